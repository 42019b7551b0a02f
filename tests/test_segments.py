"""Completions cut into segments (``prefpack.data.spans``, store format version 5: ``segments.bin``): a segment is
computed as its own sequence ``prompt + segment``, attending its prompt and itself only, and its sums add up into
its completion's. Checked in float64 against each segment run ALONE through a plain (eager attention) copy of the
model, in the packed, prompt-shared and padded layouts; the store is written by the real prepare path
(``TokenizedExample.segments`` from a wrapped tokenizer) and read back."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import shutil

import numpy as np
import pytest
import torch
from conftest import float64_llama, make_task, quiet, scored_logps_f64, write_jsonl

from prefpack.batching.collate import collate_groups, collate_packed, collate_padded
from prefpack.config import load_config
from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.spans import ScoredTokens, scored_of, segments_of
from prefpack.data.store import Store, StoreError, StoreWriter
from prefpack.data.store_format import READABLE_VERSIONS, SEGMENT_FORMAT_VERSION
from prefpack.data.tokenize import ExampleTokenizer, TokenizedExample
from prefpack.data.views import StorePairs
from prefpack.model import SequenceLogps, sequence_logps
from prefpack.objectives.base import Planned

ROWS = [[0, 1, 2], [3, 4, 5]]


def _cuts(i: int, side: int, n: int) -> list[int] | None:
    """Where row ``i``'s completion ``side`` (of ``n`` tokens) is cut: every chosen of 9+ tokens in three, every
    odd row's rejected of 4+ in two."""
    if side == 0 and n >= 9:
        return [n // 3, 2 * n // 3]
    if side == 1 and i % 2 and n >= 4:
        return [n // 2]
    return None


def _mask(i: int, side: int, n: int) -> list[bool] | None:
    """Unscored tokens: a cut chosen's first token and its second segment's first; row 2's rejected, a middle one."""
    cuts = _cuts(i, side, n)
    if side == 0 and cuts:
        return [k not in (0, cuts[0]) for k in range(n)]
    if side == 1 and i == 2 and n > 3:
        return [k != n // 2 for k in range(n)]
    return None


@contextlib.contextmanager
def _segmenting(cuts, mask):
    """prepare with the tokenizer's results given segments and score masks: ``cuts(i, k, n)`` and ``mask(i, k, n)``
    for completion k (of n tokens) of the chunk's i-th example, as a template that rewrites earlier turns would."""
    original = ExampleTokenizer.__call__

    def cut(self, examples):
        out = []
        for i, res in enumerate(original(self, examples)):
            if isinstance(res, TokenizedExample):
                n = [len(c) for c in res.completions]
                res = dataclasses.replace(res, segments=tuple(cuts(i, k, m) for k, m in enumerate(n)),
                                          scored=tuple(mask(i, k, m) for k, m in enumerate(n)))
            out.append(res)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ExampleTokenizer, "__call__", cut)
        yield


@pytest.fixture(scope="module")
def seg(tmp_path_factory, toy_tokenizers, hh_train):
    """The same 6 hh pairs prepared plainly and with segments and masks (the tokenizer wrapped to give them, as a
    template that rewrites earlier turns would)."""
    root = tmp_path_factory.mktemp("segments")
    rows = [{"prompt": r["prompt"][-100:], "chosen": r["chosen"][:150], "rejected": r["rejected"][:150]}
            for r in hh_train[:60] if r["chosen"].strip() and r["chosen"] != r["rejected"]][:6]
    src = write_jsonl(root / "rows.jsonl", rows)

    def run(name):
        prepare(PrepareOptions(inputs=[str(src)], tokenizer=str(toy_tokenizers["llama"]), output=str(root / name),
                               max_length=128, workers=1), log=quiet)
        return root / name

    plain = run("plain")
    with _segmenting(_cuts, _mask):
        segmented = run("seg")
    assert (Store(plain).column("prompt_len") >= 10).all()  # the context each segment is computed in
    return {"plain": plain, "seg": segmented, "tok": toy_tokenizers["llama"]}


def _plain(model):
    """The same weights on transformers' sdpa attention, run one sequence at a time: the reference (eager attention
    takes its softmax in float32)."""
    cfg = copy.deepcopy(model.config)
    cfg._attn_implementation = "sdpa"
    out = type(model)(cfg).double().eval()
    out.load_state_dict(model.state_dict())
    return out


def _alone(model, prompt, completion) -> np.ndarray:
    """A completion's scored-token log-probs in token order, each of its segments run alone as ``prompt +
    segment`` (float64, ``conftest.scored_logps_f64``)."""
    c = np.asarray(completion)
    mask = scored_of(completion)
    mask = np.ones(len(c), bool) if mask is None else np.asarray(mask)
    cuts = segments_of(completion)
    bounds = [0, *([] if cuts is None else [int(k) for k in cuts]), len(c)]
    return np.concatenate([scored_logps_f64(model, prompt, c[a:b], mask[a:b])
                           for a, b in zip(bounds[:-1], bounds[1:])])


def _batch(pairs, layout):
    return {"packed": lambda: collate_packed(pairs, ROWS), "padded": lambda: collate_padded(pairs, ROWS),
            "shared": lambda: collate_packed(pairs, ROWS, share_prompts=True)}[layout]()


# ---------------------------------------------------------------- the store


def test_a_store_with_segments_reads_them_back_and_refuses_a_corrupt_segments_file(seg, tmp_path):
    """prepare writes segments.bin (version 5) beside the same tokens.bin; each completion reads back its cuts and
    mask; a store without segments keeps its version and files; a segments.bin that cuts outside a completion, is
    unsorted, truncated or altered is refused in one line."""
    plain, store = Store(seg["plain"]), Store(seg["seg"], verify=True)
    assert (seg["plain"] / "tokens.bin").read_bytes() == (seg["seg"] / "tokens.bin").read_bytes()
    assert plain.meta["format_version"] == 2 and not (seg["plain"] / "segments.bin").exists()
    assert "num_segments" not in plain.meta and segments_of(plain.pair(0).chosen) is None
    assert store.meta["format_version"] == SEGMENT_FORMAT_VERSION == max(READABLE_VERSIONS) == 5
    want = 0
    for i in range(len(store)):
        for side, c in enumerate(store.pair(i)[1:]):
            cuts, mask = _cuts(i, side, len(c)), _mask(i, side, len(c))
            want += len(cuts or ())
            assert (segments_of(c) is None) == (cuts is None)
            if cuts:
                assert segments_of(c).tolist() == cuts
            assert (scored_of(c) is None) == (mask is None) and (mask is None or scored_of(c).tolist() == mask)
            np.testing.assert_array_equal(np.asarray(c), np.asarray(plain.pair(i)[1 + side]))
    assert store.num_segments == store.meta["num_segments"] == want >= 6
    extra, longest = store.segment_lengths()
    assert int(extra.sum()) == want and (longest <= np.diff(np.stack(store.completion_bounds()), axis=0)[0]).all()

    def corrupt(values, name, *, size=True):
        bad = tmp_path / name
        shutil.copytree(seg["seg"], bad)
        np.asarray(values, dtype=np.int64).tofile(bad / "segments.bin")
        if not size:
            meta = json.loads((bad / "meta.json").read_text())
            meta["num_segments"] += 1
            (bad / "meta.json").write_text(json.dumps(meta))
        return bad

    good = np.fromfile(seg["seg"] / "segments.bin", dtype=np.int64)
    starts, _ = store.completion_bounds()
    own = starts[np.searchsorted(starts, good[0], side="right") - 1]  # the first cut's completion starts there
    for values, name, size, words in [
        (np.r_[own, good[1:]], "at_start", True, "not strictly inside a completion"),
        (good[::-1], "unsorted", True, "not after the previous one"),
        (good, "short", False, "segments.bin has"),
    ]:
        with pytest.raises(StoreError, match=words) as err:
            Store(corrupt(values, name, size=size))
        assert "\n" not in str(err.value)
    moved = corrupt(np.r_[good[:-1], good[-1] + 1], "moved")
    Store(moved)  # still inside its completion: only the hash tells
    with pytest.raises(StoreError, match="segments.bin does not match its sha256"):
        Store(moved, verify=True)


def test_the_writer_refuses_segments_outside_a_completion_and_images_with_segments(tmp_path):
    """Segments cut strictly inside a completion of their block; a store holds images or segments, not both."""
    rows = np.array([[0, 2, 4, 3, 0, 0, 0]], dtype=np.int64)  # prompt [0, 2), chosen [2, 6), rejected [6, 9)
    for segments, images, words in [([6], None, "not strictly inside"), ([3], [(0, b"x", 1, 1, 0, 1)], "images")]:
        w = StoreWriter(tmp_path / "s", kind="pairs", vocab_size=100, log=quiet)
        with pytest.raises(StoreError, match=words):
            w.append(np.arange(9), rows, images=images, segments=np.array(segments))
        w.abort()


# ---------------------------------------------------------------- the forward


@pytest.fixture(scope="module")
def models(seg):
    policy = float64_llama(seg["tok"], 0)
    return policy, _plain(policy)


def _grads(model, out):
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(0.5, 1.5, out.logp_sum.numel(), dtype=out.logp_sum.dtype)
    ((out.logp_sum + 0.3 * out.tail_sum) * weights).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_each_segment_is_computed_alone_and_sums_into_its_completion_in_every_layout(seg, models):
    """Per completion, in the packed, prompt-shared and padded layouts: its log-prob sum, scored-token count,
    LD-DPO tail and per-token log-probs ([S, W], token order) equal those of its segments each run alone as
    ``prompt + segment`` (float64, 1e-9); the gradients agree across the layouts; the batch counts each segment's
    prompt in ``real_tokens``."""
    policy, plain = models
    store = Store(seg["seg"])
    pairs = StorePairs(store)
    want = {}
    for i in range(len(store)):
        prompt, *comps = store.pair(i)
        want[i] = [_alone(plain, prompt, c) for c in comps]
    assert sum(segments_of(c) is not None for i in range(len(store)) for c in store.pair(i)[1:]) >= 5
    grads, worst = {}, 0.0
    for layout in ("packed", "shared", "padded"):
        batch = _batch(pairs, layout)
        out = sequence_logps(policy, batch, chunk_size=5, pair_tails=True, token_logps=True)
        pieces = [(len(p), len(x)) for i in range(len(store)) for p, *cs in [store.pair(i)] for c in cs
                  for x in np.split(np.asarray(c), [] if segments_of(c) is None else segments_of(c))]
        assert batch.real_tokens == sum(a + b for a, b in pieces)
        if layout == "padded":
            assert batch.input_ids.shape[0] == len(pieces)
        for i in range(len(store)):
            cut = min(len(x) for x in want[i])
            for side, x in enumerate(want[i]):
                s = 2 * i + side
                assert int(out.n_tokens[s]) == len(x)
                diffs = [float(out.logp_sum[s].detach()) - x.sum(), float(out.tail_sum[s].detach()) - x[cut:].sum(),
                         *(out.token_logp[s, :len(x)].numpy() - x), *out.token_logp[s, len(x):].numpy()]
                worst = max(worst, float(np.abs(diffs).max()))
        grads[layout] = _grads(policy, out)
    assert worst < 1e-9, worst
    for layout in ("shared", "padded"):
        for name, g in grads["packed"].items():
            torch.testing.assert_close(grads[layout][name], g, rtol=1e-6, atol=2e-6, msg=f"{layout}: {name}")


def test_a_segment_in_a_shared_row_sees_its_prompt_only(seg):
    """Prompt-shared layout: a segment follows the prompt as one more sibling, positions continuing from the prompt's
    length, its first token predicted from the prompt's last position, its unscored tokens without a target."""
    store = Store(seg["seg"])
    prompt, chosen, _ = store.pair(0)
    cuts = segments_of(chosen)
    assert cuts is not None and len(prompt)
    batch = collate_groups([(prompt, (chosen,))], [[0]], ids=[0], share_prompts=True)
    n_p, bounds = len(prompt), [0, *cuts.tolist(), len(chosen)]
    pos = batch.position_ids[0, :n_p + len(chosen)].numpy()
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert pos[n_p + a:n_p + b].tolist() == list(range(n_p, n_p + b - a))
    firsts = [int(t) for t, q in zip(batch.score_targets, batch.score_positions) if int(q) == n_p - 1]
    scored = scored_of(chosen)
    assert firsts == [int(chosen[a]) for a in bounds[:-1] if scored[a]]
    assert int(batch.completion_tokens[0]) == int(scored.sum()) == batch.score_positions.numel()
    assert batch.real_tokens == len(cuts) * n_p + n_p + len(chosen) and batch.positions == n_p + len(chosen)


# ---------------------------------------------------------------- objectives


def _sigmoid(x: float) -> float:
    return -math.log(1 / (1 + math.exp(-x)))


@pytest.mark.parametrize("sharing", [False, True])
def test_dpo_losses_on_a_segmented_store_equal_those_of_the_segments_run_alone(seg, models, sharing):
    """sigmoid + ipo on LD-DPO's sums (alpha 0.5) through ``PairTask`` (planned and collated as training does, a copy
    reference) equal the formulas over the independent per-segment sums, counts and tails of policy and reference;
    the plan counts what the batches hold (a prompt again per extra segment unshared) and keeps rows in budget."""
    from prefpack.objectives.pairs import PairTask
    from prefpack.reference import CopyReference

    beta, alpha = 0.2, 0.5
    policy, plain = models
    ref_model = float64_llama(seg["tok"], 1)
    store = Store(seg["seg"])
    cfg = load_config(None, ["loss.terms=[{name: sigmoid}, {name: ipo}]", f"loss.beta={beta}",
                             f"loss.ld_alpha={alpha}", f"data.prefix_sharing={sharing}",
                             "data.max_tokens_per_row=450", "train.micro_batch_tokens=900"])
    task = make_task(PairTask, store, cfg)
    assert task.shares_prompts == sharing
    reference = CopyReference(ref_model)
    reference.configure(chunk_size=7, pair_tails=True)
    module = SequenceLogps(policy, chunk_size=7, pair_tails=True)
    ref_plain = _plain(ref_model)
    seen = []
    for planned in task.plan(np.arange(len(store)), seed=0):
        batch = task.collate(planned)
        assert planned.real_tokens == batch.real_tokens and planned.computed_tokens == batch.computed_tokens
        for r, row in enumerate(planned.rows):  # a row holds more than one pair only within its budget
            assert len(row) == 1 or int(batch.token_mask[r].sum()) <= 450
        out = task.loss(module, reference, batch, None)
        for k, i in enumerate(batch.pair_indices.tolist()):
            prompt, *comps = store.pair(i)
            (pc, pr), (rc, rr) = ([_alone(m, prompt, c) for c in comps] for m in (plain, ref_plain))
            cut = min(len(pc), len(pr))

            def ld(x, cut=cut):
                return x[:cut].sum() + alpha * x[cut:].sum()

            margin = (ld(pc) - ld(rc)) - (ld(pr) - ld(rr))
            ipo = ((ld(pc) - ld(rc)) / len(pc) - (ld(pr) - ld(rr)) / len(pr) - 1 / (2 * beta)) ** 2
            assert float(out.metrics["loss/ipo"][k]) == pytest.approx(ipo, rel=1e-9, abs=1e-10)
            assert float(out.loss[k].detach()) == pytest.approx(_sigmoid(beta * margin) + ipo, rel=1e-9, abs=1e-10)
            seen.append(i)
    assert sorted(seen) == list(range(len(store)))


@pytest.mark.parametrize("sharing", [False, True])
def test_prompt_groups_of_a_segmented_store_give_its_pairs_losses(seg, models, sharing):
    """The pair store read as prompt groups (``PromptGroupTask``: its completions' segments counted in the plan,
    each completion computed once) gives each pair the loss ``PairTask`` gives it (LD-DPO tails per drawn pair)."""
    from prefpack.objectives.groups import PromptGroupTask
    from prefpack.objectives.pairs import PairTask
    from prefpack.reference import CopyReference

    policy, _ = models
    store = Store(seg["seg"])
    cfg = load_config(None, ["loss.terms=[{name: sigmoid}]", "loss.ld_alpha=0.4", f"data.prefix_sharing={sharing}",
                             "data.max_tokens_per_row=450", "train.micro_batch_tokens=900"])
    reference = CopyReference(float64_llama(seg["tok"], 1))
    reference.configure(chunk_size=7, pair_tails=True)
    module = SequenceLogps(policy, chunk_size=7, pair_tails=True)
    pairs, groups = make_task(PairTask, store, cfg), make_task(PromptGroupTask, store, cfg)
    want = pairs.loss(module, reference, pairs.collate(Planned([list(range(len(store)))], 0, 0)), None).loss
    got = {}
    for planned in groups.plan(np.arange(len(groups)), seed=0):
        batch = groups.collate(planned)
        assert planned.real_tokens == batch.real_tokens and planned.computed_tokens == batch.computed_tokens
        loss = groups.loss(module, reference, batch, None).loss
        drawn = [r for g in batch.group_ids.tolist() for r in groups.view.pair_rows[g]]
        got.update({r: float(x) for r, x in zip(drawn, loss.detach())})
    assert sorted(got) == list(range(len(store)))
    np.testing.assert_allclose([got[r] for r in range(len(store))], want.detach().numpy(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("sharing", [False, True])
def test_kto_main_and_kl_sequences_keep_their_completions_segments(seg, models, sharing):
    """KTO on the pair store's halves: each example's sum and count, and each KL sequence's (its prompt with the
    partner's completion, segments and all), equal the segments run alone after that prompt."""
    from prefpack.batching.schedule import StepKey
    from prefpack.objectives import KTOTask

    policy, plain = models
    store = Store(seg["seg"])
    cfg = load_config(None, [f"data.train={seg['seg']}", "loss.terms=[{name: kto}]", "data.paired_as_kto=true",
                             f"data.prefix_sharing={sharing}", "train.micro_batch_tokens=4096",
                             "data.max_tokens_per_row=2048", "train.device=cpu"])
    task = make_task(KTOTask, store, cfg)
    seen = 0
    for planned in task.plan(np.arange(len(task.view)), seed=StepKey(0, 1)):
        b = task.collate(planned)
        assert planned.real_tokens == b.real_tokens
        main, kl = sequence_logps(policy, b.main, chunk_size=5), sequence_logps(policy, b.kl, chunk_size=5)
        for j, (i, p) in enumerate(zip(b.example_ids.tolist(), b.kl_ids.tolist())):
            prompt, completion, _ = task.view[i]
            want, want_kl = _alone(plain, prompt, completion), _alone(plain, prompt, task.view.completion(p))
            assert int(main.n_tokens[j]) == len(want) and int(kl.n_tokens[j]) == len(want_kl)
            assert float(main.logp_sum[j].detach()) == pytest.approx(float(want.sum()), abs=1e-9)
            assert float(kl.logp_sum[j].detach()) == pytest.approx(float(want_kl.sum()), abs=1e-9)
            seen += 1
    assert seen == 2 * len(store)


def test_what_cannot_honour_segments_refuses_in_one_line(seg):
    """A reward model reads one reward per completion at its sequence's last token: its objective, prefpack score
    and the packed scorer refuse a segmented completion, naming the store and the reason."""
    from prefpack.objectives.reward import RewardPairTask
    from prefpack.rewards.reward_model import packed_scores
    from prefpack.rewards.rows import ScoreInput, ScoreInputError

    store = Store(seg["seg"])
    with pytest.raises(StoreError, match="segments.bin") as err:
        make_task(RewardPairTask, store, load_config(None, ["train.objective=reward"]))
    assert str(seg["seg"]) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ScoreInputError, match="segments") as err:
        ScoreInput(seg["seg"])
    assert str(seg["seg"]) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="segments"):
        packed_scores(None, [(np.arange(3), [ScoredTokens(np.arange(4), None, [2])])], 64, share_prompts=False)


def test_token_shards_refuse_prompt_shared_segments_where_a_tokens_place_counts(seg, models):
    """Sequence parallelism: in a prompt-shared row a later segment's first token is scored on the prompt's shard,
    before its completion's earlier tokens, so LD-DPO tails and per-token terms are refused there (sums are not)."""
    from prefpack.model import kernel_of
    from prefpack.model.sharded import sharded_logps
    from prefpack.sequence_parallel import SeqPar

    pairs = StorePairs(Store(seg["seg"]))
    shared, packed = collate_packed(pairs, ROWS, share_prompts=True), collate_packed(pairs, ROWS)
    assert shared.segmented and packed.segmented and not collate_packed(StorePairs(Store(seg["plain"])), ROWS).segmented
    shared.key_store = str(seg["seg"])
    with pytest.raises(ValueError, match="segments.bin") as err:
        sharded_logps(None, None, kernel_of(models[0]), shared, SeqPar(size=2), flatten=False, chunk_size=5,
                      pair_tails=True)
    assert str(seg["seg"]) in str(err.value) and "\n" not in str(err.value)


def test_inspect_shows_where_a_new_sequence_starts(seg):
    from prefpack.data.inspect import SEGMENT_MARK, decode_row, format_text, length_stats
    from prefpack.tokenizer import load_tokenizer

    store = Store(seg["seg"])
    row = decode_row(store, 1, load_tokenizer(str(seg["tok"])))
    cuts = _cuts(1, 0, len(row["chosen_ids"]))
    assert row["chosen_segments"] == cuts and row["chosen_marked"].count(SEGMENT_MARK) == len(cuts)
    assert row["rejected_marked"].count(SEGMENT_MARK) == len(_cuts(1, 1, len(row["rejected_ids"])))
    text = format_text(store, length_stats(store), row)
    assert f"{len(cuts) + 1} sequences, each after the prompt" in text and "segments.bin" in text


# ---------------------------------------------------------------- group policy gradients


RANKED = [
    {"prompt": "\n\nHuman: What is two plus two? Answer briefly.\n\nAssistant:",
     "completions": [{"text": " Four. Two and two make four.", "score": 1.0}, {"text": " Five, I think.", "score": 0.0},
                     {"text": " It is four, because two and two make four.", "score": 0.5}]},
    {"prompt": "\n\nHuman: Name a colour you like.\n\nAssistant:",
     "completions": [{"text": " Blue, like the sky.", "score": 2.0}, {"text": " A dog is not one.", "score": -1.0},
                     {"text": " Red, or green.", "score": 0.25}]},
]


def _ranked_cuts(i: int, k: int, n: int) -> list[int] | None:
    return [n // 2] if k != 1 and n >= 4 else None


def _ranked_mask(i: int, k: int, n: int) -> list[bool] | None:
    return [j != n // 2 for j in range(n)] if k == 2 and n >= 4 else None  # a second segment's first token


@pytest.mark.parametrize("layout", ["shared", "packed", "padded"])
def test_group_policy_gradients_read_a_segmented_completions_tokens_in_order(tmp_path, toy_tokenizers, layout):
    """GRPO with the k3 KL on a ranked store whose completions are cut into segments: the per-token ratios and KL
    read each completion's scored tokens in token order ([S, W] matrices), so the loss and its gradient equal the
    float64 formula with every segment run alone after its prompt (the old policy another model, recomputed
    once)."""
    from prefpack.objectives.pg import GroupPolicyTask
    from prefpack.reference import CopyReference

    tok = toy_tokenizers["llama"]
    with _segmenting(_ranked_cuts, _ranked_mask):
        prepare(PrepareOptions(inputs=[str(write_jsonl(tmp_path / "rows.jsonl", RANKED))], tokenizer=str(tok),
                               output=str(tmp_path / "ranked"), workers=1), log=quiet)
    store = Store(tmp_path / "ranked")
    assert store.meta["format_version"] == 5 and store.num_segments >= 3
    eps, kl = 0.02, 0.07
    cfg = load_config(None, ["train.objective=policy_gradient", "loss.terms=[{name: grpo}]", f"loss.kl_coef={kl}",
                             f"data.prefix_sharing={layout == 'shared'}", f"data.packing={layout != 'padded'}",
                             f"loss.epsilon={eps}"])
    policy, old_model = float64_llama(tok, 0), float64_llama(tok, 1)
    task = make_task(GroupPolicyTask, store, cfg)
    reference = CopyReference(float64_llama(tok, 1))
    reference.configure(chunk_size=7, pair_tails=False, token_logps=True)
    task._start(SequenceLogps(old_model, chunk_size=5, token_logps=True), reference)
    module = SequenceLogps(policy, chunk_size=7, token_logps=True)
    rows = [[0, 1]] if layout != "padded" else [[0], [1]]
    planned = Planned(rows, 0, 0)
    task.plan_step(np.arange(len(task)), seed=None)
    got = task.loss(module, reference, task.collate(planned), None).loss.sum() / task.units(np.arange(len(task)))
    terms, old_plain = [], _plain(old_model)
    starts, scores = store.group_starts(), store.scores()
    for g in range(len(starts) - 1):
        prompt, comps = store.ranked_group(g)
        s = scores[starts[g]:starts[g + 1]]
        adv = (s - s.mean()) / (np.std(s, ddof=1) + 1e-4)
        for c, a in zip(comps, adv):
            mask = scored_of(c)
            mask = np.ones(len(c), bool) if mask is None else mask
            cuts = [] if segments_of(c) is None else segments_of(c).tolist()
            bounds, lps = [0, *cuts, len(c)], []
            for x, y in zip(bounds[:-1], bounds[1:]):
                ids = torch.tensor([[int(t) for t in prompt] + [int(t) for t in c[x:y]]])
                logp = torch.log_softmax(policy(input_ids=ids, use_cache=False).logits.double()[0, :-1], -1)
                lp = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt) - 1:]
                lps.append(lp[torch.as_tensor(mask[x:y])])
            lp, old = torch.cat(lps), torch.as_tensor(_alone(old_plain, prompt, c))
            r = torch.exp(lp - old)
            per_token = -torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps) * a)
            terms.append((per_token + kl * (torch.exp(old - lp) - (old - lp) - 1) * r).sum() / lp.numel())
    want = torch.stack(terms).sum() / len(terms)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    params = [p for p in policy.parameters() if p.requires_grad]
    for x, y in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
