"""Tests for prefpack.losses: every loss against an independent float64 formula written out with `math`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import log_sigmoid

from prefpack.losses import (
    LENGTH_NORMALISED_LOSSES,
    LOSS_NAMES,
    REFERENCE_FREE_LOSSES,
    LossTerm,
    PairLogps,
    apo_down_loss,
    apo_zero_loss,
    bco_pair_loss,
    hinge_loss,
    ipo_loss,
    needs_reference,
    nll_loss,
    orpo_loss,
    preference_loss,
    robust_loss,
    sigmoid_loss,
    simpo_loss,
)

DT = torch.float64

# --------------------------------------------------------------------------------------------------------
# Reference math (scalars, plain `math`), independent of torch and of the code under test.
# --------------------------------------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def log_odds(mean_logp: float) -> float:
    p = math.exp(mean_logp)
    return math.log(p / (1.0 - p)) if p > 1e-300 else mean_logp  # log(p/(1-p)) ~ log p when p ~ 0


# Each row: (policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens).
HAND_ROWS = [
    (-10.0, -12.0, -11.0, -11.5, 5, 7),
    (-3.2, -1.1, -2.0, -2.5, 1, 2),
    (-50.0, -49.0, -50.0, -49.0, 20, 20),  # zero margin
    (-1.0e4, -10.0, -10.0, -1.0e4, 100, 3),  # huge negative margin
    (-5.0, -9000.0, -7000.0, -5.0, 4, 900),  # huge positive margin
]


def random_rows(n: int, seed: int) -> list[tuple[float, float, float, float, int, int]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        nc, nr = (int(v) for v in rng.integers(1, 64, size=2))
        pc = -nc * float(rng.uniform(0.02, 3.0))
        pr = -nr * float(rng.uniform(0.02, 3.0))
        rows.append((pc, pr, pc + float(rng.normal(0, 4)), pr + float(rng.normal(0, 4)), nc, nr))
    return rows


ROWS = HAND_ROWS + random_rows(8, seed=0)


def pair_logps(rows, *, with_ref: bool = True, grad: bool = False, dtype=DT) -> PairLogps:
    cols = list(zip(*rows))

    def t(i, requires_grad=False):
        return torch.tensor(cols[i], dtype=dtype, requires_grad=requires_grad)

    return PairLogps(
        policy_chosen=t(0, grad),
        policy_rejected=t(1, grad),
        chosen_tokens=torch.tensor(cols[4], dtype=torch.long),
        rejected_tokens=torch.tensor(cols[5], dtype=torch.long),
        ref_chosen=t(2, grad) if with_ref else None,  # ref given requires_grad to prove it gets no gradient
        ref_rejected=t(3, grad) if with_ref else None,
    )


# One independent formula per loss name: f(row, beta, eps, gamma, delta) -> float.
def f_sigmoid(r, b, eps, g, d):
    h = (r[0] - r[2]) - (r[1] - r[3])
    return -(1 - eps) * log_sigmoid(b * h) - eps * log_sigmoid(-b * h)


def f_sigmoid_ref_free(r, b, eps, g, d):
    h = r[0] - r[1]
    return -(1 - eps) * log_sigmoid(b * h) - eps * log_sigmoid(-b * h)


def f_robust(r, b, eps, g, d):
    h = (r[0] - r[2]) - (r[1] - r[3])
    return (-(1 - eps) * log_sigmoid(b * h) + eps * log_sigmoid(-b * h)) / (1 - 2 * eps)


def f_ipo(r, b, eps, g, d):
    h = (r[0] - r[2]) / r[4] - (r[1] - r[3]) / r[5]
    return (h - 1 / (2 * b)) ** 2


def f_hinge(r, b, eps, g, d):
    return max(0.0, 1 - b * ((r[0] - r[2]) - (r[1] - r[3])))


def f_bco_pair(r, b, eps, g, d):  # TRL 1.16: no reward shift (the caller's delta is ignored)
    return -log_sigmoid(b * (r[0] - r[2])) - log_sigmoid(-(b * (r[1] - r[3])))


def f_bco_pair_running(r, b, eps, g, d):
    return -log_sigmoid(b * (r[0] - r[2]) - d) - log_sigmoid(-(b * (r[1] - r[3]) - d))


def f_apo_zero(r, b, eps, g, d):
    return (1 - sigmoid(b * (r[0] - r[2]))) + sigmoid(b * (r[1] - r[3]))


def f_apo_down(r, b, eps, g, d):
    c, rj = r[0] - r[2], r[1] - r[3]
    return sigmoid(b * c) + (1 - sigmoid(b * (c - rj)))


def f_simpo(r, b, eps, g, d):
    x = b * (r[0] / r[4] - r[1] / r[5]) - g
    return -(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x)


def f_orpo(r, b, eps, g, d):
    mc, mr = r[0] / r[4], r[1] / r[5]
    return -mc + b * -log_sigmoid(log_odds(mc) - log_odds(mr))


def f_nll(r, b, eps, g, d):
    return -r[0] / r[4]


FORMULAS = {
    "sigmoid": f_sigmoid,
    "sigmoid_ref_free": f_sigmoid_ref_free,
    "robust": f_robust,
    "ipo": f_ipo,
    "hinge": f_hinge,
    "bco_pair": f_bco_pair,
    "bco_pair_running": f_bco_pair_running,
    "apo_zero": f_apo_zero,
    "apo_down": f_apo_down,
    "simpo": f_simpo,
    "orpo": f_orpo,
    "nll": f_nll,
}


def expected(name, rows, beta=0.1, eps=0.0, gamma=0.5, delta=0.0) -> torch.Tensor:
    return torch.tensor([FORMULAS[name](r, beta, eps, gamma, delta) for r in rows], dtype=DT)


def close(actual: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(actual, want, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------------------


def test_every_loss_has_a_reference_formula():
    from test_losses_trl import FORMULAS as TRL_FORMULAS  # the TRL 1.16 losses of issue 14, tested there

    assert set(FORMULAS) | set(TRL_FORMULAS) == set(LOSS_NAMES)


@pytest.mark.parametrize("name", sorted(FORMULAS))
@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_loss_matches_formula(name, beta):
    eps = 0.2 if name in ("sigmoid", "sigmoid_ref_free", "robust", "simpo") else 0.0
    out = preference_loss(
        pair_logps(ROWS),
        [LossTerm(name, 1.0)],
        beta=beta,
        label_smoothing=eps,
        simpo_gamma=0.3,
        bco_delta=0.25,
    )
    want = expected(name, ROWS, beta=beta, eps=eps, gamma=0.3, delta=0.25)
    assert out.loss.shape == (len(ROWS),)
    assert torch.isfinite(out.loss).all()
    close(out.loss, want)
    close(out.metrics[f"loss/{name}"], want)


def test_individual_functions_match_formulas():
    lp = pair_logps(ROWS)
    cl, rl = lp.policy_chosen - lp.ref_chosen, lp.policy_rejected - lp.ref_rejected
    pc, pr, nc, nr = lp.policy_chosen, lp.policy_rejected, lp.chosen_tokens, lp.rejected_tokens
    b = 0.3
    close(sigmoid_loss(cl, rl, b), expected("sigmoid", ROWS, b))
    close(sigmoid_loss(cl, rl, b, 0.1), expected("sigmoid", ROWS, b, eps=0.1))
    close(sigmoid_loss(pc, pr, b), expected("sigmoid_ref_free", ROWS, b))
    close(robust_loss(cl, rl, b, 0.1), expected("robust", ROWS, b, eps=0.1))
    close(ipo_loss(cl, rl, nc, nr, b), expected("ipo", ROWS, b))
    close(hinge_loss(cl, rl, b), expected("hinge", ROWS, b))
    close(bco_pair_loss(cl, rl, b), expected("bco_pair", ROWS, b, delta=0.0))
    close(bco_pair_loss(cl, rl, b, torch.tensor(-0.4, dtype=DT)), expected("bco_pair_running", ROWS, b, delta=-0.4))
    close(apo_zero_loss(cl, rl, b), expected("apo_zero", ROWS, b))
    close(apo_down_loss(cl, rl, b), expected("apo_down", ROWS, b))
    close(simpo_loss(pc, pr, nc, nr, b, 1.2), expected("simpo", ROWS, b, gamma=1.2))
    close(orpo_loss(pc, pr, nc, nr, b), expected("orpo", ROWS, b))
    close(nll_loss(pc, nc), expected("nll", ROWS))


def test_hand_values():
    """A few values worked out by hand, so the reference formulas themselves are pinned down."""
    row = [(-1.0, -3.0, -2.0, -2.0, 2, 4)]  # chosen logratio 1, rejected -1, h = 2
    lp = pair_logps(row)
    one = lambda name, **kw: preference_loss(lp, [LossTerm(name)], beta=0.5, **kw).loss.item()  # noqa: E731
    assert one("sigmoid") == pytest.approx(math.log(1 + math.exp(-1.0)), rel=1e-12)
    assert one("hinge") == pytest.approx(0.0, abs=1e-15)  # 1 - 0.5 * 2 = 0
    # ipo: h_tok = 1/2 - (-1)/4 = 0.75, target 1/(2*0.5) = 1 -> 0.0625
    assert one("ipo") == pytest.approx(0.0625, rel=1e-12)
    assert one("nll") == pytest.approx(0.5, rel=1e-12)
    # simpo: 0.5 * (-1/2 - -3/4) - 0.5 = -0.375
    assert one("simpo") == pytest.approx(math.log(1 + math.exp(0.375)), rel=1e-12)


def test_ipo_is_length_normalised():
    """Doubling both completions (same per-token log-ratios) must not change the IPO loss."""
    short = [(-4.0, -6.0, -5.0, -5.0, 2, 3)]
    long = [(-8.0, -12.0, -10.0, -10.0, 4, 6)]
    a = preference_loss(pair_logps(short), [LossTerm("ipo")]).loss
    b = preference_loss(pair_logps(long), [LossTerm("ipo")]).loss
    close(a, b)
    # ...whereas DPO's sigmoid loss on sums does change.
    s = preference_loss(pair_logps(short), [LossTerm("sigmoid")]).loss
    s2 = preference_loss(pair_logps(long), [LossTerm("sigmoid")]).loss
    assert not torch.allclose(s, s2)


def test_sigmoid_ref_free_ignores_reference():
    with_ref = preference_loss(pair_logps(ROWS), [LossTerm("sigmoid_ref_free")]).loss
    without = preference_loss(pair_logps(ROWS, with_ref=False), [LossTerm("sigmoid_ref_free")]).loss
    close(with_ref, without)
    # equals DPO with the reference log-probs set to zero
    zero_ref = [(r[0], r[1], 0.0, 0.0, r[4], r[5]) for r in ROWS]
    close(with_ref, preference_loss(pair_logps(zero_ref), [LossTerm("sigmoid")]).loss)


def test_orpo_at_probability_one_is_finite():
    rows = [(0.0, -2.0, 0.0, 0.0, 3, 2), (-1e-12, -1e-9, 0.0, 0.0, 5, 5)]
    lp = pair_logps(rows, with_ref=False, grad=True)
    out = preference_loss(lp, [LossTerm("orpo")])
    out.loss.sum().backward()
    assert torch.isfinite(out.loss).all()
    assert torch.isfinite(lp.policy_chosen.grad).all() and torch.isfinite(lp.policy_rejected.grad).all()


# --------------------------------------------------------------------------------------------------------
# Label smoothing: cDPO vs robust
# --------------------------------------------------------------------------------------------------------


def test_label_smoothing_zero_is_plain_sigmoid():
    lp = pair_logps(ROWS)
    plain = preference_loss(lp, [LossTerm("sigmoid")]).loss
    close(preference_loss(lp, [LossTerm("sigmoid")], label_smoothing=0.0).loss, plain)
    close(preference_loss(lp, [LossTerm("robust")], label_smoothing=0.0).loss, plain)
    close(plain, expected("sigmoid", ROWS))


@pytest.mark.parametrize("eps", [0.05, 0.3])
def test_robust_and_cdpo_differ_as_the_formulas_say(eps):
    lp = pair_logps(ROWS)
    cdpo = preference_loss(lp, [LossTerm("sigmoid")], label_smoothing=eps).loss
    rob = preference_loss(lp, [LossTerm("robust")], label_smoothing=eps).loss
    # (1 - 2 eps) * robust = cdpo + 2 eps * log sigma(-beta h)
    b_term = torch.tensor([log_sigmoid(-0.1 * ((r[0] - r[2]) - (r[1] - r[3]))) for r in ROWS], dtype=DT)
    close((1 - 2 * eps) * rob, cdpo + 2 * eps * b_term)
    assert not torch.allclose(rob, cdpo)


@pytest.mark.parametrize("eps", [0.1, 0.4])
def test_robust_is_unbiased_under_label_flips(eps):
    """rDPO's defining property: E_flip[robust] = clean DPO loss (Chowdhury et al. 2024)."""
    rows = random_rows(6, seed=1)
    flipped = [(r[1], r[0], r[3], r[2], r[5], r[4]) for r in rows]
    rob = preference_loss(pair_logps(rows), [LossTerm("robust")], label_smoothing=eps).loss
    rob_flip = preference_loss(pair_logps(flipped), [LossTerm("robust")], label_smoothing=eps).loss
    close((1 - eps) * rob + eps * rob_flip, expected("sigmoid", rows))


