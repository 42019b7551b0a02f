"""Pair stores whose pairs repeat a prompt, read as prompt groups (``data.group_by_prompt``, issue 13): the pairs of
one prompt train as one group, the prompt and each distinct completion computed once. Checked against the same store
read pair by pair: per-pair losses and gradients in float64, `train()` step by step, eval, and a precomputed
reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import group_and_pair_losses, make_task, reference_table, tiny_llama, write_jsonl

from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.store import Store
from prefpack.data.views import PairGroups

MATH = "\n\nHuman: What is two plus two?\n\nAssistant:"
COLOUR = "\n\nHuman: Name a colour.\n\nAssistant:"
HELLO = "\n\nHuman: Hi there, how are you today?\n\nAssistant:"
FOUR, FIVE, LONG = " Four.", " Five, I think.", " It is four, because two and two make four."
HI, AWAY, WELL = " Hello!", " Go away.", " Hi! I am well, thank you."
# three prompts, their pairs interleaved; completions repeat across a prompt's pairs, and one pair twice
ROWS = [(MATH, FOUR, FIVE), (COLOUR, " Blue.", " A dog."), (HELLO, WELL, HI), (MATH, LONG, FIVE), (HELLO, WELL, AWAY),
        (MATH, FOUR, LONG), (HELLO, HI, AWAY), (COLOUR, " Blue.", " A dog.")]


def _store(tmp_path, tok) -> Store:
    rows = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in ROWS]
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "pairs.jsonl", rows))], tokenizer=str(tok),
                           output=str(tmp_path / "pairs"), workers=1), log=lambda m: None)
    return Store(tmp_path / "pairs")


def test_a_pair_store_reads_as_one_group_per_prompt_with_each_completion_once(tmp_path, toy_tokenizers):
    from transformers import AutoTokenizer

    tok_dir = toy_tokenizers["llama"]
    store = _store(tmp_path, tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    view = PairGroups(store)
    assert [list(r) for r in view.pair_rows] == [[0, 3, 5], [1, 7], [2, 4, 6]]  # prompts by first appearance
    assert view.sizes.tolist() == [3, 2, 3] and view.num_pairs.tolist() == [3, 2, 3]
    assert view.pairs == [[(0, 1), (2, 1), (0, 2)], [(0, 1), (0, 1)], [(0, 1), (0, 2), (1, 2)]]
    texts = []
    for i in range(len(view)):
        prompt, comps = view[i]
        texts.append([tok.decode(c).removesuffix(tok.eos_token) for c in comps])
        # every pair of the store, once, as (prompt, chosen, rejected) tokens
        for (c, r), row in zip(view.pairs[i], view.pair_rows[i], strict=True):
            p = store.pair(row)
            assert np.array_equal(prompt, p.prompt) and np.array_equal(comps[c], p.chosen)
            assert np.array_equal(comps[r], p.rejected)
        # a completion's key names where its tokens are in the store (what a precomputed reference reads)
        for comp, key in zip(comps, view.rows(i), strict=True):
            p = store.pair(int(key) // 2)
            assert np.array_equal(comp, p.rejected if key % 2 else p.chosen)
    assert texts == [[FOUR, FIVE, LONG], [" Blue.", " A dog."], [WELL, HI, AWAY]]
    lengths = store.index[:, 1:4].astype(int)
    cost, _ = view.costs(np.arange(3), shared=True)
    assert cost.tolist() == [int(lengths[r[0], 0] + view.completion_len[i].sum()) for i, r in enumerate(view.pair_rows)]


def test_a_group_is_never_longer_than_the_longest_pair(tmp_path, toy_tokenizers):
    """A group takes at most the positions of the store's longest pair read alone: a long prompt's pairs of short
    replies make one group, a short prompt's pairs of long replies one group each (memory never exceeds what the
    pairs need one by one, and no budget decides it)."""
    long_prompt = "\n\nHuman: " + "Tell me about the weather in the mountains in spring. " * 6 + "\n\nAssistant:"
    long_reply = " The mountains in spring are cold at night and warm by day, with rain in the afternoon."
    data = {"short_replies": [{"prompt": long_prompt, "chosen": f" Yes {k}.", "rejected": f" No {k}."} for k in range(3)],
            "long_replies": [{"prompt": "\n\nHuman: Hi\n\nAssistant:", "chosen": f"{long_reply} ({k})",
                              "rejected": f"{long_reply} [{k}]"} for k in range(3)]}
    for name, rows in data.items():
        prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / f"{name}.jsonl", rows))],
                               tokenizer=str(toy_tokenizers["llama"]), output=str(tmp_path / name), workers=1),
                log=lambda m: None)
        store = Store(tmp_path / name)
        view = PairGroups(store)
        want = [[0, 1, 2]] if name == "short_replies" else [[0], [1], [2]]
        assert [list(r) for r in view.pair_rows] == want, name
        lengths = store.index[:, 1:4].astype(int)
        longest = int((2 * lengths[:, 0] + lengths[:, 1:].sum(1)).max())
        assert int(view.costs(np.arange(len(view)), shared=True)[0].max()) <= longest


ANSWERS = [f" Answer {j}: the {w} one." for j, w in enumerate(["red", "blue", "green", "old", "new", "big", "small",
                                                               "last"])]
ROUND_PROMPTS = ["\n\nHuman: Which one?\n\nAssistant:", "\n\nHuman: Pick a colour.\n\nAssistant:"]


def _round_like_rows() -> list[dict]:
    """An on-policy round's pairs: each prompt's k = 8 samples, all_pairs (every higher-scored sample against each
    lower one: 28 pairs a prompt), prompts in turn."""
    return [{"prompt": p, "chosen": ANSWERS[i], "rejected": ANSWERS[j]}
            for p in ROUND_PROMPTS for i in range(8) for j in range(i + 1, 8)]


def _one_group_per_prompt(store: Store) -> tuple[PairGroups, int]:
    """The store's groups checked to be one per prompt, each its prompt and 8 distinct samples once (positions
    from the store's index), longer than the store's longest pair; returns the view and that longest pair."""
    view = PairGroups(store)
    index = store.index[:, 1:4].astype(int)
    assert [list(r) for r in view.pair_rows] == [list(range(28)), list(range(28, 56))]
    assert view.sizes.tolist() == [8, 8] and view.num_pairs.tolist() == [28, 28]
    # a prompt's first 7 pairs are (sample 0, sample j) for j = 1..7: sample 0 once, then each rejected one
    want = [int(index[f, 0] + index[f, 1] + index[f:f + 7, 2].sum()) for f in (0, 28)]
    cost = view.costs(np.arange(2), shared=True)[0]
    assert cost.tolist() == want
    longest_pair = int((2 * index[:, 0] + index[:, 1] + index[:, 2]).max())
    assert int(cost.min()) > longest_pair  # the old cap (the longest pair) split every prompt
    return view, longest_pair


def test_a_rounds_like_store_with_a_length_limit_makes_one_group_per_prompt(tmp_path, toy_tokenizers):
    """k = 8 samples of a short prompt, all_pairs, prepared with --max-length 96: what the data settings allow is a
    pair of two 96-token sequences, so each prompt's 28 pairs are ONE group (8 samples computed once), though longer
    than the store's longest pair; without --max-length (an older store) the cap stays the longest pair."""
    rows = write_jsonl(tmp_path / "round.jsonl", _round_like_rows())
    for name, limit in (("limited", 96), ("unlimited", None)):
        prepare(PrepareOptions(inputs=[str(rows)], tokenizer=str(toy_tokenizers["llama"]),
                               output=str(tmp_path / name), workers=1, max_length=limit), log=lambda m: None)
    view, longest_pair = _one_group_per_prompt(Store(tmp_path / "limited"))
    assert (view.cap, view.cap_source) == (192, "2 x prepare's --max-length 96")
    old = PairGroups(Store(tmp_path / "unlimited"))
    assert old.cap == longest_pair and old.cap_source == "the store's longest pair"
    assert len(old) > 2 and int(old.costs(np.arange(len(old)), shared=True)[0].max()) <= longest_pair
    assert sorted(r for rows in old.pair_rows for r in rows) == list(range(56))  # every pair once


