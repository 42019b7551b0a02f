"""Resuming with a changed config: which keys may change, the refusal, and the record of accepted changes.

`--resume` compares the new config with the run folder's `config.yaml`. A key that changes the result (the
weights an uninterrupted run with either config would reach) is refused with its dotted path and old -> new
value, unless `prefpack train --resume --allow-config-change`: then each change is printed, appended with the
step it applies from to `RUN_DIR/config_changes.jsonl`, and `config.yaml` is updated.

Keys that cannot change the result may change freely (FREE_KEYS): how often to log, evaluate and save, how many
checkpoints to keep, TensorBoard, W&B and the plot, where the run folder is, the held-out store, and the permission
flag model.allow_tokenizer_mismatch (the tokens are in the store already), and rounds.reward_timeout (a score once
made is the same under any limit). `train.max_steps` and `train.epochs`
decide the number of steps, and through it the length of the learning-rate schedule: with `optim.schedule`
cosine or linear, or a warmup given as `optim.warmup_ratio`, another length changes the learning rate of every
step, so they are refused; with a constant schedule and a fixed `optim.warmup_steps` (or none), step k's update
does not depend on the length, so more (or fewer) steps give exactly the uninterrupted run of that length.
Every other key (including ones added later) counts as changing the result.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefpack.config import Config, ConfigError, config_to_dict, load_config, save_config

CONFIG_FILE = "config.yaml"
CHANGES_FILE = "config_changes.jsonl"
STORE_FILE = "train_store.json"  # the training store's identity, in the run folder and in each checkpoint

FREE_KEYS = frozenset({
    "run.log_every", "run.eval_every", "run.save_every", "run.keep_checkpoints", "run.tensorboard", "run.plot",
    "run.report_to", "run.wandb_project", "run.output_dir", "data.eval", "model.allow_tokenizer_mismatch",
    "rounds.reward_timeout",  # bounds a reward function's call; a score, once made, is the same under any limit
})
LENGTH_KEYS = ("train.max_steps", "train.epochs")
PATH_KEYS = frozenset({"model.name_or_path", "model.tokenizer", "reference.model", "data.train"})


@dataclass
class Change:
    key: str
    old: Any
    new: Any
    changes_result: bool
    why: str = ""

    def __str__(self) -> str:
        text = f"{self.key}: {_show(self.old)} -> {_show(self.new)}"
        return f"{text} ({self.why})" if self.why else text


def _show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str | list | dict) or value is None else str(value)


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and not prefix:  # sections; values inside a section stay whole (loss.terms)
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def schedule_depends_on_length(cfg: Config) -> bool:
    """Whether the learning rate of a step depends on the total number of steps (see loop.lr_lambda)."""
    return cfg.optim.schedule != "constant" or (not cfg.optim.warmup_steps and cfg.optim.warmup_ratio > 0)


def _same_path(a: Any, b: Any) -> bool:
    try:
        return isinstance(a, str) and isinstance(b, str) and os.path.samefile(a, b)
    except OSError:
        return False


def config_changes(old: Config, new: Config) -> list[Change]:
    """Every key whose value differs, marked with whether it changes the result of the run."""
    a, b = _flatten(config_to_dict(old)), _flatten(config_to_dict(new))
    length_matters = schedule_depends_on_length(old) or schedule_depends_on_length(new)
    both_fixed = old.train.max_steps is not None and new.train.max_steps is not None
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if va == vb or (key in PATH_KEYS and _same_path(va, vb)):
            continue
        if key in FREE_KEYS:
            out.append(Change(key, va, vb, False))
        elif key == "train.epochs" and both_fixed:
            out.append(Change(key, va, vb, False, "not used: train.max_steps is set"))
        elif key in LENGTH_KEYS and length_matters:
            out.append(Change(key, va, vb, True, "sets the length of the learning-rate schedule"))
        elif key in LENGTH_KEYS:
            out.append(Change(key, va, vb, False, "the learning-rate schedule does not depend on the length"))
        else:
            out.append(Change(key, va, vb, True))
    return out


def _saved(run_dir: Path) -> tuple[Config | None, str | None]:
    """The run folder's saved config, or (None, why it cannot be read); (None, None) when there is none."""
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return None, None
    try:
        return load_config(path, []), None
    except ConfigError as exc:
        return None, str(exc)