def test_cdpo_at_half_is_symmetric():
    """With eps = 0.5 the labels carry no information: swapping chosen and rejected leaves the loss unchanged."""
    flipped = [(r[1], r[0], r[3], r[2], r[5], r[4]) for r in ROWS]
    out = preference_loss(pair_logps(ROWS), [LossTerm("sigmoid")], label_smoothing=0.5).loss
    out_flip = preference_loss(pair_logps(flipped), [LossTerm("sigmoid")], label_smoothing=0.5).loss
    close(out, out_flip)
    close(out, expected("sigmoid", ROWS, eps=0.5))


# --------------------------------------------------------------------------------------------------------
# Combination
# --------------------------------------------------------------------------------------------------------


def test_rpo_is_sigmoid_plus_weighted_nll():
    out = preference_loss(pair_logps(ROWS), [LossTerm("sigmoid", 1.0), LossTerm("nll", 0.2)], beta=0.2)
    close(out.loss, expected("sigmoid", ROWS, 0.2) + 0.2 * expected("nll", ROWS))
    close(out.metrics["loss/nll"], expected("nll", ROWS))


def test_combined_terms_equal_weighted_sum():
    terms = [LossTerm("robust", 0.5), LossTerm("ipo", 2.0), LossTerm("apo_zero", 0.25), LossTerm("orpo", 0.0)]
    out = preference_loss(pair_logps(ROWS), terms, beta=0.3, label_smoothing=0.1)
    want = (
        0.5 * expected("robust", ROWS, 0.3, eps=0.1)
        + 2.0 * expected("ipo", ROWS, 0.3)
        + 0.25 * expected("apo_zero", ROWS, 0.3)
    )
    close(out.loss, want)
    close(out.metrics["loss/orpo"], expected("orpo", ROWS, 0.3))  # weight 0: logged, not trained