def test_a_scored_samples_store_groups_a_prompts_samples_as_one_and_trains_them_as_pairs(tmp_path, toy_tokenizers,
                                                                                          one_thread):
    """A round's store as `prefpack score --pairs all_pairs` writes it from a samples file (n = 8, max_new_tokens =
    12): a prompt with its 8 samples is what its settings allow, so one group per prompt; its per-pair losses equal
    the same pairs read one by one (float64)."""
    from transformers import AutoTokenizer

    from prefpack.cli import main
    from prefpack.config import load_config
    from prefpack.tokenizer import HASH_VERSION, tokenizer_hash

    tok_dir = toy_tokenizers["llama"]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    samples = [{"prompt_ids": tok(p)["input_ids"], "prompt": p, "row": r, "truncated": [False] * 8,
                "completion_ids": [tok(a, add_special_tokens=False)["input_ids"][:12] for a in ANSWERS],
                "completions": ANSWERS} for r, p in enumerate(ROUND_PROMPTS)]
    path = write_jsonl(tmp_path / "samples.jsonl", samples)
    (tmp_path / "samples.meta.json").write_text(json.dumps(
        {"tokenizer": {"name": str(tok_dir), "hash": tokenizer_hash(tok), "hash_version": HASH_VERSION},
         "generation": {"engine": "transformers", "settings": {"n": 8, "max_new_tokens": 12}}, "complete": True}))
    (tmp_path / "fn.py").write_text("def reward(prompt, completion, row):\n    return -float(completion[8])\n")
    assert main(["score", str(path), "-o", str(tmp_path / "store"), "--reward-fn", f"{tmp_path / 'fn.py'}:reward",
                 "--pairs", "all_pairs", "--no-progress"]) == 0
    store = Store(tmp_path / "store")
    view, _ = _one_group_per_prompt(store)
    prompt = int(store.column("prompt_len").max())
    assert view.cap == prompt + 8 * 12 and view.cap_source == f"the longest prompt ({prompt}) + 8 samples x " \
                                                               "max_new_tokens 12"
    cfg = load_config(None, ["data.prefix_sharing=true", "loss.terms=[{name: sigmoid}]"])
    _, g_task, g_out, p_out = group_and_pair_losses(tok_dir, store, store, cfg, ld=False, rows=[[0], [1]])
    order = torch.as_tensor([r for rows in g_task.view.pair_rows for r in rows])
    torch.testing.assert_close(g_out.loss, p_out.loss[order], rtol=0, atol=1e-10)


