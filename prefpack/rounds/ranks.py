"""The rounds driver's processes under torchrun: one process group for the whole run (``train`` finds it joined),
and the driver's own waits on a gloo group of their own with a long timeout.

Rank 0 alone scores, writes the run's files and starts a vLLM server, and a reward model's scoring or a server's
start can outlast the process group's default timeout (30 minutes), during which the other ranks wait: a wait that
timed out would end a healthy run. Each step every rank takes together ends in one all-reduce that says whether any
rank failed, so a rank's error stops every rank at the same place (the others say where) instead of leaving them
waiting; a rank killed outright is torchrun's to handle (it stops the others).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from prefpack.distributed import Dist
from prefpack.errors import PrefpackError

WAIT = timedelta(hours=24)  # the longest a rank waits for another (rank 0 scoring, a vLLM server sampling)


class RankFailed(PrefpackError, RuntimeError):
    """Another rank failed in a step the ranks take together (its own error is printed by that rank)."""


class Ranks:
    def __init__(self, ctx: Dist):
        self.ctx = ctx
        self.group = dist.new_group(backend="gloo", timeout=WAIT) if ctx.enabled else None

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def world(self) -> int:
        return self.ctx.world

    def together(self, what: str, fn: Callable[[], Sequence[float] | None], size: int = 0) -> list[float]:
        """``fn()`` on every rank; its ``size`` numbers summed over ranks. A rank whose ``fn`` raised raises it
        again, the others raise ``RankFailed`` naming ``what``."""
        error, values = None, [0.0] * size
        try:
            out = fn()
            if size:
                values = [float(v) for v in out]
        except BaseException as exc:  # Ctrl-C too: the other ranks must not wait for this one
            error = exc
        if not self.ctx.enabled:
            if error is not None:
                raise error
            return values
        flags = torch.tensor([float(error is not None), *values], dtype=torch.float64)
        dist.all_reduce(flags, group=self.group)
        if error is not None:
            raise error
        if flags[0] > 0:
            raise RankFailed(f"another process failed while {what} (its error is printed above); this one stops too")
        return flags[1:].tolist()

    def main_only(self, what: str, fn: Callable[[], object]) -> None:
        """``fn()`` on rank 0 while the other ranks wait for it."""
        self.together(what, fn if self.is_main else lambda: None)