def test_per_pair_values_do_not_depend_on_batch_split():
    terms = [LossTerm("sigmoid"), LossTerm("simpo", 0.5), LossTerm("bco_pair", 0.5), LossTerm("nll", 0.1)]
    full = preference_loss(pair_logps(ROWS), terms, bco_delta=0.1)
    parts = [
        preference_loss(pair_logps(ROWS[:4]), terms, bco_delta=0.1),
        preference_loss(pair_logps(ROWS[4:]), terms, bco_delta=0.1),
    ]
    close(full.loss, torch.cat([p.loss for p in parts]))
    for key, value in full.metrics.items():
        close(value, torch.cat([p.metrics[key] for p in parts]))


# --------------------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_gradients_reach_policy_not_reference(name):
    rows = ROWS  # includes the large-magnitude rows: gradients must stay finite there too
    lp = pair_logps(rows, grad=True)
    out = preference_loss(lp, [LossTerm(name)], label_smoothing=0.1 if name in ("robust", "exo_pair") else 0.0)
    out.loss.sum().backward()
    assert lp.policy_chosen.grad is not None and torch.isfinite(lp.policy_chosen.grad).all()
    assert lp.policy_chosen.grad.abs().sum() > 0
    if name not in ("nll", "sft"):  # nll and sft only see the chosen completion
        assert lp.policy_rejected.grad is not None and torch.isfinite(lp.policy_rejected.grad).all()
        assert lp.policy_rejected.grad.abs().sum() > 0
    assert lp.ref_chosen.grad is None and lp.ref_rejected.grad is None
    for value in out.metrics.values():
        assert not value.requires_grad


