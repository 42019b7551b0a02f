"""The tensors of one planned micro-batch: packed rows (the default) or the padded fallback.

ONE collator, :func:`collate_groups`, lays out groups (a prompt with its k completions: a pair's chosen and
rejected, a KTO example, a KTO example's KL sequence) as sequences ``prompt + completion``; :func:`collate` is the
pair store's entry point.

Packed layout of one row: the sequences one after the other, position ids restarting at 0 for every
sequence (transformers derives the block-diagonal attention from them, see ``prefpack.model.forward``), then
row padding. The padding is its own block (positions restart at 0 again), sits after every real token
(so causal attention never lets a real token see it), has ``loss_mask`` False, ``target_ids`` = -100 and
``seq_index`` = -1: it cannot reach the loss, whatever ``pad_to_multiple_of`` is. Padded layout: one
sequence per row, right-padded, with an attention mask.

Sequence numbering inside a micro-batch follows the groups' order (not the rows'): group g's j-th completion is
sequence ``offset(g) + j``. For pairs, the chosen sequence of the batch's p-th pair is ``2p`` and the rejected
one ``2p + 1`` (pairs in row order), in both layouts.

Unscored completion tokens (issue 23: tool results, role headers): a completion may carry ``scored``, one bool per
token (``prefpack.data.spans.ScoredTokens``, read duck-typed since batching sits below data, and read before any
conversion to a plain array drops it). The position predicting an unscored token gets no target in every layout, so
it never reaches the head or the loss, and ``completion_tokens`` counts scored tokens only (what length-normalised
losses, WPO means and LD-DPO's lengths and tails read). The token itself stays in the input: later tokens attend to
it.

Completions cut into segments (``prefpack.data.spans``: a chat template that rewrites earlier assistant turns): a
completion may carry ``segments``, the offsets where its later segments start (duck-typed too). Each segment is laid
out as a piece of its own, ``prompt + segment``, with the completion's sequence index, so the per-sequence sums and
counts add the pieces up with nothing changed downstream; a completion's pieces are consecutive, in order, so its
scored tokens stay contiguous and in token order (LD-DPO's tails, per-token matrices). Packed: each piece its own
block with its own copy of the prompt; padded: one row per piece; prompt-shared: one more sibling after the shared
prompt, positions continuing from the prompt's length. The score mask is split along the segments. A prompt laid out
again for a segment counts in ``real_tokens`` (the sequence's tokens: each piece is prompt + segment).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from prefpack.batching.plan import MicroBatch, _check_multiple, round_up

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "collate",
    "collate_groups",
    "collate_packed",
    "collate_padded",
    "sequence_arrays",
]

IGNORE_INDEX = -100


@dataclass
class Batch:
    """Tensors of one micro-batch; every [B, L] field is aligned position by position.

    ``target_ids[b, i]`` is the token that position ``i`` predicts (the next token of the same sequence),
    -100 where ``loss_mask`` is False. ``loss_mask`` is True where the target is a completion token.
    ``seq_index`` is the sequence a position belongs to (-1 on padding). ``token_mask`` marks real tokens.
    ``attention_mask`` is None for packed batches (the model must derive the mask from ``position_ids``)
    and the [B, L] padding mask for padded ones.
    """

    input_ids: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64
    target_ids: torch.Tensor  # [B, L] int64
    loss_mask: torch.Tensor  # [B, L] bool
    seq_index: torch.Tensor  # [B, L] int64
    token_mask: torch.Tensor  # [B, L] bool
    attention_mask: torch.Tensor | None  # [B, L] int64 (padded) or None (packed)
    completion_tokens: torch.Tensor  # [S] int64: loss positions per sequence
    group_ids: torch.Tensor  # [G] int64: each group's id in its source (a pair's index in the store), group order
    packed: bool
    # Prompt-shared rows only (None otherwise): the scored positions as flat indices into [B * L], their targets
    # and sequences, in sequence order and token order within a sequence. A group's later completions are
    # predicted first from its prompt's last position, which they share, so a position can be scored for several
    # sequences; ``loss_mask`` then marks only the positions inside each completion's own tokens.
    score_positions: torch.Tensor | None = None  # [N] int64
    score_targets: torch.Tensor | None = None  # [N] int64
    score_sequences: torch.Tensor | None = None  # [N] int64
    shared_tokens: int = 0  # tokens laid out once for several sequences: a shared prompt, a repeated completion
    # Pairs drawn from a group's completions (ranked stores): [2, P] sequence indices, chosen then rejected, whose
    # LD-DPO tails the forward returns per pair. None: sequences 2p and 2p + 1 are pair p.
    tail_pairs: torch.Tensor | None = None
    # Sequence keys (set by the objective's collate): what each sequence IS in its store, the address a precomputed
    # reference reads and precompute-ref writes. Pair p's chosen / rejected -> 2p / 2p + 1 (also a KTO example read
    # from pairs, and a pair store's prompt-group completion); a ranked store's completion -> its row; KTO example
    # i -> i and its KL sequence -> N + i (N examples). ``tail_keys`` [2, P]: the keys of the drawn pairs' sides
    # whose LD-DPO tails the batch needs (with ``tail_pairs``; None where tails are per sequence or not needed).
    sequence_keys: torch.Tensor | None = None  # [S] int64
    tail_keys: torch.Tensor | None = None  # [2, P] int64
    key_store: str | None = None  # the store the keys address (its path)
    # Vision-language rows (issue 27, docs/images.md; None on text batches). Each image of the micro-batch's groups is
    # preprocessed and encoded ONCE, however many of the batch's sequences hold its placeholder tokens (a pair's prompt
    # is laid out twice without prompt sharing): the forward runs the vision tower over ``pixel_values`` once, then
    # writes feature row ``image_feature_rows[k]`` at the flat [B * L] position ``image_positions[k]``.
    pixel_values: torch.Tensor | None = None  # the image processor's output for the batch's images, concatenated
    image_grid_thw: torch.Tensor | None = None  # [I, 3] int64: each image's patch grid (Qwen2-VL family), else None
    image_positions: torch.Tensor | None = None  # [K] int64: flat [B * L] indices of every image-token position
    image_feature_rows: torch.Tensor | None = None  # [K] int64: the row of the concatenated image features it takes
    rope_positions: torch.Tensor | None = None  # [3, B, L] int64: Qwen2-VL's temporal / height / width positions
    # The image features computed for ``pixel_values`` by a FROZEN vision tower and projector, by the weights' key
    # (``prefpack.model.vision.frozen_key``): a copied reference with the policy's frozen vision weights (or the
    # adapter-off reference) reads the policy's features instead of encoding the images again. One dict is shared by
    # the batches of one preprocessing (KTO's main and KL batches) and survives ``to(device)``.
    vision_cache: dict | None = None
    # [N] int64: the flat [B * L] indices of the real tokens (``token_mask``'s), set by :meth:`to` while the mask is
    # still on the host, so that a forward flattens the rows by index_select, not by a boolean mask (whose result
    # size the host would have to read back from the device: a sync per forward)
    real_index: torch.Tensor | None = None
    # A per-token term the forward sums per sequence (``prefpack.model.sums.TokenTerm``: group policy gradients'
    # clipped surrogate and KL); set by the objective, moved with the batch
    token_term: Any = None
    # Some completion is computed as several sequences (its segments): in a prompt-shared row its later segments'
    # first tokens are scored at the prompt's last position, before its earlier segments' tokens
    segmented: bool = False

    @property
    def pair_indices(self) -> torch.Tensor:
        """The group ids of a pair batch (one per pair)."""
        return self.group_ids

    @property
    def num_pairs(self) -> int:
        return int(self.group_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.completion_tokens.shape[0])

    @property
    def real_tokens(self) -> int:
        """Tokens of the sequences, prompt + completion for every one (a shared prompt counts for each)."""
        return int(self.token_mask.sum()) + self.shared_tokens

    @property
    def positions(self) -> int:
        """Real positions computed: ``real_tokens`` less the prompt tokens that sharing laid out once."""
        return int(self.token_mask.sum())

    @property
    def computed_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def scored_positions(self) -> int:
        """Positions the head computes: each sequence's scored completion tokens (unscored ones have no target)."""
        return int(self.completion_tokens.sum())

    @property
    def filling(self) -> float:
        """Real positions / computed positions: 1.0 means no padding at all."""
        return self.positions / max(self.computed_tokens, 1)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        moved = {}
        if self.real_index is None and self.token_mask.device.type == "cpu":
            self.real_index = self.token_mask.reshape(-1).nonzero().squeeze(1)
        for f in fields(self):
            v = getattr(self, f.name)
            movable = isinstance(v, torch.Tensor) or f.name == "token_term" and v is not None
            moved[f.name] = v.to(device, non_blocking=non_blocking) if movable else v
        return Batch(**moved)


