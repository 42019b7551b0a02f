"""What `prefpack train` says: every evaluation announced with its main metrics (in a batch log too), a time left
that counts the evaluations, and a summary table at the end whose train block averages the last interval."""

from __future__ import annotations

import json
import types

import pytest
from conftest import metrics_lines, prepare_hh_splits, tiny_llama

from prefpack.cli import main as cli_main
from prefpack.training.cadence import Cadence


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("report")
    stores = prepare_hh_splits(root, toy_tokenizers["llama"], hh_train, {"train": 12, "eval": 4})
    tiny_llama(toy_tokenizers["llama"], root / "policy", 0)
    return {"root": root, **stores}


def _args(world, run, *extra):
    return ["train", f"model.name_or_path={world['root'] / 'policy'}", f"data.train={world['train']}",
            f"data.eval={world['eval']}", f"run.output_dir={run}", "train.global_batch_pairs=4", "train.max_steps=5",
            "run.eval_every=2", "run.log_every=2", "run.plot=false", "optim.lr=1e-3", *extra]


def test_evaluations_are_announced_and_the_summary_is_a_table(world, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli_main(_args(world, run)) == 0  # stderr is not a terminal here: the batch-log path
    out, err = capsys.readouterr()
    evals = metrics_lines(run, "eval")
    assert [e["step"] for e in evals] == [0, 2, 4, 5]
    for when, e in zip(("before training", "at step 2/5", "at step 4/5", "after training"), evals):
        assert f"eval {when}: scoring the eval data" in err
        line = next(x for x in err.splitlines() if x.startswith(f"eval {when}: loss"))
        assert f"loss {e['loss']:.4g}" in line and f"acc {e['rewards/accuracies']:.4g}" in line
    assert "{" not in out  # no raw JSON dict
    assert "run finished: 5 steps" in out
    loss_row = next(x for x in out.splitlines() if x.startswith("loss") and len(x.split()) == 3)
    assert loss_row.split()[1:] == [f"{evals[0]['loss']:.4g}", f"{evals[-1]['loss']:.4g}"]
    # the train block: the mean of the last metrics line's interval (step 5 alone: 5 is logged as the last step)
    train = metrics_lines(run)
    assert "train (step 5)" in out and f"{train[-1]['loss']:.4g}" in out
    assert f"final model  {run / 'final'}" in out


def test_json_summary_holds_the_last_intervals_means(world, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli_main(_args(world, run, "train.max_steps=4", "run.log_every=4", "--json")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    interval = summary["train_interval"]
    assert (interval["first_step"], interval["last_step"]) == (1, 4)
    assert summary["train"]["loss"] == metrics_lines(run)[-1]["loss"]
    assert summary["eval"]["loss"] == metrics_lines(run, "eval")[-1]["loss"]
    assert summary["tokens"] > 0 and summary["seconds"] > 0


def _cadence(monkeypatch, now, **run):
    monkeypatch.setattr("prefpack.training.cadence.time.monotonic", lambda: now[0])
    run = types.SimpleNamespace(**{"log_every": 1, "eval_every": 10, "save_every": 0, **run})
    metrics = types.SimpleNamespace(log=lambda *a, **k: None, close=lambda **k: None)
    return Cadence(run, 100, metrics, types.SimpleNamespace(barrier=lambda: None), evaluate=lambda: {"loss": 1.0},
                   save=lambda done: None, log=lambda line: None)


def test_the_summary_interval_averages_the_steps_of_the_last_metrics_line(monkeypatch):
    cadence = _cadence(monkeypatch, [0.0], log_every=3, eval_every=0)
    cadence.begin(0, progress=False)
    losses = [0.9, 0.7, 0.5, 0.4, 0.1, float("nan"), 0.3]
    for step, loss in enumerate(losses, start=1):
        cadence.after_step(step, {"loss": loss, "tokens": 10.0 * step})
        if step == 3:
            assert cadence.interval == (1, 3, {"loss": pytest.approx(0.7), "tokens": pytest.approx(20.0)})
    cadence.after_step(8, {"loss": 0.2, "tokens": 1.0})  # not a metrics line (8 % 3): the interval stays
    assert cadence.interval[:2] == (4, 6)  # steps 4-6, a NaN step left out of the mean
    assert cadence.interval[2]["loss"] == pytest.approx((0.4 + 0.1) / 2)


def test_time_left_counts_the_evaluations_still_to_come(monkeypatch):
    now = [0.0]
    cadence = _cadence(monkeypatch, now)
    cadence.begin(0, progress=False)
    assert len(cadence.eval_seconds) == 1  # the before-training evaluation, before the clock starts
    cadence.eval_seconds = [30.0, 30.0]  # say it and the one at step 10 took 30 s each
    now[0] = 40.0
    # 10 steps in 40 s of which 30 s were the step-10 evaluation: 1 s a step, 90 steps left; evaluations still due
    # at steps 20..90 (8) and after training (1), 30 s each
    assert cadence._eta(10) == pytest.approx(90 * 1.0 + 9 * 30.0)


def test_eval_without_a_reference_names_ref_and_precompute(world, capsys):
    assert cli_main(["eval", "--model", str(world["root"] / "policy"), "--data", str(world["eval"])]) == 2
    err = capsys.readouterr().err
    assert "--ref MODEL" in err and "prefpack precompute-ref" in err and "reference.mode" not in err


def test_every_command_line_argument_says_what_it_is_for():
    from prefpack.cli import build_parser

    parser = build_parser()
    silent = [f"{name} {a.option_strings or a.dest}"
              for name, sub in parser._subparsers._group_actions[0].choices.items()
              for a in sub._actions if not a.help and "--help" not in a.option_strings]
    assert silent == []


def test_progress_off_a_terminal_is_plain_lines(monkeypatch):
    import io

    from prefpack.progress import progress

    stream = io.StringIO()  # a batch log: no carriage returns, a line per interval and one at the end
    assert list(progress(range(3), desc="reference log-probs", unit="batch", every_s=0.0, stream=stream)) == [0, 1, 2]
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 4
    assert lines[0].startswith("reference log-probs: 1/3 batches") and "eta" in lines[0]
    assert lines[-1].startswith("reference log-probs: 3/3 batches") and "done in" in lines[-1]


def test_eval_reports_progress_in_a_batch_log(world, capsys):
    assert cli_main(["eval", "--model", str(world["root"] / "policy"), "--ref", str(world["root"] / "policy"),
                     "--data", str(world["eval"]), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["pairs"] == 4
    done = [x for x in err.splitlines() if x.startswith("eval: ") and "done in" in x]
    assert len(done) == 1 and "micro-batches" in done[0]
    # scoring holds no gradients nor optimizer state, and its memory estimate says so
    estimate = next(x for x in err.splitlines() if x.startswith("estimated peak per device"))
    assert "gradients 0.0 MiB, optimizer state 0.0 MiB" in estimate
