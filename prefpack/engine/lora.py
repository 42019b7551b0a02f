"""The LoRA stage: the policy wrapped with peft adapters (``lora.*``); on a vision-language model only the language
model's layers (and the vision side's where not frozen) get them. The adapter reference mode runs the wrapped policy."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torch import nn

from prefpack.model import ModelError, is_vision_language, load_adapter, lora_targets
from prefpack.objectives.names import train_objective

if TYPE_CHECKING:
    from prefpack.engine.core import Engine


class LoraStage:
    name = "lora"

    def apply(self, engine: Engine, log) -> None:
        if engine.cfg.lora.enabled:
            engine.policy = wrap_lora(engine.policy, engine.cfg)
            engine.reference.bind_policy(engine.policy)


def wrap_lora(model: nn.Module, cfg) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ModelError("lora.enabled needs peft: pip install 'prefpack[lora]'") from exc
    if cfg.lora.adapter:
        return continued_adapter(model, cfg.lora.adapter)
    target = cfg.lora.target_modules
    if is_vision_language(model):  # the language model's layers (and the vision side's where not frozen) only
        target = lora_targets(model, target, freeze_vision=cfg.model.freeze_vision,
                              freeze_projector=cfg.model.freeze_projector)
    lcfg = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=target, task_type=train_objective(cfg).lora_task)
    # SEQ_CLS: peft trains the new `score` head in full beside the adapters (modules_to_save), as TRL's reward LoRA
    with warnings.catch_warnings():  # peft 0.21 reads transformers' deprecated name: not the user's to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated", category=FutureWarning)
        return get_peft_model(model, lcfg)


def continued_adapter(model: nn.Module, folder: str) -> nn.Module:
    """``lora.adapter``: a saved adapter loaded trainable over the base (on-policy rounds continue the last round's
    adapter over the same base, which is never rewritten); the loading seam's adapter load."""
    return load_adapter(model, folder, trainable=True, key="lora.adapter")
