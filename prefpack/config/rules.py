"""Value rules of a config: what ``Config.validate()`` refuses and what ``Config.warnings()`` points out.

Apart from the schema because they read several sections at once (and the loss registry), and grow with every
loss and option; parsing (``io``) only checks keys and types. Below the schema: the schema's ``Config`` calls
these, so they read the config by its attributes and name its class for type checkers only.
"""

from __future__ import annotations

import difflib
import math
from typing import TYPE_CHECKING

from prefpack.config.mixture import mixture_problems, mixture_warnings
from prefpack.model.attention.kernels import KERNELS, kernel_named
from prefpack.objectives.names import OBJECTIVE_NAMES, PG_LOSS_NAMES, TRAIN_OBJECTIVES

if TYPE_CHECKING:
    from prefpack.config.schema import Config


def warnings(cfg: Config) -> list[str]:
    """``Config.warnings``: allowed but probably unintended settings, for the CLI to print."""
    out = []
    objective = TRAIN_OBJECTIVES.get(cfg.train.objective)
    if objective is not None and objective.round_output == "ranked" and cfg.rounds.count > 0 and (
            cfg.rounds.pairs != "best_vs_worst" or cfg.rounds.min_gap):
        out.append(f"rounds.pairs / rounds.min_gap draw pairs; train.objective={cfg.train.objective} trains every "
                   "sample of each round with its score, so they are ignored")
    if cfg.rounds.count > 0 and cfg.data.train:
        out.append(f"data.train ({cfg.data.train}) is not read by rounds: each round trains on its own scored "
                   "samples of rounds.prompts; remove data.train (data.eval is still evaluated)")
    if objective is not None and objective.loss_names is not None:
        pass  # a policy gradient's reference is read only by its KL term: the reference stage leaves it out at 0
    elif objective is not None and not objective.reads_reference:
        pass  # a reward model reads no reference, whatever loss.terms say: set-up notes that reference.mode is ignored
    elif cfg.reference.mode != "none" and cfg.loss.terms and not cfg.needs_reference():
        out.append(
            f"reference.mode is {cfg.reference.mode!r} but no loss term reads the reference "
            f"({', '.join(t.name for t in cfg.loss.terms)}); reference.mode=none saves memory and time"
        )
    ref = cfg.reference
    if not ref.sync and (ref.mixup_alpha != 0.6 or ref.sync_steps != 512):
        out.append("reference.mixup_alpha / reference.sync_steps are set but reference.sync is false, so the "
                   "reference is never synced; set reference.sync=true to use them")
    out.extend(mixture_warnings(cfg.data.eval))
    return out


def _objective_problems(cfg: Config, errs: list[str]) -> None:
    """``train.objective`` (its row of ``objectives/names.py``; a reward model: docs/reward-models.md): what the
    objective does not combine with."""
    coef = cfg.loss.center_rewards_coefficient
    if coef is not None and not (math.isfinite(coef) and coef >= 0):
        errs.append(f"loss.center_rewards_coefficient must be finite and >= 0 (or null = off), got {coef}")
    name = cfg.train.objective
    o = TRAIN_OBJECTIVES.get(name)
    if o is None:
        errs.append(f"train.objective must be one of {', '.join(OBJECTIVE_NAMES)}, got {name!r}")
        return
    if coef is not None and not o.sequence_classifier:
        scored = " or ".join(n for n, t in TRAIN_OBJECTIVES.items() if t.sequence_classifier)
        errs.append(f"loss.center_rewards_coefficient is read by reward models only; set train.objective={scored} "
                    "or remove it")
    if o.row("unpaired") is None and (cfg.data.paired_as_kto or any(t.name in ("kto", "apo_zero_unpaired")
                                                                      for t in cfg.loss.terms)):
        errs.append(f"train.objective={name} trains on pairs and rankings, not KTO examples; remove "
                    "data.paired_as_kto and the unpaired loss terms")
    if not o.token_shards and cfg.distributed.sequence_parallel > 1:
        errs.append(f"train.objective={name} does not run on token shards yet; set distributed.sequence_parallel=1")
    if not o.reads_reference and cfg.reference.sync:
        errs.append(f"train.objective={name} has no reference model; set reference.sync=false")
    if not o.four_bit and cfg.model.quantization is not None:
        errs.append(f"train.objective={name} with model.quantization (4-bit) is not supported yet; train in full "
                    "precision (LoRA works)")