def test_sigmoid_gradient_matches_analytic_form():
    # d/d pc of -log sigma(beta h) = -beta * sigma(-beta h); d/d pr = +beta * sigma(-beta h)
    beta = 0.4
    lp = pair_logps(ROWS, grad=True)
    preference_loss(lp, [LossTerm("sigmoid")], beta=beta).loss.sum().backward()
    s = torch.tensor([sigmoid(-beta * ((r[0] - r[2]) - (r[1] - r[3]))) for r in ROWS], dtype=DT)
    close(lp.policy_chosen.grad, -beta * s)
    close(lp.policy_rejected.grad, beta * s)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_gradcheck(name):
    rows = random_rows(5, seed=2)
    lp = pair_logps(rows)

    def fn(pc, pr):
        inputs = PairLogps(pc, pr, lp.chosen_tokens, lp.rejected_tokens, lp.ref_chosen, lp.ref_rejected)
        return preference_loss(inputs, [LossTerm(name)], beta=0.3, label_smoothing=0.1).loss

    pc = lp.policy_chosen.clone().requires_grad_(True)
    pr = lp.policy_rejected.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(fn, (pc, pr))


# --------------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------------


def test_reward_metrics_reference_based():
    beta = 0.2
    out = preference_loss(pair_logps(ROWS), [LossTerm("nll", 0.1), LossTerm("ipo")], beta=beta)
    rc = torch.tensor([beta * (r[0] - r[2]) for r in ROWS], dtype=DT)
    rr = torch.tensor([beta * (r[1] - r[3]) for r in ROWS], dtype=DT)
    close(out.metrics["rewards/chosen"], rc)  # sums, not per-token, even for ipo
    close(out.metrics["rewards/rejected"], rr)
    close(out.metrics["rewards/margins"], rc - rr)
    close(out.metrics["rewards/accuracies"], (rc > rr).to(DT))
    close(out.metrics["logps/chosen"], torch.tensor([r[0] for r in ROWS], dtype=DT))
    close(out.metrics["logps/rejected"], torch.tensor([r[1] for r in ROWS], dtype=DT))
    close(out.metrics["nll"], expected("nll", ROWS))
    expected_keys = {
        "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
        "logps/chosen", "logps/rejected", "nll", "loss/nll", "loss/ipo",
    }  # fmt: skip
    assert set(out.metrics) == expected_keys
    assert all(v.shape == (len(ROWS),) for v in out.metrics.values())


