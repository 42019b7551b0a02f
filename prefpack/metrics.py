"""Run metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl``, optionally mirrored to TensorBoard.

Each line is ``{"step": int, "split": str, "time": float, **metrics}`` with ``time`` in Unix seconds. JSON has
no NaN or infinity, so non-finite values are written as ``null`` (and read back as ``None``): the file stays
strict JSON that any tool can read, and the line still records that the metric was logged at that step.
Every line is written with one ``write`` and flushed, so a crash loses at most the line being written;
readers skip such a torn last line.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["METRICS_FILE", "MetricsLogger", "read_metrics"]

METRICS_FILE = "metrics.jsonl"
_RESERVED = ("step", "split", "time")


def _plain_float(key: str, value: Any) -> float | None:
    """A plain Python float (``None`` for NaN/inf) from a float, int, bool, numpy or 1-element torch value."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__}") from None
    return x if math.isfinite(x) else None


def _metrics_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / METRICS_FILE if p.is_dir() else p


def _parse_lines(text: str, path: Path) -> list[dict]:
    """Parse JSONL; a torn final line (crash mid-write) is dropped, a bad line elsewhere is an error."""
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
            raise ValueError(f"{path}:{i + 1}: not a JSON line ({exc.msg})") from None
    return records


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records of a ``metrics.jsonl`` file (or of the one in a run folder), in file order."""
    p = _metrics_path(path)
    return _parse_lines(p.read_text(encoding="utf-8"), p)


class MetricsWriteError(OSError):
    """metrics.jsonl could not be written (a full disk); the message names the file."""


class MetricsLogger:
    """Appends metrics to ``run_dir/metrics.jsonl`` and, when requested and installed, to TensorBoard.

    ``enabled=False`` makes every method a no-op (use it on non-zero ranks so only one process writes).
    If TensorBoard was requested but cannot be imported, ``notice`` holds a one-line message for the caller
    to print once; logging to the JSONL file goes on regardless.
    """

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, enabled: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self.notice: str | None = None
        self._fh = None
        self._writer = None
        self._writer_cls = None
        self._purge_step: int | None = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception as exc:  # ImportError, or a broken tensorboard/protobuf install
                self.notice = (f"TensorBoard logging skipped ({type(exc).__name__}: {exc}); metrics go to "
                               f"{self.path} only (pip install tensorboard to enable it)")
            else:
                self._writer_cls = SummaryWriter

    @property
    def tensorboard_active(self) -> bool:
        return self._writer_cls is not None

    def log(self, step: int, metrics: Mapping[str, Any], split: str = "train") -> None:
        """Append one record for optimizer ``step``; values become plain floats, NaN/inf become null."""
        if not self.enabled:
            return
        if isinstance(step, bool) or int(step) != step:
            raise TypeError(f"step must be an int, got {step!r}")
        step = int(step)
        record: dict[str, Any] = {"step": step, "split": str(split), "time": round(time.time(), 3)}
        for key, value in metrics.items():
            if key in _RESERVED:
                raise ValueError(f"metric name {key!r} is reserved (the record keys are {', '.join(_RESERVED)})")
            record[str(key)] = _plain_float(key, value)
        try:
            if self._fh is None:
                self._fh = open(self.path, "a", encoding="utf-8")
            self._fh.write(json.dumps(record, allow_nan=False) + "\n")
            self._fh.flush()
        except OSError as exc:
            raise MetricsWriteError(f"cannot write {self.path}: {exc.strerror or exc}; the run stays resumable from "
                                    "its last checkpoint once there is room") from exc
        if self._writer_cls is not None:
            writer = self._tb_writer()
            for key, value in record.items():
                if key not in _RESERVED and value is not None:
                    writer.add_scalar(f"{split}/{key}", value, step)
            writer.flush()

    def _tb_writer(self):
        if self._writer is None:
            kwargs = {} if self._purge_step is None else {"purge_step": self._purge_step}
            self._writer = self._writer_cls(log_dir=str(self.run_dir / "tensorboard"), **kwargs)
        return self._writer

    def truncate_after(self, step: int) -> int:
        """Drop every record with ``step`` greater than ``step`` (resuming from that checkpoint).

        The file is rewritten to a temporary file and renamed over the old one, so a crash during the
        rewrite leaves either the old or the new file, never a mix. TensorBoard events past ``step`` are
        purged by the next writer (``purge_step``). Returns the number of records dropped.
        """
        if not self.enabled:
            return 0
        self._close_file()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._purge_step = int(step) + 1
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

    def _close_file(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def close(self) -> None:
        """Close the file and the TensorBoard writer; logging again reopens the file in append mode."""
        self._close_file()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
