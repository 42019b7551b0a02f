"""SIGTERM or Ctrl-C during `prefpack generate` / `prefpack score` (issue 40): the batch in flight is finished, the
files end at a whole row or checkpoint, the command prints what was done and the command that continues it and exits
128+signum; run again, it writes what an uninterrupted run writes. A torn last line (kill -9 mid-write) is dropped,
said, and redone. The signal is sent from inside the engine / the reward function, in process."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time

import pytest
from conftest import tiny_llama, write_jsonl
from test_score import make_samples

from prefpack.cli import main
from prefpack.generation.hf_engine import TransformersEngine
from prefpack.generation.server import VllmServer
from prefpack.stop_signal import STOP_SIGNALS, StopSignal, Terminated


def _hint(err: str) -> tuple[str, list[str]]:
    lines = err.strip().splitlines()
    return lines[-2], shlex.split(lines[-1])


def test_sigterm_mid_generate_stops_at_a_whole_batch_and_the_same_command_continues(
        tmp_path, toy_tokenizers, monkeypatch, capsys, one_thread):
    rows = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"Question {i}?"}]}
                                                    for i in range(5)])
    model = tiny_llama(toy_tokenizers["chatml"], tmp_path / "model", 0)

    def argv(out):
        return ["generate", str(rows), "--model", str(model), "--tokenizer", str(toy_tokenizers["chatml"]), "-o", str(tmp_path / out), "--n", "2",
                "--max-new-tokens", "3", "--batch-size", "2", "--seed", "5"]

    assert main(argv("whole.jsonl")) == 0
    generate, calls = TransformersEngine.generate, []

    def terminated_in_the_second_batch(self, jobs, settings):
        calls.append(len(jobs))
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's notice, while the batch runs
        return generate(self, jobs, settings)

    monkeypatch.setattr(TransformersEngine, "generate", terminated_in_the_second_batch)
    capsys.readouterr()
    assert main(argv("cut.jsonl")) == 128 + signal.SIGTERM
    assert calls == [2, 2]  # the batch in flight finished, the third never started
    what, command = _hint(capsys.readouterr().err)
    assert what == (f"prefpack generate: terminated by signal 15: 4 of 5 prompts are sampled in {tmp_path / 'cut.jsonl'}"
                    "; continue with the same command:")
    assert command[1:] == argv("cut.jsonl")
    lines = (tmp_path / "cut.jsonl").read_bytes().split(b"\n")
    assert len(lines) == 5 and lines[-1] == b""  # 4 whole rows
    with open(tmp_path / "cut.jsonl", "ab") as fh:
        fh.write(lines[0][:17])  # and a torn line, as a kill -9 mid-write leaves
    monkeypatch.setattr(TransformersEngine, "generate", generate)
    assert main(command[1:]) == 0
    assert "its last line was cut off by a kill mid-write (17 bytes); dropped" in capsys.readouterr().err
    assert (tmp_path / "cut.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()


SIGNALLING_REWARD = """
import os, signal

def reward(prompt, completion, row):
    if os.environ.get("SIGNAL_AT_ROW") == str(row["row"]):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while this chunk is scored
    return float(len(completion) % 7) + 0.5 * row["label"]
"""


def test_ctrl_c_mid_score_keeps_the_scored_chunks_and_the_same_command_continues(tmp_path, toy_tokenizers,
                                                                               monkeypatch, capsys):
    samples, _ = make_samples(tmp_path, toy_tokenizers["neox"], n_rows=9)
    fn = tmp_path / "fn.py"
    fn.write_text(SIGNALLING_REWARD)

    def argv(out):
        return ["score", str(samples), "-o", str(tmp_path / out), "--reward-fn", f"{fn}:reward",
                "--checkpoint-rows", "2", "--no-progress"]

    assert main(argv("whole")) == 0
    monkeypatch.setenv("SIGNAL_AT_ROW", "3")  # in the chunk of rows 2-3: the call is cut off, the chunk dropped
    capsys.readouterr()
    assert main(argv("cut")) == 130
    what, command = _hint(capsys.readouterr().err)
    partial = tmp_path / "cut.partial"
    assert what == (f"prefpack score: terminated by signal 2: 2 of 9 rows are scored in {partial}; continue with the "
                    "same command:")
    assert command[1:] == argv("cut") and not (tmp_path / "cut").exists()
    assert sorted(p.name for p in partial.iterdir()) == ["manifest.json", "rows-000000000-000000002.json"]
    (partial / ".rows-000000002-000000004.json.tmp-99").write_text('{"scores": [[1')  # a kill -9 mid-write
    monkeypatch.delenv("SIGNAL_AT_ROW")
    assert main(command[1:]) == 0
    err = capsys.readouterr().err
    assert "a checkpoint a kill left half-written; removed" in err and "2 rows already scored" in err
    for name in ("tokens.bin", "index.bin"):
        assert (tmp_path / "cut" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    whole = (tmp_path / "whole" / "meta.json").read_text()  # the same scores; the meta names its own command
    assert (tmp_path / "cut" / "meta.json").read_text() == whole.replace(str(tmp_path / "whole"), str(tmp_path / "cut"))


def test_a_signal_while_a_vllm_server_starts_stops_the_server(tmp_path):
    hangs = VllmServer(f"{sys.executable} -c 'import time; time.sleep(60)'", model="m", log_path=tmp_path / "a.log",
                       start_timeout=30)
    t0 = time.monotonic()
    with StopSignal(signums=STOP_SIGNALS) as stop:
        stop.signum = signal.SIGTERM  # as if received while the server loads
        with pytest.raises(Terminated, match="was starting, and was stopped"):
            hangs.start(stop)
        stop.acted = True
    assert hangs.proc.poll() is not None and time.monotonic() - t0 < 10  # stopped, not left holding its GPUs
