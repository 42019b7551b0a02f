"""tests/data/trl_pg.json (TRL 1.16's GRPO and RLOO losses, recorded once by benchmarks/trl_pg.py) is
self-consistent: every recorded loss and advantage follows, in float64, from the recorded rewards and per-token
log-probs by the formulas written out below, independently of TRL and of prefpack's code. This pins down the
semantics prefpack's group policy-gradient objective has to reproduce.

GRPO, per token t of completion i (lp: the policy's log-prob, old: the old model's, ref: the reference's):
    r = exp(lp - old),  per_token = -min(r * A_i, clip(r, 1 - eps_low, 1 + eps_high) * A_i) + beta * kl,
    kl = (exp(ref - lp) - (ref - lp) - 1) * (r if use_bias_correction_kl else 1)
(use_bias_correction_kl is TRL 1.16's default, True: the KL term, and the logged `kl`, carry the unclipped ratio)
with m = completion_mask * tool_mask over the real tokens, aggregated by loss_type:
    grpo:    mean over ALL completions of sum_t(m * per_token) / max(sum_t m, 1)
    bnpo:    sum(m * per_token) / max(sum m, 1)
    dr_grpo: sum(m * per_token) / (number of completions * max_completion_length)
    dapo:    sum(m * per_token) / max(num_items_in_batch, 1),  num_items_in_batch = sum m
Advantages (k completions per prompt, std with Bessel's correction, eps 1e-4 added to the std, not the variance):
    group: (R - mean_group) / (std_group + 1e-4);  batch: (R - mean_group) / (std_batch + 1e-4);  none: R - mean_group
RLOO, per completion (sequence level, completion_mask only: no tool mask):
    R' = R - beta * sum_t(old - ref),  A = R' - (sum_group R' - R') / (k - 1),
    normalize_advantages: A = (A - mean A) / (std A + 1e-4) over the batch,
    r = exp(sum_t lp - sum_t old),  loss = mean over completions of -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
(the sums are TRL's float32 ones, recorded beside the per-token values: a float64 sum of those differs by up to
~1e-5, which moves the loss by ~2e-6; the per-token sums are checked against them to 3e-5)
GSPO (importance_sampling_level = sequence): r = exp(sum_t(m * (lp - old)) / max(sum_t m, 1)), one per completion,
on each of its tokens (the clip counts then count completions, and the KL carries that r).
vLLM's importance-sampling correction (vllm_importance_sampling_correction, with the sampler's per-token log-probs
`sampling_per_token_logps`; the old model is then the policy, as TRL recomputes it): d = m * (old - sampler), per
token w = exp(d) (token_*) or per completion w = exp(sum_t d) (sequence_*); *_truncate clips w to
[clip_min, clip_max], *_mask gives 0 outside; the surrogate (not the KL) is multiplied by w before the aggregation.
The other terms (the ratio r as above, per token or per completion): cispo, -min(r, eps_high) * A * lp (r detached),
aggregated as dapo; sapo, -sigmoid(tau * (r - 1)) * 4 / tau * A with tau = sapo_temperature_pos where A > 0, else
sapo_temperature_neg, aggregated as grpo; luspo, grpo's term, aggregated as the mean over completions of
sum_t(m * per_token). The off-policy mask (off_policy_mask_threshold d): a completion keeps its surrogate where
A >= 0 or mean_t over m of (sampler - lp) <= d (the sampler's log-probs where recorded, else old's); the KL stays.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

RECORD = json.loads((Path(__file__).resolve().parent / "data" / "trl_pg.json").read_text(encoding="utf-8"))
CASES = RECORD["cases"]
GRPO = [c for c in CASES if c["trainer"] == "GRPOTrainer"]
RLOO = [c for c in CASES if c["trainer"] == "RLOOTrainer"]
K = RECORD["num_generations"]
TOL = 1e-6


def padded(rows: list[list[float]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    return np.array([list(r) + [0.0] * (width - len(r)) for r in rows], dtype=np.float64)


def loss_mask(case: dict) -> np.ndarray:
    m = padded(case["completion_mask"])
    return m * padded(case["tool_mask"]) if "tool_mask" in case else m


def std1(x: np.ndarray, axis=None) -> np.ndarray:
    return np.std(x, axis=axis, ddof=1)


def grpo_advantages(rewards: list[float], scale: str) -> np.ndarray:
    r = np.array(rewards, dtype=np.float64).reshape(-1, K)
    adv = r - r.mean(1, keepdims=True)
    if scale == "group":
        adv = adv / (std1(r, 1)[:, None] + 1e-4)
    elif scale == "batch":
        adv = adv / (std1(r) + 1e-4)
    else:
        assert scale == "none"
    return adv.reshape(-1)


def grpo_loss(case: dict) -> tuple[float, dict]:
    cfg = case["config"]
    lp, old = padded(case["policy_per_token_logps"]), padded(case["old_per_token_logps"])
    ref = padded(case["ref_per_token_logps"])
    adv = np.array(case["advantages"], dtype=np.float64)[:, None]
    m = loss_mask(case)
    if cfg["importance_sampling_level"] == "sequence":
        ratio = np.exp(((lp - old) * m).sum(1, keepdims=True) / np.maximum(m.sum(1, keepdims=True), 1.0))
        ratio = ratio * np.ones_like(lp)
    else:
        ratio = np.exp(lp - old)
    kind = cfg["loss_type"]
    if kind == "cispo":
        per_token = -np.minimum(ratio, cfg["epsilon_high"]) * adv * lp
    elif kind == "sapo":
        tau = np.where(adv > 0, cfg["sapo_temperature_pos"], cfg["sapo_temperature_neg"])
        per_token = -(1.0 / (1.0 + np.exp(-tau * (ratio - 1)))) * 4 / tau * adv
    else:
        clipped = np.clip(ratio, 1 - cfg["epsilon_low"], 1 + cfg["epsilon_high"])
        per_token = -np.minimum(ratio * adv, clipped * adv)
    if cfg["off_policy_mask_threshold"] is not None:
        source = padded(case.get("sampling_per_token_logps") or case["old_per_token_logps"])
        gap = ((source - lp) * m).sum(1, keepdims=True) / np.maximum(m.sum(1, keepdims=True), 1.0)
        keep = (adv >= 0) | (gap <= cfg["off_policy_mask_threshold"])
        per_token = per_token * keep
    if cfg.get("vllm_importance_sampling_correction"):
        per_token = per_token * is_weights(case)
    kl = np.exp(ref - lp) - (ref - lp) - 1
    if cfg["use_bias_correction_kl"]:
        kl = kl * ratio
    if cfg["beta"] != 0.0:
        per_token = per_token + cfg["beta"] * kl
    total = (per_token * m).sum()
    if kind in ("grpo", "sapo"):
        loss = ((per_token * m).sum(1) / np.maximum(m.sum(1), 1.0)).mean()
    elif kind == "bnpo":
        loss = total / max(m.sum(), 1.0)
    elif kind == "dr_grpo":
        loss = total / (len(m) * cfg["max_completion_length"])
    elif kind in ("dapo", "cispo"):
        loss = total / max(case["num_items_in_batch"], 1)
    elif kind == "luspo":
        loss = (per_token * m).sum(1).mean()
    else:
        raise AssertionError(kind)
    low = (ratio < 1 - cfg["epsilon_low"]) & (adv < 0) & (m > 0)
    high = (ratio > 1 + cfg["epsilon_high"]) & (adv > 0) & (m > 0)
    if kind == "cispo":  # clipped above its cap where A > 0; nothing below
        low, high = np.zeros_like(low), (ratio > cfg["epsilon_high"]) & (adv > 0) & (m > 0)
    elif kind == "sapo":  # no clip
        low = high = np.zeros_like(low)
    if cfg["importance_sampling_level"] == "sequence":  # a completion clips whole: counted once
        low, high = low.any(1), high.any(1)
    units = float(m.sum()) if cfg["importance_sampling_level"] == "token" else float(len(m))
    stats = {"low": int(low.sum()), "high": int(high.sum()), "tokens": units,
             "kl": float((kl * m).sum() / m.sum())}
    return float(loss), stats


def is_weights(case: dict) -> np.ndarray:
    """TRL's importance-sampling weights of vLLM's samples, [B, T], from the recorded sampler log-probs."""
    cfg = case["config"]
    m = loss_mask(case)
    d = (padded(case["old_per_token_logps"]) - padded(case["sampling_per_token_logps"])) * m
    mode = cfg["vllm_importance_sampling_mode"]
    w = np.exp(d) if mode.startswith("token") else np.exp(d.sum(1, keepdims=True)) * np.ones_like(d)
    lo = -np.inf if cfg["vllm_importance_sampling_clip_min"] is None else cfg["vllm_importance_sampling_clip_min"]
    hi = np.inf if cfg["vllm_importance_sampling_clip_max"] is None else cfg["vllm_importance_sampling_clip_max"]
    return np.clip(w, lo, hi) if mode.endswith("truncate") else np.where((w < lo) | (w > hi), 0.0, w)


def rloo_terms(case: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sequence sums of the policy's, the old model's and the reference's log-probs (completion_mask only)."""
    cm = padded(case["completion_mask"])
    return tuple((padded(case[k]) * cm).sum(1) for k in ("policy_per_token_logps", "old_per_token_logps",
                                                        "ref_per_token_logps"))


