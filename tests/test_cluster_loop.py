"""A run on a cluster: SIGTERM (checkpoint, the resume command, exit 143, resume equal to an uninterrupted run),
non-finite steps (skipped, counted, a diverged run stopped without a final model), and strict JSON output."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import signal
import time
import types

import pytest
import test_crash
import torch
from test_crash import assert_same_final_weights, command, leftovers, overrides, start

import prefpack.training.loop as loop_module
from prefpack.cli import main as cli_main
from prefpack.commands import json_line
from prefpack.config import load_config
from prefpack.objectives.pairs import PairTask
from prefpack.training import train
from prefpack.training.checkpoint import checkpoint_step, list_checkpoints
from prefpack.training.guards import NonFiniteError

pytestmark = pytest.mark.usefixtures("one_thread")
world = test_crash.world  # the same prepared store, tiny model and uninterrupted run


def wait_for_metrics(proc, run_dir, lines=1, timeout=120.0) -> None:
    end = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < end and proc.poll() is None:
        if path.is_file() and len(path.read_text().splitlines()) >= lines:
            return
        time.sleep(0.002)
    raise AssertionError(f"no metrics line appeared ({proc.poll()})")


@pytest.mark.parametrize("lines", [1, 3])
def test_sigterm_checkpoints_prints_the_resume_command_and_exits_143(world, tmp_path, lines):
    err = ""
    for attempt in range(3):  # a run that ended before the signal arrived is the test's race: try again
        run = tmp_path / f"run{attempt}"
        proc = start(command(world["root"], run, "run.save_every=0", "run.log_every=1"))
        wait_for_metrics(proc, run, lines)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        if proc.returncode != 0:
            break
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err
    assert "prefpack train: terminated by signal 15 after step" in err
    step = int(err.split("after step ")[1].split(";")[0])
    assert [checkpoint_step(c) for c in list_checkpoints(run)] == [step]  # save_every=0: the signal's own
    assert f"the last checkpoint is step {step} " in err
    assert leftovers(run) == []
    words = shlex.split(err.split("continue with:")[1].strip().splitlines()[0])
    assert words[-1] == "--resume"
    assert cli_main(words[1:]) == 0
    assert_same_final_weights(world["full"], run)


def test_sigterm_handler_is_restored_after_training(world, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    train(load_config(None, overrides(world["root"], tmp_path / "r") + ["train.max_steps=2"]), progress=False,
          log=lambda m: None)
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("clip", ["null", "1.0"])
def test_a_huge_lr_stops_with_a_message_and_saves_no_final_model(world, tmp_path, clip):
    run = tmp_path / "run"
    logs = []
    with pytest.raises(NonFiniteError, match=r"stopped at step \d+: 5 steps in a row.*optim.lr=1000.*rows"):
        train(load_config(None, overrides(world["root"], run) + ["optim.lr=1e3", "run.save_every=0",
                                                                  "train.max_steps=20", f"optim.max_grad_norm={clip}"]),
              progress=False, log=logs.append)
    assert not (run / "final").exists()
    assert any("non-finite" in m and "skipped" in m for m in logs)
    assert list_checkpoints(run) == []


def test_the_cli_reports_a_diverged_run_without_a_traceback(world, tmp_path, capsys):
    args = ["train", *overrides(world["root"], tmp_path / "run"), "optim.lr=1e3", "train.max_steps=20",
            "--no-progress"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "stopped at step" in err and re.search(r"warning: step \d+: non-finite", err)


def _poisoned_run(world, run, monkeypatch, poison_step: int, skip_by_optimizer: bool) -> tuple[list[dict], list[str]]:
    """A run whose step ``poison_step`` (from 1) has a NaN loss, or (``skip_by_optimizer``) whose optimizer simply
    skips that step: the two must end with the same weights."""
    seen = {"step": 0}
    begin, loss, make = PairTask.begin_step, PairTask.loss, loop_module.make_optimizer

    def counting_begin(self, *a, **k):
        seen["step"] += 1
        return begin(self, *a, **k)

    def poisoned_loss(self, *a, **k):
        out = loss(self, *a, **k)
        if seen["step"] == poison_step and not skip_by_optimizer:
            return dataclasses.replace(out, loss=out.loss * float("nan"))
        return out

    def skipping_optimizer(params, cfg):
        opt = make(params, cfg)
        real = opt.step
        opt.step = types.MethodType(lambda _self, *a, **k: None if seen["step"] == poison_step else real(*a, **k),
                                    opt)  # a method: the lr scheduler wraps it
        return opt

    monkeypatch.setattr(PairTask, "begin_step", counting_begin)
    monkeypatch.setattr(PairTask, "loss", poisoned_loss)
    if skip_by_optimizer:
        monkeypatch.setattr(loop_module, "make_optimizer", skipping_optimizer)
    logs = []
    train(load_config(None, overrides(world["root"], run) + ["run.save_every=0", "optim.schedule=constant"]),
          progress=False, log=logs.append)
    monkeypatch.undo()
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()], logs


def test_a_poisoned_batch_skips_its_step_and_equals_a_run_without_that_update(world, tmp_path, monkeypatch):
    poisoned, logs = _poisoned_run(world, tmp_path / "p", monkeypatch, 3, skip_by_optimizer=False)
    skipped, _ = _poisoned_run(world, tmp_path / "s", monkeypatch, 3, skip_by_optimizer=True)
    assert any("step 3: non-finite loss" in m for m in logs)
    assert [r["skipped_steps"] for r in poisoned if "skipped_steps" in r][-1] == 1
    assert_same_final_weights(tmp_path / "p", tmp_path / "s")
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(str(tmp_path / "p" / "final" / "model.safetensors")).values())


def test_json_lines_never_hold_bare_nan():
    line = json_line({"train": {"loss": float("nan"), "g": float("inf"), "ok": 1.5}, "eval": None})
    assert json.loads(line) == {"train": {"loss": None, "g": None, "ok": 1.5}, "eval": None}


def test_progress_off_a_terminal_is_one_plain_line_per_logged_step(world, tmp_path, capsys):
    train(load_config(None, overrides(world["root"], tmp_path / "r") + ["train.max_steps=4", "run.log_every=2"]),
          progress=True, log=lambda m: None)
    err = capsys.readouterr().err
    frames = err.split("\r")  # transformers' own loading bars are not prefpack's: only the training bar is checked
    assert not any(f.startswith("train:") and "%|" in f for f in frames)
    lines = [line for line in err.splitlines() if line.startswith("train: step")]
    assert [line.split(",")[0] for line in lines] == ["train: step 2/4", "train: step 4/4"]
    assert "loss " in lines[0] and "acc " in lines[0] and "tokens/s " in lines[0] and "eta " in lines[0]


def test_progress_on_a_terminal_keeps_the_bar_and_no_progress_is_silent(world, tmp_path, capsys, monkeypatch):
    import prefpack.training.cadence as cadence

    monkeypatch.setattr(cadence, "_is_terminal", lambda stream: True)
    train(load_config(None, overrides(world["root"], tmp_path / "a") + ["train.max_steps=2"]), progress=True,
          log=lambda m: None)
    err = capsys.readouterr().err
    assert any(f.startswith("train:") and "%|" in f for f in err.split("\r")) and "train: step" not in err
    monkeypatch.undo()
    train(load_config(None, overrides(world["root"], tmp_path / "b") + ["train.max_steps=2"]), progress=False,
          log=lambda m: None)
    err = capsys.readouterr().err
    assert "train: step" not in err and not any(f.startswith("train:") for f in err.split("\r"))


def test_checkpoints_are_on_by_default_every_500_steps():
    from prefpack.distributed import Dist
    from prefpack.training.cadence import Cadence

    cfg = load_config(None, [])
    assert cfg.run.save_every == 500 and cfg.run.keep_checkpoints == 2

    class Metrics:
        def log(self, *a, **k):
            pass

    saved = []
    cadence = Cadence(cfg.run, 1200, Metrics(), Dist(), evaluate=None, save=saved.append)
    for done in range(1, 1201):
        cadence.after_step(done, {"loss": 0.5})
    assert saved == [500, 1000]  # the last step's state is the final model
