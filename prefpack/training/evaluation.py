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
    share = deal_step(task, np.arange(len(task)), seed=None, world=ctx.world, balance=balance)[ctx.rank]
    batches = [task.collate(p) for p in share.planned]
    step_state = task.begin_step(module, reference, batches, weights=share.weights, dist=ctx)  # 0 = padding batch
    totals = StepTotals()
    for batch, weight in zip(batches, share.weights):
        out = task.loss(module, reference, batch, step_state)
        if weight:
            totals.add(out, batch)
    policy.train(was_training)
    return reduce_totals(totals, ctx).means()


def reduce_totals(totals: StepTotals, ctx: Dist) -> StepTotals:
    """One all-reduce of every sum of a step (metric keys are the same on every rank)."""
    if not ctx.enabled:
        return totals
    keys = sorted(totals.metrics)
    return StepTotals.from_vector(ctx.all_reduce_sum(totals.as_vector(keys)), keys)
