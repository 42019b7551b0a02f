"""On-policy rounds with LoRA (prefpack.rounds, issue 40): each round continues the last round's adapter over the
base, which is never rewritten, and samples base + adapter; a kill in training resumes to the uninterrupted run's
adapter; the reference modes adapter and precomputed give the same losses (both are the base model)."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from prefpack.config import ConfigError, load_config
from prefpack.generation.run import GenerateOptions, generate
from prefpack.rounds import RoundsInterrupted, run_rounds
from tests.conftest import quiet, read_jsonl
from tests.test_rounds import overrides, task  # noqa: F401  (the module's task fixture, built again here)

LORA = ("lora.enabled=true", "lora.r=4", "lora.alpha=8", "rounds.steps_per_round=4", "rounds.eval_prompts=null")


def lora_config(task, run: str, *extra: str):  # noqa: F811
    return load_config(None, overrides(task, run, *LORA, *extra))


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train_losses(run_dir) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if x["split"] == "train"]


@pytest.fixture(scope="module")
def lora_run(task, one_thread):  # noqa: F811
    base = digest(task / "init" / "model.safetensors")
    result = run_rounds(lora_config(task, "lora", "reference.mode=adapter"), log=quiet, progress=False)
    return result, base


def test_lora_rounds_continue_the_adapter_over_an_unchanged_base(lora_run, task):  # noqa: F811
    result, base = lora_run
    assert digest(task / "init" / "model.safetensors") == base  # the base is never rewritten
    run = task / "lora"
    first, second = (run / "rounds" / f"{r:03d}" / "train" / "final" / "adapter" for r in (1, 2))
    assert (first / "adapter_config.json").is_file() and (second / "adapter_config.json").is_file()
    losses = train_losses(run)
    assert len(losses) == 8
    # a fresh adapter (B = 0) is the reference: round 1's first DPO loss is exactly ln 2; round 2 continues round 1's
    # trained adapter against the same base reference, so its first loss is not
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(losses[4] - math.log(2)) > 1e-3


def test_round_two_samples_base_plus_the_round_one_adapter(lora_run, task, tmp_path):  # noqa: F811
    run = task / "lora"
    samples = read_jsonl(run / "rounds" / "002" / "samples.jsonl")
    adapter = run / "rounds" / "001" / "train" / "final" / "adapter"

    def standalone(name: str, **extra) -> list:
        opts = GenerateOptions(output=str(tmp_path / name), model=str(task / "init"),
                               inputs=[str(task / "prompts.jsonl")], n=4, max_new_tokens=1, seed=1, batch_size=4,
                               device="cpu", **extra)
        generate(opts, log=quiet)
        return [r["completion_ids"] for r in read_jsonl(tmp_path / name)]

    assert [r["completion_ids"] for r in samples] == standalone("adapter.jsonl", adapter=str(adapter))
    assert [r["completion_ids"] for r in samples] != standalone("base.jsonl")  # the adapter changed what is sampled


def test_resume_after_a_kill_in_training_equals_the_uninterrupted_lora_run(lora_run, task):  # noqa: F811
    from safetensors.torch import load_file

    cfg = lora_config(task, "lora_resumed", "reference.mode=adapter", "run.save_every=2")
    with pytest.raises(RoundsInterrupted):
        run_rounds(cfg, log=quiet, progress=False, stop_at=(1, "train", 3))
    run_rounds(cfg, resume=True, log=quiet, progress=False)
    # run.save_every differs from the uninterrupted run's only in when checkpoints are written
    for name in ("samples.jsonl", "store/tokens.bin"):
        assert (task / "lora" / "rounds" / "002" / name).read_bytes() == \
            (task / "lora_resumed" / "rounds" / "002" / name).read_bytes()
    a, b = (load_file(str(task / run / "rounds" / "002" / "train" / "final" / "adapter" / "adapter_model.safetensors"))
            for run in ("lora", "lora_resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_precomputed_reference_in_lora_rounds_gives_the_adapter_references_losses(lora_run, task):  # noqa: F811
    """Both references are the base model (rounds.reference initial): one computed live with the adapter off, one
    read from each round's sidecar, computed before the round trains."""
    run_rounds(lora_config(task, "lora_pre", "reference.mode=precomputed"), log=quiet, progress=False)
    sidecars = list((task / "lora_pre" / "rounds" / "002" / "store").glob("ref_logps*.safetensors"))
    assert len(sidecars) == 1
    assert train_losses(task / "lora_pre") == pytest.approx(train_losses(task / "lora"), abs=1e-5)


@pytest.mark.parametrize("extra, words", [
    (("reference.mode=adapter", "rounds.reference=round_start"), "the adapter-off model is the initial base"),
    (("reference.mode=precomputed", "rounds.reference=round_start", "data.eval=x"), "one sidecar cannot hold"),
])
def test_reference_combinations_that_cannot_be_right_are_refused(task, extra, words):  # noqa: F811
    with pytest.raises(ConfigError, match=words):
        lora_config(task, "refused", *extra).validate(training=False)


def test_precomputed_round_start_reference_gives_the_copied_references_losses(task, one_thread):  # noqa: F811
    """All weights trained, rounds.reference round_start: round 2's sidecar is computed with round 1's final model,
    and every loss equals the run holding that model as a frozen copy (in one process, each round's sidecar computed
    with the policy in memory at the round's start)."""
    losses = {}
    for mode in ("copy", "precomputed"):
        run = f"full_{mode}"
        run_rounds(load_config(None, overrides(task, run, f"reference.mode={mode}", "rounds.reference=round_start",
                                               "rounds.steps_per_round=2", "rounds.eval_prompts=null",
                                               "rounds.optimizer=reset")),
                   log=quiet, progress=False)
        losses[mode] = train_losses(task / run)
    assert len(losses["copy"]) == 4 and losses["copy"][2] == pytest.approx(math.log(2), abs=1e-6)
    assert losses["precomputed"] == pytest.approx(losses["copy"], abs=1e-5)
