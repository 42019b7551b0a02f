"""Micro-batches from lengths only: which groups share a row, which rows share a micro-batch.

A group is the unit that is never split: a prompt with its k sequences (a pair: chosen and rejected, k = 2; a
KTO example: k = 1). ONE planner, :func:`plan_groups`, serves every objective; it reads only what each group
costs (packed positions; the padded layout's row length and row count), so the trainer plans an epoch from the
store's index without reading tokens. :func:`plan_micro_batches` is the pair store's entry point.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

__all__ = [
    "MicroBatch",
    "balanced_rows",
    "computed_tokens",
    "fit_runs",
    "group_rows",
    "pair_lengths",
    "plan_groups",
    "plan_micro_batches",
    "plan_stats",
    "round_up",
]

# A planned micro-batch: a list of rows, each row a list of group indices. In the padded layout each "row" holds
# exactly one group (which becomes one padded batch row per sequence: a pair's chosen, then its rejected).
MicroBatch = list[list[int]]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def computed_tokens(row_sizes: Sequence[int], multiple: int) -> int:
    """Positions a micro-batch computes: its rows, each as long as the longest rounded up to ``multiple`` (a batch
    is one rectangle). Packed: ``row_sizes`` are the rows' positions; padded: one entry per sequence, each the
    longest sequence's length. The one cost model every objective reports (``filling`` = real / computed)."""
    if not len(row_sizes):
        return 0
    return len(row_sizes) * round_up(int(max(row_sizes)), multiple)


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


def fit_runs(group: np.ndarray, prompt: int, sizes: np.ndarray, capacity: int) -> list[np.ndarray]:
    """A prompt group's members (``group``: indices into ``sizes``, completion lengths [n, passes]) cut into
    consecutive runs whose prompt plus completions fit ``capacity`` in every pass, so laying a repeated prompt out
    once never makes a row longer than its members alone would need (a run holds at least one member)."""
    runs, start, load = [], 0, np.zeros(sizes.shape[1], dtype=np.int64)
    for k, i in enumerate(group):
        if k > start and (prompt + load + sizes[i] > capacity).any():
            runs.append(group[start:k])
            start, load = k, np.zeros_like(load)
        load = load + sizes[i]
    runs.append(group[start:])
    return runs


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


def plan_groups(
    totals,
    *,
    token_budget: int,
    packing: bool = True,
    row_budget: int | None = None,
    longest_sequence=None,
    sequences_per_group: int | Sequence[int] | np.ndarray = 1,
    pad_to_multiple_of: int | None = None,
    window: int = 1024,
    seed: int | Sequence[int] | np.random.Generator | None = 0,
    min_filling: float = 0.95,
) -> list[MicroBatch]:
    """Group indices into micro-batches of rows, from what each group costs.

    ``totals`` [G]: positions a group takes in a packed row (a pair: 2 prompt + chosen + rejected).
    Packed (default): groups go into rows of at most ``row_budget`` tokens (default ``token_budget``) inside
    windows of ``window`` groups of a shuffled order: as few rows as first-fit decreasing needs, with the
    tokens spread evenly over them (a step of 2,800 tokens under a 2,048 budget makes two rows of about
    1,400, not 2,048 + 750). Rows are then grouped, longest first, at most ``token_budget // row_budget``
    per micro-batch, a row joining only while the micro-batch keeps ``min_filling`` of its positions real
    (rows of a micro-batch are padded to the longest). With ``pad_to_multiple_of`` the row capacity is
    rounded down to a multiple, so a padded row still fits the budget.

    Padded (``packing=False``): each group becomes ``sequences_per_group`` rows (one count, or one per group) of its
    longest sequence
    (``longest_sequence`` [G], default ``totals``); groups of similar length share a micro-batch while
    ``sequences_per_group * groups * padded_length <= token_budget``.

    A group that alone exceeds the budget is never dropped: it gets its own row and its own micro-batch
    (over the budget; truncate at tokenisation time if memory is tight). Deterministic for a given seed;
    ``seed=None`` keeps the input order (still FFD inside each window).
    """
    totals = np.asarray(totals, dtype=np.int64)
    if totals.ndim != 1:
        raise ValueError(f"totals must be one cost per group, got shape {totals.shape}")
    if (totals < 1).any():
        raise ValueError("every sequence (prompt + completion) needs at least one token")
    m = _check_multiple(pad_to_multiple_of)
    token_budget = int(token_budget)
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    rng = _rng(seed)
    n = totals.shape[0]
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
        for w in range(0, n, window):
            idx = order[w : w + window]
            rows = [[int(idx[i]) for i in b] for b in balanced_rows(totals[idx], capacity)]
            big = [r for r in rows if int(totals[r].sum()) > capacity]
            normal = [r for r in rows if int(totals[r].sum()) <= capacity]
            batches.extend(group_rows(normal, totals, rows_per_batch, min_filling))
            batches.extend([r] for r in big)
    else:
        seq_max = totals if longest_sequence is None else np.asarray(longest_sequence, dtype=np.int64)
        padded = -(-seq_max // m) * m
        k = np.broadcast_to(np.asarray(sequences_per_group, dtype=np.int64), (n,))  # padded rows per group
        for w in range(0, n, window):
            idx = order[w : w + window]
            idx = idx[np.argsort(-padded[idx], kind="stable")]
            cur: list[int] = []
            cur_len = cur_rows = 0
            for i in idx:
                i = int(i)
                new_len = max(cur_len, int(padded[i]))
                if cur and (cur_rows + int(k[i])) * new_len > token_budget:
                    batches.append([[p] for p in cur])
                    cur, new_len, cur_rows = [], int(padded[i]), 0
                cur.append(i)
                cur_len = new_len
                cur_rows += int(k[i])
            if cur:
                batches.append([[p] for p in cur])

    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def plan_micro_batches(
    lengths,
    *,
    token_budget: int,
    packing: bool = True,
    row_budget: int | None = None,
    pad_to_multiple_of: int | None = None,
    window: int = 1024,
    seed: int | Sequence[int] | np.random.Generator | None = 0,
    min_filling: float = 0.95,
    share_prompts: bool = False,
    segments: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[MicroBatch]:
    """Pairs into micro-batches (``lengths``: [P, 3] prompt/chosen/rejected): :func:`plan_groups` with a pair's
    cost ``2 prompt + chosen + rejected`` packed (``prompt + chosen + rejected`` with ``share_prompts``: the
    positions actually computed), and two padded rows of ``prompt + max(chosen, rejected)``.

    ``segments`` (completions cut into segments, each computed as its own sequence ``prompt + segment``): per pair
    the segments beyond each completion's first, summed ([P]), and its longest segment ([P]); each extra segment
    costs one more prompt unshared and one more padded row, and a padded row is ``prompt + longest segment``."""
    arr = _as_lengths(lengths)
    extra, longest = (0, np.maximum(arr[:, 1], arr[:, 2])) if segments is None else \
        (np.asarray(segments[0], dtype=np.int64), np.asarray(segments[1], dtype=np.int64))
    prompts = (1 if share_prompts and packing else 2 + extra) * arr[:, 0]
    return plan_groups(prompts + arr[:, 1] + arr[:, 2], token_budget=token_budget, packing=packing,
                       row_budget=row_budget, longest_sequence=arr[:, 0] + longest,
                       sequences_per_group=2 + extra, pad_to_multiple_of=pad_to_multiple_of, window=window, seed=seed,
                       min_filling=min_filling)


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