def problems(cfg: Config, *, training: bool) -> list[str]:
    """``Config.validate``: every problem of ``cfg``, one message each (empty when it is valid)."""
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
        need(bool(d.train) or cfg.rounds.count > 0,
             "data.train is required: a store folder written by `prefpack prepare` (or rounds.count > 0)")
    need(not (tr.device == "cpu" and kernel_named(m.attn_implementation).needs_cuda),
         f"model.attn_implementation {m.attn_implementation!r} needs CUDA but train.device is 'cpu'")
    need(not (opt.master_dtype == "bfloat16" and m.dtype == "float32"),
         "optim.master_dtype bfloat16 with model.dtype float32 would compute in float32 on bfloat16 weights; "
         "set model.dtype=bfloat16 (pure bfloat16) or leave optim.master_dtype at auto")

    errs.extend(mixture_problems(d.train, d.eval))
    if d.max_tokens_per_row != "auto":
        at_least("data.max_tokens_per_row", d.max_tokens_per_row, 2)
    if d.pad_to_multiple_of is not None:
        at_least("data.pad_to_multiple_of", d.pad_to_multiple_of, 1)

    _loss_problems(cfg, errs)
    _rounds_problems(cfg, errs)
    positive("loss.beta", lo.beta)
    need(0.0 <= lo.label_smoothing < 0.5, f"loss.label_smoothing must be in [0, 0.5), got {lo.label_smoothing}")
    need(math.isfinite(lo.simpo_gamma), f"loss.simpo_gamma must be finite, got {lo.simpo_gamma}")
    positive("loss.discopop_tau", lo.discopop_tau)
    need(math.isfinite(lo.f_alpha_divergence_coef),
         f"loss.f_alpha_divergence_coef must be finite, got {lo.f_alpha_divergence_coef}")
    if lo.ld_alpha is not None:
        need(math.isfinite(lo.ld_alpha) and 0.0 <= lo.ld_alpha <= 1.0,
             f"loss.ld_alpha must be in [0, 1] (or null = off), got {lo.ld_alpha}")
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

    need(not cfg.distributed.cpu_offload or cfg.distributed.strategy == "fsdp2",
         f"distributed.cpu_offload holds FSDP2's shards in CPU memory; with distributed.strategy "
         f"{cfg.distributed.strategy!r} every rank keeps the whole model on its device: set "
         "distributed.strategy=fsdp2 (under torchrun), or distributed.cpu_offload=false")
    sp = cfg.distributed.sequence_parallel
    at_least("distributed.sequence_parallel", sp, 1)
    if sp > 1:
        kernel = kernel_named(m.attn_implementation)
        need(m.attn_implementation == "auto" or kernel.shards_sequences,
             f"distributed.sequence_parallel={sp} runs attention on token shards, which the "
             f"{m.attn_implementation!r} kernel cannot; set model.attn_implementation to "
             + " or ".join(["auto", *(k.name for k in KERNELS if k.shards_sequences)]))
        need(d.packing, f"distributed.sequence_parallel={sp} splits packed rows; set data.packing=true")
        need(m.compile is not True, f"distributed.sequence_parallel={sp} does not run through torch.compile yet; set "
             "model.compile=off")

    _quantization_problems(cfg, errs)
    _reference_quantization_problems(cfg, errs)
    _objective_problems(cfg, errs)
    at_least("lora.r", lora.r, 1)
    need(lora.adapter is None or lora.enabled, "lora.adapter continues a LoRA adapter; set lora.enabled=true")
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
         f"run.report_to {run.report_to!r}: 'none' turns TensorBoard, W&B and MLflow off, so it must be alone and not "
         "with run.tensorboard=true (metrics.jsonl is always written)")
    if run.eval_every > 0 and d.eval is None:
        errs.append(f"run.eval_every is {run.eval_every} but data.eval is null; set data.eval or eval_every=0")
    return errs


