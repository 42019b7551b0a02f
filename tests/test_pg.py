"""Group policy gradients (issue 49; prefpack.objectives.pg, prefpack.losses.pg): GRPO's aggregations and RLOO over a
ranked store's prompt groups, against a float64 formula written out here, each completion run alone through the
model; prompts once = packed = padded; masked spans move nothing; the old policy's log-probs recomputed before the
first step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import float64_llama, make_task, scored_logps_f64, store_with_spans, write_jsonl

from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.store import Store

ROWS = [
    {"prompt": "\n\nHuman: What is two plus two?\n\nAssistant:",
     "completions": [{"text": " Four.", "score": 1.0}, {"text": " Five, I think.", "score": 0.0},
                     {"text": " It is four, because two and two make four.", "score": 0.5},
                     {"text": " Four!", "score": 1.0}]},
    {"prompt": "\n\nHuman: Name a colour.\n\nAssistant:",
     "completions": [{"text": " Blue.", "score": 2.0}, {"text": " A dog.", "score": -1.0},
                     {"text": " Red, or green.", "score": 0.25}]},
    {"prompt": "\n\nHuman: Say something.\n\nAssistant:",  # all tied: advantages 0, still counted
     "completions": [{"text": " Something.", "score": 3.0}, {"text": " Anything at all.", "score": 3.0}]},
]
EPS_LOW, EPS_HIGH, KL = 0.02, 0.03, 0.07  # small clips, so some tokens clip at this policy / old-policy gap


@pytest.fixture(scope="module")
def ranked(tmp_path_factory, toy_tokenizers):
    root = tmp_path_factory.mktemp("pg")
    prepare(PrepareOptions(inputs=[str(write_jsonl(root / "rows.jsonl", ROWS))], tokenizer=str(toy_tokenizers["llama"]),
                           output=str(root / "ranked"), workers=1), log=lambda m: None)
    spans = store_with_spans(root / "ranked", root / "spans")
    return {"plain": Store(root / "ranked"), "spans": Store(spans)}


def _config(loss: str, layout: str, *extra):
    from prefpack.config import load_config

    return load_config(None, ["train.objective=policy_gradient", f"loss.terms=[{{name: {loss}}}]",
                              f"data.prefix_sharing={layout == 'shared'}", f"data.packing={layout != 'padded'}",
                              f"loss.epsilon={EPS_LOW}", f"loss.epsilon_high={EPS_HIGH}", *extra])


def _advantages(scores: list[float], loss: str, scale: str = "group") -> np.ndarray:
    s = np.asarray(scores, dtype=np.float64)
    if loss == "rloo":
        return s - (s.sum() - s) / (len(s) - 1)
    centred = s - s.mean()
    return centred / (np.std(s, ddof=1) + 1e-4) if scale == "group" else centred


def _formula(policy, old_model, store: Store, loss: str, kl_coef: float, max_len: int, weigh=None,
             sequence: bool = False) -> torch.Tensor:
    """The step's loss over the whole store, every completion run alone through ``policy`` (with gradient) and
    ``old_model`` (the old policy, also the reference), in float64; ``weigh(row, old)`` gives a completion's
    per-token weights of the surrogate (the sampling correction); ``sequence``: one ratio per completion, exp of
    the mean of its tokens' log-ratios, on each token (GSPO)."""
    terms, tokens, completions = [], 0, 0
    starts = store.group_starts()
    scores = store.scores()
    for g in range(len(starts) - 1):
        prompt, comps = store.ranked_group(g)
        adv = _advantages(scores[starts[g]:starts[g + 1]].tolist(), loss)
        for row, c, a in zip(range(starts[g], starts[g + 1]), comps, adv):
            scored = getattr(c, "scored", None)
            ids = torch.tensor([[int(t) for t in prompt] + [int(t) for t in c]])
            logits = policy(input_ids=ids, use_cache=False).logits.double()
            lp = torch.log_softmax(logits[0, :-1], -1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt) - 1:]
            if scored is not None:
                lp = lp[torch.as_tensor(np.asarray(scored, dtype=bool))]
            old = torch.as_tensor(scored_logps_f64(old_model, prompt, c, scored))
            completions += 1
            tokens += lp.numel()
            if loss == "rloo":
                r = torch.exp(lp.sum() - old.sum())
                terms.append(-torch.minimum(r * a, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a))
                continue
            r = torch.exp(lp - old) if not sequence else torch.exp((lp - old).mean()) * torch.ones_like(lp)
            if loss == "cispo":  # the ratio clipped above at epsilon_high, detached, times A log p
                per_token = -torch.clamp(r, max=EPS_HIGH).detach() * a * lp
            elif loss == "sapo":  # a soft gate, temperature 1.0 for A > 0 and 1.05 otherwise (TRL's defaults)
                tau = 1.0 if a > 0 else 1.05
                per_token = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
            else:
                per_token = -torch.minimum(r * a, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
            if weigh is not None:
                per_token = per_token * torch.as_tensor(weigh(row, old.numpy()))
            per_token = per_token + kl_coef * (torch.exp(old - lp) - (old - lp) - 1) * r  # TRL's bias correction
            terms.append(per_token.sum() / (lp.numel() if loss in ("grpo", "sapo") else max_len if loss == "dr_grpo"
                                            else 1))
    total = torch.stack(terms).sum()
    return total / (tokens if loss in ("dapo", "bnpo", "cispo") else completions)


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "rloo"])
@pytest.mark.parametrize(("which", "layout"), [("plain", "shared"), ("plain", "packed"), ("plain", "padded"),
                                               ("spans", "shared")])
