"""``MetricsLogger``: what the training loop logs to. It checks and builds each record, writes it to
``metrics.jsonl`` first and then hands it to the mirrors ``run.report_to`` started (``backends.BACKENDS``)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from prefpack.metrics.backends import BACKENDS, report_targets
from prefpack.metrics.base import RESERVED, Backend, Setup
from prefpack.metrics.jsonl import METRICS_FILE, JsonlFile


def _plain_float(key: str, value: Any) -> float | None:
    """A plain Python float (``None`` for NaN/inf) from a float, int, bool, numpy or 1-element torch value."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__}") from None
    return x if math.isfinite(x) else None


class MetricsLogger:
    """Appends metrics to ``run_dir/metrics.jsonl`` and, when requested, to the mirrors of ``BACKENDS``
    (TensorBoard, W&B, MLflow; each module says what it does with them).

    ``report_to`` names the mirrors (``report_targets`` of a ``RunConfig``: names of ``BACKENDS`` and ``"auto"``),
    started with ``cfg`` (the ``Config``: W&B and MLflow read the project and the resolved config there; its
    defaults when None). Without ``report_to``, ``tensorboard`` alone decides: True asks for TensorBoard by name,
    ``"auto"`` uses it when installed, False not at all.

    ``enabled=False`` makes every method a no-op (use it on non-zero ranks so only one process writes).
    If TensorBoard was requested by name but cannot be imported, ``notice`` holds a one-line message for the caller
    to print once (``"auto"``, from the default ``run.report_to``, says nothing); logging to the JSONL file goes on
    regardless. W&B and MLflow are asked for by name, so a missing package, or a run that cannot start, raises
    ``MetricsSetupError`` here, before any step; ``resume=True`` continues their runs (``notice`` says how).
    """

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool | str = True,
                 report_to: Iterable[str] | None = None, cfg: Any = None, resume: bool = False,
                 enabled: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self.notice: str | None = None
        self.jsonl = JsonlFile(self.path)
        self.mirrors: dict[str, Backend] = {}  # report_to name -> started backend, in the table's order
        if not enabled:
            return
        if report_to is None:
            report_to = {"tensorboard"} if tensorboard is True else {"auto"} if tensorboard else set()
        targets = set(report_to)
        unknown = targets - set(BACKENDS) - {"auto"}
        if unknown:
            raise ValueError(f"unknown metrics backends {sorted(unknown)}; known: {', '.join(BACKENDS)}, auto")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg is None and targets:
            from prefpack.config import Config

            cfg = Config()
        for name, cls in BACKENDS.items():
            if name in targets or ("auto" in targets and cls.auto):
                setup = Setup(run_dir=self.run_dir, path=self.path, cfg=cfg, named=name in targets, resume=resume,
                              note=self._note)
                backend = cls.start(setup)
                if backend is not None:
                    self.mirrors[name] = backend

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str | os.PathLike | None = None, *, resume: bool = False,
                    enabled: bool = True) -> MetricsLogger:
        """The logger ``cfg.run`` asks for (``report_to``, ``tensorboard``, ``wandb_project``); W&B and MLflow get
        the whole resolved config (``config_to_dict(cfg)``, as in ``RUN_DIR/config.yaml``)."""
        return cls(cfg.run.output_dir if run_dir is None else run_dir, report_to=report_targets(cfg.run), cfg=cfg,
                   resume=resume, enabled=enabled)

    def _note(self, text: str) -> None:
        self.notice = text if self.notice is None else f"{self.notice}\n{text}"

    @property
    def tensorboard_active(self) -> bool:
        return "tensorboard" in self.mirrors

    @property
    def wandb_active(self) -> bool:
        return "wandb" in self.mirrors

    @property
    def mlflow_active(self) -> bool:
        return "mlflow" in self.mirrors

    @property
    def wandb_run_id(self) -> str | None:
        return getattr(self.mirrors.get("wandb"), "run_id", None)

    @property
    def mlflow_run_id(self) -> str | None:
        return getattr(self.mirrors.get("mlflow"), "run_id", None)

    @property
    def mlflow_tracking_uri(self) -> str | None:
        return getattr(self.mirrors.get("mlflow"), "tracking_uri", None)

    def log(self, step: int, metrics: Mapping[str, Any], split: str = "train") -> None:
        """Append one record for optimizer ``step``; values become plain floats, NaN/inf become null."""
        if not self.enabled:
            return
        if isinstance(step, bool) or int(step) != step:
            raise TypeError(f"step must be an int, got {step!r}")
        record: dict[str, Any] = {"step": int(step), "split": str(split), "time": round(time.time(), 3)}
        for key, value in metrics.items():
            if key in RESERVED:
                raise ValueError(f"metric name {key!r} is reserved (the record keys are {', '.join(RESERVED)})")
            record[str(key)] = _plain_float(key, value)
        self.jsonl.log(record)  # the source of truth first: a mirror that fails loses nothing here
        for backend in self.mirrors.values():
            backend.log(record)

    def truncate_after(self, step: int) -> int:
        """Drop every record with ``step`` greater than ``step`` (resuming from that checkpoint).

        The file is rewritten to a temporary file and renamed over the old one, so a crash during the
        rewrite leaves either the old or the new file, never a mix. TensorBoard events past ``step`` are
        purged by the next writer (``purge_step``). W&B and MLflow do not drop history: a resumed W&B (online) or
        MLflow run keeps what it has and takes records from its next step on (``notice`` says which). Returns the
        number of records dropped.
        """
        if not self.enabled:
            return 0
        for backend in self.mirrors.values():
            backend.truncate_after(step)
        return self.jsonl.truncate_after(step)

    def close(self, status: str = "FINISHED") -> None:
        """Close the file, the TensorBoard writer, the W&B run and the MLflow run (marked ``status``: ``FINISHED``,
        ``KILLED`` for a stop, ``FAILED`` for an error); logging again reopens the file in append mode and resumes
        the same W&B and MLflow runs."""
        self.jsonl.close(status)
        for backend in self.mirrors.values():
            backend.close(status)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close("FINISHED" if exc_type is None else "FAILED")
