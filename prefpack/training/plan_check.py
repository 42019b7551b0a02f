"""A resumed run trains the batches it started with: each checkpoint records a signature of the run's plan, and a
resume compares it with the plan this prefpack builds.

A checkpoint restores only the step; the examples of step k are rebuilt from the stores, the config and the seed
(``StoreFeed.step``). The store and the config are checked elsewhere (``resume_check``), but the code that turns
them into examples can change between releases (``PairGroups``' group cap, the schedule's shuffle): a run resumed
with such a release would silently train other batches. The signature covers what the feed replays: the number of
examples and their token counts and prompt groups, the examples per epoch, the steps per epoch, and the order of
epoch 0's examples. Not the micro-batches: how a step is cut depends on memory settings, not on which examples it
trains. It is computed the same way on every rank (numpy, no communication).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefpack.config import ConfigError

__all__ = ["PLAN_KEY", "check_plan", "plan_signature"]

PLAN_KEY = "plan_signature"  # the key in a checkpoint's trainer_state.json
_UNITS = {"pairs": "pairs", "groups": "prompt groups", "unpaired": "examples"}


def _digest(*arrays: np.ndarray | None) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(b"-" if a is None else np.ascontiguousarray(a, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def plan_signature(feed: Any) -> dict[str, Any] | None:
    """The feed's plan in a few numbers and hashes; None for a feed whose examples are made during training (no
    ``schedule``: on-policy samples), which has no plan to replay."""
    schedule = getattr(feed, "schedule", None)
    if schedule is None:
        return None
    task = feed.objective
    n = len(task)
    tokens = task.example_tokens(np.arange(n, dtype=np.int64)) if n else np.zeros(0, dtype=np.int64)
    return {"unit": _UNITS.get(task.kind, "examples"), "examples": n, "per_epoch": int(schedule.num_pairs),
            "steps_per_epoch": int(schedule.steps_per_epoch), "examples_sha": _digest(tokens, task.schedule_groups()),
            "order_sha": _digest(schedule.epoch_order(0))}


def _difference(old: dict, new: dict) -> str | None:
    """What differs, in words, the most telling first; None when the plans are the same."""
    unit = new.get("unit", "examples")
    for key, what in (("examples", f"the store's {unit}"), ("per_epoch", f"{unit} per epoch"),
                      ("steps_per_epoch", "steps per epoch")):
        if old.get(key) != new.get(key):
            return f"{what}: {new.get(key)} now, {old.get(key)} when the run started"
    if old.get("examples_sha") != new.get("examples_sha"):
        return f"the {unit} themselves (as many, other tokens or prompt groups)"
    if old.get("order_sha") != new.get("order_sha"):
        return f"the order the steps take the {unit} in (same {unit}, another shuffle)"
    return None


def check_plan(recorded: Any, current: dict | None, ckpt: Path, *, allow_change: bool,
               log: Callable[[str], None] = print) -> None:
    """Refuse (ConfigError) a resume from ``ckpt`` whose plan differs from the one its run recorded, unless
    ``allow_change`` (--allow-config-change): then say so and go on with the new plan. A checkpoint written before
    plans were recorded resumes unchecked, said in one line."""
    if current is None:
        return
    if not isinstance(recorded, dict):
        log(f"note: {ckpt} records no plan signature (written by an older prefpack), so this resume cannot check "
            "that its steps train the batches the run started with")
        return
    what = _difference(recorded, current)
    if what is None:
        return
    if allow_change:
        log(f"note: resuming from {ckpt} with another plan than the run started with ({what}); continuing with "
            "the new plan (--allow-config-change)")
        return
    raise ConfigError(f"cannot resume from {ckpt}: this prefpack plans other batches than the run started with "
                      f"({what}); pass --allow-config-change to continue with the new plan, or start a new run "
                      "(another run.output_dir)")
