"""Training and scoring honour a store's unscored spans (issue 23): a position whose target is an unscored
completion token gets no target in every layout (packed, padded, prompt-shared), prompt groups, KTO's main and KL
branches, and precompute-ref; everything that counts completion tokens counts scored ones. Checked in float64 against
sums written out here over the scored tokens of one plain forward per sequence (``conftest.scored_logps_f64``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import (
    float64_llama,
    group_and_pair_losses,
    make_task,
    prepare_hh_splits,
    reference_table,
    scored_logps_f64,
    store_with_spans,
    write_jsonl,
)

from prefpack.batching.collate import IGNORE_INDEX, collate_groups, collate_packed, collate_padded
from prefpack.config import load_config
from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.spans import ScoredTokens, scored_of
from prefpack.data.store import Store
from prefpack.data.views import PairGroups, StorePairs
from prefpack.model import SequenceLogps, sequence_logps
from prefpack.objectives.base import Planned


@pytest.fixture(scope="module")
def stores(tmp_path_factory, toy_tokenizers, hh_train):
    """A 6-pair hh store and its copy with spans (``conftest.default_unscored``: a completion's first token, or a
    few inside)."""
    root = tmp_path_factory.mktemp("spans_training")
    plain = prepare_hh_splits(root, toy_tokenizers["llama"], hh_train, {"train": 6})["train"]
    return {"plain": plain, "spans": store_with_spans(plain, root / "spans"), "tok": toy_tokenizers["llama"]}


def _f64(model, prompt, completion):
    """Per scored token of one sequence alone, in float64: log p(token) and log sum_v p_v^2 (WPO)."""
    ids = torch.tensor([[int(t) for t in prompt] + [int(t) for t in completion]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.double()[0, :-1], -1)
    rows = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    lp = logp[rows, ids[0, len(prompt):]].numpy()
    lss = torch.logsumexp(2 * logp[rows], -1).numpy()
    scored = scored_of(completion)
    return (lp, lss) if scored is None else (lp[scored], lss[scored])


def _pair_defs(model, store, i):
    """Pair i's chosen / rejected definitions: sum, scored count, tail past the shorter scored count, WPO mean."""
    pair = store.pair(i)
    (lc, sc), (lr, sr) = _f64(model, pair.prompt, pair.chosen), _f64(model, pair.prompt, pair.rejected)
    cut = min(len(lc), len(lr))
    return [(x.sum(), len(x), x[cut:].sum(), (x - s).mean()) for x, s in ((lc, sc), (lr, sr))]


def _outputs(model, batch):
    model.zero_grad(set_to_none=True)
    out = sequence_logps(model, batch, chunk_size=5, pair_tails=True, wpo=True)
    weights = torch.linspace(0.5, 1.5, out.logp_sum.numel(), dtype=out.logp_sum.dtype)
    ((out.logp_sum + 0.3 * out.tail_sum) * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("layout", ["packed", "padded", "shared"])
def test_sums_counts_tails_and_wpo_means_follow_the_scored_tokens(stores, layout):
    """Per-sequence sums, token counts, LD-DPO tails (the scored tokens of the longer completion past the shorter's
    number of scored tokens) and WPO means equal their float64 definitions over the scored tokens, and the
    gradients are the same in every layout."""
    store = Store(stores["spans"])
    pairs = StorePairs(store)
    assert sum(scored_of(c) is not None for i in range(len(store)) for c in store.pair(i)[1:]) >= 10
    model = float64_llama(stores["tok"], 0)
    rows = [[0, 1, 2], [3, 4, 5]]
    batch = {"packed": lambda: collate_packed(pairs, rows), "padded": lambda: collate_padded(pairs, rows),
             "shared": lambda: collate_packed(pairs, rows, share_prompts=True)}[layout]()
    out, grads = _outputs(model, batch)
    for i in range(len(store)):
        for side, (total, n, tail, mean) in enumerate(_pair_defs(model, store, i)):
            s = 2 * i + side
            assert int(out.n_tokens[s]) == n
            assert float(out.logp_sum[s].detach()) == pytest.approx(total, abs=1e-9)
            assert float(out.tail_sum[s].detach()) == pytest.approx(tail, abs=1e-9)
            assert float(out.wpo_mean[s]) == pytest.approx(mean, abs=1e-9)
    _, want = _outputs(model, collate_padded(pairs, rows))
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-6, atol=2e-6, msg=name)