def rloo_advantages(case: dict) -> np.ndarray:
    cfg = case["config"]
    _, old, ref = rloo_terms(case)
    r = np.array(case["rewards"], dtype=np.float64) - cfg["beta"] * (old - ref)
    g = r.reshape(-1, K)
    adv = (g - (g.sum(1, keepdims=True) - g) / (K - 1)).reshape(-1)
    if cfg["normalize_advantages"]:
        adv = (adv - adv.mean()) / (std1(adv) + 1e-4)
    return adv


def test_record_header():
    assert RECORD["trl_version"] == "1.16.0"
    assert {c["id"] for c in GRPO} >= {"grpo", "bnpo", "dr_grpo", "dapo", "grpo[beta=0.04]", "dapo[beta=0.04]",
                                       "dapo[epsilon_high=0.28]", "grpo[mask_truncated_completions]",
                                       "grpo[tool_mask]"}
    assert {c["config"]["scale_rewards"] for c in GRPO} == {"group", "batch", "none"}
    assert {c["id"] for c in RLOO} >= {"rloo", "rloo[normalize_advantages]", "rloo[beta=0.05]"}
    ids, eos, pad = RECORD["completion_ids"], RECORD["eos_token_id"], RECORD["pad_token_id"]
    assert len(ids) == len(RECORD["rewards"]) == K * len(RECORD["prompt_ids"]) == 4 * K
    assert all(3 <= len(c) <= RECORD["max_completion_length"] and pad not in c for c in ids)
    assert RECORD["truncated"] == [i for i, c in enumerate(ids) if c[-1] != eos]
    assert all(eos not in c[:-1] for c in ids)
    groups = [RECORD["rewards"][g * K:(g + 1) * K] for g in range(4)]
    assert sorted(len(set(g)) for g in groups) == [1, 3, 4, 4]  # one group all tied, one with two tied
    assert any(0 in m for m in RECORD["tool_mask"])
    assert [g["name"] for g in CASES[0]["grads"]] == [p["name"] for p in RECORD["parameters"]]
    assert any(c["clipped_tokens"]["low"] and c["clipped_tokens"]["high"] for c in GRPO)


