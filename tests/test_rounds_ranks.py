"""On-policy rounds under torchrun (tests/test_rounds.py's quickstart task): two gloo ranks, DDP then FSDP2 in one
launch, write the same samples, scores and pair stores as one process, byte for byte, and the same final weights up
to float32 rounding; in the same launch, LoRA rounds (reference.mode adapter) and rounds on a precomputed reference
(rank 0 computes each round's sidecar while the other waits) under DDP equal one process's too. The ranks' sampling
parts merge into one process's samples file, and a killed part continues."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.conftest import run_here, run_prefpack
from tests.test_rounds import overrides, task  # noqa: F401 - task: the quickstart fixture, built for this module too

# batch 3: 16 prompts make chunks of 3,3,3,3,3,1 (ranks 0 and 1 take 9 and 7 rows), the 8 held-out ones 3,3,2.
# eps 1e-3: AdamW divides by sqrt(v) + eps, which turns float32 rounding noise (the all-reduce sums in another order
# than one process) in near-zero gradients into full-size updates (as in tests/test_distributed.py)
# rounds.optimizer reset: the rounds of one process, DDP and FSDP2 run in one process each, compared with the files of
# rounds run as separate trainings elsewhere (tests/test_rounds_live.py); the LoRA runs keep their optimizer
EXTRA = ("rounds.batch_size=3", "rounds.steps_per_round=3", "optim.eps=1.0e-3", "rounds.optimizer=reset")
ATOL = 1e-5  # measured: 1.2e-7 apart; a round of training moves them by up to 8e-3 (lr 1e-2)
FILES = ("samples.jsonl", "samples.meta.json", "eval_samples.jsonl", "eval_scores.jsonl", "store/tokens.bin",
         "store/index.bin")
# the LoRA and precomputed-reference runs: 1 step a round (each round a new training run; the 3-step runs above check
# the optimizer state across steps), no held-out prompts (their sampling is checked above)
SHORT = ("rounds.steps_per_round=1", "rounds.eval_prompts=null", "rounds.optimizer=keep")
# lr 0.1: one step moves the adapter enough that round 2's samples (base + adapter) differ from the base's
LORA = ("lora.enabled=true", "lora.r=4", "lora.alpha=8", "reference.mode=adapter", "optim.lr=0.1")
# all weights trained, each round's reference its starting policy: round 2's sidecar is computed with round 1's final
PRECOMPUTED = ("reference.mode=precomputed", "rounds.reference=round_start")
DDP = ("distributed.strategy=ddp",)
FSDP2 = ("distributed.strategy=fsdp2",)
RUNS = {"one": (), "ddp": DDP, "fsdp2": FSDP2, "lora_one": SHORT + LORA, "lora_ddp": SHORT + LORA + DDP,
        "lora_fsdp2": SHORT + LORA + FSDP2, "pre_one": SHORT + PRECOMPUTED, "pre_ddp": SHORT + PRECOMPUTED + DDP,
        "pre_fsdp2": SHORT + PRECOMPUTED + FSDP2}


# the reward of tests/test_rounds.py, which also notes the rank that computed it: under torchrun the ranks share the
# scoring (row i on rank i % 2), so rank 1 scores too
SCORED_BY = """import difflib
import os


def reward(prompt, completion, row):
    with open(os.path.join(os.path.dirname(__file__), "scored_by.txt"), "a") as fh:
        fh.write(os.environ.get("RANK", "-") + "\\n")
    return difflib.SequenceMatcher(None, completion.strip().lower(), row["label"]).ratio()
