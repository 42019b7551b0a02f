"""Pairs -> micro-batches: packed rows (the default) and the padded fallback, as tensors.

A pair (prompt, chosen, rejected) is the unit. Its two sequences, ``prompt + chosen`` and
``prompt + rejected``, always land in the same micro-batch and, when packing, in the same row, so a step
never sees half a pair. Planning works from lengths only (the store's index), so the trainer can plan an
epoch without reading tokens; :func:`collate` then materialises one planned micro-batch.

Packed layout of one row: the sequences one after the other, position ids restarting at 0 for every
sequence (transformers derives the block-diagonal attention from them, see ``prefpack.forward``), then
row padding. The padding is its own block (positions restart at 0 again), sits after every real token
(so causal attention never lets a real token see it), has ``loss_mask`` False, ``target_ids`` = -100 and
``seq_index`` = -1: it cannot reach the loss, whatever ``pad_to_multiple_of`` is.

Sequence numbering inside a micro-batch: the chosen sequence of the batch's p-th pair is ``2p`` and the
rejected one ``2p + 1`` (pairs in row order), in both layouts.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "MicroBatch",
    "Pair",
    "collate",
    "collate_packed",
    "collate_padded",
    "pair_lengths",
    "plan_micro_batches",
    "plan_stats",
]

IGNORE_INDEX = -100

# A planned micro-batch: a list of rows, each row a list of pair indices. In the padded layout each
# "row" holds exactly one pair (which becomes two padded batch rows: chosen, rejected).
MicroBatch = list[list[int]]


class Pair(NamedTuple):
    """Token ids of one preference pair (1-D integer arrays)."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


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
    completion_tokens: torch.Tensor  # [S] int64, S = 2 * num_pairs: loss positions per sequence
    pair_indices: torch.Tensor  # [P] int64: index of each pair in the source, in sequence order
    packed: bool

    @property
    def num_pairs(self) -> int:
        return int(self.pair_indices.shape[0])

    @property
    def num_sequences(self) -> int:
        return 2 * self.num_pairs

    @property
    def real_tokens(self) -> int:
        return int(self.token_mask.sum())

    @property
    def computed_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def filling(self) -> float:
        """Real tokens / computed positions: 1.0 means no padding at all."""
        return self.real_tokens / max(self.computed_tokens, 1)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
        return Batch(**moved)


# --------------------------------------------------------------------------------------------------------
# Planning from lengths only.


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_multiple(pad_to_multiple_of: int | None) -> int:
    m = 1 if pad_to_multiple_of is None else int(pad_to_multiple_of)
    if m < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    return m


def pair_lengths(pairs: Sequence) -> np.ndarray:
    """[P, 3] int64 array of (prompt, chosen, rejected) lengths, the input of :func:`plan_micro_batches`."""
    out = np.zeros((len(pairs), 3), dtype=np.int64)
    for i, (p, c, r) in enumerate(pairs):
        out[i] = (len(p), len(c), len(r))
    return out


def _as_lengths(lengths) -> np.ndarray:
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"lengths must be [P, 3] (prompt, chosen, rejected), got shape {arr.shape}")
    if (arr < 0).any():
        raise ValueError("negative length")
    if ((arr[:, 0] + np.minimum(arr[:, 1], arr[:, 2])) < 1).any():
        raise ValueError("every sequence (prompt + completion) needs at least one token")
    return arr


def _rng(seed) -> np.random.Generator | None:
    if seed is None or isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed)


