"""A reward function is user code, contained (issue 50, item 3): each call is bounded by ``--reward-timeout`` (a
function asleep or spinning is stopped), SIGTERM while a call is stuck stops ``score`` at once with the scored chunks
kept and the resume hint, ``sys.exit`` is a one-line error, and only a finite float (a bool, an int in float range)
is taken as a score."""

from __future__ import annotations

import re
import signal
import time

import pytest
from test_rounds import overrides
from test_rounds import task as task  # noqa: F401 - a module-scoped fixture shared with test_rounds (its quickstart task)
from test_score import cli, make_samples
from test_stop_generate_score import _hint

from prefpack.rewards.rows import ScoreRow
from prefpack.rewards.scorers import RewardFunctionScorer, ScorerError

STUCK_AT_ROW_3 = """
import time

def reward(prompt, completion, row):
    if row["row"] == 3:
        {stuck}
    return float(len(completion) % 7)
"""


# at row 3 (the second chunk of 2 rows) a timer thread sends SIGTERM, as a scheduler would, while the call sleeps
SIGTERM_THEN_SLEEP = """import os, signal, threading
        if os.environ.get("STUCK"):
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
            time.sleep(3600)"""


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("prefpack score: error: --reward-fn"), err
    return err


@pytest.mark.parametrize("stuck", ["time.sleep(3600)", "while True:\n            pass"])
def test_a_call_that_never_returns_is_stopped_by_the_timeout(tmp_path, toy_tokenizers, capsys, stuck):
    samples, _ = make_samples(tmp_path, toy_tokenizers["neox"], n_rows=5, k=2)
    fn = tmp_path / "fn.py"
    fn.write_text(STUCK_AT_ROW_3.format(stuck=stuck))
    capsys.readouterr()
    t0 = time.monotonic()
    assert cli(samples, "-o", tmp_path / "out", "--reward-fn", f"{fn}:reward", "--reward-timeout", "0.5",
               "--checkpoint-rows", "2") == 2
    assert time.monotonic() - t0 < 10
    err = _one_line_error(capsys)
    assert f"--reward-fn {fn}:reward: row 3, completion 0: the function did not return within 0.5 s" in err, err
    assert "--reward-timeout" in err and not (tmp_path / "out").exists()
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert cli(samples, "-o", tmp_path / "out", "--reward-fn", f"{fn}:reward", "--reward-timeout", "-1") == 2
    assert capsys.readouterr().err.strip() == ("prefpack score: error: --reward-timeout must be a number of seconds >= 0 "
                                               "(0: no limit), not -1.0")


