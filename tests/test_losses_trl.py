"""The TRL 1.16 DPOTrainer loss types prefpack added (issue 14): exo_pair, nca_pair, sppo_hard, aot, aot_unpaired,
discopop, sigmoid_norm, sft, and bco_pair (TRL's, no reward shift) next to bco_pair_running (prefpack's running
mean). Every value is checked against the formula written out here in plain float64 `math` (mpmath where
TRL's own form overflows), never against the code under test."""

from __future__ import annotations

import math
from types import SimpleNamespace

import mpmath
import numpy as np
import pytest
import torch
from conftest import log_sigmoid
from test_losses import HAND_ROWS, pair_logps, random_rows

from prefpack.config import LossConfig
from prefpack.loss_params import LOSS_PARAMS
from prefpack.losses import (
    BATCH_COUPLED_LOSSES,
    LENGTH_NORMALISED_LOSSES,
    PAIR_LOSSES,
    REFERENCE_FREE_LOSSES,
    LossTerm,
    PairLogps,
    aot_loss,
    aot_unpaired_loss,
    bco_pair_loss,
    discopop_loss,
    exo_pair_loss,
    nca_pair_loss,
    preference_loss,
    sft_loss,
    sigmoid_norm_loss,
    sppo_hard_loss,
)
from prefpack.objectives import LossParams, PairTask, RunSettings, Term

DT = torch.float64

# --------------------------------------------------------------------------------------------------------
# Plain-math helpers, independent of torch and of prefpack.
# --------------------------------------------------------------------------------------------------------


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


# Rows as in test_losses (policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens).
ROWS = HAND_ROWS + random_rows(8, seed=3)



def cl(r):  # chosen log-ratio
    return r[0] - r[2]


def rl(r):  # rejected log-ratio
    return r[1] - r[3]


# --------------------------------------------------------------------------------------------------------
# TRL 1.16's definitions (trl/trainer/dpo_trainer.py), written out: f(rows, beta, eps, tau, delta) -> [values].
# Per-pair losses map each row; batch-coupled ones (aot, aot_unpaired, sft) see the whole list of rows.
# --------------------------------------------------------------------------------------------------------


def f_exo_pair(rows, b, eps, tau, d):
    out = []
    for r in rows:
        x = b * (cl(r) - rl(r))
        qw, ql = sigmoid(x), sigmoid(-x)
        out.append(qw * (log_sigmoid(x) - math.log(1 - eps)) + ql * (log_sigmoid(-x) - math.log(eps)))
    return out


def f_nca_pair(rows, b, eps, tau, d):
    return [-log_sigmoid(b * cl(r)) - 0.5 * log_sigmoid(-b * cl(r)) - 0.5 * log_sigmoid(-b * rl(r)) for r in rows]


def f_sppo_hard(rows, b, eps, tau, d):
    return [(cl(r) - 0.5 / b) ** 2 + (rl(r) + 0.5 / b) ** 2 for r in rows]


def _smoothed(x, eps):
    return -(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x)


def f_aot(rows, b, eps, tau, d):
    margins = sorted(r[0] - r[1] for r in rows)
    ref_margins = sorted(r[2] - r[3] for r in rows)
    return [_smoothed(b * (m - mr), eps) for m, mr in zip(margins, ref_margins)]


def f_aot_unpaired(rows, b, eps, tau, d):
    chosen, rejected = sorted(cl(r) for r in rows), sorted(rl(r) for r in rows)
    return [_smoothed(b * (c - rj), eps) for c, rj in zip(chosen, rejected)]


def f_discopop(rows, b, eps, tau, d):
    """TRL's form, (1 - sigma(x/tau)) * -log sigma(x) + sigma(x/tau) * exp(-x), in 60-digit arithmetic (its
    exp(-x) overflows a double at x = -1998)."""
    out = []
    with mpmath.workdps(60):
        for r in rows:
            x = mpmath.mpf(b) * (mpmath.mpf(r[0]) - mpmath.mpf(r[2]) - (mpmath.mpf(r[1]) - mpmath.mpf(r[3])))
            w = 1 / (1 + mpmath.exp(-x / tau))
            logistic = mpmath.log(1 + mpmath.exp(-x))
            out.append(float((1 - w) * logistic + w * mpmath.exp(-x)))
    return out


