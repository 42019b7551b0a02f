"""Checkpoints of a run and its final model, written atomically (a temporary folder renamed when complete).

One process writes `step-N/` with the weights (safetensors), the optimizer, scheduler and RNG state (tensors
only, loaded with ``weights_only``) and the trainer state (JSON); under torchrun every rank writes its shard with
torch.distributed.checkpoint. `save_checkpoint` and `load_checkpoint` are the one interface for both formats (the
run's `Dist` picks), which share the folder names, the publishing steps and the rotation of old checkpoints. The
final model (``final``) is `save_pretrained` output beside its tokenizer.

Every checkpoint ends with `checksums.json` (size and sha256 of every other file in it, written last, before the
rename), so `--resume` can tell a damaged checkpoint (truncated, emptied, a flipped bit) from an intact one and
falls back to the newest intact one. Checkpoints written before checksums existed are accepted with a note.
Nothing in a checkpoint runs when it is read: the sharded format's pickled metadata is read by ``dcp_read``
(only DCP's own classes), everything else is safetensors, JSON or ``torch.load(weights_only=True)``.

Writes that fail (a full disk above all) remove their temporary folder and raise `CheckpointWriteError` with the
space needed and free; the previous checkpoint stays the one to resume from. Temporary folders that a killed
process left behind (`.NAME.tmp-PID`, `.NAME.old-PID`) are removed by the next run on the folder once that
process is gone (`remove_stale_temporaries`).

This module holds the formats and the one interface; ``files`` the integrity and folder handling they share (and
``final`` the final model's save).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prefpack.distributed import SINGLE, Dist
from prefpack.model import ModelError
from prefpack.training.checkpoint.dcp_read import load_dcp, read_dcp_metadata
from prefpack.training.checkpoint.files import (
    _MARGIN,
    CHECKSUMS,
    DAMAGED_PREFIX,
    CheckpointDamaged,
    CheckpointWriteError,
    MiB,
    Verdict,
    _discard,
    _disown,
    _free_bytes,
    _fsync_dir,
    _own,
    _reason,
    _remove,
    _resume_hint,
    _retain,
    _tensor_bytes,
    _tree_size,
    _write_failure,
    _writing,
    list_checkpoints,
    verify_checkpoint,
    write_checksums,
)

# ------------------------------------------------------------------------------------------------ one interface


REFERENCE_FILE = "reference.safetensors"
OBJECTIVE_TENSORS = "objective"  # training_state.pt: an objective's tensors (its state_dict's tensor values)


@dataclass
class Checkpointed:
    """What a training checkpoint saves and restores. One process writes the bare `policy` (and `reference`) in
    one folder of files; under torchrun every rank writes its part of the (wrapped) `module` (and
    `reference_module`) with torch.distributed.checkpoint."""

    policy: nn.Module
    module: nn.Module
    optimizer: Any
    scheduler: Any
    reference: nn.Module | None = None  # a reference copy; saved only when training changes it (TR-DPO)
    reference_module: nn.Module | None = None  # the same, as wrapped for the ranks


def save_checkpoint(run_dir: Path, step: int, parts: Checkpointed, state: dict, keep: int, ctx: Dist = SINGLE, *,
                    with_reference: bool = False) -> Path:
    """`checkpoints/step-N` of a run folder in the format of this run (sharded under torchrun), atomically, with
    checksums; then only the newest `keep` checkpoints are kept. `with_reference` saves the reference too."""
    # an objective's tensors (group policy gradients' old log-probs) go with the optimizer's, the rest as JSON
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    state = {k: v for k, v in state.items() if k not in tensors}
    if ctx.enabled:
        return save_checkpoint_distributed(run_dir, step, parts.module, parts.optimizer, parts.scheduler, state,
                                           keep, ctx, reference=parts.reference_module if with_reference else None,
                                           tensors=tensors)
    return save_checkpoint_single(run_dir, step, parts.policy, parts.optimizer, parts.scheduler, state, keep,
                                  reference=parts.reference if with_reference else None, tensors=tensors)


def load_checkpoint(path: Path, parts: Checkpointed, ctx: Dist = SINGLE) -> dict:
    """Restore a checkpoint written by `save_checkpoint` into `parts`; returns the trainer state (with "step").
    The reference is restored when the checkpoint holds one."""
    if ctx.enabled:
        return load_checkpoint_distributed(path, parts.module, parts.optimizer, parts.scheduler, ctx,
                                           reference=parts.reference_module)
    return load_checkpoint_single(path, parts.policy, parts.optimizer, parts.scheduler, reference=parts.reference)


def _step_folders(run_dir: Path, step: int, pid: int) -> tuple[Path, Path, Path]:
    """(checkpoints/, checkpoints/step-N, the temporary folder step-N is written in)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    return ckpt_root, ckpt_root / f"step-{step:08d}", ckpt_root / f".step-{step:08d}.tmp-{pid}"


