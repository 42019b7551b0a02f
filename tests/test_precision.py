"""Mixed precision on CPU: bfloat16 compute (autocast) over float32 master weights keeps the updates that pure
bfloat16 weights round away, tracks float32's losses, starts from the reference exactly, and resumes exactly."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import cfg_for, final_weights, metrics_lines
from safetensors.torch import load_file
from test_train import world as world  # noqa: F401 - a module-scoped fixture shared with test_train

from prefpack.config import ConfigError
from prefpack.precision import lost_update_fraction, resolve_precision
from prefpack.training import TrainingInterrupted, train

CPU = torch.device("cpu")


def _run(world, run_dir, *extra, log=None, **kw):  # noqa: F811
    cfg = cfg_for(world, run_dir, "train.device=cpu", *extra)
    return train(cfg, log=log or (lambda m: None), progress=False, **kw)


def _changed_fraction(world, run_dir, dtype):
    """Fraction of weights that differ from the initial ones as the run held them (rounded to ``dtype``)."""
    start = load_file(str(world["policy"] / "model.safetensors"))
    end = final_weights(run_dir)
    changed = total = 0
    for name, w0 in start.items():
        w1 = end[name].to(dtype)
        changed += int((w1 != w0.to(dtype)).sum())
        total += w0.numel()
    return changed / total


def test_resolve_precision():
    cuda = torch.device("cuda")
    p = resolve_precision("auto", "auto", cuda)
    assert (p.weights, p.compute, p.autocast) == (torch.float32, torch.bfloat16, True)
    assert resolve_precision("auto", "auto", CPU).compute == torch.float32
    pure = resolve_precision("bfloat16", "bfloat16", CPU)
    assert (pure.weights, pure.autocast) == (torch.bfloat16, False)
    lora = resolve_precision("bfloat16", "auto", CPU, lora=True)
    assert (lora.weights, lora.autocast) == (torch.bfloat16, True)  # frozen base in bf16, peft keeps adapters fp32
    fsdp = resolve_precision("bfloat16", "auto", cuda, fsdp_sharded=True)
    assert (fsdp.weights, fsdp.compute, fsdp.autocast, fsdp.sharded_mixed) == (torch.float32, torch.bfloat16,
                                                                                False, True)
    assert resolve_precision("float16", "auto", cuda).weights == torch.float16  # inference only


def test_lost_update_fraction_formula():
    # bf16 keeps 8 significant bits: 1.0 has ulp 2^-7, so an update of 2^-9 (a quarter ulp) rounds away and one
    # of 2^-7 does not; 2^-12 sits at ulp 2^-19, so 2^-9 survives there.
    w = torch.tensor([1.0, 2.0**-12, 0.0, -1.0])
    assert lost_update_fraction([w], 2.0**-9) == pytest.approx(2 / 4)
    assert lost_update_fraction([w], 2.0**-7) == 0.0
    # the definition, checked by doing it: add lr in bfloat16 and see what stays
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10000, generator=g) * 0.02
    lr = 5e-7
    kept = ((x.bfloat16() + torch.tensor(lr, dtype=torch.bfloat16)) != x.bfloat16()).float().mean().item()
    assert lost_update_fraction([x.bfloat16()], lr) == pytest.approx(1 - kept, abs=0.01)


def test_mixed_precision_keeps_updates_that_pure_bfloat16_loses(world, tmp_path):  # noqa: F811
    """3 steps at lr 5e-7 (the default lr): float32 masters under bf16 autocast change as many weights as float32
    does; bfloat16 weights keep only a few of the updates (measured 0.49% on the GPU issue's 2L/128h model)."""
    lr = "optim.lr=5.0e-7"
    _run(world, tmp_path / "f32", lr, "model.dtype=float32")
    _run(world, tmp_path / "mixed", lr, "model.dtype=bfloat16")
    _run(world, tmp_path / "pure", lr, "model.dtype=bfloat16", "optim.master_dtype=bfloat16")
    f32 = _changed_fraction(world, tmp_path / "f32", torch.float32)
    mixed = _changed_fraction(world, tmp_path / "mixed", torch.float32)
    pure = _changed_fraction(world, tmp_path / "pure", torch.bfloat16)
    print(f"changed weights after 3 steps at lr 5e-7: float32 {f32:.2%}, bf16 autocast + float32 masters "
          f"{mixed:.2%}, pure bf16 {pure:.2%}")
    assert f32 > 0.5, f32
    assert mixed >= 0.95 * f32, (mixed, f32)
    assert pure < 0.1 * f32, (pure, f32)


def test_mixed_losses_track_float32_and_start_at_ln2(world, tmp_path):  # noqa: F811
    _run(world, tmp_path / "f32", "model.dtype=float32", "train.max_steps=4")
    _run(world, tmp_path / "mixed", "model.dtype=bfloat16", "train.max_steps=4")
    f32 = [m["loss"] for m in metrics_lines(tmp_path / "f32")]
    mixed = [m["loss"] for m in metrics_lines(tmp_path / "mixed")]
    # the copied reference runs exactly as the policy (float32 weights, same autocast): identical at step 0
    assert mixed[0] == pytest.approx(math.log(2), abs=1e-7)
    print("losses float32", f32, "bf16 mixed", mixed)
    assert len(f32) == len(mixed) == 4
    for a, b in zip(f32, mixed):
        assert abs(a - b) < 1e-3, (f32, mixed)  # measured 1.4e-4; the GPU target is 5e-3


def test_pure_bfloat16_warns_with_the_lost_fraction(world, tmp_path):  # noqa: F811
    lines = []
    _run(world, tmp_path / "pure", "model.dtype=bfloat16", "optim.master_dtype=bfloat16", "train.max_steps=1",
         log=lines.append)
    warning = [x for x in lines if "master_dtype=bfloat16" in x]
    assert len(warning) == 1 and "rounded away" in warning[0] and "%" in warning[0]
    info = [x for x in lines if x.startswith("budgets (")]
    assert info and "bfloat16 weights and compute" in info[0] and "cpu defaults" in info[0]


def test_resume_from_a_mixed_precision_checkpoint_equals_uninterrupted(world, tmp_path):  # noqa: F811
    extra = ("model.dtype=bfloat16", "run.save_every=1", "train.max_steps=3")
    _run(world, tmp_path / "full", *extra)
    with pytest.raises(TrainingInterrupted):
        _run(world, tmp_path / "cut", *extra, stop_after_steps=2)
    _run(world, tmp_path / "cut", *extra, resume=True)
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())  # masters checkpointed, saved in the source dtype


