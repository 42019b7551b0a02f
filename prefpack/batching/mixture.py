"""Which examples each optimizer step takes from a mixture of stores: a pure function of the step and the seed.

Source ``i`` owns the global ids ``offsets[i] .. offsets[i] + sizes[i]``. An epoch takes ``counts[i]`` examples of
each source (its ``pairs``, or its share of the weighted stores' total size by weight, largest remainders),
read from the source's own stream: seeded permutations of the store, one after another, so a source drawn more
(or less) than its size per epoch still goes through its examples evenly. The epoch's examples are then shuffled
together (whole prompt groups, as ``StepSchedule`` does) and cut into global batches. With one source the order
is exactly ``StepSchedule``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from prefpack.batching.schedule import group_order

__all__ = ["MixtureSchedule", "epoch_counts"]


def epoch_counts(sizes: Sequence[int], weights: Sequence[float | None], pairs: Sequence[int | None]) -> list[int]:
    """Examples of each source per epoch: ``pairs`` where given; the weighted sources share the sum of their own
    sizes in proportion to their weights (largest remainders, ties to the earlier source)."""
    counts = [int(p) if p is not None else 0 for p in pairs]
    weighted = [i for i, p in enumerate(pairs) if p is None]
    if weighted:
        total = sum(int(sizes[i]) for i in weighted)
        wsum = sum(float(weights[i]) for i in weighted)
        exact = {i: total * float(weights[i]) / wsum for i in weighted}
        for i in weighted:
            counts[i] = math.floor(exact[i])
        left = total - sum(counts[i] for i in weighted)
        for i in sorted(weighted, key=lambda i: (-(exact[i] - math.floor(exact[i])), i))[:left]:
            counts[i] += 1
    return counts


class MixtureSchedule:
    """``StepSchedule``'s interface (``steps_per_epoch``, ``epoch_order``, ``pairs_for_step``) over several stores."""

    def __init__(self, sizes: Sequence[int], counts: Sequence[int], global_batch: int, seed: int,
                 shuffle: bool = True, groups: Sequence[np.ndarray | None] | None = None):
        self.sizes = [int(s) for s in sizes]
        self.counts = [int(c) for c in counts]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.global_batch, self.seed, self.shuffle = int(global_batch), int(seed), shuffle
        self.groups = list(groups) if groups is not None else [None] * len(self.sizes)
        self._cache: tuple[int, np.ndarray] | None = None

    @property
    def num_pairs(self) -> int:
        """Examples per epoch."""
        return sum(self.counts)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.num_pairs / self.global_batch))

    def _cycle(self, i: int, cycle: int) -> np.ndarray:
        """The ``cycle``-th pass of source ``i``'s stream (local ids)."""
        n = self.sizes[i]
        if not self.shuffle:
            return np.arange(n)
        key = [self.seed, cycle] if len(self.sizes) == 1 else [self.seed, cycle, i + 1]
        return group_order(np.random.default_rng(key), n, self.groups[i])

    def _stream(self, i: int, start: int, count: int) -> np.ndarray:
        """Positions ``start .. start + count`` of source ``i``'s stream."""
        n = self.sizes[i]
        first, last = start // n, (start + count - 1) // n if count else start // n
        parts = np.concatenate([self._cycle(i, c) for c in range(first, last + 1)])
        return parts[start - first * n: start - first * n + count]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's global ids, in the order steps take them."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        drawn = [self._stream(i, epoch * c, c) + self.offsets[i] for i, c in enumerate(self.counts)]
        if len(drawn) == 1:
            order = drawn[0]
        elif self.shuffle:
            ids = np.concatenate(drawn)
            rng = np.random.default_rng([self.seed, epoch, 0])
            if all(g is None for g in self.groups):
                order = ids[rng.permutation(len(ids))]
            else:
                order = ids[group_order(rng, len(ids), self._global_groups()[ids])]
        else:  # spread each source evenly over the epoch, in order
            ids = np.concatenate(drawn)
            place = np.concatenate([(np.arange(c) + 0.5) / c for c in self.counts if c])
            order = ids[np.argsort(place, kind="stable")]
        self._cache = (epoch, order)
        return order

    def _global_groups(self) -> np.ndarray:
        """Each global id's prompt group, numbered apart per source (ungrouped sources: one group per example)."""
        out, base = [], 0
        for n, g in zip(self.sizes, self.groups):
            g = np.arange(n) if g is None else np.asarray(g, dtype=np.int64)
            out.append(g + base)
            base += int(g.max()) + 1 if n else 0
        return np.concatenate(out)

    def pairs_for_step(self, step: int) -> tuple[int, np.ndarray]:
        epoch, k = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        return epoch, order[k * self.global_batch: (k + 1) * self.global_batch]

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        """The source index of each global id."""
        return np.searchsorted(self.offsets, np.asarray(ids), side="right") - 1
