"""The step loop: steps of a fixed number of pairs, packed micro-batches, the learning-rate schedule, resume.

An optimizer step takes exactly `train.global_batch_pairs` pairs from a seeded, per-epoch permutation
of the store. Those pairs are packed into micro-batches under the token budget, every micro-batch's
per-pair losses are summed and divided by the step's pair count, so the update does not depend on how
the pairs were packed or split (accumulation 1 x 8 equals 8 x 1). The data position is a pure function
of the step number and the seed, so resuming needs only the step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from prefpack.distributed import Dist, clip_grad_norm, grad_sync
from prefpack.engine import final_dtype, make_optimizer, wrap_forward
from prefpack.model import ModelError, release_freed_memory
from prefpack.objectives import StepTotals, release_images
from prefpack.parallel import Parallel, start_parallel
from prefpack.plot import try_plot
from prefpack.training.cadence import Cadence
from prefpack.training.checkpoint import (
    Checkpointed,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_final,
)
from prefpack.training.evaluation import evaluate, reduce_totals
from prefpack.training.feed import total_steps
from prefpack.training.guards import NonFiniteError, NonFiniteSteps, StopSignal, check_finite_weights
from prefpack.training.plan_check import PLAN_KEY, check_plan, plan_signature
from prefpack.training.setup import build, check_trainable, open_run_dir, save_run_config

__all__ = ["TrainResult", "lr_lambda", "total_steps", "train", "warmup_steps"]

# ------------------------------------------------------------------------------------------------ schedule


def lr_lambda(schedule: str, warmup: int, total: int):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        progress = min(max(progress, 0.0), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def warmup_steps(cfg, total: int) -> int:
    if cfg.optim.warmup_steps:
        return int(cfg.optim.warmup_steps)
    return int(round(cfg.optim.warmup_ratio * total))


# ------------------------------------------------------------------------------------------------ the loop


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_dir: Path | None
    eval_before: dict[str, float] | None
    eval_after: dict[str, float] | None
    last_train: dict[str, float]
    interval: tuple[int, int, dict[str, float]] | None = None  # the last metrics line's steps and their means
    steps_run: int = 0  # steps this process ran (fewer than ``steps`` after a resume)
    seconds: float = 0.0  # this process's wall time from the first step to the saved final model
    tokens: float = 0.0  # real tokens this process's steps trained on
    plotted: bool = False

    def summary(self) -> str:
        """The end of the run as a table (``prefpack train`` prints it; ``--json`` prints :meth:`to_json`)."""
        from prefpack.training.report import summary_table

        return summary_table(run_dir=self.run_dir, final_dir=self.final_dir, steps=self.steps,
                             steps_run=self.steps_run, seconds=self.seconds, tokens=self.tokens,
                             interval=self.interval, eval_before=self.eval_before, eval_after=self.eval_after,
                             plotted=self.plotted)

    def to_json(self) -> dict:
        return {"run_dir": str(self.run_dir), "steps": self.steps, "final_model": str(self.final_dir),
                "train": self.last_train, "eval": self.eval_after, "eval_before": self.eval_before,
                "train_interval": None if self.interval is None else {
                    "first_step": self.interval[0], "last_step": self.interval[1], "means": self.interval[2]},
                "seconds": self.seconds, "tokens": self.tokens}


def train(cfg, *, resume: bool = False, stop_after_steps: int | None = None, log=print,
          progress: bool = True, schedule_span: tuple[int, int] | None = None,
          allow_plan_change: bool = False) -> TrainResult:
    """Train as the config says; returns where things were written and the last metrics.

    Under torchrun every rank runs this; only rank 0 prints, logs, plots and writes the final model.
    ``schedule_span`` = (steps before this run, steps of the whole schedule): this run is one part of a longer
    learning-rate schedule (an on-policy round: ``prefpack.rounds``); None = the schedule spans this run's steps.
    ``allow_plan_change`` (--allow-config-change): resume even where the checkpoint's plan differs from this one.
    """
    check_trainable(cfg)
    parallel = start_parallel(cfg.train.device, cfg.distributed.sequence_parallel, balance=cfg.distributed.balance)
    return _train(cfg, parallel, resume=resume, stop_after_steps=stop_after_steps, log=log, progress=progress,
                  schedule_span=schedule_span, allow_plan_change=allow_plan_change)


def _train(cfg, parallel: Parallel, *, resume: bool, stop_after_steps: int | None, log,
           progress: bool, schedule_span: tuple[int, int] | None = None,
           allow_plan_change: bool = False) -> TrainResult:
    ctx = parallel.dist
    main = ctx.is_main
    if not main:
        log = _quiet  # noqa: F811 - other ranks stay silent
        progress = False
    run_dir = open_run_dir(cfg, ctx, resume=resume, log=log)
    setup = build(cfg, log=log, parallel=parallel)
    if main:
        save_run_config(cfg, run_dir, resume=resume)
    run = run_steps(cfg, setup, run_dir, resume=resume, stop_after_steps=stop_after_steps, log=log,
                    progress=progress, schedule_span=schedule_span, allow_plan_change=allow_plan_change)
    engine = setup.engine
    check_finite_weights(run.params, ctx)  # never a NaN model saved as the result
    _free_training_state(run.optimizer, engine.reference, run.parts)
    final_dir = save_final(run_dir, engine.policy, setup.tokenizer, module=run.module, ctx=ctx,
                           strategy=cfg.distributed.strategy, dtype=final_dtype(cfg, engine.precision),
                           image_processor_dir=setup.image_processor_dir)
    plotted = bool(cfg.run.plot and main) and try_plot(run_dir, log)
    ctx.barrier()
    n_steps = setup.feed.num_steps
    return TrainResult(run_dir, n_steps, final_dir, run.eval_before, run.eval_after, run.last,
                       interval=run.interval, steps_run=n_steps - run.start, seconds=time.perf_counter() - run.t0,
                       tokens=run.tokens, plotted=plotted)


@dataclass
class StepsRun:
    """What :func:`run_steps` leaves: the evaluations, the last metrics, and the training state the caller frees
    (or saves from)."""

    eval_before: dict[str, float] | None
    eval_after: dict[str, float] | None
    last: dict[str, float]
    interval: tuple[int, int, dict[str, float]] | None
    start: int
    t0: float
    tokens: float
    params: list
    optimizer: torch.optim.Optimizer
    parts: Checkpointed
    module: torch.nn.Module


def run_steps(cfg, setup, run_dir: Path, *, resume: bool, stop_after_steps: int | None = None, log=print,
              progress: bool = True, schedule_span: tuple[int, int] | None = None,
              allow_plan_change: bool = False) -> StepsRun:
    """The steps of ``setup.feed`` on ``setup.engine``'s weights, checkpointed into ``run_dir`` (resumed from its
    newest checkpoint with ``resume``); metrics into ``run_dir/metrics.jsonl``. One optimizer and one learning-rate
    schedule over the feed's ``num_steps`` (``schedule_span``: this run is a part of a longer schedule)."""
    from prefpack.metrics import MetricsLogger
    from prefpack.training.hooks import step_hooks

    parallel = setup.parallel
    ctx = parallel.dist
    main = ctx.is_main
    engine, feed = setup.engine, setup.feed
    policy, reference = engine.policy, engine.reference
    policy.train()
    module = wrap_forward(engine, feed.forward_options())  # MoE aux loss, LD-DPO tails, WPO means
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg)
    n_steps = feed.num_steps
    offset, span = schedule_span or (0, n_steps)
    schedule = lr_lambda(cfg.optim.schedule, warmup_steps(cfg, span), span)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(offset + step))
    metrics = MetricsLogger.from_config(cfg, run_dir, resume=resume, enabled=main)  # run.report_to
    if metrics.notice:
        log(metrics.notice)
    # a synced (TR-DPO) reference is part of the state: a checkpoint that holds one restores it
    copied = reference.model is not None  # a reference model in memory (reference.mode copy)
    parts = Checkpointed(policy, module, optimizer, scheduler, reference=reference.model,
                         reference_module=reference.module if copied else None)
    start = 0
    plan = plan_signature(feed)  # each checkpoint records it; a resume compares it (plan_check)
    if resume:
        state, start = _resume(run_dir, parts, n_steps, metrics, ctx, log, plan, allow_plan_change)
        feed.load_state_dict(state)  # what the objective carries across steps (bco_pair_running's mean)
    feed.begin(start, metrics)  # a rollout feed makes its first segment's examples here, with the weights resumed

    def run_eval() -> dict[str, float]:
        out: dict[str, float] = {}
        for name, eval_task in feed.eval_tasks.items():  # data.eval as a map: each store as NAME/... (eval/NAME/..)
            eval_task.load_state_dict(feed.state_dict())  # evaluation scores as training does
            result = evaluate(policy, reference, eval_task, module=module, parallel=parallel)
            out.update({f"{name}/{k}" if name else k: v for k, v in result.items()})
        return out

    if ctx.enabled:
        log(f"{ctx.world} processes, strategy {cfg.distributed.strategy}, micro-batches dealt by {parallel.balance}")
    for line in parallel.describe():
        log(line)
    synced = cfg.reference.sync and copied  # TR-DPO: the reference moves, checkpoints keep it
    hooks = step_hooks(cfg, engine, module)
    cadence = Cadence(cfg.run, n_steps, metrics, ctx, evaluate=run_eval if feed.eval_tasks else None,
                      save=lambda done: save_checkpoint(run_dir, done, parts, _trainer_state(feed, plan),
                                                        cfg.run.keep_checkpoints, ctx,
                                                        with_reference=synced or feed.moves_reference),
                      stop_after_steps=stop_after_steps, log=log, boundary=feed.boundary,
                      step_done=feed.step_done)
    eval_before = cadence.begin(start, progress=progress)
    t_run, tokens_run = time.perf_counter(), 0.0
    last: dict[str, float] = {}
    max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else float("inf")
    nonfinite = NonFiniteSteps(cfg.optim.lr, log)
    with StopSignal(ctx) as stop:  # SIGTERM is handled between steps for the loop only
        for step in range(start, n_steps):
            t0 = time.perf_counter()
            with record_function("prefpack.plan_collate"):
                work = feed.step(step)
                if work is None:  # nothing to train at this step (a round whose samples all tied)
                    scheduler.step()  # the learning rate of step k stays a function of k
                    continue
                if work.reset_optimizer:
                    optimizer.state.clear()  # a fresh AdamW: what `rounds.optimizer: reset` asks at a round's start
                task, ids = work.objective, work.ids
                # a sequence group's ranks take the same share (each runs its token shards of it)
                share = parallel.share(task, ids, seed=work.key)
                batches = [task.collate(p) for p in share.planned]
                counted = parallel.counted(share.weights)  # a group's sums once
                if feed.reads_images and step + 1 < n_steps:  # the next step's images, meanwhile
                    ahead = feed.step(step + 1)
                    task.prefetch(parallel.share(ahead.objective, ahead.ids, seed=ahead.key).planned)
            optimizer.zero_grad(set_to_none=True)
            with record_function("prefpack.begin_step"):
                step_state = task.begin_step(module, reference, batches, weights=counted, dist=ctx)
            totals = StepTotals()
            # Every rank plans the same step, so its example count is known everywhere without communication.
            # Gradients are summed over ranks: DDP and FSDP2 average them, hence the factor world / n. With sequence
            # groups each rank's gradients are its token shards' share of its group's (group_sum passes the
            # gradient through), so the same factor holds.
            units = task.units(ids)  # the step's loss terms: its examples, or the pairs of its ranked prompts
            scale = ctx.world / units
            for i, (batch, weight) in enumerate(zip(batches, share.weights)):
                with grad_sync(module, enabled=i == len(batches) - 1):
                    with record_function("prefpack.forward_loss"):
                        out = task.loss(module, reference, batch, step_state)
                    with record_function("prefpack.backward"):
                        (out.loss.sum() * (scale * weight)).backward()
                release_images(batch)
                if weight:
                    totals.add(out, batch, counted=parallel.counts_sums)  # a sequence group's sums once
                    task.after_micro_batch(out)
            with record_function("prefpack.step_totals"):
                # the gradient norm is read with the step's sums, in one device-to-host transfer a step
                norm = clip_grad_norm(params, max_norm, to_host=False)
                (grad_norm,) = totals.settle(norm)
                totals = reduce_totals(totals, ctx)
            last = task.step_metrics(ids, totals.means())  # a mixture's NAME/pairs too
            with record_function("prefpack.optimizer"):
                lr = scheduler.get_last_lr()[0]
                # a NaN/inf step is skipped, not written into the weights; the schedule still advances, so the lr and
                # the data of step k stay functions of k (resume needs only the step)
                try:
                    update = nonfinite.check(step + 1, last["loss"], grad_norm, ids)
                except NonFiniteError:
                    cadence.abort()  # the metrics so far stay readable; every rank raises at the same step
                    raise
                if update:
                    optimizer.step()
                scheduler.step()
            if update:
                task.end_step(totals)  # running statistics from the step's sums over every rank
            for hook in hooks:  # TR-DPO's reference sync
                hook.after_step(step + 1)
            dt = time.perf_counter() - t0
            last.update({"lr": lr, "grad_norm": grad_norm, "epoch": work.epoch, "tokens/s": totals.real_tokens / dt,
                         "pairs/s": units / dt, "tokens": totals.real_tokens, "positions": totals.positions,
                         "scored": totals.scored, "skipped_steps": nonfinite.skipped, **work.metrics})
            tokens_run += totals.real_tokens
            cadence.after_step(step + 1, last)  # metrics line, bar, eval, checkpoint, stop: whatever is due
            if stop.due():  # SIGTERM: checkpoint this step, then stop (every rank here); after the last step too,
                # so a run stopped before its final evaluation and model resumes to them instead of losing its steps
                cadence.terminate(step + 1, stop.signum)
    eval_after = cadence.finish()
    return StepsRun(eval_before, eval_after, last, cadence.interval, start, t_run, tokens_run, params, optimizer,
                    parts, module)


