"""``prefpack eval`` as a library call: the typed config a store is scored with, and one store scored."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prefpack.parallel import ONE_PROCESS, Parallel

__all__ = ["EvalOptions", "eval_config", "loss_line", "run_config_of", "score_store"]


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


def run_config_of(opts: EvalOptions) -> Path | None:
    """Without --config: the config.yaml of the run folder ``--model`` is in (RUN_DIR/final's RUN_DIR/config.yaml),
    when there is one: its objective and loss are what that model trained with."""
    if opts.config:
        return None
    model = Path(opts.model)
    found = model.parent / "config.yaml"
    return found if model.is_dir() and found.is_file() else None


def _scores_pairs(run) -> bool:
    """Whether ``run``'s objective scores a pair store (a policy-gradient run's losses need groups of scored samples:
    its final model is scored with the default loss)."""
    from prefpack.objectives import train_objective

    return train_objective(run).rows["pairs"] is not None


def _take_loss(cfg, run) -> None:
    """``run``'s objective and loss (terms, weights, parameters) and how its loss read the store, onto ``cfg``."""
    if not _scores_pairs(run):
        return
    cfg.loss = run.loss
    cfg.train.objective, cfg.train.seed = run.train.objective, run.train.seed  # the seed: KTO's KL pairing
    cfg.data.paired_as_kto, cfg.data.ranked_pairs = run.data.paired_as_kto, run.data.ranked_pairs


def eval_config(opts: EvalOptions):
    """The typed config `eval` scores with: the --config run's (or the defaults; without --config, the objective
    and loss of the run folder ``--model`` is in, when it has a config.yaml), then what the flags say."""
    from prefpack.config import Config, ConfigError, LossTermConfig, load_config
    from prefpack.data.store import Store
    from prefpack.model.load import check_model_source
    from prefpack.objectives import read_only_unpaired, train_objective, trains_unpaired
    from prefpack.reference import SIDECAR_NAMES

    cfg = load_config(opts.config, []) if opts.config else Config()
    beside = run_config_of(opts)
    if beside is not None:
        run = load_config(str(beside), [])
        _take_loss(cfg, run)
        beside = beside if _scores_pairs(run) else None
    from_run = bool(opts.config or beside)
    if opts.loss:
        cfg.loss.terms = [LossTermConfig(n.strip(), 1.0) for n in opts.loss.split(",") if n.strip()]
    elif not from_run:
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
        cfg.train.seed = opts.seed if opts.seed is not None else (cfg.train.seed if from_run else 0)
        cfg.data.paired_as_kto = opts.kto or (cfg.data.paired_as_kto and from_run)
        cfg.loss.kl_pairing = "fixed" if mode == "precomputed" else "step"
    return cfg


def describe_loss(cfg) -> str:
    """The loss terms with their weights and the parameters they read: ``ipo, beta 0.1``, ``sigmoid + 0.2 nll, beta
    0.1``."""
    from prefpack.loss_params import LOSS_PARAMS
    from prefpack.losses import PAIR_LOSSES

    terms = " + ".join(t.name if t.weight == 1 else f"{t.weight:g} {t.name}" for t in cfg.loss.terms)
    names = [t.name for t in cfg.loss.terms]
    read = {p for n in names if n in PAIR_LOSSES for p in PAIR_LOSSES[n].params}
    if any(n not in PAIR_LOSSES for n in names):  # the KTO family's
        read |= {p.name for p in LOSS_PARAMS.values() if "unpaired" in p.read_by}
    params = [f"{name} {getattr(cfg.loss, name):g}" for name in LOSS_PARAMS
              if name in read and isinstance(getattr(cfg.loss, name, None), (int, float))]
    if cfg.loss.f_divergence_type != "reverse_kl":
        params.append(f"f-divergence {cfg.loss.f_divergence_type}")
    if cfg.loss.use_weighting:
        params.append("WPO weighting")
    return ", ".join([terms, *params])


def loss_line(opts: EvalOptions, cfg) -> str | None:
    """Where the loss ``eval`` scores with comes from, in one line (none for a reward model: its own objective)."""
    from prefpack.objectives import train_objective

    if not train_objective(cfg).reads_reference:
        return None
    flags = [f"--{k.replace('_', '-')}" for k, v in opts.loss_params.items() if v is not None]
    flags = (["--loss"] if opts.loss else []) + flags + (["--f-divergence-type"] if opts.f_divergence_type else []) \
        + (["--use-weighting"] if opts.use_weighting is not None else [])
    given = f" ({', '.join(flags)} as given here)" if flags else ""
    beside = run_config_of(opts)
    if opts.config:
        return f"scoring with the run's loss from {opts.config}: {describe_loss(cfg)}{given}"
    if beside is not None:
        from prefpack.config import load_config

        run = load_config(str(beside), [])
        if _scores_pairs(run):
            return f"scoring with the run's loss from {beside}: {describe_loss(cfg)}{given}"
        return (f"scoring with the default loss: {describe_loss(cfg)}{given}; the run of {beside} trained "
                f"{run.train.objective}, whose losses score groups of samples, not this store's pairs")
    return (f"scoring with the default loss: {describe_loss(cfg)}{given}; no config.yaml beside {opts.model} (a run "
            "folder's final/ has one): give --config RUN_DIR/config.yaml to score with the loss a run trained")


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
    said = loss_line(opts, cfg)  # once the model and store are accepted: what is scored with which loss
    if said:
        log(said)
    result = evaluate(setup.policy, setup.reference, setup.train_task, parallel=parallel, progress=progress)
    parallel.barrier()  # no rank leaves while another is still in a collective
    task = setup.train_task
    result.update(task.counts())
    result["reference"] = setup.reference.mode
    return result