# --------------------------------------------------------------------------------------------------------

def _ids(x) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def _scored(completion) -> np.ndarray | None:
    """The completion's score mask (True = scored), or None when every token is scored."""
    mask = getattr(completion, "scored", None)
    if mask is None:
        return None
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != np.shape(completion):
        raise ValueError(f"a score mask of shape {mask.shape} for a completion of shape {np.shape(completion)}")
    return None if mask.all() else mask


def _pieces(completion) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """A completion as the pieces it is computed as: its segments (one piece without ``segments``), each with its
    part of the score mask (None: all scored). Read before ``_ids`` drops the attributes."""
    mask = _scored(completion)
    cuts = getattr(completion, "segments", None)
    ids = _ids(completion)
    if cuts is None or not len(cuts):
        return [(ids, mask)]
    cuts = np.asarray(cuts, dtype=np.int64)
    if cuts[0] <= 0 or cuts[-1] >= ids.shape[0] or (np.diff(cuts) <= 0).any():
        raise ValueError(f"segment starts {cuts.tolist()} must be sorted and strictly inside {ids.shape[0]} tokens")
    bounds = [0, *cuts.tolist(), ids.shape[0]]
    return [(ids[a:b], None if mask is None else mask[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def sequence_arrays(prompt: np.ndarray, completion: np.ndarray, scored: np.ndarray | None = None):
    """Tokens, positions and targets of ``prompt + completion``; targets only where they are completion tokens that
    ``scored`` (one bool per completion token; None: all) marks."""
    tokens = np.concatenate([prompt, completion])
    n = tokens.shape[0]
    if n < 1:
        raise ValueError("a sequence (prompt + completion) needs at least one token")
    targets = np.full(n, IGNORE_INDEX, dtype=np.int64)
    # position i predicts token i + 1; completion tokens are i + 1 >= len(prompt). With an empty prompt the
    # first completion token has no predecessor and cannot be scored.
    start = max(prompt.shape[0] - 1, 0)
    targets[start : n - 1] = tokens[start + 1 :]
    if scored is not None:  # completion token k is predicted at position len(prompt) + k - 1
        at = prompt.shape[0] - 1 + np.flatnonzero(~scored)
        targets[at[at >= 0]] = IGNORE_INDEX
    return tokens, np.arange(n, dtype=np.int64), targets


def collate_groups(
    groups: Sequence[tuple[np.ndarray, Sequence[np.ndarray]]],
    rows: MicroBatch | None,
    *,
    ids: Sequence[int],
    pad_id: int = 0,
    pad_to_multiple_of: int | None = None,
    completion_mask: bool = False,
    share_prompts: bool = False,
) -> Batch | tuple[Batch, torch.Tensor]:
    """A :class:`Batch` of groups ``(prompt, (completion, ...))``: each completion is one sequence.

    ``rows`` lists, per packed row, indices into ``groups`` (a group stays in one row); ``rows=None`` gives the
    padded layout, one sequence per row in sequence order, with an attention mask. ``ids`` holds one id per group
    (``Batch.group_ids``). ``completion_mask=True`` also returns the [B, L] int64 mask that is 1 where the *input*
    token is a completion token (TRL's ``completion_mask``; ``loss_mask`` is the same shifted onto the position
    that predicts it). An unscored completion token is 0 there: TRL's losses read ``completion_mask`` as the tokens
    that count, so it marks the scored ones, as ``loss_mask`` does.

    ``share_prompts`` (packed only; ``completion_mask`` not supported): a group's prompt is laid out once, then
    each completion with position ids continuing from the prompt's length (``prompt, c1, c2, ...``); attention
    kernels read the group from the position ids (a block starting at position p > 0 attends to the first p
    tokens of the row's last block starting at 0), see ``prefpack.model.attention.packed_sdpa``.
    """
    m = _check_multiple(pad_to_multiple_of)
    if not groups:
        raise ValueError("a micro-batch needs at least one group")
    if len(ids) != len(groups):
        raise ValueError(f"{len(ids)} ids for {len(groups)} groups")
    if share_prompts:
        if rows is None or completion_mask:
            raise ValueError("prompt sharing needs the packed layout and no completion_mask")
        return _collate_shared(groups, rows, ids=ids, pad_id=pad_id, multiple=m)
    built = []  # per group: its pieces (tokens, positions, targets, prompt length, mask, the completion's number)
    sizes = []  # per group: its completions (sequences)
    for prompt, completions in groups:
        prompt = _ids(prompt)
        built.append([(*sequence_arrays(prompt, piece, mask), prompt.shape[0], mask, j)
                      for j, c in enumerate(completions) for piece, mask in _pieces(c)])
        sizes.append(len(completions))
    offsets = np.cumsum([0] + sizes)
    packed = rows is not None
    if packed:
        if not rows or any(len(row) == 0 for row in rows):
            raise ValueError("a packed micro-batch needs at least one row and no empty row")
        layout = [[(g, k) for g in row for k in range(len(built[g]))] for row in rows]
    else:
        layout = [[(g, k)] for g in range(len(built)) for k in range(len(built[g]))]
    length = round_up(max(sum(built[g][k][0].shape[0] for g, k in row) for row in layout), m)
    b = len(layout)
    input_ids, position_ids, target_ids, seq_index, token_mask = _row_arrays(b, length, pad_id)
    is_completion = np.zeros((b, length), dtype=np.int64)
    for r, row in enumerate(layout):
        at = 0
        for g, k in row:
            t, p, tgt, n_prompt, m, j = built[g][k]
            s = slice(at, at + t.shape[0])
            input_ids[r, s], position_ids[r, s], target_ids[r, s] = t, p, tgt
            seq_index[r, s] = offsets[g] + j
            token_mask[r, s] = True
            is_completion[r, at + n_prompt : at + t.shape[0]] = 1 if m is None else m
            at += t.shape[0]
        if packed:
            # Row padding is a block of its own: positions restart at 0, so it never extends a sequence.
            position_ids[r, at:] = np.arange(length - at)
    loss_mask = target_ids != IGNORE_INDEX
    completion_tokens = np.bincount(seq_index[loss_mask], minlength=int(offsets[-1])).astype(np.int64)
    batch = _batch((input_ids, position_ids, target_ids, seq_index, token_mask), completion_tokens, ids, packed,
                   segmented=sum(len(b) for b in built) > int(offsets[-1]))
    return (batch, torch.from_numpy(is_completion)) if completion_mask else batch


def _batch(arrays, completion_tokens: np.ndarray, ids: Sequence[int], packed: bool, **extra) -> Batch:
    """A :class:`Batch` from the [B, L] arrays of :func:`_row_arrays`, filled (loss mask from the targets)."""
    input_ids, position_ids, target_ids, seq_index, token_mask = arrays
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        target_ids=torch.from_numpy(target_ids),
        loss_mask=torch.from_numpy(target_ids != IGNORE_INDEX),
        seq_index=torch.from_numpy(seq_index),
        token_mask=torch.from_numpy(token_mask),
        attention_mask=None if packed else torch.from_numpy(token_mask.astype(np.int64)),
        completion_tokens=torch.from_numpy(completion_tokens),
        group_ids=torch.as_tensor([int(i) for i in ids], dtype=torch.int64),
        packed=packed,
        **extra,
    )


def _row_arrays(b: int, length: int, pad_id: int) -> tuple[np.ndarray, ...]:
    """Empty [b, length] input ids, position ids, targets, sequence index and token mask."""
    return (np.full((b, length), pad_id, dtype=np.int64), np.zeros((b, length), dtype=np.int64),
            np.full((b, length), IGNORE_INDEX, dtype=np.int64), np.full((b, length), -1, dtype=np.int64),
            np.zeros((b, length), dtype=bool))


def _collate_shared(groups, rows: MicroBatch, *, ids: Sequence[int], pad_id: int, multiple: int) -> Batch:
    """:func:`collate_groups` with each group's prompt laid out once (see there)."""
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("a packed micro-batch needs at least one row and no empty row")
    # per group: its prompt and its completions, each as its pieces (segments) with their masks, read before _ids
    # drops the attributes
    parts = [(_ids(prompt), [_pieces(c) for c in completions]) for prompt, completions in groups]
    offsets = np.cumsum([0] + [len(c) for _, c in parts])
    for g, (prompt, comps) in enumerate(parts):
        if not comps or (prompt.shape[0] + min(sum(x.shape[0] for x, _ in c) for c in comps)) < 1:
            raise ValueError(f"group {g}: a sequence (prompt + completion) needs at least one token")
    row_len = [sum(p.shape[0] + sum(x.shape[0] for c in cs for x, _ in c) for p, cs in (parts[g] for g in row))
               for row in rows]
    length = round_up(max(row_len), multiple)
    b = len(rows)
    input_ids, position_ids, target_ids, seq_index, token_mask = _row_arrays(b, length, pad_id)
    scored: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(int(offsets[-1]))]
    shared = 0
    for r, row in enumerate(rows):
        at = 0
        for g in row:
            prompt, comps = parts[g]
            n_prompt = prompt.shape[0]
            last_prompt = r * length + at + n_prompt - 1  # predicts every completion's first token
            input_ids[r, at:at + n_prompt] = prompt
            position_ids[r, at:at + n_prompt] = np.arange(n_prompt)
            token_mask[r, at:at + n_prompt] = True
            seq_index[r, at:at + n_prompt] = offsets[g]
            at += n_prompt
            shared += n_prompt * (sum(len(c) for c in comps) - 1)  # one prompt for every piece of every completion
            first = True  # the piece laid out right after the prompt
            for j, pieces in enumerate(comps):
                seq = int(offsets[g]) + j
                for c, m in pieces:  # a segment: one more sibling after the prompt
                    n = c.shape[0]
                    s = slice(at, at + n)
                    input_ids[r, s], position_ids[r, s] = c, np.arange(n_prompt, n_prompt + n)
                    token_mask[r, s], seq_index[r, s] = True, seq
                    keep = np.ones(n, dtype=bool) if m is None else m  # unscored tokens get no target
                    inner = np.arange(at, at + n - 1)[keep[1:]]  # inside the piece: its next token
                    target_ids[r, inner] = c[1:][keep[1:]]
                    if n_prompt and n and keep[0]:  # the first token, from the shared last prompt position
                        scored[seq].append((np.array([last_prompt]), c[:1]))
                        if first:
                            target_ids[r, at - 1] = c[0]
                    scored[seq].append((r * length + inner, c[1:][keep[1:]]))
                    first = False
                    at += n
        position_ids[r, at:] = np.arange(length - at)  # row padding: a block of its own
    counts = [sum(x[0].shape[0] for x in parts_) for parts_ in scored]
    flat_pos = np.concatenate([x[0] for seq in scored for x in seq] or [np.zeros(0, np.int64)]).astype(np.int64)
    flat_tgt = np.concatenate([x[1] for seq in scored for x in seq] or [np.zeros(0, np.int64)]).astype(np.int64)
    flat_seq = np.repeat(np.arange(len(scored), dtype=np.int64), counts)
    return _batch((input_ids, position_ids, target_ids, seq_index, token_mask), np.asarray(counts, dtype=np.int64),
                  ids, True, score_positions=torch.from_numpy(flat_pos), score_targets=torch.from_numpy(flat_tgt),
                  score_sequences=torch.from_numpy(flat_seq), shared_tokens=shared,
                  segmented=any(len(c) > 1 for _, cs in parts for c in cs))


def _pair_groups(pairs, pair_ids: Sequence[int]) -> list[tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]]:
    out = []
    for i in pair_ids:
        prompt, chosen, rejected = pairs[int(i)]
        out.append((prompt, (chosen, rejected)))
    return out