"""


@pytest.fixture(scope="module")
def stubs():
    """Two stand-in vLLM servers (tests/vllm_stub.py) for the launch: under torchrun each rank drives one."""
    from tests.vllm_stub import StubServer

    servers = [StubServer().start(), StubServer().start()]
    yield servers
    for server in servers:
        server.shutdown()


@pytest.fixture(scope="module")
def launch(task, stubs, one_thread):  # noqa: F811
    """One process, in this one (each run); then one torchrun launch of two ranks: DDP, FSDP2, LoRA under DDP, a
    precomputed reference under DDP."""
    (task / "reward_ranks.py").write_text(SCORED_BY)
    scorer = f"rounds.reward_fn={task / 'reward_ranks.py'}:reward"
    args = {name: ["train", *overrides(task, name, *EXTRA, *extra, scorer), "--no-progress", "--json"]
            for name, extra in RUNS.items()}
    vllm = (*SHORT, "rounds.engine=vllm", f"rounds.vllm_url=[{stubs[0].url},{stubs[1].url}]", "rounds.max_new_tokens=4")
    args["vllm_one"], args["vllm_ddp"] = (["train", *overrides(task, name, *EXTRA, *extra, *vllm, scorer), "--no-progress",
                                           "--json"] for name, extra in (("vllm_one", ()), ("vllm_ddp", DDP)))
    one = run_here(args["one"], args["lora_one"], args["pre_one"], args["vllm_one"])
    answered = [len(s.requests) for s in stubs]
    # the DDP run again, stopped after step 4 (in round 2: its last checkpoint is round 1's end, step 3) and resumed
    killed = ["train", *overrides(task, "ddp_resumed", *EXTRA, *DDP, scorer), "--no-progress", "--json"]
    proc = run_prefpack(args["ddp"], args["fsdp2"], args["lora_ddp"], args["pre_ddp"], [*killed, "--stop-after-steps",
                        "4"], [*killed, "--resume"], args["vllm_ddp"], args["lora_fsdp2"], args["pre_fsdp2"], nproc=2,
                        timeout=600)
    return {"one": json.loads(one[0]), "printed": [json.loads(x) for x in proc.stdout.splitlines()],
            "stderr": proc.stderr, "answered": [len(s.requests) - n for s, n in zip(stubs, answered)]}


def _without_logprobs(text: str) -> tuple[str, list[float]]:
    """A samples file's rows without their sampler log-probs, and those log-probs in order."""
    rows, values = [], []
    for line in text.splitlines():
        row = json.loads(line)
        for lp in row.pop("logprobs", None) or []:
            values.extend(lp or [])
        rows.append(json.dumps(row, sort_keys=True))
    return "\n".join(rows), values


def assert_round_files_equal(one, two, names) -> None:
    """Every round file byte for byte, except the sampler's log-probs in the samples files (and the hash of those in
    their meta): round 2 samples weights trained by ranks (an all-reduced gradient, summed in another order), which
    sample the same tokens whose log-probs differ in the last digits (to 1e-5)."""
    for r in ("001", "002"):
        for name in names:
            a, b = one / "rounds" / r / name, two / "rounds" / r / name
            # a meta names its policy's folder: round 2's is in the run's own folder
            got, want = b.read_bytes(), a.read_bytes().replace(bytes(one), bytes(two))
            if name.endswith("samples.meta.json"):  # its samples file's hash covers the log-probs
                meta_a, meta_b = json.loads(want), json.loads(got)
                for meta in (meta_a, meta_b):
                    meta.get("samples", {}).pop("sha256", None)
                assert meta_a == meta_b, f"round {r}: {name}"
                continue
            if name.endswith(".jsonl"):  # samples, and the eval scores that carry them
                (rows_a, lp_a), (rows_b, lp_b) = _without_logprobs(want.decode()), _without_logprobs(got.decode())
                assert rows_a == rows_b, f"round {r}: {name}"
                np.testing.assert_allclose(lp_b, lp_a, rtol=0, atol=1e-5, err_msg=f"round {r}: {name}")
                continue
            assert want == got, f"round {r}: {name}"
        assert not list((two / "rounds" / r).glob("*.rank-*"))  # the ranks' parts merged and removed