def f_sigmoid_norm(rows, b, eps, tau, d):
    return [-log_sigmoid(b * (cl(r) / r[4] - rl(r) / r[5])) for r in rows]


def f_sft(rows, b, eps, tau, d):
    """TRL: one token mean over the batch; prefpack: per pair, -logp * P / total tokens (mean = TRL's)."""
    total_tokens = sum(r[4] for r in rows)
    return [-r[0] * len(rows) / total_tokens for r in rows]


def f_bco_pair(rows, b, eps, tau, d):  # TRL 1.16: no reward shift, whatever delta the caller holds
    return [-log_sigmoid(b * cl(r)) - log_sigmoid(-b * rl(r)) for r in rows]


def f_bco_pair_running(rows, b, eps, tau, d):
    return [-log_sigmoid(b * cl(r) - d) - log_sigmoid(-(b * rl(r) - d)) for r in rows]


FORMULAS = {
    "exo_pair": f_exo_pair,
    "nca_pair": f_nca_pair,
    "sppo_hard": f_sppo_hard,
    "aot": f_aot,
    "aot_unpaired": f_aot_unpaired,
    "discopop": f_discopop,
    "sigmoid_norm": f_sigmoid_norm,
    "sft": f_sft,
    "bco_pair": f_bco_pair,
    "bco_pair_running": f_bco_pair_running,
}
NEW = sorted(FORMULAS)


def expected(name, rows, beta=0.1, eps=0.0, tau=0.05, delta=0.0) -> torch.Tensor:
    return torch.tensor(FORMULAS[name](rows, beta, eps, tau, delta), dtype=DT)