def _quantization_problems(cfg: Config, errs: list[str]) -> None:
    """``model.quantization`` (4-bit base weights, ``engine/quantize.py``): what a 4-bit base cannot do."""
    q = cfg.model.quantization
    if q is None:
        return
    if not cfg.lora.enabled:
        errs.append(f"model.quantization={q} holds the base weights in 4 bits, which take no gradient; set "
                    "lora.enabled=true (QLoRA: adapters trained over the 4-bit base) or model.quantization=null")
    ref = cfg.reference
    if cfg.lora.enabled and ref.mode == "copy" and ref.model in (None, cfg.model.name_or_path) \
            and cfg.needs_reference():
        errs.append(f"reference.mode 'copy' with model.quantization={q} would load a second 4-bit copy of the base "
                    "the policy already holds; use reference.mode=adapter (the same 4-bit base, adapter off: free)")
    if cfg.distributed.cpu_offload:
        errs.append(f"distributed.cpu_offload with model.quantization={q}: offload is for full fine-tuning; a 4-bit "
                    "base is frozen and already small, and its 4-bit layers are not moved by FSDP2's offload here; "
                    "set distributed.cpu_offload=false (FSDP2 shards the 4-bit base without it)")


def _reference_quantization_problems(cfg: Config, errs: list[str]) -> None:
    """``reference.quantization`` (a 4-bit frozen copy beside a full-precision policy, ``engine/reference.py``)."""
    ref = cfg.reference
    q = ref.quantization
    if q is None:
        return
    key = f"reference.quantization={q}"
    if ref.mode != "copy":
        errs.append(f"{key} loads the reference copy in 4 bits, but reference.mode is {ref.mode!r}" + {
            "precomputed": " (the sidecar holds what precompute-ref computed with --model as it loads it)",
            "adapter": " (the adapter-off policy is no separate copy)"}.get(ref.mode, "")
            + "; set reference.mode=copy or reference.quantization=null")
    elif ref.sync:
        errs.append(f"{key} with reference.sync (TR-DPO) would mix the policy's full-precision weights into a 4-bit "
                    "copy; set reference.sync=false or reference.quantization=null")
    elif cfg.model.quantization is not None:
        errs.append(f"{key} with model.quantization={cfg.model.quantization}: a copied reference is already loaded "
                    "in 4 bits like the policy; set reference.quantization=null")
    elif cfg.distributed.strategy == "fsdp2":
        errs.append(f"distributed.strategy=fsdp2 cannot shard a {key} copy (4-bit weights are not sharded through "
                    "FSDP2 here); use distributed.strategy=ddp or reference.quantization=null")


# names a user brings from papers and other trainers, mapped to the term they mean (TRL's DPO is loss_type sigmoid)
LOSS_ALIASES = {"dpo": "sigmoid", "slic": "hinge"}