def test_unscored_positions_get_no_target_in_any_layout(stores):
    """The batch itself: a position predicting an unscored token has no target, is not a score position, and TRL's
    completion mask is 1 only on scored completion tokens."""
    store = Store(stores["spans"])
    prompt, chosen, _ = store.pair(0)
    scored = scored_of(chosen)
    assert scored is not None and not scored[0]  # row 0's chosen: its first token unscored
    n_p = len(prompt)
    for share in (False, True):
        batch = collate_groups([(prompt, (chosen,))], [[0]], ids=[0], share_prompts=share)
        predicting = n_p - 1 + np.arange(len(chosen))
        targets = batch.target_ids[0, predicting].numpy()
        assert (targets[~scored] == IGNORE_INDEX).all() and (targets[scored] == np.asarray(chosen)[scored]).all()
        assert int(batch.completion_tokens[0]) == int(scored.sum())
        if share:
            assert set(batch.score_positions.tolist()) == set(predicting[scored].tolist())
    batch, cmask = collate_groups([(prompt, (chosen,))], None, ids=[0], completion_mask=True)
    assert cmask[0, n_p:n_p + len(chosen)].numpy().astype(bool).tolist() == scored.tolist()
    assert int(cmask.sum()) == int(batch.loss_mask.sum())


def test_an_unscored_last_token_changes_nothing_and_another_mask_changes_the_sums(stores):
    """The target ids of an unscored last token (nothing after it reads it) change no sum and no gradient; moving
    the mask changes the sums."""
    store = Store(stores["plain"])
    model = float64_llama(stores["tok"], 0)
    pairs = [store.pair(i) for i in range(3)]

    def batch(last_token, mask_at):
        groups = []
        for prompt, chosen, rejected in pairs:
            c = np.asarray(chosen).copy()
            c[-1] = last_token
            scored = np.ones(len(c), dtype=bool)
            scored[mask_at] = False
            groups.append((prompt, (ScoredTokens(c, scored), rejected)))
        return collate_groups(groups, [[0, 1, 2]], ids=[0, 1, 2], share_prompts=True)

    a, ga = _outputs(model, batch(5, -1))
    b, gb = _outputs(model, batch(77, -1))
    torch.testing.assert_close(a.logp_sum, b.logp_sum, rtol=0, atol=0)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=0, atol=0)
    c, _ = _outputs(model, batch(5, 1))
    assert not torch.allclose(a.logp_sum[0::2], c.logp_sum[0::2])
    torch.testing.assert_close(a.logp_sum[1::2], c.logp_sum[1::2], rtol=0, atol=0)  # rejected: unmasked, unchanged


@pytest.mark.parametrize("ld", [None, 0.3])
def test_length_normalised_losses_ld_dpo_and_wpo_equal_their_definitions_on_scored_tokens(stores, ld):
    """sigmoid, ipo (per-token log-ratios) and simpo (per-token policy) with WPO weights, and LD-DPO's length
    desensitised sums, on rows with gaps: every count and tail is over scored tokens."""
    from prefpack.objectives.pairs import PairTask
    from prefpack.reference import CopyReference

    beta, gamma = 0.2, 0.5
    store = Store(stores["spans"])
    cfg = load_config(None, ["loss.terms=[{name: sigmoid}, {name: ipo}, {name: simpo}]", f"loss.beta={beta}",
                             f"loss.simpo_gamma={gamma}", "loss.use_weighting=true",
                             *([f"loss.ld_alpha={ld}"] if ld is not None else [])])
    policy, ref_model = float64_llama(stores["tok"], 0), float64_llama(stores["tok"], 1)
    reference = CopyReference(ref_model)
    reference.configure(chunk_size=7, pair_tails=ld is not None)
    task = make_task(PairTask, store, cfg)
    module = SequenceLogps(policy, chunk_size=7, wpo=True, pair_tails=ld is not None)
    out = task.loss(module, reference, task.collate(Planned([[0, 1, 2], [3, 4, 5]], 0, 0)), None)
    alpha = 1.0 if ld is None else ld
    for i in range(len(store)):
        (pc, nc, tc, mc), (pr, nr, tr, mr) = _pair_defs(policy, store, i)
        (rc, _, trc, _), (rr, _, trr, _) = _pair_defs(ref_model, store, i)
        pc, pr, rc, rr = (x - (1 - alpha) * t for x, t in ((pc, tc), (pr, tr), (rc, trc), (rr, trr)))
        w = math.exp(mc + mr)
        sigmoid = -math.log(1 / (1 + math.exp(-beta * ((pc - rc) - (pr - rr)))))
        ipo = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2
        simpo = -math.log(1 / (1 + math.exp(-(beta * (pc / nc - pr / nr) - gamma))))
        assert float(out.metrics["loss/ipo"][i]) == pytest.approx(w * ipo, rel=1e-9, abs=1e-10)
        assert float(out.metrics["loss/simpo"][i]) == pytest.approx(w * simpo, rel=1e-9, abs=1e-10)
        assert float(out.loss[i].detach()) == pytest.approx(w * (sigmoid + ipo + simpo), rel=1e-9, abs=1e-10)