def collate_packed(
    pairs, rows: MicroBatch, *, pad_id: int = 0, pad_to_multiple_of: int | None = None, share_prompts: bool = False
) -> Batch:
    """Packed micro-batch: each row holds whole pairs back to back, rows padded at the end to the longest.

    ``pairs[i]`` must give ``(prompt, chosen, rejected)`` id arrays; ``rows`` lists pair indices per row.
    """
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("a packed micro-batch needs at least one row and no empty row")
    flat = [int(i) for row in rows for i in row]
    local, at = [], 0
    for row in rows:
        local.append(list(range(at, at + len(row))))
        at += len(row)
    return collate_groups(_pair_groups(pairs, flat), local, ids=flat, pad_id=pad_id,
                          pad_to_multiple_of=pad_to_multiple_of, share_prompts=share_prompts)


def collate_padded(pairs, pair_ids, *, pad_id: int = 0, pad_to_multiple_of: int | None = None) -> Batch:
    """Padded fallback: one sequence per batch row (chosen of pair p in row 2p, rejected in 2p + 1),
    right-padded to the longest (rounded up to ``pad_to_multiple_of``), with an attention mask.

    ``pair_ids`` is a flat list of pair indices or a planned micro-batch (list of rows).
    """
    flat = [int(i) for x in pair_ids for i in (x if isinstance(x, (list, tuple, np.ndarray)) else [x])]
    if not flat:
        raise ValueError("a padded micro-batch needs at least one pair")
    return collate_groups(_pair_groups(pairs, flat), None, ids=flat, pad_id=pad_id,
                          pad_to_multiple_of=pad_to_multiple_of)


def collate(
    pairs,
    micro_batch: MicroBatch,
    *,
    packing: bool = True,
    pad_id: int = 0,
    pad_to_multiple_of: int | None = None,
) -> Batch:
    """Materialise one planned micro-batch (see ``prefpack.batching.plan.plan_micro_batches``) in the chosen
    layout."""
    if packing:
        return collate_packed(pairs, micro_batch, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of)
    return collate_padded(pairs, micro_batch, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of)