def _policy_gradient_problems(cfg: Config, names: tuple[str, ...], errs: list[str]) -> None:
    """``train.objective=policy_gradient`` (objectives/pg.py): one of its loss terms, and its numbers."""
    terms, lo = cfg.loss.terms, cfg.loss
    given = [t.name for t in terms]
    if len(terms) != 1 or terms[0].name not in names:
        errs.append(f"train.objective={cfg.train.objective} trains one loss term, one of {', '.join(names)}; got "
                    f"{given or 'none'}")
    elif not (math.isfinite(terms[0].weight) and terms[0].weight > 0):
        errs.append(f"loss.terms[0].weight must be finite and > 0, got {terms[0].weight}")
    for key in ("epsilon", "epsilon_high", "kl_coef"):
        value = getattr(lo, key)
        if value is not None and not (math.isfinite(value) and value >= 0):
            errs.append(f"loss.{key} must be finite and >= 0, got {value}")
    if lo.epsilon is not None and math.isfinite(lo.epsilon) and lo.epsilon >= 1:
        errs.append(f"loss.epsilon must be < 1 (the ratio's lower clip is 1 - epsilon), got {lo.epsilon}")
    high = lo.epsilon if lo.epsilon_high is None else lo.epsilon_high
    if lo.delta is not None and not (math.isfinite(lo.delta) and lo.delta > 1 + high):
        errs.append(f"loss.delta caps the ratio above its clip: it must be > 1 + epsilon_high ({1 + high}), got "
                    f"{lo.delta}")
    if lo.max_completion_length is not None and not (math.isfinite(lo.max_completion_length)
                                                     and lo.max_completion_length >= 1):
        errs.append(f"loss.max_completion_length must be >= 1 (or null), got {lo.max_completion_length}")
    rloo = bool(terms) and terms[0].name == "rloo"
    if lo.kl_coef and not rloo and cfg.reference.mode == "precomputed":
        errs.append("loss.kl_coef > 0 reads the reference's per-token log-probs, which a sidecar (reference.mode "
                    "precomputed: per-sequence sums) does not hold; use reference.mode copy or adapter")
    if lo.kl_coef and cfg.reference.mode == "none":
        errs.append("loss.kl_coef > 0 needs a reference; set reference.mode copy (or adapter), or loss.kl_coef=0")
    if cfg.data.group_by_prompt or cfg.data.paired_as_kto:
        errs.append(f"train.objective={cfg.train.objective} reads ranked stores (every sample of a prompt with its "
                    "score); data.group_by_prompt and data.paired_as_kto are for pair stores: remove them")
    if lo.ld_alpha is not None or lo.use_weighting:
        errs.append(f"loss.ld_alpha and loss.use_weighting weight DPO pairs; train.objective={cfg.train.objective} "
                    "has none: remove them")
    if rloo and lo.off_policy_mask_threshold is not None:
        errs.append("loss.off_policy_mask_threshold masks the grpo family's per-token surrogate; loss rloo has none "
                    "(TRL's RLOO neither): remove it")
    for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if not (math.isfinite(getattr(lo, key)) and getattr(lo, key) > 0):
            errs.append(f"loss.{key} must be finite and > 0, got {getattr(lo, key)}")
    if lo.off_policy_mask_threshold is not None and not math.isfinite(lo.off_policy_mask_threshold):
        errs.append(f"loss.off_policy_mask_threshold must be finite (or null), got {lo.off_policy_mask_threshold}")
    if rloo and lo.importance_sampling_level == "sequence":
        errs.append("loss rloo's ratio is already the whole completion's (exp of its summed log-ratio): "
                    "loss.importance_sampling_level=sequence is for the grpo family (GSPO); remove it")
    bounds = (lo.sampling_ratio_min, lo.sampling_ratio_max)
    if any(b is not None and not (math.isfinite(b) and b >= 0) for b in bounds) or (
            None not in bounds and bounds[0] >= bounds[1]):
        errs.append(f"loss.sampling_ratio_min and loss.sampling_ratio_max bound the sampling ratio: each finite and "
                    f">= 0 (or null), min below max; got {bounds[0]} and {bounds[1]}")