# ---------------------------------------------------------------- prompt groups


MATH = "\n\nHuman: What is two plus two?\n\nAssistant:"
HELLO = "\n\nHuman: Hi there, how are you today?\n\nAssistant:"
FOUR, FIVE, LONG = " Four.", " Five, I think.", " It is four, because two and two make four."
HI, AWAY, WELL = " Hello!", " Go away.", " Hi! I am well, thank you."
# FOUR is chosen in rows 0 and 5 (masks differ by row parity), WELL in rows 2 and 4 (the same mask)
ROWS = [(MATH, FOUR, FIVE), (HELLO, AWAY, HI), (HELLO, WELL, HI), (MATH, LONG, FIVE), (HELLO, WELL, AWAY),
        (MATH, FOUR, LONG)]


@pytest.fixture(scope="module")
def grouped(tmp_path_factory, toy_tokenizers):
    root = tmp_path_factory.mktemp("spans_groups")
    tok = toy_tokenizers["llama"]
    rows = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in ROWS]
    prepare(PrepareOptions(inputs=[str(write_jsonl(root / "pairs.jsonl", rows))], tokenizer=str(tok),
                           output=str(root / "pairs"), workers=1), log=lambda m: None)
    return {"tok": tok, "plain": root / "pairs", "spans": store_with_spans(root / "pairs", root / "spans")}


