"""The folders of a run's checkpoints: checksums and their verification, listing, stale temporaries left by killed
processes, and the report of a write that failed (a full disk above all). Both checkpoint formats use these."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prefpack.model import ModelError

CHECKSUMS = "checksums.json"
CHECKSUM_FORMAT = "prefpack-checksums/1"
HASH_CHUNK = 8 << 20  # bytes read per update: large enough for full disk/page-cache speed, small in memory
DAMAGED_PREFIX = "damaged-"
MiB = 1 << 20
_MARGIN = 64 << 10  # JSON files and container overhead, beyond the tensors
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointWriteError(ModelError):
    """A checkpoint or the final model could not be written (full disk, I/O error); nothing partial is left."""


class CheckpointDamaged(ModelError):
    """No checkpoint of the run folder can be read back intact."""


# ------------------------------------------------------------------------------------------------ checksums


def file_sha256(path: Path, *, sync: bool = False) -> tuple[int, str]:
    """(size, sha256 hex) of a file, streamed in 8 MiB chunks; `sync` also flushes it to the disk (fsync)."""
    digest = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])  # hashlib releases the GIL: several files hash in parallel threads
            size += n
        if sync:
            os.fsync(fh.fileno())
    return size, digest.hexdigest()


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() != CHECKSUMS)


def _hash_all(folder: Path, files: list[Path], *, sync: bool) -> dict[str, dict]:
    def one(p: Path) -> tuple[str, dict]:
        size, sha = file_sha256(p, sync=sync)
        return p.relative_to(folder).as_posix(), {"size": size, "sha256": sha}

    workers = max(1, min(len(files), os.cpu_count() or 1, 8))
    if workers == 1:
        return dict(map(one, files))
    with ThreadPoolExecutor(workers) as pool:
        return dict(pool.map(one, files))


def write_checksums(folder: Path) -> Path:
    """Hash every file under `folder` (and fsync it) into `folder/checksums.json`; call it last, before renaming."""
    files = _hash_all(folder, _files_under(folder), sync=True)
    path = folder / CHECKSUMS
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"format": CHECKSUM_FORMAT, "algorithm": "sha256", "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(folder)
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class Verdict:
    """What `verify_checkpoint` found: status is "ok", "unverified" (no checksums.json) or "damaged"."""

    path: Path
    status: str
    problems: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return checkpoint_step(self.path)

    def describe(self) -> str:
        return f"{self.path.name}: " + "; ".join(self.problems)


def verify_checkpoint(path: Path) -> Verdict:
    """Compare every file of a checkpoint with its checksums.json (sizes first, then sha256)."""
    manifest = path / CHECKSUMS
    if not manifest.exists():
        return Verdict(path, "unverified")
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        files = data["files"]
        if data.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError("unknown layout")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return Verdict(path, "damaged", [f"{CHECKSUMS} is unreadable ({exc})"])
    problems, to_hash = [], []
    for rel, want in sorted(files.items()):
        p = path / rel
        try:
            size = p.stat().st_size
        except OSError:
            problems.append(f"{rel} is missing")
            continue
        if size != want["size"]:
            problems.append(f"{rel} has {size} bytes, {want['size']} were written"
                            + (" (truncated)" if size < want["size"] else ""))
        else:
            to_hash.append(p)
    try:
        got = _hash_all(path, to_hash, sync=False)
    except OSError as exc:
        return Verdict(path, "damaged", [*problems, f"unreadable ({exc})"])
    for rel, have in sorted(got.items()):
        if have["sha256"] != files[rel]["sha256"]:
            problems.append(f"{rel} does not match its checksum (its content changed after it was written)")
    return Verdict(path, "damaged" if problems else "ok", problems)


# ------------------------------------------------------------------------------------------------ listing


def checkpoint_step(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (`step-N` folders, renamed into place only when written), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()), key=checkpoint_step)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder (not verified: see `resume_from_checkpoints`)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


# ------------------------------------------------------------------------------------------------ temporaries


# (parent folder relative to the run folder, name prefix) of every temporary entry prefpack writes there
_TEMPORARY_PLACES = (("checkpoints", ".step-*"), (".", ".final"), (".", ".config.yaml"), (".", ".metrics.jsonl"))


def remove_stale_temporaries(run_dir: Path, *, log: Callable[[str], None] = print) -> list[Path]:
    """Remove the temporary entries of a run folder (`.step-N.tmp-PID` and `.step-N.old-PID` in checkpoints/,
    `.final.tmp-PID`, ...) whose process is gone (prefpack.stale); one whose process is alive, or that another
    machine writes, is kept. Returns the removed paths."""
    from prefpack.stale import stale_entries

    run_dir = Path(run_dir)
    removed, kept = [], []
    for sub, prefix in _TEMPORARY_PLACES:
        parent = run_dir / sub
        for tag in ("tmp", "old"):
            stale = {entry for entry, _pid in stale_entries(parent, prefix, tag)}
            for entry in _matching(parent, prefix, tag):
                if entry in stale:
                    _remove(entry)
                    removed.append(entry)
                else:
                    kept.append(entry)
    if removed:
        log(f"removed {len(removed)} temporary {'entry' if len(removed) == 1 else 'entries'} left by a process that "
            f"is gone: {', '.join(str(p.relative_to(run_dir)) for p in removed)}")
    if kept:
        log(f"note: kept {', '.join(str(p.relative_to(run_dir)) for p in kept)}: the process that writes "
            f"{'it' if len(kept) == 1 else 'them'} is still running (or runs on another machine)")
    return removed


def _matching(parent: Path, prefix: str, tag: str) -> list[Path]:
    head = "".join(".*" if c == "*" else re.escape(c) for c in prefix)
    pattern = re.compile(head + re.escape(f".{tag}-") + r"\d+")
    try:
        return sorted(parent / n for n in os.listdir(parent) if pattern.fullmatch(n))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _own(tmp: Path) -> None:
    """Name this machine inside a temporary folder (prefpack.stale): another machine sharing the run folder
    never removes it, whatever its process id means there."""
    from prefpack.stale import write_owner

    write_owner(tmp)


def _disown(tmp: Path) -> None:
    """The last touch of a temporary folder before its rename: the owner file removed, every file given the
    user's umask (safetensors writes 0600)."""
    from prefpack.stale import OWNER_FILE, apply_umask

    (tmp / OWNER_FILE).unlink(missing_ok=True)
    apply_umask(tmp)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _discard(path: Path, pid: int | None = None) -> None:
    """Remove a folder so that an interruption never leaves a half-deleted folder under its own name: it is
    first renamed to `.NAME.old-PID` (removed by the next run once this process is gone)."""
    if not path.exists():
        return
    aside = path.with_name(f".{path.name}.old-{pid or os.getpid()}")
    if aside.exists():
        _remove(aside)
    os.replace(path, aside)
    _remove(aside)


