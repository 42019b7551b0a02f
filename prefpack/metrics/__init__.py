"""Run metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl``, optionally mirrored to TensorBoard, W&B and
MLflow.

Each line is ``{"step": int, "split": str, "time": float, **metrics}`` with ``time`` in Unix seconds. JSON has
no NaN or infinity, so non-finite values are written as ``null`` (and read back as ``None``): the file stays
strict JSON that any tool can read, and the line still records that the metric was logged at that step.
Every line is written with one ``write`` and flushed, so a crash loses at most the line being written;
readers skip such a torn last line.

``run.report_to`` picks the mirrors (``MetricsLogger.from_config``), one backend class each, by name in
``backends.BACKENDS``: ``tensorboard`` writes ``RUN_DIR/tensorboard/``; ``wandb`` logs to a run named after the
run folder, keeps its files in ``RUN_DIR/wandb/`` and its run id in ``RUN_DIR/wandb_run_id`` (``--resume``
continues that W&B run); ``mlflow`` logs to ``RUN_DIR/mlruns/`` (an SQLite tracking store, ``mlflow.db``, and its
``artifacts/``) unless ``MLFLOW_TRACKING_URI`` names another tracking store, in the experiment
``MLFLOW_EXPERIMENT_NAME`` (default ``prefpack``), with the resolved config as params and as the artifact
``config.yaml``; its run id is kept in ``RUN_DIR/mlflow_run_id`` (``--resume`` continues that MLflow run). Each
mirror gets each record as ``split/name`` scalars at its optimizer step; a null (NaN/inf) value is left out of them.

Modules: ``base`` (the ``Backend`` interface, ``Setup``, the errors), ``jsonl`` (the file, ``read_metrics``),
``tensorboard``, ``wandb``, ``mlflow`` (one backend each), ``backends`` (the name table, ``report_targets``,
``check_report_to``), ``logger`` (``MetricsLogger``).
"""

from prefpack.metrics.backends import BACKENDS, check_report_to, report_targets
from prefpack.metrics.base import Backend, MetricsSetupError, MetricsWriteError, Setup
from prefpack.metrics.jsonl import METRICS_FILE, read_metrics
from prefpack.metrics.logger import MetricsLogger
from prefpack.metrics.mlflow import MLFLOW_ID_FILE
from prefpack.metrics.wandb import WANDB_ID_FILE

__all__ = ["BACKENDS", "METRICS_FILE", "MLFLOW_ID_FILE", "WANDB_ID_FILE", "Backend", "MetricsLogger",
           "MetricsSetupError", "MetricsWriteError", "Setup", "check_report_to", "read_metrics", "report_targets"]