def first_fit_decreasing(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of local indices; an item larger than ``capacity`` gets a bin of its own (never dropped)."""
    order = np.argsort(-sizes, kind="stable")
    remaining = np.empty(len(sizes), dtype=np.int64)
    bins: list[list[int]] = []
    normal: list[int] = []  # bin ids that can still take items, aligned with remaining[:len(normal)]
    for i in order:
        s = int(sizes[i])
        if s > capacity:
            bins.append([int(i)])
            continue
        k = len(normal)
        fits = remaining[:k] >= s
        j = int(np.argmax(fits)) if k else 0
        if k and fits[j]:
            bins[normal[j]].append(int(i))
            remaining[j] -= s
        else:
            normal.append(len(bins))
            bins.append([int(i)])
            remaining[k] = capacity - s
    return bins


def balanced_rows(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """As many bins as first-fit decreasing needs, but with their loads evened out.

    FFD fills its first bins to the brim and leaves the remainder in the last one, so rows of one
    micro-batch differ in length and the short ones are padded to the longest. With the same number of
    bins, longest-processing-time (each item, largest first, into the least loaded bin) spreads the
    tokens evenly: less padding, and shorter longest rows (attention costs L^2 per row where the kernel
    does not skip the blocks between sequences, e.g. sdpa on CPU). When LPT cannot place an item under
    ``capacity`` the FFD bins are kept. Items larger than ``capacity`` keep a bin of their own.
    """
    bins = first_fit_decreasing(sizes, capacity)
    normal = [b for b in bins if int(sizes[b].sum()) <= capacity]
    big = [b for b in bins if int(sizes[b].sum()) > capacity]
    if len(normal) < 2:
        return bins
    items = sorted((i for b in normal for i in b), key=lambda i: (-int(sizes[i]), i))
    heap = [(0, j) for j in range(len(normal))]
    spread: list[list[int]] = [[] for _ in normal]
    for i in items:
        load, j = heapq.heappop(heap)
        if load + int(sizes[i]) > capacity:
            return bins
        spread[j].append(i)
        heapq.heappush(heap, (load + int(sizes[i]), j))
    return spread + big


def group_rows(rows: list[list[int]], totals: np.ndarray, rows_per_batch: int,
                min_filling: float) -> list[MicroBatch]:
    """Rows (longest first) into micro-batches of at most ``rows_per_batch`` rows.

    A row joins the current micro-batch only while the micro-batch stays at least ``min_filling`` real
    tokens (its rows are padded to the longest); otherwise it starts the next one, so padding never
    exceeds ``1 - min_filling`` of a micro-batch (before ``pad_to_multiple_of`` rounding).
    """
    out: list[MicroBatch] = []
    cur: MicroBatch = []
    real = longest = 0
    for row in sorted(rows, key=lambda r: -int(totals[r].sum())):
        t = int(totals[row].sum())
        if cur and (len(cur) >= rows_per_batch or real + t < min_filling * (len(cur) + 1) * longest):
            out.append(cur)
            cur, real = [], 0
        if not cur:
            longest = t
        cur.append(row)
        real += t
    if cur:
        out.append(cur)
    return out


def plan_micro_batches(
    lengths,
    *,
    token_budget: int,
    packing: bool = True,
    row_budget: int | None = None,
    pad_to_multiple_of: int | None = None,
    window: int = 1024,
    seed: int | np.random.Generator | None = 0,
    min_filling: float = 0.95,
) -> list[MicroBatch]:
    """Group pairs into micro-batches from their lengths only (``lengths``: [P, 3] prompt/chosen/rejected).

    Packed (default): pairs go into rows of at most ``row_budget`` tokens (default ``token_budget``) inside
    windows of ``window`` pairs of a shuffled order: as few rows as first-fit decreasing needs, with the
    tokens spread evenly over them (a step of 2,800 tokens under a 2,048 budget makes two rows of about
    1,400, not 2,048 + 750). Rows are then grouped, longest first, at most ``token_budget // row_budget``
    per micro-batch, a row joining only while the micro-batch keeps ``min_filling`` of its positions real
    (rows of a micro-batch are padded to the longest). With ``pad_to_multiple_of`` the row capacity is
    rounded down to a multiple, so a padded row still fits the budget.

    Padded (``packing=False``): pairs of similar length share a micro-batch while
    ``2 * pairs * padded_length <= token_budget``.

    A pair that alone exceeds the budget is never dropped: it gets its own row and its own micro-batch
    (over the budget; truncate at tokenisation time if memory is tight). Deterministic for a given seed;
    ``seed=None`` keeps the input order (still FFD inside each window).
    """
    arr = _as_lengths(lengths)
    m = _check_multiple(pad_to_multiple_of)
    token_budget = int(token_budget)
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    rng = _rng(seed)
    n = arr.shape[0]
    if window < 1:
        raise ValueError("window must be >= 1")
    order = rng.permutation(n) if rng is not None else np.arange(n)

    batches: list[MicroBatch] = []
    if packing:
        row_budget = token_budget if row_budget is None else int(row_budget)
        if row_budget < 1:
            raise ValueError("row_budget must be >= 1")
        capacity = max((row_budget // m) * m, 1)
        rows_per_batch = max(token_budget // row_budget, 1)
        totals = 2 * arr[:, 0] + arr[:, 1] + arr[:, 2]
        for w in range(0, n, window):
            idx = order[w : w + window]
            rows = [[int(idx[i]) for i in b] for b in balanced_rows(totals[idx], capacity)]
            big = [r for r in rows if int(totals[r].sum()) > capacity]
            normal = [r for r in rows if int(totals[r].sum()) <= capacity]
            batches.extend(group_rows(normal, totals, rows_per_batch, min_filling))
            batches.extend([r] for r in big)
    else:
        seq_max = arr[:, 0] + np.maximum(arr[:, 1], arr[:, 2])
        padded = -(-seq_max // m) * m
        for w in range(0, n, window):
            idx = order[w : w + window]
            idx = idx[np.argsort(-padded[idx], kind="stable")]
            cur: list[int] = []
            cur_len = 0
            for i in idx:
                i = int(i)
                new_len = max(cur_len, int(padded[i]))
                if cur and 2 * (len(cur) + 1) * new_len > token_budget:
                    batches.append([[p] for p in cur])
                    cur, new_len = [], int(padded[i])
                cur.append(i)
                cur_len = new_len
            if cur:
                batches.append([[p] for p in cur])

    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def plan_stats(
    lengths, plan: list[MicroBatch], *, packing: bool = True, pad_to_multiple_of: int | None = None
) -> dict:
    """Tokens a plan computes, from lengths only: ``filling`` = real tokens / computed positions."""
    arr = _as_lengths(lengths)
    m = _check_multiple(pad_to_multiple_of)
    real = computed = n_rows = 0
    for mb in plan:
        pairs = [p for row in mb for p in row]
        real += int((2 * arr[pairs, 0] + arr[pairs, 1] + arr[pairs, 2]).sum())
        if packing:
            longest = max(int((2 * arr[row, 0] + arr[row, 1] + arr[row, 2]).sum()) for row in mb)
            computed += len(mb) * round_up(longest, m)
            n_rows += len(mb)
        else:
            longest = int((arr[pairs, 0] + np.maximum(arr[pairs, 1], arr[pairs, 2])).max())
            computed += 2 * len(pairs) * round_up(longest, m)
            n_rows += 2 * len(pairs)
    return {
        "micro_batches": len(plan),
        "rows": n_rows,
        "pairs": sum(len(row) for mb in plan for row in mb),
        "real_tokens": real,
        "computed_tokens": computed,
        "filling": real / max(computed, 1),
    }


# --------------------------------------------------------------------------------------------------------
# Materialising one micro-batch.


def _ids(x) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def sequence_arrays(prompt: np.ndarray, completion: np.ndarray):
    """Tokens, positions and targets of ``prompt + completion``; targets only where they are completion."""
    tokens = np.concatenate([prompt, completion])
    n = tokens.shape[0]
    if n < 1:
        raise ValueError("a sequence (prompt + completion) needs at least one token")
    targets = np.full(n, IGNORE_INDEX, dtype=np.int64)
    # position i predicts token i + 1; completion tokens are i + 1 >= len(prompt). With an empty prompt the
    # first completion token has no predecessor and cannot be scored.
    start = max(prompt.shape[0] - 1, 0)
    targets[start : n - 1] = tokens[start + 1 :]
    return tokens, np.arange(n, dtype=np.int64), targets


def _get_pair(pairs, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p, c, r = pairs[i]
    return _ids(p), _ids(c), _ids(r)


def _finish(rows_tokens, rows_pos, rows_tgt, rows_seq, pair_indices, *, packed, pad_id, multiple) -> Batch:
    longest = max(len(t) for t in rows_tokens)
    length = round_up(longest, multiple)
    b = len(rows_tokens)
    input_ids = np.full((b, length), pad_id, dtype=np.int64)
    target_ids = np.full((b, length), IGNORE_INDEX, dtype=np.int64)
    seq_index = np.full((b, length), -1, dtype=np.int64)
    position_ids = np.zeros((b, length), dtype=np.int64)
    token_mask = np.zeros((b, length), dtype=bool)
    for r in range(b):
        k = len(rows_tokens[r])
        input_ids[r, :k] = rows_tokens[r]
        target_ids[r, :k] = rows_tgt[r]
        seq_index[r, :k] = rows_seq[r]
        position_ids[r, :k] = rows_pos[r]
        token_mask[r, :k] = True
        if packed:
            # Row padding is a block of its own: positions restart at 0, so it never extends a sequence.
            position_ids[r, k:] = np.arange(length - k)
    loss_mask = target_ids != IGNORE_INDEX
    n_seq = 2 * len(pair_indices)
    completion_tokens = np.bincount(seq_index[loss_mask], minlength=n_seq).astype(np.int64)
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        target_ids=torch.from_numpy(target_ids),
        loss_mask=torch.from_numpy(loss_mask),
        seq_index=torch.from_numpy(seq_index),
        token_mask=torch.from_numpy(token_mask),
        attention_mask=None if packed else torch.from_numpy(token_mask.astype(np.int64)),
        completion_tokens=torch.from_numpy(completion_tokens),
        pair_indices=torch.as_tensor(pair_indices, dtype=torch.int64),
        packed=packed,
    )


def collate_packed(
    pairs, rows: MicroBatch, *, pad_id: int = 0, pad_to_multiple_of: int | None = None
) -> Batch:
    """Packed micro-batch: each row holds whole pairs back to back, rows padded at the end to the longest.

    ``pairs[i]`` must give ``(prompt, chosen, rejected)`` id arrays; ``rows`` lists pair indices per row.
    """
    m = _check_multiple(pad_to_multiple_of)
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("a packed micro-batch needs at least one row and no empty row")
    toks, poss, tgts, seqs, pair_indices = [], [], [], [], []
    for row in rows:
        rt, rp, rg, rs = [], [], [], []
        for i in row:
            prompt, chosen, rejected = _get_pair(pairs, i)
            local = len(pair_indices)
            pair_indices.append(int(i))
            for half, completion in enumerate((chosen, rejected)):
                t, p, g = sequence_arrays(prompt, completion)
                rt.append(t)
                rp.append(p)
                rg.append(g)
                rs.append(np.full(t.shape[0], 2 * local + half, dtype=np.int64))
        toks.append(np.concatenate(rt))
        poss.append(np.concatenate(rp))
        tgts.append(np.concatenate(rg))
        seqs.append(np.concatenate(rs))
    return _finish(toks, poss, tgts, seqs, pair_indices, packed=True, pad_id=pad_id, multiple=m)


def collate_padded(pairs, pair_ids, *, pad_id: int = 0, pad_to_multiple_of: int | None = None) -> Batch:
    """Padded fallback: one sequence per batch row (chosen of pair p in row 2p, rejected in 2p + 1),
    right-padded to the longest (rounded up to ``pad_to_multiple_of``), with an attention mask.

    ``pair_ids`` is a flat list of pair indices or a planned micro-batch (list of rows).
    """
    m = _check_multiple(pad_to_multiple_of)
    flat = [int(i) for x in pair_ids for i in (x if isinstance(x, (list, tuple, np.ndarray)) else [x])]
    if not flat:
        raise ValueError("a padded micro-batch needs at least one pair")
    toks, poss, tgts, seqs = [], [], [], []
    for local, i in enumerate(flat):
        prompt, chosen, rejected = _get_pair(pairs, i)
        for half, completion in enumerate((chosen, rejected)):
            t, p, g = sequence_arrays(prompt, completion)
            toks.append(t)
            poss.append(p)
            tgts.append(g)
            seqs.append(np.full(t.shape[0], 2 * local + half, dtype=np.int64))
    return _finish(toks, poss, tgts, seqs, flat, packed=False, pad_id=pad_id, multiple=m)


def collate(
    pairs,
    micro_batch: MicroBatch,
    *,
    packing: bool = True,
    pad_id: int = 0,
    pad_to_multiple_of: int | None = None,
) -> Batch:
    """Materialise one planned micro-batch (see :func:`plan_micro_batches`) in the chosen layout."""
    if packing:
        return collate_packed(pairs, micro_batch, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of)
    return collate_padded(pairs, micro_batch, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of)