def _publish(tmp: Path, final: Path, trainer_state: dict, pid: int | None = None) -> None:
    """The last writes of both formats: trainer_state.json, the checksums of every file, the rename into place."""
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    store = final.parent.parent / "train_store.json"  # the run's data (resume_check.STORE_FILE), checksummed too
    if store.is_file():
        shutil.copyfile(store, tmp / store.name)
    _disown(tmp)
    write_checksums(tmp)
    _discard(final, pid)
    os.replace(tmp, final)


def _rotate(ckpt_root: Path, keep: int) -> None:
    """After a checkpoint is in place: make the rename durable and remove all but the newest `keep`."""
    _fsync_dir(ckpt_root)
    _retain(ckpt_root, keep)


def _read_trainer_state(path: Path) -> dict:
    state = json.loads((path / "trainer_state.json").read_text())
    int(state["step"])
    return state


# ------------------------------------------------------------------------------------------------ one process


def save_checkpoint_single(run_dir: Path, step: int, model: nn.Module, optimizer, scheduler, state: dict, keep: int,
                           *, reference: nn.Module | None = None, tensors: dict | None = None) -> Path:
    """Weights (safetensors), optimizer/scheduler/RNG (tensors only), trainer state and checksums, atomically.

    ``reference``: a reference model that changes during training (``reference.sync``, TR-DPO), saved as
    ``reference.safetensors`` (covered by the checksums like every file) so that a resume continues from it."""
    from safetensors.torch import save_model

    run_dir = Path(run_dir)
    ckpt_root, final, tmp = _step_folders(run_dir, step, os.getpid())
    ckpt_root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    blob = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            OBJECTIVE_TENSORS: dict(tensors or {})}
    needed = _tensor_bytes(model.state_dict()) + _tensor_bytes(blob) + _MARGIN
    if reference is not None:
        needed += _tensor_bytes(reference.state_dict())
    with _writing(tmp, final, needed=needed, run_dir=run_dir):
        tmp.mkdir()
        _own(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        if reference is not None:
            save_model(reference, str(tmp / REFERENCE_FILE))
        torch.save(blob, tmp / "training_state.pt")
        _publish(tmp, final, {**state, "step": step})
    _rotate(ckpt_root, keep)
    return final


_LOAD_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, RuntimeError, ValueError, KeyError, TypeError,
                                                 IndexError, pickle.UnpicklingError)


def _require(blob, *keys: str) -> None:
    if not isinstance(blob, dict):
        raise ValueError(f"expected a dict of training state, found {type(blob).__name__}")
    missing = [k for k in keys if k not in blob]
    if missing:
        raise KeyError(f"training state lacks {', '.join(missing)}")


