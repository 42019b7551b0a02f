"""On-policy rounds in one training process: the run's engine built once (the policy loaded once), the training
loop run over every round's steps with one optimizer and one learning-rate schedule, and the rounds as its feed
(:class:`prefpack.rounds.feed.RolloutFeed`: each round's samples drawn from the policy in memory, scored, written as
the round driver writes them). Checkpoints are the run's (``RUN_DIR/checkpoints``, the step counted from the first
round); each round's model is exported to ``rounds/NNN/train/final`` when the round ends.
"""

from __future__ import annotations

from pathlib import Path

from prefpack.rounds import plan
from prefpack.rounds.metrics import ROUND_FILE, read_json

__all__ = ["run_in_process"]


def run_in_process(cfg, *, resume: bool = False, log=print, progress: bool = True,
                   stop_at: tuple[int, str, int] | None = None, stop_after_steps: int | None = None):
    """``cfg.rounds.count`` rounds into ``run.output_dir`` in this process (see the module doc); ``stop_at`` as
    :func:`prefpack.rounds.driver.run_rounds`'s; ``stop_after_steps``: stop as a kill would after that many steps of
    the run (``--stop-after-steps``, tests)."""
    from prefpack.parallel import start_parallel
    from prefpack.rounds.feed import RolloutFeed
    from prefpack.rounds.phases import RoundsInterrupted, RoundsResult, _open_run_dir, _quiet
    from prefpack.rounds.ranks import Ranks
    from prefpack.training.cadence import TrainingInterrupted
    from prefpack.training.checkpoint import latest_checkpoint
    from prefpack.training.loop import run_steps
    from prefpack.training.setup import build

    parallel = start_parallel(cfg.train.device, cfg.distributed.sequence_parallel, balance=cfg.distributed.balance)
    ranks = Ranks(parallel.dist)
    if not ranks.is_main:
        log, progress = _quiet, False
    run_dir = Path(cfg.run.output_dir)
    rc = cfg.rounds
    result = RoundsResult(run_dir)
    finished = next((r for r in range(rc.count) if not (plan.round_dir(run_dir, r) / ROUND_FILE).is_file()), rc.count)

    def open_run() -> None:
        _open_run_dir(cfg, resume)
        metrics = run_dir / "metrics.jsonl"
        if resume and latest_checkpoint(run_dir) is None and metrics.is_file():
            metrics.write_text("", encoding="utf-8")  # no checkpoint: the run starts at step 0, its lines again
        if resume:
            log(f"resuming at round {finished + 1} of {rc.count}")

    ranks.main_only("opening the run folder", open_run)
    if finished < rc.count:
        engine_cfg = plan.train_config(cfg, run_dir, 0)  # round 1's: the initial policy and reference
        engine_cfg.data.train = None
        engine_cfg.train.max_steps = None

        def make_feed(cfg_, stores, engine, *, pad_id, tokenizer, log):
            return RolloutFeed(cfg, run_dir, stores, engine, pad_id=pad_id, tokenizer=tokenizer, ranks=ranks,
                               log=log, stop_at=stop_at)

        setup = build(engine_cfg, log=log, parallel=parallel, make_feed=make_feed)
        stop_steps = stop_after_steps
        if stop_at is not None and stop_at[1] == "train":
            stop_steps = stop_at[0] * rc.steps_per_round + stop_at[2]
        try:
            run_steps(cfg, setup, run_dir, resume=resume, log=log, progress=progress, stop_after_steps=stop_steps)
        except TrainingInterrupted as exc:
            raise RoundsInterrupted(str(exc)) from None
        finally:
            setup.feed.close()  # a vLLM server the run started
    result.rounds = [read_json(plan.round_dir(run_dir, r) / ROUND_FILE) for r in range(rc.count)]
    result.final_dir = Path(plan.policy_of(cfg, run_dir, rc.count))
    if cfg.run.plot and ranks.is_main:
        from prefpack.plot import try_plot

        try_plot(run_dir, log)
    parallel.dist.barrier()
    return result
