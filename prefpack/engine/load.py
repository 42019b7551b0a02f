"""The load stage: the policy's weights on the run's device, in its precision, with its attention kernel (and
compiled layers where asked); a vision-language model's towers frozen or trained as ``model.freeze_*`` say."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from prefpack.model import (
    ModelError,
    apply_freeze,
    choose_attention,
    is_vision_language,
    wants_compile,
)
from prefpack.precision import resolve_precision

if TYPE_CHECKING:
    from prefpack.engine.core import Engine


class LoadStage:
    """``model.*``: dtype, attention, compile, the vision towers' freezing (the source was checked before the
    tokenizer was read: ``training.setup.build``)."""

    name = "load"

    def apply(self, engine: Engine, log) -> None:
        cfg, device = engine.cfg, engine.device
        world = engine.parallel.world
        engine.precision = resolve_precision(
            cfg.model.dtype, cfg.optim.master_dtype, device, lora=cfg.lora.enabled,
            fsdp_sharded=cfg.distributed.strategy == "fsdp2" and world > 1)
        if cfg.model.quantization is not None:  # what the quantize stage holds the linear weights in
            engine.precision = replace(engine.precision, four_bit=cfg.model.quantization,
                                       double_quant=cfg.model.quantization_double)
        choice = choose_attention(cfg.model.attn_implementation, device, engine.precision.compute,
                                  source=cfg.model.name_or_path, packed=cfg.data.packing,
                                  trust_remote_code=cfg.model.trust_remote_code)
        engine.attn = choice.name
        if choice.auto:
            log(choice.describe())
        engine.compile_layers = wants_compile(cfg.model.compile, device, world)
        torch.manual_seed(cfg.train.seed)
        engine.policy = engine.load_like_policy(cfg.model.name_or_path)
        freeze_vision_towers(engine.policy, cfg, log)
        if engine.compile_layers:
            log("decoder layers compiled with torch.compile (model.compile"
                + (": auto; eager where the compiler fails)" if engine.compile_layers == "auto" else ")"))


def freeze_vision_towers(policy: nn.Module, cfg, log) -> None:
    """``model.freeze_vision`` / ``model.freeze_projector`` applied to a vision-language policy; on a text model
    either set false is an error (nothing to train)."""
    if not is_vision_language(policy):
        unset = [k for k in ("freeze_vision", "freeze_projector") if not getattr(cfg.model, k)]
        if unset:
            raise ModelError(f"model.{unset[0]}=false: {cfg.model.name_or_path!r} is a text model, with no vision "
                             "encoder or projector to train; leave it at true")
        return
    apply_freeze(policy, freeze_vision=cfg.model.freeze_vision, freeze_projector=cfg.model.freeze_projector)
    state = {True: "frozen", False: "trained"}
    log(f"vision-language model ({type(policy).__name__}): vision encoder {state[cfg.model.freeze_vision]}, projector "
        f"{state[cfg.model.freeze_projector]} (model.freeze_vision, model.freeze_projector)")
    if not cfg.model.freeze_vision and cfg.train.micro_batch_tokens == "auto":
        log("note: the auto micro-batch budget counts the language model's activations only; a trained vision "
            "encoder keeps its own for every image patch (Qwen2-VL: 4 per image token). If memory runs short, set "
            "train.micro_batch_tokens lower")
