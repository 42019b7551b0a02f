"""What the loop does between steps on a clock: evaluations (before, every ``run.eval_every``, after), metrics lines
(every ``run.log_every``), checkpoints (every ``run.save_every``), the progress bar and ``stop_after_steps``.

Progress goes to stderr: a tqdm bar on a terminal; off a terminal (a batch job's log file) one plain line per metrics
line instead, since the bar's carriage-return frames make one endless line in a file.

Kept apart from the loop so that ``train()`` reads as the step itself, and so that every "is step k due?" rule lives
in one place: an evaluation or checkpoint that would fall on the last step is left to the end of the run (the final
evaluation, the final model), and the last step always gets a metrics line.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from prefpack.distributed import Dist
from prefpack.progress import clock, is_terminal
from prefpack.training.report import IntervalMeans, eval_line

_is_terminal = is_terminal  # module-level, so tests can stand in a terminal

__all__ = ["Cadence", "TrainingInterrupted", "log_line", "postfix"]


class TrainingInterrupted(RuntimeError):
    """Raised by `stop_after_steps` (tests simulate a crash with it)."""


def postfix(last: dict[str, float]) -> dict[str, str]:
    """The progress bar's short summary of a step's metrics (what is there: accuracy for pairs, KL for KTO, the
    share of positions saved when prompts are laid out once)."""
    shown = {"loss": f"{last['loss']:.4f}", "fill": f"{last['filling']:.2f}"}
    if "rewards/accuracies" in last:
        shown["acc"] = f"{last['rewards/accuracies']:.2f}"
    if "kl" in last:
        shown["kl"] = f"{last['kl']:.3f}"
    if last["positions"] < last["tokens"]:  # prompts laid out once: the share of positions not computed
        shown["saved"] = f"{1 - last['positions'] / last['tokens']:.0%}"
    return shown


def log_line(done: int, n_steps: int, last: dict[str, float], eta_s: float | None) -> str:
    """The plain progress line of a batch job's log: step, loss, reward accuracy (pairs) or KL (KTO), tokens/s, the
    positions saved by shared prompts, time left."""
    parts = [f"step {done}/{n_steps}", f"loss {last['loss']:.4f}"]
    if "rewards/accuracies" in last:
        parts.append(f"acc {last['rewards/accuracies']:.2f}")
    if "kl" in last:
        parts.append(f"kl {last['kl']:.3f}")
    parts.append(f"tokens/s {last.get('tokens/s', 0.0):.0f}")
    if last["positions"] < last["tokens"]:  # as the bar: the share of positions prompts laid out once saved
        parts.append(f"saved {1 - last['positions'] / last['tokens']:.0%}")
    if eta_s is not None:
        parts.append(f"eta {clock(eta_s)}")
    if last.get("skipped_steps"):
        parts.append(f"skipped {int(last['skipped_steps'])}")
    return "train: " + ", ".join(parts)


class Cadence:
    """The run's clock for steps ``start + 1 .. n_steps``: :meth:`begin` before the first, :meth:`after_step` after
    each, :meth:`finish` after the last. ``evaluate`` (None without eval data) returns eval metrics; ``save(step)``
    writes a checkpoint; ``metrics`` is the run's ``MetricsLogger``, closed by :meth:`finish` or on a stop.

    Each evaluation is announced and its main metrics printed through ``log`` (above the bar on a terminal); the
    time left counts the evaluations still to come; :attr:`interval` holds the train metrics averaged over the
    steps of the last metrics line (the run summary's "train" block)."""

    def __init__(self, run: Any, n_steps: int, metrics: Any, ctx: Dist, *, evaluate: Callable[[], dict] | None,
                 save: Callable[[int], None], stop_after_steps: int | None = None, log: Callable[[str], None] = print,
                 boundary: Callable[[int], bool] | None = None,
                 step_done: Callable[[int, dict | None], None] | None = None):
        self.log_every, self.eval_every, self.save_every = run.log_every, run.eval_every, run.save_every
        self.n_steps = n_steps
        self.metrics = metrics
        self.ctx = ctx
        self.evaluate = evaluate
        self.save = save
        self.stop_after_steps = stop_after_steps
        # a feed's segment ends (a round's last step): an evaluation and a checkpoint there too, then the feed's own
        # record of the segment (a resume from that checkpoint records it when the record is missing)
        self.boundary = boundary or (lambda done: False)
        self.step_done = step_done  # after each step's evaluation and checkpoint (the last step's: after finish's)
        self.bar = None
        self.lines = False  # plain progress lines (stderr is not a terminal)
        self.clock: tuple[int, float] = (0, 0.0)  # (first step, its time), for the lines' time left
        self.log = log
        self.eval_seconds: list[float] = []  # how long each evaluation took, for the time left
        self.window = IntervalMeans()  # train metrics since the last metrics line
        self.interval: tuple[int, int, dict[str, float]] | None = None  # (first step, last step, their means)

    def _due(self, every: int | None, done: int) -> bool:
        """Every ``every`` steps (0 or None: never), short of the last step, which the run's end covers."""
        return bool(every) and done % every == 0 and done < self.n_steps

    def begin(self, start: int, *, progress: bool) -> dict[str, float] | None:
        """The evaluation before training (a fresh run with eval data only: a resumed run logged it already), then
        the progress bar from ``start``. Returns that evaluation."""
        before = None
        if self.evaluate is not None and start == 0:
            before = self._evaluate(0, "before training")
        self.clock = (start, time.monotonic())
        if progress and not _is_terminal(sys.stderr):
            self.lines = True
        elif progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.n_steps, initial=start, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True)
        return before

    def after_step(self, done: int, last: dict[str, float]) -> None:
        """After step ``done`` (counted from 1) with its metrics ``last``: whatever is due, in this order: the
        metrics line, the bar, an evaluation, a checkpoint, then a stop that ``stop_after_steps`` asks for."""
        self.window.add(done, last)
        if done % self.log_every == 0 or done == self.n_steps:
            self.metrics.log(done, last)
            self.interval = self.window.take()
            if self.lines:
                print(log_line(done, self.n_steps, last, self._eta(done)), file=sys.stderr, flush=True)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(postfix(last))
        ends = self.boundary(done) and done < self.n_steps  # the last step's is the run's end (finish)
        evaluation = None
        if self.evaluate is not None and (self._due(self.eval_every, done) or ends):
            evaluation = self._evaluate(done, f"at step {done}/{self.n_steps}")
        if self._due(self.save_every, done) or ends:
            self.save(done)
        if self.step_done is not None and done < self.n_steps:  # after the checkpoint: a resume from it finds
            self.step_done(done, evaluation)  # what the feed records here
        if self.stop_after_steps is not None and done >= self.stop_after_steps and done < self.n_steps:
            self._close_bar()
            self.metrics.close(status="KILLED")
            self.ctx.barrier()  # no rank tears the process group down while another is still in a collective
            raise TrainingInterrupted(f"stopped after step {done}")

    def terminate(self, done: int, signum: int) -> None:
        """A stop signal after step ``done``: a checkpoint of that step (unless the cadence just wrote one), then
        stop with :class:`TrainingTerminated`."""
        from prefpack.training.guards import TrainingTerminated

        if not (self._due(self.save_every, done) or self.boundary(done) and done < self.n_steps):
            self.save(done)
        self._close_bar()
        self.metrics.close(status="KILLED")
        self.ctx.barrier()
        raise TrainingTerminated(done, signum)

    def abort(self) -> None:
        """The run stops on an error: close the bar and the metrics (flushed, so they show what led to it)."""
        self._close_bar()
        self.metrics.close(status="FAILED")

    def finish(self) -> dict[str, float] | None:
        """After the last step: close the bar, evaluate (with eval data) and close the metrics. Returns that
        evaluation."""
        self._close_bar()
        after = None
        if self.evaluate is not None:
            after = self._evaluate(self.n_steps, "after training")
        if self.step_done is not None:  # the last step, with the evaluation after training
            self.step_done(self.n_steps, after)
        self.metrics.close()
        return after

    def _evaluate(self, step: int, when: str) -> dict[str, float]:
        """One evaluation, announced first (it can take minutes), logged at ``step`` and printed."""
        self._say(f"eval {when}: scoring the eval data")
        t0 = time.monotonic()
        result = self.evaluate()
        self.eval_seconds.append(time.monotonic() - t0)
        self.metrics.log(step, result, split="eval")
        for line in eval_line(when, result, self.eval_seconds[-1]):
            self._say(line)
        return result

    def _say(self, line: str) -> None:
        if self.bar is not None:  # above the bar, which stays whole
            self.bar.write(line, file=sys.stderr)
        else:
            self.log(line)

    def _evals_left(self, done: int) -> int:
        """Evaluations after step ``done``: those due in the steps still to run, and the one after training."""
        if self.evaluate is None:
            return 0
        every = self.eval_every or 0  # multiples of it in (done, n_steps), counted, not walked (a long online run)
        due = (self.n_steps - 1) // every - done // every if every else 0
        return due + 1  # a feed's segment ends are not counted: the time left is a little short with them

    def _eta(self, done: int) -> float | None:
        """Time left: the steps still to run at the rate so far (evaluations taken out of it), plus the evaluations
        still to come at the mean time of those done."""
        first, t0 = self.clock
        if done <= first:
            return None
        evals = self.eval_seconds[1:] if self.eval_seconds and first == 0 else self.eval_seconds
        stepping = max(time.monotonic() - t0 - sum(evals), 0.0)
        eval_s = sum(self.eval_seconds) / len(self.eval_seconds) if self.eval_seconds else 0.0
        return stepping / (done - first) * (self.n_steps - done) + eval_s * self._evals_left(done)

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
