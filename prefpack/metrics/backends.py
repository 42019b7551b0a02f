"""The table of metrics mirrors: ``run.report_to`` name -> backend class. ``check_report_to`` and
``MetricsLogger.from_config`` read it; the config's ``ReportTo`` choices list the same names (tested)."""

from __future__ import annotations

from typing import Any

from prefpack.metrics.base import Backend
from prefpack.metrics.mlflow import MLflow
from prefpack.metrics.tensorboard import TensorBoard
from prefpack.metrics.wandb import WandB

# the order they start, log and close in
BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (TensorBoard, WandB, MLflow)}


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
    """Raise ``MetricsSetupError`` now if ``run`` (a ``RunConfig``) asks for a mirror that cannot work (W&B or
    MLflow not installed): what ``MetricsLogger.from_config`` would find later, for a caller that wants to stop
    before loading models."""
    targets = report_targets(run)
    for name, cls in BACKENDS.items():
        if name in targets:
            cls.check(run)
