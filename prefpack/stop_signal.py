"""A stop signal (a scheduler's SIGTERM before it kills, Ctrl-C's SIGINT) acted on between two units of work, so that
what a run writes ends at a whole unit (a checkpointed step, a samples line, a scored chunk) and it stops with a hint.

The handler only sets a flag: a handler that raised could cut a step or a write in half. Training, ``prefpack
generate``, ``prefpack score`` and the rounds' phases all use this one class; :class:`Terminated` is what the
generate and score loops raise once they acted on it (training raises its own ``TrainingTerminated``).
"""

from __future__ import annotations

import signal
import threading

from prefpack.distributed import Dist

__all__ = ["STOP_SIGNALS", "StopSignal", "Terminated"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # generate and score: a scheduler's notice and Ctrl-C alike


class Terminated(RuntimeError):
    """A stop signal acted on at a whole batch: ``what`` says what was done (``N of M prompts sampled``)."""

    def __init__(self, what: str, signum: int):
        super().__init__(f"terminated by signal {signum}: {what}")
        self.what, self.signum = what, signum


class StopSignal:
    """The handler of ``signums`` while a loop runs (the previous handlers are restored on exit); ``due()`` once per
    unit of work says, the same on every rank, whether to stop now.

    A signal that arrives after the last ``due()`` was never acted on: on exit it is delivered again, to the
    restored handler, so it is never swallowed (it once was: a run under torchrun finished after its SIGTERM)."""

    def __init__(self, ctx: Dist | None = None, signums: tuple[int, ...] = (signal.SIGTERM,)):
        self.ctx = ctx if ctx is not None else Dist()
        self.signums = tuple(signums)
        self.signum = 0
        self.acted = False
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self.previous = {s: signal.signal(s, self._handle) for s in self.signums}
        return self

    def __exit__(self, *exc) -> None:
        previous, self.previous = self.previous, {}
        for s, handler in previous.items():
            signal.signal(s, handler)
        if previous and self.signum and not self.acted and exc[0] is None:
            signal.raise_signal(self.signum)  # arrived after the last check: the handler outside the loop's

    def _handle(self, signum, _frame) -> None:
        self.signum = signum  # acted on between units of work, never in the middle of one

    def due(self) -> bool:
        if not self.ctx.enabled:
            got = bool(self.signum)
        else:
            import torch

            flag = torch.tensor([float(bool(self.signum))], device=self.ctx.device)
            got = float(self.ctx.all_reduce_sum(flag)) > 0
            if got and not self.signum:
                self.signum = signal.SIGTERM  # another rank received it
        self.acted = self.acted or got
        return got
