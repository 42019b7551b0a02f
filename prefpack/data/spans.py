"""Completion tokens that are not scored (tool results, a user turn inside a multi-turn reply, a masked span), as a
store keeps them and as a completion carries them to the collator.

A store of format version 2 may hold ``spans.bin``: int64 rows ``[start, end)`` of absolute positions in
``tokens.bin`` whose tokens are not scored, sorted by start, never overlapping, each inside one completion. A store
without it (every store of version 1) scores every completion token. A completion read from a store with spans is
a :class:`ScoredTokens`: the token ids as an ordinary array, plus ``scored`` (one bool per token); the collator
reads ``scored`` (duck-typed: ``prefpack.batching`` sits below ``data``) and gives unscored positions no target.

A store of format version 5 may hold ``segments.bin`` too: int64 absolute positions in tokens.bin where a later
segment of a completion starts (sorted, each strictly inside one completion). A completion cut into segments is
computed as several sequences ``prompt + segment``, each attending its prompt and itself only, whose sums add up to
the completion's (a chat template that rewrites earlier assistant turns: each turn scored in the context the model
saw at that turn). Such a completion is a :class:`ScoredTokens` whose ``segments`` holds the offsets, relative to
it, where segments 1, 2, ... start; ``scored`` may then be None (every token scored).
"""

from __future__ import annotations

import numpy as np

__all__ = ["SEGMENTS_FILE", "SPANS_FILE", "ScoredTokens", "check_segments", "check_spans", "mask_to_spans",
           "scored_of", "scored_mask", "segment_lengths", "segments_in", "segments_of"]

SPANS_FILE = "spans.bin"
SEGMENTS_FILE = "segments.bin"


class ScoredTokens(np.ndarray):
    """Token ids with ``scored`` (bool per token, False where the token gets no loss; None: all scored) and
    ``segments`` (int64 offsets where segments 1, 2, ... start, each strictly inside; None: one sequence). Anything
    derived from it (a slice, a copy, a concatenation) is a plain array again with both None: only the completion
    as read carries them, so they never go out of step with the tokens they describe."""

    scored: np.ndarray | None
    segments: np.ndarray | None

    def __new__(cls, tokens: np.ndarray, scored: np.ndarray | None = None,
                segments: np.ndarray | None = None) -> ScoredTokens:
        obj = np.asarray(tokens).view(cls)
        if scored is not None:
            scored = np.asarray(scored, dtype=bool)
            if scored.shape != obj.shape:
                raise ValueError(f"a score mask of shape {scored.shape} for {obj.shape} tokens")
        if segments is not None:
            segments = np.asarray(segments, dtype=np.int64).reshape(-1)
            n = obj.shape[0] if obj.ndim == 1 else -1
            if not len(segments) or segments[0] <= 0 or segments[-1] >= n or (np.diff(segments) <= 0).any():
                raise ValueError(f"segment starts {segments.tolist()} must be sorted and strictly inside {n} tokens")
        obj.scored = scored
        obj.segments = segments
        return obj

    def __array_finalize__(self, obj) -> None:
        self.scored = None
        self.segments = None

    def __reduce__(self):  # pickles (worker processes) as a plain array plus its mask and segments
        return ScoredTokens, (np.asarray(self), self.scored, self.segments)


def scored_of(tokens) -> np.ndarray | None:
    """The score mask a completion carries (None: every token is scored)."""
    return getattr(tokens, "scored", None)


def segments_of(tokens) -> np.ndarray | None:
    """The offsets where a completion's later segments start (None: the completion is one sequence)."""
    return getattr(tokens, "segments", None)


def segments_in(segments: np.ndarray, offset: int, length: int) -> np.ndarray | None:
    """The segment starts of ``tokens.bin[offset : offset + length]`` relative to it, from a store's sorted
    ``segments``; None when it has none."""
    if not len(segments):
        return None
    lo, hi = np.searchsorted(segments, [offset, offset + length])
    return None if lo >= hi else np.asarray(segments[lo:hi], dtype=np.int64) - offset


def segment_lengths(segments: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per completion ``[starts, ends)`` (sorted by start): how many segments it has beyond its first, and the
    length of its longest segment (its length without segments). What planning reads: unshared, each extra segment
    is laid out after a copy of the prompt."""
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    n = len(starts)
    segments = np.asarray(segments, dtype=np.int64)
    if not len(segments):
        return np.zeros(n, np.int64), ends - starts
    k = np.searchsorted(starts, segments, side="right") - 1  # the completion each segment start is in
    comp = np.concatenate([np.arange(n), k])
    at = np.concatenate([starts, segments])
    order = np.lexsort((at, comp))
    comp, at = comp[order], at[order]
    nxt = np.append(at[1:], 0)
    last = np.append(comp[1:] != comp[:-1], True)  # each completion's last segment ends where it ends
    end = np.where(last, ends[comp], nxt)
    longest = np.zeros(n, np.int64)
    np.maximum.at(longest, comp, end - at)
    return np.bincount(k, minlength=n).astype(np.int64), longest


def check_segments(segments: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> str | None:
    """What is wrong with a store's segment starts given its completions' ``[starts, ends)`` (sorted by start), or
    None: strictly increasing, each strictly inside one completion (a segment is never empty)."""
    if not len(segments):
        return None
    s = np.asarray(segments, dtype=np.int64)
    if (np.diff(s) <= 0).any():
        return f"segment start {int(np.argmax(np.diff(s) <= 0)) + 1} is not after the previous one (unsorted)"
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    k = np.searchsorted(starts, s, side="right") - 1
    inside = (k >= 0) & (s > starts[np.maximum(k, 0)]) & (s < ends[np.maximum(k, 0)]) if len(starts) else k < -1
    if not inside.all():
        i = int(np.argmax(~inside))
        return f"segment start {i} (position {int(s[i])}) is not strictly inside a completion"
    return None


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
