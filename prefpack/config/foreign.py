"""Other trainers' config names (TRL's DPOConfig and script arguments, LLaMA-Factory's arguments) and what each is in
prefpack, with the value carried over: the answer to such a name at the top level of a config (a TRL or LLaMA-Factory
YAML is flat). Used only to word the unknown-key error (``keys.unknown_keys_error``); docs/coming-from-trl.md has
both tables, tests/test_config_keys.py checks the LLaMA-Factory one against this.

LLaMA-Factory's names are those of hiyouga/LLaMA-Factory @ ff6d4d12eeb0 (the commit of the demo data in
shared/data/realworld/llamafactory): src/llamafactory/hparams/finetuning_args.py (pref_*, kto_*, simpo_gamma, lora_*,
stage, finetuning_type, ref_model, freeze_*), data_args.py (dataset, dataset_dir, template, cutoff_len, ...),
model_args.py (model_name_or_path, flash_attn, quantization_*, ...); its training keys (learning_rate, ...) are
transformers' TrainingArguments, as TRL's are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["FOREIGN", "Foreign", "foreign_line"]

TRL = "TRL"
LF = "LLaMA-Factory"
BOTH = "TRL, LLaMA-Factory"


def flow(value: Any) -> str:
    """One-line YAML for a value (as the user would write it in a prefpack config)."""
    try:
        text = yaml.safe_dump(value, default_flow_style=True, width=2**31 - 1, allow_unicode=True, sort_keys=False)
    except yaml.YAMLError:
        return repr(value)
    text = text.removesuffix("\n...\n").rstrip("\n")
    return json.dumps(value, ensure_ascii=False, default=str) if "\n" in text else text


Render = Callable[[Any, dict], str]  # (the value given, the other names given beside it) -> the text after "->"


@dataclass(frozen=True)
class Foreign:
    origin: str  # "TRL", "LLaMA-Factory" or both
    key: str | None  # prefpack's config key it maps to (None: not a config key: a prepare flag, a CLI flag, nothing)
    render: Render


def _key(key: str, note: str = "") -> Render:
    return lambda v, _: f"{key}: {flow(v)}" + (f" ({note})" if note else "")


def _text(text: str) -> Render:
    return lambda v, _: text


def _prepare(flag: str, note: str = "") -> Render:
    """A name that is a prepare flag, not a train key: truncation and tokenising happen once, when the store is
    written."""
    def render(v: Any, _: dict) -> str:
        shown = v if isinstance(v, int | float | str) and not isinstance(v, bool) else "N"
        return f"not a train key: prefpack prepare {flag} {shown}" + (f" ({note})" if note else "")
    return render


_INPUT = ("not a train key: the data is prepare's input: prefpack prepare FILES -o STORE (JSONL, JSON, Parquet, CSV or "
          "a datasets save_to_disk folder), then data.train: STORE")


def _batch(v: Any, given: dict) -> str:
    per = given.get("per_device_train_batch_size", 8)  # TrainingArguments' defaults
    acc = given.get("gradient_accumulation_steps", 1)
    try:
        total = int(per) * int(acc)
    except (TypeError, ValueError):
        return "train.global_batch_pairs: per_device_train_batch_size x gradient_accumulation_steps x GPUs"
    return (f"train.global_batch_pairs: {total} x your GPU count (per_device_train_batch_size {per} x "
            f"gradient_accumulation_steps {acc} x ranks: the pairs of one optimizer step; micro-batches are sized "
            "in tokens by train.micro_batch_tokens, not counted)")


def _accumulation(v: Any, given: dict) -> str:
    if "per_device_train_batch_size" in given:
        return "folded into train.global_batch_pairs (per_device_train_batch_size's line)"
    return _batch(v, given)


def _betas(v: Any, given: dict) -> str:
    return f"optim.betas: [{flow(given.get('adam_beta1', 0.9))}, {flow(given.get('adam_beta2', 0.999))}]"


def _terms(names: list[Any], weights: list[Any] | None = None) -> str:
    items = []
    for i, name in enumerate(names):
        w = weights[i] if weights and i < len(weights) else None
        items.append(f"{{name: {name}}}" if w is None else f"{{name: {name}, weight: {flow(w)}}}")
    return "loss.terms: [" + ", ".join(items) + "]"


_PREF_LOSS = {"sigmoid": "sigmoid", "hinge": "hinge", "ipo": "ipo", "orpo": "orpo", "simpo": "simpo"}


def _pref_loss_name(given: dict) -> str:
    return _PREF_LOSS.get(str(given.get("pref_loss", "sigmoid")), "sigmoid")


def _pref_loss(v: Any, given: dict) -> str:
    if v == "kto_pair":
        return ("loss.terms: [{name: kto}] with data.paired_as_kto: true (KTO on the pairs' halves; kto_pair itself "
                "is gone from the TRL that LLaMA-Factory's DPO trainer hands it to)")
    name = _PREF_LOSS.get(str(v))
    if name is None:
        return "loss.terms: [{name: sigmoid}] (LLaMA-Factory's sigmoid, hinge, ipo, orpo, simpo keep their names)"
    ftx = given.get("pref_ftx")
    extra = [ftx] if isinstance(ftx, int | float) and not isinstance(ftx, bool) and ftx > 0 else []
    text = _terms([name] + ["nll"] * len(extra), [None] + extra if extra else None)
    notes = {"ipo": "per-token log-ratios, as LLaMA-Factory's", "simpo": "its margin: loss.simpo_gamma",
             "orpo": "its NLL included; beta is ORPO's lambda"}
    return text + (f" ({notes[name]})" if name in notes else "")


def _pref_ftx(v: Any, given: dict) -> str:
    return (_terms([_pref_loss_name(given), "nll"], [None, v])
            + " (LLaMA-Factory adds pref_ftx x the chosen completion's per-token NLL: the nll term)")


def _bco(v: Any, given: dict) -> str:
    try:
        w = float(v)
        a, b = round(1 / (1 + w), 6), round(w / (1 + w), 6)
    except (TypeError, ValueError, ZeroDivisionError):
        a, b = "1/(1+w)", "w/(1+w)"
    return (_terms(["sigmoid", "bco_pair_running"], [a, b])
            + " (LLaMA-Factory: (DPO + w x BCO) / (1 + w), BCO's reward shift a running mean)")


def _stage(v: Any, _: dict) -> str:
    return {
        "dpo": "train.objective: preference (the default; the loss from pref_loss: loss.terms)",
        "kto": "loss.terms: [{name: kto}] on an unpaired store (prefpack prepare --format kto-messages)",
        "rm": "train.objective: reward (a reward model by the Bradley-Terry loss, docs/reward-models.md)",
    }.get(str(v), "no such stage: prefpack's are preference objectives (train.objective: preference), reward "
                   "models (train.objective: reward) and on-policy rounds (rounds.count); no sft, pt or ppo stage")


def _finetuning(v: Any, _: dict) -> str:
    return {
        "lora": "lora.enabled: true (LLaMA-Factory's default; prefpack's is full training)",
        "full": "lora.enabled: false (the default)",
    }.get(str(v), "no freeze or OFT tuning: lora.enabled: true, or full training (the default)")


def _lora_target(v: Any, _: dict) -> str:
    if v in ("all", "all-linear"):
        return "lora.target_modules: all-linear"
    if isinstance(v, str):
        return "lora.target_modules: " + flow([p.strip() for p in v.split(",") if p.strip()])
    return f"lora.target_modules: {flow(v)}"


def _schedule(v: Any, _: dict) -> str:
    mapped = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}
    if str(v) in mapped:
        return f"optim.schedule: {mapped[str(v)]}" + (" (after warmup)" if v == "constant_with_warmup" else "")
    return "optim.schedule: cosine, linear or constant (no other schedule)"


def _warmup_steps(v: Any, _: dict) -> str:
    if isinstance(v, float) and 0 < v < 1:
        return f"optim.warmup_ratio: {flow(v)} (a float below 1 is TRL's ratio)"
    return f"optim.warmup_steps: {flow(v)}"


def _max_steps(v: Any, _: dict) -> str:
    return "train.max_steps: null (from train.epochs)" if v == -1 else f"train.max_steps: {flow(v)}"


def _loss_type(v: Any, given: dict) -> str:
    names = v if isinstance(v, list) else [v]
    names = ["sigmoid" if n == "dpo" else n for n in names]
    weights = given.get("loss_weights")
    return _terms(names, weights if isinstance(weights, list) else None)


def _loss_weights(v: Any, given: dict) -> str:
    names = given.get("loss_type", "sigmoid")
    return _loss_type(names, {"loss_weights": v}) + " (each term's weight)"


def _bf16(v: Any, _: dict) -> str:
    if v is False:
        return "model.dtype: float32"
    return "model.dtype: auto (bfloat16 autocast over float32 weights on CUDA, float32 on CPU)"


def _flash_attn(v: Any, _: dict) -> str:
    mapped = {"fa2": "flash_attention_2", "sdpa": "sdpa", "auto": "auto", "disabled": "eager", "fa3": "auto"}
    return f"model.attn_implementation: {mapped.get(str(v), 'auto')}"


def _quant_bit(v: Any, given: dict) -> str:
    if v == 4:
        return f"model.quantization: {given.get('quantization_type', 'nf4')} (QLoRA: needs lora.enabled)"
    return "model.quantization: nf4 or fp4 (4-bit only; no 8-bit training)"


def _eval_strategy(v: Any, _: dict) -> str:
    if v == "no":
        return "data.eval: null (no evaluation)"
    return "run.eval_every: N with data.eval: STORE (evaluation before, every N steps and at the end; no per-epoch)"


FOREIGN: dict[str, Foreign] = {
    # ---- TRL 1.16 DPOConfig (tests/data/trl_dpo_config_fields.json) and TrainingArguments ----
    "activation_offloading": Foreign(TRL, "train.activation_offloading", _key("train.activation_offloading")),
    "adam_beta1": Foreign(BOTH, "optim.betas", _betas),
    "adam_beta2": Foreign(BOTH, "optim.betas", _betas),
    "adam_epsilon": Foreign(BOTH, "optim.eps", _key("optim.eps")),
    "beta": Foreign(TRL, "loss.beta", _key("loss.beta")),
    "bf16": Foreign(BOTH, "model.dtype", _bf16),
    "dataset_num_proc": Foreign(TRL, None, _prepare("--workers")),
    "deepspeed": Foreign(BOTH, None, _text("no DeepSpeed: torchrun with distributed.strategy: ddp or fsdp2")),
    "disable_dropout": Foreign(TRL, None, _text("always on in prefpack (dropout p = 0 at load): remove it")),
    "disable_tqdm": Foreign(BOTH, None, _text("prefpack train --no-progress")),
    "discopop_tau": Foreign(TRL, "loss.discopop_tau", _key("loss.discopop_tau")),
    "eval_steps": Foreign(BOTH, "run.eval_every", _key("run.eval_every")),
    "eval_strategy": Foreign(BOTH, "run.eval_every", _eval_strategy),
    "f_alpha_divergence_coef": Foreign(TRL, "loss.f_alpha_divergence_coef", _key("loss.f_alpha_divergence_coef")),
    "f_divergence_type": Foreign(TRL, "loss.f_divergence_type", _key("loss.f_divergence_type")),
    "fp16": Foreign(BOTH, "model.dtype", _text("float16 training is refused: model.dtype: auto (bfloat16 on CUDA)")),
    "fsdp": Foreign(BOTH, "distributed.strategy", _text("distributed.strategy: fsdp2 (under torchrun)")),
    "gradient_accumulation_steps": Foreign(BOTH, "train.global_batch_pairs", _accumulation),
    "gradient_checkpointing": Foreign(BOTH, "model.gradient_checkpointing", _key("model.gradient_checkpointing")),
    "label_smoothing": Foreign(TRL, "loss.label_smoothing", _key("loss.label_smoothing")),
    "ld_alpha": Foreign(BOTH, "loss.ld_alpha", _key("loss.ld_alpha")),
    "learning_rate": Foreign(BOTH, "optim.lr", _key("optim.lr")),
    "logging_steps": Foreign(BOTH, "run.log_every", _key("run.log_every")),
    "loss_type": Foreign(TRL, "loss.terms", _loss_type),
    "loss_weights": Foreign(TRL, "loss.terms", _loss_weights),
    "lr_scheduler_kwargs": Foreign(BOTH, None, _text("the schedules take no options (no minimum lr, no restarts)")),
    "lr_scheduler_type": Foreign(BOTH, "optim.schedule", _schedule),
    "max_grad_norm": Foreign(BOTH, "optim.max_grad_norm", _key("optim.max_grad_norm")),
    "max_length": Foreign(TRL, None, _prepare("--max-length", "prompt + completion, cut once when the store is "
                                              "written; default no limit, TRL's 1024")),
    "max_steps": Foreign(BOTH, "train.max_steps", _max_steps),
    "model_init_kwargs": Foreign(TRL, "model.dtype", _text("model.dtype, model.attn_implementation, "
                                                            "model.trust_remote_code (no free-form kwargs)")),
    "num_train_epochs": Foreign(BOTH, "train.epochs", _key("train.epochs")),
    "optim": Foreign(BOTH, None, _text("always torch's AdamW (fused where available): remove it")),
    "output_dir": Foreign(BOTH, "run.output_dir", _key("run.output_dir")),
    "pad_to_multiple_of": Foreign(TRL, "data.pad_to_multiple_of", _key("data.pad_to_multiple_of")),
    "pad_token": Foreign(TRL, None, _text("the tokenizer's pad token (else EOS): remove it")),
    "padding_free": Foreign(TRL, "data.packing", _key("data.packing")),
    "per_device_eval_batch_size": Foreign(BOTH, "train.micro_batch_tokens",
                                          _text("train.micro_batch_tokens (evaluation uses the training micro-batch "
                                                "token budget)")),
    "per_device_train_batch_size": Foreign(BOTH, "train.global_batch_pairs", _batch),
    "precompute_ref_batch_size": Foreign(TRL, None, _text("prefpack precompute-ref --micro-batch-tokens (tokens)")),
    "precompute_ref_log_probs": Foreign(TRL, "reference.mode", _text(
        "reference.mode: precomputed (after prefpack precompute-ref --model REF --data STORE)")),
    "ref_model_mixup_alpha": Foreign(TRL, "reference.mixup_alpha", _key("reference.mixup_alpha")),
    "ref_model_sync_steps": Foreign(TRL, "reference.sync_steps", _key("reference.sync_steps")),
    "report_to": Foreign(BOTH, "run.report_to", _key("run.report_to")),
    "resume_from_checkpoint": Foreign(BOTH, None, _text("prefpack train --resume (the newest intact checkpoint)")),
    "router_aux_loss_coef": Foreign(TRL, "loss.router_aux_loss_coef", _key("loss.router_aux_loss_coef")),
    "run_name": Foreign(BOTH, "run.output_dir", _text("run.output_dir (the W&B run name is its folder's name)")),
    "save_steps": Foreign(BOTH, "run.save_every", _key("run.save_every")),
    "save_strategy": Foreign(BOTH, "run.save_every", _text("run.save_every: N (steps only)")),
    "save_total_limit": Foreign(BOTH, "run.keep_checkpoints", _key("run.keep_checkpoints")),
    "seed": Foreign(BOTH, "train.seed", _key("train.seed")),
    "sync_ref_model": Foreign(TRL, "reference.sync", _key("reference.sync")),
    "torch_compile": Foreign(BOTH, "model.compile", _key("model.compile")),
    "torch_empty_cache_steps": Foreign(BOTH, None, _text("not offered: the CUDA cache is never emptied during training")),
    "truncation_mode": Foreign(TRL, None, _text("not a train key: prefpack prepare --truncation prompt-left or drop")),
    "trust_remote_code": Foreign(BOTH, "model.trust_remote_code", _key(
        "model.trust_remote_code", "and prepare's --trust-remote-code")),
    "use_cpu": Foreign(BOTH, "train.device", _text("train.device: cpu")),
    "use_liger_kernel": Foreign(BOTH, None, _text("no Liger kernels (the chunked completion-only head saves the same "
                                                  "memory): remove it")),
    "use_weighting": Foreign(TRL, "loss.use_weighting", _key("loss.use_weighting")),
    "warmup_steps": Foreign(BOTH, "optim.warmup_steps", _warmup_steps),
    "warmup_ratio": Foreign(BOTH, "optim.warmup_ratio", _key("optim.warmup_ratio")),
    "weight_decay": Foreign(BOTH, "optim.weight_decay", _key("optim.weight_decay")),
    # TRL's script and model arguments, which a flat TRL YAML holds beside DPOConfig's
    "dataset_name": Foreign(TRL, None, _text(_INPUT)),
    "dataset_train_split": Foreign(TRL, None, _text("not a train key: prefpack prepare --split NAME (of a "
                                                    "save_to_disk DatasetDict folder)")),
    "dataset_test_split": Foreign(TRL, "data.eval", _text(
        "data.eval: STORE, prepared from that split (prefpack prepare --split NAME -o STORE)")),
    "model_name_or_path": Foreign(BOTH, "model.name_or_path", _key("model.name_or_path")),
    "torch_dtype": Foreign(TRL, "model.dtype", _key("model.dtype")),
    "dtype": Foreign(TRL, "model.dtype", _key("model.dtype")),
    "attn_implementation": Foreign(TRL, "model.attn_implementation", _key("model.attn_implementation")),
    "use_peft": Foreign(TRL, "lora.enabled", _key("lora.enabled")),
    "lora_r": Foreign(TRL, "lora.r", _key("lora.r")),
    "lora_target_modules": Foreign(TRL, "lora.target_modules", _lora_target),
    "load_in_4bit": Foreign(TRL, "model.quantization", _text("model.quantization: nf4 (needs lora.enabled)")),
    "bnb_4bit_quant_type": Foreign(TRL, "model.quantization", _key("model.quantization")),
    "use_bnb_nested_quant": Foreign(TRL, "model.quantization_double", _key("model.quantization_double")),
    "max_prompt_length": Foreign(TRL, None, _prepare("--max-length", "the whole sequence; a long pair loses the "
                                                     "prompt's start first")),
    "rpo_alpha": Foreign(TRL, "loss.terms", lambda v, _: _terms(["sigmoid", "nll"], [None, v])),
    # ---- LLaMA-Factory: hparams/finetuning_args.py ----
    "stage": Foreign(LF, "train.objective", _stage),
    "finetuning_type": Foreign(LF, "lora.enabled", _finetuning),
    "pref_beta": Foreign(LF, "loss.beta", _key("loss.beta")),
    "pref_loss": Foreign(LF, "loss.terms", _pref_loss),
    "pref_ftx": Foreign(LF, "loss.terms", _pref_ftx),
    "pref_bco_weight": Foreign(LF, "loss.terms", _bco),
    "dpo_label_smoothing": Foreign(LF, "loss.label_smoothing", _key("loss.label_smoothing")),
    "simpo_gamma": Foreign(LF, "loss.simpo_gamma", _key("loss.simpo_gamma")),
    "kto_chosen_weight": Foreign(LF, "loss.desirable_weight", _key("loss.desirable_weight")),
    "kto_rejected_weight": Foreign(LF, "loss.undesirable_weight", _key("loss.undesirable_weight")),
    "lora_rank": Foreign(LF, "lora.r", _key("lora.r")),
    "lora_alpha": Foreign(BOTH, "lora.alpha", _key("lora.alpha", "LLaMA-Factory's default is 2 x lora_rank; "
                                                   "prefpack's is 16")),
    "lora_dropout": Foreign(BOTH, "lora.dropout", _key("lora.dropout")),
    "lora_target": Foreign(LF, "lora.target_modules", _lora_target),
    "use_dora": Foreign(LF, None, _text("no DoRA: plain LoRA only (lora.enabled: true)")),
    "ref_model": Foreign(LF, "reference.model", _key("reference.model")),
    "freeze_vision_tower": Foreign(LF, "model.freeze_vision", _key("model.freeze_vision")),
    "freeze_multi_modal_projector": Foreign(LF, "model.freeze_projector", _key("model.freeze_projector")),
    "plot_loss": Foreign(LF, "run.plot", _key("run.plot")),
    # ---- LLaMA-Factory: hparams/data_args.py ----
    "cutoff_len": Foreign(LF, None, _prepare("--max-length", "prompt + completion, cut once when the store is written; "
                                             "default no limit, LLaMA-Factory's 2048")),
    "dataset": Foreign(LF, None, _text(
        "not a train key: the file dataset_info.json names for it is prepare's input: prefpack prepare "
        "DATASET_DIR/FILE -o STORE (--format sharegpt, kto-messages or alpaca are LLaMA-Factory's layouts), then "
        "data.train: STORE")),
    "dataset_dir": Foreign(LF, None, _text("not a train key: the folder of prepare's input files (prefpack prepare "
                                           "DATASET_DIR/FILE -o STORE)")),
    "eval_dataset": Foreign(LF, "data.eval", _text("data.eval: STORE, prepared from that dataset's file")),
    "val_size": Foreign(LF, "data.eval", _text("data.eval: STORE: a held-out file prepared apart (no split at "
                                               "train time)")),
    "template": Foreign(LF, None, _text(
        "not a train key: prepare renders with the tokenizer's own chat template; another one: prefpack prepare "
        "--chat-template FILE.jinja (LLaMA-Factory's template names are its own, not files)")),
    "enable_thinking": Foreign(LF, None, lambda v, _: "not a train key: prefpack prepare --chat-template-kwargs "
                               + "'" + json.dumps({"enable_thinking": bool(v)}) + "'"),
    "preprocessing_num_workers": Foreign(LF, None, _prepare("--workers")),
    "max_samples": Foreign(LF, None, _text("no sample cap: prepare a shortened input file, or bound the run with "
                                           "train.max_steps")),
    "packing": Foreign(LF, "data.packing", _key("data.packing")),
    # ---- LLaMA-Factory: hparams/model_args.py ----
    "adapter_name_or_path": Foreign(LF, "lora.adapter", _key("lora.adapter")),
    "flash_attn": Foreign(LF, "model.attn_implementation", _flash_attn),
    "quantization_bit": Foreign(LF, "model.quantization", _quant_bit),
    "quantization_type": Foreign(LF, "model.quantization", _key("model.quantization")),
    "double_quantization": Foreign(LF, "model.quantization_double", _key("model.quantization_double")),
    "disable_gradient_checkpointing": Foreign(LF, "model.gradient_checkpointing",
                                              lambda v, _: "model.gradient_checkpointing: "
                                              + ("false" if v is True else "auto")),
    # ---- TrainingArguments keys LLaMA-Factory's examples set ----
    "do_train": Foreign(LF, None, _text("prefpack train trains: remove it")),
    "overwrite_output_dir": Foreign(LF, None, _text(
        "a folder holding a run is never overwritten: another run.output_dir, or prefpack train --resume")),
    "save_only_model": Foreign(LF, None, _text("not offered: checkpoints hold what prefpack train --resume needs, "
                                               "the final model is written apart: remove it")),
    "ddp_timeout": Foreign(LF, None, _text("not offered: remove it")),
    "dataloader_num_workers": Foreign(LF, None, _text("not offered (the store is read in process): remove it")),
}


def foreign_line(name: str, given: dict) -> str | None:
    """``NAME (ORIGIN) -> what it is in prefpack`` for another trainer's top-level name, else None. ``given`` is every
    unknown top-level name of the config with its value (a batch size is the product of two of them)."""
    entry = FOREIGN.get(name)
    if entry is None:
        return None
    try:
        text = entry.render(given.get(name), given)
    except Exception:  # a value of an unexpected type: still name the key
        text = entry.key or "see docs/coming-from-trl.md"
    return f"({entry.origin}) -> {text}"