def _loss_problems(cfg: Config, errs: list[str]) -> None:
    from prefpack.losses import PAIR_LOSSES, UNPAIRED_LOSS_NAMES

    terms = cfg.loss.terms
    objective = TRAIN_OBJECTIVES.get(cfg.train.objective)
    if objective is not None and objective.loss_names is not None:
        _policy_gradient_problems(cfg, objective.loss_names, errs)
        return
    misplaced = [t.name for t in terms if t.name in PG_LOSS_NAMES]
    if misplaced:
        errs.append(f"loss {', '.join(misplaced)} trains with train.objective=policy_gradient (on a ranked store of "
                    f"scored samples); set train.objective=policy_gradient")
        return
    valid = (*PAIR_LOSSES, *UNPAIRED_LOSS_NAMES)
    reference_free = sorted(n for n, spec in PAIR_LOSSES.items() if not spec.needs_reference)
    if not terms:
        errs.append(f"loss.terms is empty; give at least one of: {', '.join(valid)}")
        return
    names = [t.name for t in terms]
    for i, t in enumerate(terms):
        if t.name not in valid:
            alias = LOSS_ALIASES.get(t.name.lower())
            hint = [alias] if alias else difflib.get_close_matches(t.name, valid, n=1)
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
    if cfg.data.group_by_prompt and unpaired:
        errs.append(f"data.group_by_prompt groups pairs that share a prompt; {', '.join(unpaired)} trains unpaired "
                    "examples, whose prompts data.prefix_sharing already lays out once per row: set "
                    "group_by_prompt=false")
    if unpaired and (cfg.loss.ld_alpha is not None or cfg.loss.use_weighting):
        on = [k for k, v in (("ld_alpha", cfg.loss.ld_alpha is not None), ("use_weighting", cfg.loss.use_weighting))
              if v]
        errs.append(f"loss.{' and loss.'.join(on)} weight(s) a pair's chosen and rejected completions against each "
                    f"other (TRL's DPOConfig, not KTOConfig); {', '.join(unpaired)} has no pairs: remove "
                    f"{'them' if len(on) > 1 else 'it'}")
    sorting = [n for n in names if n in ("aot", "aot_unpaired")]
    if cfg.loss.use_weighting and sorting:
        errs.append(f"loss.use_weighting (WPO) cannot weight {', '.join(sorting)}: those losses sort the pairs of a "
                    "micro-batch, so a pair's weight would meet another pair's loss (TRL 1.16 refuses it too)")
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
    if cfg.reference.mode == "none" and with_ref and (objective is None or objective.reads_reference):
        errs.append(
            f"reference.mode is 'none' but loss {', '.join(repr(n) for n in with_ref)} needs a reference; "
            f"use reference.mode 'copy' (or 'adapter'/'precomputed') or only reference-free losses "
            f"({', '.join(reference_free)})"
        )