def test_loss_and_gradients_equal_the_float64_formula(ranked, toy_tokenizers, loss, layout, which):
    """The step's loss (the sum of the completions' values over the step's units, as the loop takes it) and its
    gradient equal the written-out formula, each completion alone; the old policy recomputed before the first step
    (here: another model, so ratios differ from 1 and some tokens clip); prompts once, packed and padded alike;
    a store's unscored spans are not in any sum or count."""
    from prefpack.model import SequenceLogps
    from prefpack.objectives.base import Planned
    from prefpack.objectives.pg import GroupPolicyTask
    from prefpack.reference import CopyReference

    store = ranked[which]
    tok = toy_tokenizers["llama"]
    kl = 0.0 if loss == "rloo" else KL
    policy, old_model = float64_llama(tok, 0), float64_llama(tok, 1)
    task = make_task(GroupPolicyTask, store, _config(loss, layout, f"loss.kl_coef={kl}",
                                                     "loss.max_completion_length=16"))
    reference = CopyReference(float64_llama(tok, 1))
    reference.configure(chunk_size=7, pair_tails=False, token_logps=True)
    task._start(SequenceLogps(old_model, chunk_size=5, token_logps=True), reference)  # the old policy's, once
    module = SequenceLogps(policy, chunk_size=7, token_logps=True, entropy=True)
    ids = np.arange(len(task))
    task.plan_step(ids, seed=None)
    rows = [[0, 1], [2]] if layout != "padded" else [[0], [1], [2]]
    got = torch.cat([task.loss(module, reference, task.collate(Planned([r], 0, 0)), None).loss for r in rows]
                    if layout == "padded" else [task.loss(module, reference, task.collate(Planned(rows, 0, 0)),
                                                          None).loss])
    got = got.sum() / task.units(ids)
    want = _formula(policy, old_model, store, loss, kl, 16)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    # gradients to float32 accuracy: LlamaRMSNorm casts to float32 even in a float64 model (tests/test_ranked.py)
    params = [p for p in policy.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    out = task.loss(module, reference, task.collate(Planned([[0, 1, 2]], 0, 0)), None)
    if loss not in ("rloo", "sapo", "cispo"):  # the clip is active on some tokens of this pair of models, not all
        clipped = out.metrics["clip_ratio/region"]
        assert 0 < float(clipped.max()) and float(clipped.min()) < 1


def test_current_old_logprobs_give_the_plain_policy_gradient(ranked, toy_tokenizers):
    """``loss.old_logprobs=current``: ratio 1, so the grpo loss is -mean(A) = 0 per group with group scaling, and
    its gradient is -A times the gradient of the token mean of log p (the REINFORCE form)."""
    from prefpack.model import SequenceLogps
    from prefpack.objectives.base import Planned
    from prefpack.objectives.pg import GroupPolicyTask
    from prefpack.reference import NoReference

    store = ranked["plain"]
    tok = toy_tokenizers["llama"]
    policy = float64_llama(tok, 0)
    task = make_task(GroupPolicyTask, store, _config("grpo", "shared", "loss.old_logprobs=current"))
    module = SequenceLogps(policy, chunk_size=7, token_logps=True, entropy=True)
    task.begin_step(module, NoReference(), [])
    assert task.old is None
    ids = np.arange(len(task))
    task.plan_step(ids, seed=None)
    got = task.loss(module, NoReference(), task.collate(Planned([[0, 1, 2]], 0, 0)), None).loss.sum() / task.units(ids)
    starts, scores = store.group_starts(), store.scores()
    want = []
    for g in range(len(starts) - 1):
        prompt, comps = store.ranked_group(g)
        for c, a in zip(comps, _advantages(scores[starts[g]:starts[g + 1]].tolist(), "grpo")):
            ids_ = torch.tensor([[int(t) for t in prompt] + [int(t) for t in c]])
            lp = torch.log_softmax(policy(input_ids=ids_).logits.double()[0, :-1], -1)
            lp = lp[torch.arange(ids_.shape[1] - 1), ids_[0, 1:]][len(prompt) - 1:]
            want.append(-a * lp.mean())
    want = torch.stack(want).sum() / len(want)
    assert float(got.detach()) == pytest.approx(0.0, abs=1e-12)
    params = [p for p in policy.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


GAP_SEED, RATIO_MIN, RATIO_MAX = 7, 0.95, 1.06


def _weights(old: np.ndarray, sampler: np.ndarray, mode: str) -> np.ndarray:
    """TRL 1.16's importance-sampling weights written out: exp(old - sampler) per token, or exp of its sum per
    completion; clipped to [RATIO_MIN, RATIO_MAX] (truncate) or 0 outside it (mask)."""
    ratio = np.exp(old - sampler) if mode.startswith("token") else np.exp((old - sampler).sum()) * np.ones_like(old)
    if mode.endswith("truncate"):
        return np.minimum(np.maximum(ratio, RATIO_MIN), RATIO_MAX)
    return np.where((ratio < RATIO_MIN) | (ratio > RATIO_MAX), 0.0, ratio)


def _sampled_task(store, tok, old_model, mode, loss, layout, *extra):
    """A task whose old policy is recomputed from ``old_model`` and whose sampler log-probs are that plus seeded
    noise (what a store's logprobs.bin gives), with the sampling correction ``mode``; and its reference."""
    from prefpack.model import SequenceLogps
    from prefpack.objectives.pg import GroupPolicyTask
    from prefpack.reference import CopyReference

    task = make_task(GroupPolicyTask, store, _config(loss, layout, f"loss.kl_coef={KL}", *extra,
                                                     f"loss.sampling_ratio_min={RATIO_MIN}",
                                                     f"loss.sampling_ratio_max={RATIO_MAX}"))
    reference = CopyReference(float64_llama(tok, 1))
    reference.configure(chunk_size=7, pair_tails=False, token_logps=True)
    task._start(SequenceLogps(old_model, chunk_size=5, token_logps=True), reference)
    rng = np.random.default_rng(GAP_SEED)
    task.sampler = [o + rng.normal(0.0, 0.03, o.shape) for o in task.old]
    task.correction = mode
    return task, reference


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("layout", ["shared", "padded"])
def test_sampling_correction_weights_the_surrogate_as_the_formula(ranked, toy_tokenizers, mode, layout):
    """``loss.sampling_correction``: each token's surrogate (not its KL) times the weight from the recomputed old
    policy and the sampler's log-probs (here: the old policy's plus seeded noise, so some ratios pass the bounds and
    some do not), against the float64 formula with TRL's weights written out; loss, gradients and the masked share."""
    from prefpack.model import SequenceLogps
    from prefpack.objectives.base import Planned

    store = ranked["plain"]
    tok = toy_tokenizers["llama"]
    policy, old_model = float64_llama(tok, 0), float64_llama(tok, 1)
    task, reference = _sampled_task(store, tok, old_model, mode, "grpo", layout)
    module = SequenceLogps(policy, chunk_size=7, token_logps=True, entropy=True)
    ids = np.arange(len(task))
    task.plan_step(ids, seed=None)
    plans = [[[0, 1, 2]]] if layout == "shared" else [[[0]], [[1]], [[2]]]
    outs = [task.loss(module, reference, task.collate(Planned(p, 0, 0)), None) for p in plans]
    got = torch.cat([o.loss for o in outs]).sum() / task.units(ids)
    want = _formula(policy, old_model, store, "grpo", KL, 16,
                    weigh=lambda row, old: _weights(old, task.sampler[row], mode))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    params = [p for p in policy.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    weights = np.concatenate([_weights(o, s, mode) for o, s in zip(task.old, task.sampler)])
    assert 0 < (weights == 0).mean() < 1 if mode.endswith("mask") else 0 < (weights == RATIO_MAX).mean() < 1
    masked = torch.cat([o.metrics["sampling_masked"] for o in outs])
    assert (float(masked.max()) > 0) == mode.endswith("mask")


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
@pytest.mark.parametrize("correction", [None, "token_truncate", "sequence_mask"])
def test_sequence_level_ratio_is_gspo_as_the_formula(ranked, toy_tokenizers, loss, correction):
    """``loss.importance_sampling_level=sequence`` (GSPO): one ratio per completion, exp of the mean of its tokens'
    log-ratios to the old policy, clipped and on every token; the KL times that ratio; with or without the sampling
    correction; against the float64 formula, loss and gradients, prompts once and padded alike."""
    from prefpack.model import SequenceLogps
    from prefpack.objectives.base import Planned

    store = ranked["spans"]  # unscored spans: the mean is over the scored tokens
    tok = toy_tokenizers["llama"]
    policy, old_model = float64_llama(tok, 0), float64_llama(tok, 1)
    got = []
    for layout in ("shared", "padded"):
        task, reference = _sampled_task(store, tok, old_model, correction, loss, layout,
                                        "loss.importance_sampling_level=sequence")
        module = SequenceLogps(policy, chunk_size=7, token_logps=True, entropy=True)
        ids = np.arange(len(task))
        task.plan_step(ids, seed=None)
        plans = [[[0, 1, 2]]] if layout == "shared" else [[[0]], [[1]], [[2]]]
        outs = [task.loss(module, reference, task.collate(Planned(p, 0, 0)), None) for p in plans]
        got.append(torch.cat([o.loss for o in outs]).sum() / task.units(ids))
    weigh = None if correction is None else (lambda row, old: _weights(old, task.sampler[row], correction))
    want = _formula(policy, old_model, store, loss, KL, 16, weigh=weigh, sequence=True)
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12)
    params = [p for p in policy.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(got[0], params), torch.autograd.grad(want, params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    region = torch.cat([o.metrics["clip_ratio/region"] for o in outs])
    assert set(region.tolist()) <= {0.0, 1.0} and 0 < float(region.sum()) < len(region)  # whole completions clip


def test_sampling_correction_follows_trl_where_it_applies(ranked, toy_tokenizers):
    """``auto`` is TRL's default where TRL applies it: sequence_mask for a store vLLM sampled (its samples record)
    with the old policy recomputed; none for the in-process engine's samples or a store without log-probs. An
    explicit mode without what it reads is refused in one line."""
    import copy
    import dataclasses

    from prefpack.data.store import StoreError
    from prefpack.objectives.pg import GroupPolicyTask

    task = make_task(GroupPolicyTask, ranked["plain"], _config("grpo", "shared"))
    assert task.correction is None  # no logprobs.bin: nothing to correct with
    task.store = copy.copy(task.store)
    task.sampler = [np.zeros(int(n)) for n in task.scored]

    def resolved(mode: str = "auto", engine: str = "vllm", old: str = "recompute", loss: str = "grpo"):
        task.store.meta = {**task.store.meta, "samples": {"generation": {"engine": engine}}}
        task.settings = dataclasses.replace(task.settings, loss=dataclasses.replace(
            task.settings.loss, sampling_correction=mode))
        task.old_mode, task.loss_name = old, loss
        return task._sampling_correction()

    assert resolved() == "sequence_mask" and resolved(engine="transformers") is None
    assert resolved(old="sampler") is None and resolved(loss="rloo") is None
    assert resolved("token_truncate", engine="transformers") == "token_truncate" and resolved("none") is None
    with pytest.raises(ValueError, match="needs loss.old_logprobs=recompute"):
        resolved("sequence_mask", old="current")
    with pytest.raises(ValueError, match="loss rloo has none"):
        resolved("token_mask", loss="rloo")
    task.sampler = None
    with pytest.raises(StoreError, match="does not hold"):
        resolved("token_mask")


def test_config_names_the_wrong_combinations():
    from prefpack.config import ConfigError, load_config

    def problems(*args):
        with pytest.raises(ConfigError) as err:
            load_config(None, ["model.name_or_path=m", "data.train=s", *args]).validate()
        return str(err.value)

    assert "one of grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, rloo" in problems("train.objective=policy_gradient")
    assert "set train.objective=policy_gradient" in problems("loss.terms=[{name: grpo}]")
    assert "loss.epsilon must be < 1" in problems("train.objective=policy_gradient", "loss.terms=[{name: dapo}]",
                                                  "loss.epsilon=1.5")
    assert "sidecar" in problems("train.objective=policy_gradient", "loss.terms=[{name: grpo}]", "loss.kl_coef=0.1",
                                 "reference.mode=precomputed")
    assert "already the whole completion's" in problems("train.objective=policy_gradient", "loss.terms=[{name: rloo}]",
                                                        "loss.importance_sampling_level=sequence")
    assert "min below max" in problems("train.objective=policy_gradient", "loss.terms=[{name: grpo}]",
                                       "loss.sampling_ratio_min=2", "loss.sampling_ratio_max=1.5")


def _train(tmp_path, model, store, name, *extra):
    import json

    from prefpack.config import load_config
    from prefpack.training import train

    cfg = load_config(None, [f"model.name_or_path={model}", f"data.train={store.path}", "train.max_steps=2",
                             "train.global_batch_pairs=3", "train.device=cpu", "optim.lr=5e-3",
                             "train.objective=policy_gradient", "loss.terms=[{name: dapo}]", "loss.kl_coef=0.05",
                             "optim.schedule=constant", f"run.output_dir={tmp_path / name}", "run.plot=false",
                             "run.save_every=1", *extra])
    notes: list[str] = []
    train(cfg, progress=False, log=notes.append)
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x.get("split", "train") == "train"], notes


def test_training_steps_do_not_depend_on_micro_batches(ranked, toy_tokenizers, tmp_path, one_thread):
    """Two optimizer steps over the store: one micro-batch per step, or one per prompt group (1 x k = k x 1), give
    the same losses, metrics and final weights; the old policy is the starting one (recomputed once, so step 2's
    ratios differ from 1); a run of the objective reports its metrics."""
    from conftest import final_weights, tiny_llama

    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "model", seed=0)
    store = ranked["spans"]
    whole, notes = _train(tmp_path, model, store, "whole")
    split, _ = _train(tmp_path, model, store, "split", "train.micro_batch_tokens=40")
    assert any("all tie" in n for n in notes)
    assert len(whole) == len(split) == 2
    for a, b in zip(whole, split):
        for key in ("loss", "kl", "clip_ratio/region", "reward", "advantage", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert whole[0]["kl"] == pytest.approx(0.0, abs=1e-7) and whole[1]["kl"] > 0
    assert whole[0]["clip_ratio/region"] == 0.0  # ratio 1 at the first step
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "split")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_resumed_equals_uninterrupted(ranked, toy_tokenizers, tmp_path, one_thread):
    """Stopped after step 1 of 3 and resumed: the old policy's log-probs recomputed before step 1 come back from the
    checkpoint (not recomputed from the resumed weights), so steps 2-3 and the final weights equal an uninterrupted
    run's."""
    from conftest import final_weights, tiny_llama

    from prefpack.config import load_config
    from prefpack.training import train

    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "model", seed=0)
    args = [f"model.name_or_path={model}", f"data.train={ranked['plain'].path}", "train.max_steps=3",
            "train.global_batch_pairs=1", "train.device=cpu", "optim.lr=2e-2", "train.objective=policy_gradient",
            "loss.terms=[{name: grpo}]", "optim.schedule=constant", "run.plot=false", "run.save_every=1",
            "loss.epsilon=0.05", "data.shuffle=false"]

    def cfg(name):
        return load_config(None, [*args, f"run.output_dir={tmp_path / name}"])

    import json

    train(cfg("straight"), progress=False, log=lambda m: None)
    from prefpack.training.cadence import TrainingInterrupted

    with pytest.raises(TrainingInterrupted):
        train(cfg("resumed"), stop_after_steps=1, progress=False, log=lambda m: None)
    train(cfg("resumed"), resume=True, progress=False, log=lambda m: None)

    def lines(name):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows if r.get("split", "train") == "train"}

    a, b = lines("straight"), lines("resumed")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert a[2]["clip_ratio/region"] > 0  # step 2's ratios are to the starting policy, not 1
    for step in (2, 3):
        for key in ("loss", "clip_ratio/region", "grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), (step, key)
    wa, wb = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_grpo_rounds_raise_held_out_reward_on_the_arithmetic_task(tmp_path, one_thread):
    """`prefpack quickstart --task arithmetic`'s GRPO config, two rounds at seed 3: the held-out prompts' mean sample
    reward (the final policy sampled as a next round would) rises by more than 0.05 over the warm start's, and the
    training prompts' sample reward rises from round 1 to round 2. Measured first on seeds 0-4 (benchmarks/
    arithmetic_rounds.py, 2026-11-28), held-out after two rounds minus the warm start: -0.013, +0.056, +0.018, +0.100,
    +0.100 (+0.006 to +0.225 after three); the training prompts' reward rose in every round of every seed."""
    import json

    from prefpack.arithmetic import build_arithmetic, sample_accuracy
    from prefpack.config import load_config
    from prefpack.rounds import run_rounds

    built = build_arithmetic(str(tmp_path / "task"), seed=3, log=lambda m: None)
    cfg = load_config(built["grpo_config"], ["rounds.count=2", "run.plot=false", f"run.output_dir={tmp_path / 'run'}"])
    result = run_rounds(cfg, log=lambda m: None, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rounds = sorted((x for x in lines if x.get("split") == "round"), key=lambda x: x["round"])
    final = sample_accuracy(result.final_dir, tmp_path / "task" / "data" / "held_out_prompts.jsonl",
                            tmp_path / "final.jsonl", n=cfg.rounds.samples_per_prompt, seed=cfg.rounds.seed + 2)
    warm = rounds[0]["eval_reward/mean"]
    assert final > warm + 0.05, (warm, final)
    assert rounds[1]["reward/mean"] > rounds[0]["reward/mean"]


def test_an_eval_store_scores_the_policy_of_each_evaluation(ranked, toy_tokenizers, tmp_path, one_thread):
    """data.eval with a ranked store: each evaluation takes the policy as it stands as the old policy (no ratio
    clipped, whatever the steps before), its KL to the reference grows as the policy moves away."""
    import json

    from conftest import tiny_llama

    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "model", seed=0)
    _train(tmp_path, model, ranked["plain"], "evals", f"data.eval={ranked['spans'].path}", "run.eval_every=1",
           "loss.epsilon=0.01")
    lines = [json.loads(x) for x in (tmp_path / "evals" / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if x.get("split") == "eval"]
    assert len(evals) >= 2
    assert all(x["clip_ratio/region"] == 0.0 for x in evals)
    assert evals[-1]["kl"] > evals[0]["kl"] >= 0.0
