"""`prefpack score` (issue 39, item 4): samples, text rows or a store scored by a reward function or a reward model
into a ranked store (token ids as given), a pair store of drawn pairs, or JSONL; a killed run resumed writes the same
bytes as an uninterrupted one; user code's failures are one-line errors naming the row."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import write_jsonl

from prefpack.cli import main
from prefpack.data.store import Store
from prefpack.data.views import group_pairs
from prefpack.rewards.pairs import PairSelection, all_pairs, best_vs_rest, best_vs_worst
from prefpack.rewards.run import ScoreOptions, ScoringInterrupted, score

# the reward function the tests score with: a verifier-like mix of the completion's text and the row's label
REWARD_FN = """
import os

def reward(prompt, completion, row):
    if os.environ.get("SCORE_CALLS"):
        with open(os.environ["SCORE_CALLS"], "a") as fh:
            fh.write(f"{row['row']}\\n")
    return float(len(completion) % 7) + 0.5 * row["label"]
"""


def expected_reward(completion: str, label: int) -> float:
    return float(len(completion) % 7) + 0.5 * label


def make_samples(tmp_path, tok_dir, n_rows=10, k=3, seed=0):
    """A samples file as `prefpack generate` writes it (random ids, decoded texts, cut flags, passthrough label)
    and its meta; returns the file and the rows."""
    from transformers import AutoTokenizer

    from prefpack.tokenizer import HASH_VERSION, tokenizer_hash

    tok = AutoTokenizer.from_pretrained(tok_dir)
    rng = random.Random(seed)
    rows = []
    for i in range(n_rows):
        p = [rng.randrange(5, len(tok)) for _ in range(rng.randrange(3, 9))]
        comps = [[rng.randrange(5, len(tok)) for _ in range(rng.randrange(2, 8))] for _ in range(k)]
        rows.append({"prompt_ids": p, "completion_ids": comps, "prompt": tok.decode(p),
                     "completions": [tok.decode(c) for c in comps], "truncated": [j == 1 for j in range(k)],
                     "row": i, "label": i % 3})
    path = write_jsonl(tmp_path / "samples.jsonl", rows)
    (tmp_path / "samples.meta.json").write_text(json.dumps(
        {"tokenizer": {"name": str(tok_dir), "hash": tokenizer_hash(tok), "hash_version": HASH_VERSION},
         "generation": {"n": k, "temperature": 1.0}}))
    return path, rows


def cli(*argv) -> int:
    return main(["score", *map(str, argv), "--no-progress"])


def test_samples_scored_by_a_reward_fn_keep_their_ids_train_and_show_in_inspect(tmp_path, toy_tokenizers, capsys,
                                                                                 one_thread):
    from conftest import tiny_llama

    from prefpack.config import load_config
    from prefpack.training import train

    tok = toy_tokenizers["llama"]
    samples, rows = make_samples(tmp_path, tok)
    fn = tmp_path / "fn.py"
    fn.write_text(REWARD_FN)
    assert cli(samples, "-o", tmp_path / "ranked", "--reward-fn", f"{fn}:reward") == 0
    store = Store(tmp_path / "ranked", verify=True)
    assert store.kind == "ranked" and store.meta["num_groups"] == len(rows)
    flags = store.column("flags")
    for g, row in enumerate(rows):
        prompt, comps = store.ranked_group(g)
        assert prompt.tolist() == row["prompt_ids"]  # the ids as generated: nothing re-tokenised
        assert [c.tolist() for c in comps] == row["completion_ids"]
        a, b = store.group_starts()[g], store.group_starts()[g + 1]
        assert store.scores()[a:b].tolist() == [expected_reward(c, row["label"]) for c in row["completions"]]
        assert (flags[a:b] & 2).astype(bool).tolist() == row["truncated"]
        assert store.column("source_row")[a:b].tolist() == [g] * (b - a)
    assert store.meta["samples"]["generation"] == {"n": 3, "temperature": 1.0}
    assert not (tmp_path / "ranked.partial").exists()
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "ranked"), "--row", "4", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["row"]
    assert shown["score"] == expected_reward(rows[1]["completions"][1], rows[1]["label"]) and shown["group"] == 1
    assert main(["inspect", str(tmp_path / "ranked")]) == 0
    assert f"scores     by reward_fn {fn}:reward: 30 completions" in capsys.readouterr().out

    # best_vs_worst as a pair store: each prompt's (max, min) completions, a tie skipped and counted
    assert cli(samples, "-o", tmp_path / "pairs", "--reward-fn", f"{fn}:reward", "--pairs", "best_vs_worst") == 0
    pairs = Store(tmp_path / "pairs")
    want = []
    for row in rows:
        s = [expected_reward(c, row["label"]) for c in row["completions"]]
        if max(s) > min(s):
            want.append((row["prompt_ids"], row["completion_ids"][s.index(max(s))],
                         row["completion_ids"][len(s) - 1 - s[::-1].index(min(s))]))
    assert [tuple(x.tolist() for x in pairs.pair(i)) for i in range(len(pairs))] == want
    assert pairs.meta["pairs"]["tied_prompts"] == len(rows) - len(want)

    # the ranked store trains (one step)
    model = tiny_llama(tok, tmp_path / "model", seed=0)
    cfg = load_config(None, [f"model.name_or_path={model}", f"data.train={store.path}", "train.max_steps=1",
                             "train.global_batch_pairs=4", "train.device=cpu", f"run.output_dir={tmp_path / 'run'}",
                             "run.plot=false", "run.tensorboard=false"])
    train(cfg, progress=False, log=lambda m: None)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(math.isfinite(m.get("loss", math.nan)) for m in metrics)


def test_a_killed_run_resumes_and_writes_the_same_bytes(tmp_path, toy_tokenizers, monkeypatch):
    tok = toy_tokenizers["neox"]
    samples, rows = make_samples(tmp_path, tok, n_rows=9)
    fn = tmp_path / "fn.py"
    fn.write_text(REWARD_FN)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("SCORE_CALLS", str(calls))

    def opts(out, **kw):
        return ScoreOptions(input=str(samples), output=str(tmp_path / out), reward_fn=f"{fn}:reward",
                            checkpoint_rows=2, progress=False, **kw)

    score(opts("whole"), log=lambda m: None)
    calls.unlink()
    with pytest.raises(ScoringInterrupted):
        score(opts("resumed", stop_after_rows=4), log=lambda m: None)
    assert not (tmp_path / "resumed").exists() and (tmp_path / "resumed.partial").is_dir()
    (tmp_path / "resumed.partial" / ".rows-000000004-000000006.json.tmp-99").write_text('{"scores": [[1')  # a kill
    notes = []
    score(opts("resumed"), log=notes.append)
    assert any("4 rows already scored" in n for n in notes)
    scored = [int(x) for x in calls.read_text().split()]
    assert sorted(set(scored)) == list(range(9)) and scored.count(0) == 3 and scored.count(5) == 3  # none twice
    for name in ("meta.json", "tokens.bin", "index.bin", "tokenizer/tokenizer.json"):
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert not (tmp_path / "resumed.partial").exists()

    # a checkpoint of another scorer is refused, not mixed in
    other = tmp_path / "other.py"
    other.write_text(REWARD_FN.replace("0.5 *", "0.25 *"))
    with pytest.raises(ScoringInterrupted):
        score(opts("mixed", stop_after_rows=2), log=lambda m: None)
    with pytest.raises(Exception, match="holds the scores of another run"):
        score(ScoreOptions(input=str(samples), output=str(tmp_path / "mixed"), reward_fn=f"{other}:reward",
                           progress=False), log=lambda m: None)


@pytest.mark.parametrize("source, expect", [
    ("def reward(p, c):\n    return 1.0\nraise RuntimeError('no GPU here')\n", "importing .* RuntimeError: no GPU here"),
    ("def reward(p, c)\n    return 1.0\n", "importing .* SyntaxError"),
    ("import not_a_module_anywhere\n", "importing .* ModuleNotFoundError"),
    ("score = 3\n", "'reward' is not defined"),
    ("def reward(p, c, row):\n    return 1 / (row['row'] - 2)\n", "row 2, completion 0: the function raised "
     "ZeroDivisionError"),
    ("def reward(p, c):\n    return 'good'\n", "row 0, completion 0: the function returned str 'good', not a number"),
    ("def reward(p, c, row):\n    return float('nan') if row['row'] == 3 else 1.0\n", "row 3, completion 0: the "
     "function returned nan"),
])
def test_a_bad_reward_function_or_row_is_a_one_line_error(tmp_path, toy_tokenizers, capsys, source, expect):
    import re

    samples, _ = make_samples(tmp_path, toy_tokenizers["neox"], n_rows=5)
    fn = tmp_path / "bad.py"
    fn.write_text(source)
    capsys.readouterr()
    assert cli(samples, "-o", tmp_path / "out", "--reward-fn", f"{fn}:reward") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("prefpack score: error: --reward-fn") and re.search(expect, err), err
    assert not (tmp_path / "out").exists()


def test_a_reward_model_scores_each_sequence_as_the_model_alone(tmp_path, toy_tokenizers):
    """Text rows tokenised as prepare tokenises them, scored in padded batches: equal to the model's head read at each
    sequence's last token run alone, a completion ending in the pad id (EOS) included."""
    import transformers as tf

    from prefpack.data.prepare import PrepareOptions, prepare

    tok_dir = toy_tokenizers["llama"]
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.eos_token_id)
    model = tf.LlamaForSequenceClassification(cfg).eval()
    model.save_pretrained(tmp_path / "rm")
    rows = [{"prompt": "\n\nHuman: What is two plus two?\n\nAssistant:", "completions": [" Four.", " Five, I think."],
             "label": 1},
            {"prompt": "\n\nHuman: Name a colour.\n\nAssistant:", "completions": [" Blue.", " A dog.", " Red, or "
             "perhaps a deep and quiet green."]}]
    text = write_jsonl(tmp_path / "rows.jsonl", rows)
    assert cli(text, "-o", tmp_path / "scored", "--reward-model", tmp_path / "rm", "--tokenizer", tok_dir,
               "--batch-tokens", 40, "--format", "jsonl") == 0
    got = [json.loads(x) for x in (tmp_path / "scored").read_text().splitlines()]
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "ranked.jsonl", [
        {**r, "scores": [0] * len(r["completions"])} for r in rows]))], tokenizer=str(tok_dir),
        output=str(tmp_path / "prepared"), workers=1), log=lambda m: None)
    prepared = Store(tmp_path / "prepared")
    for g, (row, out) in enumerate(zip(rows, got)):
        prompt, comps = prepared.ranked_group(g)
        assert out["prompt_ids"] == prompt.tolist() and out["completion_ids"] == [c.tolist() for c in comps]
        assert out.get("label") == row.get("label") and out["completions"] == row["completions"]
        for ids, value in zip(out["completion_ids"], out["scores"]):
            seq = torch.tensor([out["prompt_ids"] + ids])
            assert seq[0, -1] == tok.eos_token_id  # the pad id: pooling by pad id would read another token
            with torch.no_grad():
                by_hand = model.score(model.model(seq).last_hidden_state[0, -1]).item()
            assert value == pytest.approx(by_hand, abs=1e-5)