def test_pair_groups_merge_completions_only_with_the_same_mask(grouped):
    plain, spans = PairGroups(Store(grouped["plain"])), PairGroups(Store(grouped["spans"]))
    store = Store(grouped["spans"])

    def side(key):
        pair = store.pair(int(key) // 2)
        return pair.rejected if key % 2 else pair.chosen

    assert spans.copies[10] == 10 != plain.copies[10] == 0  # FOUR in row 5: another mask than row 0's, not merged
    assert spans.copies[8] == plain.copies[8] == 4  # WELL in row 4: the same mask as row 2's, merged
    for key, copy in enumerate(spans.copies):
        a, b = side(key), side(copy)
        assert np.array_equal(a, b)
        ma, mb = scored_of(a), scored_of(b)
        assert (ma is None and mb is None) or np.array_equal(ma, mb)
    for i in range(len(spans)):  # a group's completions carry their masks
        _, comps = spans[i]
        for comp, key in zip(comps, spans.rows(i), strict=True):
            want = scored_of(side(key))
            assert (want is None and scored_of(comp) is None) or np.array_equal(scored_of(comp), want)


@pytest.mark.parametrize("layout", ["shared", "packed", "padded"])
def test_grouped_pair_losses_with_spans_equal_the_pairs_read_one_by_one(grouped, layout):
    tok, store = grouped["tok"], Store(grouped["spans"])
    cfg = load_config(None, [f"data.prefix_sharing={layout == 'shared'}", f"data.packing={layout != 'padded'}",
                             "loss.terms=[{name: sigmoid}, {name: ipo, weight: 0.5}]", "loss.use_weighting=true",
                             "loss.ld_alpha=0.4"])
    rows = [[k] for k in range(len(PairGroups(store)))]
    assert len(rows) < len(store)  # some prompt's pairs share a group
    policy, g_task, g_out, p_out = group_and_pair_losses(tok, store, store, cfg, ld=True, rows=rows)
    order = torch.as_tensor([r for rows in g_task.view.pair_rows for r in rows])
    torch.testing.assert_close(g_out.loss, p_out.loss[order], rtol=0, atol=1e-10)
    plain = Store(grouped["plain"])
    _, _, _, plain_out = group_and_pair_losses(tok, plain, plain, cfg, ld=True,
                                               rows=[[k] for k in range(len(PairGroups(plain)))])
    assert not torch.allclose(plain_out.loss, p_out.loss)  # the spans change the losses
    params = [p for p in policy.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(g_out.loss.sum(), params), torch.autograd.grad(p_out.loss.sum(), params),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_precompute_ref_on_grouped_prompts_with_spans_equals_pair_by_pair(grouped):
    """precompute-ref over a pair store's prompt groups fills each repeated completion's key from the one computed:
    with spans, only from a completion with the same mask (sums and LD-DPO tails as pair by pair)."""
    store = Store(grouped["spans"])
    model = float64_llama(grouped["tok"], 3)
    together = reference_table(model, store, chunk_size=5, group_by_prompt=True)
    alone = reference_table(model, store, chunk_size=5, group_by_prompt=False)
    np.testing.assert_allclose(together.logps, alone.logps, rtol=0, atol=1e-9)
    np.testing.assert_allclose(together.tails, alone.tails, rtol=0, atol=1e-9)
    for i in range(len(store)):
        for side, (total, _, tail, _) in enumerate(_pair_defs(model, store, i)):
            assert float(alone.logps[2 * i + side]) == pytest.approx(total, abs=1e-9)
            assert float(alone.tails[2 * i + side]) == pytest.approx(tail, abs=1e-9)


# ---------------------------------------------------------------- KTO, precompute-ref


@pytest.mark.parametrize("sharing", [False, True])
def test_kto_main_and_kl_sequences_score_their_own_completion_masks(stores, sharing):
    """KTO on the pair store's halves (``paired_as_kto``): each example's sum is over its completion's scored tokens,
    each KL sequence's over its partner's; TRL's completion masks are 1 on scored completion tokens only."""
    from prefpack.batching.schedule import StepKey
    from prefpack.objectives import KTOTask
    from prefpack.reference import make_reference

    store = Store(stores["spans"])
    cfg = load_config(None, [f"data.train={stores['spans']}", "loss.terms=[{name: kto}]", "data.paired_as_kto=true",
                             f"data.prefix_sharing={sharing}", "train.micro_batch_tokens=4096",
                             "data.max_tokens_per_row=2048", "train.device=cpu"])
    task = make_task(KTOTask, store, cfg)
    policy = float64_llama(stores["tok"], 0)
    module = SequenceLogps(policy, chunk_size=5)
    batches = [task.collate(p) for p in task.plan(np.arange(len(task.view)), seed=StepKey(0, 1))]
    reference = make_reference("copy", model=float64_llama(stores["tok"], 1), chunk_size=5)
    step = task.begin_step(module, reference, batches)
    assert step.kl is not None
    seen = 0
    for b in batches:
        main, kl = module(b.main), module(b.kl)
        assert int(b["completion_mask"].sum()) == int(b.main.completion_tokens.sum()) == int(main.n_tokens.sum())
        assert int(b["KL_completion_mask"].sum()) == int(b.kl.completion_tokens.sum())
        for j, (i, p) in enumerate(zip(b.example_ids.tolist(), b.kl_ids.tolist())):
            prompt, completion, _ = task.view[i]
            partner = task.view.completion(p)
            want = scored_logps_f64(policy, prompt, completion, scored_of(completion))
            assert float(main.logp_sum[j].detach()) == pytest.approx(float(want.sum()), abs=1e-9)
            assert int(main.n_tokens[j]) == len(want)
            want_kl = scored_logps_f64(policy, prompt, partner, scored_of(partner))
            assert float(kl.logp_sum[j].detach()) == pytest.approx(float(want_kl.sum()), abs=1e-9)
            seen += 1
        task.loss(module, reference, b, step)
    assert seen == len(task.view) == 2 * len(store)


def test_precompute_ref_records_the_scored_sums(stores):
    """precompute-ref through the objective: each key's sum and LD-DPO tail over scored tokens only."""
    store = Store(stores["spans"])
    model = float64_llama(stores["tok"], 2)
    table = reference_table(model, store, chunk_size=5)
    for i in range(len(store)):
        for side, (total, _, tail, _) in enumerate(_pair_defs(model, store, i)):
            assert float(table.logps[2 * i + side]) == pytest.approx(total, abs=1e-6)
            assert float(table.tails[2 * i + side]) == pytest.approx(tail, abs=1e-6)


RANKED = [
    {"prompt": "\n\nHuman: What is two plus two?\n\nAssistant:",
     "completions": [{"text": " Four.", "score": 9}, {"text": " Five, I think.", "score": 2},
                     {"text": " It is four, because two and two make four.", "score": 8.5}]},
    {"prompt": "\n\nHuman: Hi there, how are you today?\n\nAssistant:",
     "completions": [{"text": " Hello!", "score": 5}, {"text": " Go away.", "score": 1},
                     {"text": " Hi! I am well, thank you.", "score": 7}]},
]


@pytest.mark.parametrize("layout", ["shared", "packed", "padded"])
def test_ranked_groups_score_masked_completions_and_their_drawn_pair_tails(tmp_path, toy_tokenizers, layout):
    """A ranked store with spans: each completion's sum and count over its scored tokens, and each drawn pair's
    LD-DPO tails (the scored tokens of the longer past the shorter's scored count) per pair."""
    from prefpack.objectives.groups import PromptGroupTask

    tok = toy_tokenizers["llama"]
    prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "ranked.jsonl", RANKED))], tokenizer=str(tok),
                           output=str(tmp_path / "ranked"), workers=1), log=lambda m: None)
    store = Store(store_with_spans(tmp_path / "ranked", tmp_path / "spans"))
    cfg = load_config(None, [f"data.prefix_sharing={layout == 'shared'}", f"data.packing={layout != 'padded'}",
                             "data.ranked_pairs=all_pairs", "loss.ld_alpha=0.5"])
    task = make_task(PromptGroupTask, store, cfg)
    batch = task.collate(Planned([[0, 1]] if layout != "padded" else [[0], [1]], 0, 0))
    model = float64_llama(tok, 0)
    with torch.no_grad():
        out = sequence_logps(model, batch, chunk_size=5, pair_tails=True, wpo=True)
    lps = []
    for i in range(len(task.view)):
        prompt, comps = task.view[i]
        assert any(scored_of(c) is not None for c in comps)
        lps += [_f64(model, prompt, c) for c in comps]
    for s, (lp, lss) in enumerate(lps):
        assert int(out.n_tokens[s]) == len(lp)
        assert float(out.logp_sum[s]) == pytest.approx(lp.sum(), abs=1e-9)
        assert float(out.wpo_mean[s]) == pytest.approx((lp - lss).mean(), abs=1e-9)
    for p, (a, b) in enumerate(batch.tail_pairs.T.tolist()):
        cut = min(len(lps[a][0]), len(lps[b][0]))
        assert float(out.tail_sum[0, p]) == pytest.approx(lps[a][0][cut:].sum(), abs=1e-9)
        assert float(out.tail_sum[1, p]) == pytest.approx(lps[b][0][cut:].sum(), abs=1e-9)


