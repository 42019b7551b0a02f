"""What a metrics backend is: one class per destination of the records (``metrics.jsonl``, TensorBoard, W&B,
MLflow), started from a ``Setup``, given each record, told when a resume drops steps, and closed; plus the errors
and helpers the backends share, so a new backend is one module and its name in ``backends.BACKENDS``."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from prefpack.config import ConfigError
from prefpack.errors import PrefpackError

RESERVED = ("step", "split", "time")


class MetricsWriteError(PrefpackError, OSError):
    """metrics.jsonl could not be written (a full disk); the message names the file."""


class MetricsSetupError(ConfigError):
    """A requested metrics destination cannot start (wandb or mlflow not installed, W&B or MLflow refusing to start
    a run)."""


@dataclass(frozen=True)
class Setup:
    """What a backend starts from (``Backend.start``)."""

    run_dir: Path
    path: Path  # RUN_DIR/metrics.jsonl: notices name it, as it keeps the records a mirror leaves out
    cfg: Any  # the ``Config`` whose ``run`` asked for the backend (its defaults when the logger was built without)
    named: bool  # run.report_to names the backend (False: "auto" asked for it, so start quietly or not at all)
    resume: bool  # --resume: continue the run this folder's earlier start made, where the backend has one
    note: Callable[[str], None]  # adds a line to ``MetricsLogger.notice``, printed once by the caller

    def config(self) -> dict:
        """The whole resolved config, as ``RUN_DIR/config.yaml`` holds it (W&B's config, MLflow's params)."""
        from prefpack.config import config_to_dict

        return config_to_dict(self.cfg)


class Backend:
    """One destination of the metrics records. ``name`` is its ``run.report_to`` name; ``auto`` says whether the
    default ``report_to: [auto]`` starts it when it can (TensorBoard), without a word when it cannot."""

    name: ClassVar[str] = ""
    auto: ClassVar[bool] = False

    @classmethod
    def check(cls, run: Any) -> None:
        """Raise ``MetricsSetupError`` now if the backend cannot start for ``run`` (a ``RunConfig``): what
        ``start`` would find later (a missing package), for a caller that wants to stop before loading models."""

    @classmethod
    def start(cls, setup: Setup) -> Backend | None:
        """The started backend, or None when it cannot start and that is not an error (``setup.note`` says why
        when it was asked for by name); ``MetricsSetupError`` when it was asked for and must work."""
        raise NotImplementedError

    def log(self, record: Mapping[str, Any]) -> None:
        """One record, ``{"step": int, "split": str, "time": float, **metrics}`` (a metric None for NaN/inf)."""
        raise NotImplementedError

    def truncate_after(self, step: int) -> int:
        """Resuming from the checkpoint at ``step``: forget later steps where the backend can; returns the number
        of records dropped."""
        return 0

    def close(self, status: str = "FINISHED") -> None:
        """Release files and runs (``status``: ``FINISHED``, ``KILLED`` or ``FAILED``); a later ``log`` goes on."""


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A record as a mirror takes it: ``split/name`` scalars, the nulls (NaN/inf) left out."""
    split = record["split"]
    return {f"{split}/{key}": value for key, value in record.items() if key not in RESERVED and value is not None}


def write_id(id_file: Path, run_id: str) -> None:
    """Keep a mirror's run id in the run folder (atomically), so ``--resume`` continues that run."""
    tmp = id_file.with_name(f".{id_file.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(run_id + "\n", encoding="utf-8")
        os.replace(tmp, id_file)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise MetricsWriteError(f"cannot write {id_file}: {exc.strerror or exc}") from exc