@pytest.mark.parametrize("case", GRPO, ids=[c["id"] for c in GRPO])
def test_grpo_case(case):
    cfg = case["config"]
    lengths = [len(c) for c in RECORD["completion_ids"]]
    for key in ("policy_per_token_logps", "old_per_token_logps", "ref_per_token_logps", "completion_mask"):
        assert [len(r) for r in case[key]] == lengths, key
    # the masks TRL built: the truncated completion zeroed only under mask_truncated_completions
    zeroed = RECORD["truncated"] if cfg["mask_truncated_completions"] else []
    assert case["completion_mask"] == [[0 if i in zeroed else 1] * n for i, n in enumerate(lengths)]
    assert ("tool_mask" in case) == cfg["tool_mask"]
    if cfg["tool_mask"]:
        assert case["tool_mask"] == RECORD["tool_mask"]
    m = loss_mask(case)
    assert case["num_items_in_batch"] == int(m.sum())
    if cfg.get("vllm_importance_sampling_correction"):  # TRL recomputed the old policy: the policy itself
        assert case["old_model"] == "policy"
        np.testing.assert_allclose(padded(case["old_per_token_logps"]), padded(case["policy_per_token_logps"]),
                                   rtol=0, atol=1e-6)
        w = is_weights(case)
        recorded = case["importance_sampling_ratio"]
        if isinstance(recorded[0], list):  # per token, over each completion's own tokens
            real = padded([[1.0] * n for n in lengths]) > 0
            np.testing.assert_allclose(padded(recorded)[real], w[real], rtol=1e-5, atol=1e-6)
        else:  # per completion
            np.testing.assert_allclose(recorded, w[:, 0], rtol=1e-5, atol=1e-6)
        assert 0 < (w * m == 0).sum() - (m == 0).sum() or (w[m > 0] != 1).any()  # the correction does something
    else:  # old = ref = the reference's log-probs (GRPO's old model is the reference here)
        assert case["old_per_token_logps"] == case["ref_per_token_logps"]
    for i in zeroed:  # hidden from attention: TRL scores no label there, its log-probs are 0
        assert not any(case["policy_per_token_logps"][i]) and not any(case["old_per_token_logps"][i])

    adv = grpo_advantages(RECORD["rewards"], cfg["scale_rewards"])
    np.testing.assert_allclose(case["advantages"], adv, rtol=0, atol=1e-5)
    assert case["advantages"][K:2 * K] == [0.0] * K  # the tied group carries no signal

    loss, stats = grpo_loss(case)
    assert abs(loss - case["loss"]) <= TOL * max(1.0, abs(loss)), (loss, case["loss"])
    assert case["clipped_tokens"] == {"low": stats["low"], "high": stats["high"]}
    metrics = case["metrics_loss"]
    if cfg["loss_type"] == "cispo":
        assert math.isclose(metrics["cispo_clip_ratio"], stats["high"] / stats["tokens"], abs_tol=1e-6)
    elif cfg["loss_type"] != "sapo":
        assert math.isclose(metrics["clip_ratio/low_mean"], stats["low"] / stats["tokens"], abs_tol=1e-6)
        assert math.isclose(metrics["clip_ratio/high_mean"], stats["high"] / stats["tokens"], abs_tol=1e-6)
    if cfg["off_policy_mask_threshold"] is not None:  # the mask drops some completions' surrogate, not all
        lp, m = padded(case["policy_per_token_logps"]), loss_mask(case)
        source = padded(case.get("sampling_per_token_logps") or case["old_per_token_logps"])
        gap = ((source - lp) * m).sum(1) / np.maximum(m.sum(1), 1.0)
        dropped = (np.array(case["advantages"]) < 0) & (gap > cfg["off_policy_mask_threshold"])
        assert 0 < dropped.sum() < (np.array(case["advantages"]) < 0).sum()
    if cfg["beta"]:
        assert math.isclose(metrics["kl"], stats["kl"], rel_tol=1e-5)
    else:
        assert "kl" not in metrics


