"""One typed config tree for ``prefpack train CONFIG.yaml [key.sub=value ...]``.

The tree is plain nested dataclasses. Parsing (``load_config`` / ``config_from_dict``) checks keys and types
only, so partial configs (tests, ``prefpack eval``) can be built; ``Config.validate()`` checks values and
cross-field rules and is what ``train`` must call before doing any work.

Type rules, chosen so that a YAML file and a command-line override mean the same thing:

* ints are accepted for floats, and so are numeric strings: PyYAML (YAML 1.1) reads ``1e-5`` (no dot) as
  the string ``"1e-5"``, which would otherwise make ``optim.lr=1e-5`` an error;
* bools must be real YAML bools (``true``/``false``), never ``0``/``1`` or ``"yes"`` in quotes;
* ``X | None`` fields accept ``null``; ``Literal`` fields accept exactly their choices;
* a section given as ``null`` (an empty ``lora:`` with everything commented out) means all defaults;
* on the command line, a value for a string field that YAML reads as a number or date (``data.train=2024``)
  is kept as the text that was typed.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
import types
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from prefpack.loss_params import LOSS_PARAMS

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "LoraConfig",
    "LossConfig",
    "LossTermConfig",
    "ModelConfig",
    "OptimConfig",
    "ReferenceConfig",
    "RunConfig",
    "TrainConfig",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "load_config",
    "parse_override",
    "save_config",
]


class ConfigError(ValueError):
    """A config file, override or value is wrong; the message names the dotted key and what was expected."""


def _f(default: Any, help: str) -> Any:
    """A dataclass field with a one-line ``help`` (also written as a comment by ``save_config``)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _param(name: str) -> Any:
    """A ``loss.*`` field from the one table of loss parameters (prefpack.loss_params)."""
    p = LOSS_PARAMS[name]
    return _f(p.default, p.help)


DType = Literal["auto", "float32", "bfloat16", "float16"]
AttnImpl = Literal["auto", "sdpa", "packed_sdpa", "varlen", "eager", "flash_attention_2"]
MasterDType = Literal["auto", "float32", "bfloat16"]
SaveDType = Literal["auto", "float32", "bfloat16"]
Budget = int | Literal["auto"]
ReferenceMode = Literal["copy", "adapter", "precomputed", "none"]
KLPairing = Literal["step", "fixed"]
FDivergence = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]  # losses.F_DIVERGENCES
Schedule = Literal["cosine", "linear", "constant"]
Device = Literal["auto", "cpu", "cuda"]


@dataclass
class ModelConfig:
    name_or_path: str | None = _f(None, "policy weights: local folder or hub id (required for train)")
    tokenizer: str | None = _f(None, "tokenizer folder; null = the model's own, else the store's copy")
    dtype: DType = _f("auto", "compute dtype; auto = float32 on CPU, bfloat16 on CUDA (float32 master weights, "
                      "see optim.master_dtype)")
    attn_implementation: AttnImpl = _f(
        "auto", "attention kernel: auto = packed_sdpa on CPU; on CUDA flash_attention_2 if installed, else torch's "
        "varlen (half-precision compute), else sdpa")
    trust_remote_code: bool = _f(False, "allow custom model code from the hub")
    allow_tokenizer_mismatch: bool = _f(False, "train even if the store was tokenised by another tokenizer")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")


@dataclass
class DataConfig:
    train: str | None = _f(None, "prepared store folder to train on (required for train)")
    eval: str | None = _f(None, "prepared held-out store folder; null = no evaluation")
    packing: bool = _f(True, "pack several pairs into each row; false = one padded pair per row")
    max_tokens_per_row: Budget = _f("auto", "row length budget in tokens when packing; auto = 2048 on CPU, "
                                    "sized from the device on CUDA")
    pad_to_multiple_of: int | None = _f(None, "pad row length up to a multiple of this; null = no rounding")
    shuffle: bool = _f(True, "shuffle pairs every epoch (seeded by train.seed)")
    paired_as_kto: bool = _f(False, "KTO on a pair store: chosen = desirable, rejected = undesirable")


