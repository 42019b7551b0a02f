"""Everything before the first step: config and run-folder checks, then `build` (stores, precision, attention,
models, reference, budgets, tasks), the modules wrapped for the ranks, and the optimizer."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prefpack.budgets import checkpointing_on, resolve_budgets
from prefpack.config.mixture import eval_sources, is_mixture, train_sources
from prefpack.data.store import Store, StoreError
from prefpack.data.views import row_lengths
from prefpack.distributed import Dist, wrap
from prefpack.losses import BATCH_COUPLED_LOSSES, LossTerm, needs_reference
from prefpack.model import (
    KERNELS,
    ModelError,
    SequenceLogps,
    TokenizerHandle,
    apply_freeze,
    attention_name,
    check_model_source,
    check_vocab_fits,
    is_vision_language,
    kernel_of,
    load_causal_lm,
    lora_targets,
    pick_attention,
    pick_device,
    release_freed_memory,
    resolve_tokenizer,
    router_aux_loss_coef,
    source_dtype,
    uses_flash_attention,
    wants_compile,
    weights_hash,
)
from prefpack.objectives import (
    Objective,
    RunSettings,
    config_terms,
    make_objectives,
    open_store,
    settings_from_config,
    uses_unpaired_loss,
)
from prefpack.precision import DTYPES, Precision, pure_bfloat16_warning, resolve_precision
from prefpack.reference import REFERENCE_MODES, Reference, ReferenceSetup
from prefpack.tokenizer import tokenizer_matches
from prefpack.training.mixture import describe_mixture

# ------------------------------------------------------------------------------------------------ checks


def check_trainable(cfg) -> None:
    """The checks that need neither a model nor a device: a bad config stops before anything loads."""
    from prefpack.config import ConfigError
    from prefpack.metrics import check_report_to

    cfg.validate()
    check_report_to(cfg.run)  # a missing wandb or mlflow stops before any model loads
    if cfg.model.dtype == "float16":
        raise ConfigError("model.dtype float16 cannot train here: its narrow range needs loss scaling, which prefpack "
                          "does not do; use bfloat16 (float32 master weights are kept) or float32 (float16 is fine "
                          "for eval and precompute-ref)")


def open_run_dir(cfg, ctx: Dist, *, resume: bool, log) -> Path:
    """The run folder, checked: stale temporaries of killed runs removed, a finished or started run never
    overwritten without --resume, and a resume's config compared with the run's. Rank 0 creates it."""
    run_dir = Path(cfg.run.output_dir)
    if ctx.is_main and run_dir.is_dir():
        from prefpack.training.checkpoint import remove_stale_temporaries

        remove_stale_temporaries(run_dir, log=log)  # left by killed runs (never one whose process is alive)
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
            raise ModelError(f"run folder {str(run_dir)!r} already holds a run; pass --resume to continue it or "
                             "choose another run.output_dir")
        _refuse_user_config(run_dir / "config.yaml")
    ctx.barrier()
    if resume:
        from prefpack.training.resume_check import check_resume_config, check_resume_store

        check_resume_config(cfg, run_dir, log=log)  # a config that changes the result is refused
        check_resume_store(cfg, run_dir)  # so is other data (at the same path or another)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            _start_over_without_checkpoint(run_dir, log)
    return run_dir


def _refuse_user_config(path: Path) -> None:
    """A run writes its resolved config to RUN_DIR/config.yaml: a file there that prefpack did not write (the
    user's own config, comments and all) is never replaced."""
    from prefpack.config import ConfigError
    from prefpack.config.io import CONFIG_HEADER

    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            first = fh.readline().rstrip("\n")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if first != CONFIG_HEADER:
        raise ConfigError(f"{path} is not a config prefpack wrote (your own config?), and a run writes its resolved "
                          f"config there: move your file out of the run folder (e.g. next to it) and train with it "
                          "from there, or choose another run.output_dir")


def _start_over_without_checkpoint(run_dir: Path, log) -> None:
    """`--resume` with no checkpoint starts from step 0: the lines an earlier start logged are dropped, so no step
    is logged twice."""
    from prefpack.training.checkpoint import latest_checkpoint

    metrics = run_dir / "metrics.jsonl"
    if latest_checkpoint(run_dir) is None and metrics.is_file() and metrics.stat().st_size:
        lines = sum(1 for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip())
        metrics.write_text("", encoding="utf-8")
        log(f"no checkpoint to resume from: the run starts over, and the {lines} lines an earlier start wrote in "
            f"{metrics} are dropped")


def save_run_config(cfg, run_dir: Path, *, resume: bool) -> None:
    """`config.yaml` of the run folder (rank 0 only); a resume with the same config rewrites nothing."""
    from prefpack.config import save_config
    from prefpack.training.resume_check import config_unchanged, config_write_errors, write_store_identity

    if not (resume and config_unchanged(cfg, run_dir / "config.yaml")):  # a resume rewrites nothing
        with config_write_errors(run_dir / "config.yaml"):  # atomic; a failed write leaves the old file
            save_config(cfg, run_dir / "config.yaml")
    write_store_identity(cfg, run_dir)  # what each checkpoint records as the run's data


# ------------------------------------------------------------------------------------------------ set-up


@dataclass
class Setup:
    policy: nn.Module
    reference: Reference
    tokenizer: TokenizerHandle
    train_store: Store
    eval_store: Store | None
    device: torch.device
    dtype: torch.dtype
    pad_id: int
    train_task: Objective
    eval_task: Objective | None
    precision: Precision
    cfg: Any  # the run's config as loaded (never changed; what build resolved is in ``settings``)
    settings: RunSettings  # budgets, layout and loss parameters resolved for this device and kernel
    # every eval store's objective by name (data.eval as a map; "" for a single store); eval_task is the first
    eval_tasks: dict[str, Objective] = field(default_factory=dict)
    # the image processor the run preprocesses with (an image store's processor/), saved with the final model so
    # that it is a complete checkpoint; None for a text run
    image_processor_dir: Path | None = None


def build(cfg, *, log=print, device: torch.device | None = None, check_sidecar_reference: bool = True) -> Setup:
    """Load stores, tokenizer, policy and reference as the config says, with every check up front.

    ``check_sidecar_reference=False`` (``prefpack eval``): a precomputed reference is taken as the reference
    whatever model it was computed with; training checks it was computed with its reference weights."""
    if not cfg.model.name_or_path:
        raise ModelError("model.name_or_path is required (a local model folder or a hub id)")
    if not cfg.data.train:
        raise StoreError("data.train is required (a store written by prefpack prepare)")
    check_model_source(cfg.model.name_or_path, "model.name_or_path")  # one line now, not hub retries later
    kto = uses_unpaired_loss(cfg)  # the KTO family: unpaired examples, prefpack.objectives.KTOTask
    opener = partial(open_store, unpaired=kto, paired_as_kto=cfg.data.paired_as_kto)
    specs = train_sources(cfg.data.train)  # a mixture: several stores, each under its own name
    train_stores = [(spec.name, opener(spec.path, "train")) for spec in specs]
    train_store = train_stores[0][1]
    eval_stores = {name: opener(path, "eval") for name, path in eval_sources(cfg.data.eval).items()}
    eval_store = next(iter(eval_stores.values()), None)
    if cfg.reference.model and REFERENCE_MODES[cfg.reference.mode].reads_weights:
        check_model_source(cfg.reference.model, "reference.model")
    device = device or pick_device(cfg.train.device)
    precision = resolve_precision(
        cfg.model.dtype, cfg.optim.master_dtype, device, lora=cfg.lora.enabled,
        fsdp_sharded=cfg.distributed.strategy == "fsdp2" and int(os.environ.get("WORLD_SIZE", "1")) > 1)
    dtype = precision.weights
    attn = pick_attention(cfg.model.attn_implementation, device, precision.compute)
    tok = resolve_tokenizer(cfg.model.name_or_path, train_store.meta, train_store.tokenizer_path(),
                            tokenizer=cfg.model.tokenizer, allow_mismatch=cfg.model.allow_tokenizer_mismatch,
                            trust_remote_code=cfg.model.trust_remote_code)
    for name, store in eval_stores.items():
        if not cfg.model.allow_tokenizer_mismatch and not tokenizer_matches(tok, store.meta["tokenizer"]):
            raise StoreError(f"data.eval{'.' + name if name else ''}: eval store {str(store.path)!r} was prepared "
                             "with another tokenizer than the train store")
    for i, (_, store) in enumerate(train_stores[1:], 1):
        if not cfg.model.allow_tokenizer_mismatch and not tokenizer_matches(tok, store.meta["tokenizer"]):
            raise StoreError(f"data.train[{i}]: store {str(store.path)!r} was prepared with another tokenizer than "
                             f"data.train[0] ({specs[0].path!r}); a mixture's stores share one tokenizer (prepare it "
                             "again with the same --tokenizer)")
    compile_layers = wants_compile(cfg.model.compile, device, int(os.environ.get("WORLD_SIZE", "1")))
    torch.manual_seed(cfg.train.seed)
    policy = load_causal_lm(cfg.model.name_or_path, precision=precision, attn_implementation=attn, device=device,
                            trust_remote_code=cfg.model.trust_remote_code, packed=cfg.data.packing,
                            compile_layers=compile_layers)
    _vision_settings(policy, cfg, log)
    for spec, (_, store) in zip(specs, train_stores):
        check_vocab_fits(policy, store.meta, spec.path)
    if compile_layers:
        log("decoder layers compiled with torch.compile (model.compile"
            + (": auto; eager where the compiler fails)" if compile_layers == "auto" else ")"))
    terms = [] if kto else [LossTerm(t.name, float(t.weight)) for t in cfg.loss.terms]
    coupled = [t.name for t in terms if t.name in BATCH_COUPLED_LOSSES]
    if coupled:
        log(f"note: {', '.join(coupled)} couple the pairs of one micro-batch (as TRL's do within one forward pass), "
            "so their values depend on which pairs share a micro-batch (train.micro_batch_tokens)")
    mode = cfg.reference.mode
    if not kto and not needs_reference(terms) and mode != "none":
        log(f"note: the losses {[t.name for t in terms]} need no reference; reference.mode {mode!r} is ignored")
        mode = "none"
    ref_path = cfg.reference.model or cfg.model.name_or_path
    # what a mode may ask for, computed only if it does: the reference weights loaded exactly like the policy's
    # (same dtype and autocast: at step 0 both give the same log-probs), or their hash (a sidecar's tag)
    reference = REFERENCE_MODES[mode].set_up(ReferenceSetup(
        load=partial(load_causal_lm, ref_path, precision=precision, attn_implementation=attn, device=device,
                     trust_remote_code=cfg.model.trust_remote_code, packed=cfg.data.packing,
                     compile_layers=compile_layers),
        weights_hash=partial(_reference_hash, cfg, policy, ref_path, precision, attn) if check_sidecar_reference
        else _no_hash, lora=cfg.lora.enabled))
    if cfg.lora.enabled:
        policy = _wrap_lora(policy, cfg)
        reference.bind_policy(policy)
    if checkpointing_on(cfg.model.gradient_checkpointing, device, cfg.train.memory):
        _enable_checkpointing(policy)
    if precision.weights == torch.bfloat16 and cfg.optim.master_dtype == "bfloat16":
        log(pure_bfloat16_warning([p for p in policy.parameters() if p.requires_grad], cfg.optim.lr))
    budgets = _budgets(cfg, policy, device, precision, attn, log)
    shares_prompts = _prefix_sharing(cfg.data, policy)
    if shares_prompts:
        log("each prompt laid out once per prompt group in packed rows (data.prefix_sharing)")
    for what, store in [("train", st) for _, st in train_stores] + [("eval", st) for st in eval_stores.values()]:
        if store is not None:
            check_lengths(store, what, policy, budgets.row_tokens if cfg.data.packing else None, log)
    # LD-DPO weights the reference's sums too
    reference.configure(chunk_size=budgets.chunk_size, pair_tails=cfg.loss.ld_alpha is not None)
    pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    tokenizer = TokenizerHandle.of(tok, trust_remote_code=cfg.model.trust_remote_code)
    del tok  # loaded again to be saved with the final model; training needs only the ids
    release_freed_memory()
    coef = 0.0
    if kto and cfg.loss.router_aux_loss_coef:
        raise ModelError("loss.router_aux_loss_coef: the MoE load-balancing loss is added to pair losses only, "
                         "not to KTO's; leave it null or 0")
    if not kto:
        try:  # TRL's rule: null = the model config's coefficient, added only for MoE models
            coef = router_aux_loss_coef(policy, cfg.loss.router_aux_loss_coef)
        except ValueError as e:
            raise ModelError(str(e)) from None
        if coef:
            log(f"MoE router load-balancing loss added with weight {coef:g} (loss.router_aux_loss_coef)")
    every_store = [("train", st) for _, st in train_stores] + [(f"data.eval{'.' + n if n else ''}", st)
                                                               for n, st in eval_stores.items()]
    vision = run_images(policy, every_store)
    processor_dir = next((st.path / "processor" for _, st in every_store if st.num_images), None)
    settings = settings_from_config(cfg, pad_id=pad_id, micro_batch_tokens=budgets.micro_batch_tokens,
                                    row_tokens=budgets.row_tokens, chunk_size=budgets.chunk_size,
                                    shares_prompts=shares_prompts, router_aux_loss_coef=coef, vision=vision)
    train_task, eval_list = make_objectives(settings, config_terms(cfg),
                                            train_stores if is_mixture(cfg.data.train) else train_store,
                                            list(eval_stores.values()), reference, kto=kto,
                                            group_by_prompt=cfg.data.group_by_prompt, log=log)
    eval_tasks = dict(zip(eval_stores, eval_list))
    for line in describe_mixture(cfg, train_task):
        log(line)
    return Setup(policy, reference, tokenizer, train_store, eval_store, device, dtype, pad_id, train_task,
                 eval_list[0] if eval_list else None, precision, cfg, settings, eval_tasks, processor_dir)


def run_images(model: nn.Module, stores: list[tuple[str, Store]]):
    """The run's ``VisionSettings`` (None when no store holds images): one image processor over every image store,
    each store's images expanded for this model (its image token and patch grid), and a vision-language model."""
    from prefpack.data.vision_inputs import run_vision
    from prefpack.model.vision import check_processor, vision_parts

    parts = vision_parts(model) if is_vision_language(model) else None

    def check(processor: dict, where: str) -> None:
        try:
            check_processor(model, processor, where)
        except ValueError as exc:
            raise StoreError(str(exc)) from None

    return run_vision(stores, parts, check)


def _vision_settings(policy: nn.Module, cfg, log) -> None:
    """``model.freeze_vision`` / ``model.freeze_projector`` applied to a vision-language policy; on a text model
    either set false is an error (nothing to train), and so are images under sequence parallelism."""
    if not is_vision_language(policy):
        unset = [k for k in ("freeze_vision", "freeze_projector") if not getattr(cfg.model, k)]
        if unset:
            raise ModelError(f"model.{unset[0]}=false: {cfg.model.name_or_path!r} is a text model, with no vision "
                             "encoder or projector to train; leave it at true")
        return
    if cfg.distributed.sequence_parallel > 1:
        raise ModelError("distributed.sequence_parallel: vision-language models do not run on token shards yet; set "
                         "distributed.sequence_parallel=1")
    apply_freeze(policy, freeze_vision=cfg.model.freeze_vision, freeze_projector=cfg.model.freeze_projector)
    state = {True: "frozen", False: "trained"}
    log(f"vision-language model ({type(policy).__name__}): vision encoder {state[cfg.model.freeze_vision]}, projector "
        f"{state[cfg.model.freeze_projector]} (model.freeze_vision, model.freeze_projector)")
    if not cfg.model.freeze_vision and cfg.train.micro_batch_tokens == "auto":
        log("note: the auto micro-batch budget counts the language model's activations only; a trained vision "
            "encoder keeps its own for every image patch (Qwen2-VL: 4 per image token). If memory runs short, set "
            "train.micro_batch_tokens lower")


def _enable_checkpointing(policy: nn.Module) -> None:
    """Non-reentrant activation checkpointing, under the name transformers 5.23 prefers (the old one warns)."""
    enable = getattr(policy, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _prefix_sharing(data_cfg, policy: nn.Module) -> bool:
    """``data.prefix_sharing`` resolved: prompt-shared rows need packing and a kernel that reads
    prompt groups (its descriptor says so). ``auto`` is on where the descriptor says sharing was measured faster
    (``prefix_sharing_auto``); ``true`` runs on any reader and elsewhere is an error naming what is missing."""
    setting = data_cfg.prefix_sharing
    if not setting:
        return False
    kernel = kernel_of(policy)
    if setting == "auto":
        return data_cfg.packing and kernel.prefix_sharing_auto  # pair and KTO objectives alike
    if not data_cfg.packing:
        raise ModelError("data.prefix_sharing lays prompts out once in packed rows; with data.packing=false there are "
                         "none: set one of them false")
    if not kernel.reads_prompt_groups:
        readers = [k for k in KERNELS if k.reads_prompt_groups]
        raise ModelError(f"data.prefix_sharing needs an attention kernel that reads prompt groups from position ids "
                         f"({' or '.join(f'{k.name} on {k.where}' for k in readers)}); this run uses "
                         f"{kernel.name or 'another kernel'!r}. Set data.prefix_sharing=false, or "
                         f"model.attn_implementation={' / '.join(f'{k.name} ({k.where})' for k in readers)}")
    return True


def _budgets(cfg, policy: nn.Module, device: torch.device, precision: Precision, attn: str, log):
    """The micro-batch, row and chunk budgets: the config's numbers, ``auto`` ones sized for this device."""
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    budgets, line = resolve_budgets(cfg.train, cfg.data, policy, device, trainable_params=trainable,
                                    autocast=precision.autocast,
                                    checkpointing=checkpointing_on(cfg.model.gradient_checkpointing, device,
                                                                   cfg.train.memory),
                                    memory_first=cfg.train.memory == "first",
                                    flattened=uses_flash_attention(policy))
    log(f"{line}; precision: {precision.describe()}; attention: {attention_name(policy) or attn}")
    return budgets


def check_lengths(store: Store, what: str, model: nn.Module, row_budget: int | None, log) -> None:
    """Refuse sequences longer than the model's positions (they would fail or silently extrapolate), and say
    once how many examples are longer than a packed row (each of those gets a row of its own)."""
    longest, example, unit = row_lengths(store)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0 and int(longest.max()) > limit:
        n = int((longest > limit).sum())
        raise ModelError(f"{what} store {str(store.path)!r}: {n} of {len(store)} {unit} have a sequence longer than "
                         f"the model's max_position_embeddings ({limit}; the longest has {int(longest.max())} "
                         f"tokens); prepare the data again with `prefpack prepare ... --max-length {limit}`")
    if row_budget is not None:
        n = int((example > row_budget).sum())
        if n:
            log(f"note: {n} of {len(store)} {unit} in the {what} store are longer than a row "
                f"(data.max_tokens_per_row={row_budget}); each of them gets a row of its own")


def _no_hash() -> None:
    return None  # a precomputed reference read without checking which weights computed it


def _reference_hash(cfg, policy: nn.Module, ref_path: str, precision: Precision, attn) -> str:
    if ref_path == cfg.model.name_or_path:
        return weights_hash(policy)
    ref = load_causal_lm(ref_path, precision=precision, attn_implementation=attn, device=torch.device("cpu"),
                         trust_remote_code=cfg.model.trust_remote_code, packed=False)  # only hashed
    h = weights_hash(ref)
    del ref
    return h


def _wrap_lora(model: nn.Module, cfg) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ModelError("lora.enabled needs peft: pip install 'prefpack[lora]'") from exc
    target = cfg.lora.target_modules
    if is_vision_language(model):  # the language model's layers (and the vision side's where not frozen) only
        target = lora_targets(model, target, freeze_vision=cfg.model.freeze_vision,
                              freeze_projector=cfg.model.freeze_projector)
    lcfg = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=target, task_type="CAUSAL_LM")
    return get_peft_model(model, lcfg)


def wrap_modules(setup: Setup, ctx: Dist) -> nn.Module:
    """The policy's SequenceLogps, wrapped for the ranks (DDP / FSDP2), and the reference's module to match."""
    policy, reference = setup.policy, setup.reference
    strategy = setup.cfg.distributed.strategy
    chunk = setup.settings.chunk_size
    mixed = setup.precision.compute if setup.precision.sharded_mixed else None
    options = setup.train_task.forward_options()  # MoE aux loss, LD-DPO tails, WPO means
    module = wrap(SequenceLogps(policy, chunk_size=chunk, **options), policy, strategy, ctx,
                  trainable=True, compute_dtype=mixed)
    reference.attach(partial(_wrap_frozen, strategy=strategy, ctx=ctx, compute_dtype=mixed), module)
    return module


def _wrap_frozen(module: nn.Module, model: nn.Module, *, strategy: str, ctx: Dist, compute_dtype) -> nn.Module:
    return wrap(module, model, strategy, ctx, trainable=False, compute_dtype=compute_dtype)


# ------------------------------------------------------------------------------------------------ optimizer


def make_optimizer(params: list[nn.Parameter], cfg) -> torch.optim.Optimizer:
    """AdamW, fused where torch has a fused kernel for these parameters.

    The fused kernel updates each parameter in one pass without the foreach path's temporaries: on CPU it
    lowered the peak RSS of a 152k-vocabulary step by about 13% and made the optimizer step 6x faster
    (benchmarks/compare_trl.py). FSDP2's sharded DTensor parameters keep the default implementation.
    """
    from torch.distributed.tensor import DTensor

    fused = bool(params) and not any(isinstance(p, DTensor) for p in params) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                             weight_decay=cfg.optim.weight_decay, fused=fused or None)


def final_dtype(cfg, precision: Precision) -> torch.dtype:
    """``run.save_dtype``: auto = the dtype of the source checkpoint (a bfloat16 model trained with float32 masters
    is saved in bfloat16), else the dtype it trained in."""
    if cfg.run.save_dtype != "auto":
        return DTYPES[cfg.run.save_dtype]
    return source_dtype(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code) or precision.weights