class _Meta:
    """What ``group_cap`` reads of a store: its meta.json, its prompt lengths and its size."""

    def __init__(self, meta: dict, prompts=(30,)):
        self.meta, self._prompts = meta, np.asarray(prompts)

    def column(self, name):
        assert name == "prompt_len"
        return self._prompts

    def __len__(self):
        return len(self._prompts)


def test_the_group_cap_is_what_the_data_settings_allow_up_to_a_row_of_every_auto_budget():
    """min(what the store records, GROUP_POSITIONS), never below the store's longest pair; a missing, malformed or
    boolean limit keeps the longest pair; GROUP_POSITIONS fits one row of every auto budget."""
    from prefpack.data.views import GROUP_POSITIONS, group_cap
    from prefpack.engine.budgets import CPU_BUDGETS, MIN_MICRO_BATCH_TOKENS

    assert GROUP_POSITIONS <= min(CPU_BUDGETS.row_tokens, MIN_MICRO_BATCH_TOKENS)
    samples = {"samples": {"generation": {"settings": {"n": 8, "max_new_tokens": 16}}}}
    cases = [({"args": {"max_length": 300}}, 100, 600), ({"args": {"max_length": 5000}}, 100, GROUP_POSITIONS),
             ({"args": {"max_length": 5000}}, 3000, 3000), ({"args": {"max_length": 40}}, 100, 100),
             (samples, 100, 30 + 8 * 16), ({"args": {"max_length": None}}, 100, 100), ({}, 100, 100),
             ({"args": {"max_length": True}}, 100, 100), ({"args": {"max_length": "300"}}, 100, 100)]
    for meta, longest_pair, want in cases:
        assert group_cap(_Meta(meta), longest_pair)[0] == want, meta


