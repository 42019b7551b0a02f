"""The reference-weights stage: the reference of ``reference.mode`` set up, reading only what the mode asks for
(a copy loaded like the policy, or the hash of the reference weights a sidecar is tagged with).

``reference.quantization`` (nf4 | fp4) loads the copy through the same loader with its own 4-bit config (that of
``model.quantization``, ``engine/quantize.py``): a frozen reference in about a quarter of its linear weights'
memory beside a full-precision policy. Its log-probs are the 4-bit model's, so step 0's DPO loss is not exactly
ln 2; the config's rules refuse it with another mode, TR-DPO syncing, a 4-bit policy and FSDP2."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from prefpack.engine.quantize import check_four_bit
from prefpack.model import FourBit, check_model_source, weights_hash
from prefpack.objectives.names import train_objective
from prefpack.reference import REFERENCE_MODES, ReferenceSetup

if TYPE_CHECKING:
    from prefpack.engine.core import Engine


class ReferenceStage:
    """``reference.*``: the mode, and the model it reads (default: the policy's starting weights)."""

    name = "reference"

    def apply(self, engine: Engine, log) -> None:
        cfg = engine.cfg
        mode = cfg.reference.mode
        if cfg.reference.model and REFERENCE_MODES[mode].reads_weights:
            check_model_source(cfg.reference.model, "reference.model")
        terms = [] if engine.unpaired else [t.name for t in cfg.loss.terms]
        if not train_objective(cfg).reads_reference:  # a reward model's Bradley-Terry loss reads no reference
            if mode != "none":
                log(f"note: train.objective={cfg.train.objective} reads no reference; reference.mode {mode!r} is "
                    "ignored")
            mode = "none"
        elif not engine.unpaired and not cfg.needs_reference() and mode != "none":
            why = "loss.kl_coef is 0, so" if train_objective(cfg).loss_names else "the losses"
            log(f"note: {why} {terms} need no reference; reference.mode {mode!r} is ignored")
            mode = "none"
        ref_path = cfg.reference.model or cfg.model.name_or_path
        loader = engine
        if cfg.reference.quantization is not None and mode == "copy":
            loader = _four_bit_loader(engine, cfg.reference.quantization, log)
        # what a mode may ask for, computed only if it does: the reference weights loaded exactly like the policy's
        # (same dtype and autocast: at step 0 both give the same log-probs), or their hash (a sidecar's tag)
        engine.reference = REFERENCE_MODES[mode].set_up(ReferenceSetup(
            load=partial(loader.load_like_policy, ref_path, purpose="reference"),
            weights_hash=partial(_reference_hash, engine, ref_path) if engine.check_sidecar_reference else _no_hash,
            lora=cfg.lora.enabled))


def _four_bit_loader(engine: Engine, kind: str, log) -> Engine:
    """The engine as the copy's loader sees it: everything the policy's, the 4-bit config the reference's own."""
    check_four_bit(engine, f"reference.quantization={kind}")
    log(f"4-bit frozen reference ({kind}, double quantisation; reference.quantization): its log-probs are the 4-bit "
        "model's, so the first DPO loss is near ln 2, not exactly")
    return replace(engine, quantization=FourBit(kind, double=True))


def _no_hash() -> None:
    return None  # a precomputed reference read without checking which weights computed it


def _reference_hash(engine: Engine, ref_path: str) -> str:
    if ref_path == engine.cfg.model.name_or_path:
        return weights_hash(engine.policy)
    ref = engine.load_like_policy(ref_path, device=torch.device("cpu"), packed=False, purpose="reference")  # hashed
    h = weights_hash(ref)
    del ref
    return h
