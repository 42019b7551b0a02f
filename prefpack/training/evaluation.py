"""Evaluation over a whole store, shared by the loop (before, during, after training) and `prefpack eval`."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from prefpack.batching.deal import deal_step
from prefpack.distributed import SINGLE, Dist
from prefpack.model import SequenceLogps
from prefpack.objectives import Objective, StepTotals
from prefpack.reference import Reference
from prefpack.sequence_parallel import current as current_layout


@torch.no_grad()
def evaluate(policy: nn.Module, reference: Reference, task: Objective, *, module: nn.Module | None = None,
             ctx: Dist = SINGLE, balance: str = "tokens") -> dict[str, float]:
    """Mean loss and metrics over every example of a task's store (deterministic micro-batches, no grad).

    `module` is the (possibly wrapped) SequenceLogps of `policy`; with several ranks the micro-batches
    are dealt across them and the sums all-reduced.
    """
    if module is None:
        module = SequenceLogps(policy, chunk_size=task.settings.chunk_size, **task.forward_options())
    was_training = policy.training
    policy.eval()
    sp = current_layout()  # sequence groups (distributed.sequence_parallel): a group's ranks share the micro-batches
    world, rank = (sp.data_world, sp.data_rank) if sp.enabled else (ctx.world, ctx.rank)
    share = deal_step(task, np.arange(len(task)), seed=None, world=world, balance=balance)[rank]
    batches = [task.collate(p) for p in share.planned]
    counted = share.weights if sp.rank == 0 else [0.0] * len(share.weights)  # a group's sums counted once
    step_state = task.begin_step(module, reference, batches, weights=counted, dist=ctx)  # 0 = padding batch
    totals = StepTotals()
    for batch, weight in zip(batches, share.weights):
        out = task.loss(module, reference, batch, step_state)
        if weight:
            totals.add(out, batch, counted=sp.rank == 0)
    policy.train(was_training)
    return reduce_totals(totals, ctx).means()


def reduce_totals(totals: StepTotals, ctx: Dist) -> StepTotals:
    """One all-reduce of every sum of a step (metric keys are the same on every rank)."""
    if not ctx.enabled:
        return totals
    keys = sorted(totals.metrics)
    return StepTotals.from_vector(ctx.all_reduce_sum(totals.as_vector(keys)), keys)
