"""What runs after an optimizer step, besides the step itself: :class:`StepHook` objects, each one job, run by the
loop in order once the update is written (before the step's metrics line, evaluation and checkpoint). TR-DPO's
reference sync is the first; a sampler that takes the policy's weights every N steps is the next kind.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from prefpack.reference import sync_reference

__all__ = ["ReferenceSync", "StepHook", "step_hooks"]


class StepHook(Protocol):
    def after_step(self, done: int) -> None: ...  # ``done``: steps finished, counted from 1


class ReferenceSync:
    """TR-DPO: every ``every`` steps the reference moves toward the policy, ``ref = alpha * policy + (1 - alpha) *
    ref`` (TRL's ``global_step % ref_model_sync_steps == 0``); ``wrappers``: FSDP2's modules, resharded after."""

    def __init__(self, policy: nn.Module, reference: nn.Module, *, every: int, alpha: float,
                 wrappers: tuple = ()):
        self.policy, self.reference, self.every, self.alpha, self.wrappers = policy, reference, every, alpha, wrappers

    def after_step(self, done: int) -> None:
        if done % self.every == 0:
            sync_reference(self.policy, self.reference, self.alpha, wrappers=self.wrappers)


def step_hooks(cfg, engine, module: nn.Module) -> list[StepHook]:
    """The config's hooks for a run whose engine is built and wrapped (``module``: the policy's wrapped forward)."""
    reference, ctx = engine.reference, engine.parallel.dist
    hooks: list[StepHook] = []
    if cfg.reference.sync and reference.model is not None:  # a copied reference moves (TR-DPO); checkpoints keep it
        fsdp = cfg.distributed.strategy == "fsdp2" and ctx.enabled
        hooks.append(ReferenceSync(engine.policy, reference.model, every=cfg.reference.sync_steps,
                                   alpha=cfg.reference.mixup_alpha,
                                   wrappers=(module, reference.module) if fsdp else ()))
    return hooks
