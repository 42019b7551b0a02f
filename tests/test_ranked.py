"""Ranked stores (issue 13, item 4): one prompt with several scored completions, stored with the prompt once; at
train time each completion is computed once and the pairs it yields (best vs the rest, or every ordered pair)
reach the ordinary pair losses. Checked against the same pairs written out as a pair store: per-pair losses in
float64, a `train()` run step by step, and the reference sidecar."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import group_and_pair_losses, reference_table, write_jsonl

from prefpack.data.prepare import PrepareError, PrepareOptions, prepare
from prefpack.data.store import Store
from prefpack.data.views import RankedGroups, group_pairs

ROWS = [
    {"prompt": "\n\nHuman: What is two plus two?\n\nAssistant:",
     "completions": [{"text": " Four.", "score": 9}, {"text": " Five, I think.", "score": 2},
                     {"text": " It is four, because two and two make four.", "score": 8.5}]},
    {"prompt": "\n\nHuman: Name a colour.\n\nAssistant:",
     "completions": [{"text": " Blue.", "rank": 1}, {"text": " A dog.", "rank": 2}]},
    {"prompt": "\n\nHuman: Hi there, how are you today?\n\nAssistant:",
     "completions": [{"response": " Hello!", "score": 5}, {"response": " Hey.", "score": 5},
                     {"response": " Go away.", "score": 1}, {"response": " Hi! I am well, thank you.", "score": 7}]},
    {"prompt": "\n\nHuman: Say something.\n\nAssistant:",  # all tied: yields no pair
     "completions": [{"text": " Something.", "score": 3}, {"text": " Anything.", "score": 3}]},
]


def _prepare(tmp_path, tok, rows, name, **kw):
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / f"{name}.jsonl", rows))], tokenizer=str(tok),
                           output=str(tmp_path / name), workers=1, **kw), log=lambda m: None)
    return Store(tmp_path / name)


def _expanded_pairs(mode: str) -> list[dict]:
    """The pairs a ranked store yields, written out as pair rows (the independent layout to compare with)."""
    out = []
    for row in ROWS:
        texts = [c.get("text", c.get("response")) for c in row["completions"]]
        scores = np.array([c["score"] if "score" in c else -c["rank"] for c in row["completions"]], dtype=float)
        out += [{"prompt": row["prompt"], "chosen": texts[c], "rejected": texts[r]} for c, r in group_pairs(scores, mode)]
    return out


def test_group_pairs_best_vs_rest_and_all_pairs_skip_ties():
    s = np.array([5.0, 5.0, 1.0, 7.0])
    assert group_pairs(s, "best_vs_rest") == [(3, 0), (3, 1), (3, 2)]
    assert group_pairs(s, "all_pairs") == [(3, 0), (3, 1), (3, 2), (0, 2), (1, 2)]
    assert group_pairs(np.array([2.0, 9.0, 8.5]), "best_vs_rest") == [(1, 0), (1, 2)]
    assert group_pairs(np.array([3.0, 3.0]), "all_pairs") == group_pairs(np.array([3.0, 3.0]), "best_vs_rest") == []


def test_prepare_stores_each_prompt_once_with_scores(tmp_path, toy_tokenizers):
    from transformers import AutoTokenizer

    tok_dir = toy_tokenizers["neox"]
    store = _prepare(tmp_path, tok_dir, ROWS, "ranked")
    store.verify()
    assert store.kind == "ranked" and store.meta["layout"] == "ranked" and store.meta["num_groups"] == 4
    assert store.group_starts().tolist() == [0, 3, 5, 9, 11]
    assert store.scores().tolist() == [9, 2, 8.5, -1, -2, 5, 5, 1, 7, 3, 3]  # a rank r is stored as score -r
    tok = AutoTokenizer.from_pretrained(tok_dir)
    total = 0
    for g, row in enumerate(ROWS):
        prompt, comps = store.ranked_group(g)
        assert tok.decode(prompt) == row["prompt"]
        texts = [c.get("text", c.get("response")) for c in row["completions"]]
        assert [tok.decode(c) for c in comps] == [t + tok.eos_token for t in texts]
        total += len(prompt) + sum(len(c) for c in comps)
    assert store.num_tokens == total  # the prompt once per row, not once per completion
    view = RankedGroups(store, "all_pairs")
    assert len(view) == 3 and view.groups_without_pairs == 1 and view.num_pairs.tolist() == [3, 1, 5]


def test_prepare_names_bad_ranked_rows_or_counts_them(tmp_path, toy_tokenizers):
    good = ROWS[0]
    bad = [
        {"prompt": "p", "completions": [{"text": " only one", "score": 1}]},
        {"prompt": "p", "completions": [{"text": " same", "score": 1}, {"text": " same", "score": 2}]},
        {"prompt": "p", "completions": [{"text": " a", "score": 1}, {"text": " b"}]},
        {"prompt": "p", "completions": [{"text": " a", "score": 1}, {"text": " b", "score": "high"}]},
        {"prompt": "p", "completions": [{"words": " a", "score": 1}, {"text": " b", "score": 2}]},
    ]
    with pytest.raises(PrepareError, match=r"strict.jsonl line 2, field .completions.: .*at least two.*\[too_few_completions\]"):
        _prepare(tmp_path, toy_tokenizers["neox"], [good, *bad], "strict", layout="ranked")
    store = _prepare(tmp_path, toy_tokenizers["neox"], [good, *bad], "lenient", layout="ranked", skip_invalid=True)
    assert store.meta["counts"]["skipped"] == {"too_few_completions": 1, "identical_completions": 1,
                                               "missing_field": 2, "wrong_type": 1}
    skipped = [json.loads(x) for x in (tmp_path / "lenient" / "skipped.jsonl").read_text().splitlines()]
    assert [s["field"] for s in skipped] == ["completions", "completions[1]", "completions[1]",
                                             "completions[1].score", "completions[0]"]
    assert len(store) == 3 and store.meta["num_groups"] == 1


@pytest.mark.parametrize("ld", [False, True], ids=["wpo", "wpo+ld"])
@pytest.mark.parametrize("mode", ["best_vs_rest", "all_pairs"])
@pytest.mark.parametrize("layout", ["shared", "packed", "padded"])
def test_ranked_pair_losses_equal_the_same_pairs_from_a_pair_store(tmp_path, toy_tokenizers, mode, layout, ld):
    """Per-pair losses and their gradients, in float64: WPO weights, and LD-DPO's tails (which depend on the pair,
    so a completion in several pairs has one per pair), against the same pairs written out as a pair store."""
    from prefpack.config import load_config

    tok = toy_tokenizers["llama"]
    ranked = _prepare(tmp_path, tok, ROWS, "ranked")
    pairs = _prepare(tmp_path, tok, _expanded_pairs(mode), "pairs")

    def config(*extra):
        return load_config(None, [f"data.ranked_pairs={mode}", f"data.prefix_sharing={layout == 'shared'}",
                                  f"data.packing={layout != 'padded'}",
                                  "loss.terms=[{name: sigmoid}, {name: sft, weight: 0.3}]", "loss.use_weighting=true",
                                  *extra])

    ld_alpha = ["loss.ld_alpha=0.4"] if ld else []
    policy, r_task, r_out, p_out = group_and_pair_losses(tok, ranked, pairs, config(*ld_alpha), ld=ld)
    got = r_out.loss
    assert got.shape[0] == len(pairs) == r_task.units(np.arange(len(r_task)))
    torch.testing.assert_close(got, p_out.loss, rtol=0, atol=1e-10)
    for key in ("rewards/margins", "logps/chosen", "logps/rejected"):
        torch.testing.assert_close(r_out.metrics[key], p_out.metrics[key], rtol=0, atol=1e-9)
    # Gradients to float32 accuracy: transformers' LlamaRMSNorm casts its input to float32 even in a float64 model,
    # so backward is not exactly linear in its upstream gradient, and a completion in three pairs backpropagates
    # 3 * g once here but g three times from the pair store (measured: equal to 1e-15 when both are scaled alike).
    params = [p for p in policy.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(got.sum(), params), torch.autograd.grad(p_out.loss.sum(), params),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if ld:  # the tails matter: without them the same pairs give other losses
        other = group_and_pair_losses(tok, ranked, pairs, config(), ld=False)[2].loss
        assert (other - got).abs().max() > 1e-3


def test_training_on_a_ranked_store_equals_training_on_its_pairs(tmp_path, toy_tokenizers, one_thread):
    """Two full-batch steps: a step of all 3 prompts is a step of their 9 pairs (the loss is the mean over pairs),
    each completion and each prompt computed once; precomputed reference sums equal the copy's."""
    from conftest import tiny_llama

    from prefpack.config import load_config
    from prefpack.model import load_causal_lm
    from prefpack.training import train

    tok = toy_tokenizers["llama"]
    ranked = _prepare(tmp_path, tok, ROWS, "ranked")
    expanded = _expanded_pairs("all_pairs")
    pairs = _prepare(tmp_path, tok, expanded, "pairs")
    model = tiny_llama(tok, tmp_path / "model", seed=0)

    def run(store, batch, name):
        cfg = load_config(None, [f"model.name_or_path={model}", f"data.train={store.path}", "train.max_steps=2",
                                 f"train.global_batch_pairs={batch}", "train.device=cpu", "optim.lr=2e-3",
                                 "data.ranked_pairs=all_pairs", f"run.output_dir={tmp_path / name}", "run.plot=false",
                                 "run.tensorboard=false"])
        notes = []
        train(cfg, progress=False, log=notes.append)
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()], notes

    got, notes = run(ranked, 4, "ranked")
    want, _ = run(pairs, len(expanded), "pairs")
    assert any("1 of 4 prompts" in n and "no pair" in n for n in notes)
    # float32 sums in another order (a shared prompt's gradient is summed once), then one Adam step: 1e-5
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=1e-5)
    assert got[1]["loss"] != got[0]["loss"]
    lengths = pairs.index[:, 1:4].astype(int)
    assert got[0]["tokens"] < want[0]["tokens"] == int((2 * lengths[:, 0] + lengths[:, 1:].sum(1)).sum())
    starts = ranked.group_starts()[:4]
    useful = ranked.index[: starts[3]]  # the 3 prompts that give pairs
    assert got[0]["positions"] == int(useful[:, 2].sum() + ranked.column("prompt_len")[starts[:3]].sum())

    ref = load_causal_lm(str(model), device=torch.device("cpu"), attn_implementation="packed_sdpa")
    per_row = reference_table(ref, ranked, chunk_size=5).logps
    per_pair = reference_table(ref, pairs, chunk_size=5).logps
    assert np.isfinite(per_row[: starts[3]]).all() and np.isnan(per_row[starts[3]:]).all()  # ties: no pair reads
    view = RankedGroups(ranked, "all_pairs")
    chosen = [view.rows(i)[c] for i in range(len(view)) for c, _ in view.pairs[i]]
    rejected = [view.rows(i)[r] for i in range(len(view)) for _, r in view.pairs[i]]
    np.testing.assert_allclose(per_row[chosen], per_pair[0::2], rtol=0, atol=1e-4)
    np.testing.assert_allclose(per_row[rejected], per_pair[1::2], rtol=0, atol=1e-4)


