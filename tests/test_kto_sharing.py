"""KTO with prompts laid out once (issue 13): a prompt group's examples (a pair's halves under ``paired_as_kto``, or
repeated prompts of an unpaired store) share one copy of their prompt in the main rows, and their KL sequences
(the same prompt with each partner's completion) share one in the KL rows.

In float64 the per-example policy log-probs, KL log-probs, z0's sums and the losses with sharing equal those
without and a direct forward of each sequence alone; gradients agree to float32 accuracy (see
tests/test_prefix_sharing.py for why). A few `train()` steps give the same losses and tokens with fewer positions,
and precompute-ref's KTO arrays are the same whether the kernel reads prompt groups or not.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import make_task, tiny_llama, write_jsonl

from prefpack.batching.schedule import StepKey, StepSchedule
from prefpack.config import load_config
from prefpack.data.prepare import PrepareOptions, prepare
from prefpack.data.store import Store
from prefpack.data.views import UnpairedView
from prefpack.model import SequenceLogps
from prefpack.objectives import KTOTask
from prefpack.reference import make_reference
from prefpack.training import train


def _quiet(_msg):
    return None


@pytest.fixture(scope="module")
def ks(tmp_path_factory, toy_tokenizers, hh_train):
    """A 6-pair store (12 KTO examples), an unpaired store with repeated prompts, one with distinct prompts."""
    root = tmp_path_factory.mktemp("kto_sharing")
    tok = toy_tokenizers["llama"]
    rows = [r for r in hh_train[:40] if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]
    pairs = [{"prompt": f"P{k}:{r['prompt'][-40:]}", "chosen": r["chosen"][:40], "rejected": r["rejected"][:40]}
             for k, r in enumerate(rows[20:26])]
    unpaired = []
    for k, repeats in enumerate((3, 1, 2, 1, 2, 1)):  # short texts: no truncation, a repeated prompt keeps its tokens
        prompt = f"Q{k}:{rows[k]['prompt'][-40:]}"
        for j in range(repeats):
            text = (rows[k]["chosen"], rows[k]["rejected"], rows[k + 10]["chosen"])[j]
            unpaired.append({"prompt": prompt, "completion": text[:40] + f" {j}", "label": (j + k) % 2 == 0})
    distinct = [dict(r, prompt=f"{r['prompt']} #{i}") for i, r in enumerate(unpaired)]
    out = {}
    for name, part in (("pairs", pairs), ("repeated", unpaired), ("distinct", distinct)):
        prepare(PrepareOptions(inputs=[str(write_jsonl(root / f"{name}.jsonl", part))], tokenizer=str(tok),
                               output=str(root / name), max_length=64, workers=1), log=_quiet)
        out[name] = root / name
    out.update(root=root, tok=tok)
    return out


def _cfg(ks, store, sharing, *extra):
    return load_config(None, [f"data.train={store}", "loss.terms=[{name: kto}]", f"data.prefix_sharing={sharing}",
                              "train.micro_batch_tokens=192", "data.max_tokens_per_row=96", "train.device=cpu",
                              "run.plot=false", "run.tensorboard=false", *extra])


def _model64(tok_dir, seed):
    """A tiny float64 Llama on the packed_sdpa kernel (the one that reads prompt groups)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from prefpack.model.attention.packed_sdpa import register

    register()
    cfg = LlamaConfig(vocab_size=len(AutoTokenizer.from_pretrained(tok_dir)), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = "packed_sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).double().eval()


def _direct(model, prompt, completion) -> float:
    """log p(completion | prompt) from one forward of the sequence alone."""
    ids = torch.tensor([[int(t) for t in prompt] + [int(t) for t in completion]])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
    logp = torch.log_softmax(logits[0, :-1].double(), -1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
    return float(logp[len(prompt) - 1:].sum())


def _step(task, ids, policy, reference):
    """Per-example values of one step: policy log-probs of the main and KL sequences, losses, z0's sums, grads."""
    module = SequenceLogps(policy, chunk_size=5)
    batches = [task.collate(p) for p in task.plan(ids, seed=StepKey(0, 3))]
    step = task.begin_step(module, reference, batches)
    policy.zero_grad(set_to_none=True)
    main, kl, loss, partner = {}, {}, {}, {}
    for b in batches:
        out = task.loss(module, reference, b, step)
        out.loss.sum().backward()
        with torch.no_grad():
            m, k = module(b.main)[0], module(b.kl)[0]
        for j, (i, p) in enumerate(zip(b.example_ids.tolist(), b.kl_ids.tolist())):
            main[i], kl[i], loss[i], partner[i] = float(m[j]), float(k[j]), float(out.loss[j]), p
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return batches, step, main, kl, loss, partner, grads


@pytest.mark.parametrize(("which", "row"), [("pairs", 96), ("repeated", 96), ("repeated", 64)])
def test_shared_kto_steps_equal_unshared(ks, which, row, one_thread):
    """``row=64``: the 3-completion prompt (19 + 24 + 18 + 12 tokens) is cut into runs that fit a row."""
    store = Store(ks[which])
    extra = (["data.paired_as_kto=true"] if which == "pairs" else []) + [f"data.max_tokens_per_row={row}"]
    on, off = (make_task(KTOTask, store, _cfg(ks, ks[which], s, *extra)) for s in ("true", "false"))
    view = on.view
    ids = np.random.default_rng(1).permutation(len(view))[:10]
    policy, reference = _model64(ks["tok"], 0), make_reference("copy", model=_model64(ks["tok"], 1), chunk_size=5)
    b_on, s_on, main_on, kl_on, loss_on, partner_on, g_on = _step(on, ids, policy, reference)
    b_off, s_off, main_off, kl_off, loss_off, partner_off, g_off = _step(off, ids, policy, reference)
    assert sorted(main_on) == sorted(ids.tolist()) and partner_on == partner_off
    assert sum(b.main.shared_tokens for b in b_on) > 0 and sum(b.kl.shared_tokens for b in b_on) > 0
    assert all(b.main.shared_tokens == b.kl.shared_tokens == 0 for b in b_off)
    assert len(b_on) > 1 and all(max(b.main.input_ids.shape[1], b.kl.input_ids.shape[1]) <= row for b in b_on)
    for i in ids.tolist():  # against one forward of each sequence alone
        prompt, completion, label = view[i]
        assert main_on[i] == pytest.approx(_direct(policy, prompt, completion), abs=1e-10)
        assert kl_on[i] == pytest.approx(_direct(policy, prompt, view.completion(partner_on[i])), abs=1e-10)
        assert main_off[i] == pytest.approx(main_on[i], abs=1e-10) and kl_off[i] == pytest.approx(kl_on[i], abs=1e-10)
        assert loss_on[i] == pytest.approx(loss_off[i], abs=1e-10)
    assert s_on.kl_count == s_off.kl_count == len(ids) and s_on.class_counts == s_off.class_counts
    assert s_on.kl_sum == pytest.approx(s_off.kl_sum, abs=1e-10) and s_on.kl == pytest.approx(s_off.kl, abs=1e-12)
    ref_model = reference.model
    want = sum(kl_on[i] - _direct(ref_model, view.prompt(i), view.completion(partner_on[i])) for i in ids.tolist())
    assert s_on.kl_sum == pytest.approx(want, abs=1e-9)
    assert g_on.keys() == g_off.keys()
    for name in g_on:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-6, atol=2e-6, msg=name)
    # accounting: tokens count every sequence's prompt, positions only what is laid out; plans say what batches hold
    for planned, b in zip(on.plan(ids, seed=StepKey(0, 3)), b_on):
        assert (planned.real_tokens, planned.computed_tokens) == (b.real_tokens, b.computed_tokens)
    assert sum(b.real_tokens for b in b_on) == sum(b.real_tokens for b in b_off)
    assert sum(b.positions for b in b_on) == sum(b.positions for b in b_off) - sum(
        b.main.shared_tokens + b.kl.shared_tokens for b in b_on)


def test_shared_batch_order_and_completion_masks(ks):
    """Example k is sequence k of both passes; labels, ids and TRL's completion masks follow the shared layout."""
    store = Store(ks["pairs"])
    task = make_task(KTOTask, store, _cfg(ks, ks["pairs"], "true", "data.paired_as_kto=true",
                                          "train.micro_batch_tokens=4096", "data.max_tokens_per_row=4096"))
    view = task.view
    (planned,) = task.plan(np.arange(len(view)), seed=StepKey(0, 0))
    b = task.collate(planned)
    flat = b.example_ids.tolist()
    assert b.main.num_sequences == b.kl.num_sequences == len(flat) == 12
    assert b.label.tolist() == view.labels[flat].tolist()
    assert all(view.groups[flat[k]] == view.groups[flat[k + 1]] for k in range(0, 12, 2))  # a pair's halves together
    assert len(set(view.groups.tolist())) == 6 and b.main.shared_tokens == int(view.prompt_len[flat[0::2]].sum())
    kl_of, seq_of = dict(zip(flat, b.kl_ids.tolist())), {i: k for k, i in enumerate(flat)}
    kl_order = [flat[k] for r in planned.kl_rows for k in r]  # KL rows hold a group's examples together
    for batch, mask, order, completions in (
            (b.main, b["completion_mask"], flat, [view.completion(i) for i in flat]),
            (b.kl, b["KL_completion_mask"], kl_order, [view.completion(kl_of[i]) for i in kl_order])):
        assert mask.shape == batch.input_ids.shape
        assert batch.input_ids[mask.bool()].tolist() == np.concatenate(completions).tolist()
        n = batch.completion_tokens.tolist()
        assert [n[seq_of[i]] for i in order] == [len(c) for c in completions]


def test_distinct_prompts_keep_todays_batches(ks):
    """No prompt repeats: sharing on plans and collates exactly what sharing off does."""
    store = Store(ks["distinct"])
    on, off = (make_task(KTOTask, store, _cfg(ks, ks["distinct"], s)) for s in ("true", "false"))
    ids = np.arange(len(on))
    assert len(set(on.view.groups.tolist())) == len(on)
    p_on, p_off = on.plan(ids, seed=StepKey(0, 2)), off.plan(ids, seed=StepKey(0, 2))
    assert p_on == p_off and len(p_on) > 1
    for a, b in zip(p_on, p_off):
        x, y = on.collate(a), off.collate(b)
        for key in x.keys():
            assert torch.equal(x[key], y[key]) if x[key] is not None else y[key] is None, key
        assert x.main.score_positions is None and x.kl.score_positions is None


def _metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_training_kto_with_prefix_sharing_equals_training_without(ks, tmp_path, one_thread):
    """Three KTO steps on a pair store read as KTO: same losses and tokens; positions fall by each step's repeated
    prompts (in the main and the KL rows), and `auto` turns sharing on."""
    model = tiny_llama(ks["tok"], tmp_path / "model", seed=0)
    ref = tiny_llama(ks["tok"], tmp_path / "ref", seed=3)
    runs = {}
    for name, sharing in (("plain", "false"), ("shared", "auto")):
        logged = []
        cfg = _cfg(ks, ks["pairs"], sharing, "data.paired_as_kto=true", f"model.name_or_path={model}",
                   f"reference.model={ref}", f"run.output_dir={tmp_path / name}", "train.global_batch_pairs=8",
                   "train.max_steps=3", "optim.lr=1e-2")
        train(cfg, progress=False, log=logged.append)
        runs[name] = _metrics(tmp_path / name)
        assert any("laid out once" in m for m in logged) == (name == "shared")
    plain, shared = runs["plain"], runs["shared"]
    view = UnpairedView(Store(ks["pairs"]), paired_as_kto=True)
    sched = StepSchedule(len(view), 8, 0, True, view.groups)  # a pair's halves are shuffled as a block
    total = 0
    for step, (p, s) in enumerate(zip(plain, shared)):
        ids = sched.pairs_for_step(step)[1]
        _, first, counts = np.unique(view.groups[ids], return_index=True, return_counts=True)
        saved = 2 * int((view.prompt_len[ids[first]] * (counts - 1)).sum())  # main and KL rows, each group once
        assert s["tokens"] == p["tokens"] == p["positions"]
        assert s["positions"] == p["positions"] - saved
        total += saved
        assert s["loss"] == pytest.approx(p["loss"], abs=2e-5) and s["kl"] == pytest.approx(p["kl"], abs=2e-5)
    # 8 examples a step = 4 whole pairs: every half shares its prompt with its sibling
    assert total == sum(2 * int(view.prompt_len[sched.pairs_for_step(k)[1]].sum()) // 2 for k in range(3))
    assert len(plain) == 3 and plain[-1]["loss"] != plain[0]["loss"]


def test_precompute_ref_kto_arrays_with_and_without_prompt_groups(ks):
    """precompute-ref's KTO objective lays prompt groups out once on packed_sdpa; the table equals the unshared
    layout (a kernel that does not read groups) and one forward per sequence, the KL sequences at keys N + i."""
    from prefpack.training.precompute import record_reference, scoring_objective

    store = Store(ks["repeated"])
    model = _model64(ks["tok"], 4)
    kw = dict(kto=True, seed=0, micro_batch_tokens=192, row_tokens=64, chunk_size=5)  # 3-completion prompt: cut
    shared = scoring_objective(store, shares_prompts=True, **kw)
    batches = [shared.collate(p) for p in shared.plan(np.arange(len(shared)), seed=None)]
    assert any(b.main.score_positions is not None and b.kl.score_positions is not None for b in batches)
    assert max(max(b.main.input_ids.shape[1], b.kl.input_ids.shape[1]) for b in batches) <= 64  # rows fit
    on = record_reference(shared, model)
    model.config._attn_implementation = "sdpa"
    plain = scoring_objective(store, shares_prompts=False, **kw)
    assert all(plain.collate(p).main.score_positions is None for p in plain.plan(np.arange(len(plain)), seed=None))
    off = record_reference(plain, model)
    model.config._attn_implementation = "packed_sdpa"
    view = UnpairedView(store)
    n, partners = len(view), shared.fixed_partners()
    assert on.tails is None and len(on.logps) == 2 * n and np.isfinite(on.logps).all()
    np.testing.assert_allclose(on.logps, off.logps, rtol=0, atol=1e-10)
    for i in range(n):
        assert on.logps[i] == pytest.approx(_direct(model, view.prompt(i), view.completion(i)), abs=1e-10)
        assert on.logps[n + i] == pytest.approx(_direct(model, view.prompt(i), view.completion(partners[i])),
                                                abs=1e-10)