def test_pair_selection_modes_and_ties():
    rng = np.random.default_rng(0)
    for _ in range(50):
        s = rng.integers(0, 4, size=rng.integers(2, 7)).astype(float).tolist()
        for mode, fn in (("best_vs_rest", best_vs_rest), ("all_pairs", all_pairs)):
            assert fn(s) == group_pairs(np.array(s), mode)  # what a ranked store yields at train time
        hi, lo = max(s), min(s)
        want = [] if hi == lo else [(s.index(hi), len(s) - 1 - s[::-1].index(lo))]
        assert best_vs_worst(s) == want
    s = [0.1, 0.5, 0.45, 0.9]
    assert all_pairs(s, min_gap=0.38) == [(3, 0), (3, 1), (3, 2), (1, 0)] and best_vs_rest(s, min_gap=0.5) == [(3, 0)]
    pick = PairSelection("best_vs_worst", min_gap=0.2)
    assert pick([1.0, 1.1]) == [] and pick([2.0, 2.0, 2.0]) == [] and pick([0.0, 1.0]) == [(1, 0)]
    assert pick.counts() == {"mode": "best_vs_worst", "min_gap": 0.2, "prompts": 3, "pairs": 1, "tied_prompts": 2,
                             "mean_gap": 1.0}


def test_a_pair_store_scored_keeps_its_ids_and_unscored_spans(tmp_path, toy_tokenizers):
    """A pair store's pairs become ranked groups of two: the same ids, the same unscored tokens (spans.bin)."""
    from prefpack.data.prepare import PrepareOptions, prepare
    from prefpack.data.spans import scored_of

    rows = [{"prompt": "Q: two plus two?\nA:", "chosen": " Four. [cite] done", "rejected": " Five.",
             "loss_masking_spans": {"chosen": [[7, 13]], "rejected": []}},
            {"prompt": "Q: a colour?\nA:", "chosen": " Blue.", "rejected": " A dog, [note] surely.",
             "loss_masking_spans": {"chosen": [], "rejected": [[7, 14]]}}]
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "pairs.jsonl", rows))],
                           tokenizer=str(toy_tokenizers["neox"]), output=str(tmp_path / "pairs"), workers=1),
            log=lambda m: None)
    pairs = Store(tmp_path / "pairs")
    assert len(pairs.spans) == 2
    fn = tmp_path / "fn.py"
    fn.write_text("def reward(prompt, completion):\n    return len(completion) / 10\n")
    assert cli(tmp_path / "pairs", "-o", tmp_path / "ranked", "--reward-fn", f"{fn}:reward") == 0
    ranked = Store(tmp_path / "ranked", verify=True)
    assert ranked.meta["source_layout"] == "store" and len(ranked.spans) == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_tokenizers["neox"])
    for i in range(len(pairs)):
        prompt, chosen, rejected = pairs.pair(i)
        got_prompt, comps = ranked.ranked_group(i)
        assert got_prompt.tolist() == prompt.tolist()
        for want, got in zip((chosen, rejected), comps):
            assert got.tolist() == want.tolist()
            mask_want, mask_got = scored_of(want), scored_of(got)
            assert (mask_want is None and mask_got is None) or mask_got.tolist() == mask_want.tolist()
        assert ranked.scores()[2 * i:2 * i + 2].tolist() == [len(tok.decode(c.tolist())) / 10 for c in (chosen,
                                                                                                     rejected)]


