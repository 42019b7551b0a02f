"""Several processes: dealing micro-batches to ranks, and torchrun (gloo, 2 CPU processes) against one process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import make_task, run_here, run_prefpack, write_jsonl

from prefpack.batching.deal import deal_step, rank_tokens
from prefpack.batching.schedule import StepKey
from prefpack.config import load_config
from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.store import Store
from prefpack.objectives import PairTask


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("dist")
    rows = [r for r in hh_train[:60] if r["chosen"].strip() and r["chosen"] != r["rejected"]][:37]  # odd count
    prepare(PrepareOptions(inputs=[str(write_jsonl(root / "d.jsonl", rows))], tokenizer=str(toy_tokenizers["llama"]),
                           output=str(root / "store"), max_length=64, min_prompt_keep=0, workers=1),
            log=lambda m: None)  # most prompts cut to almost nothing: allowed here
    tok = AutoTokenizer.from_pretrained(toy_tokenizers["llama"])
    torch.manual_seed(3)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
                     ).save_pretrained(root / "policy")
    conf = root / "c.yaml"
    conf.write_text(
        f"model: {{name_or_path: {root / 'policy'}}}\n"
        f"data: {{train: {root / 'store'}, max_tokens_per_row: 256}}\n"
        # eps 1e-3: AdamW divides by sqrt(v) + eps, which turns float32 rounding noise in near-zero gradients
        # (rows of rare tokens) into full-size updates; a larger eps keeps the comparison about the gradients
        "optim: {lr: 1.0e-3, schedule: cosine, warmup_steps: 1, eps: 1.0e-3}\n"
        "train: {global_batch_pairs: 10, max_steps: 4, micro_batch_tokens: 256}\n"
        "run: {plot: false, tensorboard: false, save_every: 2}\n")
    return {"root": root, "conf": conf, "store": root / "store"}


# ---------------------------------------------------------------- dealing (no processes)


@pytest.mark.parametrize("balance", ["tokens", "count"])
@pytest.mark.parametrize("n_world", [1, 2, 3])
def test_every_pair_once_per_step_and_equal_micro_batch_counts(world, balance, n_world):
    cfg = load_config(world["conf"], ["train.micro_batch_tokens=200", "data.max_tokens_per_row=200"])
    task = make_task(PairTask, Store(world["store"]), cfg)
    for n_ids in (1, 5, 10, 37):
        ids = np.random.default_rng(n_ids).permutation(len(task))[:n_ids]
        shares = deal_step(task, ids, seed=StepKey(0, n_ids), world=n_world, balance=balance)
        assert len(shares) == n_world
        counted = [pid for s in shares for p, w in zip(s.planned, s.weights) if w for row in p.rows for pid in row]
        assert sorted(counted) == sorted(int(i) for i in ids)  # every pair exactly once, none dropped
        assert len({len(s.planned) for s in shares}) == 1  # same number of forward passes on every rank (FSDP2)
        for s in shares:
            assert len(s.planned) >= 1 and all(w in (0.0, 1.0) for w in s.weights)


def test_token_balancing_beats_count_dealing_on_real_lengths(world):
    cfg = load_config(world["conf"], ["train.micro_batch_tokens=300", "data.max_tokens_per_row=300"])
    task = make_task(PairTask, Store(world["store"]), cfg)
    ratios = {}
    for balance in ("tokens", "count"):
        worst = []
        for step in range(8):
            ids = np.random.default_rng(step).permutation(len(task))[:16]
            toks = rank_tokens(deal_step(task, ids, seed=StepKey(0, step), world=2, balance=balance))
            worst.append(max(toks) / (sum(toks) / len(toks)))
        ratios[balance] = float(np.mean(worst))
    assert ratios["tokens"] <= ratios["count"]


# ---------------------------------------------------------------- torchrun


def _args(world, run_dir, *extra, stop=None, resume=False) -> list[str]:
    """`prefpack train` of the world's config into ``run_dir``."""
    return ["train", str(world["conf"]), f"run.output_dir={run_dir}", "--no-progress", "--json", *extra,
            *([f"--stop-after-steps={stop}"] if stop else []), *(["--resume"] if resume else [])]


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def _losses(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["loss"], m["grad_norm"]) for m in lines if m["split"] == "train"]