def test_a_step_logs_the_scored_positions(stores, tmp_path, one_thread):
    """metrics.jsonl's ``scored``: the positions through the head, each completion's scored tokens (the spans left
    out); ``tokens`` and ``positions`` still count every token laid out."""
    from conftest import metrics_lines, tiny_llama

    from prefpack.training import train

    policy = tiny_llama(stores["tok"], tmp_path / "policy", 1)
    rows = {}
    for name in ("plain", "spans"):
        cfg = load_config(None, [f"model.name_or_path={policy}", f"data.train={stores[name]}",
                                 f"run.output_dir={tmp_path / name}",
                                 "reference.mode=none", "loss.terms=[{name: simpo}]", "train.global_batch_pairs=6",
                                 "train.max_steps=1", "run.plot=false", "run.tensorboard=false", "train.device=cpu"])
        train(cfg, progress=False, log=lambda m: None)
        rows[name] = metrics_lines(tmp_path / name)[0]
    store = Store(stores["spans"])
    unscored = int(np.diff(np.asarray(store.spans), axis=1).sum())
    lengths = store.index[:, 1:4].astype(int)
    assert rows["plain"]["scored"] == int(lengths[:, 1:].sum())
    assert rows["spans"]["scored"] == rows["plain"]["scored"] - unscored > 0
    assert rows["spans"]["tokens"] == rows["plain"]["tokens"] and rows["spans"]["positions"] == rows["plain"]["positions"]
    assert rows["spans"]["loss"] != rows["plain"]["loss"]