@dataclass
class LossTermConfig:
    name: str = field(metadata={"help": "loss name, see prefpack.losses.PAIR_LOSSES (and kto, apo_zero_unpaired)"})
    weight: float = _f(1.0, "multiplier of this term in the total loss (0 = log only)")


@dataclass
class LossConfig:
    terms: list[LossTermConfig] = field(
        default_factory=lambda: [LossTermConfig("sigmoid", 1.0)],
        metadata={"help": "weighted loss terms summed into the training loss"},
    )
    beta: float = _param("beta")
    label_smoothing: float = _param("label_smoothing")
    simpo_gamma: float = _param("simpo_gamma")
    discopop_tau: float = _param("discopop_tau")
    # a choice, not a float, so not a row of LOSS_PARAMS (prefpack eval takes it from --config)
    f_divergence_type: FDivergence = _f(
        "reverse_kl", "f-DPO regulariser (TRL's f_divergence_type): reverse_kl = plain DPO, forward_kl, js_divergence, "
        "alpha_divergence; other than reverse_kl only with sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, "
        "discopop (+ nll, sft)")
    f_alpha_divergence_coef: float = _param("f_alpha_divergence_coef")
    desirable_weight: float = _param("desirable_weight")
    undesirable_weight: float = _param("undesirable_weight")
    router_aux_loss_coef: float | None = _param("router_aux_loss_coef")
    kl_pairing: KLPairing = _f("step", "KTO KL partners: step = from the same step, fixed = seeded per store")


@dataclass
class ReferenceConfig:
    mode: ReferenceMode = _f("copy", "copy = frozen copy, adapter = LoRA base, precomputed = from store, none")
    model: str | None = _f(None, "reference weights for copy/precomputed; null = model.name_or_path")
    sync: bool = _f(False, "TR-DPO (TRL's sync_ref_model): every sync_steps optimizer steps the reference becomes "
                    "mixup_alpha * policy + (1 - mixup_alpha) * reference; mode copy only, no LoRA")
    mixup_alpha: float = _f(0.6, "TR-DPO alpha in (0, 1] (TRL's ref_model_mixup_alpha); 1 = copy the policy")
    sync_steps: int = _f(512, "TR-DPO tau: sync after every sync_steps-th optimizer step (TRL's ref_model_sync_steps)")


@dataclass
class LoraConfig:
    enabled: bool = _f(False, "train LoRA adapters instead of all weights (needs peft)")
    r: int = _f(8, "adapter rank")
    alpha: int = _f(16, "adapter scaling numerator (scale = alpha / r)")
    dropout: float = _f(0.0, "dropout on the adapter input")
    target_modules: str | list[str] = _f("all-linear", "modules to adapt: 'all-linear' or a list of names")


@dataclass
class OptimConfig:
    lr: float = _f(5.0e-7, "peak learning rate (AdamW)")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay")
    betas: tuple[float, float] = _f((0.9, 0.999), "AdamW moment decay rates")
    eps: float = _f(1.0e-8, "AdamW denominator epsilon")
    schedule: Schedule = _f("cosine", "learning-rate decay after warmup")
    warmup_steps: int = _f(0, "linear warmup steps")
    warmup_ratio: float = _f(0.0, "warmup as a fraction of all steps, used when warmup_steps is 0")
    max_grad_norm: float | None = _f(1.0, "clip the global gradient norm to this; null = no clipping")
    master_dtype: MasterDType = _f(
        "auto", "dtype of the trained weights and optimizer state; auto = float32 (bfloat16 loses updates "
        "smaller than half a bf16 ulp, most of them at DPO learning rates)")


