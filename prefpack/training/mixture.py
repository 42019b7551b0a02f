"""A run's training schedule (one store, or a mixture of stores) and the mixture's line at start."""

from __future__ import annotations

from prefpack.batching.mixture import MixtureSchedule, epoch_counts
from prefpack.batching.schedule import StepSchedule
from prefpack.config.mixture import train_sources
from prefpack.objectives import Objective
from prefpack.objectives.mixture import MixtureObjective

__all__ = ["describe_mixture", "make_schedule"]

_UNITS = {"pairs": "pairs", "groups": "prompt groups", "unpaired": "examples"}


def make_schedule(cfg, task: Objective) -> StepSchedule | MixtureSchedule:
    """Which examples each step takes: ``StepSchedule`` for one store, ``MixtureSchedule`` for a ``data.train`` list
    (a one-entry list takes exactly ``StepSchedule``'s order)."""
    tr = cfg.train
    if not isinstance(task, MixtureObjective):
        return StepSchedule(len(task), tr.global_batch_pairs, tr.seed, cfg.data.shuffle, task.schedule_groups())
    specs = train_sources(cfg.data.train)
    counts = epoch_counts(task.sizes(), [s.weight for s in specs], [s.pairs for s in specs])
    return MixtureSchedule(task.sizes(), counts, tr.global_batch_pairs, tr.seed, cfg.data.shuffle,
                           task.source_groups())


def describe_mixture(cfg, task: Objective) -> list[str]:
    """The mixture per epoch, one line per source (nothing for a single store given as a string)."""
    if not isinstance(task, MixtureObjective):
        return []
    sched = make_schedule(cfg, task)
    specs = train_sources(cfg.data.train)
    total = max(sched.num_pairs, 1)
    lines = [f"mixture of {len(specs)} store(s): {sched.num_pairs} examples per epoch, {sched.steps_per_epoch} "
             f"steps of {cfg.train.global_batch_pairs}"]
    for spec, t, n in zip(specs, task.tasks, sched.counts):
        unit = _UNITS.get(t.kind, "examples")
        how = f"pairs={spec.pairs}" if spec.pairs is not None else f"weight={spec.weight:g}"
        lines.append(f"  {spec.name}: {n} {unit} per epoch ({100 * n / total:.1f}%, {how}) of {len(t)} in "
                     f"{spec.path}")
        if n == 0:
            lines.append(f"warning: data.train source {spec.name!r} gets no example per epoch (its weight is too small "
                         "for the stores' total size): raise its weight or give it `pairs:`")
    if cfg.train.global_batch_pairs > sched.num_pairs:
        lines.append(f"warning: train.global_batch_pairs={cfg.train.global_batch_pairs} is larger than the mixture's "
                     f"{sched.num_pairs} examples per epoch: every step takes a whole epoch. Lower it to at most "
                     f"{sched.num_pairs}")
    return lines