def test_save_dtype(world, tmp_path):  # noqa: F811
    _run(world, tmp_path / "bf16", "model.dtype=bfloat16", "train.max_steps=1", "run.save_dtype=bfloat16")
    assert {v.dtype for v in final_weights(tmp_path / "bf16").values()} == {torch.bfloat16}


def test_float16_training_is_refused(world, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match="float16 cannot train"):
        _run(world, tmp_path / "fp16", "model.dtype=float16")


def test_lora_in_bfloat16_keeps_float32_adapters_and_learns(world, tmp_path):  # noqa: F811
    """LoRA: the frozen base runs in bfloat16, the trained adapters stay float32 under autocast."""
    lines = []
    res = _run(world, tmp_path / "lora", "model.dtype=bfloat16", "lora.enabled=true", "reference.mode=adapter",
               "lora.r=4", "train.max_steps=4", "optim.lr=5.0e-3", log=lines.append)
    assert any("bfloat16 frozen base weights, float32 LoRA adapters" in x for x in lines), lines
    losses = [m["loss"] for m in metrics_lines(tmp_path / "lora")]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6) and losses[-1] < losses[0]
    from prefpack.training import build

    setup = build(cfg_for(world, tmp_path / "b", "train.device=cpu", "model.dtype=bfloat16", "lora.enabled=true",
                          "reference.mode=adapter"), log=lambda m: None)
    dtypes = {p.requires_grad: p.dtype for p in setup.policy.parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}
    # the source checkpoint is float32, so run.save_dtype auto saves the merged model in float32
    assert {v.dtype for v in load_file(str(res.final_dir / "model.safetensors")).values()} == {torch.float32}


def test_describe_names_four_bit_base_weights():
    """A 4-bit base is not described as full-precision weights (the start-up line, issue 41)."""
    from prefpack.precision import Precision

    four = Precision(torch.float32, torch.float32, four_bit="fp4")
    assert four.describe() == "4-bit FP4 base weights, embeddings, norms and head float32, compute float32, LoRA " \
        "adapters float32"
    assert Precision(torch.float32, torch.float32).describe() == "float32 weights and compute"