@dataclass
class TrainConfig:
    global_batch_pairs: int = _f(8, "pairs (KTO: examples) per optimizer step (over all micro-batches and ranks)")
    micro_batch_tokens: Budget = _f("auto", "token budget of one micro-batch (all its rows); auto = 4096 on CPU, "
                                    "sized from free memory and the model on CUDA")
    epochs: float = _f(1.0, "passes over the training store (fractions allowed)")
    max_steps: int | None = _f(None, "optimizer steps to run; overrides epochs when set")
    seed: int = _f(0, "seed for shuffling, dropout and initialisation")
    chunk_size: Budget = _f("auto", "tokens per chunk of the memory-bounded log-softmax; auto = 1024 on CPU, "
                            "sized from the device on CUDA")
    device: Device = _f("auto", "auto = cuda when available, else cpu")


@dataclass
class RunConfig:
    output_dir: str = _f("runs/prefpack", "folder for checkpoints, metrics and the final model")
    log_every: int = _f(1, "log train metrics every N optimizer steps")
    eval_every: int = _f(0, "evaluate every N steps; 0 = only at the end")
    save_every: int = _f(0, "checkpoint every N steps; 0 = only the final model")
    keep_checkpoints: int = _f(2, "how many most recent checkpoints to keep")
    report_to: Literal["tensorboard", "wandb", "none"] | list[Literal["tensorboard", "wandb", "none"]] = _f(
        ["tensorboard"], "where metrics go besides metrics.jsonl (always written): tensorboard (when installed), "
        "wandb (pip install 'prefpack[wandb]'), none")
    wandb_project: str = _f("prefpack", "W&B project when report_to has wandb (run name = the run folder's name)")
    tensorboard: bool | None = _f(None, "older switch: true adds tensorboard to report_to, false removes it, "
                                  "null = report_to decides")
    plot: bool = _f(True, "write curves.png at the end")
    save_dtype: SaveDType = _f("auto", "dtype of the final model; auto = the dtype of the source checkpoint")


Strategy = Literal["ddp", "fsdp2"]
Balance = Literal["tokens", "count"]


@dataclass
class DistributedConfig:
    strategy: Strategy = _f("ddp", "under torchrun: ddp (model fits one device) or fsdp2 (shard it)")
    balance: Balance = _f("tokens", "ranks get micro-batches balanced by tokens, or equal pair counts packed per rank (count)")


