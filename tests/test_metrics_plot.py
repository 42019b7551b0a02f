"""Tests for prefpack.metrics (JSONL logger, truncation on resume) and prefpack.plot (curves.png)."""

from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from prefpack.metrics import MetricsLogger, read_metrics
from prefpack.plot import PlotError, plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _drop_time(records):
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def test_log_and_read_back(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, tensorboard=False) as logger:
        logger.log(1, {"loss": torch.tensor(0.5), "lr": np.float32(1e-6), "tokens/s": 100, "ok": True})
        logger.log(1, {"loss": 0.25}, split="eval")
        assert logger.notice is None
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    records = read_metrics(run)
    assert records == read_metrics(run / "metrics.jsonl")
    first = records[0]
    assert list(first)[:3] == ["step", "split", "time"]
    assert first["step"] == 1 and first["split"] == "train" and isinstance(first["time"], float)
    assert first["loss"] == 0.5 and type(first["lr"]) is float and first["lr"] == pytest.approx(1e-6)
    assert first["tokens/s"] == 100.0 and first["ok"] == 1.0
    assert records[1]["split"] == "eval" and records[1]["loss"] == 0.25
    # Appends after reopening (a resumed run keeps its history).
    MetricsLogger(run, tensorboard=False).log(2, {"loss": 0.4})
    assert [r["step"] for r in read_metrics(run)] == [1, 1, 2]


def test_bad_inputs(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match="reserved"):
        logger.log(1, {"step": 3.0})
    with pytest.raises(TypeError, match="metric 'name': expected a number"):
        logger.log(1, {"name": "abc"})
    with pytest.raises(TypeError, match="step must be an int"):
        logger.log(1.5, {"loss": 1.0})


def test_nan_and_inf_are_null(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(3, {"loss": float("nan"), "grad_norm": float("inf"), "lr": torch.tensor(-math.inf), "x": 1.0})
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line
    record = json.loads(line)  # strict JSON
    assert record["loss"] is None and record["grad_norm"] is None and record["lr"] is None and record["x"] == 1.0


def test_truncate_after(tmp_path):
    # An uninterrupted run logs steps 1..6.
    full = MetricsLogger(tmp_path / "full", tensorboard=False)
    for step in range(1, 7):
        full.log(step, {"loss": 1.0 / step})
        if step % 3 == 0:
            full.log(step, {"loss": 2.0 / step}, split="eval")
    full.close()

    # A crashed run got to step 5 (plus half a line) after its checkpoint at step 3, then resumes from 3.
    run = tmp_path / "resumed"
    logger = MetricsLogger(run, tensorboard=False)
    for step in range(1, 6):
        logger.log(step, {"loss": 1.0 / step})
        if step % 3 == 0:
            logger.log(step, {"loss": 2.0 / step}, split="eval")
    logger.jsonl._fh.write('{"step": 6, "split": "tr')  # torn line, as a crash mid-write leaves it
    logger.jsonl._fh.flush()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 3, 4, 5]  # readers skip the torn line

    assert logger.truncate_after(3) == 3  # steps 4 and 5 plus the torn line
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 3]
    assert not list(run.glob(".*tmp*"))
    for step in range(4, 7):  # the same logger keeps appending to the new file
        logger.log(step, {"loss": 1.0 / step})
        if step % 3 == 0:
            logger.log(step, {"loss": 2.0 / step}, split="eval")
    logger.close()
    assert _drop_time(read_metrics(run)) == _drop_time(read_metrics(tmp_path / "full"))

    assert MetricsLogger(tmp_path / "empty", tensorboard=False).truncate_after(0) == 0  # no file yet


def test_disabled_is_a_no_op(tmp_path):
    logger = MetricsLogger(tmp_path / "rank1", enabled=False)
    logger.log(1, {"loss": 1.0})
    assert logger.truncate_after(0) == 0
    logger.close()
    assert not (tmp_path / "rank1").exists()


def test_tensorboard_missing_is_refused_when_asked_for(tmp_path, monkeypatch):
    from prefpack.metrics import MetricsSetupError

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(MetricsSetupError, match="pip install tensorboard"):  # as wandb is (issue 51)
        MetricsLogger(tmp_path, tensorboard=True)
    assert MetricsLogger(tmp_path / "b", tensorboard=False).notice is None
    quiet = MetricsLogger(tmp_path / "c", tensorboard="auto")  # the default report_to: no notice, no writer
    assert quiet.notice is None and not quiet.tensorboard_active