def assert_weights_close(a_path, b_path) -> None:
    from safetensors.torch import load_file

    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=0)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_write_the_rounds_of_one_process(launch, task, strategy):  # noqa: F811
    one, two = task / "one", task / strategy
    assert (two / "checkpoints").is_dir()  # rounds in one process (FSDP2: each rank samples the gathered policy)
    assert_round_files_equal(one, two, FILES)
    final = ("rounds", "002", "train", "final", "model.safetensors")
    assert_weights_close(one.joinpath(*final), two.joinpath(*final))
    # the ranks shared the scoring (rounds in one process: DDP), and rank 0 wrote the store one process writes
    assert "1" in (task / "scored_by.txt").read_text().split()
    # rank 0 alone logs and prints: one round line per round, one summary per run
    lines = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines if x["split"] == "round"] == [0, 1]
    assert [m["run_dir"] for m in launch["printed"]] == [str(task / x) for x in ("ddp", "fsdp2", "lora_ddp", "pre_ddp",
                                                                                 "ddp_resumed", "vllm_ddp",
                                                                                 "lora_fsdp2", "pre_fsdp2")]
    assert [m["reward/mean"] for m in launch["printed"][0]["rounds"]] == \
        [m["reward/mean"] for m in launch["one"]["rounds"]]


def train_losses(run_dir) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if x["split"] == "train"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lora_rounds_under_ranks_are_those_of_one_process(launch, task, strategy):  # noqa: F811
    """Each rank samples base + the adapter it trains (FSDP2: the shards gathered into a copy under the same
    adapter, unmerged): the same samples and pair stores, both rounds' adapters and the merged final model to float32
    rounding."""
    one, two = task / "lora_one", task / f"lora_{strategy}"
    assert (two / "checkpoints").is_dir()  # rounds in one process
    assert_round_files_equal(one, two, FILES[:2] + FILES[4:])
    # round 2 sampled base + round 1's adapter (its meta names them)
    assert str(two / "rounds" / "001" / "train" / "final" / "adapter") in \
        (two / "rounds" / "002" / "samples.meta.json").read_text()
    for r in ("001", "002"):
        adapter = ("rounds", r, "train", "final", "adapter", "adapter_model.safetensors")
        assert_weights_close(one.joinpath(*adapter), two.joinpath(*adapter))
    final = ("rounds", "002", "train", "final", "model.safetensors")  # the merged model beside the adapter
    assert_weights_close(one.joinpath(*final), two.joinpath(*final))
    assert train_losses(two) == pytest.approx(train_losses(one), abs=1e-5) and len(train_losses(two)) == 2


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_precomputed_reference_under_ranks_is_that_of_one_process(launch, task, strategy):  # noqa: F811
    """Rank 0 computes each round's sidecar (round 2's with the policy in memory at its start, named by the folder
    its own run saved those weights in: round 1's final model) while the other waits; every rank trains on it: the same
    stores and sidecars, the same losses and final weights."""
    from safetensors import safe_open

    one, two = task / "pre_one", task / f"pre_{strategy}"
    assert (two / "checkpoints").is_dir()  # rounds in one process (FSDP2: each rank scores with the gathered policy)
    assert_round_files_equal(one, two, FILES[:2] + FILES[4:])
    for r, reference in (("001", task / "init"), ("002", two / "rounds" / "001" / "train" / "final")):
        (a,), (b,) = ((run / "rounds" / r / "store").glob("ref_logps*.safetensors") for run in (one, two))
        with safe_open(str(a), "np") as fa, safe_open(str(b), "np") as fb:
            assert fb.metadata()["reference"] == str(reference)
            assert np.isfinite(fb.get_tensor("logps")).all()
            np.testing.assert_allclose(fa.get_tensor("logps"), fb.get_tensor("logps"), atol=ATOL, rtol=0)
    losses = train_losses(two)
    assert len(losses) == 2 and losses[1] == pytest.approx(math.log(2), abs=1e-6)  # round 2 starts at its reference
    assert losses == pytest.approx(train_losses(one), abs=1e-5)
    final = ("rounds", "002", "train", "final", "model.safetensors")
    assert_weights_close(one.joinpath(*final), two.joinpath(*final))