# Tolerance: the two ranks' gradients are summed by an all-reduce in another order than one process sums
# them, so float32 results differ by rounding (about 1e-8 after 4 AdamW steps at lr 1e-3 with eps 1e-3,
# measured); 1e-5 is far below any real error (a pair lost or counted twice moves weights by about 1e-4).
ATOL = 1e-5


BCO = ("bco_pair", "bco_pair_running")
SYNC = ("reference.sync=true", "reference.sync_steps=2", "reference.mixup_alpha=0.5")


@pytest.fixture(scope="module")
def launch(world):
    """Every run the tests below compare, the two-rank ones in one torchrun launch (start-up paid once), the one-process
    ones in this process: each BCO loss (one process, DDP); FSDP2 uninterrupted, and stopped after step 3 (its last
    checkpoint at step 2) then resumed; TR-DPO's reference sync (one process without and with it; DDP, FSDP2, and
    FSDP2 stopped and resumed: the uninterrupted one is the FSDP2 run); precompute-ref then eval, each into a store
    copy of its own."""
    root = world["root"]
    runs = {(n, k): root / f"{n}-{k}" for n in BCO for k in ("one", "two")}
    runs |= {("fsdp2", k): root / f"{k}-fsdp2" for k in ("full", "cut")}
    runs |= {("sync", k): root / f"sync-{k}" for k in ("plain", "one", "ddp", "fsdp2", "cut")}
    bco = {n: f"loss.terms=[{{name: {n}}}]" for n in BCO}
    fsdp2, sync_fsdp2 = ("distributed.strategy=fsdp2",), ("distributed.strategy=fsdp2", *SYNC)
    stores = {k: root / f"scoring-{k}" for k in ("one", "two")}
    scoring = {}
    for k, store in stores.items():
        shutil.copytree(world["store"], store)
        policy = root / "policy"
        scoring[k] = [["precompute-ref", "--model", policy, "--data", store],
                      ["eval", "--model", policy, "--data", store, "--loss", "sigmoid,nll", "--json"]]
    one = run_here(*(_args(world, runs[n, "one"], bco[n]) for n in BCO),
                    _args(world, runs["sync", "plain"]), _args(world, runs["sync", "one"], *SYNC), *scoring["one"])
    proc = run_prefpack(
        *(_args(world, runs[n, "two"], bco[n], "distributed.strategy=ddp") for n in BCO),
        _args(world, runs["fsdp2", "full"], *fsdp2), _args(world, runs["fsdp2", "cut"], *fsdp2, stop=3),
        _args(world, runs["fsdp2", "cut"], *fsdp2, resume=True),
        _args(world, runs["sync", "ddp"], "distributed.strategy=ddp", *SYNC),
        _args(world, runs["sync", "fsdp2"], *sync_fsdp2), _args(world, runs["sync", "cut"], *sync_fsdp2, stop=3),
        _args(world, runs["sync", "cut"], *sync_fsdp2, resume=True),
        *scoring["two"], nproc=2, timeout=900)
    printed = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return {"runs": runs, "stderr": proc.stderr, "stores": stores, "one": json.loads(one[-1]),
            "scored": [m for m in printed if "run_dir" not in m], "summaries": [m for m in printed if "run_dir" in m]}


def _resumed(launch, name) -> tuple:
    """The uninterrupted run and the stopped-and-resumed one of ``name``; checks what the launch said of them."""
    full, cut = launch["runs"][name, "fsdp2" if name == "sync" else "full"], launch["runs"][name, "cut"]
    # the stopped run said so and printed no summary; the full and the resumed run each printed theirs
    assert "continue with --resume" in launch["stderr"]
    done = [(m["run_dir"], m["steps"]) for m in launch["summaries"]]
    assert done.count((str(full), 4)) == 1 and done.count((str(cut), 4)) == 1
    assert (cut / "checkpoints" / "step-00000002").is_dir()
    return full, cut


@pytest.mark.parametrize("name", BCO)
def test_bco_pair_two_ranks_equal_one_rank(launch, name):
    """TRL 1.16's bco_pair has no running mean, and bco_pair_running's comes from each step's sums over all ranks:
    neither update depends on the number of ranks."""
    one, two = launch["runs"][name, "one"], launch["runs"][name, "two"]
    for (s1, l1, g1), (s2, l2, g2) in zip(_losses(one), _losses(two), strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=1e-6) and g1 == pytest.approx(g2, rel=1e-5)
    w1, w2 = _weights(one), _weights(two)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=ATOL, rtol=0)


