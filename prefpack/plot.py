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

__all__ = ["PANELS", "PlotError", "eval_store_names", "legend_label", "panels", "plot_run", "train_source_names",
           "try_plot"]

# (panel title, metric keys drawn in it); a panel appears only when one of its keys has a value.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("policy sample reward (per on-policy round)", ("reward/mean", "reward/max", "reward/min", "eval_reward/mean")),
    ("loss", ("loss",)),
    ("reward accuracy", ("rewards/accuracies",)),
    ("reward margin", ("rewards/margins",)),
    ("rewards", ("rewards/chosen", "rewards/rejected")),
    ("log-probs (completion sums)", ("logps/chosen", "logps/rejected")),
    ("KL reference point z0 (KTO)", ("kl",)),
    ("token entropy (policy, scored tokens)", ("entropy/chosen", "entropy/rejected")),
    ("learning rate", ("lr",)),
    ("gradient norm", ("grad_norm",)),
    ("tokens / s", ("tokens/s",)),
)


# a metric's name in its panel's legend, where the last part of its key alone would repeat another's ("mean")
LEGEND_NAMES = {"eval_reward/mean": "held-out mean"}


def legend_label(key: str, where: str, panel_keys: set[str]) -> str:
    """``mean (round)``; the bare ``where`` (``train``, ``eval NAME``) in a panel of one metric."""
    if len(panel_keys) == 1:
        return where
    return f"{LEGEND_NAMES.get(key, key.rsplit('/', 1)[-1])} ({where})"


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


def train_source_names(records: list[dict]) -> list[str]:
    """The sources of a mixture (``data.train`` as a list), from the train lines' ``NAME/pairs`` keys (every step
    names every source), in order of appearance."""
    names: dict[str, None] = {}
    for r in records:
        if r.get("split", "train") == "train":
            for k in r:
                if k.endswith("/pairs") and k.count("/") == 1:
                    names.setdefault(k[: -len("/pairs")], None)
    return list(names)


def panels(records: list[dict]) -> list[tuple[str, list[tuple[str, str, str, list[int], list[float]]]]]:
    """The panels ``plot_run`` draws: ``(title, lines)``, each line ``(metric key, split, label, steps, values)``.

    In a panel: the run's train curve, its eval markers, then each source of a mixture as its own train curve
    (``NAME/loss`` ..., labelled ``train NAME``) and each store of a ``data.eval`` map as its own markers
    (``eval NAME``); a panel appears only when one of its lines has a value."""
    stores = eval_store_names(records)
    sources = train_source_names(records)
    out = []
    for title, keys in PANELS:
        lines = []
        for key in keys:
            # (metric key in the record, split, label)
            for full, split, label in [(key, "train", "train"), (key, "eval", "eval"), (key, "round", "round"),
                                       *((f"{n}/{key}", "train", f"train {n}") for n in sources),
                                       *((f"{n}/{key}", "eval", f"eval {n}") for n in stores)]:
                steps, values = _series(records, split, full)
                if steps:
                    lines.append((key, split, label, steps, values))
        if lines:
            out.append((title, lines))
    return out


def run_title(run_dir: Path) -> str:
    """What the run was, from its config.yaml: loss terms, model and data (the folder's name alone says little)."""
    name = run_dir.resolve().name
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
        from prefpack.objectives.names import TRAIN_OBJECTIVES

        objective = TRAIN_OBJECTIVES.get(str((cfg.get("train") or {}).get("objective")))
        if objective is not None and objective.sequence_classifier:  # its loss is its own, not loss.terms
            terms = f"{objective.name} model (Bradley-Terry)"
        else:
            terms = " + ".join(str(t.get("name")) for t in cfg["loss"]["terms"])
        model = Path(str(cfg["model"]["name_or_path"])).name
        train, rounds = cfg["data"]["train"], (cfg.get("rounds") or {}).get("count") or 0
        if rounds:  # an on-policy run trains on its rounds' own stores, not data.train
            data = f"{rounds} on-policy rounds of {Path(str(cfg['rounds']['prompts'])).name}"
        else:
            data = Path(str(train)).name if isinstance(train, str) else f"a mixture of {len(train)} stores"
    except Exception:  # no config (an old or hand-made metrics file): the folder's name is what there is
        return name
    return f"{name}: {terms} on {model}, data {data}"


def plot_run(run_dir: str | os.PathLike, *, out: str | os.PathLike | None = None,
             log: Callable[[str], None] | None = None) -> Path:
    """Draw the run's curves (train as lines, eval as markers; a mixture's sources and a ``data.eval`` map's stores
    each as their own, see ``panels``) to ``out`` (default ``run_dir/curves.png``).

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

    drawn = panels(records)
    if not drawn:
        known = ", ".join(k for _, keys in PANELS for k in keys)
        raise PlotError(f"{path} has none of the plotted metrics ({known})")

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise PlotError("matplotlib is not installed; pip install prefpack[plot]") from None

    ncols = min(len(drawn), 2 if len(drawn) <= 4 else 3)
    nrows = math.ceil(len(drawn) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (title, lines) in zip(axes, drawn):
        colors = {}
        for key, split, where, steps, values in lines:
            # one color per (metric, source): a source's train curve and its eval store's markers share it
            color = colors.setdefault((key, where.partition(" ")[2]), f"C{len(colors)}")
            label = legend_label(key, where, {k for k, *_ in lines})
            if split == "train":
                ax.plot(steps, values, "-", color=color, linewidth=1.2, label=label)
            elif split == "round":  # one point per on-policy round, at the step its samples were drawn
                ax.plot(steps, values, "s-", color=color, linewidth=1.2, markersize=4, label=label)
            else:
                ax.plot(steps, values, "o", color=color, markersize=5, markeredgecolor="black",
                        markeredgewidth=0.5, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)  # KTO's loss near 0.5: values, not "+5e-1" offsets
        if len(lines) > 1:  # beside the panel, never over its curves (a mixture has many)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    for ax in axes[len(drawn):]:
        ax.set_visible(False)
    fig.suptitle(run_title(run_dir), fontsize=10)

    target = Path(out) if out is not None else run_dir / "curves.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100, format="png")
    os.replace(tmp, target)
    return target


def try_plot(run_dir: str | os.PathLike, log: Callable[[str], None]) -> bool:
    """curves.png at a run's end (True when drawn): a missing plotting library or an empty run is a note, never the
    failure of a finished run."""
    try:
        plot_run(run_dir)
        return True
    except Exception as exc:
        log(f"note: no curves.png ({exc})")
        return False
