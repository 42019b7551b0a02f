"""Several training stores as one objective: each source's own objective plans, collates and scores its examples;
this one routes global ids (source ``i`` owns ``offset_i .. offset_i + len_i``) and names the metrics by source.

A micro-batch holds one source's examples (each store keeps its layout, its sidecar and its sequence keys); the
step's loss is still the sum over every example divided by the step's units, so packing, accumulation and ranks do
not change it. Running state (bco_pair_running's mean) is the run's: every source is updated with the whole step's
sums, as one store would be; so is KTO's step state (z0 and class counts), from every source's sums at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefpack.losses import LossOutput
from prefpack.objectives.base import Objective, Planned, StepState, StepTotals
from prefpack.reference import KeySpace

__all__ = ["MixtureObjective", "SourcePlanned"]


@dataclass
class SourcePlanned(Planned):
    """A micro-batch of one source: global rows (for dealing), and the source objective's own plan."""

    source: int = 0
    inner: Any = None


@dataclass
class MixtureState(StepState):
    states: list[StepState] = field(default_factory=list)


class MixtureObjective(Objective):
    """Routes a step's examples to the objectives of its sources; metrics also as ``NAME/...`` per source."""

    kind = "mixture"

    def __init__(self, names: list[str], tasks: list[Objective]):
        self.names, self.tasks = list(names), list(tasks)
        self.store, self.settings = tasks[0].store, tasks[0].settings
        self.offsets = np.concatenate([[0], np.cumsum([len(t) for t in tasks])]).astype(np.int64)
        self._last = 0

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def sizes(self) -> list[int]:
        return [len(t) for t in self.tasks]

    def split(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(source, local ids in the order given) for each source the ids touch."""
        ids = np.asarray(ids, dtype=np.int64)
        src = np.searchsorted(self.offsets, ids, side="right") - 1
        return [(i, ids[src == i] - self.offsets[i]) for i in range(len(self.tasks)) if (src == i).any()]

    def example_tokens(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros(len(ids), dtype=np.int64)
        src = np.searchsorted(self.offsets, ids, side="right") - 1
        for i, local in self.split(ids):
            out[src == i] = self.tasks[i].example_tokens(local)
        return out

    def schedule_groups(self) -> np.ndarray | None:
        groups = [t.schedule_groups() for t in self.tasks]
        if all(g is None for g in groups):
            return None
        out, base = [], 0
        for t, g in zip(self.tasks, groups):
            g = np.arange(len(t)) if g is None else np.asarray(g, dtype=np.int64)
            out.append(g + base)
            base += int(g.max()) + 1 if len(g) else 0
        return np.concatenate(out)

    def source_groups(self) -> list[np.ndarray | None]:
        return [t.schedule_groups() for t in self.tasks]

    def units(self, ids: np.ndarray) -> int:
        return sum(self.tasks[i].units(local) for i, local in self.split(ids))

    def step_metrics(self, ids: np.ndarray, means: dict[str, float]) -> dict[str, float]:
        """``NAME/pairs``: the units (pairs) each source gives the step, every source named (0 when not drawn, and
        then none of its other ``NAME/...`` metrics, which would read 0)."""
        counts = dict.fromkeys(self.names, 0)
        for i, local in self.split(ids):
            counts[self.names[i]] = self.tasks[i].units(local)
        undrawn = tuple(f"{n}/" for n, c in counts.items() if not c)
        out = {k: v for k, v in means.items() if not (undrawn and k.startswith(undrawn))}
        out.update({f"{n}/pairs": float(c) for n, c in counts.items()})
        return out

    def plan_step(self, ids: np.ndarray, *, seed: Any) -> None:
        for i, local in self.split(ids):
            self.tasks[i].plan_step(local, seed=seed)

    def plan(self, ids: np.ndarray, *, seed: Any) -> list[Planned]:
        out: list[Planned] = []
        for i, local in self.split(ids):
            off = int(self.offsets[i])
            for p in self.tasks[i].plan(local, seed=seed):
                rows = [[int(x) + off for x in r] for r in p.rows]
                out.append(SourcePlanned(rows, p.real_tokens, p.computed_tokens, source=i, inner=p))
        return out

    def collate(self, planned: SourcePlanned) -> Any:
        batch = self.tasks[planned.source].collate(planned.inner)
        batch.mix_source = planned.source
        return batch

    def prefetch(self, planned: Sequence[SourcePlanned]) -> None:
        for i, task in enumerate(self.tasks):
            mine = [p.inner for p in planned if p.source == i]
            if mine:
                task.prefetch(mine)

    def key_space(self) -> KeySpace:
        raise NotImplementedError("a mixture has no key space of its own: each source's objective has its store's")

    def reference_batches(self, batch: Any) -> list[Any]:
        return self.tasks[batch.mix_source].reference_batches(batch)

    def forward_options(self) -> dict:
        out: dict = {}
        for t in self.tasks:
            for k, v in t.forward_options().items():
                out[k] = bool(out.get(k)) or bool(v)
        return out

    def begin_step(self, policy, reference, batches, weights=None, dist=None) -> MixtureState:
        weights = weights if weights is not None else [1.0] * len(batches)
        if all(hasattr(t, "step_sums") for t in self.tasks):  # KTO: z0 and class counts over the whole step
            acc = sum(t.step_sums(policy, reference, *self._mine(i, batches, weights))
                      for i, t in enumerate(self.tasks))
            if dist is not None:
                dist.all_reduce_sum(acc)
            return MixtureState(states=[t.step_state(acc) for t in self.tasks])
        states = []
        for i, t in enumerate(self.tasks):  # every source, in order, on every rank (collectives stay in step)
            mine, mine_weights = self._mine(i, batches, weights)
            kwargs = {} if dist is None else {"dist": dist}
            states.append(t.begin_step(policy, reference, mine, weights=mine_weights, **kwargs))
        return MixtureState(states=states)

    @staticmethod
    def _mine(i: int, batches: list, weights: list) -> tuple[list, list]:
        """Source ``i``'s micro-batches of a step and their weights."""
        mine = [k for k, b in enumerate(batches) if b.mix_source == i]
        return [batches[k] for k in mine], [weights[k] for k in mine]

    def loss(self, policy, reference, batch, step: MixtureState) -> LossOutput:
        i = self._last = batch.mix_source
        out = self.tasks[i].loss(policy, reference, batch, step.states[i])
        per_source = {"loss": out.loss.detach(), **out.metrics}
        for j, name in enumerate(self.names):  # every source's keys in every batch: ranks all-reduce the same ones
            for k, v in per_source.items():
                out.metrics[f"{name}/{k}"] = v if j == i else v.reshape(-1)[:0]
        return out

    def after_micro_batch(self, out: LossOutput) -> None:
        self.tasks[self._last].after_micro_batch(out)

    def end_step(self, totals: StepTotals) -> None:
        for t in self.tasks:
            t.end_step(totals)

    def state_dict(self) -> dict[str, Any]:
        return self.tasks[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for t in self.tasks:
            t.load_state_dict(state)