def test_default_report_to_is_quiet_without_tensorboard(tmp_path, monkeypatch):
    """A user who did not ask for TensorBoard hears nothing about it; one who asked by name hears why not."""
    from prefpack.config import load_config

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    default = MetricsLogger.from_config(load_config(None, [f"run.output_dir={tmp_path / 'a'}"]))
    assert default.notice is None and not default.tensorboard_active
    from prefpack.metrics import MetricsSetupError, check_report_to

    named = load_config(None, [f"run.output_dir={tmp_path / 'b'}", "run.report_to=tensorboard"])
    for start in (lambda: MetricsLogger.from_config(named), lambda: check_report_to(named.run)):
        with pytest.raises(MetricsSetupError) as info:  # refused in one line, as wandb without wandb
            start()
        assert "\n" not in str(info.value) and "pip install tensorboard" in str(info.value)
        assert "remove 'tensorboard' from run.report_to" in str(info.value)


def test_tensorboard_writer_calls(tmp_path, monkeypatch):
    calls = []

    class FakeWriter:
        def __init__(self, log_dir, **kwargs):
            calls.append(("init", kwargs.get("purge_step")))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    logger = MetricsLogger(tmp_path, tensorboard=True)
    assert logger.notice is None and logger.tensorboard_active
    logger.log(1, {"loss": 1.0, "grad_norm": float("nan")})
    logger.log(2, {"loss": 0.5}, split="eval")
    logger.truncate_after(1)
    logger.log(2, {"loss": 0.7})
    logger.close()
    assert calls == [("init", None), ("train/loss", 1.0, 1), ("eval/loss", 0.5, 2), ("close",),
                     ("init", 2), ("train/loss", 0.7, 2), ("close",)]


def _fake_run(run_dir):
    logger = MetricsLogger(run_dir, tensorboard=False)
    for step in range(1, 21):
        logger.log(step, {
            "loss": 0.7 - 0.01 * step, "rewards/accuracies": min(1.0, 0.5 + 0.02 * step),
            "rewards/margins": 0.05 * step, "rewards/chosen": 0.02 * step, "rewards/rejected": -0.03 * step,
            "logps/chosen": -100.0 + step, "logps/rejected": -110.0 - step, "lr": 1e-6 * min(1.0, step / 5),
            "grad_norm": float("nan") if step == 7 else 1.0 / step, "tokens/s": 1000.0 + step,
        })
        if step % 10 == 0:
            logger.log(step, {"loss": 0.69 - 0.01 * step, "rewards/accuracies": 0.6}, split="eval")
    logger.close()


def test_plot_writes_png(tmp_path):
    run = tmp_path / "run"
    _fake_run(run)
    out = plot_run(run)
    assert out == run / "curves.png"
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    assert not list(run.glob(".*tmp*"))


def test_plot_some_metrics_only(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"loss": 1.0})
    logger.log(1, {"loss": 0.9}, split="eval")
    logger.close()
    out = plot_run(tmp_path, out=tmp_path / "sub" / "c.png")
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_plot_errors(tmp_path, monkeypatch):
    with pytest.raises(PlotError, match="no metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match="no records"):
        plot_run(tmp_path)
    MetricsLogger(tmp_path, tensorboard=False).log(1, {"something_else": 1.0})
    with pytest.raises(PlotError, match="none of the plotted metrics"):
        plot_run(tmp_path)
    MetricsLogger(tmp_path, tensorboard=False).log(2, {"loss": 1.0})
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(PlotError, match=r"pip install prefpack\[plot\]"):
        plot_run(tmp_path)


def test_a_full_disk_names_the_metrics_file(tmp_path, monkeypatch):
    import builtins
    import errno

    from prefpack.metrics import MetricsLogger, MetricsWriteError

    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"loss": 0.5})
    logger.close()
    real_open = builtins.open

    def full(path, *args, **kwargs):
        if str(path).endswith("metrics.jsonl") or ".metrics.jsonl.tmp-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full)
    logger = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(MetricsWriteError, match=r"cannot write .*metrics.jsonl: No space left on device"):
        logger.log(2, {"loss": 0.4})
    with pytest.raises(MetricsWriteError, match="it is unchanged"):
        logger.truncate_after(0)
    monkeypatch.setattr(builtins, "open", real_open)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not list(tmp_path.glob(".metrics.jsonl.tmp-*"))


