"""Sequence parallelism (distributed.sequence_parallel): two gloo ranks, each holding half of every row, against
one process computing the whole row in float64."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_here, run_prefpack
from sp_cases import (
    ATTENTION_CASES,
    FORWARD_CASES,
    case_tensors,
    forward_case,
    forward_loss,
    kernel_kwargs,
    tiny_model,
)
from test_distributed import ATOL, _losses, _weights, world  # noqa: F401 - world: a module-scoped fixture

from prefpack.config import ConfigError, load_config
from prefpack.model import sequence_logps
from prefpack.model.attention import packed_sdpa, varlen
from prefpack.model.sharded import check_model
from prefpack.sequence_parallel import (
    SeqPar,
    SequenceParallelError,
    check_heads,
    kv_repeats,
    layout_line,
    make_layout,
)

HERE = Path(__file__).resolve().parent
KERNELS = {"packed_sdpa": packed_sdpa.packed_sdpa_attention, "varlen": varlen.varlen_attention}


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


RUNS = {  # name: the overrides of a three-step run (the world's config), trained in one process and on two ranks
    "pairs": ("distributed.strategy=ddp",),
    "kto": ("distributed.strategy=ddp", "loss.terms=[{name: kto}]", "data.paired_as_kto=true"),
    "fsdp2_ld_wpo": ("distributed.strategy=fsdp2", "loss.ld_alpha=0.5", "loss.use_weighting=true"),
    # a Qwen2 whose second layer attends within a window of 8 tokens (rows of up to 256, sequences of up to 64);
    # SWA_POLICY: the fixture's model (below)
    "sliding_window": ("distributed.strategy=ddp", "model.name_or_path=SWA_POLICY"),
}
SWA = 8  # the sliding-window model's window


def sliding_window_model(vocab_size: int, *, window: int | None = SWA):
    """A 2-layer float32 Qwen2 (4 query heads over 2 key/value heads), its first layer full attention and its second
    a sliding window of ``window`` tokens (full attention when None), seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=window is not None,
        sliding_window=window, layer_types=["full_attention", "sliding_attention" if window else "full_attention"]))


@pytest.fixture(scope="module")
def launch(world, tmp_path_factory):  # noqa: F811 - the imported fixture
    """One torchrun launch of two gloo ranks (tests/sp_ranks.py): the attention and forward cases, then every run of
    ``RUNS`` with distributed.sequence_parallel=2; and the runs in one process (one process started for all)."""
    out = tmp_path_factory.mktemp("sp")
    vocab = json.loads((world["root"] / "policy" / "config.json").read_text())["vocab_size"]
    sliding_window_model(vocab).save_pretrained(out / "swa-policy")

    def train(name: str, *extra: str) -> list[str]:
        evaluated = [f"data.eval={world['store']}"] if name.endswith("-pairs") else []  # before and after training
        extra = [a.replace("SWA_POLICY", str(out / "swa-policy")) for a in extra]
        return ["train", str(world["conf"]), f"run.output_dir={out / name}", "--no-progress", "train.max_steps=3",
                "run.save_every=0", *evaluated, *extra]

    def scoring(name: str, *extra: str) -> list[list[str]]:
        """``prefpack eval`` (pairs, and KTO, of the trained two-rank model against the initial one as --ref) and
        ``precompute-ref`` into a copy of the store of its own."""
        shutil.copytree(world["store"], out / f"{name}-store")
        model = ["--model", str(out / "two-pairs" / "final"), "--data", str(world["store"]), "--json"]
        return [["eval", *model, "--ref", str(world["root"] / "policy"), *extra],
                ["eval", *model, "--ref", str(world["root"] / "policy"), "--kto", *extra],
                ["precompute-ref", "--model", str(world["root"] / "policy"), "--data", str(out / f"{name}-store"),
                 *extra]]

    commands = out / "commands.json"
    # the pairs run again, stopped after step 2 (its checkpoint) and resumed: the uninterrupted run's steps
    cut = train("resumed-pairs", *RUNS["pairs"], "distributed.sequence_parallel=2", "run.save_every=2")
    commands.write_text(json.dumps([*(train(f"two-{n}", *o, "distributed.sequence_parallel=2")
                                      for n, o in RUNS.items()), [*cut, "--stop-after-steps=2"], [*cut, "--resume"],
                                    *scoring("two", "--sequence-parallel", "2")]))
    proc = torchrun("sp_ranks.py", out, commands)
    one = run_here(*(train(f"one-{n}", *o[1:]) for n, o in RUNS.items()), *scoring("one"))
    return {"out": out, "conf": world["conf"], "store": world["store"], "log": proc.stdout + proc.stderr,
            "scored": [_json_lines(proc.stdout), _json_lines("\n".join(one))], "vocab": vocab,
            "ranks": [torch.load(out / f"attention-{r}.pt") for r in range(2)]}


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")][-3:]  # after the training runs


