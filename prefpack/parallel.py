"""Where this process stands among the run's processes: one object built once per entry point and passed explicitly.

``Parallel`` joins the process group (:class:`prefpack.distributed.Dist`: ranks, device) and the sequence groups
(:class:`prefpack.sequence_parallel.SeqPar`). Dealing a step's micro-batches, evaluation, precompute-ref and the
forward read it from their arguments, never from a module global, so a function's layout is what its caller
passed. The rank fork every reader needed ("a sequence group's ranks share one data-parallel share") lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefpack.batching.deal import Share, deal_step
from prefpack.distributed import SINGLE, Dist, init_from_env, shutdown
from prefpack.sequence_parallel import SINGLE_SP, SeqPar, layout_line, make_layout

__all__ = ["ONE_PROCESS", "Parallel", "start_parallel"]


@dataclass(frozen=True)
class Parallel:
    """The process group (``dist``), this rank's sequence group (``seq``; one rank per group by default) and how
    micro-batches are dealt to the ranks (``balance``: by tokens or by count, ``prefpack.batching.deal``)."""

    dist: Dist = field(default_factory=lambda: SINGLE)
    seq: SeqPar = SINGLE_SP
    balance: str = "tokens"  # how a step's examples are dealt to the data-parallel shares (distributed.balance)

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def world(self) -> int:
        return self.dist.world

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def enabled(self) -> bool:
        return self.dist.enabled

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    @property
    def data_world(self) -> int:
        """How many data-parallel shares a step is dealt into (a sequence group's ranks share one)."""
        return self.seq.data_world if self.seq.enabled else self.dist.world

    @property
    def data_rank(self) -> int:
        """Which of those shares this rank runs."""
        return self.seq.data_rank if self.seq.enabled else self.dist.rank

    @property
    def counts_sums(self) -> bool:
        """Whether this rank counts its share's sums (every rank of a sequence group returns the group's: once)."""
        return self.seq.rank == 0

    def share(self, task, ids, *, seed) -> Share:
        """This rank's micro-batches of a step (every rank plans the whole step; the same answer everywhere)."""
        return deal_step(task, ids, seed=seed, world=self.data_world, balance=self.balance)[self.data_rank]

    def counted(self, weights: list[float]) -> list[float]:
        """The weights this rank's sums are counted with: its own, or zeros on a sequence group's other ranks."""
        return list(weights) if self.counts_sums else [0.0] * len(weights)

    def barrier(self) -> None:
        self.dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.dist.all_reduce_sum(t)

    def describe(self) -> list[str]:
        """What a run prints about its processes at start (nothing for one process)."""
        return [layout_line(self.seq, self.world)] if self.seq.enabled else []


ONE_PROCESS = Parallel()


def start_parallel(device: str = "auto", sequence_parallel: int = 1, *, balance: str = "tokens") -> Parallel:
    """Join the process group torchrun describes (one process needs none) and form the sequence groups of
    ``sequence_parallel`` ranks (refused with the numbers when that does not divide the processes)."""
    ctx = init_from_env(device)
    try:
        return Parallel(ctx, make_layout(sequence_parallel, ctx.world, ctx.rank, ctx.device.type), balance)
    except BaseException:
        shutdown()  # a refused layout leaves no process group behind
        raise
