"""Dealing one optimizer step's examples to the ranks: each rank plans its own share, and every rank runs the same
number of micro-batches (padding ones weigh 0) so FSDP2's collective forwards stay in step. Pure planning: the same
answer on every rank, no communication."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Share", "deal_step", "rank_tokens"]


@dataclass
class Share:
    """One rank's micro-batches for a step; padding entries have weight 0 and are not counted."""

    planned: list[Any]
    weights: list[float]


def deal_step(task, ids: np.ndarray, *, seed: Any, world: int, balance: str = "tokens") -> list[Share]:
    """Every rank's micro-batches for one step (the same answer on every rank). ``task.plan_step`` sees the whole
    step first, once, so what it draws for the step is the same whatever the world size and the dealing (a task
    without the hook, a bare planner, plans as before)."""
    plan_step = getattr(task, "plan_step", None)
    if plan_step is not None:
        plan_step(ids, seed=seed)
    if world == 1:
        planned = task.plan(ids, seed=seed)
        return [Share(planned, [1.0] * len(planned))]
    if balance == "count":
        shares = [task.plan(part, seed=seed) if len(part) else [] for part in np.array_split(ids, world)]
    elif balance == "tokens":
        # Deal pairs (fine-grained) largest first to the rank with the fewest tokens so far, then let each
        # rank pack its own; dealing whole micro-batches instead leaves a coarser, worse balance.
        # Examples of one prompt group (``task.schedule_groups()``) go to one rank together: their prompt is laid
        # out once only if they share a micro-batch.
        sizes = task.example_tokens(ids)
        groups = getattr(task, "schedule_groups", lambda: None)()
        keys = np.asarray(groups)[ids] if groups is not None else np.arange(len(ids))
        _, blocks = np.unique(keys, return_inverse=True)
        members = [np.flatnonzero(blocks == b) for b in range(int(blocks.max()) + 1)] if len(ids) else []
        parts: list[list[int]] = [[] for _ in range(world)]
        load = [0] * world
        for m in sorted(members, key=lambda m: (-int(sizes[m].sum()), int(m[0]))):
            r = min(range(world), key=lambda j: (load[j], j))
            parts[r].extend(int(ids[k]) for k in m)
            load[r] += int(sizes[m].sum())
        shares = [task.plan(np.asarray(part, dtype=np.int64), seed=seed) if part else [] for part in parts]
    else:
        raise ValueError(f"unknown balance {balance!r}; choose tokens or count")
    every = [p for s in shares for p in s]
    filler = min(every, key=lambda p: p.computed_tokens) if every else None
    longest = max(len(s) for s in shares)
    out = []
    for s in shares:
        pad = longest - len(s)
        out.append(Share(s + [filler] * pad, [1.0] * len(s) + [0.0] * pad))
    return out


def rank_tokens(shares: list[Share]) -> list[int]:
    """Computed positions per rank (padding micro-batches included: they cost time too)."""
    return [sum(p.computed_tokens for p in s.planned) for s in shares]
