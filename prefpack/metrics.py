"""Run metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl``, optionally mirrored to TensorBoard, W&B and
MLflow.

Each line is ``{"step": int, "split": str, "time": float, **metrics}`` with ``time`` in Unix seconds. JSON has
no NaN or infinity, so non-finite values are written as ``null`` (and read back as ``None``): the file stays
strict JSON that any tool can read, and the line still records that the metric was logged at that step.
Every line is written with one ``write`` and flushed, so a crash loses at most the line being written;
readers skip such a torn last line.

``run.report_to`` picks the mirrors (``MetricsLogger.from_config``): TensorBoard writes ``RUN_DIR/tensorboard/``;
W&B logs to a run named after the run folder, keeps its files in ``RUN_DIR/wandb/`` and its run id in
``RUN_DIR/wandb_run_id`` (``--resume`` continues that W&B run). MLflow logs to ``RUN_DIR/mlruns/`` (an SQLite
tracking store, ``mlflow.db``, and its ``artifacts/``) unless ``MLFLOW_TRACKING_URI`` names another tracking store,
in the experiment ``MLFLOW_EXPERIMENT_NAME``
(default ``prefpack``), with the resolved config as params and as the artifact ``config.yaml``; its run id is kept in
``RUN_DIR/mlflow_run_id`` (``--resume`` continues that MLflow run). Each mirror gets each record as ``split/name``
scalars at its optimizer step; a null (NaN/inf) value is left out of them.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefpack.config import ConfigError
from prefpack.errors import PrefpackError

__all__ = ["METRICS_FILE", "MLFLOW_ID_FILE", "WANDB_ID_FILE", "MetricsLogger", "MetricsSetupError", "check_report_to", "read_metrics",
           "report_targets"]

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"
_RESERVED = ("step", "split", "time")
_WANDB_INSTALL = "pip install 'prefpack[wandb]'"
MLFLOW_ID_FILE = "mlflow_run_id"
MLFLOW_DIR = "mlruns"
MLFLOW_DB = "mlflow.db"
_MLFLOW_INSTALL = "pip install 'prefpack[mlflow]'"
_MLFLOW_EXPERIMENT = "prefpack"


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


class MetricsWriteError(PrefpackError, OSError):
    """metrics.jsonl could not be written (a full disk); the message names the file."""


class MetricsSetupError(ConfigError):
    """A requested metrics destination cannot start (wandb or mlflow not installed, W&B or MLflow refusing to start
    a run)."""


def report_targets(run: Any) -> set[str]:
    """The mirrors a ``RunConfig`` asks for, from ``report_to`` (a name or a list) and the older ``tensorboard``
    switch: true adds ``"tensorboard"``, false removes it (and ``"auto"``), None leaves ``report_to`` alone.
    ``"none"`` adds nothing (``Config.validate`` refuses it next to other names); ``"auto"`` (the default) stays in the set:
    TensorBoard when it is installed, without a word when it is not."""
    listed = [run.report_to] if isinstance(run.report_to, str) else list(run.report_to)
    targets = {name for name in listed if name != "none"}
    if run.tensorboard is True:
        targets.add("tensorboard")
    elif run.tensorboard is False:
        targets -= {"tensorboard", "auto"}
    if "tensorboard" in targets:  # asked for by name: "auto" adds nothing more
        targets.discard("auto")
    return targets


def check_report_to(run: Any) -> None:
    """Raise ``MetricsSetupError`` now if ``run`` (a ``RunConfig``) asks for W&B or MLflow and it cannot work: what
    ``MetricsLogger.from_config`` would find later, for a caller that wants to stop before loading models."""
    targets = report_targets(run)
    if "wandb" in targets:
        _import_wandb(run.wandb_project)
    if "mlflow" in targets:
        _import_mlflow()


def _import_wandb(project: str):
    if not project or not project.strip():
        raise MetricsSetupError("run.wandb_project must name a W&B project when run.report_to has 'wandb'")
    try:
        import wandb
    except Exception as exc:  # ImportError, or a broken install (protobuf, pydantic versions)
        raise MetricsSetupError(
            f"run.report_to has 'wandb' but the wandb package cannot be imported ({type(exc).__name__}: "
            f"{exc}); install it with {_WANDB_INSTALL}, or remove 'wandb' from run.report_to") from None
    return wandb


def _import_mlflow():
    """MLflow's client and entities (``mlflow-skinny`` has them), or ``MetricsSetupError`` naming the extra; without
    ``MLFLOW_TRACKING_URI`` the local SQLite store needs SQLAlchemy and Alembic too (in the extra as well)."""
    try:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        if not os.environ.get("MLFLOW_TRACKING_URI", "").strip():
            import alembic  # noqa: F401
            import sqlalchemy  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        raise MetricsSetupError(
            f"run.report_to has 'mlflow' but the mlflow package cannot be imported ({type(exc).__name__}: "
            f"{exc}); install it with {_MLFLOW_INSTALL}, or remove 'mlflow' from run.report_to") from None
    return MlflowClient, Metric, Param


def _flat_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"loss": {"beta": 0.1}}`` as ``{"loss.beta": "0.1"}``: MLflow params are flat strings (a list as YAML
    would show it, inline); a value past MLflow's length limit is cut (the whole config is the ``config.yaml``
    artifact)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flat_params(value, f"{name}."))
        else:
            text = json.dumps(value) if not isinstance(value, str) else value
            out[name] = text if len(text) <= 6000 else text[:5997] + "..."
    return out


def _write_id(id_file: Path, run_id: str) -> None:
    tmp = id_file.with_name(f".{id_file.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(run_id + "\n", encoding="utf-8")
        os.replace(tmp, id_file)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise MetricsWriteError(f"cannot write {id_file}: {exc.strerror or exc}") from exc


def _new_run_id() -> str:
    """Eight lowercase letters and digits, as W&B's own run ids."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class MetricsLogger:
    """Appends metrics to ``run_dir/metrics.jsonl`` and, when requested, to TensorBoard and W&B.

    ``enabled=False`` makes every method a no-op (use it on non-zero ranks so only one process writes).
    If TensorBoard was requested by name (``tensorboard=True``) but cannot be imported, ``notice`` holds a
    one-line message for the caller to print once (``tensorboard="auto"``, from the default ``run.report_to``,
    uses it when installed and says nothing when not); logging to the JSONL file goes on regardless. W&B was
    asked for by name, so a missing ``wandb`` package, or a W&B run that cannot start, raises
    ``MetricsSetupError`` here, before any step.

    W&B (``wandb=True``): ``wandb.init`` with ``project=wandb_project``, the run folder's name as run name,
    ``dir=run_dir`` (its files go to ``run_dir/wandb/``) and ``config=wandb_config``. The mode is W&B's own
    (``WANDB_MODE=offline`` writes ``run_dir/wandb/offline-run-*`` and never uses the network). The run id is
    kept in ``run_dir/wandb_run_id``: a new one for a new run, the same one with ``resume=True``.

    MLflow (``mlflow=True``), through ``MlflowClient`` (no active-run globals, no autologging): the tracking store
    of ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///run_dir/mlruns/mlflow.db`` with the artifacts in
    ``run_dir/mlruns/artifacts`` (a database, not MLflow's file store: that one cannot hold both ``train/loss`` and
    ``train/loss/sigmoid``, a file and a folder of one name, and MLflow 3 refuses it by default); the experiment
    ``MLFLOW_EXPERIMENT_NAME`` (default ``prefpack``), created when missing; the run folder's name as run name;
    ``mlflow_config`` flattened as params (``loss.beta``) and whole as the artifact ``config.yaml``. The run id is
    kept in ``run_dir/mlflow_run_id``; ``resume=True`` continues that run (params are not logged again: MLflow
    refuses a changed value) and, as for W&B, leaves out records of steps the run already holds.
    """

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool | str = True, wandb: bool = False,
                 wandb_project: str = "prefpack", wandb_config: Mapping[str, Any] | None = None,
                 mlflow: bool = False, mlflow_config: Mapping[str, Any] | None = None,
                 resume: bool = False, enabled: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self.notice: str | None = None
        self._fh = None
        self._writer = None
        self._writer_cls = None
        self._purge_step: int | None = None
        self._wandb = None  # the wandb module, when W&B is on
        self._wandb_run = None  # the live run (None after close(); the next log() starts it again)
        self._wandb_floor = 0  # the first step the W&B run accepts (a resumed online run already has the earlier)
        self.wandb_run_id: str | None = None
        self._wandb_init: dict[str, Any] = {}  # wandb.init's arguments, to start the run again after close()
        self._mlflow = None  # (MlflowClient instance, Metric class), when MLflow is on
        self._mlflow_live = False  # the MLflow run is RUNNING (close() marks it FINISHED)
        self._mlflow_floor = 0  # the first step the resumed MLflow run does not hold yet
        self.mlflow_run_id: str | None = None
        self.mlflow_tracking_uri: str | None = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception as exc:  # ImportError, or a broken tensorboard/protobuf install
                if tensorboard is True:  # asked for by name; "auto" stays quiet
                    self._note(f"TensorBoard logging skipped ({type(exc).__name__}: {exc}); metrics go to "
                               f"{self.path} only (pip install tensorboard to enable it)")
            else:
                self._writer_cls = SummaryWriter
        if mlflow:
            self._start_mlflow(dict(mlflow_config or {}), resume)
        if wandb:
            self._start_wandb(wandb_project, dict(wandb_config or {}), resume)

    @classmethod
    def from_config(cls, cfg: Any, run_dir: str | os.PathLike | None = None, *, resume: bool = False,
                    enabled: bool = True) -> MetricsLogger:
        """The logger ``cfg.run`` asks for (``report_to``, ``tensorboard``, ``wandb_project``); W&B and MLflow get
        the whole resolved config (``config_to_dict(cfg)``, as in ``RUN_DIR/config.yaml``)."""
        from prefpack.config import config_to_dict

        targets = report_targets(cfg.run)
        tensorboard: bool | str = True if "tensorboard" in targets else "auto" if "auto" in targets else False
        return cls(cfg.run.output_dir if run_dir is None else run_dir, tensorboard=tensorboard,
                   wandb="wandb" in targets, wandb_project=cfg.run.wandb_project,
                   wandb_config=config_to_dict(cfg) if "wandb" in targets else None,
                   mlflow="mlflow" in targets, mlflow_config=config_to_dict(cfg) if "mlflow" in targets else None,
                   resume=resume,
                   enabled=enabled)

    def _note(self, text: str) -> None:
        self.notice = text if self.notice is None else f"{self.notice}\n{text}"

    @property
    def tensorboard_active(self) -> bool:
        return self._writer_cls is not None

    @property
    def wandb_active(self) -> bool:
        return self._wandb is not None

    @property
    def mlflow_active(self) -> bool:
        return self._mlflow is not None

    # ---------------------------------------------------------------------------------------------- W&B

    def _start_wandb(self, project: str, config: dict, resume: bool) -> None:
        wandb = _import_wandb(project)
        id_file = self.run_dir / WANDB_ID_FILE
        run_id = None
        if resume and id_file.exists():
            run_id = id_file.read_text(encoding="utf-8").strip() or None
            if run_id is None:
                self._note(f"{id_file} is empty: this run goes on in a new W&B run")
        elif resume:
            self._note(f"no {id_file}: this run goes on in a new W&B run")
        resuming = run_id is not None
        if run_id is None:
            run_id = _new_run_id()
            _write_id(id_file, run_id)
        self._wandb = wandb
        self.wandb_run_id = run_id
        self._wandb_init = {"project": project.strip(), "name": self.run_dir.resolve().name,
                            "dir": str(self.run_dir), "id": run_id, "config": config, "allow_val_change": True}
        run = self._wandb_start(resume="allow" if resuming else None)
        self._wandb_floor = int(getattr(run, "starting_step", 0) or 0) if resuming else 0
        if resuming and self._wandb_floor:
            self._note(f"W&B: run {run_id} resumed; it already holds steps up to {self._wandb_floor - 1}, so records "
                       f"of those steps logged again after the checkpoint go to {self.path} only")
        elif resuming and getattr(run, "offline", False):
            self._note(f"W&B: run {run_id} goes on offline in a new {self.run_dir / 'wandb'}/offline-run-*-{run_id}* "
                       "folder; `wandb sync` those folders in order (oldest first)")
        elif resuming:
            self._note(f"W&B: run {run_id} resumed")

    def _wandb_start(self, resume: str | None):
        kwargs = dict(self._wandb_init)
        if resume is not None:
            kwargs["resume"] = resume
        try:
            self._wandb_run = self._wandb.init(**kwargs)
        except Exception as exc:  # no API key, server unreachable, bad project name...
            raise MetricsSetupError(
                f"W&B could not start run {kwargs['id']} in project {kwargs['project']!r} ({type(exc).__name__}: "
                f"{exc}); log in with `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to keep "
                f"the run in {self.run_dir / 'wandb'} and `wandb sync` it later") from exc
        return self._wandb_run

    def _wandb_log(self, record: Mapping[str, Any], split: str, step: int) -> None:
        if step < self._wandb_floor:
            return  # already in the resumed W&B run (W&B steps only go forward)
        data = {f"{split}/{key}": value for key, value in record.items()
                if key not in _RESERVED and value is not None}
        if not data:
            return
        run = self._wandb_run or self._wandb_start(resume="allow")  # closed earlier: the same run goes on
        run.log(data, step=step)

    # ---------------------------------------------------------------------------------------------- MLflow

    def _start_mlflow(self, config: dict, resume: bool) -> None:
        client_cls, metric_cls, param_cls = _import_mlflow()
        uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
        artifacts = None  # the artifact root of an experiment created here (None: the tracking store's default)
        if not uri:
            local = (self.run_dir / MLFLOW_DIR).resolve()
            local.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{local / MLFLOW_DB}"
            artifacts = (local / "artifacts").as_uri()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip() or _MLFLOW_EXPERIMENT
        id_file = self.run_dir / MLFLOW_ID_FILE
        run_id = None
        step = "connect"
        try:
            client = client_cls(tracking_uri=uri)
            if resume and id_file.exists():
                run_id = id_file.read_text(encoding="utf-8").strip() or None
                if run_id is not None:
                    step = f"find run {run_id}"
                    try:
                        found = client.get_run(run_id)
                    except Exception as exc:  # not in this tracking store (another MLFLOW_TRACKING_URI?)
                        self._note(f"MLflow: run {run_id} is not in {uri} ({type(exc).__name__}); this run goes on "
                                   "in a new MLflow run")
                        run_id = None
                    else:
                        if found.info.lifecycle_stage == "deleted":
                            self._note(f"MLflow: run {run_id} was deleted; this run goes on in a new MLflow run")
                            run_id = None
                else:
                    self._note(f"{id_file} is empty: this run goes on in a new MLflow run")
            elif resume:
                self._note(f"no {id_file}: this run goes on in a new MLflow run")
            if run_id is not None:
                step = f"resume run {run_id}"
                held = [m.step for key in found.data.metrics for m in client.get_metric_history(run_id, key)]
                self._mlflow_floor = max(held) + 1 if held else 0
                client.update_run(run_id, status="RUNNING")
                note = f"MLflow: run {run_id} resumed"
                if self._mlflow_floor:
                    note += (f"; it already holds steps up to {self._mlflow_floor - 1}, so records of those steps "
                             f"logged again after the checkpoint go to {self.path} only")
                self._note(note)
            else:
                step = f"use experiment {experiment!r}"
                exp = client.get_experiment_by_name(experiment)
                exp_id = (exp.experiment_id if exp is not None
                          else client.create_experiment(experiment, artifact_location=artifacts))
                step = "start a run"
                run_id = client.create_run(exp_id, run_name=self.run_dir.resolve().name).info.run_id
                _write_id(id_file, run_id)
                step = "log the config"
                params = [param_cls(k, v) for k, v in _flat_params(config).items()]
                for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                    client.log_batch(run_id, params=params[i:i + 100])
                client.log_dict(run_id, config, "config.yaml")
        except MetricsWriteError:
            raise
        except Exception as exc:  # server unreachable, a store that refuses us...
            raise MetricsSetupError(
                f"MLflow could not {step} at {uri} ({type(exc).__name__}: {exc}); check MLFLOW_TRACKING_URI "
                f"(unset, runs go to {self.run_dir / MLFLOW_DIR / MLFLOW_DB}), or remove 'mlflow' from run.report_to") from exc
        self._mlflow = (client, metric_cls)
        self._mlflow_live = True
        self.mlflow_run_id = run_id
        self.mlflow_tracking_uri = uri

    def _mlflow_log(self, record: Mapping[str, Any], split: str, step: int) -> None:
        if step < self._mlflow_floor:
            return  # already in the resumed MLflow run
        client, metric_cls = self._mlflow
        ms = int(record["time"] * 1000)
        metrics = [metric_cls(f"{split}/{key}", value, ms, step) for key, value in record.items()
                   if key not in _RESERVED and value is not None]
        if not metrics:
            return
        if not self._mlflow_live:  # closed earlier: the same run goes on
            client.update_run(self.mlflow_run_id, status="RUNNING")
            self._mlflow_live = True
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            client.log_batch(self.mlflow_run_id, metrics=metrics[i:i + 1000])

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
        if self._wandb is not None:
            self._wandb_log(record, str(split), step)
        if self._mlflow is not None:
            self._mlflow_log(record, str(split), step)

    def _tb_writer(self):
        if self._writer is None:
            kwargs = {} if self._purge_step is None else {"purge_step": self._purge_step}
            self._writer = self._writer_cls(log_dir=str(self.run_dir / "tensorboard"), **kwargs)
        return self._writer

    def truncate_after(self, step: int) -> int:
        """Drop every record with ``step`` greater than ``step`` (resuming from that checkpoint).

        The file is rewritten to a temporary file and renamed over the old one, so a crash during the
        rewrite leaves either the old or the new file, never a mix. TensorBoard events past ``step`` are
        purged by the next writer (``purge_step``). W&B and MLflow do not drop history: a resumed W&B (online) or
        MLflow run keeps what it has and takes records from its next step on (``notice`` says which). Returns the number of
        records dropped.
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

    def close(self, status: str = "FINISHED") -> None:
        """Close the file, the TensorBoard writer, the W&B run and the MLflow run (marked ``status``: ``FINISHED``,
        ``KILLED`` for a stop, ``FAILED`` for an error); logging again reopens the file in append mode and resumes
        the same W&B and MLflow runs."""
        self._close_file()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            run.finish()
        if self._mlflow is not None and self._mlflow_live:
            self._mlflow_live = False
            self._mlflow[0].set_terminated(self.mlflow_run_id, status)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close("FINISHED" if exc_type is None else "FAILED")