def test_sigterm_while_a_call_is_stuck_stops_score_keeping_the_scored_chunks(tmp_path, toy_tokenizers, capsys,
                                                                             monkeypatch):
    samples, _ = make_samples(tmp_path, toy_tokenizers["neox"], n_rows=6, k=2)
    fn = tmp_path / "fn.py"
    fn.write_text(STUCK_AT_ROW_3.format(stuck=SIGTERM_THEN_SLEEP))

    def argv(out):
        return ["score", str(samples), "-o", str(tmp_path / out), "--reward-fn", f"{fn}:reward",
                "--checkpoint-rows", "2", "--no-progress"]

    from prefpack.cli import main

    assert main(argv("whole")) == 0
    monkeypatch.setenv("STUCK", "1")
    capsys.readouterr()
    t0 = time.monotonic()
    assert main(argv("cut")) == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 10  # not the hour the function sleeps, nor the 60 s timeout
    what, command = _hint(capsys.readouterr().err)
    partial = tmp_path / "cut.partial"
    assert what == (f"prefpack score: terminated by signal 15: 2 of 6 rows are scored in {partial}; continue with the "
                    "same command:")
    assert command[1:] == argv("cut")
    assert sorted(p.name for p in partial.iterdir()) == ["manifest.json", "rows-000000000-000000002.json"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    monkeypatch.delenv("STUCK")
    assert main(command[1:]) == 0
    assert "2 rows already scored" in capsys.readouterr().err
    for name in ("tokens.bin", "index.bin"):
        assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


@pytest.mark.parametrize("body, expect", [
    ("import sys\n    sys.exit(0)", r"the function called sys\.exit\(0\)"),
    ("raise SystemExit('bye')", r"the function called sys\.exit\('bye'\)"),
    ("raise KeyboardInterrupt", "the function raised KeyboardInterrupt"),
    ("return 10 ** 400", r"the function returned int 1000+\.\.\., too large for a float"),
    ("return 10 ** 5000", r"the function returned int <int of 16610 bits>, too large for a float"),
])
def test_an_exit_or_a_value_that_is_no_finite_float_is_a_one_line_error(tmp_path, toy_tokenizers, capsys, body,
                                                                         expect):
    """(NaN, inf, a string, None: refused as before, in test_score.py.)"""
    samples, _ = make_samples(tmp_path, toy_tokenizers["neox"], n_rows=4, k=2)
    fn = tmp_path / "fn.py"
    fn.write_text(f"def reward(prompt, completion, row):\n    if row['row'] != 2:\n        return 1.0\n    {body}\n")
    capsys.readouterr()
    assert cli(samples, "-o", tmp_path / "out", "--reward-fn", f"{fn}:reward") == 2
    err = _one_line_error(capsys)
    assert re.search(f"--reward-fn {re.escape(str(fn))}:reward: row 2, completion 0: {expect}", err), err
    assert not (tmp_path / "out").exists()


def test_bools_and_ints_in_float_range_are_scores(tmp_path):
    fn = tmp_path / "fn.py"
    fn.write_text("def reward(prompt, completion):\n    return {'t': True, 'f': False, 'i': 2 ** 60}[completion]\n")
    scorer = RewardFunctionScorer(f"{fn}:reward", timeout=0.5)
    row = ScoreRow(row=0, prompt_ids=[1], completion_ids=[[2], [3], [4]], prompt="p", completions=["t", "f", "i"],
                   truncated=[False] * 3)
    assert scorer.score([row]) == [[1.0, 0.0, float(2 ** 60)]]
    assert all(type(v) is float for v in scorer.score([row])[0])


def test_the_import_calling_sys_exit_is_a_one_line_error(tmp_path):
    fn = tmp_path / "fn.py"
    fn.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ScorerError, match=r"importing .* failed: called sys.exit\(3\)"):
        RewardFunctionScorer(f"{fn}:reward")


def test_rounds_reward_timeout_reaches_the_scorer_and_is_checked(tmp_path):
    from prefpack.config import ConfigError, load_config
    from prefpack.rounds.plan import score_options

    fn = tmp_path / "fn.py"
    fn.write_text("def reward(prompt, completion):\n    return 1.0\n")
    keys = ["rounds.count=1", f"rounds.prompts={tmp_path}", f"rounds.reward_fn={fn}:reward"]
    from prefpack.rewards.user_call import DEFAULT_TIMEOUT

    assert score_options(load_config(None, keys), tmp_path, tmp_path, pairs=True).reward_timeout == DEFAULT_TIMEOUT
    assert DEFAULT_TIMEOUT == 60.0  # as `prefpack score --help` and docs/scoring.md say
    opts = score_options(load_config(None, [*keys, "rounds.reward_timeout=0.5"]), tmp_path, tmp_path, pairs=True)
    from prefpack.rewards.run import make_scorer

    assert opts.reward_timeout == 0.5 and make_scorer(opts).timeout == 0.5
    with pytest.raises(ConfigError, match="rounds.reward_timeout must be a number of seconds >= 0"):
        load_config(None, [*keys, "rounds.reward_timeout=-1"]).validate()


