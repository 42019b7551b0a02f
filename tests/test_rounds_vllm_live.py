"""Rounds in one process sampling through vLLM servers that live across rounds (tests/vllm_stub.py's stand-in, on
127.0.0.1): each round's policy is given to every server in place before it samples (the full weights reloaded from
the folder the round's policy was exported to; LoRA: the round's adapter loaded at run time), under a version each
server confirms and each round's samples record; prompts are dealt over two servers; a server prefpack starts is
started once for every round; a server that cannot take the weights stops the run in one line."""

from __future__ import annotations

import sys

import pytest
import torch

from prefpack.config import load_config
from prefpack.generation.engine import GenerationError
from prefpack.rounds import RoundsInterrupted, run_rounds
from prefpack.rounds.sampler import weights_version
from tests.conftest import quiet, read_jsonl
from tests.test_rounds import overrides, task  # noqa: F401 - task: the quickstart fixture, built for this module too
from tests.vllm_stub import StubServer

ROUNDS = 3
VLLM = (f"rounds.count={ROUNDS}", "rounds.steps_per_round=2", "rounds.eval_prompts=null", "rounds.engine=vllm",
        "rounds.max_new_tokens=4")


def rounds_config(task, run: str, *extra: str):  # noqa: F811
    return load_config(None, overrides(task, run, *VLLM, *extra))


@pytest.fixture
def servers():
    started = [StubServer().start(), StubServer().start()]
    yield started
    for s in started:
        s.shutdown()


def reloads(server) -> list[tuple[str, str]]:
    return [tuple(body["args"]) for path, body in server.admin
            if path == "/collective_rpc" and body["method"] == "prefpack_reload_weights"]


def test_two_live_servers_take_each_rounds_weights_in_place(task, servers, one_thread):  # noqa: F811
    run = task / "vllm_live"
    urls = ",".join(s.url for s in servers)
    result = run_rounds(rounds_config(task, "vllm_live", f"rounds.vllm_url=[{urls}]"), log=quiet, progress=False)
    assert len(result.rounds) == ROUNDS
    folders = [str(task / "init")] + [str(run / "rounds" / f"{r:03d}" / "train" / "final") for r in range(1, ROUNDS)]
    versions = [weights_version(run, r) for r in range(ROUNDS)]
    for server in servers:  # every server reloaded every round's policy, in order, each under its round's version
        assert reloads(server) == list(zip(folders, versions))
        assert server.version == versions[-1]
        assert [p for p, _ in server.admin].count("/reset_prefix_cache") == ROUNDS
    # the prompts dealt over both servers, each request the prompt's own seeded one, so every row as one server's
    assert all(len(s.requests) > 0 for s in servers)
    for r in range(ROUNDS):  # every sample names the weights that made it
        assert samples_meta(run, r)["generation"]["weights_version"] == versions[r]
    from prefpack.generation.engine import prompt_seed
    from tests.vllm_stub import stub_choice

    for row in read_jsonl(run / "rounds" / "002" / "samples.jsonl"):  # round 2 samples with seed rounds.seed + 1
        body = next(b for s in servers for b in s.requests
                    if b["prompt"] == row["prompt_ids"] and b["seed"] == prompt_seed(1, row["row"]))
        assert row["completion_ids"] == [stub_choice(body, k)["token_ids"] for k in range(body["n"])]


def samples_meta(run, r: int) -> dict:
    import json

    return json.loads((run / "rounds" / f"{r + 1:03d}" / "samples.meta.json").read_text())


def test_a_server_prefpack_starts_serves_every_round_from_one_start(task, one_thread):  # noqa: F811
    from pathlib import Path

    run = task / "vllm_command"
    stub = Path(__file__).resolve().parent / "vllm_stub.py"
    command = f"{sys.executable} {stub} --port {{port}}"
    result = run_rounds(rounds_config(task, "vllm_command", f"rounds.vllm_command='{command}'"), log=quiet,
                        progress=False)
    assert len(result.rounds) == ROUNDS
    log = (run / "sampler.vllm.log").read_text()
    assert log.count("stub server started") == 1  # one start for every round (a round per training: one each)
    for r in range(ROUNDS):
        assert samples_meta(run, r)["generation"]["weights_version"] == weights_version(run, r)


def test_lora_rounds_load_each_rounds_adapter_into_the_live_server(task, servers, one_thread):  # noqa: F811
    run = task / "vllm_lora"
    server = servers[0]
    run_rounds(rounds_config(task, "vllm_lora", f"rounds.vllm_url={server.url}", "lora.enabled=true", "lora.r=4",
                             "reference.mode=adapter"), log=quiet, progress=False)
    loads = [body for path, body in server.admin if path == "/v1/load_lora_adapter"]
    paths = [str(run / "rounds" / "001" / "start_adapter")] + \
        [str(run / "rounds" / f"{r:03d}" / "train" / "final" / "adapter") for r in range(1, ROUNDS)]
    assert [b["lora_path"] for b in loads] == paths
    assert [b["lora_name"] for b in loads] == [f"prefpack-{weights_version(run, r)}" for r in range(ROUNDS)]
    assert list(server.adapters) == [f"prefpack-{weights_version(run, ROUNDS - 1)}"]  # the earlier ones unloaded
    assert {b["model"] for b in server.requests} == {f"prefpack-{weights_version(run, r)}" for r in range(ROUNDS)}


