"""``RUN_DIR/metrics.jsonl``, the source of truth: always written (by rank 0), read back by ``prefpack plot`` and
the tests; the mirrors only copy its records."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefpack.metrics.base import Backend, MetricsWriteError, Setup

METRICS_FILE = "metrics.jsonl"


def _metrics_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / METRICS_FILE if p.is_dir() else p


def _parse_lines(text: str, path: Path, bad: list[int] | None = None) -> list[dict]:
    """Parse JSONL; a torn final line (crash mid-write) is dropped, a bad line elsewhere is an error (or, when `bad`
    is a list, skipped and its 1-based number appended there)."""
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:  # no newline after it: the write was interrupted
                break
            if bad is not None:
                bad.append(i + 1)
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON line ({exc.msg})") from None
    return records


def read_metrics(path: str | os.PathLike, *, bad: list[int] | None = None) -> list[dict]:
    """All records of a ``metrics.jsonl`` file (or of the one in a run folder), in file order; with `bad` (a list),
    lines that are not JSON are skipped and their numbers appended there instead of raising."""
    p = _metrics_path(path)
    return _parse_lines(p.read_text(encoding="utf-8", errors="replace"), p, bad)


class JsonlFile(Backend):
    """Appends each record as one line, written with one ``write`` and flushed (a crash loses at most that line);
    the file is opened on the first record, so a run that fails to start leaves none."""

    name = "jsonl"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = None

    @classmethod
    def start(cls, setup: Setup) -> JsonlFile:
        return cls(setup.path)

    def log(self, record: Mapping[str, Any]) -> None:
        try:
            if self._fh is None:
                self._fh = open(self.path, "a", encoding="utf-8")
            self._fh.write(json.dumps(record, allow_nan=False) + "\n")
            self._fh.flush()
        except OSError as exc:
            raise MetricsWriteError(f"cannot write {self.path}: {exc.strerror or exc}; the run stays resumable from "
                                    "its last checkpoint once there is room") from exc

    def truncate_after(self, step: int) -> int:
        """Drop every record of a later step (and a torn last line), rewriting the file to a temporary one renamed
        over it: a crash during the rewrite leaves the old or the new file, never a mix."""
        self.close()
        if not self.path.exists():
            return 0
        text = self.path.read_text(encoding="utf-8")
        kept_lines, dropped = [], 0
        for line in text.split("\n"):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # torn final line from the crash that made us resume
                dropped += 1
                continue
            if record.get("step", 0) > step:
                dropped += 1
            else:
                kept_lines.append(line + "\n")
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.writelines(kept_lines)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise MetricsWriteError(f"cannot rewrite {self.path}: {exc.strerror or exc}; it is unchanged") from exc
        return dropped

    def close(self, status: str = "FINISHED") -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
