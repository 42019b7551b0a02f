"""Training curves from ``RUN_DIR/metrics.jsonl`` as one PNG (backs ``prefpack plot RUN_DIR``).

matplotlib is optional (``pip install prefpack[plot]``) and imported only here, through its object API with
the Agg canvas, so plotting never changes the pyplot backend of a notebook or script that calls it.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from prefpack.errors import PrefpackError
from prefpack.metrics import METRICS_FILE, read_metrics

__all__ = ["PANELS", "PlotError", "plot_run"]

# (panel title, metric keys drawn in it); a panel appears only when one of its keys has a value.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss",)),
    ("reward accuracy", ("rewards/accuracies",)),
    ("reward margin", ("rewards/margins",)),
    ("rewards", ("rewards/chosen", "rewards/rejected")),
    ("log-probs (completion sums)", ("logps/chosen", "logps/rejected")),
    ("KL reference point z0 (KTO)", ("kl",)),
    ("learning rate", ("lr",)),
    ("gradient norm", ("grad_norm",)),
    ("tokens / s", ("tokens/s",)),
)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


class PlotError(PrefpackError, ValueError):
    """Nothing to plot, or matplotlib is missing; the message says what to do."""


def _series(records: list[dict], split: str, key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of one metric; a step logged twice keeps its last value."""
    by_step: dict[int, float] = {}
    for r in records:
        v = r.get(key)
        if r.get("split", "train") == split and isinstance(v, int | float) and math.isfinite(v):
            by_step[int(r["step"])] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def eval_store_names(records: list[dict]) -> list[str]:
    """The stores of a ``data.eval`` map, from the eval lines' ``NAME/loss`` keys, in order of appearance."""
    names: dict[str, None] = {}
    for r in records:
        if r.get("split") == "eval":
            for k in r:
                if k.endswith("/loss") and k.count("/") == 1:
                    names.setdefault(k[: -len("/loss")], None)
    return list(names)


def plot_run(run_dir: str | os.PathLike, *, out: str | os.PathLike | None = None,
             log: Callable[[str], None] | None = None) -> Path:
    """Draw the run's curves (train as lines, eval as markers) to ``out`` (default ``run_dir/curves.png``).

    A line of metrics.jsonl that is not JSON (a damaged file) is skipped, and ``log`` (stderr by default) names it."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"no {METRICS_FILE} in {run_dir}; is this a prefpack run folder?")
    bad: list[int] = []
    records = [r for r in read_metrics(path, bad=bad) if isinstance(r, dict) and "step" in r]
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        (log or _stderr)(f"warning: skipped {len(bad)} line(s) of {path} that are not JSON (line {shown}); "
                         "the plot leaves those records out")
    if not records:
        raise PlotError(f"{path} has no records yet; nothing to plot")

    panels = []
    stores = eval_store_names(records)
    for title, keys in PANELS:
        lines = []
        for key in keys:
            # (metric key, split, label suffix): train, eval, then each store of a data.eval map (eval/NAME/...)
            for full, split, label in [(key, "train", "train"), (key, "eval", "eval"),
                                       *((f"{n}/{key}", "eval", f"eval {n}") for n in stores)]:
                steps, values = _series(records, split, full)
                if steps:
                    lines.append((key, split, label, steps, values))
        if lines:
            panels.append((title, lines))
    if not panels:
        known = ", ".join(k for _, keys in PANELS for k in keys)
        raise PlotError(f"{path} has none of the plotted metrics ({known})")

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise PlotError("matplotlib is not installed; pip install prefpack[plot]") from None

    ncols = min(len(panels), 2 if len(panels) <= 4 else 3)
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (title, lines) in zip(axes, panels):
        colors = {}
        for key, split, where, steps, values in lines:
            color = colors.setdefault((key, where if where.startswith("eval ") else ""), f"C{len(colors)}")
            name = key.rsplit("/", 1)[-1] if len({k for k, *_ in lines}) > 1 else ""
            label = f"{name} ({where})" if name else where
            if split == "train":
                ax.plot(steps, values, "-", color=color, linewidth=1.2, label=label)
            else:
                ax.plot(steps, values, "o", color=color, markersize=5, markeredgecolor="black",
                        markeredgewidth=0.5, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(run_dir.resolve().name, fontsize=11)

    target = Path(out) if out is not None else run_dir / "curves.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100, format="png")
    os.replace(tmp, target)
    return target