def check_resume_config(cfg: Config, run_dir: Path, *, log: Callable[[str], None] = print) -> list[Change]:
    """Refuse (ConfigError) a resume whose config changes the result; note the free changes. Every rank may call
    it (all read the same file and decide the same)."""
    run_dir = Path(run_dir)
    old, unreadable = _saved(run_dir)
    if unreadable is not None:
        raise ConfigError(f"cannot compare this config with the run's: {run_dir / CONFIG_FILE} is unreadable "
                          f"({unreadable}); pass --allow-config-change to replace it with this config")
    if old is None:
        from prefpack.training.checkpoint import latest_checkpoint

        if latest_checkpoint(run_dir) is not None:
            raise ConfigError(f"cannot compare this config with the run's: {run_dir / CONFIG_FILE} is missing and "
                              f"{run_dir} holds checkpoints; resume with the run's config and pass "
                              "--allow-config-change to record this config as the run's")
        log(f"note: {run_dir / CONFIG_FILE} is missing, so this config cannot be compared with the run's")
        return []
    changes = config_changes(old, cfg)
    refused = [c for c in changes if c.changes_result]
    if refused:
        lines = "\n".join(f"  {c}" for c in refused)
        raise ConfigError(
            f"this config differs from the one {run_dir} was trained with ({run_dir / CONFIG_FILE}) in "
            f"{'a key that changes' if len(refused) == 1 else 'keys that change'} the result:\n{lines}\n"
            "resume with the run's config, or pass --allow-config-change to continue with the new values (each "
            f"change is printed and recorded in {run_dir / CHANGES_FILE})")
    for c in changes:
        log(f"note: config change that does not change the result: {c}")
    return changes


def accept_config_changes(cfg: Config, *, step: int | None, log: Callable[[str], None] = print) -> list[Change]:
    """For --allow-config-change: print every change, append them to RUN_DIR/config_changes.jsonl with the step
    they apply from, and write the new config.yaml (so check_resume_config then finds no difference)."""
    run_dir = Path(cfg.run.output_dir)
    old, unreadable = _saved(run_dir)
    if old is None and unreadable is None:
        if step is not None:  # checkpoints without the run's config: this one becomes the run's, recorded
            log(f"config change from step {step}: {run_dir / CONFIG_FILE} was missing; written with this config")
            _append_line(run_dir / CHANGES_FILE, json.dumps({"time": round(time.time(), 3), "step": step,
                                                             "changes": {}, "replaced_missing_config": True}))
            write_config(cfg, run_dir / CONFIG_FILE)
        return []
    changes = [] if old is None else config_changes(old, cfg)
    if not changes and unreadable is None:
        return []
    where = f"step {step}" if step is not None else "step 0 (no checkpoint)"
    if unreadable is not None:
        log(f"config change: {run_dir / CONFIG_FILE} was unreadable ({unreadable}); replaced with this config")
    for c in changes:
        log(f"config change from {where}: {c}")
    record = {"time": round(time.time(), 3), "step": step,
              "changes": {c.key: {"old": c.old, "new": c.new, "changes_result": c.changes_result} for c in changes}}
    if unreadable is not None:
        record["replaced_unreadable_config"] = unreadable
    _append_line(run_dir / CHANGES_FILE, json.dumps(record, ensure_ascii=False))
    write_config(cfg, run_dir / CONFIG_FILE)
    return changes


