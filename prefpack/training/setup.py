"""Everything before the first step: config and run-folder checks, then `build`: the run's stores opened, its weights
held by an :class:`prefpack.engine.Engine` and what each step trains on by a :class:`prefpack.training.feed.Feed`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefpack.data.renderer import renderer_warnings
from prefpack.data.store import StoreError
from prefpack.distributed import Dist
from prefpack.engine import Engine, build_engine
from prefpack.model import (
    ModelError,
    TokenizerHandle,
    check_model_source,
    check_vocab_fits,
    pick_device,
    release_freed_memory,
    resolve_tokenizer,
)
from prefpack.model.sharded import check_model
from prefpack.objectives import train_objective, uses_unpaired_loss
from prefpack.parallel import ONE_PROCESS, Parallel
from prefpack.tokenizer import tokenizer_matches
from prefpack.training.feed import StoreFeed, StoreSet, open_stores, store_feed

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
    """A run built: its weights (``engine``), what it trains on (``feed``), where it runs (``parallel``), and what the
    final folder needs besides the weights (the tokenizer; the image processor of an image run, so that it is a
    complete checkpoint)."""

    engine: Engine
    feed: StoreFeed  # or any Feed (prefpack.training.feed)
    parallel: Parallel
    tokenizer: TokenizerHandle
    pad_id: int
    cfg: Any  # the run's config as loaded (never changed; what build resolved is in ``settings``)
    image_processor_dir: Path | None = None

    @property
    def policy(self):
        return self.engine.policy

    @property
    def reference(self):
        return self.engine.reference

    @property
    def precision(self):
        return self.engine.precision

    @property
    def settings(self):
        """Budgets, layout and loss parameters resolved for this device and kernel."""
        return self.feed.settings

    @property
    def train_task(self):
        return self.feed.objective

    @property
    def eval_tasks(self):
        """Every eval store's objective by name (data.eval as a map; "" for a single store)."""
        return self.feed.eval_tasks

    @property
    def eval_task(self):
        return next(iter(self.feed.eval_tasks.values()), None)


def build(cfg, *, log=print, parallel: Parallel | None = None, check_sidecar_reference: bool = True,
          training: bool = True, make_feed: Callable[..., Any] | None = None) -> Setup:
    """Open the stores, hold the weights, and lay out what each step trains on, with every check up front.

    ``parallel``: the rank layout (default one process on ``train.device``). ``check_sidecar_reference=False``
    (``prefpack eval``): a precomputed reference is taken as the reference whatever model it was computed with;
    training checks it was computed with its reference weights. ``training=False``: the weights are only scored
    (no gradients nor optimizer state in the memory estimate). ``make_feed(cfg, stores, engine, pad_id=, tokenizer=,
    log=)``: a feed whose train stores are made during training (on-policy rounds); ``data.train`` is then not read."""
    if not cfg.model.name_or_path:
        raise ModelError("model.name_or_path is required (a local model folder or a hub id)")
    if not cfg.data.train and make_feed is None:
        raise StoreError("data.train is required (a store written by prefpack prepare)")
    check_model_source(cfg.model.name_or_path, "model.name_or_path")  # one line now, not hub retries later
    unpaired = uses_unpaired_loss(cfg)  # the KTO family (the objective registry decides)
    stores = open_stores(cfg, unpaired=unpaired, train=make_feed is None)
    if parallel is None:
        parallel = ONE_PROCESS
        device = pick_device(cfg.train.device)
    else:
        device = parallel.device
    tok = _tokenizer(cfg, stores)
    for line in renderer_warnings(_store_metas(stores)):  # the tokens are what they are: trained, said once
        log(line)
    engine = build_engine(cfg, parallel, device, unpaired=unpaired, log=log,
                          check_sidecar_reference=check_sidecar_reference, training=training)
    for spec, (_, store) in zip(stores.specs, stores.train):
        check_vocab_fits(engine.policy, store.meta, spec.path)
        if store.margins is not None and not train_objective(cfg).reads_margins:
            log(f"note: {spec.path} gives {store.meta.get('num_margins')} pairs a margin (margins.bin), which only "
                f"train.objective=reward reads; the {cfg.train.objective} objective's losses ignore it")
    # LD-DPO weights the reference's sums too
    engine.reference.configure(chunk_size=engine.budgets.chunk_size, pair_tails=cfg.loss.ld_alpha is not None,
                               seq=parallel.seq, token_logps=train_objective(cfg).per_token)
    pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    if train_objective(cfg).sets_pad_token:  # saved with the reward model: transformers' classifier needs it
        from prefpack.model.reward import set_pad_token

        warning = set_pad_token(engine.policy, pad_id, tok.eos_token_id)
        if warning:
            log(f"warning: {warning}")
    tokenizer = TokenizerHandle.of(tok, trust_remote_code=cfg.model.trust_remote_code)
    del tok  # loaded again to be saved with the final model; training needs only the ids
    release_freed_memory()
    if make_feed is None:
        feed = store_feed(cfg, stores, engine, pad_id=pad_id, log=log)
    else:
        feed = make_feed(cfg, stores, engine, pad_id=pad_id, tokenizer=tokenizer, log=log)
    # a kernel, head count, vision model or loss the sequence groups cannot shard, refused before any step
    check_model(engine.policy, parallel.seq, router_aux=bool(feed.forward_options().get("router_aux")))
    if engine.reference.model is not None:
        check_model(engine.reference.model, parallel.seq)
    processor_dir = next((st.path / "processor" for _, st in stores.every() if st.num_images), None)
    return Setup(engine, feed, parallel, tokenizer, pad_id, cfg, processor_dir)