def test_a_rounds_run_resumes_under_another_reward_timeout_only(tmp_path):
    from prefpack.config import load_config, save_config
    from prefpack.rounds.phases import RoundsError, _open_run_dir

    keys = ["rounds.count=1", f"rounds.prompts={tmp_path}", "rounds.reward_fn=fn.py:reward",
            f"run.output_dir={tmp_path / 'run'}"]
    (tmp_path / "run").mkdir()
    save_config(load_config(None, keys), tmp_path / "run" / "config.yaml")
    assert _open_run_dir(load_config(None, [*keys, "rounds.reward_timeout=600"]), resume=True) == tmp_path / "run"
    with pytest.raises(RoundsError, match="the config differs"):
        _open_run_dir(load_config(None, [*keys, "rounds.min_gap=0.5"]), resume=True)


def test_a_signal_outside_a_reward_functions_call_still_lets_the_chunk_in_flight_finish(tmp_path, toy_tokenizers):
    """A scorer that is not user code (a reward model) is never cut off: its chunk is scored and kept."""
    from prefpack.rewards.run import ScoreOptions, score
    from prefpack.rewards.scorers import Scorer
    from prefpack.stop_signal import Terminated

    class Signalling(Scorer):
        name, calls = "model", 0

        def identity(self) -> dict:
            return {"scorer": self.name}

        def score(self, rows):
            self.calls += 1
            if self.calls == 2:
                signal.raise_signal(signal.SIGTERM)
            return [[1.0] * len(r.completions) for r in rows]

    samples, _ = make_samples(tmp_path, toy_tokenizers["neox"], n_rows=6, k=2)
    opts = ScoreOptions(input=str(samples), output=str(tmp_path / "out"), reward_model="unused", checkpoint_rows=2,
                        progress=False)
    with pytest.raises(Terminated, match="terminated by signal 15: 4 of 6 rows are scored"):
        score(opts, log=lambda _: None, scorer=Signalling())


def test_a_function_that_swallows_the_timeout_still_times_out_and_a_thread_checks_after_the_call():
    import threading

    from prefpack.rewards.user_call import CallFailed, call_contained

    def swallows_once():
        try:
            time.sleep(3600)
        except BaseException:  # a bare `except:` in the user's code
            pass
        return 1.0

    with pytest.raises(CallFailed, match=r"did not return within 0\.2 s") as failed:
        call_contained(swallows_once, 0.2)
    assert failed.value.timed_out and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert call_contained(lambda: 2.0, 0.2) == 2.0
    outcome = []

    def on_a_thread():  # no signal reaches a thread: the call runs to its end, then the limit is checked
        try:
            call_contained(lambda: time.sleep(0.3), 0.1)
        except CallFailed as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=on_a_thread)
    thread.start()
    thread.join()
    assert len(outcome) == 1 and "over the 0.1 s limit" in outcome[0] and "cannot be cut off" in outcome[0]


@pytest.mark.parametrize("body, code", [("import sys\n        sys.exit(0)", 2),
                                        (SIGTERM_THEN_SLEEP, 128 + signal.SIGTERM)])
def test_a_rounds_reward_function_that_exits_or_hangs_under_sigterm_stops_the_run(  # noqa: F811
        task, tmp_path, capsys, monkeypatch, body, code):
    """Once a round's samples are drawn: sys.exit(0) was a silent exit 0; a SIGTERM during a stuck call was lost."""
    from prefpack.cli import main

    fn = tmp_path / "fn.py"
    fn.write_text(STUCK_AT_ROW_3.format(stuck=body))
    monkeypatch.setenv("STUCK", "1")
    capsys.readouterr()
    t0 = time.monotonic()
    assert main(["train", *overrides(task, str(tmp_path / "run"), f"rounds.reward_fn={fn}:reward"),
                 "--no-progress"]) == code
    assert time.monotonic() - t0 < 60
    err = capsys.readouterr().err.strip().splitlines()
    if code == 2:
        assert err[-1].endswith(f"--reward-fn {fn}:reward: row 3, completion 0: the function called sys.exit(0)"), err
    else:
        assert "terminated by signal 15" in err[-2] and "--resume" in err[-1], err[-2:]
        assert (tmp_path / "run" / "rounds" / "001" / "samples.jsonl").is_file()  # kept: --resume scores them