def _dcp_errors() -> tuple[type[BaseException], ...]:
    """Exception, and torch.distributed.checkpoint's CheckpointException (a BaseException: the errors of all ranks)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _load_errors() -> tuple[type[BaseException], ...]:
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - older safetensors
        return (*_LOAD_ERRORS, CheckpointException)
    return (*_LOAD_ERRORS, SafetensorError, CheckpointException)


def load_checkpoint_single(path: Path, model: nn.Module, optimizer, scheduler, *,
                           reference: nn.Module | None = None) -> dict:
    """Restore a checkpoint; every file is read (and may fail) before the model or optimizer is changed.

    ``reference``: the reference copy, restored from ``reference.safetensors`` when the checkpoint has one (a run
    with ``reference.sync``); without that file the reference was never changed and stays as loaded."""
    from safetensors.torch import load_file, load_model

    state = _read_trainer_state(path)
    blob = torch.load(path / "training_state.pt", weights_only=True, map_location="cpu")
    _require(blob, "optimizer", "scheduler", "torch_rng", "cuda_rng")  # damaged: fail before anything changed
    ref_file = path / REFERENCE_FILE
    if reference is not None and ref_file.exists():
        load_file(str(ref_file))  # read it whole (a damaged file fails here) before anything changes
    load_model(model, str(path / "model.safetensors"))  # reads the whole file before it copies into the model
    if reference is not None and ref_file.exists():
        load_model(reference, str(ref_file))
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    if blob["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(blob["cuda_rng"])
    return {**state, **blob.get(OBJECTIVE_TENSORS, {})}


# ------------------------------------------------------------------------------------------------ torchrun


def _broadcast(obj, ctx: Dist):
    """Rank 0's `obj` on every rank (objects prefpack built itself: ints, strings, lists)."""
    if not ctx.enabled:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_ok(ok: bool, ctx: Dist) -> bool:
    if not ctx.enabled:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=ctx.device)
    return float(ctx.all_reduce_sum(flag).item()) == 0.0


def save_checkpoint_distributed(run_dir: Path, step: int, module: nn.Module, optimizer, scheduler, state: dict,
                                keep: int, ctx: Dist, *, reference: nn.Module | None = None,
                                tensors: dict | None = None) -> Path:
    """Sharded checkpoint with torch.distributed.checkpoint (every rank writes its part), then renamed.

    ``reference``: the (wrapped) reference module of a run whose reference changes (``reference.sync``), saved
    under the DCP key ``reference`` beside ``model`` and ``optim``.

    Rank 0 writes the rest, hashes every file of the folder (all ranks' shards) into checksums.json and renames
    it into place. A failed write on any rank removes the folder, and every rank raises.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run_dir = Path(run_dir)
    pid = _broadcast(os.getpid(), ctx)  # rank 0's, so a stale folder can be matched with its (dead) process
    ckpt_root, final, tmp = _step_folders(run_dir, step, pid)
    if ctx.is_main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _own(tmp)
    ctx.barrier()
    model_sd, optim_sd = get_state_dict(module, optimizer)
    content = {"model": model_sd, "optim": optim_sd}
    if reference is not None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        content["reference"] = get_model_state_dict(reference)
    needed = sum(_tensor_bytes(v) for v in content.values()) + _MARGIN  # DTensor.numel() is the global size
    error: BaseException | None = None
    try:  # dcp.save gathers every rank's write result, so a failure on one rank raises on all of them
        dcp.save(content, checkpoint_id=str(tmp / "dcp"))
    except _dcp_errors() as exc:  # reported below, after the folder is removed
        error = exc
    if ctx.is_main and error is None:
        try:
            torch.save({"scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                        OBJECTIVE_TENSORS: dict(tensors or {})}, tmp / "training_state.pt")
            _publish(tmp, final, {**state, "step": step, "world": ctx.world}, pid)
        except _dcp_errors() as exc:
            error = exc
    failed = not _all_ok(error is None, ctx)
    if failed:
        if ctx.is_main:
            free_at_failure, written = _free_bytes(tmp), _tree_size(tmp)
            _remove(tmp)
            clear = _write_failure(error, final, needed=needed, written=written, free_at_failure=free_at_failure,
                                   run_dir=run_dir) if error is not None else None
            if clear is not None:
                raise clear from error
            if error is not None:
                raise error
        ctx.barrier()  # rank 0 has removed the folder
        if error is not None:
            raise error
        raise CheckpointWriteError(f"rank 0 could not write {final} (its message says why); "
                                   f"{_resume_hint(run_dir)}")
    if ctx.is_main:
        _rotate(ckpt_root, keep)
    ctx.barrier()
    return final


def load_checkpoint_distributed(path: Path, module: nn.Module, optimizer, scheduler, ctx: Dist, *,
                                reference: nn.Module | None = None) -> dict:
    """Restore a sharded checkpoint; ``reference`` (the wrapped reference copy) is restored when it holds one.

    Its ``dcp/.metadata`` is read by `read_dcp_metadata` (nothing in it runs; `CheckpointRefused` otherwise) on
    every rank before anything changes, and only that checked metadata reaches dcp.load."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    state = _read_trainer_state(path)
    if state.get("world") != ctx.world:
        raise ModelError(f"checkpoint {path} was written by {state.get('world')} processes; resume it with the same "
                         f"number (this run has {ctx.world})")
    extra = torch.load(path / "training_state.pt", weights_only=True, map_location="cpu")
    _require(extra, "scheduler", "torch_rng")  # a damaged file fails here, before anything changed
    meta = read_dcp_metadata(path / "dcp")  # a crafted one is refused here, on every rank, before any collective
    model_sd, optim_sd = get_state_dict(module, optimizer)
    blob = {"model": model_sd, "optim": optim_sd}
    if reference is not None and any(key.startswith("reference.") for key in meta.state_dict_metadata):
        blob["reference"] = get_model_state_dict(reference)
    load_dcp(blob, path / "dcp", meta)
    set_state_dict(module, optimizer, model_state_dict=blob["model"], optim_state_dict=blob["optim"])
    if "reference" in blob:
        set_model_state_dict(reference, blob["reference"])
    scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["torch_rng"])
    state.pop("world", None)
    state.update(extra.get(OBJECTIVE_TENSORS, {}))
    return state