def _store_metas(stores: StoreSet) -> list[tuple[str, dict]]:
    """Each store's meta.json, named as the config names it (for the renderer comparison)."""
    several = len(stores.train) > 1
    out = [(f"data.train{f'[{i}]' if several else ''} ({str(st.path)!r})", st.meta)
           for i, (_, st) in enumerate(stores.train)]
    return out + [(f"data.eval{'.' + n if n else ''} ({str(st.path)!r})", st.meta) for n, st in stores.evals.items()]


def _tokenizer(cfg, stores: StoreSet):
    """The run's tokenizer (the model's, checked against the train store's; or the one named), and every other
    store prepared with it."""
    if not stores.train:  # stores made during training (rounds): the model's tokenizer, or the one named
        from prefpack.tokenizer import load_tokenizer

        tok = load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path,
                             trust_remote_code=cfg.model.trust_remote_code)
        for name, store in stores.evals.items():
            if not cfg.model.allow_tokenizer_mismatch and not tokenizer_matches(tok, store.meta["tokenizer"]):
                raise StoreError(f"data.eval{'.' + name if name else ''}: eval store {str(store.path)!r} was prepared "
                                 "with another tokenizer than the model's")
        return tok
    train_store = stores.train[0][1]
    tok = resolve_tokenizer(cfg.model.name_or_path, train_store.meta, train_store.tokenizer_path(),
                            tokenizer=cfg.model.tokenizer, allow_mismatch=cfg.model.allow_tokenizer_mismatch,
                            trust_remote_code=cfg.model.trust_remote_code)
    if cfg.model.allow_tokenizer_mismatch:
        return tok
    for name, store in stores.evals.items():
        if not tokenizer_matches(tok, store.meta["tokenizer"]):
            raise StoreError(f"data.eval{'.' + name if name else ''}: eval store {str(store.path)!r} was prepared "
                             "with another tokenizer than the train store")
    for i, (_, store) in enumerate(stores.train[1:], 1):
        if not tokenizer_matches(tok, store.meta["tokenizer"]):
            raise StoreError(f"data.train[{i}]: store {str(store.path)!r} was prepared with another tokenizer than "
                             f"data.train[0] ({stores.specs[0].path!r}); a mixture's stores share one tokenizer "
                             "(prepare it again with the same --tokenizer)")
    return tok
