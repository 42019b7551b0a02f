"""Issue 40's claim with its exact reward: two on-policy rounds raise the mean sample reward and the held-out
preference accuracy, from a warm-started quickstart model.

Why a warm start: the untrained tiny model samples its 400-token vocabulary almost uniformly, so " positive" /
" negative" are ~0.7% of its samples, the reward "1 when the answer names the true label" ties nearly every prompt,
and the few pairs rarely contrast the two labels (docs/on-policy.md, Example). A few SFT steps on OTHER prompts with
a random label each teach the model to answer with a label but not which one (its held-out accuracy stays at the
class share), so what the rounds add is the polarity itself.

Why this baseline: the rounds' own `eval/rewards/accuracies` is 0 before round 1 (policy == reference, every margin 0),
so "after > before" on it is vacuous. The accuracy compared here is the policy's own preference on the held-out
pairs, log p(chosen) > log p(rejected) of each completion as the store holds it (label + EOS: a label-only recompute
differed from the run's lines by a row or more), recomputed in float64 through the HF model for the warm start and the
final policy alike, and checked equal to the run's `eval/logps/accuracies` lines before round 1 and after round 2.

Why k = 8 and 40 steps a round: the one setting tried where all three seeds raise the held-out accuracy (0.5 ->
0.75 / 0.625 / 0.781 for seeds 0 / 1 / 2; docs/on-policy.md has the table); the test asserts seed 0.
"""

from __future__ import annotations

import random

import pytest
import torch

from prefpack.config import load_config
from prefpack.rounds import run_rounds
from tests.conftest import quiet, read_jsonl, write_jsonl

# the reward, exactly: 1 when the sampled answer names the review's true label, else 0
REWARD = '''def reward(prompt, completion, row):
    return 1.0 if row["label"] in completion.lower().split() else 0.0
'''
SEED, PROMPTS, HELD_OUT, WARM_STEPS, STEPS, SAMPLES, LR = 0, 64, 32, 24, 40, 8, 1e-2
LABELS = (" positive", " negative")


