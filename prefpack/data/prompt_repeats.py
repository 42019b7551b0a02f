"""Pairs whose prompt another pair of the store also has, counted while prepare writes (its advice to train with
``data.group_by_prompt=true``)."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np

from prefpack.data.store_format import FLAG_PROMPT_TRUNCATED


class PromptRepeats:
    """Counts pairs whose prompt (as tokens) another pair also has: training computes such a prompt once per pair,
    which a ranked layout would avoid. Keeps an 8-byte digest per distinct prompt. Prompts --max-length cut are left
    out: cut to their last tokens, unrelated prompts look alike (hh's cut to ``<s>:``)."""

    def __init__(self):
        self.seen: Counter = Counter()

    def observe(self, tokens: np.ndarray, index: np.ndarray, images: list | None = None) -> None:
        """`images`: the chunk's (row, bytes, ...) per image; a prompt's images are part of it (their image tokens
        are the same placeholder ids whatever the image)."""
        by_row: dict[int, list[bytes]] = {}
        for row, data, *_ in images or ():
            by_row.setdefault(row, []).append(data)
        uncut = (index[:, 4] & FLAG_PROMPT_TRUNCATED) == 0  # the pair columns' flags
        for row in np.flatnonzero(uncut).tolist():
            offset, prompt_len = int(index[row, 0]), int(index[row, 1])
            h = hashlib.blake2b(tokens[offset:offset + prompt_len].tobytes(), digest_size=8)
            for data in by_row.get(row, ()):
                h.update(hashlib.blake2b(data, digest_size=16).digest())
            self.seen[h.digest()] += 1

    def counts(self) -> dict[str, int]:
        repeated = [n for n in self.seen.values() if n > 1]
        return {"prompts": len(repeated), "pairs": sum(repeated)}