@pytest.fixture(scope="module")
def attention_ranks(launch):
    return launch["ranks"]


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_sharded_attention_equals_the_whole_row(attention_ranks, name):
    """Values and q/k/v gradients of the two shards, put together, are those of the kernel on the unsharded row."""
    case = ATTENTION_CASES[name]
    q, k, v, pos, cot = case_tensors(case)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    extra = {"sliding_window": case["window"]} if case.get("window") else {}
    out, _ = KERNELS[case["kernel"]](torch.nn.Module(), q, k, v, None, scaling=case.get("scale"), position_ids=pos,
                                     **kernel_kwargs(case, pos), **extra)
    (out * cot).sum().backward()
    shards = [r[name] for r in attention_ranks]
    torch.testing.assert_close(torch.cat([s["out"] for s in shards], dim=1), out.detach(), rtol=0, atol=1e-12)
    for key, full in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        torch.testing.assert_close(torch.cat([s[key] for s in shards], dim=2), full, rtol=0, atol=1e-12)


def test_group_sum_is_the_sum_on_every_rank_with_the_sums_gradient(attention_ranks):
    total = torch.arange(3, dtype=torch.float64) * 3  # rank 0 holds arange(3), rank 1 twice that
    for r in attention_ranks:
        torch.testing.assert_close(r["group_sum"]["out"], total)
        torch.testing.assert_close(r["group_sum"]["grad"], torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


def test_head_counts_are_checked_with_the_numbers():
    assert kv_repeats(1, 2) == 2 and kv_repeats(2, 2) == 1 and kv_repeats(3, 2) == 2 and kv_repeats(2, 4) == 2
    check_heads(4, 1, 2)
    check_heads(6, 3, 2)
    with pytest.raises(SequenceParallelError, match="must divide the model's 6 attention heads"):
        check_heads(6, 2, 4)
    with pytest.raises(SequenceParallelError, match="does not divide the 6 processes"):
        make_layout(4, 6, 0)
    line = layout_line(SeqPar(size=2, rank=0, group=None, data_world=2, data_rank=0), 4)
    assert "4 processes = 2 data-parallel group(s) of 2 (ranks 0-1, 2-3)" in line


@pytest.mark.parametrize("name", sorted(FORWARD_CASES))
def test_sharded_forward_equals_one_process(attention_ranks, name):
    """A float64 Llama (4 query heads over 1 key/value head) on two ranks' token shards: every rank returns the
    whole row's log-prob sums, LD-DPO tails and WPO means; the ranks' parameter gradients add up to one process's."""
    model = tiny_model()
    batch, options = forward_case(name, model)
    out = sequence_logps(model, batch, chunk_size=4, **options)
    forward_loss(out).backward()
    ranks = [r["forward/" + name] for r in attention_ranks]
    for r in ranks:
        for key in ("logp_sum", "tail_sum", "wpo_mean"):
            torch.testing.assert_close(r[key], getattr(out, key).detach(), rtol=0, atol=1e-10)
    for key, p in model.named_parameters():
        torch.testing.assert_close(ranks[0]["grads"][key] + ranks[1]["grads"][key], p.grad, rtol=0, atol=1e-10)


# ---------------------------------------------------------------- refusals


def test_the_config_refuses_what_cannot_run_sharded():
    cfg = load_config(None, ["distributed.sequence_parallel=2", "model.attn_implementation=sdpa",
                             "data.packing=false"])
    with pytest.raises(ConfigError) as err:
        cfg.validate(training=False)
    assert "the 'sdpa' kernel cannot; set model.attn_implementation to auto or packed_sdpa or varlen" in str(err.value)
    assert "set data.packing=true" in str(err.value)
    with pytest.raises(ConfigError, match="does not run through torch.compile yet; set model.compile=off"):
        load_config(None, ["distributed.sequence_parallel=2", "model.compile=true"]).validate(training=False)
    with pytest.raises(ConfigError, match="distributed.sequence_parallel must be >= 1, got 0"):
        load_config(None, ["distributed.sequence_parallel=0"]).validate(training=False)
    load_config(None, ["distributed.sequence_parallel=2"]).validate(training=False)


def test_a_model_the_group_cannot_shard_is_refused_with_the_numbers():
    model = tiny_model()
    check_model(model, SeqPar(size=4, group=None))  # 4 heads over 4 ranks, the 1 key/value head repeated
    with pytest.raises(SequenceParallelError, match="must divide the model's 4 attention heads"):
        check_model(model, SeqPar(size=3, group=None))
    with pytest.raises(SequenceParallelError, match="set loss.router_aux_loss_coef=0"):
        check_model(model, SeqPar(size=2, group=None), router_aux=True)
    model.config._attn_implementation = "eager"
    with pytest.raises(SequenceParallelError, match="packed_sdpa or varlen kernel; this model's is eager"):
        check_model(model, SeqPar(size=2, group=None))


# ---------------------------------------------------------------- training


def _trains_as_one(one_dir: Path, many_dir: Path, evaluated: bool = False) -> None:
    """The same losses (1e-6), gradient norms and final weights (float32 on CPU; the ranks add their shards'
    gradients in another order); and when ``evaluated``, the same evaluations before and after training."""
    one, many = _losses(one_dir), _losses(many_dir)
    assert len(one) == 3
    for (s1, l1, g1), (s2, l2, g2) in zip(one, many, strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=1e-6) and g1 == pytest.approx(g2, rel=1e-5)
    if evaluated:  # evaluation before and after training, its micro-batches sharded too
        evals = [[m for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if m["split"] == "eval"]
                 for d in (one_dir, many_dir)]
        assert len(evals[0]) == 2
        for e1, e2 in zip(*evals, strict=True):
            assert e1["loss"] == pytest.approx(e2["loss"], abs=1e-6)
            assert e1["logps/chosen"] == pytest.approx(e2["logps/chosen"], rel=1e-6)
            for side in ("chosen", "rejected"):  # the head's entropy, summed over the shards as the log-probs are
                assert e1[f"entropy/{side}"] == pytest.approx(e2[f"entropy/{side}"], rel=1e-6)
    w1, w2 = _weights(one_dir), _weights(many_dir)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_two_ranks_of_one_sequence_group_train_as_one_process(launch, name):
    """Every row split in two token shards over two ranks: the same losses, gradient norms and weights as one
    process running the whole rows (float32 on CPU; the ranks add their shards' gradients in another order). Pairs
    (prompts laid out once) and KTO with DDP; pairs with LD-DPO's tails and WPO's weights with FSDP2; a model with a
    sliding-window layer (window 8, shorter than the sequences; the window crosses the shards' boundary) with DDP."""
    assert "sequence parallel: 2 processes = 1 data-parallel group(s) of 2 (ranks 0-1)" in launch["log"]
    _trains_as_one(launch["out"] / f"one-{name}", launch["out"] / f"two-{name}", evaluated=name == "pairs")


def test_the_sliding_window_model_attends_within_its_window(launch):
    """The training check above is about a window: the sliding-window model's second layer, on the packed_sdpa
    kernel training loads, gives other log-probs than the same weights with full attention on a 24-token sequence
    (and the same ones on a sequence no longer than the window)."""
    from prefpack.model.attention import packed_sdpa

    packed_sdpa.register()
    models = [sliding_window_model(launch["vocab"], window=w) for w in (SWA, None)]
    for m in models:
        m.config._attn_implementation = "packed_sdpa"
    ids = torch.randint(1, launch["vocab"], (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [[m(input_ids=ids[:, :n], position_ids=torch.arange(n)[None]).logits for m in models]
                  for n in (SWA, 24)]
    torch.testing.assert_close(logits[0][0], logits[0][1], rtol=0, atol=1e-6)
    assert (logits[1][0] - logits[1][1]).abs().max() > 1e-3


# ---------------------------------------------------------------- eval and precompute-ref


def test_eval_and_precompute_ref_on_a_sequence_group_score_as_one_process(launch):
    """``prefpack eval --sequence-parallel 2`` (pairs and KTO, a reference model beside the policy) and
    ``precompute-ref --sequence-parallel 2`` on two ranks of one group: the metrics and the sidecar one process
    computes over the whole rows."""
    from safetensors.numpy import load_file

    two, one = launch["scored"]
    assert len(two) == len(one) == 3  # two evaluations, one precompute summary
    for e2, e1 in zip(two[:2], one[:2], strict=True):
        assert e2.keys() == e1.keys() and e1["reference"] == "copy"
        for key, value in e1.items():
            if isinstance(value, float):  # float32 sums of ~-300 nats added in another order: KTO's kl (a mean of
                # policy - reference differences of such sums, ~1e-3) moves by ~5e-6
                assert e2[key] == pytest.approx(value, rel=1e-5, abs=2e-5), key
            else:
                assert e2[key] == value, key
    assert two[2]["sequences"] == one[2]["sequences"] > 0
    tables = [load_file(Path(s["sidecar"])) for s in (two[2], one[2])]
    assert tables[0].keys() == tables[1].keys()
    for key in tables[1]:
        np.testing.assert_allclose(tables[0][key], tables[1][key], rtol=1e-5, atol=1e-5, equal_nan=True)


def test_eval_refuses_a_sequence_group_larger_than_the_processes(world, capsys):  # noqa: F811
    from prefpack.cli import main

    assert main(["eval", "--model", str(world["root"] / "policy"), "--data", str(world["store"]),
                 "--sequence-parallel", "2"]) != 0
    assert "distributed.sequence_parallel=2 does not divide the 1 processes" in capsys.readouterr().err


def test_a_sequence_group_resumed_from_its_checkpoint_equals_the_uninterrupted_run(launch):
    """Two ranks of one group stopped after step 2 (its checkpoint) and resumed with --resume: the losses, gradient
    norms and final weights of the uninterrupted run (same ranks, same order of sums: identical)."""
    assert "continue with --resume" in launch["log"]
    full, cut = launch["out"] / "two-pairs", launch["out"] / "resumed-pairs"
    assert (cut / "checkpoints" / "step-00000002").is_dir()
    assert _losses(cut) == _losses(full) and len(_losses(full)) == 3
    w1, w2 = _weights(full), _weights(cut)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=0, rtol=0)


FOUR = ("ddp", "fsdp2")  # 2 x 2 runs, each strategy's


@pytest.fixture(scope="module")
def four(launch):
    """One torchrun launch of four processes (two data-parallel groups of two sequence ranks): the pairs run with
    each strategy of ``FOUR``."""
    out = launch["out"]
    proc = run_prefpack(*(["train", str(launch["conf"]), f"run.output_dir={out / f'four-{s}'}", "--no-progress",
                           "train.max_steps=3", "run.save_every=0", f"data.eval={launch['store']}",
                           f"distributed.strategy={s}", "distributed.sequence_parallel=2"] for s in FOUR), nproc=4)
    return {"out": out, "log": proc.stdout + proc.stderr}


@pytest.mark.parametrize("strategy", FOUR)
def test_two_data_parallel_groups_of_two_sequence_ranks_train_as_one_process(four, strategy):
    """2 x 2: four processes, two data-parallel groups of two sequence ranks (the step's pairs dealt to the groups,
    each group's rows split over its ranks), with DDP and with FSDP2 (the parameters sharded over all four ranks):
    the one-process pairs run's losses, gradient norms, evaluations before and after training, and weights."""
    assert four["log"].count("4 processes = 2 data-parallel group(s) of 2 (ranks 0-1, 2-3)") == len(FOUR)
    _trains_as_one(four["out"] / "one-pairs", four["out"] / f"four-{strategy}", evaluated=True)