@pytest.mark.parametrize("name", ["simpo", "orpo"])
def test_reward_metrics_length_normalised_reference_free(name):
    beta = 0.2
    out = preference_loss(pair_logps(ROWS, with_ref=False), [LossTerm(name)], beta=beta)
    rc = torch.tensor([beta * r[0] / r[4] for r in ROWS], dtype=DT)
    rr = torch.tensor([beta * r[1] / r[5] for r in ROWS], dtype=DT)
    close(out.metrics["rewards/chosen"], rc)
    close(out.metrics["rewards/rejected"], rr)
    close(out.metrics["rewards/accuracies"], (rc > rr).to(DT))


def test_reward_metrics_sigmoid_ref_free_and_nll_only():
    beta = 0.2
    out = preference_loss(pair_logps(ROWS), [LossTerm("sigmoid_ref_free")], beta=beta)
    close(out.metrics["rewards/chosen"], torch.tensor([beta * r[0] for r in ROWS], dtype=DT))
    out = preference_loss(pair_logps(ROWS, with_ref=False), [LossTerm("nll")], beta=beta)
    close(out.metrics["rewards/rejected"], torch.tensor([beta * r[1] for r in ROWS], dtype=DT))
    out = preference_loss(pair_logps(ROWS), [LossTerm("nll")], beta=beta)
    close(out.metrics["rewards/rejected"], torch.tensor([beta * (r[1] - r[3]) for r in ROWS], dtype=DT))


def test_apo_avoids_cancellation_in_float32():
    """1 - sigmoid(20) is 0 in float32; the loss must keep the tiny but nonzero sigma(-20)."""
    cl = torch.tensor([200.0], dtype=torch.float32)
    rl = torch.tensor([-1e4], dtype=torch.float32)
    want = sigmoid(-20.0) + sigmoid(-1e3)
    assert apo_zero_loss(cl, rl, 0.1).item() == pytest.approx(want, rel=1e-6)
    assert apo_down_loss(-rl, -cl, 0.1).item() == pytest.approx(sigmoid(1e3) + sigmoid(-(1e3 + 20)), rel=1e-6)