def test_ranks_parts_merge_into_the_samples_of_one_process(task, tmp_path, one_thread):  # noqa: F811
    """Each rank's part (rank 1's killed mid-chunk, a partial last line, then continued) merged by rank 0: the
    samples file and meta one process writes."""
    from prefpack.config import load_config
    from prefpack.generation.run import build_engine, prompt_source, sample_prompts, settings_of
    from prefpack.generation.shards import merge_parts, part_path
    from prefpack.rounds import plan

    cfg = load_config(None, overrides(task, "unused", *EXTRA))
    opts = plan.generate_options(cfg, tmp_path, 0, prompts=cfg.rounds.prompts, output=tmp_path / "one.jsonl")
    source = prompt_source(opts)
    settings, engine = settings_of(opts, source), build_engine(opts, source)
    sample_prompts(source, engine, settings, tmp_path / "one.jsonl", log=lambda m: None)
    merged = tmp_path / "two.jsonl"
    part = part_path(merged, 1, 2)
    sample_prompts(source, engine, settings, part, log=lambda m: None, shard=(1, 2))
    lines = part.read_bytes().splitlines(keepends=True)
    assert len(lines) == 7  # chunks 1, 3, 5: 3 + 3 + 1 rows
    part.write_bytes(b"".join(lines[:4]) + lines[4][:10])  # killed in chunk 3, in the middle of its second row
    part_meta = part.with_name(part.name.replace(".jsonl", ".meta.json"))
    part_meta.write_text(part_meta.read_text().replace('"complete": true', '"complete": false'))
    for rank in (1, 0):
        sample_prompts(source, engine, settings, part_path(merged, rank, 2), log=lambda m: None, shard=(rank, 2))
    meta = merge_parts(merged, 2, opts.batch_size)
    assert merged.read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    one = json.loads((tmp_path / "one.meta.json").read_text())
    assert meta == {**one, "samples": {**one["samples"], "file": "two.jsonl"}}  # each meta names its own file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.jsonl", "one.meta.json", "two.jsonl", "two.meta.json"]


def test_two_ranks_killed_in_a_round_resume_to_the_uninterrupted_run(launch, task):  # noqa: F811
    """Rounds in one process under DDP, stopped after step 4 and resumed from the run's checkpoint (round 1's end):
    the same round files and the same final weights as the run that was never stopped."""
    one, two = task / "ddp", task / "ddp_resumed"
    assert_round_files_equal(one, two, FILES)
    final = ("rounds", "002", "train", "final", "model.safetensors")
    from safetensors.torch import load_file

    a, b = load_file(str(one.joinpath(*final))), load_file(str(two.joinpath(*final)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "stopped after step 4; continue with --resume" in launch["stderr"]
    assert f"resumed from {two / 'checkpoints' / 'step-00000003'} at step 3" in launch["stderr"]


def test_each_rank_drives_a_vllm_server_of_its_own(launch, task, stubs):  # noqa: F811
    """rounds.vllm_url with a server a rank: rank k samples its chunks of rounds.batch_size prompts through server k
    (given each round's weights by that rank), and the merged samples are one process's (which deals its prompts over
    both); rank 0's part names its own server alone."""
    one, two = task / "vllm_one", task / "vllm_ddp"
    assert_round_files_equal(one, two, ("samples.jsonl", "store/tokens.bin", "store/index.bin"))
    assert all(n > 0 for n in launch["answered"])  # both servers sampled for the launch
    meta = json.loads((two / "rounds" / "002" / "samples.meta.json").read_text())
    assert meta["generation"]["url"] == stubs[0].url  # rank 0 drove the first server, rank 1 the second
    from prefpack.rounds.sampler import weights_version

    for stub in stubs:  # each rank gave its server both rounds' weights, in order
        reloads = [tuple(b["args"]) for p, b in stub.admin if p == "/collective_rpc"
                   and b["method"] == "prefpack_reload_weights" and b["args"][1].startswith(weights_version(two, 0)[:10])]
        assert reloads == [(str(task / "init"), weights_version(two, 0)),
                           (str(two / "rounds" / "001" / "train" / "final"), weights_version(two, 1))]
