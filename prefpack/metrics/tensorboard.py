"""TensorBoard: ``RUN_DIR/tensorboard/`` event files, one scalar per ``split/name``; what the default
``report_to: [auto]`` starts when TensorBoard is installed. Asked for by name and not installed, the run is refused
before it starts, as W&B and MLflow are."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefpack.metrics.base import Backend, MetricsSetupError, Setup, scalars


def import_writer():
    """``SummaryWriter``, or ``MetricsSetupError`` saying how to install TensorBoard (or not ask for it)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as exc:  # ImportError, or a broken tensorboard/protobuf install
        raise MetricsSetupError(
            f"run.report_to has 'tensorboard' but TensorBoard cannot be imported ({type(exc).__name__}: {exc}); "
            "install it with pip install tensorboard, or remove 'tensorboard' from run.report_to (the default, auto, "
            "uses it only when it is installed)") from None
    return SummaryWriter


class TensorBoard(Backend):
    """A ``SummaryWriter``, opened on the first record after a start or a truncation; a resume's truncation has
    the next writer purge the events past the checkpoint (``purge_step``)."""

    name = "tensorboard"
    auto = True

    def __init__(self, writer_cls: Any, log_dir: Path) -> None:
        self._writer_cls = writer_cls
        self._log_dir = log_dir
        self._writer = None
        self._purge_step: int | None = None

    @classmethod
    def check(cls, run: Any) -> None:
        import_writer()

    @classmethod
    def start(cls, setup: Setup) -> TensorBoard | None:
        """None when TensorBoard cannot be imported and ``report_to`` is auto, without a word; asked for by name,
        ``MetricsSetupError`` (as W&B and MLflow)."""
        try:
            writer_cls = import_writer()
        except MetricsSetupError:
            if setup.named:
                raise
            return None
        return cls(writer_cls, setup.run_dir / "tensorboard")

    def log(self, record: Mapping[str, Any]) -> None:
        if self._writer is None:
            kwargs = {} if self._purge_step is None else {"purge_step": self._purge_step}
            self._writer = self._writer_cls(log_dir=str(self._log_dir), **kwargs)
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, record["step"])
        self._writer.flush()

    def truncate_after(self, step: int) -> int:
        self.close()
        self._purge_step = int(step) + 1
        return 0

    def close(self, status: str = "FINISHED") -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