def test_a_server_that_cannot_take_the_weights_stops_the_run_in_one_line(task, one_thread):  # noqa: F811
    server = StubServer(extension=False).start()
    try:
        with pytest.raises(GenerationError) as err:
            run_rounds(rounds_config(task, "vllm_stale", f"rounds.vllm_url={server.url}"), log=quiet, progress=False)
    finally:
        server.shutdown()
    message = str(err.value)
    assert "\n" not in message and server.url in message and "--worker-extension-cls" in message
    assert not server.requests  # nothing sampled from weights it could not confirm


def test_a_server_that_dies_mid_round_stops_it_in_one_line_and_a_resume_continues_exactly(task, one_thread):  # noqa: F811
    """The only server dies after 3 requests of round 1: one line naming it; restarted at the same address, the run
    resumes (the new server given the round's weights first) to the files of a run whose server never died."""
    straight_server = StubServer().start()
    try:
        run_rounds(rounds_config(task, "vllm_straight", f"rounds.vllm_url={straight_server.url}"), log=quiet,
                   progress=False)
    finally:
        straight_server.shutdown()
    dying = StubServer(die_after=3).start()
    url = dying.url
    cfg = rounds_config(task, "vllm_died", f"rounds.vllm_url={url}")
    try:
        with pytest.raises(GenerationError) as err:
            run_rounds(cfg, log=quiet, progress=False)
    finally:
        dying.shutdown()
        dying.server_close()
    assert "\n" not in str(err.value) and url in str(err.value)
    again = StubServer(port=int(url.rsplit(":", 1)[1])).start()  # the server restarted where it was
    try:
        run_rounds(cfg, resume=True, log=quiet, progress=False)
    finally:
        again.shutdown()
    assert reloads(again)[0] == (str(task / "init"), weights_version(task / "vllm_died", 0))
    for r in range(1, ROUNDS + 1):
        a, b = (task / run / "rounds" / f"{r:03d}" / "samples.jsonl" for run in ("vllm_straight", "vllm_died"))
        assert a.read_bytes() == b.read_bytes(), r


def test_overlap_samples_the_next_round_while_this_one_trains_one_round_stale(task, servers, one_thread):  # noqa: F811
    """rounds.overlap: round r + 1 is sampled (in a thread) from round r's starting policy while round r trains;
    round 1 and round 2 both sample the initial policy, round 3 round 2's start (round 1's final), and so on."""
    run, server = task / "vllm_overlap", servers[0]
    result = run_rounds(rounds_config(task, "vllm_overlap", f"rounds.vllm_url={server.url}", "rounds.count=4",
                                      "rounds.overlap=true"), log=quiet, progress=False)
    assert len(result.rounds) == 4 and all("seconds/generate_waited" in m for m in result.rounds[1:])
    versions = [weights_version(run, r) for r in range(4)]
    assert [samples_meta(run, r)["generation"]["weights_version"] for r in range(4)] == \
        [versions[0], versions[0], versions[1], versions[2]]
    folders = [str(task / "init")] + [str(run / "rounds" / f"{r:03d}" / "train" / "final") for r in (1, 2)]
    assert reloads(server) == list(zip(folders, versions[:3]))  # round 4's start has no next round to sample


def test_an_online_overlapped_run_killed_mid_way_resumes_to_the_uninterrupted_one(task, servers, one_thread):  # noqa: F811
    from safetensors.torch import load_file

    online = ("rounds.count=5", "rounds.steps_per_round=1", "rounds.save_each_round=false", "rounds.overlap=true",
              "run.save_every=2", "rounds.prompts_per_round=4")
    straight = rounds_config(task, "overlap_straight", f"rounds.vllm_url={servers[0].url}", *online)
    run_rounds(straight, log=quiet, progress=False)
    cfg = rounds_config(task, "overlap_resumed", f"rounds.vllm_url={servers[1].url}", *online)
    with pytest.raises(RoundsInterrupted):  # stopped after step 3, while round 4 samples in its thread
        run_rounds(cfg, log=quiet, progress=False, stop_at=(2, "train", 1))
    run_rounds(cfg, resume=True, log=quiet, progress=False)
    a, b = (task / x for x in ("overlap_straight", "overlap_resumed"))
    for r in range(1, 6):
        scored = "store/tokens.bin" if (a / "rounds" / f"{r:03d}" / "store").is_dir() else "no_pairs.json"
        for name in ("samples.jsonl", scored):
            assert (a / "rounds" / f"{r:03d}" / name).read_bytes() == (b / "rounds" / f"{r:03d}" / name).read_bytes()
    wa, wb = (load_file(str(x / "rounds" / "005" / "train" / "final" / "model.safetensors")) for x in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [p.name for p in (b / "sampler").iterdir()] == [weights_version(b, 3)]  # round 5 sampled round 4's start
