"""What a run says to its user: each evaluation's main metrics in one line, and the summary table at the end.

A TRL user expects the eval metrics printed at every evaluation; the end of a run should read as a table (like
quickstart's), not as a 1,500-character JSON dict whose train block is the last step alone. The JSON stays
available (``prefpack train --json``).
"""

from __future__ import annotations

import math
from pathlib import Path

from prefpack.progress import clock

__all__ = ["IntervalMeans", "eval_line", "summary_table"]

# (label, metric) in the order they are shown; a metric the objective does not log is left out
MAIN_METRICS = (("loss", "loss"), ("acc", "rewards/accuracies"), ("margin", "rewards/margins"), ("kl", "kl"))
SUMMARY_ROWS = (
    ("loss", "loss"), ("reward accuracy", "rewards/accuracies"), ("reward margin", "rewards/margins"),
    ("preference accuracy", "logps/accuracies"), ("log p(chosen)", "logps/chosen"),
    ("log p(rejected)", "logps/rejected"), ("KL estimate", "kl"),
)


class IntervalMeans:
    """Train metrics averaged over the steps since the last :meth:`take` (one metrics line's interval)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.first: int | None = None
        self.last = 0

    def add(self, step: int, metrics: dict[str, float]) -> None:
        if self.first is None:
            self.first = step
        self.last = step
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.sums[key] = self.sums.get(key, 0.0) + float(value)
                self.counts[key] = self.counts.get(key, 0) + 1

    def take(self) -> tuple[int, int, dict[str, float]]:
        """(first step, last step, the means) of the interval, and start a new one."""
        means = {k: self.sums[k] / self.counts[k] for k in self.sums}
        out = (self.first if self.first is not None else self.last, self.last, means)
        self.__init__()
        return out


def _sources(result: dict[str, float]) -> list[str]:
    """The eval stores' prefixes ("" for one store, "NAME/" for each store of a ``data.eval`` map)."""
    return sorted({key[: -len("loss")] for key in result if key == "loss" or key.endswith("/loss")})


def eval_line(when: str, result: dict[str, float], seconds: float) -> list[str]:
    """One line per eval store: ``eval after training [NAME]: loss 0.4123, acc 0.91, margin 1.203 (12 s)``."""
    lines = []
    for prefix in _sources(result) or [""]:
        shown = [f"{label} {result[prefix + key]:.4g}" for label, key in MAIN_METRICS if prefix + key in result]
        name = f" [{prefix[:-1]}]" if prefix else ""
        lines.append(f"eval {when}{name}: {', '.join(shown) or 'no metrics'} ({seconds:.0f} s)")
    return lines


def _cell(value: float | None) -> str:
    """A table cell: 4 significant digits, but large counts in full (tokens/s 11,160, not 1.116e+04)."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


def summary_table(*, run_dir: Path, final_dir: Path | None, steps: int, steps_run: int, seconds: float,
                  tokens: float, interval: tuple[int, int, dict[str, float]] | None,
                  eval_before: dict[str, float] | None, eval_after: dict[str, float] | None,
                  plotted: bool) -> str:
    """The end of a run as plain text: evaluations before and after, the last interval's train metrics, time and
    throughput of this process's steps, and where everything was written."""
    out = []
    rate = f", {tokens / seconds:,.0f} tokens/s" if seconds > 0 and tokens else ""
    resumed = f" ({steps_run} run by this process)" if steps_run != steps else ""
    out.append(f"run finished: {steps} steps{resumed} in {clock(seconds)}{rate}")
    if eval_after is not None:
        for prefix in _sources(eval_after) or [""]:
            out.append("")
            title = f"evaluation [{prefix[:-1]}]" if prefix else "evaluation"
            out.append(f"{title:<30}{'first':>12}{'last':>12}")
            for label, key in SUMMARY_ROWS:
                if prefix + key in eval_after:
                    first = None if eval_before is None else eval_before.get(prefix + key)
                    out.append(f"{label:<30}{_cell(first):>12}{_cell(eval_after[prefix + key]):>12}")
            if eval_before is None:
                out.append("(first: this run resumed; its before-training evaluation is in metrics.jsonl)")
    if interval is not None:
        first, last, means = interval
        span = f"step {last}" if first == last else f"mean of steps {first}-{last}"
        out.append("")
        out.append(f"train ({span})")
        for label, key in (*SUMMARY_ROWS, ("grad norm", "grad_norm"), ("learning rate", "lr"),
                           ("packed rows filled", "filling"), ("tokens/s", "tokens/s")):
            if key in means:
                out.append(f"{label:<30}{_cell(means[key]):>12}")
    out.append("")
    out.append(f"run folder   {run_dir}")
    out.append(f"metrics      {run_dir / 'metrics.jsonl'}" + (f"   curves: {run_dir / 'curves.png'}" if plotted else ""))
    if final_dir is not None:
        out.append(f"final model  {final_dir}")
    return "\n".join(out)
