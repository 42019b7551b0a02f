"""Which examples each optimizer step takes, and the key that names a step to the planners.

The data position is a pure function of the step number and the seed, so a resumed run needs only the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["StepKey", "StepSchedule", "group_order"]


class StepKey(NamedTuple):
    """The plan seed of training step ``step``. A tuple of ints, so numpy seeds its generator with it
    (``default_rng(StepKey(s, k))`` is ``default_rng([s, k])``), and a task that needs the whole step (KTO's KL
    pairing) can recognise it instead of decoding a list."""

    seed: int
    step: int


def group_order(rng: np.random.Generator, n: int, groups: np.ndarray | None) -> np.ndarray:
    """A seeded permutation of ``n`` examples that moves whole groups (``groups``: each example's group id), so
    a group's examples stay next to each other; without groups, the plain permutation."""
    if groups is None:
        return rng.permutation(n)
    groups = np.asarray(groups, dtype=np.int64)
    rank = np.empty(int(groups.max()) + 1, dtype=np.int64)
    rank[rng.permutation(rank.shape[0])] = np.arange(rank.shape[0])
    return np.argsort(rank[groups], kind="stable")


@dataclass
class StepSchedule:
    """Which examples each optimizer step uses: a seeded permutation per epoch, cut into global batches."""

    num_pairs: int
    global_batch: int
    seed: int
    shuffle: bool = True
    # Optional prompt group of each example (ids numbered by first appearance): a shuffle then moves whole groups,
    # so examples of one prompt stay next to each other and land in one step, where their prompt is laid out once.
    # With every example its own group (0, 1, 2, ...) the order is exactly the plain permutation.
    groups: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.num_pairs / self.global_batch)

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_pairs)
        return group_order(np.random.default_rng([self.seed, epoch]), self.num_pairs, self.groups)

    def pairs_for_step(self, step: int) -> tuple[int, np.ndarray]:
        epoch, k = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        return epoch, order[k * self.global_batch : (k + 1) * self.global_batch]