def test_a_reward_model_scores_a_ranked_store_packed_prompts_once_as_each_sequence_alone(tmp_path, toy_tokenizers,
                                                                                        monkeypatch):
    """A ranked store of 4 completions per prompt, scored in float64 under a small token budget (several
    micro-batches, several groups per row): every prompt laid out once, no padding, and every score equal to
    AutoModelForSequenceClassification run on that prompt + completion alone."""
    import transformers as tf

    import prefpack.model.reward as reward_forward
    from prefpack.data.prepare import PrepareOptions, prepare

    tok_dir = toy_tokenizers["llama"]
    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(1)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=None)
    model = tf.LlamaForSequenceClassification(cfg).double().eval()
    model.save_pretrained(tmp_path / "rm")
    rows = [{"prompt": f"Q{i}: what is {i} plus {i}?" + " Think." * i,
             "completions": [f" {2 * i}.", f" It is {2 * i + k}, I believe." * (k + 1), " No idea.", f" {k}{i}!"],
             "scores": [3, 2, 1, 0]} for i, k in ((1, 0), (2, 1), (3, 2), (4, 0), (5, 1))]
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "ranked.jsonl", rows))], tokenizer=str(tok_dir),
                           output=str(tmp_path / "ranked"), workers=1), log=lambda m: None)
    store = Store(tmp_path / "ranked")
    batches = []
    real = reward_forward.sequence_rewards

    def spy(model, batch, **kw):
        batches.append(batch)
        return real(model, batch, **kw)

    monkeypatch.setattr(reward_forward, "sequence_rewards", spy)
    def opts(out, **kw):
        return ScoreOptions(input=str(tmp_path / "ranked"), output=str(tmp_path / out), format="jsonl",
                            reward_model=str(tmp_path / "rm"), dtype="float64", batch_tokens=150, checkpoint_rows=2,
                            progress=False, **kw)

    score(opts("scored.jsonl"), log=lambda m: None)
    got = [json.loads(x) for x in (tmp_path / "scored.jsonl").read_text().splitlines()]
    unique = sum(len(store.ranked_group(g)[0]) + sum(map(len, store.ranked_group(g)[1])) for g in range(len(rows)))
    assert len(batches) >= 3 and any(len(b.group_ids) > 1 for b in batches)
    assert all(b.score_positions is not None and b.packed for b in batches)  # prompts laid out once, packed
    assert sum(b.positions for b in batches) == unique == sum(b.computed_tokens for b in batches)  # no padding
    for g, out in enumerate(got):
        prompt, comps = store.ranked_group(g)
        assert len(comps) == 4 and out["completion_ids"] == [c.tolist() for c in comps]
        for ids, value in zip(comps, out["scores"]):
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([prompt.tolist() + ids.tolist()])).logits[0, 0].item()
            assert value == pytest.approx(alone, rel=1e-10, abs=1e-12)
    with pytest.raises(ScoringInterrupted):  # killed after 2 rows, then resumed: the same bytes
        score(opts("resumed.jsonl", stop_after_rows=2), log=lambda m: None)
    score(opts("resumed.jsonl"), log=lambda m: None)
    assert (tmp_path / "resumed.jsonl").read_bytes() == (tmp_path / "scored.jsonl").read_bytes()


