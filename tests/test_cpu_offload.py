"""``distributed.cpu_offload``: FSDP2's CPUOffloadPolicy on 2 gloo ranks equals one process and the run without
offload, resumes exactly, offloads the reference copy too (TR-DPO's sync included), and is refused in one line
where it cannot apply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import run_here, tiny_llama, write_jsonl

from prefpack.cli import main as cli_main
from prefpack.config import ConfigError, load_config
from prefpack.data.prepare import PrepareOptions, prepare

# test_distributed.py's tolerance for two ranks against one process: the all-reduce sums the ranks' gradients in
# another order than one process does (about 1e-8 after 4 steps); a pair lost or counted twice moves about 1e-4
ATOL = 1e-5
OFFLOAD = ("distributed.strategy=fsdp2", "distributed.cpu_offload=true")
SYNC = ("reference.sync=true", "reference.sync_steps=2", "reference.mixup_alpha=0.5")
QLORA = ("lora.enabled=true", "lora.r=4", "reference.mode=adapter", "model.quantization=nf4", "train.max_steps=2",
         "run.save_every=1")


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_tokenizers, hh_train):
    root = tmp_path_factory.mktemp("offload")
    rows = [r for r in hh_train[:60] if r["chosen"].strip() and r["chosen"] != r["rejected"]][:37]
    prepare(PrepareOptions(inputs=[str(write_jsonl(root / "d.jsonl", rows))], tokenizer=str(toy_tokenizers["llama"]),
                           output=str(root / "store"), max_length=64, min_prompt_keep=0, workers=1),
            log=lambda m: None)
    tiny_llama(toy_tokenizers["llama"], root / "policy", seed=3)
    conf = root / "c.yaml"
    conf.write_text(
        f"model: {{name_or_path: {root / 'policy'}}}\n"
        f"data: {{train: {root / 'store'}, max_tokens_per_row: 256}}\n"
        "optim: {lr: 1.0e-3, schedule: cosine, warmup_steps: 1, eps: 1.0e-3, max_grad_norm: 0.5}\n"
        "train: {global_batch_pairs: 10, max_steps: 4, micro_batch_tokens: 256}\n"
        "run: {plot: false, tensorboard: false, save_every: 2}\n")
    return {"root": root, "conf": conf}


def _args(world, run_dir, *extra, stop=None, resume=False) -> list[str]:
    return ["train", str(world["conf"]), f"run.output_dir={run_dir}", "--no-progress", "--json", *extra,
            *([f"--stop-after-steps={stop}"] if stop else []), *(["--resume"] if resume else [])]


def _two_ranks(*commands) -> subprocess.CompletedProcess:
    """``commands`` in one 2-rank torchrun launch (tests/offload_runs.py: cli_runs.py that also prints what FSDP2
    holds after each run wraps its forward)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump([[str(a) for a in argv] for argv in commands], fh)
    script = str(Path(__file__).with_name("offload_runs.py"))
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               script, fh.name], capture_output=True, text=True, timeout=400,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        os.unlink(fh.name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(world):
    """One process (plain, with TR-DPO's sync, and LoRA over a 4-bit base), then in one 2-rank launch: FSDP2 without
    offload, with offload, with offload stopped after step 3 and resumed, with offload and the sync, and FSDP2 over
    the 4-bit base stopped after step 1 and resumed."""
    names = ("one", "one-sync", "one-4bit", "fsdp2", "offload", "cut", "offload-sync", "fsdp2-4bit")
    r = {n: world["root"] / n for n in names}
    run_here(_args(world, r["one"]), _args(world, r["one-sync"], *SYNC), _args(world, r["one-4bit"], *QLORA))
    four_bit = (*QLORA, "distributed.strategy=fsdp2")
    proc = _two_ranks(_args(world, r["fsdp2"], "distributed.strategy=fsdp2"), _args(world, r["offload"], *OFFLOAD),
                      _args(world, r["cut"], *OFFLOAD, stop=3), _args(world, r["cut"], *OFFLOAD, resume=True),
                      _args(world, r["offload-sync"], *OFFLOAD, *SYNC), _args(world, r["fsdp2-4bit"], *four_bit, stop=1),
                      _args(world, r["fsdp2-4bit"], *four_bit, resume=True))
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    r["groups"] = [x["fsdp_groups"] for x in lines if "fsdp_groups" in x]
    r["summaries"] = [x for x in lines if "run_dir" in x]
    r["stderr"] = proc.stderr
    return r


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def _losses(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["loss"], m["grad_norm"]) for m in lines if m["split"] == "train"]


def _close(a, b) -> None:
    for (s1, l1, g1), (s2, l2, g2) in zip(_losses(a), _losses(b), strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, abs=1e-6) and g1 == pytest.approx(g2, rel=1e-5)
    w1, w2 = _weights(a), _weights(b)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=ATOL, rtol=0)


