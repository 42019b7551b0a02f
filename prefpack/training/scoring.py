"""``prefpack eval`` as a library call: the typed config a store is scored with, and one store scored."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prefpack.parallel import ONE_PROCESS, Parallel

__all__ = ["EvalOptions", "eval_config", "score_store"]


@dataclass
class EvalOptions:
    """What ``prefpack eval`` is asked for one store (its flags; None = the --config run's value, else the default)."""

    model: str
    data: str
    config: str | None = None  # a run's config.yaml: score as that run trained
    loss: str | None = None  # comma-separated loss terms
    ref: str | None = None  # a reference model run beside the policy
    kto: bool = False
    seed: int | None = None
    micro_batch_tokens: int | str = "auto"
    device: str = "auto"
    dtype: str | None = None
    allow_tokenizer_mismatch: bool = False
    sequence_parallel: int | None = None
    loss_params: dict[str, float] = field(default_factory=dict)  # loss.* numbers given as flags
    f_divergence_type: str | None = None
    use_weighting: bool | None = None
    ranked_pairs: str | None = None
    trust_remote_code: bool = False  # run code the model, tokenizer or processor folder names (or the --config run's)


def sequence_parallel_of(opts: EvalOptions) -> int:
    """``--sequence-parallel``, else the --config run's, else 1."""
    if opts.sequence_parallel is not None:
        return opts.sequence_parallel
    if opts.config:
        from prefpack.config import load_config

        return load_config(opts.config, []).distributed.sequence_parallel
    return 1


def eval_config(opts: EvalOptions):
    """The typed config `eval` scores with: the --config run's (or the defaults), then what the flags say."""
    from prefpack.config import Config, ConfigError, LossTermConfig, load_config
    from prefpack.data.store import Store
    from prefpack.model.load import check_model_source
    from prefpack.objectives import read_only_unpaired, train_objective, trains_unpaired
    from prefpack.reference import SIDECAR_NAMES

    cfg = load_config(opts.config, []) if opts.config else Config()
    if opts.loss:
        cfg.loss.terms = [LossTermConfig(n.strip(), 1.0) for n in opts.loss.split(",") if n.strip()]
    elif not opts.config:
        unpaired = opts.kto or read_only_unpaired(Store(opts.data).kind)
        cfg.loss.terms = [LossTermConfig("kto" if unpaired else "sigmoid", 1.0)]
    for name, value in opts.loss_params.items():
        if value is not None:
            setattr(cfg.loss, name, value)
    if opts.f_divergence_type:
        cfg.loss.f_divergence_type = opts.f_divergence_type
    if opts.use_weighting is not None:
        cfg.loss.use_weighting = opts.use_weighting
    if opts.ranked_pairs:
        cfg.data.ranked_pairs = opts.ranked_pairs
    from prefpack.model.load import is_reward_checkpoint

    check_model_source(opts.model, "--model")  # one line at once, not hub retries
    if is_reward_checkpoint(opts.model, opts.trust_remote_code or cfg.model.trust_remote_code):
        cfg.train.objective = "reward"  # a one-label sequence classifier: scored as a reward model
    unpaired = trains_unpaired(cfg.loss.terms)  # the loss terms decide: --kto without --loss chose kto above
    sidecar = SIDECAR_NAMES["unpaired" if unpaired else Store(opts.data).kind]  # the key space the run reads
    mode = "copy" if opts.ref else ("precomputed" if (Path(opts.data) / sidecar).exists() else "none")
    if not train_objective(cfg).reads_reference:
        mode = "none"  # a reward model reads no reference
    if mode == "none" and cfg.needs_reference():  # in eval's terms, not the config's reference.mode
        terms = ", ".join(t.name for t in cfg.loss.terms)
        raise ConfigError(
            f"loss {terms} needs a reference, and {opts.data} has no precomputed reference ({sidecar}) and no --ref "
            f"was given: give --ref MODEL (e.g. the initial model), run `prefpack precompute-ref --model MODEL --data "
            f"{opts.data}` once, or score a reference-free loss (--loss simpo, orpo, nll ...)")
    mbt = opts.micro_batch_tokens
    if mbt != "auto" and not str(mbt).isdigit():
        raise ConfigError(f"--micro-batch-tokens must be a positive integer or auto, got {mbt!r}")
    check_model_source(opts.model, "--model")  # one line at once, not hub retries
    if opts.ref:
        check_model_source(opts.ref, "--ref")
    cfg.model.name_or_path, cfg.data.train, cfg.data.eval = opts.model, opts.data, None
    cfg.model.dtype = opts.dtype or (cfg.model.dtype if opts.config else "auto")
    cfg.model.allow_tokenizer_mismatch = opts.allow_tokenizer_mismatch
    cfg.model.trust_remote_code = opts.trust_remote_code or cfg.model.trust_remote_code
    cfg.reference.mode, cfg.reference.model = mode, opts.ref if mode == "copy" else None  # a reward model: no --ref
    if mode != "copy":  # a run's 4-bit reference copy: only a --ref model is loaded as the run loaded its own
        cfg.reference.quantization = None
    cfg.reference.sync = False  # eval scores fixed models: a run's TR-DPO syncing does not apply
    cfg.lora.enabled = False  # a trained run's final model has its adapter merged
    cfg.model.quantization = None  # ... into its de-quantised base (a QLoRA run's final/ holds no 4-bit weights)
    cfg.train.micro_batch_tokens = "auto" if mbt == "auto" else int(mbt)
    cfg.train.device = opts.device
    cfg.run.eval_every = cfg.run.save_every = 0
    cfg.distributed.sequence_parallel = sequence_parallel_of(opts)
    cfg.distributed.cpu_offload = False  # scoring never wraps for the ranks: a run's FSDP2 offload does not apply
    if unpaired:
        cfg.train.seed = opts.seed if opts.seed is not None else (cfg.train.seed if opts.config else 0)
        cfg.data.paired_as_kto = opts.kto or (cfg.data.paired_as_kto and bool(opts.config))
        cfg.loss.kl_pairing = "fixed" if mode == "precomputed" else "step"
    return cfg


def reward_model_notes(opts: EvalOptions, cfg) -> list[str]:
    """What of the flags and the --config run a reward model's evaluation does not use, said once (it is scored by
    its own objective: the pairs' accuracy and Bradley-Terry loss, no reference)."""
    from prefpack.objectives import train_objective

    if train_objective(cfg).reads_reference:  # a causal LM's objective: every setting applies
        return []
    unused = [f"--ref {opts.ref}"] if opts.ref else []
    if opts.loss:
        unused.append(f"--loss {opts.loss}")
    unused += [f"--{k.replace('_', '-')}" for k, v in opts.loss_params.items() if v is not None]
    if opts.config:
        unused.append(f"{opts.config}'s loss terms, loss numbers and reference")
    if not unused:
        return []
    return [f"note: {opts.model} is a reward model (a one-label sequence classifier), scored by its own objective "
            f"(pairwise accuracy, Bradley-Terry loss, no reference): {', '.join(unused)} do not apply"]


def score_store(opts: EvalOptions, *, parallel: Parallel = ONE_PROCESS, log=print, progress: bool = False) -> dict:
    """``prefpack eval`` on one store: its metrics, counts and reference mode."""
    from prefpack.training.evaluation import evaluate
    from prefpack.training.setup import build

    cfg = eval_config(opts)
    cfg.validate()
    for line in reward_model_notes(opts, cfg):
        log(line)
    setup = build(cfg, log=log, parallel=parallel, check_sidecar_reference=False,  # the sidecar IS the ref
                  training=False)
    result = evaluate(setup.policy, setup.reference, setup.train_task, parallel=parallel, progress=progress)
    parallel.barrier()  # no rank leaves while another is still in a collective
    task = setup.train_task
    result.update(task.counts())
    result["reference"] = setup.reference.mode
    return result
