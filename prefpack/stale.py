"""Find and remove temporary entries (`<prefix>.tmp-PID`) left behind by a process that was killed.

Writers fill `<prefix>.tmp-PID` and rename it into place when complete; a killed writer leaves it
forever. Such an entry is only removed when its process is gone on this machine: a live process, a
process of another user, and an entry whose owner file names another host are always kept.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

OWNER_FILE = ".prefpack-owner"  # inside a temporary folder: the host that writes it (shared filesystems)


def pid_alive(pid: int) -> bool:
    """True unless `pid` is certainly not running on this machine."""
    if pid <= 0:
        return True  # not a real process id: never treat as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return True
    return True


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """Give `path` (a file, or every file and folder under a folder) the modes a plain `open` would have under the
    user's umask: writers such as safetensors create their files 0600, which a teammate cannot read."""
    mask = current_umask()
    root = Path(path)
    entries = [root] if not root.is_dir() else [root, *root.rglob("*")]
    for entry in entries:
        if entry.is_symlink():
            continue
        mode = (0o777 if entry.is_dir() else 0o666) & ~mask
        try:
            os.chmod(entry, mode)
        except OSError:
            pass  # not ours to change (another user's file): leave it


def write_owner(tmp_dir: str | Path) -> None:
    """Record this host in a temporary folder, so another machine sharing the folder never removes it."""
    Path(tmp_dir, OWNER_FILE).write_text(socket.gethostname(), encoding="utf-8")


def _other_host(entry: Path) -> str | None:
    try:
        host = (entry / OWNER_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return host if host and host != socket.gethostname() else None


def stale_entries(parent: str | Path, prefix: str, tag: str = "tmp") -> list[tuple[Path, int]]:
    """Entries of `parent` named `<prefix>.<tag>-PID` whose process is gone, with their PID.

    `*` in `prefix` matches any characters (`.step-*` for every checkpoint step).
    """
    parent = Path(parent)
    head = "".join(".*" if c == "*" else re.escape(c) for c in prefix)
    pattern = re.compile(head + re.escape(f".{tag}-") + r"(\d+)")
    try:
        names = sorted(os.listdir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        m = pattern.fullmatch(name)
        if not m:
            continue
        pid = int(m.group(1))
        entry = parent / name
        if pid == os.getpid() or pid_alive(pid) or _other_host(entry):
            continue
        out.append((entry, pid))
    return out


def remove_stale_tmp(parent: str | Path, prefix: str, *, log: Callable[[str], None] | None = print) -> list[Path]:
    """Remove `parent/<prefix>.tmp-PID` folders or files whose process is gone; return what was removed.

    Examples: `remove_stale_tmp(ckpt_root, ".step-*")`, `remove_stale_tmp(run_dir, ".final")`.
    """
    removed = []
    for entry, pid in stale_entries(parent, prefix, "tmp"):
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as exc:
            if log is not None:
                log(f"warning: could not remove {entry}, left by process {pid} which is no longer running: {exc}")
            continue
        removed.append(entry)
        if log is not None:
            log(f"removed {entry}: a temporary copy left by process {pid}, which is no longer running")
    return removed