def test_offloaded_run_equals_one_process_and_the_run_without_offload(runs):
    """Losses, gradient norms (clipped at 0.5: the norm is summed over the ranks' CPU shards) and the gathered final
    weights."""
    assert max(g for _, _, g in _losses(runs["one"])) > 0.5  # clipping took part
    _close(runs["offload"], runs["one"])
    # on the CPU, offload moves nothing and changes no arithmetic: the same numbers as FSDP2 without it, bit for bit
    assert _losses(runs["offload"]) == _losses(runs["fsdp2"])
    w1, w2 = _weights(runs["offload"]), _weights(runs["fsdp2"])
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


def test_offload_holds_the_policy_and_the_reference_copy_on_the_cpu(runs):
    """FSDP2's own state: every parameter group of the policy and of the reference copy offloads (a group per
    decoder layer and one for the rest); without the key none does."""
    fsdp2, offload = runs["groups"][0], runs["groups"][1]
    assert fsdp2 == {"policy": [3, 0], "reference": [3, 0]}
    assert offload == {"policy": [3, 3], "reference": [3, 3]}
    assert all(g == offload for g in runs["groups"][1:5])  # the stopped, resumed and synced runs too


def test_offloaded_resume_equals_uninterrupted(runs):
    full, cut = runs["offload"], runs["cut"]
    assert "continue with --resume" in runs["stderr"]
    assert (cut / "checkpoints" / "step-00000002" / "dcp").is_dir()  # the sharded (DCP) format
    # the stopped run printed no summary; every other run of the launch printed its own
    assert [(m["run_dir"], m["steps"]) for m in runs["summaries"]] == \
        [(str(runs[n]), s) for n, s in (("fsdp2", 4), ("offload", 4), ("cut", 4), ("offload-sync", 4),
                                          ("fsdp2-4bit", 2))]
    assert _losses(full) == _losses(cut)
    w1, w2 = _weights(full), _weights(cut)
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k


def test_offloaded_reference_sync_equals_one_process(runs):
    """TR-DPO mixes the offloaded policy's and reference's CPU shards in place: equal to one process."""
    assert _losses(runs["one"])[2][1] != pytest.approx(_losses(runs["one-sync"])[2][1], abs=1e-6)  # sync mattered
    _close(runs["offload-sync"], runs["one-sync"])


def test_fsdp2_over_a_four_bit_base_with_lora_equals_one_process_and_resumes(runs):
    """LoRA over a 4-bit (NF4) base sharded by FSDP2 on 2 ranks, stopped after step 1 and resumed: the losses and
    gradient norms of one process, its adapter and its final folder (the adapters merged into the de-quantised
    base, gathered from the shards)."""
    from safetensors.torch import load_file

    one, sharded = runs["one-4bit"], runs["fsdp2-4bit"]
    # FSDP2 did shard the 4-bit policy (the adapter reference runs the policy's own module)
    assert runs["groups"][5:] == [{"policy": [3, 0], "reference": [3, 0]}] * 2
    assert (sharded / "checkpoints" / "step-00000001" / "dcp").is_dir()
    assert len(_losses(one)) == 2 and _losses(one)[-1][1] != _losses(one)[0][1]
    _close(sharded, one)
    a1, a2 = (load_file(str(r / "final" / "adapter" / "adapter_model.safetensors")) for r in (one, sharded))
    assert a1.keys() == a2.keys() and a1
    for k in a1:
        torch.testing.assert_close(a1[k], a2[k], atol=ATOL, rtol=0)


def test_cpu_offload_without_fsdp2_is_refused_in_one_line(world):
    cfg = load_config(world["conf"], ["distributed.cpu_offload=true"])
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    msg = str(err.value)
    assert "\n" not in msg and "distributed.cpu_offload" in msg and "distributed.strategy=fsdp2" in msg
    load_config(world["conf"], list(OFFLOAD)).validate()  # with fsdp2 the config is valid


def test_cpu_offload_in_one_process_is_refused_before_loading(world, tmp_path, capsys):
    """One process has no FSDP2 to offload: refused in one line that names what fits one GPU instead, before the
    weights load (a model too big for the device would otherwise fail first, less clearly)."""
    code = cli_main(_args(world, tmp_path / "run", *OFFLOAD))
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1, err
    assert "distributed.cpu_offload" in err and "torchrun" in err and "train.activation_offloading" in err
    assert not (tmp_path / "run" / "final").exists()


def test_eval_with_an_offloading_runs_config_scores_in_one_process(world, tmp_path, capsys):
    """`prefpack eval --config` of a run that offloaded: scoring never wraps for the ranks, so the key does not
    apply there and one process scores as usual."""
    conf = tmp_path / "offload.yaml"
    conf.write_text(world["conf"].read_text() + "distributed: {strategy: fsdp2, cpu_offload: true}\n")
    policy = str(world["root"] / "policy")
    code = cli_main(["eval", "--config", str(conf), "--model", policy, "--ref", policy, "--data",
                     str(world["root"] / "store"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["pairs"] > 0