def test_the_example_reward_fn_sees_hh_rlhfs_curly_apostrophe_refusals():
    """examples/rewards/concise.py (docs/scoring.md's example) on the bundled hh test rows: a reply opening with
    "I’m sorry" (hh-rlhf's curly apostrophe: 14 of its final replies) is a refusal, as "I'm sorry" is."""
    import gzip
    from pathlib import Path

    from prefpack.rewards.scorers import RewardFunctionScorer

    root = Path(__file__).resolve().parents[1]
    fn = RewardFunctionScorer(f"{root}/examples/rewards/concise.py:reward").fn
    with gzip.open(root / "examples/data/hh-rlhf-harmless-base/test_312.jsonl.gz", "rt", encoding="utf-8") as fh:
        replies = [r[side] for r in map(json.loads, fh) for side in ("chosen", "rejected")]
    curly = [t for t in replies if "I\u2019m sorry" in t.rpartition("Assistant:")[2]]
    assert len(curly) == 14
    for text in curly:
        reply = text.rpartition("Assistant:")[2]
        assert fn("", reply, {}) == pytest.approx(-0.01 * len(reply.split()) - 1.0)


def test_a_causal_lm_given_as_reward_model_is_named_as_such(tmp_path, toy_tokenizers):
    """The policy's own folder passed as --reward-model (an easy slip) is answered with what it is and what to do,
    not with "this one has 2 outputs" (transformers' default num_labels for a config that never set it)."""
    from conftest import tiny_llama

    from prefpack.rewards.reward_model import RewardModelScorer
    from prefpack.rewards.scorers import ScorerError

    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "policy", 0)
    with pytest.raises(ScorerError, match=r"is a LlamaForCausalLM, not a reward model .* train.objective=reward"):
        RewardModelScorer(str(model))
