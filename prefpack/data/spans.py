"""Completion tokens that are not scored (tool results, a user turn inside a multi-turn reply, a masked span), as a
store keeps them and as a completion carries them to the collator.

A store of format version 2 may hold ``spans.bin``: int64 rows ``[start, end)`` of absolute positions in
``tokens.bin`` whose tokens are not scored, sorted by start, never overlapping, each inside one completion. A store
without it (every store of version 1) scores every completion token. A completion read from a store with spans is
a :class:`ScoredTokens`: the token ids as an ordinary array, plus ``scored`` (one bool per token); the collator
reads ``scored`` (duck-typed: ``prefpack.batching`` sits below ``data``) and gives unscored positions no target.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SPANS_FILE", "ScoredTokens", "check_spans", "mask_to_spans", "scored_of", "scored_mask"]

SPANS_FILE = "spans.bin"


class ScoredTokens(np.ndarray):
    """Token ids with ``scored`` (bool per token, False where the token gets no loss). Anything derived from it
    (a slice, a copy, a concatenation) is a plain array again with ``scored = None``: only the completion as read
    carries its mask, so a mask never goes out of step with the tokens it describes."""

    scored: np.ndarray | None

    def __new__(cls, tokens: np.ndarray, scored: np.ndarray) -> ScoredTokens:
        scored = np.asarray(scored, dtype=bool)
        obj = np.asarray(tokens).view(cls)
        if scored.shape != obj.shape:
            raise ValueError(f"a score mask of shape {scored.shape} for {obj.shape} tokens")
        obj.scored = scored
        return obj

    def __array_finalize__(self, obj) -> None:
        self.scored = None

    def __reduce__(self):  # pickles (worker processes) as a plain array plus its mask
        return ScoredTokens, (np.asarray(self), self.scored)


def scored_of(tokens) -> np.ndarray | None:
    """The score mask a completion carries (None: every token is scored)."""
    return getattr(tokens, "scored", None)


def scored_mask(spans: np.ndarray, offset: int, length: int) -> np.ndarray | None:
    """The bool mask of ``tokens.bin[offset : offset + length]`` (True = scored) from a store's unscored ``spans``
    ([M, 2], sorted); None when every token of the range is scored."""
    if not len(spans):
        return None
    end = offset + length
    lo = int(np.searchsorted(spans[:, 1], offset, side="right"))  # first span ending after offset
    hi = int(np.searchsorted(spans[:, 0], end, side="left"))  # spans starting before end
    if lo >= hi:
        return None
    mask = np.ones(length, dtype=bool)
    for start, stop in spans[lo:hi]:
        mask[max(int(start), offset) - offset : min(int(stop), end) - offset] = False
    return mask


def mask_to_spans(scored: np.ndarray, offset: int = 0) -> np.ndarray:
    """The ``[start, end)`` runs of False in a score mask, shifted by ``offset`` ([M, 2] int64): how prepare turns
    a completion's mask into the rows of spans.bin."""
    unscored = np.concatenate([[False], ~np.asarray(scored, dtype=bool), [False]])
    edges = np.flatnonzero(np.diff(unscored.astype(np.int8)))
    return edges.reshape(-1, 2).astype(np.int64) + offset


def check_spans(spans: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> str | None:
    """What is wrong with a store's ``spans`` given its completions' ``[starts, ends)`` (sorted by start, apart),
    or None: every span non-empty, sorted, apart from the next, and inside one completion, and no completion wholly
    unscored."""
    if not len(spans):
        return None
    if not len(starts):
        return f"{len(spans)} span(s) but no completion to hold them"
    s, e = np.asarray(spans[:, 0]), np.asarray(spans[:, 1])
    if (e <= s).any():
        return f"span {int(np.argmax(e <= s))} is empty or reversed"
    if (s[1:] < e[:-1]).any():
        return f"span {int(np.argmax(s[1:] < e[:-1])) + 1} starts before the previous one ends (unsorted or overlapping)"
    k = np.searchsorted(starts, s, side="right") - 1  # the completion each span starts in
    inside = (k >= 0) & (e <= np.asarray(ends)[np.maximum(k, 0)]) & (s < np.asarray(ends)[np.maximum(k, 0)])
    if not inside.all():
        i = int(np.argmax(~inside))
        return f"span {i} [{int(s[i])}, {int(e[i])}) is not inside one completion"
    starts, ends = np.asarray(starts), np.asarray(ends)
    covered = np.bincount(k, weights=(e - s).astype(np.float64), minlength=len(starts))
    bare = (covered > 0) & (covered >= ends - starts)  # spans apart and inside: their sum is what they cover
    if bare.any():  # prepare refuses such a reply (no_scored_tokens); a length-normalised loss would divide by 0
        c = int(np.argmax(bare))
        return f"completion {c} [{int(starts[c])}, {int(ends[c])}) has no scored token left (spans cover all of it)"
    return None