def close(actual: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(actual, want, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize(("beta", "eps", "tau"), [(0.1, 0.2, 0.05), (0.7, 1e-3, 0.4)])
def test_loss_matches_trl_formula(name, beta, eps, tau):
    out = preference_loss(pair_logps(ROWS), [LossTerm(name)], beta=beta, label_smoothing=eps, discopop_tau=tau,
                          bco_delta=0.25)
    want = expected(name, ROWS, beta, eps, tau, delta=0.25)
    assert out.loss.shape == (len(ROWS),) and out.loss.dtype == DT
    assert torch.isfinite(out.loss).all()
    close(out.loss, want)
    close(out.metrics[f"loss/{name}"], want)


def test_individual_functions_match_formulas():
    lp = pair_logps(ROWS)
    c, r = lp.policy_chosen - lp.ref_chosen, lp.policy_rejected - lp.ref_rejected
    pc, pr, nc, nr = lp.policy_chosen, lp.policy_rejected, lp.chosen_tokens, lp.rejected_tokens
    b = 0.3
    close(exo_pair_loss(c, r, b, 0.05), expected("exo_pair", ROWS, b, eps=0.05))
    close(nca_pair_loss(c, r, b), expected("nca_pair", ROWS, b))
    close(sppo_hard_loss(c, r, b), expected("sppo_hard", ROWS, b))
    close(aot_loss(pc, pr, lp.ref_chosen, lp.ref_rejected, b), expected("aot", ROWS, b))
    close(aot_loss(pc, pr, lp.ref_chosen, lp.ref_rejected, b, 0.3), expected("aot", ROWS, b, eps=0.3))
    close(aot_unpaired_loss(c, r, b, 0.1), expected("aot_unpaired", ROWS, b, eps=0.1))
    close(discopop_loss(c, r, b, 0.2), expected("discopop", ROWS, b, tau=0.2))
    close(sigmoid_norm_loss(c, r, nc, nr, b), expected("sigmoid_norm", ROWS, b))
    close(sft_loss(pc, nc), expected("sft", ROWS))
    close(bco_pair_loss(c, r, b), expected("bco_pair", ROWS, b))
    close(bco_pair_loss(c, r, b, torch.tensor(-0.4, dtype=DT)), expected("bco_pair_running", ROWS, b, delta=-0.4))


def test_hand_values():
    """Values worked out by hand, so the written-out formulas themselves are pinned down."""
    zero = [(-2.0, -3.0, -2.0, -3.0, 2, 4)]  # both log-ratios 0
    one = lambda name, rows=zero, **kw: preference_loss(pair_logps(rows), [LossTerm(name)], **kw).loss.item()  # noqa: E731
    ln2 = math.log(2.0)
    assert one("nca_pair") == pytest.approx(2 * ln2, rel=1e-12)  # ln2 + ln2/2 + ln2/2
    # exo at q = (1/2, 1/2): KL to (1 - eps, eps) = -ln2 - (ln(1 - eps) + ln eps) / 2
    assert one("exo_pair", label_smoothing=0.1) == pytest.approx(-ln2 - (math.log(0.9) + math.log(0.1)) / 2, rel=1e-12)
    assert one("discopop") == pytest.approx(ln2 / 2 + 0.5, rel=1e-12)  # w = 1/2: (ln2 + e^0) / 2
    assert one("sppo_hard", beta=0.5) == pytest.approx(2.0, rel=1e-12)  # (0 - 1)^2 + (0 + 1)^2
    assert one("sigmoid_norm") == pytest.approx(ln2, rel=1e-12)
    # chosen log-ratio 1, rejected -1 at beta 0.5: the SPPO targets +-1 are met exactly
    assert one("sppo_hard", [(-1.0, -3.0, -2.0, -2.0, 2, 4)], beta=0.5) == pytest.approx(0.0, abs=1e-15)
    # sft over two pairs: chosen sums -6 (3 tokens) and -2 (1 token): token mean 8/4 = 2, per pair -logp * 2 / 4
    two = [(-6.0, -1.0, 0.0, 0.0, 3, 5), (-2.0, -1.0, 0.0, 0.0, 1, 5)]
    out = preference_loss(pair_logps(two), [LossTerm("sft")]).loss
    close(out, torch.tensor([3.0, 1.0], dtype=DT))
    assert out.mean().item() == pytest.approx(2.0, rel=1e-15)  # TRL's batch token mean


def test_sft_mean_is_trl_token_mean_and_differs_from_nll():
    lp = pair_logps(ROWS)
    sft = preference_loss(lp, [LossTerm("sft")]).loss
    token_mean = -sum(r[0] for r in ROWS) / sum(r[4] for r in ROWS)  # TRL: mean over every chosen token
    assert sft.mean().item() == pytest.approx(token_mean, rel=1e-12)
    nll = preference_loss(lp, [LossTerm("nll")]).loss  # per-sequence token means: another number
    assert nll.mean().item() != pytest.approx(token_mean, rel=1e-3)


def test_bco_pair_is_trl_and_running_variant_reads_delta():
    lp = pair_logps(ROWS)
    for delta in (0.0, 0.7, torch.tensor(-1.3, dtype=DT)):
        close(preference_loss(lp, [LossTerm("bco_pair")], bco_delta=delta).loss, expected("bco_pair", ROWS))
    close(preference_loss(lp, [LossTerm("bco_pair_running")], bco_delta=0.7).loss,
          expected("bco_pair_running", ROWS, delta=0.7))
    close(preference_loss(lp, [LossTerm("bco_pair_running")], bco_delta=0.0).loss, expected("bco_pair", ROWS))
    assert not torch.allclose(expected("bco_pair", ROWS), expected("bco_pair_running", ROWS, delta=0.7))


def test_sigmoid_norm_is_length_normalised_and_sigmoid_is_not():
    short, long = [(-4.0, -6.0, -5.0, -5.0, 2, 3)], [(-8.0, -12.0, -10.0, -10.0, 4, 6)]
    run = lambda name, rows: preference_loss(pair_logps(rows), [LossTerm(name)]).loss  # noqa: E731
    close(run("sigmoid_norm", short), run("sigmoid_norm", long))
    assert not torch.allclose(run("sigmoid", short), run("sigmoid", long))


# --------------------------------------------------------------------------------------------------------
# Batch coupling: aot, aot_unpaired and sft combine the pairs of one call (one micro-batch).
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["aot", "aot_unpaired", "sft"])
def test_batch_coupled_losses_depend_on_the_split(name):
    """Documented behaviour: the value of a call depends on which pairs it holds, so splitting a step into
    other micro-batches changes the step's loss (unlike per-pair losses), but not the order within a call."""
    whole = preference_loss(pair_logps(ROWS), [LossTerm(name)], beta=0.3).loss.sum()
    split = sum(preference_loss(pair_logps(part), [LossTerm(name)], beta=0.3).loss.sum()
                for part in (ROWS[:4], ROWS[4:]))
    assert whole.item() != pytest.approx(split.item(), rel=1e-6)
    close(split, torch.tensor(sum(sum(FORMULAS[name](part, 0.3, 0.0, 0.05, 0.0)) for part in (ROWS[:4], ROWS[4:])),
                              dtype=DT))
    shuffled = [ROWS[i] for i in np.random.default_rng(0).permutation(len(ROWS))]
    close(preference_loss(pair_logps(shuffled), [LossTerm(name)], beta=0.3).loss.sum(), whole)


def test_aot_on_one_pair_is_the_smoothed_logistic_of_that_pair():
    row = [ROWS[0]]
    h = cl(ROWS[0]) - rl(ROWS[0])
    for name in ("aot", "aot_unpaired"):
        got = preference_loss(pair_logps(row), [LossTerm(name)], beta=0.4, label_smoothing=0.1).loss.item()
        assert got == pytest.approx(_smoothed(0.4 * h, 0.1), rel=1e-12)


def test_per_pair_new_losses_do_not_depend_on_the_split():
    terms = [LossTerm(n) for n in NEW if n not in BATCH_COUPLED_LOSSES]
    kw = dict(label_smoothing=0.1, bco_delta=0.2, discopop_tau=0.3)
    full = preference_loss(pair_logps(ROWS), terms, **kw)
    parts = [preference_loss(pair_logps(p), terms, **kw) for p in (ROWS[:5], ROWS[5:])]
    close(full.loss, torch.cat([p.loss for p in parts]))


# --------------------------------------------------------------------------------------------------------
# Gradients and numerics
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW)
def test_gradients_finite_and_reach_policy_not_reference(name):
    lp = pair_logps(ROWS, grad=True)  # includes the huge-margin rows
    out = preference_loss(lp, [LossTerm(name)], label_smoothing=0.1)
    out.loss.sum().backward()
    assert torch.isfinite(out.loss).all()
    assert lp.policy_chosen.grad is not None and torch.isfinite(lp.policy_chosen.grad).all()
    assert lp.policy_chosen.grad.abs().sum() > 0
    if name == "sft":  # reads only the chosen completion
        assert lp.policy_rejected.grad is None
    else:
        assert lp.policy_rejected.grad is not None and torch.isfinite(lp.policy_rejected.grad).all()
        assert lp.policy_rejected.grad.abs().sum() > 0
    assert lp.ref_chosen.grad is None and lp.ref_rejected.grad is None
    assert all(not v.requires_grad for v in out.metrics.values())


