"""The round driver: for each round, generate (the round's policy samples every prompt k times), score (the samples
ranked by the reward function or model, pairs drawn, the round's pair store written), train (the training loop on
that store for ``rounds.steps_per_round`` steps, its learning rate one part of a schedule over every round).

Each phase resumes the way its own command does: the samples file continues, the score partial continues, the
round's training run resumes from its newest checkpoint; a finished phase's output is never written again. The
policy each round samples is the last round's saved final model (the initial model first), read from disk, so a
resumed run samples exactly what an uninterrupted one samples, and a vLLM server serves the same folder. A round after
the first whose samples all tie (the policy has learned its prompts) is recorded and trains nothing; the next round
samples the same policy. In the first round that is an error: the reward is too sparse for the initial policy.

Under torchrun (``prefpack.rounds.ranks``) the ranks share the sampling (prefpack.generation.shards: the samples of
one process), rank 0 alone scores, writes the run's files and talks to a vLLM server while the others wait, and every
rank trains (DDP or FSDP2, in the one process group of the run).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefpack.rounds import plan
from prefpack.rounds.metrics import ROUND_FILE, copy_training_lines, drop_unfinished, read_json, record_phase
from prefpack.rounds.phases import (  # noqa: F401 - the phases' names, imported from here by tests and callers
    RoundsError,
    RoundsInterrupted,
    RoundsResult,
    _eval_prompts,
    _generate,
    _open_run_dir,
    _quiet,
    _record,
    _score,
)
from prefpack.rounds.ranks import Ranks
from prefpack.rounds.reference import precompute_round_reference
from prefpack.training.cadence import TrainingInterrupted


def run_rounds(cfg, *, resume: bool = False, log=print, progress: bool = True,
               stop_at: tuple[int, str, int] | None = None, stop_after_steps: int | None = None) -> RoundsResult:
    """The rounds under the run folder's lock (rank 0 takes it: one `prefpack train` at a time on a run folder, in
    every phase); see :func:`_run_rounds`."""
    import os

    from prefpack.training.run_folder import RunLock

    if int(os.environ.get("RANK", "0")) != 0:
        return _run_rounds(cfg, resume=resume, log=log, progress=progress, stop_at=stop_at,
                           stop_after_steps=stop_after_steps)
    lock = RunLock(cfg.run.output_dir, log=log)
    try:
        return _run_rounds(cfg, resume=resume, log=log, progress=progress, stop_at=stop_at,
                           stop_after_steps=stop_after_steps)
    finally:
        lock.release()


def _run_rounds(cfg, *, resume: bool = False, log=print, progress: bool = True,
                stop_at: tuple[int, str, int] | None = None, stop_after_steps: int | None = None) -> RoundsResult:
    """Run ``cfg.rounds.count`` rounds into ``run.output_dir``. ``stop_at`` = (round, phase, count), tests only:
    stop as if killed after ``count`` generate calls / scored rows / training steps of that round's phase."""
    from prefpack.distributed import init_from_env
    from prefpack.metrics import MetricsLogger
    from prefpack.training.setup import check_trainable

    check_trainable(cfg)
    plan.check_prompt_subset(cfg)
    why = plan.why_restart(cfg)
    if why is None:  # the default: every round in this one training process
        from prefpack.rounds.live import run_in_process

        return run_in_process(cfg, resume=resume, log=log, progress=progress, stop_at=stop_at,
                              stop_after_steps=stop_after_steps)
    if not cfg.rounds.save_each_round:
        raise RoundsError(f"rounds.save_each_round=false runs the rounds in one process, and {why}; set "
                          "rounds.save_each_round=true")
    ranks = Ranks(init_from_env(cfg.train.device))  # train() finds the group joined: one group for the whole run
    if not ranks.is_main:
        log, progress = _quiet, False
    run_dir = Path(cfg.run.output_dir)
    rc = cfg.rounds
    total = rc.count * rc.steps_per_round
    finished = next((r for r in range(rc.count) if not (plan.round_dir(run_dir, r) / ROUND_FILE).is_file()), rc.count)

    def open_run() -> None:
        _open_run_dir(cfg, resume)
        dropped = drop_unfinished(run_dir, finished)
        if resume:
            log(f"resuming at round {finished + 1} of {rc.count}" + (f" ({dropped} metrics lines of it dropped)"
                                                                     if dropped else ""))

    ranks.main_only("opening the run folder", open_run)
    if not cfg.rounds.in_process or cfg.rounds.optimizer == "keep":
        log(f"note: each round runs as a whole training run ({why}): the policy is read back from its saved folder "
            "and each round starts a fresh optimizer")
    result = RoundsResult(run_dir)
    metrics = MetricsLogger.from_config(cfg, run_dir, resume=True, enabled=ranks.is_main)
    try:
        for r in range(rc.count):
            folder = plan.round_dir(run_dir, r)
            if r < finished:
                result.rounds.append(read_json(folder / ROUND_FILE))
                continue
            folder.mkdir(parents=True, exist_ok=True)
            adapter = plan.adapter_of(cfg, run_dir, r) if rc.engine == "transformers" else None  # vLLM: merged
            log(f"round {r + 1}/{rc.count}: policy " + (f"{plan.initial_policy(cfg)} + adapter {adapter}"
                                                         if adapter else plan.policy_of(cfg, run_dir, r)))
            stop = stop_at[1:] if stop_at is not None and stop_at[0] == r else None
            line = _round(cfg, run_dir, r, total, metrics, stop, log, progress, ranks)
            result.rounds.append(line)
            # a round that trained nothing left no_pairs.json; a ranked round (policy_gradient) has no pairs' counts
            if (folder / plan.NO_PAIRS_FILE).is_file():
                log(f"round {r + 1}: every prompt's samples tie (reward mean {line['reward/mean']:.3f}): nothing to "
                    "train on; the policy carries over")
            else:
                drawn = (f"{line['pairs']} pairs, {line['tied_prompts']} tied prompts skipped" if "pairs" in line
                         else f"{line['samples']} samples of {line['prompts']} prompts ranked")
                log(f"round {r + 1}: sample reward mean {line['reward/mean']:.4f} (min {line['reward/min']:.3f}, "
                    f"max {line['reward/max']:.3f}), {drawn}")
    finally:
        metrics.close()
    result.final_dir = Path(plan.policy_of(cfg, run_dir, rc.count))
    if cfg.run.plot and ranks.is_main:
        from prefpack.plot import try_plot

        try_plot(run_dir, log)
    return result