def test_a_group_over_the_micro_batch_budget_trains_alone_and_is_reported(tmp_path, toy_tokenizers):
    """A budget below the groups (a memory setting; grouping does not read it): each group gets a micro-batch of
    its own, none is dropped, and the run's note says how many pass the row budget."""
    from prefpack.config import load_config
    from prefpack.objectives.groups import PromptGroupTask

    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "round.jsonl", _round_like_rows()))],
                           tokenizer=str(toy_tokenizers["llama"]), output=str(tmp_path / "s"), workers=1,
                           max_length=96), log=lambda m: None)
    store = Store(tmp_path / "s")
    budget = int(PairGroups(store).costs(np.arange(2), shared=True)[0].min()) - 1
    cfg = load_config(None, ["data.prefix_sharing=true", f"train.micro_batch_tokens={budget}",
                             f"data.max_tokens_per_row={budget}"])
    task = make_task(PromptGroupTask, store, cfg)
    assert len(task) == 2  # the same groups as with any budget
    planned = task.plan(np.arange(2), seed=0)
    assert sorted(p.rows for p in planned) == [[[0]], [[1]]]
    assert f"2 groups pass the {budget}-token row budget and each trains in a row of its own" in task.run_note()


@pytest.mark.parametrize("attn", ["packed_sdpa", "sdpa"])
def test_precompute_ref_scores_each_prompt_and_completion_once_with_the_same_values(tmp_path, toy_tokenizers, attn):
    """precompute-ref on a pair store that repeats prompts scores its prompt groups (each distinct completion once,
    the prompt once where the kernel reads prompt groups): the same sums and LD-DPO tails per pair as scoring each
    pair alone, to float32 accuracy."""
    from prefpack.model import load_causal_lm

    tok = toy_tokenizers["llama"]
    store = _store(tmp_path, tok)
    model = load_causal_lm(str(tiny_llama(tok, tmp_path / "m", seed=3)), device=torch.device("cpu"),
                           attn_implementation=attn)
    grouped = reference_table(model, store, chunk_size=5)  # the store repeats prompts: its prompt groups
    alone = reference_table(model, store, chunk_size=5, group_by_prompt=False)
    assert np.isfinite(grouped.logps).all() and np.isfinite(grouped.tails).all()  # every key, repeats filled in
    np.testing.assert_allclose(grouped.logps, alone.logps, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(grouped.tails, alone.tails, rtol=1e-6, atol=1e-4)
    assert np.abs(alone.tails[0::2]).sum() > 0 and np.abs(alone.tails[1::2]).sum() > 0


@pytest.mark.parametrize("ld", [False, True], ids=["wpo", "wpo+ld"])
@pytest.mark.parametrize("layout", ["shared", "packed", "padded"])
def test_grouped_pair_losses_equal_the_pairs_read_one_by_one(tmp_path, toy_tokenizers, layout, ld):
    """Per-pair losses (sigmoid + sft, WPO weights, LD-DPO's per-pair tails) and their gradients in float64."""
    from prefpack.config import load_config

    tok = toy_tokenizers["llama"]
    store = _store(tmp_path, tok)
    cfg = load_config(None, [f"data.prefix_sharing={layout == 'shared'}", f"data.packing={layout != 'padded'}",
                             "loss.terms=[{name: sigmoid}, {name: sft, weight: 0.3}]", "loss.use_weighting=true",
                             *(["loss.ld_alpha=0.4"] if ld else [])])
    policy, g_task, g_out, p_out = group_and_pair_losses(tok, store, store, cfg, ld=ld)
    order = torch.as_tensor([r for rows in g_task.view.pair_rows for r in rows])  # the store pair of each loss
    assert g_out.loss.shape[0] == len(store) == g_task.units(np.arange(len(g_task)))
    torch.testing.assert_close(g_out.loss, p_out.loss[order], rtol=0, atol=1e-10)
    for key in ("rewards/margins", "logps/chosen", "logps/rejected"):
        torch.testing.assert_close(g_out.metrics[key], p_out.metrics[key][order], rtol=0, atol=1e-9)
    # float32 accuracy, as for ranked stores: LlamaRMSNorm computes in float32 even in a float64 model, and a
    # completion in two pairs backpropagates 2g once here but g twice pair by pair
    params = [p for p in policy.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(g_out.loss.sum(), params), torch.autograd.grad(p_out.loss.sum(), params),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_training_and_eval_with_grouped_prompts_equal_pair_by_pair(tmp_path, toy_tokenizers, one_thread):
    """A full-batch step of the 3 prompts is a step of the store's 8 pairs (the loss is the mean over pairs), with
    fewer positions; eval and a precomputed reference agree (LD-DPO's tails included); KTO refuses grouping."""
    from prefpack.cli import main as cli_main
    from prefpack.config import ConfigError, load_config
    from prefpack.training import build, evaluate, train

    tok = toy_tokenizers["llama"]
    store = _store(tmp_path, tok)
    model, ref = tiny_llama(tok, tmp_path / "model", seed=0), tiny_llama(tok, tmp_path / "ref", seed=1)

    def config(name, *extra):
        return load_config(None, [f"model.name_or_path={model}", f"reference.model={ref}", f"data.train={store.path}",
                                  "train.max_steps=2", "train.device=cpu", "optim.lr=2e-3",
                                  f"run.output_dir={tmp_path / name}", "run.plot=false", "run.tensorboard=false",
                                  *extra])

    notes = []

    def run(name, *extra):
        train(config(name, *extra), progress=False, log=notes.append)
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    grouped = run("grouped", "data.group_by_prompt=true", "train.global_batch_pairs=3")
    assert any("8 pairs" in n and "3 prompt groups with 8 distinct completions (of 16)" in n
               and "2.67 pairs each on average (a step of 3 holds about 8 pairs)" in n for n in notes)
    plain = run("plain", "train.global_batch_pairs=8")
    # float32 sums in another order (a shared completion's gradient is summed once), then one Adam step: 1e-5
    assert [r["loss"] for r in grouped] == pytest.approx([r["loss"] for r in plain], abs=1e-5)
    assert grouped[1]["loss"] != grouped[0]["loss"]
    assert grouped[0]["tokens"] == plain[0]["tokens"]  # real tokens counted as before: every pair's
    view = PairGroups(store)
    assert grouped[0]["positions"] == int(view.costs(np.arange(3), shared=True)[0].sum()) < plain[0]["positions"]

    # eval: the same loss grouped or not; a precomputed reference (the pair sidecar) equals the copy
    assert cli_main(["precompute-ref", "--model", str(ref), "--data", str(store.path)]) == 0
    results = {}
    runs = {"copy": [], "pre": ["reference.mode=precomputed"], "plain": ["data.group_by_prompt=false"]}
    for name, extra in runs.items():
        cfg = config(f"eval-{name}", "data.group_by_prompt=true", *extra)
        setup = build(cfg, log=lambda m: None)
        assert type(setup.train_task).__name__ == ("PairTask" if name == "plain" else "PromptGroupTask")
        results[name] = evaluate(setup.policy, setup.reference, setup.train_task)
    for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        tol = {"rel": 1e-6} if key.startswith("logps") else {"abs": 1e-6}  # logps: float32 sums near -60
        assert results["copy"][key] == pytest.approx(results["plain"][key], **tol), key
        assert results["pre"][key] == pytest.approx(results["copy"][key], **tol), key

    # LD-DPO's per-pair tails: read from the pair sidecar for the drawn pairs, equal to the copy's
    ld = {}
    for name, extra in {"copy": [], "pre": ["reference.mode=precomputed"]}.items():
        setup = build(config(f"ld-{name}", "data.group_by_prompt=true", "loss.ld_alpha=0.5", *extra), log=lambda m: None)
        ld[name] = evaluate(setup.policy, setup.reference, setup.train_task)
    assert ld["pre"]["loss"] == pytest.approx(ld["copy"]["loss"], abs=1e-6)
    assert ld["pre"]["rewards/margins"] == pytest.approx(ld["copy"]["rewards/margins"], abs=1e-6)
    assert abs(ld["copy"]["loss"] - results["copy"]["loss"]) > 1e-4  # the tails change the loss
    with pytest.raises(ConfigError, match="group_by_prompt"):
        config("kto", "data.group_by_prompt=true", "data.paired_as_kto=true", "loss.terms=[{name: kto}]").validate()