@pytest.mark.parametrize("name", NEW)
def test_gradcheck(name):
    lp = pair_logps(random_rows(5, seed=4))

    def fn(pc, pr):
        inputs = PairLogps(pc, pr, lp.chosen_tokens, lp.rejected_tokens, lp.ref_chosen, lp.ref_rejected)
        return preference_loss(inputs, [LossTerm(name)], beta=0.3, label_smoothing=0.1, discopop_tau=0.3,
                               bco_delta=0.2).loss

    pc = lp.policy_chosen.clone().requires_grad_(True)
    pr = lp.policy_rejected.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(fn, (pc, pr))


def test_sft_gradient_is_the_token_mean_weight():
    lp = pair_logps(ROWS, grad=True)
    preference_loss(lp, [LossTerm("sft")]).loss.sum().backward()
    weight = len(ROWS) / sum(r[4] for r in ROWS)
    close(lp.policy_chosen.grad, torch.full((len(ROWS),), -weight, dtype=DT))


def test_discopop_finite_where_trls_form_overflows():
    """TRL's exp(-x) * sigma(x/tau) is inf * 0 = NaN once exp(-x) overflows (x < -89 in float32)."""
    x = torch.tensor([-89.0, -200.0, -1000.0], dtype=torch.float32)
    w = torch.sigmoid(x / 0.05)
    assert torch.isnan(-torch.nn.functional.logsigmoid(x) * (1 - w) + torch.exp(-x) * w).all()  # TRL's form
    got = discopop_loss(x.clone().requires_grad_(True), torch.zeros_like(x), 1.0, 0.05)
    want = FORMULAS["discopop"]([(float(v), 0.0, 0.0, 0.0, 1, 1) for v in x], 1.0, 0.0, 0.05, 0.0)
    torch.testing.assert_close(got.detach(), torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=0)
    got.sum().backward()


def test_float32_stays_float32():
    lp = pair_logps(ROWS, dtype=torch.float32)
    out = preference_loss(lp, [LossTerm(n) for n in NEW], label_smoothing=0.1)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss).all()