@pytest.mark.parametrize("case", RLOO, ids=[c["id"] for c in RLOO])
def test_rloo_case(case):
    cfg = case["config"]
    lp64, old64, _ = rloo_terms(case)
    lp, old = np.array(case["policy_logps"], dtype=np.float64), np.array(case["old_logps"], dtype=np.float64)
    np.testing.assert_allclose(lp, lp64, rtol=0, atol=3e-5)  # TRL's float32 sums of the per-token values
    np.testing.assert_allclose(old, old64, rtol=0, atol=3e-5)
    if case["old_model"] == "reference":
        assert case["old_per_token_logps"] == case["ref_per_token_logps"]
    adv = rloo_advantages(case)
    np.testing.assert_allclose(case["advantages"], adv, rtol=0, atol=1e-5)
    a = np.array(case["advantages"], dtype=np.float64)
    ratio = np.exp(lp - old)
    clipped = np.clip(ratio, 1 - cfg["epsilon_low"], 1 + cfg["epsilon_high"])
    loss = float((-np.minimum(ratio * a, clipped * a)).mean())
    assert abs(loss - case["loss"]) <= TOL * max(1.0, abs(loss)), (loss, case["loss"])
    low = int(((ratio < 1 - cfg["epsilon_low"]) & (a < 0)).sum())
    high = int(((ratio > 1 + cfg["epsilon_high"]) & (a > 0)).sum())
    assert case["clipped_sequences"] == {"low": low, "high": high}
    assert math.isclose(case["metrics_loss"]["clip_ratio/region_mean"], (low + high) / len(a), abs_tol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_gradients_recorded(case):
    """Each full gradient gives the recorded norm, and its dot with the seeded normal z the recorded dot (z
    regenerated as RECORD["projection"] says, so that a test of prefpack's gradients can do the same)."""
    import torch

    for i, (g, p) in enumerate(zip(case["grads"], RECORD["parameters"])):
        n = int(np.prod(p["shape"]))
        assert ("grad" in g) == (n <= RECORD["full_grad_max_numel"])
        if "grad" in g:
            assert len(g["grad"]) == n
            assert math.isclose(float(np.linalg.norm(np.array(g["grad"], dtype=np.float64))), g["norm"],
                                rel_tol=1e-6, abs_tol=1e-12)
            gen = torch.Generator().manual_seed(RECORD["proj_seed"] + i)
            z = torch.randn(p["shape"], generator=gen, dtype=torch.float32).double().reshape(-1).numpy()
            assert math.isclose(float(np.dot(np.array(g["grad"], dtype=np.float64), z)), g["dot"],
                                rel_tol=1e-6, abs_tol=1e-12)
    assert any(g["norm"] > 0 for g in case["grads"])