def test_plot_draws_each_source_of_a_mixture(tmp_path):
    """A mixture's train lines carry NAME/pairs and NAME/loss, ...: each source is its own train curve, beside the
    run's total, and a data.eval map's stores their own markers (a source and its eval store share a color)."""
    from prefpack.plot import panels, train_source_names

    lines = [
        {"step": 0, "split": "eval", "loss": 0.69, "code/loss": 0.7, "code/rewards/accuracies": 0.5},
        {"step": 1, "split": "train", "loss": 0.68, "rewards/accuracies": 0.5, "lr": 1e-3, "code/pairs": 3.0,
         "code/loss": 0.67, "code/rewards/accuracies": 0.66, "chat/pairs": 1.0, "chat/loss": 0.7,
         "chat/rewards/accuracies": 0.0},
        {"step": 2, "split": "train", "loss": 0.6, "rewards/accuracies": 0.75, "lr": 1e-3, "code/pairs": 4.0,
         "code/loss": 0.6, "code/rewards/accuracies": 0.75, "chat/pairs": 0.0},  # chat not drawn this step
        {"step": 3, "split": "train", "loss": 0.5, "rewards/accuracies": 1.0, "lr": 1e-3, "code/pairs": 2.0,
         "code/loss": None, "code/rewards/accuracies": 1.0, "chat/pairs": 2.0, "chat/loss": 0.5,
         "chat/rewards/accuracies": 1.0},
        {"step": 3, "split": "eval", "loss": 0.55, "code/loss": 0.5, "code/rewards/accuracies": 0.75},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = read_metrics(tmp_path)
    assert train_source_names(records) == ["code", "chat"]
    drawn = {title: [(split, label, steps, values) for _, split, label, steps, values in ls]
             for title, ls in panels(records)}
    assert drawn["loss"] == [
        ("train", "train", [1, 2, 3], [0.68, 0.6, 0.5]),
        ("eval", "eval", [0, 3], [0.69, 0.55]),
        ("train", "train code", [1, 2], [0.67, 0.6]),  # the null at step 3 left out
        ("train", "train chat", [1, 3], [0.7, 0.5]),  # no point where the source gave no pair
        ("eval", "eval code", [0, 3], [0.7, 0.5]),
    ]
    assert drawn["reward accuracy"] == [
        ("train", "train", [1, 2, 3], [0.5, 0.75, 1.0]),
        ("train", "train code", [1, 2, 3], [0.66, 0.75, 1.0]),
        ("train", "train chat", [1, 3], [0.0, 1.0]),
        ("eval", "eval code", [0, 3], [0.5, 0.75]),
    ]
    assert [label for _, label, *_ in drawn["learning rate"]] == ["train"]  # NAME/pairs itself is no curve
    assert set(drawn) == {"loss", "reward accuracy", "learning rate"}
    pytest.importorskip("matplotlib")
    assert plot_run(tmp_path).read_bytes().startswith(PNG_SIGNATURE)


def test_plot_title_names_the_run_and_entropy_gets_a_panel(tmp_path):
    """The title says what was trained (loss terms, model, data) from config.yaml, not only the folder's name; the
    policy's token entropy, logged every step, is drawn."""
    from prefpack.plot import panels, run_title

    (tmp_path / "config.yaml").write_text("model: {name_or_path: /m/qwen-0.5b}\ndata: {train: /s/hh-train}\n"
                                          "loss: {terms: [{name: sigmoid, weight: 1.0}, {name: nll, weight: 0.2}]}\n")
    assert run_title(tmp_path) == f"{tmp_path.name}: sigmoid + nll on qwen-0.5b, data hh-train"
    (tmp_path / "config.yaml").write_text("model: {name_or_path: m/init}\ndata: {train: null}\nloss: {terms: "
                                          "[{name: sigmoid}]}\nrounds: {count: 2, prompts: runs/prompts.jsonl}\n")
    assert run_title(tmp_path) == f"{tmp_path.name}: sigmoid on init, data 2 on-policy rounds of prompts.jsonl"
    (tmp_path / "config.yaml").write_text("not: [valid")
    assert run_title(tmp_path) == tmp_path.name
    records = [{"step": 1, "split": "train", "loss": 0.5, "entropy/chosen": 2.0, "entropy/rejected": 2.5}]
    drawn = dict(panels(records))
    assert [label for _, _, label, *_ in drawn["token entropy (policy, scored tokens)"]] == ["train", "train"]


def test_a_rounds_runs_reward_panel_names_each_line_apart():
    """The per-round panel holds the samples' mean, max, min and the held-out prompts' mean: four legend entries,
    none repeating another (the held-out mean once read "mean (round)" twice)."""
    from prefpack.plot import legend_label, panels

    records = [{"step": s, "split": "round", "reward/mean": 0.1 * r, "reward/max": 1.0, "reward/min": 0.0,
                "eval_reward/mean": 0.2 * r} for r, s in enumerate((0, 8))]
    (title, lines), = panels(records)
    keys = {k for k, *_ in lines}
    labels = [legend_label(k, where, keys) for k, _, where, *_ in lines]
    assert labels == ["mean (round)", "max (round)", "min (round)", "held-out mean (round)"]
    assert legend_label("loss", "eval code", {"loss"}) == "eval code"
