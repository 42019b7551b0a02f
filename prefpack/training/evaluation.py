"""Evaluation over a whole store, shared by the loop (before, during, after training) and `prefpack eval`."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from prefpack.distributed import Dist
from prefpack.model import forward_module
from prefpack.objectives import Objective, StepTotals, release_images
from prefpack.parallel import ONE_PROCESS, Parallel
from prefpack.progress import progress as show_progress
from prefpack.reference import Reference


@torch.no_grad()
def evaluate(policy: nn.Module, reference: Reference, task: Objective, *, module: nn.Module | None = None,
             parallel: Parallel = ONE_PROCESS, progress: bool = False) -> dict[str, float]:
    """Mean loss and metrics over every example of a task's store (deterministic micro-batches, no grad).

    `module` is the (possibly wrapped) SequenceLogps of `policy`; with several ranks the micro-batches
    are dealt across them (a sequence group's ranks share theirs) and the sums all-reduced.
    """
    if module is None:
        module = forward_module(policy, chunk_size=task.settings.chunk_size, seq=parallel.seq,
                                **task.forward_options())
    ctx = parallel.dist
    was_training = policy.training
    policy.eval()
    share = parallel.share(task, np.arange(len(task)), seed=None)
    counted = parallel.counted(share.weights)  # a sequence group's sums counted once
    windows = _windows(task, len(share.planned))
    if windows is None:
        batches = [task.collate(p) for p in share.planned]
        step_state = task.begin_step(module, reference, batches, weights=counted, dist=ctx)  # 0 = padding batch
        windows, collated = [range(len(batches))], batches
    else:  # images: a few micro-batches at a time, so the whole store's pixels are never held at once
        step_state = _windowed_state(task, module, reference, share.planned, counted, windows, ctx)
        collated = None
    totals = StepTotals()
    # `prefpack eval` on a big store: a bar on a terminal, plain lines in a batch log (training announces its own)
    ticks = iter(show_progress(range(len(share.planned)), desc="eval", unit="micro-batch",
                               enabled=progress and ctx.is_main))
    for window in windows:
        if collated is None:
            task.prefetch([share.planned[k] for k in window])
        for k in window:
            next(ticks, None)
            batch = collated[k] if collated is not None else task.collate(share.planned[k])
            out = task.loss(module, reference, batch, step_state)
            release_images(batch)
            if share.weights[k]:
                totals.add(out, batch, counted=parallel.counts_sums)
    for _ in ticks:  # the last line
        pass
    policy.train(was_training)
    return reduce_totals(totals, ctx).means()


EVAL_WINDOW = 4  # micro-batches an image evaluation collates at a time (their pixels are large; text: all at once)


def _windows(task: Objective, n: int) -> list[range] | None:
    """The micro-batch windows of an evaluation over images, or None (all at once: text, or an objective whose
    step state needs every batch at once, e.g. a mixture). A window-wise evaluation needs a step state that is
    either nothing (the base ``begin_step``: pairs, prompt groups) or additive sums (KTO's ``step_sums``)."""
    if getattr(task.settings, "vision", None) is None:
        return None
    stateless = type(task).begin_step is Objective.begin_step
    if not stateless and not (hasattr(task, "step_sums") and hasattr(task, "step_state")):
        return None
    return [range(i, min(i + EVAL_WINDOW, n)) for i in range(0, n, EVAL_WINDOW)]


def _windowed_state(task: Objective, module, reference, planned, counted, windows, ctx: Dist):
    """``begin_step`` over the windows: nothing for a stateless objective; KTO's sums (the KL reference point over
    the whole store) summed window by window, then all-reduced once, as ``begin_step`` does."""
    if type(task).begin_step is Objective.begin_step:
        return task.begin_step(module, reference, [], weights=[], dist=ctx)
    acc = None
    for window in windows:
        task.prefetch([planned[k] for k in window])
        part = task.step_sums(module, reference, [task.collate(planned[k]) for k in window],
                              [counted[k] for k in window])
        acc = part if acc is None else acc + part
    if acc is None:  # this rank has no micro-batch: zeros of the shape its peers all-reduce
        acc = task.step_sums(module, reference, [], [])
    ctx.all_reduce_sum(acc)
    return task.step_state(acc)


def reduce_totals(totals: StepTotals, ctx: Dist) -> StepTotals:
    """One all-reduce of every sum of a step (metric keys are the same on every rank)."""
    totals.settle()
    if not ctx.enabled:
        return totals
    keys = sorted(totals.metrics)
    return StepTotals.from_vector(ctx.all_reduce_sum(totals.as_vector(keys)), keys)