def read_config_changes(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / CHANGES_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _append_line(path: Path, line: str) -> None:
    from prefpack.training.checkpoint import CheckpointWriteError

    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise CheckpointWriteError(f"could not write {path}: {exc}") from exc


def config_unchanged(cfg: Config, path: str | os.PathLike, ignore: tuple[str, ...] = ()) -> bool:
    """Whether `path` holds this very config (then a resume need not write it: on a full disk it could not);
    ``ignore``: keys (``section.key``) that may differ."""
    p = Path(path)
    if not p.exists():
        return False
    try:
        saved, now = _flatten(config_to_dict(load_config(p, []))), _flatten(config_to_dict(cfg))
    except ConfigError:
        return False
    return {k: v for k, v in saved.items() if k not in ignore} == {k: v for k, v in now.items() if k not in ignore}


@contextmanager
def config_write_errors(path: str | os.PathLike):
    """Around prefpack.config.save_config (temporary file + rename): a failed write removes the temporary file
    and raises CheckpointWriteError with the space needed and free; the previous file is unchanged."""
    from prefpack.training.checkpoint.files import CheckpointWriteError, _free_bytes, _remove, _says_disk_full

    p = Path(path)
    try:
        yield
    except OSError as exc:
        _remove(p.with_name(f".{p.name}.tmp-{os.getpid()}"))  # save_config's temporary file
        free = _free_bytes(p.parent)
        if _says_disk_full(exc):
            raise CheckpointWriteError(
                f"no space left on device writing {p}: needs about 1 MiB, {(free or 0) / (1 << 20):.0f} MiB free; "
                f"the previous {p.name} is unchanged") from exc
        raise CheckpointWriteError(f"could not write {p}: {exc}; the previous {p.name} is unchanged") from exc
    except BaseException:
        _remove(p.with_name(f".{p.name}.tmp-{os.getpid()}"))
        raise


def write_config(cfg: Config, path: str | os.PathLike) -> Path:
    """save_config (atomic) with the clear error of config_write_errors."""
    with config_write_errors(path):
        return save_config(cfg, path)


# ------------------------------------------------------------------------------------------------ the train store


def store_identity(path: Any) -> dict[str, str] | None:
    """The training store's identity: its path and content hash (`reference.sidecar.store_hash`: the sha256 of its
    tokens and index in meta.json); None when it cannot be opened (build reports why). A mixture (``data.train``
    as a list) is identified by its sources' names, paths and hashes; a one-entry list by its store alone."""
    from prefpack.config.mixture import train_sources
    from prefpack.data.store import Store, StoreError
    from prefpack.reference.sidecar import store_hash

    specs = train_sources(path)
    try:
        hashes = [store_hash(Store(s.path)) for s in specs]
    except (StoreError, OSError, ValueError):
        return None
    if len(specs) == 1:
        return {"path": str(specs[0].path), "store_hash": hashes[0]}
    joined = "\n".join(f"{s.name}={h}" for s, h in zip(specs, hashes))
    return {"path": ", ".join(f"{s.name}={s.path}" for s in specs),
            "store_hash": hashlib.sha256(joined.encode()).hexdigest()}


def write_store_identity(cfg: Config, run_dir: Path) -> None:
    """`RUN_DIR/train_store.json` (rank 0); each checkpoint copies it (`checkpoint.formats`)."""
    from prefpack.training.checkpoint import CheckpointWriteError

    identity = store_identity(cfg.data.train)
    if identity is None:
        return
    path = Path(run_dir) / STORE_FILE
    try:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(identity, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise CheckpointWriteError(f"could not write {path}: {exc}") from exc


def recorded_store(run_dir: Path) -> tuple[dict | None, Path | None]:
    """The store identity the newest checkpoint recorded (else the run folder's), and the file it came from."""
    from prefpack.training.checkpoint import latest_checkpoint

    newest = latest_checkpoint(run_dir)
    for path in ([newest / STORE_FILE] if newest is not None else []) + [Path(run_dir) / STORE_FILE]:
        try:
            return json.loads(path.read_text(encoding="utf-8")), path
        except (OSError, ValueError):
            continue
    return None, None


def check_resume_store(cfg: Config, run_dir: Path) -> None:
    """Refuse a resume whose training store is not the run's (other content at the same path, or another store);
    --allow-config-change does not change this: a run continues on the data it was trained on."""
    from prefpack.data.store import StoreError

    old, where = recorded_store(run_dir)
    new = store_identity(cfg.data.train)
    if old is None or new is None or old.get("store_hash") == new["store_hash"]:
        return
    same_path = _same_path(old.get("path"), new["path"]) or old.get("path") == new["path"]
    what = ("holds other data than the run was trained on" if same_path
            else f"is not the store the run was trained on ({old.get('path')!r})")
    raise StoreError(f"cannot resume {run_dir}: the training store {new['path']!r} {what}: its content hash is "
                     f"{new['store_hash'][:16]}..., the run's was {str(old.get('store_hash'))[:16]}... (recorded in "
                     f"{where}). Resume with the run's store, or start a new run (another run.output_dir); "
                     "--allow-config-change does not apply to the data")


def accept_changes_from_newest_checkpoint(cfg: Config, *, log: Callable[[str], None] = print) -> None:
    """--allow-config-change: print and record the changes with the step of the checkpoint the resume starts from
    (the newest one that matches its checksums), then update config.yaml; train() then finds no difference."""
    from prefpack.training.checkpoint import list_checkpoints, verify_checkpoint

    cfg.validate()
    intact = (v for v in map(verify_checkpoint, reversed(list_checkpoints(Path(cfg.run.output_dir))))
              if v.status != "damaged")
    newest = next(intact, None)
    accept_config_changes(cfg, step=newest.step if newest is not None else None, log=log)


def resume_hint(cfg: Config, argv: list[str], what: str = "interrupted", where: str | None = None) -> str:
    """Ctrl-C or SIGTERM: the last checkpoint (or ``where``: a caller's own clause, e.g. a rounds run's round and
    phase) and the exact command that continues from it."""
    import shlex

    from prefpack.training.checkpoint import checkpoint_step, latest_checkpoint

    last = latest_checkpoint(Path(cfg.run.output_dir))
    words, skip = [], False
    for w in argv:
        if skip:
            skip = False
        elif w == "--stop-after-steps":
            skip = True  # its value follows
        elif not w.startswith("--stop-after-steps="):
            words.append(w)
    if "--resume" not in words:
        words.append("--resume")
    if where is None and last is None:
        where = (f"no checkpoint was written yet (run.save_every={cfg.run.save_every}), so resuming starts again "
                 "from step 0")
    elif where is None:
        where = f"the last checkpoint is step {checkpoint_step(last)} ({last})"
    return f"prefpack train: {what}; {where}; continue with:\n  {shlex.join(words)}"
