"""What the training loop trains, as one interface: an objective turns store examples into micro-batches and
per-example losses, and the loop (optimizer, accumulation, checkpoints, metrics, ranks) is the same for all.

The hooks are fixed and typed, called in this order for every step:

0. ``plan_step(ids, seed=...)`` once with the whole step's examples, before they are dealt to ranks
   (``prefpack.batching.deal.deal_step``): what depends on the whole step (KTO's KL partners) is drawn here, so a
   rank that plans only its share gets what one process would;
1. ``plan(ids, seed=...)`` then ``collate(planned)``: the step's micro-batches (``seed`` is a
   ``prefpack.batching.schedule.StepKey`` in training, None in evaluation);
2. ``begin_step(policy, reference, batches, weights, dist)`` -> a :class:`StepState`: what the whole step needs
   before any loss (KTO's KL reference point, all-reduced over ``dist``'s ranks); ``weights`` 0 marks a padding
   micro-batch a distributed loop runs only to keep collectives in step;
3. per micro-batch ``loss(policy, reference, batch, step)`` (per-example values, so the loop can divide by the
   step's example count whatever the packing) then ``after_micro_batch(out)``;
4. ``end_step(totals)`` with the step's sums already all-reduced over ranks (so a running statistic built from
   them is the same on every rank and does not depend on how the step was split);
5. ``state_dict()`` / ``load_state_dict()``: what the objective carries from step to step (BCO's running mean),
   saved in checkpoints and handed to the eval objective so evaluation scores as training does.

Every sequence a batch holds carries a key (``Batch.sequence_keys``) in the objective's :meth:`key_space`; the
reference is asked about the batches :meth:`reference_batches` names. ``precompute-ref`` is the objective evaluated
over its whole store with the reference recorded by key (``prefpack.training.precompute``), so a store kind is laid
out in one place, its objective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from prefpack.data.store import Store
from prefpack.distributed import SINGLE, Dist
from prefpack.losses import LossOutput
from prefpack.losses.reward import SQUARED, reward_std
from prefpack.objectives.settings import RunSettings
from prefpack.reference import KeySpace, Reference

__all__ = ["Objective", "Planned", "StepState", "StepTotals"]


@dataclass
class Planned:
    """One planned micro-batch: rows of global example ids, and its token counts (for dealing to ranks)."""

    rows: list[list[int]]
    real_tokens: int
    computed_tokens: int

    @property
    def num_examples(self) -> int:
        return sum(len(r) for r in self.rows)


@dataclass
class StepState:
    """What ``begin_step`` computed for a whole step (objectives extend it)."""


class Objective:
    """The base of every objective: the hooks the loop calls, with defaults for the optional ones."""

    kind = ""
    store: Store
    settings: RunSettings  # what the objective reads of the run, resolved (never the config)

    def __len__(self) -> int:
        raise NotImplementedError

    def example_tokens(self, ids: np.ndarray) -> np.ndarray:
        """Tokens each example costs, for balancing ranks."""
        raise NotImplementedError

    def schedule_groups(self) -> np.ndarray | None:
        """The prompt group of each example, for a shuffle that keeps a group's examples in one step (None: every
        example on its own)."""
        return None

    def units(self, ids: np.ndarray) -> int:
        """The per-example loss values a step's examples give, which the step's loss is averaged over: one per
        example, except ranked prompt groups, which give one per pair they yield."""
        return len(ids)

    def counts(self) -> dict[str, int]:
        """What its whole store gives, as ``prefpack eval`` reports it (default: the pairs)."""
        return {"pairs": self.units(np.arange(len(self)))}

    def step_metrics(self, ids: np.ndarray, means: dict[str, float]) -> dict[str, float]:
        """A step's metrics line from its all-reduced means and its ids (a mixture adds ``NAME/pairs`` and drops
        the metrics of the sources the step did not draw; default: ``means`` as they are)."""
        return means

    def plan_step(self, ids: np.ndarray, *, seed: Any) -> None:
        """Called once per step with the whole step's ``ids`` before they are dealt to ranks, so what depends on
        the whole step does not depend on the dealing (default: nothing)."""

    def plan(self, ids: np.ndarray, *, seed: Any) -> list[Planned]:
        raise NotImplementedError

    def collate(self, planned: Planned) -> Any:
        raise NotImplementedError

    def prefetch(self, planned: Sequence[Planned]) -> None:
        """Start reading and preprocessing these micro-batches' images on a background thread, so that their
        :meth:`collate` finds them ready (vision runs of an objective with a ``store`` and ``image_examples``:
        the store rows whose images each micro-batch's groups hold; otherwise nothing)."""
        vision = getattr(getattr(self, "settings", None), "vision", None)
        if vision is None or not hasattr(self, "image_examples"):
            return
        if getattr(self, "_images", None) is None:
            from prefpack.data.vision_inputs import ImagePrefetcher

            self._images = ImagePrefetcher(self.store, vision)
        self._images.submit_all([self.image_examples(p)[0] for p in planned])

    def key_space(self) -> KeySpace:
        """What this objective's sequence keys address (the table a sidecar of its store holds)."""
        raise NotImplementedError

    def reference_batches(self, batch: Any) -> list[Any]:
        """The sequence batches (``prefpack.batching.collate.Batch``) of a collated micro-batch whose reference sums
        the objective reads: the batch itself, unless the objective collates several (KTO: main and KL)."""
        return [batch]

    def forward_options(self) -> dict:
        """What the policy forward (``prefpack.model.forward.SequenceLogps``) must return besides the sums."""
        return {}

    def as_evaluation(self) -> None:
        """Called on an objective built to evaluate a store (``data.eval``), not to train on it (default: nothing;
        group policy gradients take the policy as it stands as the old policy there)."""

    def begin_step(self, policy: nn.Module, reference: Reference, batches: list[Any],
                   weights: list[float] | None = None, dist: Dist = SINGLE) -> StepState:
        """``weights``: one per micro-batch, 0 for a padding batch; ``dist``: the ranks to all-reduce step sums over."""
        return StepState()

    def loss(self, policy: nn.Module, reference: Reference, batch: Any, step: StepState) -> LossOutput:
        raise NotImplementedError

    def after_micro_batch(self, out: LossOutput) -> None:
        """Called after each micro-batch's loss (default: nothing)."""

    def end_step(self, totals: StepTotals) -> None:
        """Update the objective's running state from the step's all-reduced sums (default: none)."""

    def state_dict(self) -> dict[str, Any]:
        """The running state a checkpoint saves (JSON numbers); empty for most objectives."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no running state, got {sorted(state)}")


def release_images(batch: Any) -> None:
    """Drop the image features a micro-batch kept for its later forwards (``Batch.vision_cache``; a KTO batch's main
    and KL passes share one) once its loss is computed: the step's micro-batches are all collated up front, and
    their features would otherwise stay on the device until the step ends."""
    for part in (batch, getattr(batch, "main", None), getattr(batch, "kl", None)):
        cache = getattr(part, "vision_cache", None)
        if cache:
            cache.clear()


@dataclass
class StepTotals:
    """Sums over the examples of a step (or an eval pass), turned into means at the end."""

    examples: int = 0
    loss: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    real_tokens: int = 0
    computed_tokens: int = 0
    positions: int = 0  # real positions computed: real_tokens less the prompt tokens laid out once for a group
    scored: int = 0  # positions through the head: scored completion tokens (a store's unscored spans excluded)

    def add(self, out: LossOutput, batch: Any, counted: bool = True) -> None:
        """Add a micro-batch's sums; ``counted=False`` (another rank of a sequence group counts them) adds only its
        metric names, so every rank's all-reduced vector has the same keys."""
        if not counted:
            for k in out.metrics:
                self.metrics.setdefault(k, 0.0)
                self.counts.setdefault(k, 0.0)
            return
        self.examples += int(out.loss.shape[0])
        # The sums stay on the device until the step is settled (one transfer a step, not one per metric and
        # micro-batch: each would wait for the GPU to finish, and the host could not queue the next micro-batch).
        pending = self.__dict__.setdefault("_pending", {})
        for k, v in (("", out.loss), *out.metrics.items()):
            part = v.detach().double().sum()
            pending[k] = part if k not in pending else pending[k] + part
            if k:
                self.metrics.setdefault(k, 0.0)
                self.counts[k] = self.counts.get(k, 0.0) + float(v.numel())
        self.real_tokens += batch.real_tokens
        self.computed_tokens += batch.computed_tokens
        self.positions += batch.positions
        self.scored += batch.scored_positions

    def settle(self, *extra: torch.Tensor) -> list[float]:
        """Bring the device-side sums of :meth:`add` to the host, in one transfer, and add them to ``loss`` and
        ``metrics`` (float64 throughout: the same values as adding each micro-batch's sum on the host). ``extra``
        scalars (the step's gradient norm) ride along in the same transfer; returns their values."""
        pending = self.__dict__.pop("_pending", None) or {}
        pending.update({i: t.detach().double().reshape(()) for i, t in enumerate(extra)})
        by_device: dict = {}
        for k, t in pending.items():
            by_device.setdefault(t.device, []).append(k)
        read = [0.0] * len(extra)
        for keys in by_device.values():  # one transfer per device (all on the model's, in practice)
            for k, v in zip(keys, torch.stack([pending[k] for k in keys]).tolist()):
                if isinstance(k, int):
                    read[k] = v
                elif k:
                    self.metrics[k] = self.metrics.get(k, 0.0) + v
                else:
                    self.loss += v
        return read

    def as_vector(self, keys: list[str]) -> torch.Tensor:
        """Everything as one float64 vector (one all-reduce per step across ranks)."""
        self.settle()
        vals = [self.examples, self.loss, self.real_tokens, self.computed_tokens, self.positions, self.scored]
        for k in keys:
            vals.extend([self.metrics.get(k, 0.0), self.counts.get(k, 0.0)])
        return torch.tensor(vals, dtype=torch.float64)

    @classmethod
    def from_vector(cls, vec: torch.Tensor, keys: list[str]) -> StepTotals:
        v = vec.tolist()
        out = cls(examples=int(v[0]), loss=v[1], real_tokens=int(v[2]), computed_tokens=int(v[3]),
                  positions=int(v[4]), scored=int(v[5]))
        for i, k in enumerate(keys):
            out.metrics[k], out.counts[k] = v[6 + 2 * i], v[7 + 2 * i]
        return out

    def means(self) -> dict[str, float]:
        self.settle()
        out = {"loss": self.loss / max(self.examples, 1)}
        # a metric may cover a subset of examples (e.g. KTO's desirable ones): divide by its own count
        out.update({k: v / max(self.counts.get(k, 0.0), 1.0) for k, v in sorted(self.metrics.items())})
        for k in [k for k in out if k.endswith(SQUARED)]:  # NAME^2: NAME's standard deviation (reward models)
            base = k[:-len(SQUARED)]
            out[f"{base}_std"] = reward_std(out.get(base, 0.0), out.pop(k))
        out["filling"] = self.positions / max(self.computed_tokens, 1)  # padding's share: real positions / computed
        return out
