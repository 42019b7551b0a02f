"""Where a stopped rounds run stands, for the hint after Ctrl-C or SIGTERM: the round and phase it stopped in and what
``--resume`` continues from there (the samples file, the scoring partial, or the newest training checkpoint: the
run's, ``RUN_DIR/checkpoints``, for rounds in one process; the round's, ``RUN_DIR/rounds/NNN/train/checkpoints``,
for rounds run as separate trainings)."""

from __future__ import annotations

import re
from pathlib import Path

from prefpack.rounds import plan
from prefpack.rounds.metrics import ROUND_FILE, read_json

_SCORED_CHUNK = re.compile(r"rows-\d+-(\d+)\.json")  # prefpack.rewards.partial's checkpoint files


def stopped_round(cfg) -> int:
    """The first round (from 0) without its ``round.json``: the one a resumed run continues."""
    run_dir = Path(cfg.run.output_dir)
    count = cfg.rounds.count
    return next((r for r in range(count) if not (plan.round_dir(run_dir, r) / ROUND_FILE).is_file()), count)


def where_stopped(cfg) -> str:
    """One clause: the round and phase the run stopped in, and what ``--resume`` continues from."""
    from prefpack.training.checkpoint import checkpoint_step, latest_checkpoint

    run_dir, count = Path(cfg.run.output_dir), cfg.rounds.count
    r = stopped_round(cfg)
    if r == count:
        return f"all {count} rounds are done (resuming only prints their summary)"
    folder = plan.round_dir(run_dir, r)
    head = f"round {r + 1} of {count} ({folder})"
    if not read_json(folder / "samples.meta.json").get("complete"):
        return (f"{head} stopped while sampling its prompts: {_complete_lines(folder / 'samples.jsonl')} prompts are "
                "sampled in samples.jsonl, and resuming samples the rest")
    tied = (folder / plan.NO_PAIRS_FILE).is_file()
    if not tied and not (folder / "store" / "meta.json").is_file():
        return (f"{head} stopped while scoring its samples: {_scored_rows(folder / 'store.partial')} rows are scored "
                "in store.partial, and resuming scores the rest")
    if cfg.rounds.eval_prompts and not (folder / "eval_scores.jsonl").is_file():
        return f"{head} stopped while sampling and scoring its held-out prompts; resuming continues them"
    if tied:
        return f"{head} found every prompt's samples tied (nothing to train on); resuming records the round"
    if plan.why_restart(cfg) is None:  # in one process: the run's checkpoints, steps counted from round 1's first
        last = latest_checkpoint(run_dir)
        if last is None:
            return (f"{head} stopped in training before the run's first checkpoint (run.save_every="
                    f"{cfg.run.save_every}), so resuming trains from step 0, the samples and stores kept")
        return f"{head} stopped in training; the run's last checkpoint is step {checkpoint_step(last)} ({last})"
    train_dir = folder / "train"
    last = latest_checkpoint(train_dir)
    if last is None:
        return (f"{head} stopped in training before its first checkpoint (run.save_every={cfg.run.save_every}), so "
                "resuming trains the round again from its step 0")
    return f"{head} stopped in training; its last checkpoint is step {checkpoint_step(last)} ({last})"


def _complete_lines(path: Path) -> int:
    """The rows written in a samples file and, under torchrun, in its ranks' part files."""
    from prefpack.generation.shards import part_files

    total = 0
    for file in [path, *(p for p in part_files(path) if p.suffix == ".jsonl")]:
        if file.is_file():
            with open(file, "rb") as fh:
                total += sum(1 for line in fh if line.endswith(b"\n"))
    return total


def _scored_rows(partial: Path) -> int:
    if not partial.is_dir():
        return 0
    ends = [int(m.group(1)) for p in partial.iterdir() if (m := _SCORED_CHUNK.fullmatch(p.name))]
    return max(ends, default=0)