# --------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------


def test_exo_pair_needs_positive_label_smoothing():
    with pytest.raises(ValueError, match=r"exo_pair: label_smoothing \(eps\) must be in \(0, 1\)"):
        preference_loss(pair_logps(ROWS), [LossTerm("exo_pair")])  # the default label_smoothing is 0


@pytest.mark.parametrize("tau", [0.0, -0.1, math.inf, math.nan])
def test_discopop_tau_must_be_positive(tau):
    with pytest.raises(ValueError, match="discopop: tau"):
        preference_loss(pair_logps(ROWS), [LossTerm("discopop")], discopop_tau=tau)


@pytest.mark.parametrize("name", ["aot", "aot_unpaired"])
def test_aot_label_smoothing_range(name):
    with pytest.raises(ValueError, match=f"{name}: label_smoothing"):
        preference_loss(pair_logps(ROWS), [LossTerm(name)], label_smoothing=0.6)


@pytest.mark.parametrize(("name", "side"), [("sigmoid_norm", "chosen"), ("sigmoid_norm", "rejected"),
                                            ("sft", "chosen")])
def test_zero_length_completion_raises(name, side):
    bad = (-1.0, -2.0, -1.0, -2.0, 0, 4) if side == "chosen" else (-1.0, -2.0, -1.0, -2.0, 3, 0)
    with pytest.raises(ValueError, match=rf"{name}: zero-length completion"):
        preference_loss(pair_logps([(-1.0, -2.0, -1.5, -2.5, 3, 4), bad]), [LossTerm(name)])


def test_sft_ignores_an_empty_rejected_completion():
    rows = [(-1.0, 0.0, -1.5, 0.0, 3, 0), (-2.0, -2.0, -1.0, -1.0, 1, 2)]
    close(preference_loss(pair_logps(rows), [LossTerm("sft")]).loss, expected("sft", rows))


@pytest.mark.parametrize("name", sorted(n for n in NEW if PAIR_LOSSES[n].needs_reference))
def test_reference_losses_without_reference_raise(name):
    with pytest.raises(ValueError, match=rf"'{name}'.*reference"):
        preference_loss(pair_logps(ROWS, with_ref=False), [LossTerm(name)], label_smoothing=0.1)


def test_sft_works_without_reference():
    out = preference_loss(pair_logps(ROWS, with_ref=False), [LossTerm("sft")])
    close(out.loss, expected("sft", ROWS))
    close(out.metrics["rewards/chosen"], torch.tensor([0.1 * r[0] for r in ROWS], dtype=DT))


# --------------------------------------------------------------------------------------------------------
# Registry, parameters, config and the task's wiring
# --------------------------------------------------------------------------------------------------------

REGISTRY = {  # name: (needs_reference, rewards, params, length_normalised, batch_coupled)
    "exo_pair": (True, "logratio", ("beta", "label_smoothing"), False, False),
    "nca_pair": (True, "logratio", ("beta",), False, False),
    "sppo_hard": (True, "logratio", ("beta",), False, False),
    "aot": (True, "logratio", ("beta", "label_smoothing"), False, True),
    "aot_unpaired": (True, "logratio", ("beta", "label_smoothing"), False, True),
    "discopop": (True, "logratio", ("beta", "discopop_tau"), False, False),
    "sigmoid_norm": (True, "logratio", ("beta",), True, False),
    "sft": (False, None, (), True, True),
    "bco_pair": (True, "logratio", ("beta",), False, False),
    "bco_pair_running": (True, "logratio", ("beta",), False, False),
}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_registry_entry(name):
    spec = PAIR_LOSSES[name]
    needs_ref, rewards, params, length_normalised, coupled = REGISTRY[name]
    assert spec.name == name
    assert (spec.needs_reference, spec.rewards, spec.params) == (needs_ref, rewards, params)
    assert spec.length_normalised == length_normalised == (name in LENGTH_NORMALISED_LOSSES)
    assert spec.batch_coupled == coupled == (name in BATCH_COUPLED_LOSSES)
    assert (name in REFERENCE_FREE_LOSSES) == (not needs_ref)
    assert set(spec.params) <= set(LOSS_PARAMS)


def test_every_trl_116_dpo_loss_type_is_registered():
    trl_116 = {"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
               "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"}
    assert trl_116 <= set(PAIR_LOSSES)
    assert BATCH_COUPLED_LOSSES == {"aot", "aot_unpaired", "sft"}


