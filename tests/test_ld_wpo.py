"""Issue 14: LD-DPO (loss.ld_alpha) and WPO (loss.use_weighting), TRL 1.16's ld_alpha and use_weighting.

Formulas are written out here from per-token log-probabilities in float64 (never from the code under test);
TRL's own numbers on the same weights are in tests/test_trl_numbers.py (cases with ld_alpha / use_weighting).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import cfg_for, metrics_lines
from test_packing import make_model, random_pairs
from test_train import world  # noqa: F401 - a module-scoped fixture shared with test_train

from prefpack.batching.collate import collate_packed, collate_padded
from prefpack.cli import main as cli_main
from prefpack.config import ConfigError, load_config
from prefpack.losses import LossTerm, PairLogps, length_desensitised, preference_loss, wpo_weights
from prefpack.model import sequence_logps
from prefpack.model.logprobs import completion_logprobs
from prefpack.training import train

DT = torch.float64


# ------------------------------------------------------------------ the head's log sum p^2


@pytest.mark.parametrize("scale,softcap", [(1.0, None), (0.5, None), (1.0, 3.0)])
def test_log_sum_sq_equals_its_definition(scale, softcap):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(11, 8, generator=g, dtype=DT), torch.randn(37, 8, generator=g, dtype=DT) * 2
    targets = torch.randint(0, 37, (11,), generator=g)
    logp, lss = completion_logprobs(h, targets, w, chunk_size=4, scale=scale, softcap=softcap, with_log_sum_sq=True)
    z = (h @ w.t()) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    p = torch.softmax(z, -1)
    want = torch.tensor([math.log(sum(float(x) ** 2 for x in row)) for row in p], dtype=DT)
    torch.testing.assert_close(lss, want, rtol=1e-12, atol=1e-12)
    plain = completion_logprobs(h, targets, w, chunk_size=4, scale=scale, softcap=softcap)
    assert torch.equal(logp, plain)
    assert not lss.requires_grad


def test_log_sum_sq_leaves_the_gradient_unchanged():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(9, 6, generator=g, dtype=DT, requires_grad=True)
    w = torch.randn(23, 6, generator=g, dtype=DT, requires_grad=True)
    targets = torch.randint(0, 23, (9,), generator=g)
    logp, _ = completion_logprobs(h, targets, w, chunk_size=2, with_log_sum_sq=True)
    ga = torch.autograd.grad(logp.sum(), (h, w))
    gb = torch.autograd.grad(completion_logprobs(h, targets, w, chunk_size=2).sum(), (h, w))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------ the forward's tails and WPO means


def _per_token(model, prompt, completion):
    """log p and log sum_v p_v^2 of each completion token, from the model's own logits on the sequence alone."""
    ids = torch.tensor([[int(t) for t in prompt] + [int(t) for t in completion]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].double()
    logp = torch.log_softmax(logits, -1)
    start = len(prompt) - 1
    tok = [float(logp[start + i, int(t)]) for i, t in enumerate(completion)]
    sq = [math.log(sum(math.exp(float(v)) ** 2 for v in logp[start + i])) for i in range(len(completion))]
    return tok, sq


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_tails_and_wpo_means_equal_the_written_out_sums(layout):
    model = make_model("llama")
    pairs = random_pairs(5, seed=3)
    pairs[1] = type(pairs[1])(pairs[1].prompt, pairs[1].chosen[:4], pairs[1].chosen[:4])  # equal lengths: no tail
    rows = [[0, 1], [2], [3, 4]]
    batch = collate_packed(pairs, rows) if layout == "packed" else collate_padded(pairs, [p for r in rows for p in r])
    order = [p for r in rows for p in r]
    with torch.no_grad():
        out = sequence_logps(model, batch, chunk_size=3, pair_tails=True, wpo=True)
    for local, p in enumerate(order):
        chosen, chosen_sq = _per_token(model, pairs[p].prompt, pairs[p].chosen)
        rejected, rejected_sq = _per_token(model, pairs[p].prompt, pairs[p].rejected)
        shared = min(len(chosen), len(rejected))
        for k, (tok, sq) in enumerate(((chosen, chosen_sq), (rejected, rejected_sq))):
            s = 2 * local + k
            assert float(out.logp_sum[s]) == pytest.approx(sum(tok), abs=1e-9)
            assert float(out.tail_sum[s]) == pytest.approx(sum(tok[shared:]), abs=1e-9)
            want = sum(a - b for a, b in zip(tok, sq)) / len(tok)
            assert float(out.wpo_mean[s]) == pytest.approx(want, abs=1e-9)
    assert float(out.tail_sum[2]) == 0.0 and float(out.tail_sum[3]) == 0.0  # pair 1: both completions equal length
    assert out.aux_loss is None


def test_tails_need_a_pair_batch():
    from prefpack.model.forward import _tail_mask

    with pytest.raises(ValueError, match="pair batch"):
        _tail_mask(torch.zeros(3, dtype=torch.long), torch.tensor([3]))


# ------------------------------------------------------------------ the losses, from per-token values

# per pair: policy chosen / rejected token log-probs, reference chosen / rejected token log-probs
TOKENS = [
    ([-1.0, -2.0, -0.5], [-0.7, -3.0, -1.1, -2.2, -0.4], [-1.2, -1.9, -0.6], [-0.9, -2.5, -1.0, -2.0, -0.8]),
    ([-0.3, -0.2, -1.5, -2.5], [-1.0, -1.0], [-0.5, -0.4, -1.0, -2.0], [-0.8, -1.3]),
    ([-2.0, -1.0], [-2.5, -0.5], [-1.5, -1.5], [-2.0, -1.0]),
]


def _logps(tokens=TOKENS, grad=False):
    def col(i, tail=False):
        vals = []
        for row in tokens:
            shared = min(len(row[0]), len(row[1]))
            vals.append(sum(row[i][shared:]) if tail else sum(row[i]))
        return torch.tensor(vals, dtype=DT, requires_grad=grad and i < 2 and not tail)

    n = [torch.tensor([len(r[k]) for r in tokens]) for k in (0, 1)]
    return PairLogps(col(0), col(1), n[0], n[1], col(2), col(3), policy_chosen_tail=col(0, True),
                     policy_rejected_tail=col(1, True), ref_chosen_tail=col(2, True), ref_rejected_tail=col(3, True))


def _ld(tokens, alpha, shared):
    return sum(t if i < shared else alpha * t for i, t in enumerate(tokens))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_ld_dpo_sigmoid_and_ipo_equal_the_paper(alpha):
    beta = 0.2
    out = preference_loss(_logps(), [LossTerm("sigmoid"), LossTerm("ipo", 0.5)], beta=beta, ld_alpha=alpha)
    for p, (pc, pr, rc, rr) in enumerate(TOKENS):
        lp = min(len(pc), len(pr))  # l_p: the shorter completion's length (Liu et al. 2024, Eq. 9)
        h = (_ld(pc, alpha, lp) - _ld(rc, alpha, lp)) - (_ld(pr, alpha, lp) - _ld(rr, alpha, lp))
        sigmoid = math.log1p(math.exp(-beta * h))
        # TRL's ipo: each log-ratio divided by its own completion's token count
        hn = (_ld(pc, alpha, lp) - _ld(rc, alpha, lp)) / len(pc) - (_ld(pr, alpha, lp) - _ld(rr, alpha, lp)) / len(pr)
        ipo = (hn - 1 / (2 * beta)) ** 2
        assert float(out.metrics["loss/sigmoid"][p]) == pytest.approx(sigmoid, abs=1e-12)
        assert float(out.metrics["loss/ipo"][p]) == pytest.approx(ipo, abs=1e-10)
        assert float(out.loss[p]) == pytest.approx(sigmoid + 0.5 * ipo, abs=1e-10)
        assert float(out.metrics["rewards/chosen"][p]) == pytest.approx(
            beta * (_ld(pc, alpha, lp) - _ld(rc, alpha, lp)), abs=1e-12)


def test_ld_alpha_one_is_plain_dpo_and_nll_sft_read_plain_sums():
    lp = _logps()
    plain = preference_loss(lp, [LossTerm("sigmoid")])
    assert torch.allclose(preference_loss(lp, [LossTerm("sigmoid")], ld_alpha=1.0).loss, plain.loss, atol=1e-14)
    assert not torch.allclose(preference_loss(lp, [LossTerm("sigmoid")], ld_alpha=0.5).loss, plain.loss)
    for name in ("nll", "sft"):
        a = preference_loss(lp, [LossTerm(name)], ld_alpha=0.0).loss
        b = preference_loss(lp, [LossTerm(name)]).loss
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    nll = preference_loss(lp, [LossTerm("nll")], ld_alpha=0.0).loss
    for p, row in enumerate(TOKENS):
        assert float(nll[p]) == pytest.approx(-sum(row[0]) / len(row[0]), abs=1e-12)


def test_ld_alpha_needs_tails_and_a_valid_value():
    lp = _logps()
    bare = PairLogps(lp.policy_chosen, lp.policy_rejected, lp.chosen_tokens, lp.rejected_tokens, lp.ref_chosen,
                     lp.ref_rejected)
    with pytest.raises(ValueError, match="tail sums"):
        preference_loss(bare, [LossTerm("sigmoid")], ld_alpha=0.5)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        preference_loss(lp, [LossTerm("sigmoid")], ld_alpha=1.5)
    assert float(length_desensitised(torch.tensor(-10.0), torch.tensor(-4.0), 0.25)) == pytest.approx(-7.0)


def test_wpo_weights_multiply_each_pair_and_sft_as_a_batch_scalar():
    beta = 0.1
    means = torch.tensor([[-0.5, -1.0], [-0.2, -0.1], [-2.0, -0.3]], dtype=DT)  # (chosen, rejected) wpo means
    weights = wpo_weights(means[:, 0], means[:, 1])
    for p in range(3):
        assert float(weights[p]) == pytest.approx(math.exp(float(means[p, 0])) * math.exp(float(means[p, 1])))
    lp = _logps(grad=True)
    out = preference_loss(lp, [LossTerm("sigmoid"), LossTerm("sft", 0.3)], beta=beta, pair_weights=weights)
    sft_trl = -sum(sum(r[0]) for r in TOKENS) / sum(len(r[0]) for r in TOKENS)  # TRL: one token mean per batch
    for p, (pc, pr, rc, rr) in enumerate(TOKENS):
        h = (sum(pc) - sum(rc)) - (sum(pr) - sum(rr))
        want = float(weights[p]) * (math.log1p(math.exp(-beta * h)) + 0.3 * sft_trl)
        assert float(out.loss[p]) == pytest.approx(want, abs=1e-12)
    assert float(out.loss.mean()) == pytest.approx(
        sum(float(weights[p]) * math.log1p(math.exp(-beta * ((sum(r[0]) - sum(r[2])) - (sum(r[1]) - sum(r[3])))))
            for p, r in enumerate(TOKENS)) / 3 + 0.3 * float(weights.mean()) * sft_trl, abs=1e-12)
    torch.testing.assert_close(out.metrics["wpo/weight"], weights)
    out.loss.sum().backward()  # the weights carry no gradient; the policy log-probs do
    assert lp.policy_chosen.grad is not None and not weights.requires_grad
    for name in ("aot", "aot_unpaired"):
        with pytest.raises(ValueError, match="sort"):
            preference_loss(_logps(), [LossTerm(name)], pair_weights=weights)


# ------------------------------------------------------------------ config


def _problems(*overrides):
    try:
        load_config(None, list(overrides)).validate(training=False)
    except ConfigError as exc:
        return str(exc)
    return ""


def test_config_rules():
    assert _problems("loss.ld_alpha=0.5", "loss.use_weighting=true") == ""
    assert "in [0, 1]" in _problems("loss.ld_alpha=1.5")
    assert "in [0, 1]" in _problems("loss.ld_alpha=-0.1")
    assert "cannot weight aot" in _problems("loss.use_weighting=true", "loss.terms=[{name: aot}]")
    msg = _problems("loss.use_weighting=true", "loss.ld_alpha=0.5", "loss.terms=[{name: kto}]")
    assert "loss.ld_alpha and loss.use_weighting" in msg and "kto has no pairs" in msg


# ------------------------------------------------------------------ runs


@pytest.mark.parametrize("option", ["loss.ld_alpha=0.5", "loss.use_weighting=true", "loss.f_divergence_type=js_divergence",
                                    "loss.f_divergence_type=alpha_divergence"])
def test_a_run_lowers_the_loss(world, tmp_path, option):  # noqa: F811
    """LD-DPO, WPO and f-DPO (issue 14 asks a tiny run that lowers the loss for each)."""
    run = tmp_path / "run"
    train(cfg_for(world, run, option, f"reference.model={world['policy']}", "train.max_steps=6",
                  "train.global_batch_pairs=24"), progress=False, log=lambda m: None)
    rows = metrics_lines(run)
    losses = [m["loss"] for m in rows]
    if "use_weighting" not in option:
        assert losses[0] == pytest.approx(math.log(2), abs=1e-5)  # reference = policy at step 0: every score is 0
    else:
        assert 0 < rows[0]["wpo/weight"] < 1  # WPO weights are probabilities' ratios, tiny on a random model
        assert losses[0] == pytest.approx(math.log(2) * rows[0]["wpo/weight"], rel=0.5)
    assert losses[-1] < losses[0] * 0.9


def _evaluate(world, tmp_path, *extra):  # noqa: F811
    from prefpack.training import build, evaluate

    setup = build(cfg_for(world, tmp_path / "unused", "loss.ld_alpha=0.3", *extra), log=lambda m: None)
    return evaluate(setup.policy, setup.reference, setup.train_task)


def test_precomputed_reference_serves_ld_dpo(world, tmp_path, capsys):  # noqa: F811
    """precompute-ref stores the tails too, so a run reading the sidecar scores what the reference model gives."""
    import shutil

    store = tmp_path / "store"
    shutil.copytree(world["eval"], store)
    data = [f"data.train={store}", f"reference.model={world['ref']}"]
    with_model = _evaluate(world, tmp_path, *data, "reference.mode=copy")
    assert cli_main(["precompute-ref", "--model", str(world["ref"]), "--data", str(store)]) == 0
    with_sidecar = _evaluate(world, tmp_path, *data, "reference.mode=precomputed")
    assert with_sidecar["loss"] == pytest.approx(with_model["loss"], abs=1e-6)
    assert abs(with_model["loss"] - math.log(2)) > 1e-3  # a real difference between policy and reference
    # the sidecar by sequence key: pair p's chosen at 2p, its rejected at 2p + 1, the tails likewise
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from prefpack.reference import ReferenceMismatch

    path = store / "ref_logps.safetensors"
    with safe_open(str(path), framework="numpy") as fh:
        meta = fh.metadata()
    tensors = load_file(str(path))
    assert meta["version"] == "2" and sorted(tensors) == ["logps", "tails"]
    # a sidecar of format 1 (before sequence keys: one column per side) reads the same
    v1 = {k: np.ascontiguousarray(tensors[t][s::2]) for k, t, s in (
        ("chosen", "logps", 0), ("rejected", "logps", 1), ("chosen_tail", "tails", 0), ("rejected_tail", "tails", 1))}
    v1_meta = {k: meta[k] for k in ("format", "store_hash", "reference_hash", "reference")} | {"version": "1"}
    save_file(v1, str(path), metadata=v1_meta)
    assert _evaluate(world, tmp_path, *data, "reference.mode=precomputed")["loss"] == with_sidecar["loss"]
    # one without tails (format 1 from before LD-DPO, or 2 written so) is refused by name, with what to do
    for tables, version in (({"logps": tensors["logps"]}, meta), ({k: v1[k] for k in ("chosen", "rejected")}, v1_meta)):
        save_file(tables, str(path), metadata=version)
        with pytest.raises(ReferenceMismatch, match="ld_alpha.*precompute-ref again"):
            _evaluate(world, tmp_path, *data, "reference.mode=precomputed")
    old = _evaluate(world, tmp_path, *data, "reference.mode=precomputed", "loss.ld_alpha=null")
    assert np.isfinite(old["loss"]) and old["loss"] != pytest.approx(with_model["loss"], abs=1e-6)