def _rounds_problems(cfg: Config, errs: list[str]) -> None:
    """The ``rounds`` section (on-policy rounds: prefpack.rounds), checked only when it is on."""
    r = cfg.rounds
    if r.count < 0:
        errs.append(f"rounds.count must be >= 0 (0 = off), got {r.count}")
    if r.count <= 0:
        return
    if not r.prompts:
        errs.append("rounds.prompts is required: a store folder or JSONL file(s) of prompts each round samples")
    if (r.reward_fn is None) == (r.reward_model is None):
        errs.append("rounds: give one scorer, rounds.reward_fn (path/to/file.py:function) or rounds.reward_model")
    if r.prompts_per_round < 0:
        errs.append(f"rounds.prompts_per_round must be >= 0 (0 = every prompt each round), got {r.prompts_per_round}")
    for key in ("samples_per_prompt", "max_new_tokens", "steps_per_round", "batch_size"):
        if getattr(r, key) < 1:
            errs.append(f"rounds.{key} must be >= 1, got {getattr(r, key)}")
    if r.pairs == "best_vs_worst" and r.samples_per_prompt < 2:
        errs.append("rounds.samples_per_prompt must be >= 2: pairs are drawn from a prompt's samples")
    if not (math.isfinite(r.reward_timeout) and r.reward_timeout >= 0):
        errs.append(f"rounds.reward_timeout must be a number of seconds >= 0 (0 = no limit), got {r.reward_timeout}")
    if not (math.isfinite(r.min_gap) and r.min_gap >= 0):
        errs.append(f"rounds.min_gap must be a finite number >= 0, got {r.min_gap}")
    if r.engine == "vllm" and (r.vllm_command is None) == (r.vllm_url is None):
        errs.append("rounds.engine vllm: give rounds.vllm_command (started on each round's policy) or rounds.vllm_url")
    if r.overlap and (r.engine != "vllm" or not r.in_process):
        errs.append("rounds.overlap samples the next round on vLLM servers while this one trains: it needs "
                    "rounds.engine=vllm and rounds.in_process=true (the in-process engine shares the trainer's device)")
    if not r.in_process and not r.save_each_round:
        errs.append("rounds.save_each_round=false keeps no round's model but the last, and rounds run as separate "
                    "trainings (rounds.in_process=false) read each round's policy back from its model: set one true")
    if not r.in_process and r.optimizer == "keep":
        errs.append("rounds.in_process=false runs each round as a whole training run, with a fresh optimizer: set "
                    "rounds.optimizer=reset with it (keep carries the optimizer across rounds in one process)")
    if r.vllm_url is not None and r.count > 1 and not r.in_process:
        errs.append("rounds.vllm_url with rounds.in_process=false: a round run as its own training cannot give a "
                    "running server its policy; leave rounds.in_process true (the server is updated in place) or "
                    "use rounds.vllm_command")
    if cfg.train.objective in TRAIN_OBJECTIVES and not TRAIN_OBJECTIVES[cfg.train.objective].rounds:
        errs.append("rounds train the policy on preference pairs: train.objective must be "
                    + " or ".join(n for n, o in TRAIN_OBJECTIVES.items() if o.rounds))
    _rounds_reference_problems(cfg, errs)


def _rounds_reference_problems(cfg: Config, errs: list[str]) -> None:
    """The reference modes and LoRA in rounds: only what cannot give the reference ``rounds.reference`` names."""
    r, mode, q = cfg.rounds, cfg.reference.mode, cfg.model.quantization
    if mode == "adapter" and r.reference == "round_start":
        errs.append("rounds.reference=round_start with reference.mode=adapter: the adapter-off model is the initial "
                    "base, not the round's starting policy; use rounds.reference=initial, or reference.mode copy or "
                    "precomputed")
    if mode == "adapter" and cfg.lora.adapter:
        errs.append("rounds with lora.adapter and reference.mode=adapter: the adapter-off model is the base without "
                    "lora.adapter, not the initial policy; use reference.mode copy or precomputed with reference.model "
                    "= a merged copy of it")
    if q is not None and mode == "precomputed":
        errs.append(f"rounds with model.quantization={q} and reference.mode=precomputed: precompute-ref scores "
                    "full-precision weights, not the 4-bit base the policy holds; use reference.mode=adapter")
    if q is not None and r.reference == "round_start" and mode != "none":
        errs.append(f"rounds.reference=round_start with model.quantization={q}: the round's starting policy (the 4-bit "
                    "base and the last adapter) is held by no reference mode; use rounds.reference=initial with "
                    "reference.mode=adapter")
    if cfg.lora.enabled and cfg.lora.adapter and r.engine == "vllm" and not r.in_process:
        errs.append("rounds.engine=vllm serves merged model folders, and round 1's policy is model.name_or_path under "
                    "lora.adapter; merge it into a folder for model.name_or_path, or use rounds.engine=transformers")
    if mode == "precomputed" and r.reference == "round_start" and cfg.data.eval:
        errs.append("rounds.reference=round_start with reference.mode=precomputed and data.eval: the held-out store's "
                    "one sidecar cannot hold every round's reference; use rounds.reference=initial or reference.mode "
                    "copy")