def _trainer_state(feed, plan: dict | None) -> dict[str, Any]:
    """What a checkpoint's trainer_state.json holds besides the step: the objective's state and the run's plan."""
    return {**feed.state_dict(), PLAN_KEY: plan} if plan is not None else feed.state_dict()


def _resume(run_dir: Path, parts: Checkpointed, n_steps: int, metrics, ctx: Dist, log, plan: dict | None = None,
            allow_plan_change: bool = False) -> tuple[dict[str, Any], int]:
    """(trainer state, first step) from the newest intact checkpoint, with the metrics logged after that step
    dropped; ({}, 0) when there is none. A checkpoint whose plan differs from ``plan`` is refused (plan_check)."""
    from prefpack.training.checkpoint import resume_from_checkpoints

    if latest_checkpoint(run_dir) is None:
        log(f"no checkpoint in {run_dir / 'checkpoints'}; starting from step 0")
        return {}, 0
    # the newest checkpoint that matches its checksums and loads; damaged ones are reported and set aside
    ckpt, state = resume_from_checkpoints(run_dir, lambda path: load_checkpoint(path, parts, ctx), ctx=ctx, log=log)
    start = int(state.pop("step"))
    check_plan(state.pop(PLAN_KEY, None), plan, ckpt, allow_change=allow_plan_change, log=log)
    if start > n_steps:
        raise ModelError(f"{ckpt} is at step {start}, past this config's {n_steps} steps (train.max_steps / "
                         "train.epochs); its final model would not be the one this config asks for")
    metrics.truncate_after(start)
    log(f"resumed from {ckpt} at step {start}")
    return state, start


def _free_training_state(optimizer, reference, parts: Checkpointed) -> None:
    """Training state is not needed to save the result: free it first, so saving never raises the run's peak."""
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()
    reference.release()
    parts.reference = parts.reference_module = None
    release_freed_memory()


def _quiet(*_args, **_kwargs) -> None:
    return None
