"""Where a store is written: refusing an output that is not prefpack's to replace, and cleaning up after a prepare
that was killed (its temporary folder, an old store moved aside by --overwrite).

Apart from ``store`` (the format written and read) because this is about the folder around a store, not what it
holds; ``store`` re-exports these names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from prefpack.data.store_format import FORMAT_NAME, STORE_ENTRIES, StoreError
from prefpack.stale import remove_stale_tmp, stale_entries


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


# precompute-ref's sidecars (and their temporary files), which prefpack also writes in a store folder
_SIDECAR = re.compile(r"\.?ref_logps[A-Za-z0-9_]*\.safetensors(\.tmp-\d+)?")


def foreign_entries(path: Path) -> list[str] | None:
    """Names in `path` that prefpack did not write, or None when `path` holds no prefpack meta.json."""
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        return None
    return sorted(n for n in os.listdir(path) if n not in STORE_ENTRIES and not _SIDECAR.fullmatch(n))


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_output(path: Path, *, overwrite: bool) -> None:
    """Refuse an output that exists, unless --overwrite and it is a prefpack store or an empty folder.

    --overwrite deletes the old folder, so it must never hit a user's own files.
    """
    if not os.path.lexists(path):
        return
    if path.is_symlink():
        raise StoreError(f"output {str(path)!r} is a symbolic link; give the folder itself (or another --output)")
    if not path.is_dir():
        raise StoreError(f"output {str(path)!r} is a file, not a store folder; prefpack never replaces a file, even "
                         "with --overwrite. Choose another --output, or move the file away yourself.")
    if not overwrite:
        raise StoreError(f"output {str(path)!r} already exists; pass --overwrite to replace it (only a prefpack store "
                         "or an empty folder can be replaced)")
    names = sorted(os.listdir(path))
    if not names:
        return
    foreign = foreign_entries(path)
    if foreign is None:
        raise StoreError(f"--overwrite refused: {str(path)!r} is not a prefpack store (no meta.json with format "
                         f"{FORMAT_NAME!r}) and holds {_listing(names)}. --overwrite only replaces a store or an "
                         "empty folder; choose another --output, or move those files away yourself.")
    if foreign:
        raise StoreError(f"--overwrite refused: the store {str(path)!r} also holds {_listing(foreign)}, which "
                         "prefpack did not write; move them away first, or choose another --output.")


def recover_interrupted(path: Path, *, log: Callable[[str], None] | None = _stderr) -> None:
    """Clean up after a prepare on `path` that was killed: its temporary folder and any old-store backup.

    A backup whose process is gone is put back when nothing took its place (the kill came between the two
    renames of an --overwrite), and removed when the new store is in place.
    """
    remove_stale_tmp(path.parent, f".{path.name}", log=log)
    for backup, pid in stale_entries(path.parent, f".{path.name}", "old"):
        is_store = backup.is_dir() and not backup.is_symlink() and (
            not os.listdir(backup) or foreign_entries(backup) == [])
        if not is_store:
            if log is not None:
                log(f"warning: left {backup} alone: it is not a prefpack store (process {pid} moved it aside "
                    f"while replacing {path}); move it back or delete it yourself")
        elif not os.path.lexists(path):
            try:
                os.replace(backup, path)
            except OSError as exc:
                raise StoreError(f"cannot put the store {backup} (left by process {pid} while replacing "
                                 f"{path}) back: {exc}; rename it yourself") from exc
            if log is not None:
                log(f"restored {path} from {backup.name}: process {pid} was killed while replacing it")
        else:
            remove_backup(backup, log)


def remove_backup(backup: Path, log: Callable[[str], None] | None) -> None:
    try:
        shutil.rmtree(backup)
    except OSError as exc:
        if log is not None:
            log(f"warning: could not delete the replaced store {backup} ({exc}); the new store is in place. "
                "Delete it yourself (the next prepare on this output tries again).")
