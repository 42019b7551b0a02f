"""``OUT.partial``: the scores of a ``prefpack score`` run so far, so that a killed run continues where it stopped.

The folder holds ``manifest.json`` (the input's and the scorer's identity: a resumed run must find both again) and
one ``rows-START-END.json`` per checkpoint, the scores of input rows ``[START, END)``, each written to a temporary
name, flushed and renamed into place, so a kill leaves either the whole file or none (a leftover temporary is
removed, and said). The scores are JSON numbers, which read back to the same float64. The folder is removed once
the output is written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from prefpack.errors import PrefpackError

MANIFEST = "manifest.json"
PARTIAL_VERSION = 1
_CHUNK = re.compile(r"rows-(\d{9})-(\d{9})\.json")


class PartialError(PrefpackError, ValueError):
    """An ``OUT.partial`` folder of another run, or a damaged one."""


def partial_path(output: str | Path) -> Path:
    out = Path(output)
    return out.parent / (out.name + ".partial")


class PartialScores:
    """The checkpoints of one run: opened (or started) against the run's identity, appended to, read back."""

    def __init__(self, output: str | Path, identity: dict, *, log=None):
        self.path = partial_path(output)
        self.identity = {"version": PARTIAL_VERSION, **identity}
        self.scores: list[list[float]] = []
        if (self.path / MANIFEST).is_file():
            self._resume(log)
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.path / MANIFEST, self.identity)

    def _resume(self, log) -> None:
        try:
            found = json.loads((self.path / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PartialError(f"{self.path / MANIFEST}: unreadable ({exc}); remove {self.path} to start over") \
                from None
        if found != self.identity:
            what = [k for k in sorted(set(found) | set(self.identity)) if found.get(k) != self.identity.get(k)]
            raise PartialError(f"{self.path} holds the scores of another run (its {', '.join(what)} differ from this "
                               f"one's); remove that folder to start over, or give the same input and scorer")
        chunks = []
        for entry in self.path.iterdir():
            m = _CHUNK.fullmatch(entry.name)
            if m:
                chunks.append((int(m[1]), int(m[2]), entry))
            elif entry.name != MANIFEST:  # a temporary a kill left behind
                entry.unlink(missing_ok=True)
                if log is not None:
                    log(f"{entry}: a checkpoint a kill left half-written; removed, its rows are scored again")
        for start, end, entry in sorted(chunks):
            try:
                rows = json.loads(entry.read_text(encoding="utf-8"))["scores"]
            except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                raise PartialError(f"{entry}: damaged checkpoint ({exc}); remove {self.path} to start over") from None
            if start != len(self.scores) or end - start != len(rows):
                raise PartialError(f"{entry}: checkpoints out of sequence (rows {len(self.scores)} expected next); "
                                   f"remove {self.path} to start over")
            self.scores.extend(rows)
        if self.scores and log is not None:
            log(f"resuming: {len(self.scores)} rows already scored in {self.path}")

    def __len__(self) -> int:
        return len(self.scores)

    def add(self, scores: list[list[float]]) -> None:
        """Checkpoint the scores of the next rows."""
        start, end = len(self.scores), len(self.scores) + len(scores)
        _write_atomic(self.path / f"rows-{start:09d}-{end:09d}.json", {"scores": scores})
        self.scores.extend(scores)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _write_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
