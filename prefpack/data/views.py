"""A prepared store read as training examples: pairs (prompt, chosen, rejected), or KTO's unpaired examples
(prompt, completion, label) from an unpaired store or from a pair store's two halves."""

from __future__ import annotations

import hashlib

import numpy as np

from prefpack.data.store import Store, StoreError

__all__ = ["RANKED_PAIR_MODES", "RankedGroups", "StorePairs", "UnpairedView", "group_pairs"]


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


def _prompt_groups(store: Store) -> np.ndarray:
    """A group id per store row: rows whose prompt tokens are identical share one (hashed, 16 bytes each)."""
    offsets, lengths = store.column("offset"), store.column("prompt_len")
    tokens = store.tokens
    seen: dict[bytes, int] = {}
    out = np.empty(len(store), dtype=np.int64)
    for i in range(len(store)):
        o, n = int(offsets[i]), int(lengths[i])
        key = hashlib.blake2b(np.asarray(tokens[o : o + n]).tobytes(), digest_size=16).digest()
        out[i] = seen.setdefault(key, len(seen))
    return out


RANKED_PAIR_MODES = ("best_vs_rest", "all_pairs")


class RankedGroups:
    """A ranked store (several scored completions per prompt) read as prompt groups and the pairs they yield.

    Example ``i`` is the i-th prompt group that yields at least one pair (a group whose scores all tie yields none
    and is counted in ``groups_without_pairs``). ``best_vs_rest``: the best completion (the first of the top score)
    against each completion scored lower; ``all_pairs``: every (higher, lower) pair of completions whose scores
    differ. Pairs are (chosen, rejected) indices of the group's completions, in store order.
    """

    def __init__(self, store: Store, mode: str = "best_vs_rest"):
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
            if got:
                groups.append(g)
                pairs.append(got)
        self.groups = np.asarray(groups, dtype=np.int64)  # store group number of each example
        self.pairs = pairs  # per example: [(chosen, rejected), ...] completion indices within the group
        self.groups_without_pairs = len(starts) - 1 - len(groups)
        self.first_row = starts[self.groups]  # store row of each example's first completion
        self.sizes = (starts[self.groups + 1] - self.first_row).astype(np.int64)  # completions per example
        self.prompt_len = prompt_len[self.first_row]
        rows = [np.arange(a, a + k) for a, k in zip(self.first_row, self.sizes)]
        self.completion_len = [completion_len[r] for r in rows]
        self.num_pairs = np.asarray([len(p) for p in pairs], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.groups.shape[0])

    def __getitem__(self, i: int) -> tuple[np.ndarray, list[np.ndarray]]:
        return self.store.ranked_group(int(self.groups[int(i)]))

    def rows(self, i: int) -> np.ndarray:
        """Store rows (one per completion) of example ``i``."""
        return np.arange(int(self.first_row[i]), int(self.first_row[i] + self.sizes[i]))

    def costs(self, ids: np.ndarray, *, shared: bool) -> tuple[np.ndarray, np.ndarray]:
        """Positions each example takes in a packed row (its prompt once with ``shared``, else once per completion)
        and its longest sequence (prompt + longest completion)."""
        p = self.prompt_len[ids]
        total = np.asarray([int(self.completion_len[i].sum()) for i in ids], dtype=np.int64)
        longest = np.asarray([int(self.completion_len[i].max()) for i in ids], dtype=np.int64)
        return (p if shared else p * self.sizes[ids]) + total, p + longest


def group_pairs(scores: np.ndarray, mode: str) -> list[tuple[int, int]]:
    """(chosen, rejected) index pairs of one prompt's completions from their scores (higher is better)."""
    if mode == "best_vs_rest":
        best = int(np.argmax(scores))  # the first of the top score
        return [(best, j) for j in range(len(scores)) if scores[j] < scores[best]]
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return [(i, j) for i in order for j in range(len(scores)) if scores[i] > scores[j]]
