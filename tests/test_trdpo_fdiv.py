"""Issue 14 item 2: f-DPO divergences (loss.f_divergence_type) and TR-DPO reference syncing (reference.sync)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import cfg_for, final_weights, log_sigmoid, metrics_lines
from test_train import world  # noqa: F401 - a module-scoped fixture shared with test_train

from prefpack.config import Config, ConfigError, load_config
from prefpack.losses import (
    F_DIVERGENCE_LOSSES,
    PAIR_LOSSES,
    LossTerm,
    PairLogps,
    f_divergence_scores,
    preference_loss,
    sigmoid_loss,
)
from prefpack.training import TrainingInterrupted, train

DT = torch.float64
# (policy chosen, policy rejected, ref chosen, ref rejected, chosen tokens, rejected tokens)
ROWS = [(-12.0, -15.5, -13.0, -14.0, 4, 6), (-30.2, -22.1, -29.0, -25.0, 9, 7), (-5.0, -5.0, -5.0, -5.0, 3, 3),
        (-40.0, -80.0, -41.5, -70.0, 12, 20), (-7.25, -9.5, -6.0, -12.0, 2, 5), (-18.0, -3.0, -20.0, -4.5, 8, 1)]


def logps(rows=ROWS, dtype=DT) -> PairLogps:
    col = list(zip(*rows))
    t = [torch.tensor(c, dtype=dtype) for c in col[:4]]
    return PairLogps(t[0], t[1], torch.tensor(col[4]), torch.tensor(col[5]), t[2], t[3])


# ------------------------------------------------------------------ f-divergence: formulas written out in u = pi/ref


def f_prime(u: float, kind: str, alpha: float) -> float:
    """f'(u) of Wang et al. 2023 (arXiv:2309.16240), Table 1, in TRL 1.16's parametrisation of alpha."""
    if kind == "reverse_kl":
        return math.log(u)
    if kind == "forward_kl":
        return 1.0 - 1.0 / u
    if kind == "js_divergence":
        return math.log(2.0 * u / (1.0 + u))
    if kind == "alpha_divergence":
        return (u ** (alpha - 1.0) - 1.0) / (alpha - 1.0)
    raise AssertionError(kind)


def expected(name: str, kind: str, alpha: float, beta: float, eps: float = 0.0) -> torch.Tensor:
    ls = log_sigmoid
    out = []
    for pc, pr, rc, rr, nc, nr in ROWS:
        sc, sr = f_prime(math.exp(pc - rc), kind, alpha), f_prime(math.exp(pr - rr), kind, alpha)
        z = beta * (sc - sr)
        if name == "sigmoid":
            out.append(-ls(z))
        elif name == "hinge":
            out.append(max(0.0, 1.0 - z))
        elif name == "ipo":
            out.append((sc / nc - sr / nr - 1.0 / (2.0 * beta)) ** 2)
        elif name == "robust":
            out.append((-(1 - eps) * ls(z) + eps * ls(-z)) / (1 - 2 * eps))
        else:
            raise AssertionError(name)
    return torch.tensor(out, dtype=DT)


KINDS = [("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.5), ("alpha_divergence", 0.3),
         ("alpha_divergence", 1.7), ("reverse_kl", 0.5)]


@pytest.mark.parametrize("kind,alpha", KINDS)
@pytest.mark.parametrize("name", ["sigmoid", "hinge", "ipo", "robust"])
def test_f_divergence_matches_the_written_out_formula(name, kind, alpha):
    eps = 0.1 if name == "robust" else 0.0
    out = preference_loss(logps(), [LossTerm(name)], beta=0.3, label_smoothing=eps, f_divergence_type=kind,
                          f_alpha_divergence_coef=alpha)
    torch.testing.assert_close(out.loss, expected(name, kind, alpha, 0.3, eps), rtol=1e-12, atol=1e-12)
    # the reward metrics stay beta * log-ratio, as in TRL
    torch.testing.assert_close(out.metrics["rewards/chosen"], 0.3 * (logps().policy_chosen - logps().ref_chosen))


def test_reverse_kl_is_plain_dpo_bitwise():
    for dtype in (torch.float32, DT, torch.bfloat16):
        lp = logps(dtype=dtype)
        plain = preference_loss(lp, [LossTerm("sigmoid")], beta=0.2).loss
        for kind, alpha in (("reverse_kl", 0.5), ("alpha_divergence", 1.0)):  # alpha -> 1 is the reverse_kl limit
            got = preference_loss(lp, [LossTerm("sigmoid")], beta=0.2, f_divergence_type=kind,
                                  f_alpha_divergence_coef=alpha).loss
            assert torch.equal(got, plain)
        direct = sigmoid_loss(lp.policy_chosen - lp.ref_chosen, lp.policy_rejected - lp.ref_rejected, 0.2)
        assert torch.equal(plain, direct)


def test_alpha_divergence_caps_like_trl_and_keeps_half_precision():
    x = torch.tensor([-200.0, 0.0, 3.0], requires_grad=True)  # t = -0.5 * -200 = 100 is capped at 80
    s = f_divergence_scores(x, "alpha_divergence", 0.5)
    assert torch.isfinite(s).all()
    assert s[0].item() == pytest.approx((math.exp(80.0) - 1.0) / -0.5, rel=1e-6)
    s.sum().backward()
    assert x.grad[0] == 0 and x.grad[2] == pytest.approx(math.exp(-1.5), rel=1e-6)  # d/dx (e^{-x/2}-1)/(-1/2)
    # float16: t is capped at 11 (exp(11) < 65504), computed in float32 and cast back, as in TRL. (As in TRL the
    # cap ignores the factor 1/(alpha-1): with |1/(alpha-1)| > 1.09 a capped float16 score still overflows.)
    h = f_divergence_scores(torch.tensor([30.0, 1.0], dtype=torch.float16), "alpha_divergence", 2.0)
    assert h.dtype == torch.float16 and torch.isfinite(h).all()
    assert h[0].item() == pytest.approx(math.exp(11.0) - 1.0, rel=1e-3)


def test_trl_list_of_f_divergence_losses_and_refusals():
    assert F_DIVERGENCE_LOSSES == {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop"}
    for name in ("apo_zero", "bco_pair", "nca_pair", "sppo_hard", "aot", "simpo", "sigmoid_ref_free"):
        with pytest.raises(ValueError, match="no f-divergence form"):
            preference_loss(logps(), [LossTerm(name)], f_divergence_type="js_divergence")
    out = preference_loss(logps(), [LossTerm("sigmoid"), LossTerm("nll", 0.2)], f_divergence_type="js_divergence")
    assert torch.isfinite(out.loss).all()
    assert set(PAIR_LOSSES) >= F_DIVERGENCE_LOSSES


def _problems(*overrides):
    cfg = load_config(None, list(overrides))
    try:
        cfg.validate(training=False)
    except ConfigError as exc:
        return str(exc)
    return ""


def test_config_f_divergence():
    cfg = Config()
    assert (cfg.loss.f_divergence_type, cfg.loss.f_alpha_divergence_coef) == ("reverse_kl", 0.5)
    assert _problems("loss.f_divergence_type=alpha_divergence", "loss.f_alpha_divergence_coef=0.3") == ""
    assert _problems("loss.f_divergence_type=js_divergence", "loss.terms=[{name: sigmoid}, {name: nll}]") == ""
    assert "no f-divergence form" in _problems("loss.f_divergence_type=js_divergence", "loss.terms=[{name: apo_zero}]")
    assert "no f-divergence form" in _problems("loss.f_divergence_type=forward_kl", "loss.terms=[{name: kto}]")
    with pytest.raises(ConfigError, match="did you mean 'js_divergence'"):
        load_config(None, ["loss.f_divergence_type=js_divergnce"])


# ------------------------------------------------------------------ TR-DPO: config


def test_config_sync_refusals():
    assert _problems("reference.sync=true") == ""
    assert "reference.mode 'copy'" in _problems("reference.sync=true", "reference.mode=precomputed")
    assert "reference.mode 'copy'" in _problems("reference.sync=true", "reference.mode=adapter", "lora.enabled=true")
    assert "reference.mode 'copy'" in _problems("reference.sync=true", "reference.mode=none",
                                                 "loss.terms=[{name: simpo}]")
    assert "lora.enabled" in _problems("reference.sync=true", "lora.enabled=true")
    assert "no loss term reads the reference" in _problems("reference.sync=true", "loss.terms=[{name: simpo}]")
    assert "mixup_alpha must be in (0, 1]" in _problems("reference.sync=true", "reference.mixup_alpha=0")
    assert "mixup_alpha must be in (0, 1]" in _problems("reference.sync=true", "reference.mixup_alpha=1.5")
    assert "sync_steps must be >= 1" in _problems("reference.sync=true", "reference.sync_steps=0")
    cfg = load_config(None, ["reference.sync_steps=4"])
    assert any("reference.sync is false" in w for w in cfg.warnings())
    assert (Config().reference.mixup_alpha, Config().reference.sync_steps) == (0.6, 512)  # TRL's defaults


# ------------------------------------------------------------------ TR-DPO: training


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_sync_happens_at_the_configured_steps_with_the_formula(world, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    alpha = 0.6
    train(cfg_for(world, run, f"reference.model={world['ref']}", "reference.sync=true", "reference.sync_steps=2",
                  f"reference.mixup_alpha={alpha}", "train.max_steps=5", "run.save_every=1", "run.keep_checkpoints=5"),
          progress=False, log=lambda m: None)
    ckpt = {k: run / "checkpoints" / f"step-{k:08d}" for k in (1, 2, 3, 4)}
    pol = {k: _load(p / "model.safetensors") for k, p in ckpt.items()}
    ref = {k: _load(p / "reference.safetensors") for k, p in ckpt.items()}
    ref0 = _load(world["ref"] / "model.safetensors")
    for p in ckpt.values():
        assert "reference.safetensors" in json.loads((p / "checksums.json").read_text())["files"]
    keys = sorted(ref[1])
    assert keys and all(k in ref0 for k in keys)
    prev = {k: ref0[k] for k in keys}
    for step in (1, 2, 3, 4):
        for k in keys:
            if step % 2:  # no sync after steps 1 and 3
                assert torch.equal(ref[step][k], prev[k]), (step, k)
                continue
            want32 = prev[k].clone().mul_(1.0 - alpha).add_(pol[step][k], alpha=alpha)  # TRL's in-place ops
            assert torch.equal(ref[step][k], want32), (step, k)
            want64 = alpha * pol[step][k].double() + (1.0 - alpha) * prev[k].double()
            torch.testing.assert_close(ref[step][k].double(), want64, rtol=1e-6, atol=1e-7)
            assert not torch.equal(ref[step][k], prev[k]) or torch.equal(pol[step][k], prev[k])
        prev = ref[step]
    assert any(not torch.equal(ref[4][k], ref0[k]) for k in keys)


def test_trl_callback_gives_the_same_update():
    trl_callbacks = pytest.importorskip("trl.trainer.callbacks")
    from torch import nn

    from prefpack.reference import sync_reference

    torch.manual_seed(0)
    a, b = nn.Linear(5, 3), nn.Linear(5, 3)
    a2, b2 = nn.Linear(5, 3), nn.Linear(5, 3)
    a2.load_state_dict(a.state_dict())
    b2.load_state_dict(b.state_dict())
    trl_callbacks.SyncRefModelCallback._sync_target_model(a, b, 0.6)  # (model, target, alpha)
    assert sync_reference(a2, b2, 0.6) == 2
    for p, q in zip(b.parameters(), b2.parameters()):
        assert torch.equal(p, q)


def test_sync_run_lowers_the_loss(world, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    train(cfg_for(world, run, "reference.sync=true", "reference.sync_steps=2", "train.max_steps=8",
                  "train.global_batch_pairs=24"), progress=False, log=lambda m: None)
    losses = [m["loss"] for m in metrics_lines(run)]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert losses[-1] < losses[0] - 0.05


def test_resume_between_syncs_equals_uninterrupted(world, tmp_path):  # noqa: F811
    full, broken = tmp_path / "full", tmp_path / "broken"
    args = ("reference.sync=true", "reference.sync_steps=2", "train.max_steps=6", "run.save_every=3")
    train(cfg_for(world, full, *args), progress=False, log=lambda m: None)
    with pytest.raises(TrainingInterrupted):
        train(cfg_for(world, broken, *args), stop_after_steps=4, progress=False, log=lambda m: None)
    step3 = broken / "checkpoints" / f"step-{3:08d}"
    policy0 = _load(world["policy"] / "model.safetensors")
    saved_ref = _load(step3 / "reference.safetensors")
    assert any(not torch.equal(saved_ref[k], policy0[k]) for k in saved_ref)  # synced at step 2: not the start
    train(cfg_for(world, broken, *args), resume=True, progress=False, log=lambda m: None)
    wa, wb = final_weights(full), final_weights(broken)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    la, lb = metrics_lines(full), metrics_lines(broken)
    assert [m["step"] for m in lb] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in la] == [m["loss"] for m in lb]