def _balanced(rows: list[dict], n: int) -> list[dict]:
    """n rows, positive and negative alternating (class-balanced)."""
    pos = [r for r in rows if r["chosen"] == LABELS[0]][: n // 2]
    neg = [r for r in rows if r["chosen"] == LABELS[1]][: n // 2]
    assert len(pos) == len(neg) == n // 2
    return [r for pair in zip(pos, neg) for r in pair]


def _preference_accuracy(model_dir, tok, rows: list[dict]) -> float:
    """Share of rows whose chosen completion the model prefers: log p(chosen) > log p(rejected), each completion as
    prepare stores it (the label, one token of the toy tokenizer, then EOS), float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).double().eval()
    label_ids = {s: tok(s, add_special_tokens=False)["input_ids"] for s in LABELS}
    assert all(len(ids) == 1 for ids in label_ids.values())

    def logp(prompt: list[int], completion: list[int]) -> float:
        logps = model(torch.tensor([prompt + completion])).logits[0].log_softmax(-1)
        return sum(float(logps[len(prompt) - 1 + i, t]) for i, t in enumerate(completion))

    right = 0
    with torch.no_grad():
        for r in rows:
            prompt = tok(r["prompt"])["input_ids"]
            chosen, rejected = (label_ids[r[side]] + [tok.eos_token_id] for side in ("chosen", "rejected"))
            right += logp(prompt, chosen) > logp(prompt, rejected)
    return right / len(rows)


def test_two_rounds_from_a_warm_start_raise_the_label_reward_and_held_out_accuracy(tmp_path, one_thread):
    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.quickstart import _build_model, make_pairs
    from prefpack.toy_tokenizer import build_toy_tokenizer
    from prefpack.training import train

    tok = build_toy_tokenizer([r["prompt"] + r["chosen"] for r in make_pairs(400, 0)] + list(LABELS),
                              style="llama", vocab_size=400)
    _build_model(tok, tmp_path / "init", SEED)
    pool = make_pairs(400, 10)
    prompts = _balanced(pool, PROMPTS)
    held_out = _balanced([r for r in pool if r not in prompts], HELD_OUT)
    seen = {r["prompt"] for r in prompts + held_out}
    rng = random.Random(SEED)  # the warm start: other prompts, each with a random label (no polarity to learn)
    warm = [dict(r, chosen=c, rejected=LABELS[1 - LABELS.index(c)])
            for r in make_pairs(64, 100) if r["prompt"] not in seen for c in [rng.choice(LABELS)]]
    assert not {r["prompt"] for r in prompts} & {r["prompt"] for r in held_out} and len(warm) > 48
    write_jsonl(tmp_path / "warm.jsonl", warm)
    write_jsonl(tmp_path / "held_out.jsonl", held_out)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"], "label": r["chosen"].strip()} for r in prompts])
    (tmp_path / "reward.py").write_text(REWARD)
    for name in ("warm", "held_out"):
        prepare(PrepareOptions(inputs=[str(tmp_path / f"{name}.jsonl")], tokenizer=str(tmp_path / "init"),
                               output=str(tmp_path / f"{name}-store"), workers=1), log=quiet)
    warmed = train(load_config(None, [
        f"model.name_or_path={tmp_path / 'init'}", f"data.train={tmp_path / 'warm-store'}",
        "loss.terms=[{name: sft}]", "reference.mode=none", f"train.max_steps={WARM_STEPS}",
        "train.global_batch_pairs=8", "optim.lr=1e-2", f"train.seed={SEED}", f"run.output_dir={tmp_path / 'warm'}",
        "run.report_to=none", "run.plot=false"]), log=quiet, progress=False)

    cfg = load_config(None, [
        f"model.name_or_path={warmed.final_dir}", f"data.eval={tmp_path / 'held_out-store'}",
        "train.global_batch_pairs=16", f"optim.lr={LR}", "optim.schedule=cosine", "loss.beta=0.1",
        "loss.terms=[{name: sigmoid}, {name: nll, weight: 0.2}]", f"train.seed={SEED}",
        f"run.output_dir={tmp_path / 'rounds'}", "run.report_to=none", "run.plot=false", "rounds.count=2",
        f"rounds.prompts={tmp_path / 'prompts.jsonl'}", f"rounds.samples_per_prompt={SAMPLES}",
        "rounds.max_new_tokens=1", "rounds.batch_size=16", f"rounds.reward_fn={tmp_path / 'reward.py'}:reward",
        f"rounds.steps_per_round={STEPS}", f"rounds.seed={SEED}"])
    result = run_rounds(cfg, log=quiet, progress=False)

    # the mean sample reward, recomputed here from each round's samples file with the reward written out
    means = []
    for r, line in enumerate(result.rounds, 1):
        samples = read_jsonl(tmp_path / "rounds" / "rounds" / f"{r:03d}" / "samples.jsonl")
        label = {row["row"]: prompts[row["row"]]["chosen"].strip() for row in samples}
        values = [float(c.strip() == label[row["row"]]) for row in samples for c in row["completions"]]
        named = sum(c.strip() in ("positive", "negative") for row in samples for c in row["completions"])
        assert line["reward/mean"] == pytest.approx(sum(values) / len(values))
        assert named > 0.9 * len(values)  # the warm start names a label: pairs contrast the two labels
        means.append(sum(values) / len(values))
    assert means[1] > means[0] + 0.2

    # the held-out preference accuracy of the warm start (the baseline) and of the final policy, recomputed here
    before = _preference_accuracy(warmed.final_dir, tok, held_out)
    after = _preference_accuracy(result.final_dir, tok, held_out)
    assert before <= 0.6 and after > before + 0.2, (before, after)
    import json

    lines = [json.loads(x) for x in (tmp_path / "rounds" / "metrics.jsonl").read_text().splitlines()]
    evals = sorted((x["step"], x["logps/accuracies"]) for x in lines if x["split"] == "eval")
    assert evals[0] == (0, pytest.approx(before)) and evals[-1] == (2 * STEPS, pytest.approx(after))