# ------------------------------------------------------------------------------------------------ resume


def _set_aside(path: Path) -> Path:
    target = path.with_name(DAMAGED_PREFIX + path.name)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{DAMAGED_PREFIX}{path.name}.{n}")
    os.replace(path, target)
    return target


def resume_from_checkpoints(run_dir: Path, load: Callable[[Path], dict], *, ctx: Dist = SINGLE,
                            log: Callable[[str], None] = print) -> tuple[Path, dict] | None:
    """Load the newest intact checkpoint of a run folder with `load(path) -> trainer state`.

    Each checkpoint, newest first, is checked against its checksums.json (rank 0 hashes, every rank hears the
    verdict), then loaded; one that is damaged or fails to load is reported with the file and the reason and
    the previous one is tried. Newer damaged checkpoints are then renamed `damaged-step-N` (kept, never deleted,
    and no longer seen as checkpoints). None when there is no checkpoint at all; `CheckpointDamaged` when none is
    intact.
    """
    run_dir = Path(run_dir)
    candidates = list_checkpoints(run_dir)
    if not candidates:
        return None
    errors = _load_errors()
    damaged: list[Verdict] = []
    for path in reversed(candidates):
        t0 = time.perf_counter()
        verdict = _broadcast(verify_checkpoint(path) if ctx.is_main else None, ctx)
        verdict.path = path
        if verdict.status == "damaged":
            log(f"checkpoint {path} is damaged: {'; '.join(verdict.problems)}")
            damaged.append(verdict)
            continue
        if verdict.status == "unverified":
            log(f"note: checkpoint {path} has no {CHECKSUMS} (written before prefpack checked checkpoints), so it "
                "cannot be verified")
        else:
            mib = _tree_size(path) / MiB if ctx.is_main else 0.0
            log(f"checkpoint {path.name} verified ({mib:.1f} MiB hashed in {time.perf_counter() - t0:.2f} s)")
        error: BaseException | None = None
        try:
            state = load(path)
        except errors as exc:
            if isinstance(exc, ModelError) and not isinstance(exc, CheckpointDamaged):
                raise  # a usable checkpoint that does not fit this run (e.g. another number of processes)
            error = exc
        if not _all_ok(error is None, ctx):
            reason = _reason(error) if error is not None else "it failed to load on another rank"
            log(f"checkpoint {path} cannot be read: {reason[:500]}")
            damaged.append(Verdict(path, "damaged", [f"cannot be read ({reason[:300]})"]))
            continue
        if damaged:
            if ctx.is_main:
                moved = [_set_aside(v.path) for v in damaged]
                log(f"resuming from {path.name}, the newest intact checkpoint; the damaged "
                    f"{'one was' if len(moved) == 1 else 'ones were'} renamed "
                    f"{', '.join(m.name for m in moved)} (delete {'it' if len(moved) == 1 else 'them'} when no "
                    "longer needed)")
            ctx.barrier()
        return path, state
    lines = "\n".join(f"  - {v.describe()}" for v in damaged)
    raise CheckpointDamaged(f"no intact checkpoint in {run_dir / 'checkpoints'}:\n{lines}\nnothing was changed; "
                            "restore a checkpoint from a backup, or move the checkpoints folder away to train again "
                            "from step 0")
