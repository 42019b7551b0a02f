"""train.objective=policy_gradient against TRL 1.16's own GRPOTrainer / RLOOTrainer numbers, case by case.

TRL's losses, advantages, per-token log-probs and gradients were recorded once by benchmarks/trl_pg.py into
tests/data/trl_pg.json (TRL is not imported here; tests/test_pg_trl_record.py checks the file against the
formulas it implies). For each recorded case this test

1. writes a ranked store of the recorded ids (prompts with their BOS, completions; the case's rewards as
   scores; the truncated completion flagged FLAG_COMPLETION_TRUNCATED; a ``[tool_mask]`` case's zeros as
   unscored spans) the way ``prefpack score`` writes one (``prefpack.rewards.output._append_group``), and reads
   the ids back;
2. loads the recorded policy in float32 with prefpack's loader, the reference as a ``CopyReference``;
3. builds the objective from the case's config mapped to prefpack's keys (prompts laid out once: prefix
   sharing), the old policy's log-probs recomputed from the case's old model as a run does (``_start`` with
   ``loss.old_logprobs=recompute``), and checks them, and the policy's, against TRL's per-token values;
4. takes one optimizer step's loss over the whole store (every planned micro-batch, sum / units, as the loop
   does) and compares the advantages, the loss, the clip, KL and entropy statistics, and every parameter's
   gradient: its norm, its dot with the recorded seeded normal, and the full gradient where recorded.

Both sides run float32 (TRL: sdpa over left-padded prompts, one row per completion; prefpack: packed_sdpa, each
prompt once). Measured on CPU: per-token log-probs (old and policy) within 7.7e-6; advantages within 2e-7
(GRPO) and 8.5e-7 (RLOO with the KL in the rewards); losses within 1.8e-7 absolute (GRPO family: losses of 2e-3
to 0.16 that are near-cancelling means of terms of size |A| ~ 1) and 2.5e-6 (RLOO: the exp of a sum of ~10
log-probs); gradient norms within 8e-6 relative, dots with z within 2e-5 of the norm, full gradients within
2.1e-5 of their largest entry.

The GSPO cases (importance_sampling_level=sequence) map to loss.importance_sampling_level; the vLLM
importance-sampling cases write the sampler's recorded log-probs into the store's logprobs.bin (a vLLM-sampled store,
as ``prefpack score`` writes one) and map TRL's mode and bounds to loss.sampling_correction and
loss.sampling_ratio_min/max; their old model is the policy, as TRL recomputes it (ratio 1), and the mean weight is
checked against TRL's logged ``sampling/importance_sampling_ratio/mean`` (losses within 4.8e-7).

A case where prefpack and TRL define the numbers differently is skipped with the difference named
(``DIFFERENCES``). No recorded case is: TRL's RLOO ignores the tool mask, but no RLOO case carries one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

DATA = Path(__file__).resolve().parent / "data"
ASSETS = DATA / "trl_losses"
RECORD = json.loads((DATA / "trl_pg.json").read_text(encoding="utf-8"))
CASES = RECORD["cases"]
K = RECORD["num_generations"]
TRL = f"TRL {RECORD['trl_version']}"
CPU = torch.device("cpu")
DIFFERENCES = {  # (trainer, has a tool mask) -> why prefpack's number is not TRL's
    ("RLOOTrainer", True): "TRL's RLOO ignores tool_mask (its sums run over the completion mask), while a "
                           "store's unscored spans never enter prefpack's sums",
}

ADV_TOL = 1e-5  # advantages, absolute
LOGP_TOL = 1e-5  # per-token log-probs, absolute (TRL's left padding shifts positions: RoPE rounds apart)
# the loss: 1e-5 relative, or absolute where the loss is a near-cancelling mean of per-token terms of size
# |A| ~ 1 (GRPO family: float32 rounding of those terms, 1.8e-7 measured; RLOO: the exp of a sum of ~10
# per-token log-probs, each up to 7.7e-6 from TRL's, 2.5e-6 measured)
LOSS_TOL = {"GRPOTrainer": (1e-5, 1e-6), "RLOOTrainer": (1e-5, 1e-5)}  # (relative, absolute)
GRAD_RTOL = 1e-4  # each parameter's gradient norm, relative; its dot with z relative to the norm (~ its size)
FULL_RTOL = 1e-4  # a full gradient: max |prefpack - TRL| over its largest |entry|


def _ranked_store(path: Path, case: dict) -> Path:
    """The recorded prompts and completions, as ``prefpack score`` writes a ranked store."""
    from prefpack.data.spans import mask_to_spans
    from prefpack.data.store import FLAG_COMPLETION_TRUNCATED, StoreWriter
    from prefpack.rewards.output import score_bits
    from prefpack.tokenizer import load_tokenizer

    tok = load_tokenizer(ASSETS / "tokenizer")
    writer = StoreWriter(path, kind="ranked", vocab_size=len(tok), log=None)
    completions, rewards = RECORD["completion_ids"], case["rewards"]
    tool = case.get("tool_mask")
    sampled = case.get("sampling_per_token_logps")  # the sampler's, as a vLLM-sampled store's logprobs.bin holds
    try:
        for g, prompt in enumerate(RECORD["prompt_ids"]):
            flat, index, spans = list(prompt), [], []
            logprobs = [np.full(len(prompt), np.nan, np.float32)]
            for j in range(g * K, (g + 1) * K):
                ids = completions[j]
                flags = FLAG_COMPLETION_TRUNCATED if j in RECORD["truncated"] else 0
                index.append([len(flat), len(prompt), len(ids), score_bits(rewards[j]), 0, flags, 0, g])
                if tool is not None and 0 in tool[j]:
                    spans.append(mask_to_spans(np.asarray(tool[j], dtype=bool), len(flat)))
                if sampled is not None:
                    logprobs.append(np.asarray(sampled[j], np.float32))
                flat.extend(ids)
            writer.append(np.asarray(flat, dtype=np.int64), np.asarray(index, dtype=np.int64),
                          np.concatenate(spans) if spans else None,
                          logprobs=np.concatenate(logprobs) if sampled is not None else None)
        tok.save_pretrained(writer.tmp / "tokenizer")
        specials = {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                    "pad_token_id": tok.pad_token_id}
        samples = {"samples": {"generation": {"engine": "vllm"}}} if sampled is not None else {}
        writer.commit({"layout": "scored", "tokenizer": specials, **samples,
                       "sources": [{"path": "tests/data/trl_pg.json", "rows": len(RECORD["prompt_ids"])}]})
    except BaseException:
        writer.abort()
        raise
    return path


@pytest.fixture(scope="module")
def models():
    """The recorded policy, reference and policy_sppo in float32 (prefpack's loader; packed_sdpa reads
    prompt groups)."""
    from prefpack.model import load_causal_lm

    out = {name: load_causal_lm(str(ASSETS / name), attn_implementation="packed_sdpa", device=CPU,
                                dtype=torch.float32) for name in ("policy", "reference", "policy_sppo")}
    for name in ("reference", "policy_sppo"):
        out[name].eval().requires_grad_(False)
    assert [n for n, _ in out["policy"].named_parameters()] == [p["name"] for p in RECORD["parameters"]]
    return out


@pytest.fixture(scope="module")
def projections():
    """z_i as RECORD["projection"] says, float64."""
    seed = RECORD["proj_seed"]
    return [torch.randn(p["shape"], generator=torch.Generator().manual_seed(seed + i),
                        dtype=torch.float32).double() for i, p in enumerate(RECORD["parameters"])]


def _config(case: dict):
    from prefpack.config import load_config

    cfg = case["config"]
    rloo = case["trainer"] == "RLOOTrainer"
    name = "rloo" if rloo else cfg["loss_type"]
    args = ["train.objective=policy_gradient", f"loss.terms=[{{name: {name}}}]",
            "data.prefix_sharing=true", "data.packing=true", f"loss.epsilon={cfg['epsilon_low']}",
            f"loss.epsilon_high={cfg['epsilon_high']}", f"loss.kl_coef={cfg['beta']}",
            f"loss.max_completion_length={cfg['max_completion_length']}", "loss.old_logprobs=recompute"]
    if rloo:
        args.append(f"loss.normalize_advantages={str(cfg['normalize_advantages']).lower()}")
    else:
        assert cfg["top_entropy_quantile"] == 1.0
        assert not cfg["entropy_coef"]
        args += [f"loss.importance_sampling_level={cfg['importance_sampling_level']}",
                 f"loss.off_policy_mask_threshold={_yaml(cfg['off_policy_mask_threshold'])}",
                 f"loss.sapo_temperature_pos={cfg['sapo_temperature_pos']}",
                 f"loss.sapo_temperature_neg={cfg['sapo_temperature_neg']}"]
        if cfg.get("vllm_importance_sampling_correction"):  # TRL's mode and bounds under prefpack's names
            args += [f"loss.sampling_correction={cfg['vllm_importance_sampling_mode']}",
                     f"loss.sampling_ratio_min={_yaml(cfg['vllm_importance_sampling_clip_min'])}",
                     f"loss.sampling_ratio_max={_yaml(cfg['vllm_importance_sampling_clip_max'])}"]
        else:
            args.append("loss.sampling_correction=none")
        args += [f"loss.scale_rewards={cfg['scale_rewards']}",
                 f"loss.mask_truncated_completions={str(cfg['mask_truncated_completions']).lower()}",
                 f"loss.use_bias_correction_kl={str(cfg['use_bias_correction_kl']).lower()}"]
        if cfg["delta"] is not None:
            args.append(f"loss.delta={cfg['delta']}")
    assert cfg["temperature"] == 1.0 and cfg["reward_weights"] is None
    return load_config(None, args)


def _yaml(value) -> str:
    return "null" if value is None else str(value)


def _max_rel(got: float, want: float, scale: float) -> float:
    return abs(got - want) / max(scale, 1e-30)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_loss_and_gradients_equal_trls(case, models, projections, tmp_path, one_thread):
    from conftest import make_task

    from prefpack.data.store import FLAG_COMPLETION_TRUNCATED, Store
    from prefpack.model import SequenceLogps
    from prefpack.objectives.pg import GroupPolicyTask
    from prefpack.reference import CopyReference, as_sequence_output

    why = DIFFERENCES.get((case["trainer"], "tool_mask" in case))
    if why:
        pytest.skip(f"{case['id']}: {why} ({TRL} loss {case['loss']:.7f})")
    cfg = case["config"]
    rloo = case["trainer"] == "RLOOTrainer"
    completions = RECORD["completion_ids"]
    eos = RECORD["eos_token_id"]
    assert RECORD["truncated"] == [j for j, c in enumerate(completions) if c[-1] != eos]

    # 1. the store, read back
    store = Store(_ranked_store(tmp_path / "ranked", case), verify=True)
    tool = case.get("tool_mask")
    starts = store.group_starts()
    assert starts.tolist() == list(range(0, len(completions) + 1, K))
    for g, prompt in enumerate(RECORD["prompt_ids"]):
        p, comps = store.ranked_group(g)
        assert np.asarray(p).tolist() == prompt
        for k, c in enumerate(comps):
            j = g * K + k
            assert np.asarray(c).tolist() == completions[j]
            scored = getattr(c, "scored", None)
            want = None if tool is None or 0 not in tool[j] else tool[j]
            assert (None if scored is None else np.asarray(scored, dtype=int).tolist()) == want, j
    assert np.array_equal(store.scores(), np.asarray(case["rewards"], dtype=np.float64))
    truncated = (store.column("flags") & FLAG_COMPLETION_TRUNCATED) != 0
    assert np.flatnonzero(truncated).tolist() == RECORD["truncated"]

    # 2. models
    policy = models["policy"]
    policy.zero_grad(set_to_none=True)
    reference = CopyReference(models["reference"])
    reference.configure(chunk_size=64, pair_tails=False, token_logps=True)
    old_model = models[case["old_model"]]

    # 3. the objective; the old policy's log-probs recomputed from the old model
    task = make_task(GroupPolicyTask, store, _config(case), pad_id=RECORD["pad_token_id"])
    task._start(SequenceLogps(old_model, chunk_size=64, token_logps=True), reference)
    masked = set(RECORD["truncated"]) if cfg.get("mask_truncated_completions") else set()

    def scored_of(j: int) -> np.ndarray:
        return np.ones(len(completions[j]), bool) if tool is None else np.asarray(tool[j], bool)

    lp_diff = 0.0
    for j, want in enumerate(case["old_per_token_logps"]):
        if j in masked:  # TRL hid it from attention (its values are 0); prefpack's keep=0 drops its loss
            continue
        got = task.old[j]
        assert len(got) == int(scored_of(j).sum())
        lp_diff = max(lp_diff, float(np.abs(got - np.asarray(want)[scored_of(j)]).max()))
    assert lp_diff <= LOGP_TOL, f"old per-token log-probs differ from {TRL}'s by {lp_diff:.2e}"
    old_diff, lp_diff = lp_diff, 0.0

    # 4a. advantages (RLOO with beta: the KL in the rewards, from the old model's and the reference's sums)
    adv_diff = float(np.abs(task.advantages - np.asarray(case["advantages"])).max())
    assert adv_diff <= ADV_TOL, f"advantages differ from {TRL}'s by {adv_diff:.2e}"

    # 4b. one step's loss over the whole store, as the loop takes it
    module = SequenceLogps(policy, chunk_size=64, token_logps=True, entropy=True)
    ids = np.arange(len(task))
    task.plan_step(ids, seed=None)
    outs, rows = [], []
    for planned in task.plan(ids, seed=None):
        batch = task.collate(planned)
        rows.append(batch.sequence_keys.numpy().copy())
        outs.append(task.loss(module, reference, batch, None))
    rows = np.concatenate(rows)
    assert sorted(rows.tolist()) == list(range(len(store)))
    loss = torch.cat([o.loss for o in outs]).sum() / task.units(ids)
    loss.backward()
    got = float(loss.detach())
    rtol, atol = LOSS_TOL[case["trainer"]]
    assert abs(got - case["loss"]) <= max(rtol * abs(case["loss"]), atol), (
        f"{case['id']}: prefpack {got:.9g}, {TRL} {case['loss']:.9g} (difference {got - case['loss']:+.2e})")

    # the policy's per-token log-probs (those the loss read) are TRL's too
    with torch.no_grad():
        plain = SequenceLogps(policy, chunk_size=64, token_logps=True)
        for planned in task.plan(ids, seed=None):
            batch = task.collate(planned)
            matrix = as_sequence_output(plain(batch)).token_logp.double().numpy()
            for s, j in enumerate(batch.sequence_keys.numpy()):
                if int(j) in masked:
                    continue
                want = np.asarray(case["policy_per_token_logps"][j])[scored_of(int(j))]
                diff = float(np.abs(matrix[s, : len(want)] - want).max())
                lp_diff = max(lp_diff, diff)
    assert lp_diff <= LOGP_TOL, f"the policy's per-token log-probs differ from {TRL}'s by {lp_diff:.2e}"

    # 4c. the statistics TRL logs, as counts (TRL's are token means over the batch, prefpack's per completion)
    metrics = {k: torch.cat([o.metrics[k] for o in outs]).double().numpy() for k in outs[0].metrics}
    order = np.argsort(rows)
    metrics = {k: v[order] for k, v in metrics.items()}
    n_tok = metrics["completion_length"]
    weight = np.where(truncated & bool(cfg.get("mask_truncated_completions")), 0.0, 1.0)
    for j in range(len(store)):  # each completion's entropy mean over its scored tokens, from TRL's per token
        if j not in masked:
            want = float(np.mean(np.asarray(case["policy_entropies"][j])[scored_of(j)]))
            assert metrics["entropy"][j] == pytest.approx(want, rel=1e-5, abs=1e-6), j
    entropy = float((metrics["entropy"] * n_tok * weight).sum() / (n_tok * weight).sum())
    assert entropy == pytest.approx(case["metrics_loss"]["entropy"], rel=1e-5)
    if rloo:
        counts = {k: int(round(float(metrics[f"clip_ratio/{k}"].sum()))) for k in ("low", "high")}
        assert counts == case["clipped_sequences"]
    else:
        sequence = cfg["importance_sampling_level"] == "sequence"  # a completion clips whole: counted once
        counts = {k: int(round(float((metrics[f"clip_ratio/{k}"] * (weight if sequence else n_tok * weight)).sum())))
                  for k in ("low", "high")}
        assert counts == case["clipped_tokens"]
        tokens = float((n_tok * weight).sum())
        assert tokens == case["num_items_in_batch"]
        logged = {"cispo": {"high": "cispo_clip_ratio"}, "sapo": {}}.get(
            cfg["loss_type"], {k: f"clip_ratio/{k}_mean" for k in ("low", "high")})
        for k, key in logged.items():
            assert counts[k] / (len(store) if sequence else tokens) == pytest.approx(
                case["metrics_loss"][key], abs=1e-6)
        if cfg.get("vllm_importance_sampling_correction"):  # TRL's mean weight: over tokens, or over completions
            mean = (metrics["sampling_ratio"].mean() if cfg["vllm_importance_sampling_mode"].startswith("sequence")
                    else float((metrics["sampling_ratio"] * n_tok).sum()) / tokens)
            assert mean == pytest.approx(case["metrics_generate"]["sampling/importance_sampling_ratio/mean"],
                                         rel=1e-4)
            sampler = [np.asarray(case["sampling_per_token_logps"][j], np.float32)[scored_of(j)]
                       for j in range(len(store))]
            assert all(np.array_equal(task.sampler[j], s.astype(np.float64)) for j, s in enumerate(sampler))
        if cfg["beta"]:
            kl = float((metrics["kl"] * n_tok * weight).sum()) / tokens
            assert kl == pytest.approx(case["metrics_loss"]["kl"], rel=1e-5)

    # 4d. gradients
    worst = {"norm": 0.0, "dot": 0.0, "full": 0.0}
    for (name, p), rec, z in zip(policy.named_parameters(), case["grads"], projections, strict=True):
        assert name == rec["name"]
        g = p.grad.detach().double()
        norm, dot = float(g.norm()), float((g * z).sum())
        scale = max(rec["norm"], 1e-12)
        worst["norm"] = max(worst["norm"], _max_rel(norm, rec["norm"], scale))
        # a dot with a standard normal z is ~ norm in size: held relative to the norm
        worst["dot"] = max(worst["dot"], _max_rel(dot, rec["dot"], scale))
        if "grad" in rec:
            want = torch.tensor(rec["grad"], dtype=torch.float64).reshape(g.shape)
            full = float((g - want).abs().max()) / max(float(want.abs().max()), 1e-12)
            worst["full"] = max(worst["full"], full)
    policy.zero_grad(set_to_none=True)
    print(f"{case['id']}: loss {got - case['loss']:+.2e}, advantages {adv_diff:.2e}, log-probs old "
          f"{old_diff:.2e} policy {lp_diff:.2e}, grad norm {worst['norm']:.2e} dot {worst['dot']:.2e} "
          f"full {worst['full']:.2e}")
    assert worst["norm"] <= GRAD_RTOL and worst["dot"] <= GRAD_RTOL, worst
    assert worst["full"] <= FULL_RTOL, worst
