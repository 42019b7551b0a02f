"""A prepared store read as training examples: pairs (prompt, chosen, rejected), or KTO's unpaired examples
(prompt, completion, label) from an unpaired store or from a pair store's two halves."""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from prefpack.data.spans import scored_mask, segments_in
from prefpack.data.store import Store, StoreError

__all__ = ["GROUP_POSITIONS", "RANKED_PAIR_MODES", "PairGroups", "PromptGroups", "RankedGroups", "StorePairs",
           "UnpairedView", "data_group_limit", "group_cap", "group_pairs", "row_lengths"]


class StorePairs:
    """Indexable view of a pair store as (prompt, chosen, rejected) arrays, optionally over a subset."""

    def __init__(self, store: Store, ids: np.ndarray | None = None):
        self.store = store
        self.ids = np.arange(len(store)) if ids is None else np.asarray(ids, dtype=np.int64)
        idx = store.index
        self._lengths = np.stack([np.asarray(idx[self.ids, c]) for c in (1, 2, 3)], axis=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        p = self.store.pair(int(self.ids[i]))
        return p.prompt, p.chosen, p.rejected

    def lengths(self) -> np.ndarray:
        return self._lengths

    @functools.cached_property
    def _segments(self) -> tuple[np.ndarray, np.ndarray]:
        extra, longest = self.store.segment_lengths()  # chosen and rejected interleaved
        return extra.reshape(-1, 2)[self.ids].sum(axis=1), longest.reshape(-1, 2)[self.ids].max(axis=1, initial=0)

    def segment_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Per pair: the segments its two completions have beyond their first ([P] summed: each one more sequence,
        unshared with another copy of the prompt) and its longest segment ([P]: its longest completion without
        segments); ``prefpack.data.spans``."""
        return self._segments


class UnpairedView:
    """A store as KTO examples: ``view[i] = (prompt, completion, label)``, with lengths, labels and groups.

    Unpaired store: example i is row i. Pair store (``paired_as_kto``): example 2p is the chosen half of
    pair p (desirable), 2p + 1 the rejected half (undesirable). ``groups`` numbers the distinct prompts:
    examples with the same prompt tokens (the two halves of a pair, or several completions of one prompt)
    share a group, and the KL pairing never pairs an example with its own group when another group exists
    (prompt + a completion of the same prompt is a real example, not a mismatched one).
    """

    def __init__(self, store: Store, *, paired_as_kto: bool = False):
        self.store = store
        if store.kind == "unpaired":
            self.paired = False
            self.prompt_len = store.column("prompt_len").astype(np.int64)
            self.completion_len = store.column("completion_len").astype(np.int64)
            self.labels = store.column("label").astype(bool)
            prompts = np.arange(len(store))
            self.extra_segments = store.segment_lengths()[0]
        elif store.kind == "pairs":
            if not paired_as_kto:
                raise StoreError(f"store {str(store.path)!r} holds pairs; set data.paired_as_kto=true to train KTO "
                                 "on it (chosen = desirable, rejected = undesirable)")
            self.paired = True
            self.prompt_len = np.repeat(store.column("prompt_len"), 2).astype(np.int64)
            self.completion_len = np.stack([store.column("chosen_len"), store.column("rejected_len")],
                                           axis=1).reshape(-1).astype(np.int64)
            self.labels = np.tile(np.array([True, False]), len(store))
            prompts = np.repeat(np.arange(len(store)), 2)
            self.extra_segments = store.segment_lengths()[0]  # chosen and rejected interleaved, as the examples
        else:
            raise StoreError(f"store {str(store.path)!r} has unknown kind {store.kind!r}")
        self.groups = _prompt_groups(store)[prompts]

    @property
    def source(self) -> str:
        return "paired_as_kto" if self.paired else "unpaired"

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, bool]:
        i = int(i)
        if self.paired:
            p = self.store.pair(i // 2)
            return p.prompt, (p.rejected if i % 2 else p.chosen), not bool(i % 2)
        u = self.store.unpaired(i)
        return u.prompt, u.completion, bool(u.label)

    def prompt(self, i: int) -> np.ndarray:
        return self[i][0]

    def completion(self, i: int) -> np.ndarray:
        return self[i][1]


def row_lengths(store: Store) -> tuple[np.ndarray, np.ndarray, str]:
    """Per store row: its longest sequence (prompt + longer completion; a completion cut into segments: its longest
    segment), the positions it takes read alone (a pair: its prompt twice and both completions; a prompt again per
    extra segment), and what a row is called (for messages)."""
    prompt = store.column("prompt_len").astype(np.int64)
    extra, longest = store.segment_lengths()
    if store.kind == "pairs":
        chosen, rejected = store.column("chosen_len").astype(np.int64), store.column("rejected_len").astype(np.int64)
        extra = extra.reshape(-1, 2).sum(axis=1)
        return (prompt + longest.reshape(-1, 2).max(axis=1, initial=0), (2 + extra) * prompt + chosen + rejected,
                "pairs")
    alone = (1 + extra) * prompt + store.column("completion_len").astype(np.int64)
    return prompt + longest, alone, "completions" if store.kind == "ranked" else "examples"


def _prompt_groups(store: Store) -> np.ndarray:
    """A group id per store row: rows whose prompt tokens (and images, in an image store) are identical share one
    (hashed, 16 bytes each)."""
    offsets, lengths = store.column("offset"), store.column("prompt_len")
    tokens = store.tokens
    seen: dict[bytes, int] = {}
    out = np.empty(len(store), dtype=np.int64)
    for i in range(len(store)):
        o, n = int(offsets[i]), int(lengths[i])
        key = hashlib.blake2b(np.asarray(tokens[o : o + n]).tobytes() + store.image_key(i), digest_size=16).digest()
        out[i] = seen.setdefault(key, len(seen))
    return out


RANKED_PAIR_MODES = ("best_vs_rest", "all_pairs")


class PromptGroups:
    """Prompt groups: example ``i`` is one prompt with ``sizes[i]`` completions (``view[i] = (prompt, [completion,
    ...])``) and the (chosen, rejected) pairs of them it yields (``pairs[i]``, indices into its completions). Each
    completion has a key (``rows(i)``) under which a precomputed reference holds its log-prob. Subclasses fill
    ``pairs``, ``sizes``, ``prompt_len`` and ``completion_len`` (one array per example)."""

    store: Store
    pairs: list[list[tuple[int, int]]]
    sizes: np.ndarray
    prompt_len: np.ndarray
    completion_len: list[np.ndarray]
    extra_segments: list[np.ndarray]  # per example, per completion: its segments beyond the first (0: one sequence)
    groups_without_pairs = 0

    def __len__(self) -> int:
        return len(self.pairs)

    @functools.cached_property
    def num_pairs(self) -> np.ndarray:
        return np.asarray([len(p) for p in self.pairs], dtype=np.int64)

    def costs(self, ids: np.ndarray, *, shared: bool) -> tuple[np.ndarray, np.ndarray]:
        """Positions each example takes in a packed row (its prompt once with ``shared``, else once per sequence: a
        completion cut into segments is one per segment) and its longest sequence (prompt + longest completion)."""
        p = self.prompt_len[ids]
        total = np.asarray([int(self.completion_len[i].sum()) for i in ids], dtype=np.int64)
        longest = np.asarray([int(self.completion_len[i].max()) for i in ids], dtype=np.int64)
        return (p if shared else p * self.pieces(ids)) + total, p + longest

    def pieces(self, ids: np.ndarray) -> np.ndarray:
        """The sequences each example is computed as: one per completion, and one more per extra segment (a padded
        row each)."""
        ids = np.asarray(ids, dtype=np.int64)
        return self.sizes[ids] + np.asarray([int(self.extra_segments[i].sum()) for i in ids], dtype=np.int64)

    def real_tokens(self, ids: np.ndarray) -> np.ndarray:
        """The tokens each example counts in a step's ``tokens`` (its data's tokens, whatever is computed once):
        its prompt with each completion."""
        return self.costs(ids, shared=False)[0]


class RankedGroups(PromptGroups):
    """A ranked store (several scored completions per prompt) read as prompt groups and the pairs they yield.

    Example ``i`` is the i-th prompt group that yields at least one pair (a group whose scores all tie yields none
    and is counted in ``groups_without_pairs``). ``best_vs_rest``: the best completion (the first of the top score)
    against each completion scored lower; ``all_pairs``: every (higher, lower) pair of completions whose scores
    differ. Pairs are (chosen, rejected) indices of the group's completions, in store order. A completion's key is
    its store row. ``keep_ties``: every prompt group is an example, those whose scores all tie with no pair (group
    policy gradients train them all).
    """

    def __init__(self, store: Store, mode: str = "best_vs_rest", *, keep_ties: bool = False):
        if store.kind != "ranked":
            raise StoreError(f"store {str(store.path)!r} holds {store.kind}, not ranked completions")
        if mode not in RANKED_PAIR_MODES:
            raise ValueError(f"unknown ranked pairing {mode!r}; choose {', '.join(RANKED_PAIR_MODES)}")
        self.store, self.mode = store, mode
        starts = store.group_starts()
        scores = store.scores()
        prompt_len = store.column("prompt_len").astype(np.int64)
        completion_len = store.column("completion_len").astype(np.int64)
        groups, pairs = [], []
        for g in range(len(starts) - 1):
            got = group_pairs(scores[starts[g]:starts[g + 1]], mode)
            if got or keep_ties:
                groups.append(g)
                pairs.append(got)
        self.groups = np.asarray(groups, dtype=np.int64)  # store group number of each example
        self.pairs = pairs
        self.groups_without_pairs = len(starts) - 1 - len(groups)
        self.first_row = starts[self.groups]  # store row of each example's first completion
        self.sizes = (starts[self.groups + 1] - self.first_row).astype(np.int64)  # completions per example
        self.prompt_len = prompt_len[self.first_row]
        self.completion_len = [completion_len[self.rows(i)] for i in range(len(groups))]
        extra = store.segment_lengths()[0]  # per store row
        self.extra_segments = [extra[self.rows(i)] for i in range(len(groups))]

    def __getitem__(self, i: int) -> tuple[np.ndarray, list[np.ndarray]]:
        return self.store.ranked_group(int(self.groups[int(i)]))

    def rows(self, i: int) -> np.ndarray:
        """Store rows (one per completion) of example ``i``."""
        return np.arange(int(self.first_row[i]), int(self.first_row[i] + self.sizes[i]))


# The most positions a prompt group takes where the store records its length limits: the shortest row any ``auto``
# budget plans (engine/budgets.py: CPU_BUDGETS.row_tokens, and masked sdpa's rows on CUDA; every auto micro-batch
# holds at least 4,096), so a group fits one row of every auto budget. A constant, so grouping never depends on a
# run's memory settings.
GROUP_POSITIONS = 2048


def data_group_limit(store: Store) -> tuple[int, str] | None:
    """The most positions a prompt group (its prompt once, each completion once) may take that the store's recorded
    data settings allow, and where that comes from; None where the store records none (a prepare without
    ``--max-length``, an older store): ``prepare --max-length L`` allows a pair of two L-token sequences (2 L); a
    store scored from a samples file (``prefpack score``, on-policy rounds) a prompt with its ``n`` samples, each at
    most ``max_new_tokens`` (the store's longest prompt + n x max_new_tokens)."""
    meta = store.meta
    length = (meta.get("args") or {}).get("max_length")
    if _positive(length):
        return 2 * length, f"2 x prepare's --max-length {length}"
    settings = ((meta.get("samples") or {}).get("generation") or {}).get("settings") or {}
    n, new = settings.get("n"), settings.get("max_new_tokens")
    if _positive(n) and _positive(new) and len(store):
        prompt = int(store.column("prompt_len").max())
        return prompt + n * new, f"the longest prompt ({prompt}) + {n} samples x max_new_tokens {new}"
    return None


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def group_cap(store: Store, longest_pair: int) -> tuple[int, str]:
    """The positions a pair store's prompt group may take, and why: what the data settings allow
    (:func:`data_group_limit`) up to ``GROUP_POSITIONS``, never below the store's longest pair (which trains
    whatever the grouping); the longest pair alone where the store records no limit."""
    allowed = data_group_limit(store)
    if allowed is None or min(allowed[0], GROUP_POSITIONS) <= longest_pair:
        return longest_pair, "the store's longest pair"
    if allowed[0] <= GROUP_POSITIONS:
        return allowed
    return GROUP_POSITIONS, f"{GROUP_POSITIONS} positions (of {allowed[1]})"


class PairGroups(PromptGroups):
    """A pair store read as prompt groups (``data.group_by_prompt``): the pairs whose prompts are the same tokens
    form a group, each distinct completion (by tokens and score mask) once, so a prompt in five pairs is computed once and a
    chosen reply shared by three of them once. A group takes at most ``cap`` positions (its prompt once, each
    completion once; :func:`group_cap`): what the store's data settings allow (2 x prepare's ``--max-length``, or a
    scored samples file's prompt with its n samples) up to ``GROUP_POSITIONS``, the shortest row any auto budget
    plans, and never less than the store's longest pair laid out alone (the cap where the store records no limit).
    A prompt's pairs, in store order, start a new group where the next would pass it. So the grouping depends on the
    data and its recorded settings only, never on memory settings, and a group fits a row of every auto budget (or is
    no longer than a pair of the store). Pairs stay the store's
    pairs, each once (``pair_rows[i]``: the store rows of example i's pairs). A completion's key is
    ``2 * pair + side`` (side 0 chosen, 1 rejected), an index into the pair store's chosen and rejected columns
    interleaved; ``copies[key]`` is the key of the completion computed in its place (itself, or an earlier pair's
    identical completion in the group)."""

    def __init__(self, store: Store):
        if store.kind != "pairs":
            raise StoreError(f"store {str(store.path)!r} holds {store.kind}, not pairs")
        self.store = store
        index = store.index
        by_prompt: dict[int, list[int]] = {}
        for row, g in enumerate(_prompt_groups(store)):
            by_prompt.setdefault(int(g), []).append(row)
        lengths = index[:, 1:4].astype(np.int64)
        extra = store.segment_lengths()[0]  # per key (2 * pair + side): segments beyond the first
        # a pair read alone: its prompt twice, and once more per extra segment (its own sequence)
        per_pair = (2 + extra.reshape(-1, 2).sum(axis=1)) * lengths[:, 0] + lengths[:, 1] + lengths[:, 2]
        self.cap, self.cap_source = group_cap(store, int(per_pair.max(initial=0)))
        cap = self.cap
        self.pairs, self.keys, self.completion_len, self.pair_rows, prompt_len = [], [], [], [], []
        self.extra_segments = []
        self.copies = np.arange(2 * len(store), dtype=np.int64)  # key -> the key of the same completion computed

        def add(p, keys, sizes, pairs, rows):
            self.pairs.append(pairs)
            self.keys.append(np.asarray(keys, dtype=np.int64))
            self.extra_segments.append(extra[np.asarray(keys, dtype=np.int64)])
            self.completion_len.append(np.asarray(sizes, dtype=np.int64))
            self.pair_rows.append(rows)
            prompt_len.append(p)

        for rows in by_prompt.values():  # prompts in order of first appearance
            p = int(index[rows[0], 1])
            at: dict[tuple, int] = {}  # a completion's tokens and mask -> its index in the group
            keys, sizes, pairs, start, total = [], [], [], 0, p
            for k, row in enumerate(rows):
                off, _, c, r = (int(x) for x in index[row, :4])
                sides = [(_completion_key(store, off + p, c), 2 * row, c),
                         (_completion_key(store, off + p + c, r), 2 * row + 1, r)]
                # what a new completion adds: its tokens, and a prompt per extra segment (laid out unshared)
                adds = {t: n + p * int(extra[key]) for t, key, n in sides if t not in at}
                if pairs and total + sum(adds.values()) > cap:
                    add(p, keys, sizes, pairs, rows[start:k])
                    at, keys, sizes, pairs, start, total = {}, [], [], [], k, p
                for t, key, n in sides:
                    if t not in at:
                        at[t] = len(keys)
                        keys.append(key)
                        sizes.append(n)
                        total += n + p * int(extra[key])
                    self.copies[key] = keys[at[t]]
                pairs.append((at[sides[0][0]], at[sides[1][0]]))
            add(p, keys, sizes, pairs, rows[start:])
        self.prompt_len = np.asarray(prompt_len, dtype=np.int64)
        self.sizes = np.asarray([len(k) for k in self.keys], dtype=np.int64)
        self._real = np.asarray([int(per_pair[r].sum()) for r in self.pair_rows], dtype=np.int64)

    def __getitem__(self, i: int) -> tuple[np.ndarray, list[np.ndarray]]:
        keys = self.keys[int(i)]
        pairs = [self.store.pair(int(k) // 2) for k in keys]
        return pairs[0].prompt, [p.rejected if k % 2 else p.chosen for p, k in zip(pairs, keys)]

    def rows(self, i: int) -> np.ndarray:
        """Keys (``2 * pair + side``) of example ``i``'s completions."""
        return self.keys[int(i)]

    def real_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Every pair's prompt twice and both completions, as the same pairs count read one by one (so tokens/s
        compares with and without grouping, and with TRL on the same store)."""
        return self._real[np.asarray(ids, dtype=np.int64)]


def _completion_key(store: Store, offset: int, length: int) -> tuple[bytes, bytes | None, bytes | None]:
    """What makes two completions the same computation: their tokens, which of them are scored and where their
    segments start (the same tokens with another mask or other segments give other sums, so they are never
    merged)."""
    mask = scored_mask(store.spans, offset, length)
    cuts = segments_in(store.segments, offset, length)
    return (np.asarray(store.tokens[offset:offset + length]).tobytes(),
            None if mask is None else np.packbits(mask).tobytes(), None if cuts is None else cuts.tobytes())


def group_pairs(scores: np.ndarray, mode: str) -> list[tuple[int, int]]:
    """(chosen, rejected) index pairs of one prompt's completions from their scores (higher is better)."""
    if mode == "best_vs_rest":
        best = int(np.argmax(scores))  # the first of the top score
        return [(best, j) for j in range(len(scores)) if scores[j] < scores[best]]
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return [(i, j) for i in order for j in range(len(scores)) if scores[i] > scores[j]]
