"""TensorBoard: ``RUN_DIR/tensorboard/`` event files, one scalar per ``split/name``; what the default
``report_to: [auto]`` starts when TensorBoard is installed."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefpack.metrics.base import Backend, Setup, scalars


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
    def start(cls, setup: Setup) -> TensorBoard | None:
        """None when TensorBoard cannot be imported: a notice if it was asked for by name, else not a word."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as exc:  # ImportError, or a broken tensorboard/protobuf install
            if setup.named:
                setup.note(f"TensorBoard logging skipped ({type(exc).__name__}: {exc}); metrics go to "
                           f"{setup.path} only (pip install tensorboard to enable it)")
            return None
        return cls(SummaryWriter, setup.run_dir / "tensorboard")

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