def _retain(ckpt_root: Path, keep: int) -> None:
    found = [p for p in ckpt_root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    found.sort(key=checkpoint_step)
    for p in found[: max(0, len(found) - keep)]:
        try:
            _discard(p)
        except OSError:
            pass  # an old checkpoint that cannot be removed costs space, not correctness


# ------------------------------------------------------------------------------------------------ failed writes


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _tree_size(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, its causes, and the per-rank errors torch.distributed.checkpoint gathers into CheckpointException."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.append(e.__cause__ or e.__context__)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())


def _reason(exc: BaseException) -> str:
    """One line: type and message (for CheckpointException, each rank's error instead of its tracebacks)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = [f"rank {r}: {_reason(f[0] if isinstance(f, tuple) else f)}" for r, f in sorted(failures.items())]
        return "; ".join(parts)
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _says_disk_full(exc: BaseException) -> bool:
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
    return False


def _resume_hint(run_dir: Path) -> str:
    found = list_checkpoints(run_dir)
    if not found:
        return "no checkpoint was written yet, so --resume would start again from step 0"
    older = (f" (only the newest checkpoint is needed: {', '.join(p.name for p in found[:-1])} may be deleted)"
             if len(found) > 1 else "")
    return f"the run can be resumed from {found[-1].name} with --resume{older}"


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}" if n < 10 * MiB else f"{n / MiB:.0f}"


def _write_failure(exc: BaseException, target: Path, *, needed: int, written: int, free_at_failure: int | None,
                   run_dir: Path) -> CheckpointWriteError | None:
    """The clear error for a failed write, or None when `exc` is not a storage failure (a bug: re-raise it).

    torch.save reports a full disk as RuntimeError('basic_ios::clear' / 'unexpected pos ...'), without errno:
    such an error counts as a full disk when less space was free than the write still needed.
    """
    short_of_space = free_at_failure is not None and free_at_failure < max(needed - written, 0) + _MARGIN
    storage = any(isinstance(e, _storage_errors()) for e in _chain(exc))
    full = _says_disk_full(exc) or (storage and short_of_space)
    free_now = _free_bytes(target.parent)
    if full:
        free = f"{_mib(free_now)} MiB free" if free_now is not None else "free space unknown"
        return CheckpointWriteError(f"no space left on device writing {target}: needs about {_mib(needed)} MiB, "
                                    f"{free}; nothing partial was left behind; once there is space, "
                                    f"{_resume_hint(run_dir)}")
    if isinstance(exc, OSError):
        return CheckpointWriteError(f"could not write {target}: {exc}; nothing partial was left behind; "
                                    f"{_resume_hint(run_dir)}")
    return None


@contextmanager
def _writing(tmp: Path, target: Path, *, needed: int, run_dir: Path):
    """Remove the temporary folder if anything fails inside (Ctrl-C included) and explain storage failures."""
    try:
        yield
    except BaseException as exc:
        free_at_failure = _free_bytes(tmp)
        written = _tree_size(tmp)
        _remove(tmp)
        clear = _write_failure(exc, target, needed=needed, written=written, free_at_failure=free_at_failure,
                               run_dir=run_dir) if isinstance(exc, Exception) else None
        if clear is not None:
            raise clear from exc
        raise


def _storage_errors() -> tuple[type[BaseException], ...]:
    """What writers raise when the disk fails: OSError, torch's RuntimeError, safetensors' own error."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - older safetensors
        return (OSError, RuntimeError)
    return (OSError, RuntimeError, SafetensorError)