@dataclass
class Config:
    """The whole resolved config of one run. ``validate()`` before training."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def loss_terms(self) -> list:
        """The terms as ``prefpack.losses.LossTerm`` objects (imports torch, hence lazily)."""
        from prefpack.losses import LossTerm

        return [LossTerm(t.name, float(t.weight)) for t in self.loss.terms]

    def needs_reference(self) -> bool:
        """Whether any loss term reads reference log-probs."""
        from prefpack.losses import PAIR_LOSSES

        return any(t.name not in PAIR_LOSSES or PAIR_LOSSES[t.name].needs_reference for t in self.loss.terms)

    def validate(self, *, training: bool = True) -> None:
        """Check values and cross-field rules; raise one ``ConfigError`` listing every problem found.

        ``training=False`` skips the keys only ``train`` needs (``model.name_or_path``, ``data.train``) so
        ``eval`` and tests can check partial configs.
        """
        problems = _problems(self, training=training)
        if len(problems) == 1:
            raise ConfigError(problems[0])
        if problems:
            raise ConfigError("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))

    def warnings(self) -> list[str]:
        """Allowed but probably unintended settings, for the CLI to print."""
        out = []
        if self.reference.mode != "none" and self.loss.terms and not self.needs_reference():
            out.append(
                f"reference.mode is {self.reference.mode!r} but no loss term reads the reference "
                f"({', '.join(t.name for t in self.loss.terms)}); reference.mode=none saves memory and time"
            )
        ref = self.reference
        if not ref.sync and (ref.mixup_alpha != 0.6 or ref.sync_steps != 512):
            out.append("reference.mixup_alpha / reference.sync_steps are set but reference.sync is false, so the "
                       "reference is never synced; set reference.sync=true to use them")
        return out


# --------------------------------------------------------------------------------------------------------
# Value checks
# --------------------------------------------------------------------------------------------------------


def _problems(cfg: Config, *, training: bool) -> list[str]:
    errs: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errs.append(msg)

    def positive(path: str, x: float) -> None:
        if not math.isfinite(x):
            errs.append(f"{path} must be a finite number, got {x}")
        else:
            need(x > 0, f"{path} must be > 0, got {x}")

    def at_least(path: str, x: int, low: int) -> None:
        need(x >= low, f"{path} must be >= {low}, got {x}")

    m, d, lo, ref, lora, opt, tr, run = (
        cfg.model, cfg.data, cfg.loss, cfg.reference, cfg.lora, cfg.optim, cfg.train, cfg.run
    )
    if training:
        need(bool(m.name_or_path), "model.name_or_path is required: a local model folder or a hub id")
        need(bool(d.train), "data.train is required: a store folder written by `prefpack prepare`")
    need(not (tr.device == "cpu" and m.attn_implementation == "flash_attention_2"),
         "model.attn_implementation 'flash_attention_2' needs CUDA but train.device is 'cpu'")
    need(not (opt.master_dtype == "bfloat16" and m.dtype == "float32"),
         "optim.master_dtype bfloat16 with model.dtype float32 would compute in float32 on bfloat16 weights; "
         "set model.dtype=bfloat16 (pure bfloat16) or leave optim.master_dtype at auto")

    if d.max_tokens_per_row != "auto":
        at_least("data.max_tokens_per_row", d.max_tokens_per_row, 2)
    if d.pad_to_multiple_of is not None:
        at_least("data.pad_to_multiple_of", d.pad_to_multiple_of, 1)

    _loss_problems(cfg, errs)
    positive("loss.beta", lo.beta)
    need(0.0 <= lo.label_smoothing < 0.5, f"loss.label_smoothing must be in [0, 0.5), got {lo.label_smoothing}")
    need(math.isfinite(lo.simpo_gamma), f"loss.simpo_gamma must be finite, got {lo.simpo_gamma}")
    positive("loss.discopop_tau", lo.discopop_tau)
    need(math.isfinite(lo.f_alpha_divergence_coef),
         f"loss.f_alpha_divergence_coef must be finite, got {lo.f_alpha_divergence_coef}")
    if any(t.name == "exo_pair" for t in lo.terms):
        need(lo.label_smoothing > 0, "loss exo_pair needs loss.label_smoothing > 0 (its epsilon; TRL uses 1e-3)")
    positive("loss.desirable_weight", lo.desirable_weight)
    positive("loss.undesirable_weight", lo.undesirable_weight)
    if lo.router_aux_loss_coef is not None:
        need(math.isfinite(lo.router_aux_loss_coef) and lo.router_aux_loss_coef >= 0,
             f"loss.router_aux_loss_coef must be finite and >= 0 (or null = the model config's), "
             f"got {lo.router_aux_loss_coef}")

    if ref.mode == "adapter" and not lora.enabled:
        errs.append("reference.mode 'adapter' uses the base model under a LoRA adapter; set lora.enabled=true "
                    "or use reference.mode 'copy'")
    if ref.model is not None and ref.mode in ("adapter", "none"):
        errs.append(f"reference.model is only used with reference.mode 'copy' or 'precomputed', "
                    f"not {ref.mode!r}; remove it")
    if ref.sync:
        if ref.mode != "copy":
            errs.append(f"reference.sync (TR-DPO) moves a reference model towards the policy, so it needs "
                        f"reference.mode 'copy', not {ref.mode!r}" + {
                            "precomputed": " (precomputed log-probs would be stale after the first sync)",
                            "adapter": " (the adapter-off policy is no separate model to update)",
                            "none": " (there is no reference)"}.get(ref.mode, ""))
        elif lora.enabled:
            errs.append("reference.sync with lora.enabled is not supported (as in TRL): the synced reference would "
                        "need the merged adapter; set reference.sync=false or train all weights")
        elif cfg.loss.terms and not cfg.needs_reference():
            errs.append("reference.sync is set but no loss term reads the reference; set reference.sync=false")
        need(math.isfinite(ref.mixup_alpha) and 0.0 < ref.mixup_alpha <= 1.0,
             f"reference.mixup_alpha must be in (0, 1], got {ref.mixup_alpha}")
        at_least("reference.sync_steps", ref.sync_steps, 1)

    at_least("lora.r", lora.r, 1)
    positive("lora.alpha", lora.alpha)
    need(0.0 <= lora.dropout < 1.0, f"lora.dropout must be in [0, 1), got {lora.dropout}")
    tm = lora.target_modules
    need(bool(tm) and (isinstance(tm, str) or all(tm)),
         "lora.target_modules must be 'all-linear' or a non-empty list of non-empty module names")

    positive("optim.lr", opt.lr)
    need(math.isfinite(opt.weight_decay) and opt.weight_decay >= 0,
         f"optim.weight_decay must be >= 0, got {opt.weight_decay}")
    need(all(0.0 <= b < 1.0 for b in opt.betas), f"optim.betas must each be in [0, 1), got {list(opt.betas)}")
    positive("optim.eps", opt.eps)
    at_least("optim.warmup_steps", opt.warmup_steps, 0)
    need(0.0 <= opt.warmup_ratio < 1.0, f"optim.warmup_ratio must be in [0, 1), got {opt.warmup_ratio}")
    if opt.max_grad_norm is not None:
        positive("optim.max_grad_norm", opt.max_grad_norm)

    at_least("train.global_batch_pairs", tr.global_batch_pairs, 1)
    if tr.micro_batch_tokens != "auto":
        at_least("train.micro_batch_tokens", tr.micro_batch_tokens, 2)
    positive("train.epochs", tr.epochs)
    if tr.max_steps is not None:
        at_least("train.max_steps", tr.max_steps, 1)
    need(0 <= tr.seed < 2**32, f"train.seed must be in [0, 2**32), got {tr.seed}")
    if tr.chunk_size != "auto":
        at_least("train.chunk_size", tr.chunk_size, 1)

    need(bool(run.output_dir), "run.output_dir must not be empty")
    at_least("run.log_every", run.log_every, 1)
    at_least("run.eval_every", run.eval_every, 0)
    at_least("run.save_every", run.save_every, 0)
    at_least("run.keep_checkpoints", run.keep_checkpoints, 1)
    need("none" not in run.report_to or run.report_to in ("none", ["none"]) and not run.tensorboard,
         f"run.report_to {run.report_to!r}: 'none' turns TensorBoard and W&B off, so it must be alone and not "
         "with run.tensorboard=true (metrics.jsonl is always written)")
    if run.eval_every > 0 and d.eval is None:
        errs.append(f"run.eval_every is {run.eval_every} but data.eval is null; set data.eval or eval_every=0")
    return errs


def _loss_problems(cfg: Config, errs: list[str]) -> None:
    from prefpack.losses import PAIR_LOSSES, UNPAIRED_LOSS_NAMES

    terms = cfg.loss.terms
    valid = (*PAIR_LOSSES, *UNPAIRED_LOSS_NAMES)
    reference_free = sorted(n for n, spec in PAIR_LOSSES.items() if not spec.needs_reference)
    if not terms:
        errs.append(f"loss.terms is empty; give at least one of: {', '.join(valid)}")
        return
    names = [t.name for t in terms]
    for i, t in enumerate(terms):
        if t.name not in valid:
            hint = difflib.get_close_matches(t.name, valid, n=1)
            did = f" (did you mean {hint[0]!r}?)" if hint else ""
            errs.append(f"loss.terms[{i}].name: unknown loss {t.name!r}{did}; valid: {', '.join(valid)}")
        if not (math.isfinite(t.weight) and t.weight >= 0):
            errs.append(f"loss.terms[{i}].weight must be finite and >= 0, got {t.weight}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        errs.append(f"loss.terms lists {', '.join(dupes)} more than once; merge their weights")
    if all(t.weight == 0 for t in terms):
        errs.append("every loss.terms weight is 0, so nothing would train")
    unpaired = [n for n in names if n in UNPAIRED_LOSS_NAMES]
    if unpaired and len(names) > 1:
        errs.append(f"loss.terms: {', '.join(unpaired)} (KTO family, unpaired examples) must be the only term, "
                    f"got {', '.join(names)}")
    if cfg.data.paired_as_kto and not unpaired:
        errs.append(f"data.paired_as_kto reads pairs as KTO examples but loss.terms has no unpaired loss; use "
                    f"loss.terms=[{{name: kto}}] (or {', '.join(UNPAIRED_LOSS_NAMES[1:])}) or paired_as_kto=false")
    if "kto" in unpaired and cfg.reference.mode == "precomputed" and cfg.loss.kl_pairing != "fixed":
        errs.append("reference.mode 'precomputed' with loss 'kto' needs loss.kl_pairing=fixed: with step pairing "
                    "an example's KL partner depends on its optimizer step, so no sidecar can hold its reference "
                    "KL log-prob (fixed pairing gives each example one seeded partner that precompute-ref scores)")
    with_ref = [n for n in names if n in valid and n not in reference_free]
    if cfg.loss.f_divergence_type != "reverse_kl":
        from prefpack.losses import F_DIVERGENCE_COMPATIBLE, F_DIVERGENCE_LOSSES

        refused = [n for n in names if n not in F_DIVERGENCE_COMPATIBLE]
        if refused:
            errs.append(f"loss.f_divergence_type {cfg.loss.f_divergence_type!r} works only with the losses "
                        f"{', '.join(sorted(F_DIVERGENCE_LOSSES))} (TRL 1.16's list; nll and sft may be added): "
                        f"{', '.join(refused)} {'has' if len(refused) == 1 else 'have'} no f-divergence form; use "
                        f"loss.f_divergence_type=reverse_kl with {'it' if len(refused) == 1 else 'them'}")
    if cfg.reference.mode == "none" and with_ref:
        errs.append(
            f"reference.mode is 'none' but loss {', '.join(repr(n) for n in with_ref)} needs a reference; "
            f"use reference.mode 'copy' (or 'adapter'/'precomputed') or only reference-free losses "
            f"({', '.join(reference_free)})"
        )


# --------------------------------------------------------------------------------------------------------
# Parsing: keys and types
# --------------------------------------------------------------------------------------------------------

# Names people carry over from other trainers; used only to suggest the right key.
_ALIASES = {
    "learning_rate": "lr",
    "scheduler": "schedule",
    "lr_scheduler": "schedule",
    "lr_scheduler_type": "schedule",
    "lr_schedule": "schedule",
    "model_name_or_path": "name_or_path",
    "model_name": "name_or_path",
    "name": "name_or_path",
    "path": "name_or_path",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "batch_size": "global_batch_pairs",
    "grad_clip": "max_grad_norm",
    "clip_grad_norm": "max_grad_norm",
    "lora_r": "r",
    "rank": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "torch_dtype": "dtype",
    "ref_model": "model",
    "output": "output_dir",
    "save_steps": "save_every",
    "eval_steps": "eval_every",
    "logging_steps": "log_every",
    "loss_type": "terms",
}

_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _describe(tp: Any, plural: bool = False) -> str:
    """Human name of a type for error messages: 'a float', 'a list of strings', "one of 'a', 'b'"."""
    s = "s" if plural else ""
    if tp is type(None):
        return "null"
    if tp is bool:
        return f"bool{s} (true/false)" if plural else "a bool (true/false)"
    if tp is int:
        return f"int{s}" if plural else "an int"
    if tp is float:
        return f"float{s}" if plural else "a float"
    if tp is str:
        return f"string{s}" if plural else "a string"
    if is_dataclass(tp):
        return f"mapping{s}" if plural else "a mapping"
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return ("lists" if plural else "a list") + " of " + _describe(args[0], plural=True)
    if origin is tuple:
        return ("lists" if plural else "a list") + f" of {len(args)} " + _describe(args[0], plural=True)
    if _is_union(tp):
        return " or ".join(_describe(a, plural) for a in args)
    return getattr(tp, "__name__", str(tp))


def _type_error(path: str, tp: Any, value: Any, extra: str = "") -> ConfigError:
    return ConfigError(f"{path}: expected {_describe(tp)}, got {_show(value)}{extra}")


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it converted (int->float, list->tuple...)."""
    if is_dataclass(tp):
        return _build(tp, value, path)
    origin, args = get_origin(tp), get_args(tp)
    if _is_union(tp):
        if value is None:
            if type(None) in args:
                return None
            raise _type_error(path, tp, value)
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:  # `X | None`: report X's own, more precise error (element paths, choices)
            try:
                return _convert(value, inner[0], path)
            except ConfigError as exc:
                if not str(exc).startswith(f"{path}: expected "):
                    raise
                raise _type_error(path, tp, value) from None
        for arg in inner:
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue
        raise _type_error(path, tp, value)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        hint = difflib.get_close_matches(value, [str(a) for a in args], n=1) if isinstance(value, str) else []
        raise _type_error(path, tp, value, f" (did you mean {hint[0]!r}?)" if hint else "")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(path, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(path, tp, value)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, str) and value.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity"):
            raise ConfigError(f"{path} must be a finite number, got {value!r}")
        raise _type_error(path, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        hint = " (quote it to make it a string)" if isinstance(value, int | float) else ""
        raise _type_error(path, tp, value, hint)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise _type_error(path, tp, value)
        return [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise _type_error(path, tp, value)
        return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is Any:
        return value
    raise TypeError(f"config annotation {tp!r} at {path} is not supported")  # a bug in this module


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _all_paths(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the tree (sections and leaves), for suggestions across sections."""
    cls = cls or Config
    out = []
    for f in fields(cls):
        path = _join(prefix, f.name)
        out.append(path)
        tp = _hints(cls)[f.name]
        if is_dataclass(tp):
            out.extend(_all_paths(tp, path))
    return out


def _initials(name: str) -> str:
    return "".join(p[0] for p in name.split("_") if p)


def _suggest(key: str, section: str, names: list[str]) -> str | None:
    """The most likely intended full dotted key for an unknown ``key`` in ``section``."""
    norm = key.strip().lower().replace("-", "_")
    if norm in names:
        return _join(section, norm)
    alias = _ALIASES.get(norm)
    if alias in names:
        return _join(section, alias)
    in_section = "[" not in section  # inside list items (loss.terms[0]) other sections make no sense
    elsewhere = [p for p in _all_paths() if p.rsplit(".", 1)[-1] in (norm, alias)] if in_section else []
    if elsewhere:
        return elsewhere[0]
    close = difflib.get_close_matches(norm, names, n=1, cutoff=0.6)
    if close:
        return _join(section, close[0])
    for name in names:
        if name == _initials(norm) or _initials(name) == norm:
            return _join(section, name)
    if in_section:
        leaves = {p.rsplit(".", 1)[-1]: p for p in _all_paths()}
        close = difflib.get_close_matches(norm, list(leaves), n=1, cutoff=0.8)
        if close:
            return leaves[close[0]]
    return None


def _unknown_key(key: Any, section: str, names: list[str]) -> ConfigError:
    full = _join(section, str(key))
    guess = _suggest(str(key), section, names)
    if guess:
        return ConfigError(f"unknown key {full!r} (did you mean {guess!r}?)")
    where = f"in {section!r}" if section else "at the top level"
    return ConfigError(f"unknown key {full!r}; valid keys {where}: {', '.join(names)}")


def _build(cls: type, data: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys, missing required keys and bad types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of keys to values, got {_show(data)}")
    names = [f.name for f in fields(cls)]
    for key in data:
        if key not in names:
            raise _unknown_key(key, path, names)
    hints = _hints(cls)
    kwargs = {}
    for f in fields(cls):
        sub = _join(path, f.name)
        if f.name in data:
            kwargs[f.name] = _convert(data[f.name], hints[f.name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{sub}: required key is missing")
    return cls(**kwargs)


def config_from_dict(data: dict | None) -> Config:
    """Build a Config from plain data (missing keys take defaults); checks keys and types, not values."""
    return _build(Config, data, "")


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key.sub=value`` and parse the value as YAML; returns ``(dotted_key, value)``."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"override {text!r} must look like key.sub=value, e.g. optim.lr=1e-5")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({_one_line(exc)})") from None
    return key, value


def _one_line(exc: Exception) -> str:
    """PyYAML's multi-line message as 'problem at line L, column C'."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def _type_at(key: str) -> Any:
    """The annotation of dotted ``key``; unknown keys get the same message as in a file."""
    tp: Any = Config
    walked = ""
    for part in key.split("."):
        if not is_dataclass(tp):
            raise ConfigError(f"{walked!r} is a value, not a section, so {key!r} cannot be set; "
                              f"set the whole value instead ({walked}=...)")
        names = [f.name for f in fields(tp)]
        if part not in names:
            raise _unknown_key(part, walked, names)
        tp = _hints(tp)[part]
        walked = _join(walked, part)
    return tp


def _accepts_str(tp: Any) -> bool:
    return tp is str or (_is_union(tp) and str in get_args(tp))


def _set_path(data: dict, parts: list[str], value: Any) -> None:
    """Set ``data[a][b]... = value``, merging mappings into existing sections instead of replacing them."""
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    last = parts[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        for k, v in value.items():
            _set_path(node[last], [k], v)
    else:
        node[last] = value


def _read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {_one_line(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not a UTF-8 text file ({exc.reason})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (model:, data:, ...), "
                          f"got {_show(data)}")
    return data


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (``None`` = all defaults) and apply ``key.sub=value`` overrides in order.

    Checks keys and types; call ``cfg.validate()`` before training. Each error says whether it came from
    the file or from which override.
    """
    data: dict = {}
    if path is not None:
        data = _read_yaml(path)
        try:
            _build(Config, data, "")
        except ConfigError as exc:
            raise ConfigError(f"{exc} (in {path})") from None
    for text in overrides or []:
        key, value = parse_override(text)
        try:
            tp = _type_at(key)
            raw = text.partition("=")[2].strip()
            if _accepts_str(tp) and value is not None and not isinstance(value, str | bool | list | dict):
                value = raw  # e.g. data.train=2024 or run.output_dir=2024-01-01: the user typed a name
            _convert(value, tp, key)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (in override {text!r})") from None
        _set_path(data, key.split("."), value)
    return _build(Config, data, "")


# --------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def config_to_dict(cfg: Config) -> dict:
    """Plain dict/list/scalar form of ``cfg`` (tuples become lists), as written by ``save_config``."""
    return _plain(cfg)


def _flow(value: Any) -> str:
    """One-line YAML for a value; JSON (a YAML subset) when PyYAML would need several lines."""
    text = yaml.safe_dump(value, default_flow_style=True, width=2**31 - 1, allow_unicode=True, sort_keys=False)
    text = text.removesuffix("\n...\n").rstrip("\n")
    if "\n" in text:
        text = json.dumps(value, ensure_ascii=False)
    return text


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML text with each field's meaning as a trailing comment."""
    lines = ["# prefpack config (resolved: file + overrides + defaults)"]
    for section_field in fields(Config):
        section = getattr(cfg, section_field.name)
        lines.append(f"{section_field.name}:")
        for f in fields(section):
            line = f"  {f.name}: {_flow(_plain(getattr(section, f.name)))}"
            help = f.metadata.get("help")
            lines.append(f"{line}  # {help}" if help else line)
    text = "\n".join(lines) + "\n"
    if yaml.safe_load(text) != config_to_dict(cfg):  # never write something that reads back differently
        text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)
    return text


def save_config(cfg: Config, path: str | os.PathLike) -> Path:
    """Write ``cfg`` as YAML (atomically); ``load_config(path, [])`` gives back an equal Config."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    tmp.write_text(dump_config(cfg), encoding="utf-8")
    os.replace(tmp, p)
    return p