def test_discopop_tau_parameter_has_trls_default():
    assert LOSS_PARAMS["discopop_tau"].default == 0.05
    assert LOSS_PARAMS["discopop_tau"].flag == "--discopop-tau"
    assert LossConfig().discopop_tau == 0.05


def test_rewards_are_logratio_sums_for_the_reference_losses():
    for name in ("exo_pair", "aot", "discopop", "sigmoid_norm"):
        out = preference_loss(pair_logps(ROWS), [LossTerm(name)], beta=0.2, label_smoothing=0.1)
        close(out.metrics["rewards/chosen"], torch.tensor([0.2 * cl(r) for r in ROWS], dtype=DT))
        close(out.metrics["rewards/rejected"], torch.tensor([0.2 * rl(r) for r in ROWS], dtype=DT))


class _FakeStore:
    """Just what PairTask's constructor reads: a length and an index with token counts in columns 1-3."""

    def __init__(self, n: int):
        self.index = np.ones((n, 4), dtype=np.int64)
        self.path = "fake"
        self.num_images = 0  # a text store

    def __len__(self) -> int:
        return len(self.index)


def _task(names, **loss):
    params = {n: p.default for n, p in LOSS_PARAMS.items()} | {"f_divergence_type": "reverse_kl", "use_weighting": False,
                                                                "kl_pairing": "step"} | loss
    settings = RunSettings(micro_batch_tokens=64, row_tokens=64, chunk_size=64, packing=True, pad_to_multiple_of=None,
                           shares_prompts=False, pad_id=0, global_batch=len(ROWS), seed=0,
                           ranked_pairs="best_vs_rest", paired_as_kto=False, loss=LossParams(**params))
    return PairTask(_FakeStore(len(ROWS)), settings, [Term(n) for n in names])


def _run(task):
    """PairTask.loss on ROWS with a stand-in policy (per-sequence sums, chosen/rejected interleaved) and a
    precomputed reference holding ROWS' reference sums for the task's store."""
    from pathlib import Path

    from prefpack.objectives import StepState
    from prefpack.reference import KeyedLogps, PrecomputedReference

    seq = torch.tensor([v for r in ROWS for v in (r[0], r[1])], dtype=DT)
    tokens = torch.tensor([v for r in ROWS for v in (r[4], r[5])], dtype=torch.long)
    batch = SimpleNamespace(pair_indices=torch.arange(len(ROWS)), sequence_keys=torch.arange(2 * len(ROWS)),
                            key_store=task.store.path, completion_tokens=tokens, tail_pairs=None, tail_keys=None)
    reference = PrecomputedReference()
    reference.tables[Path(task.store.path)] = KeyedLogps(np.array([v for r in ROWS for v in (r[2], r[3])]))
    return task.loss(lambda b: (seq, tokens), reference, batch, StepState())


def test_task_keeps_the_running_mean_only_for_bco_pair_running():
    assert _task(["bco_pair_running"]).bco and not _task(["bco_pair"]).bco
    for name, moves in (("bco_pair", False), ("bco_pair_running", True)):
        from prefpack.objectives import StepTotals

        task = _task([name])
        out = _run(task)
        totals = StepTotals()  # the step's sums as the loop hands them over (all-reduced over ranks)
        for key in ("rewards/chosen", "rewards/rejected"):
            totals.metrics[key], totals.counts[key] = float(out.metrics[key].double().sum()), out.metrics[key].numel()
        task.end_step(totals)
        state = task.state_dict()
        if not moves:
            assert state == {}
            continue
        rewards = [0.1 * cl(r) for r in ROWS] + [0.1 * rl(r) for r in ROWS]
        assert state["bco_delta"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-12)
        close(_run(task).loss, expected("bco_pair_running", ROWS, delta=state["bco_delta"]))
        fresh = _task([name])  # the state a checkpoint saves gives a fresh objective the same loss
        fresh.load_state_dict(state)
        close(_run(fresh).loss, expected("bco_pair_running", ROWS, delta=state["bco_delta"]))


def test_task_passes_discopop_tau_from_the_config():
    out = _run(_task(["discopop"], discopop_tau=0.3))
    close(out.loss, expected("discopop", ROWS, tau=0.3))
    assert not torch.allclose(out.loss, expected("discopop", ROWS, tau=0.05))