def test_distributed_resume_equals_uninterrupted(launch):
    full, cut = _resumed(launch, "fsdp2")
    w1, w2 = _weights(full), _weights(cut)
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    assert _losses(full) == _losses(cut)


def test_precompute_ref_and_eval_split_across_ranks(launch):
    from safetensors.numpy import load_file

    single = launch["one"]
    one = load_file(str(launch["stores"]["one"] / "ref_logps.safetensors"))
    two = load_file(str(launch["stores"]["two"] / "ref_logps.safetensors"))
    assert np.isfinite(one["logps"]).all() and np.isfinite(two["tails"]).all()  # every key scored once
    np.testing.assert_allclose(one["logps"], two["logps"], atol=1e-6)
    np.testing.assert_allclose(one["tails"], two["tails"], atol=1e-6)
    assert len(launch["scored"]) == 2  # precompute-ref's line and eval's: only rank 0 prints
    double = launch["scored"][1]
    assert single["pairs"] == double["pairs"] == len(Store(launch["stores"]["two"]))
    for k in ("loss", "nll", "logps/chosen", "rewards/accuracies"):
        assert single[k] == pytest.approx(double[k], abs=1e-6)


_SHUTDOWN_SCRIPT = """
import importlib, os, sys, time, torch
from prefpack.distributed import init_from_env, shutdown
threads = lambda: len(os.listdir("/proc/self/task"))
torch.set_num_threads(1)  # what init_from_env sets for two ranks on this machine's 2 cores
# threads started while importing may still be winding down (once measured 11 here on a loaded machine): wait
# until the count is steady before taking it
before, steady = threads(), 0
for _ in range(100):
    time.sleep(0.02)
    now = threads()
    steady = steady + 1 if now == before else 0
    before = now
    if steady >= 5:
        break
ctx = init_from_env("cpu")
importlib.import_module("torch.distributed.nn.functional")  # what transformers does while loading a model
ctx.all_reduce_sum(torch.ones(3))
during = threads()
ctx.barrier()
shutdown()
os.write(1, f"{before} {during} {threads()}\\n".encode())  # one write: the two ranks' lines never interleave
"""


def test_shutdown_frees_the_process_group_and_its_threads(tmp_path):
    # A group that outlives shutdown keeps gloo worker threads that can abort the process at exit (the CI failure
    # of 2026-11-22: "terminate called without an active exception" in a two-rank eval).
    script = tmp_path / "shutdown.py"
    script.write_text(_SHUTDOWN_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = [tuple(map(int, line.split())) for line in proc.stdout.split("\n") if line.strip()]
    assert len(counts) == 2, (proc.stdout, proc.stderr[-2000:])
    assert all(len(c) == 3 for c in counts), proc.stdout
    for before, during, after in counts:  # the group's threads are gone
        assert during > after and after <= before, (before, during, after, proc.stderr[-2000:])


# ---------------------------------------------------------------- TR-DPO reference syncing under torchrun


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_reference_sync_two_processes_equal_one_process(launch, strategy):
    """Each rank mixes its own copy (DDP) or shard (FSDP2) of the reference: the losses after the sync at step 2
    (which read the synced reference) and the final weights match one process."""
    runs = launch["runs"]
    one, two = _losses(runs["sync", "one"]), _losses(runs["sync", strategy])
    assert _losses(runs["sync", "plain"])[2][1] != pytest.approx(one[2][1], abs=1e-6)  # the sync changed step 3
    for (s1, l1, g1), (s2, l2, g2) in zip(one, two, strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=1e-6) and g1 == pytest.approx(g2, rel=1e-5)
    w1, w2 = _weights(runs["sync", "one"]), _weights(runs["sync", strategy])
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=ATOL, rtol=0)


def test_reference_sync_distributed_resume_equals_uninterrupted(launch):
    """The DCP checkpoint holds the synced reference (key `reference`), and --resume restores it."""
    import torch.distributed.checkpoint as dcp

    full, cut = _resumed(launch, "sync")
    meta = dcp.FileSystemReader(str(cut / "checkpoints" / "step-00000002" / "dcp")).read_metadata()
    assert any(k.startswith("reference.") for k in meta.state_dict_metadata)
    w1, w2 = _weights(full), _weights(cut)
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    assert _losses(full) == _losses(cut)
