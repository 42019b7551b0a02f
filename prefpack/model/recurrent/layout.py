"""Where each sequence of a packed forward starts, as the recurrent layers need it: one :class:`Piece` per block of
position ids running n, n+1, ... (a sequence, a prompt group's prompt and first completion, a later completion of
that group, or row padding), read from the host once per forward.

A block whose position ids start at p > 0 is a later completion of the prompt group that began at the row's latest
block starting at 0 (the layout ``collate_groups(share_prompts=True)`` writes and the attention kernels read): in a
recurrent layer it must continue from the state the prompt's first p tokens leave, so it runs after a copy of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

__all__ = ["Piece", "Segments", "read_segments"]


class Piece(NamedTuple):
    """One block: ``length`` tokens of the flattened [B * L] positions, in order; ``prefix`` tokens of block
    ``root`` (its prompt) run before it and are dropped from its output (0: it starts from a zero state)."""

    length: int
    root: int
    prefix: int


@dataclass(frozen=True)
class Segments:
    """The blocks of a packed [B, L] forward, in the order of its flattened positions (they cover all of them)."""

    rows: int
    length: int
    pieces: tuple[Piece, ...]

    @property
    def shares_prompts(self) -> bool:
        return any(p.prefix for p in self.pieces)

    @cached_property
    def gathered(self) -> GatheredLayout:
        """The same blocks as one row where every later completion follows its own copy of its prompt: what a
        boundary-aware kernel (``cu_seqlens`` / ``seq_idx``) runs in one call."""
        starts, at = [], 0
        for piece in self.pieces:
            starts.append(at)
            at += piece.length
        index, own, cu, seq_idx, out = [], [], [0], [], 0
        for i, piece in enumerate(self.pieces):
            if piece.prefix:
                index.append(torch.arange(starts[piece.root], starts[piece.root] + piece.prefix))
            index.append(torch.arange(starts[i], starts[i] + piece.length))
            own.append(torch.arange(out + piece.prefix, out + piece.prefix + piece.length))
            out += piece.prefix + piece.length
            cu.append(out)
            seq_idx.append(torch.full((piece.prefix + piece.length,), i, dtype=torch.int32))
        return GatheredLayout(torch.cat(index), torch.cat(own), torch.tensor(cu, dtype=torch.int32),
                              torch.cat(seq_idx)[None], max(piece.prefix + piece.length for piece in self.pieces))


class GatheredLayout(NamedTuple):
    """``index`` [N'] into the flattened positions; ``own`` [B * L]: where each position's output sits among the N';
    ``cu_seqlens`` int32 [n + 1] and ``seq_idx`` int32 [1, N'] of the n blocks; ``longest`` block."""

    index: torch.Tensor
    own: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_idx: torch.Tensor
    longest: int


def read_segments(position_ids: torch.Tensor) -> Segments:
    """The blocks of position ids [B, L] (one host transfer). A row must start a sequence at position 0, and a later
    completion may read at most its group's prompt; anything else would run a recurrent layer from a state it
    never had, so it is refused (ValueError)."""
    pos = position_ids.reshape(-1, position_ids.shape[-1]).cpu()
    rows, length = pos.shape
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    pieces: list[Piece] = []
    for r in range(rows):
        cuts = starts[r].nonzero().squeeze(1).tolist() + [length]
        root = None
        for s, e in zip(cuts[:-1], cuts[1:], strict=True):
            first = int(pos[r, s])
            if first == 0:
                root = len(pieces)
                pieces.append(Piece(e - s, root, 0))
            elif root is None or first > pieces[root].length:
                raise ValueError(f"packed row {r} has a block starting at position {first} with no prompt of that "
                                 "length before it: recurrent layers must see every sequence from its start")
            else:
                pieces.append(Piece(e - s, root, first))
    return Segments(rows, length, tuple(pieces))