def test_eval_loss_is_the_same_shared_unshared_and_ranked(tmp_path, toy_tokenizers, one_thread, capsys):
    """`evaluate()` (what `prefpack eval` and the run's eval report): the pairs of a pair store with prompts laid out
    once or not, and the same pairs drawn from a ranked store, give one loss to 1e-6."""
    from conftest import tiny_llama

    from prefpack.config import load_config
    from prefpack.training import build, evaluate

    tok = toy_tokenizers["llama"]
    ranked = _prepare(tmp_path, tok, ROWS, "ranked")
    pairs = _prepare(tmp_path, tok, _expanded_pairs("best_vs_rest"), "pairs")
    model, ref = tiny_llama(tok, tmp_path / "model", seed=0), tiny_llama(tok, tmp_path / "ref", seed=1)

    def loss(store, sharing):
        cfg = load_config(None, [f"model.name_or_path={model}", f"reference.model={ref}", f"data.train={store.path}",
                                 f"data.prefix_sharing={sharing}", "train.device=cpu", "train.micro_batch_tokens=64",
                                 f"run.output_dir={tmp_path / 'unused'}"])
        setup = build(cfg, log=lambda m: None)
        assert setup.train_task.shares_prompts == sharing
        return evaluate(setup.policy, setup.reference, setup.train_task)

    plain, shared, grouped = loss(pairs, False), loss(pairs, True), loss(ranked, True)
    assert plain["loss"] != pytest.approx(0.6931, abs=1e-3)  # the reference differs from the policy
    for other in (shared, grouped):
        assert other["loss"] == pytest.approx(plain["loss"], abs=1e-6)
        assert other["rewards/margins"] == pytest.approx(plain["rewards/margins"], abs=1e-5)
    # the command reports the pairs a ranked store's prompts yield (not its completions) and the prompts used
    from prefpack.cli import main as cli_main

    for mode, want in (("best_vs_rest", 6), ("all_pairs", 9)):
        capsys.readouterr()
        assert cli_main(["eval", "--model", str(model), "--ref", str(ref), "--data", str(ranked.path), "--json",
                         "--ranked-pairs", mode, "--micro-batch-tokens", "64"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["pairs"], out["prompts"]) == (want, 3)
        if mode == "best_vs_rest":
            assert out["loss"] == pytest.approx(plain["loss"], abs=1e-6)


def test_chat_ranked_rows_render_each_completion_after_the_prompt(tmp_path, toy_tokenizers):
    from transformers import AutoTokenizer

    tok_dir = toy_tokenizers["chatml"]
    prompt = [{"role": "user", "content": "Hi?"}]
    replies = [{"role": "assistant", "content": "Hello!"}, [{"role": "assistant", "content": "Go."}]]
    store = _prepare(tmp_path, tok_dir, [{"prompt": prompt, "completions": [
        {"text": replies[0], "score": 2}, {"content": replies[1], "score": 1}]}], "chat")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids, comps = store.ranked_group(0)
    for reply, comp in zip(([replies[0]], replies[1]), comps):
        full = tok.apply_chat_template(prompt + reply, tokenize=False)
        assert tok.decode(ids) + tok.decode(comp) == full
    with pytest.raises(PrepareError, match=r"completions\[0\]\.text.*must be a list of messages|message list"):
        _prepare(tmp_path, tok_dir, [{"prompt": prompt, "completions": [{"text": "plain", "score": 2},
                                                                        {"text": "x", "score": 1}]}], "bad")


def test_public_ranked_layouts_are_detected_and_read_alike(tmp_path, toy_tokenizers):
    """UltraFeedback's raw rows (instruction, completions[].response/overall_score), Nectar's (prompt,
    answers[].answer/rank) and plain lists with a parallel score list all give the store of the documented layout."""
    tok = toy_tokenizers["neox"]
    p, texts = "\n\nHuman: Hi?\n\nAssistant:", [" Hello!", " Go away.", " Hi, how can I help?"]
    expected = _prepare(tmp_path, tok, [{"prompt": p, "completions": [
        {"text": t, "score": s} for t, s in zip(texts, (7, 1, 9))]}], "documented")
    variants = {
        "ultrafeedback": {"source": "x", "instruction": p, "models": ["a", "b", "c"], "completions": [
            {"model": m, "response": t, "overall_score": s, "annotations": {"helpfulness": {"Rating": "N/A"}}}
            for m, t, s in zip("abc", texts, (7, 1, 9))]},
        "nectar": {"prompt": p, "answers": [{"answer": t, "model": "m", "rank": r} for t, r in zip(texts, (2, 3, 1))],
                   "num_responses": 3},
        "parallel_scores": {"prompt": p, "responses": texts, "scores": [7, 1, 9]},
        "parallel_ranks": {"prompt": p, "completions": texts, "ranks": [2, 3, 1]},
    }
    for name, row in variants.items():
        store = _prepare(tmp_path, tok, [row], name)
        assert store.kind == "ranked", name
        prompt, comps = store.ranked_group(0)
        want_prompt, want_comps = expected.ranked_group(0)
        assert prompt.tolist() == want_prompt.tolist() and [c.tolist() for c in comps] == [
            c.tolist() for c in want_comps], name
        # the same order of preference (ranks are stored as minus the rank)
        assert np.argsort(-store.scores()).tolist() == [2, 0, 1], name
    # a named field wins over detection, and a parallel list of the wrong length is named
    store = _prepare(tmp_path, tok, [{"question": p, "answers": [{"answer": t, "rank": r} for t, r in
                                                                  zip(texts, (1, 2, 3))]}],
                     "named", fields={"prompt": "question"})
    assert store.kind == "ranked" and len(store) == 3
    # SimPO's on-policy data (princeton-nlp/llama3-ultrafeedback-armorm): chosen/rejected plus all the samples
    simpo = {"prompt": p, "chosen": texts[2], "rejected": texts[1], "all_generated_responses": texts,
             "all_rm_scores": [0.7, 0.1, 0.9]}
    store = _prepare(tmp_path, tok, [simpo], "simpo", layout="ranked",
                     fields={"completions": "all_generated_responses", "scores": "all_rm_scores"})
    assert np.argsort(-store.scores()).tolist() == [2, 0, 1] and store.scores().tolist() == [0.7, 0.1, 0.9]
    with pytest.raises(PrepareError, match=r"field 'all_rm_scores' is null"):
        _prepare(tmp_path, tok, [{**simpo, "all_rm_scores": None}], "simpo_null", layout="ranked",
                 fields={"completions": "all_generated_responses", "scores": "all_rm_scores"})
    with pytest.raises(PrepareError, match=r"line 1, field 'scores': .*list of 3 numbers.*got 2"):
        _prepare(tmp_path, tok, [{"prompt": p, "completions": texts, "scores": [1, 2]}], "short")
    with pytest.raises(PrepareError, match=r"field 'scores\[1\]' must be a finite number"):
        _prepare(tmp_path, tok, [{"prompt": p, "completions": texts, "scores": [1, None, 2]}], "nan")
    with pytest.raises(PrepareError, match=r"field 'completions\[0\]' must be an object.*'scores'"):
        _prepare(tmp_path, tok, [{"prompt": p, "completions": texts}], "unscored", layout="ranked")


def test_unsupported_uses_of_a_ranked_store_are_user_errors(tmp_path, toy_tokenizers, capsys):
    """LD-DPO on a ranked store with a precomputed reference (its sidecar holds one sum per completion, not the
    tails of each pair), and a ranked store whose prompts all tie, stop `prefpack train` with a message naming the
    store (exit 2), not a traceback."""
    from conftest import tiny_llama

    from prefpack.cli import main as cli_main

    tok = toy_tokenizers["llama"]
    ranked = _prepare(tmp_path, tok, ROWS, "ranked")
    tied = _prepare(tmp_path, tok, ROWS[3:], "tied")
    model = tiny_llama(tok, tmp_path / "model", seed=0)
    base = [f"model.name_or_path={model}", "train.device=cpu", "train.max_steps=1", "run.eval_every=0"]
    for store, extra, message in ((ranked, ["loss.ld_alpha=0.5", "reference.mode=precomputed"],
                                   "holds ranked completions and loss.ld_alpha (LD-DPO) needs the reference's sums"),
                                  (tied, [], "no prompt yields a pair")):
        capsys.readouterr()
        code = cli_main(["train", *base, f"data.train={store.path}", f"run.output_dir={tmp_path / 'run'}", *extra])
        err = capsys.readouterr().err
        assert code == 2 and message in err and str(store.path) in err and "Traceback" not in err


def test_inspect_row_shows_its_prompt_group_ranked_with_the_pairs_training_draws(tmp_path, toy_tokenizers, capsys):
    """`prefpack inspect --row I` on a ranked store: row I's prompt once, every completion of its group best first
    (a tie in store order, as training breaks it) with its score, length and unscored text marked, and the pairs
    data.ranked_pairs draws (from --ranked-pairs, or a --config run's), as store rows."""
    from conftest import default_unscored, store_with_spans
    from transformers import AutoTokenizer

    from prefpack.cli import main as cli_main

    tok_dir = toy_tokenizers["neox"]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    path = store_with_spans(_prepare(tmp_path, tok_dir, ROWS, "ranked").path, tmp_path / "spans")
    group = ROWS[2]  # store rows 5..8, scores 5, 5, 1, 7; row 6 is " Hey." (5, tied with row 5)

    def shown(*flags) -> dict:
        capsys.readouterr()
        assert cli_main(["inspect", str(path), "--row", "6", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["row"]

    row = shown()
    assert (row["index"], row["group"], row["rows"], row["score"]) == (6, 2, [5, 9], 5.0)
    assert row["prompt"] == group["prompt"]
    order = [3, 0, 1, 2]  # by score: 7, then the tied 5s in store order, then 1
    assert [c["row"] for c in row["completions"]] == [5 + k for k in order]
    assert [c["score"] for c in row["completions"]] == [7.0, 5.0, 5.0, 1.0]
    for c, k in zip(row["completions"], order):
        text = group["completions"][k]["response"] + tok.eos_token
        assert c["text"] == text and tok.decode(c["ids"]) == text and c["tokens"] == len(c["ids"])
        unscored = {t for a, b in default_unscored(c["row"], 0, c["tokens"]) for t in range(a, b)}
        assert c["scored_tokens"] == c["tokens"] - len(unscored)
        if unscored:
            assert c["scored"] == [t not in unscored for t in range(c["tokens"])]
            assert c["marked"].replace("⟦", "").replace("⟧", "") == text
            for a, b in default_unscored(c["row"], 0, c["tokens"]):
                assert "⟦" + tok.decode(c["ids"][a:b]) + "⟧" in c["marked"]
        else:
            assert "scored" not in c and "marked" not in c
    assert row["pairs"] == {"mode": "best_vs_rest", "pairs": [{"chosen": 8, "rejected": r, "gap": g}
                                                              for r, g in ((5, 2.0), (6, 2.0), (7, 6.0))]}
    every = [(8, 5), (8, 6), (8, 7), (5, 7), (6, 7)]  # every (higher, lower) pair; the tie 5 / 6 gives none
    assert [(p["chosen"], p["rejected"]) for p in shown("--ranked-pairs", "all_pairs")["pairs"]["pairs"]] == every
    (tmp_path / "reward.yaml").write_text("train:\n  objective: reward\n")  # auto: all_pairs for a reward model
    assert shown("--config", str(tmp_path / "reward.yaml"))["pairs"]["mode"] == "all_pairs"

    capsys.readouterr()
    assert cli_main(["inspect", str(path), "--row", "6"]) == 0
    text = capsys.readouterr().out
    assert text.count("Hi there, how are you today?") == 1  # the prompt once
    assert f"row 6 (from {tmp_path / 'ranked.jsonl'} row 2): prompt group 2, store rows 5..8, its 4 completions" in text
    heads = [line.split(":")[0] for line in text.splitlines() if line.startswith("--- #")]
    assert heads == ["--- #1 row 8", "--- #2 row 5", "--- #3 row 6 (the row asked)", "--- #4 row 7"]
    assert "--- pairs data.ranked_pairs=best_vs_rest draws (3, chosen > rejected by store row): 8 > 5 (gap 2)" in text
    assert cli_main(["inspect", str(path), "--row", "10"]) == 0  # group 3: both scores 3
    assert "draws: none (all 2 scores tie; training leaves this prompt out)" in capsys.readouterr().out
