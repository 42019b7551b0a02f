"""The activation-checkpointing stage (``model.gradient_checkpointing``; ``auto`` follows ``train.memory`` on the
device), and the note a pure-bfloat16 run gets about updates too small for its weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from prefpack.engine.budgets import checkpointing_on
from prefpack.precision import pure_bfloat16_warning

if TYPE_CHECKING:
    from prefpack.engine.core import Engine


class CheckpointingStage:
    name = "checkpointing"

    def apply(self, engine: Engine, log) -> None:
        cfg, policy = engine.cfg, engine.policy
        if checkpointing_on(cfg.model.gradient_checkpointing, engine.device, cfg.train.memory):
            enable_checkpointing(policy)
        if engine.precision.weights == torch.bfloat16 and cfg.optim.master_dtype == "bfloat16":
            log(pure_bfloat16_warning([p for p in policy.parameters() if p.requires_grad], cfg.optim.lr))


def enable_checkpointing(policy: nn.Module) -> None:
    """Non-reentrant activation checkpointing, under the name transformers 5.23 prefers (the old one warns)."""
    enable = getattr(policy, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
