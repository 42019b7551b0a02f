"""MLflow: a run in ``RUN_DIR/mlruns/`` (or the tracking store ``MLFLOW_TRACKING_URI`` names), the resolved config as
its params and ``config.yaml`` artifact, its id in ``RUN_DIR/mlflow_run_id`` so ``--resume`` continues it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from prefpack.metrics.base import Backend, MetricsSetupError, MetricsWriteError, Setup, scalars, write_id

MLFLOW_ID_FILE = "mlflow_run_id"
MLFLOW_DIR = "mlruns"
MLFLOW_DB = "mlflow.db"
_MLFLOW_INSTALL = "pip install 'prefpack[mlflow]'"
_MLFLOW_EXPERIMENT = "prefpack"


def import_mlflow():
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


def flat_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"loss": {"beta": 0.1}}`` as ``{"loss.beta": "0.1"}``: MLflow params are flat strings (a list as YAML
    would show it, inline); a value past MLflow's length limit is cut (the whole config is the ``config.yaml``
    artifact)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            text = json.dumps(value) if not isinstance(value, str) else value
            out[name] = text if len(text) <= 6000 else text[:5997] + "..."
    return out


class MLflow(Backend):
    """Through ``MlflowClient`` (no active-run globals, no autologging): the tracking store of
    ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///RUN_DIR/mlruns/mlflow.db`` with the artifacts in
    ``RUN_DIR/mlruns/artifacts`` (a database, not MLflow's file store: that one cannot hold both ``train/loss`` and
    ``train/loss/sigmoid``, a file and a folder of one name, and MLflow 3 refuses it by default); the experiment
    ``MLFLOW_EXPERIMENT_NAME`` (default ``prefpack``), created when missing; the run folder's name as run name; the
    resolved config flattened as params (``loss.beta``) and whole as the artifact ``config.yaml``. The run id is
    kept in ``RUN_DIR/mlflow_run_id``; ``--resume`` continues that run (params are not logged again: MLflow
    refuses a changed value) and, as for W&B, leaves out records of steps the run already holds."""

    name = "mlflow"

    def __init__(self, client: Any, metric_cls: Any, run_id: str, tracking_uri: str, floor: int) -> None:
        self._client = client
        self._metric_cls = metric_cls
        self._live = True  # the MLflow run is RUNNING (close() marks it FINISHED, KILLED or FAILED)
        self._floor = floor  # the first step the resumed MLflow run does not hold yet
        self.run_id = run_id
        self.tracking_uri = tracking_uri

    @classmethod
    def check(cls, run: Any) -> None:
        import_mlflow()

    @classmethod
    def start(cls, setup: Setup) -> MLflow:
        client_cls, metric_cls, param_cls = import_mlflow()
        config = setup.config()
        uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
        artifacts = None  # the artifact root of an experiment created here (None: the tracking store's default)
        if not uri:
            local = (setup.run_dir / MLFLOW_DIR).resolve()
            local.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{local / MLFLOW_DB}"
            artifacts = (local / "artifacts").as_uri()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip() or _MLFLOW_EXPERIMENT
        id_file = setup.run_dir / MLFLOW_ID_FILE
        run_id = None
        floor = 0
        step = "connect"
        try:
            client = client_cls(tracking_uri=uri)
            if setup.resume and id_file.exists():
                run_id = id_file.read_text(encoding="utf-8").strip() or None
                if run_id is not None:
                    step = f"find run {run_id}"
                    try:
                        found = client.get_run(run_id)
                    except Exception as exc:  # not in this tracking store (another MLFLOW_TRACKING_URI?)
                        setup.note(f"MLflow: run {run_id} is not in {uri} ({type(exc).__name__}); this run goes on "
                                   "in a new MLflow run")
                        run_id = None
                    else:
                        if found.info.lifecycle_stage == "deleted":
                            setup.note(f"MLflow: run {run_id} was deleted; this run goes on in a new MLflow run")
                            run_id = None
                else:
                    setup.note(f"{id_file} is empty: this run goes on in a new MLflow run")
            elif setup.resume:
                setup.note(f"no {id_file}: this run goes on in a new MLflow run")
            if run_id is not None:
                step = f"resume run {run_id}"
                held = [m.step for key in found.data.metrics for m in client.get_metric_history(run_id, key)]
                floor = max(held) + 1 if held else 0
                client.update_run(run_id, status="RUNNING")
                note = f"MLflow: run {run_id} resumed"
                if floor:
                    note += (f"; it already holds steps up to {floor - 1}, so records of those steps "
                             f"logged again after the checkpoint go to {setup.path} only")
                setup.note(note)
            else:
                step = f"use experiment {experiment!r}"
                exp = client.get_experiment_by_name(experiment)
                exp_id = (exp.experiment_id if exp is not None
                          else client.create_experiment(experiment, artifact_location=artifacts))
                step = "start a run"
                run_id = client.create_run(exp_id, run_name=setup.run_dir.resolve().name).info.run_id
                write_id(id_file, run_id)
                step = "log the config"
                params = [param_cls(k, v) for k, v in flat_params(config).items()]
                for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                    client.log_batch(run_id, params=params[i:i + 100])
                client.log_dict(run_id, config, "config.yaml")
        except MetricsWriteError:
            raise
        except Exception as exc:  # server unreachable, a store that refuses us...
            raise MetricsSetupError(
                f"MLflow could not {step} at {uri} ({type(exc).__name__}: {exc}); check MLFLOW_TRACKING_URI "
                f"(unset, runs go to {setup.run_dir / MLFLOW_DIR / MLFLOW_DB}), or remove 'mlflow' from "
                "run.report_to") from exc
        return cls(client, metric_cls, run_id, uri, floor)

    def log(self, record: Mapping[str, Any]) -> None:
        step = record["step"]
        if step < self._floor:
            return  # already in the resumed MLflow run
        ms = int(record["time"] * 1000)
        metrics = [self._metric_cls(tag, value, ms, step) for tag, value in scalars(record).items()]
        if not metrics:
            return
        if not self._live:  # closed earlier: the same run goes on
            self._client.update_run(self.run_id, status="RUNNING")
            self._live = True
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, status: str = "FINISHED") -> None:
        if self._live:
            self._live = False
            self._client.set_terminated(self.run_id, status)