def test_float32_stays_float32():
    lp = pair_logps(ROWS, dtype=torch.float32)
    out = preference_loss(lp, [LossTerm("sigmoid"), LossTerm("simpo"), LossTerm("orpo"), LossTerm("ipo")])
    assert out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss).all()
    assert all(v.dtype == torch.float32 for v in out.metrics.values())


# --------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(set(LOSS_NAMES) - REFERENCE_FREE_LOSSES))
def test_reference_loss_without_reference_raises(name):
    with pytest.raises(ValueError, match=rf"'{name}'.*reference"):
        preference_loss(pair_logps(ROWS, with_ref=False), [LossTerm(name)])


def test_missing_reference_error_names_only_the_offending_loss():
    with pytest.raises(ValueError) as info:
        preference_loss(pair_logps(ROWS, with_ref=False), [LossTerm("simpo"), LossTerm("ipo")])
    assert "'ipo'" in str(info.value) and "'simpo'" not in str(info.value)


def test_reference_free_losses_work_without_reference():
    assert not needs_reference([LossTerm(n) for n in REFERENCE_FREE_LOSSES])
    assert needs_reference([LossTerm("nll"), LossTerm("hinge")])
    out = preference_loss(
        pair_logps(ROWS, with_ref=False), [LossTerm(n) for n in sorted(REFERENCE_FREE_LOSSES)]
    )
    assert torch.isfinite(out.loss).all()


def test_unknown_loss_lists_valid_names():
    with pytest.raises(ValueError) as info:
        LossTerm("dpo")
    message = str(info.value)
    assert "'dpo'" in message
    assert all(name in message for name in LOSS_NAMES)


ZERO_LENGTH_CASES = [
    (name, side) for name in sorted(LENGTH_NORMALISED_LOSSES) for side in ("chosen", "rejected")
]
ZERO_LENGTH_CASES.remove(("nll", "rejected"))  # nll reads only the chosen completion
ZERO_LENGTH_CASES.remove(("sft", "rejected"))  # so does sft


@pytest.mark.parametrize(("name", "side"), ZERO_LENGTH_CASES)
def test_zero_length_completion_raises_for_length_normalised_losses(name, side):
    bad = (-1.0, -2.0, -1.0, -2.0, 0, 4) if side == "chosen" else (-1.0, -2.0, -1.0, -2.0, 3, 0)
    rows = [(-1.0, -2.0, -1.0, -2.0, 3, 4), bad]
    with pytest.raises(ValueError, match=rf"{name}: zero-length completion"):
        preference_loss(pair_logps(rows), [LossTerm(name)])


def test_zero_length_is_fine_for_sum_based_losses():
    rows = [(0.0, -2.0, 0.0, -1.0, 0, 4), (-1.0, 0.0, -1.5, 0.0, 3, 0)]
    out = preference_loss(pair_logps(rows), [LossTerm("sigmoid")])
    assert all(torch.isfinite(v).all() for v in [out.loss, *out.metrics.values()])


def test_invalid_arguments():
    lp = pair_logps(ROWS)
    with pytest.raises(ValueError, match="robust: label_smoothing"):
        preference_loss(lp, [LossTerm("robust")], label_smoothing=0.5)
    with pytest.raises(ValueError, match="sigmoid: label_smoothing"):
        preference_loss(lp, [LossTerm("sigmoid")], label_smoothing=0.6)
    with pytest.raises(ValueError, match="beta"):
        preference_loss(lp, [LossTerm("sigmoid")], beta=0.0)
    with pytest.raises(ValueError, match="weight"):
        LossTerm("sigmoid", -1.0)
    with pytest.raises(ValueError, match="more than once: sigmoid"):
        preference_loss(lp, [LossTerm("sigmoid"), LossTerm("sigmoid", 0.5)])
    with pytest.raises(ValueError, match="no loss terms"):
        preference_loss(lp, [])


def test_invalid_pair_logps():
    x = torch.zeros(3, dtype=DT)
    n = torch.ones(3, dtype=torch.long)
    with pytest.raises(ValueError, match="rejected_tokens has shape"):
        PairLogps(x, x, n, torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="both ref_chosen and ref_rejected"):
        PairLogps(x, x, n, n, ref_chosen=x)
    with pytest.raises(ValueError, match="1-D"):
        PairLogps(x[None], x[None], n[None], n[None])
    with pytest.raises(ValueError, match="floating-point"):
        PairLogps(n, n, n, n)