def _round(cfg, run_dir: Path, r: int, total: int, metrics, stop, log, progress: bool, ranks: Ranks) -> dict:
    from prefpack.training import train

    folder = plan.round_dir(run_dir, r)
    samples = folder / "samples.jsonl"
    _generate(cfg, run_dir, r, cfg.rounds.prompts, samples, "generate", stop, log, ranks)
    store, tied = folder / "store", folder / plan.NO_PAIRS_FILE
    if not (store / "meta.json").is_file() and not tied.is_file():
        ranks.main_only(f"scoring round {r + 1}'s samples", lambda: _score(cfg, r, samples, store, stop, log))
    trains = not tied.is_file()  # rank 0 wrote it when every prompt tied; every rank reads it
    if trains and cfg.reference.mode == "precomputed":  # rank 0 computes the sidecars every rank's training reads
        ranks.main_only(f"computing round {r + 1}'s reference log-probs",
                        lambda: precompute_round_reference(cfg, run_dir, r, log))
    eval_scores = _eval_prompts(cfg, run_dir, r, stop, log, ranks) if cfg.rounds.eval_prompts else None
    steps = cfg.rounds.steps_per_round
    if not trains:  # nothing to train on: the round is recorded, its policy carries over (plan.last_trained)
        ranks.main_only(f"recording round {r + 1}",
                        lambda: _record(metrics, r, r * steps, samples, read_json(tied), None, eval_scores))
        return read_json(folder / ROUND_FILE)
    t0 = time.perf_counter()
    train_cfg = plan.train_config(cfg, run_dir, r)
    train_dir = Path(train_cfg.run.output_dir)
    resume = train_dir.is_dir() and any(train_dir.iterdir())
    ranks.together(f"starting round {r + 1}'s training", lambda: None)  # each rank read the folder before rank 0 fills it
    stop_steps = stop[1] if stop is not None and stop[0] == "train" else None
    try:
        result = train(train_cfg, resume=resume, log=log, progress=progress, stop_after_steps=stop_steps,
                       schedule_span=(r * steps, total))
    except TrainingInterrupted as exc:
        raise RoundsInterrupted(str(exc)) from None

    def record() -> None:
        from prefpack.data.store import Store

        record_phase(folder, "train", seconds=time.perf_counter() - t0)
        copy_training_lines(metrics, train_dir, r, r * steps)
        _record(metrics, r, r * steps, samples, Store(store).meta, result.eval_after, eval_scores)

    ranks.main_only(f"recording round {r + 1}", record)
    return read_json(folder / ROUND_FILE)


