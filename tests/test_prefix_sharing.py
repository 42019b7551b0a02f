"""Prompt groups laid out once (issue 13, first step: the CPU kernel and the forward).

A group's prompt is laid out once, then each completion with position ids continuing from the prompt's length;
each completion attends to the prompt and to itself, never to a sibling, and the first token of every completion
is scored from the prompt's last position. Per-sequence log-probs and gradients must equal the unshared layout
(each completion after its own copy of the prompt) in float64, for pairs, a 4-completion group and a
sliding-window model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_packing import VOCAB, make_model, random_pairs

from prefpack.batching.collate import collate_groups, collate_packed
from prefpack.model import sequence_logps


def _outputs(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    out = sequence_logps(model, batch, chunk_size=5, **kw)
    parts = [out.logp_sum] + [x for x in (out.tail_sum, out.wpo_mean) if x is not None]
    weights = torch.linspace(0.5, 1.5, out.logp_sum.numel(), dtype=out.logp_sum.dtype)
    (out.logp_sum * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [x.detach() for x in parts], out.n_tokens, grads


def _assert_same(a, b, grad_tol=2e-6):
    (va, na, ga), (vb, nb, gb) = a, b
    assert torch.equal(na, nb)
    for x, y in zip(va, vb, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-10)
    assert ga.keys() == gb.keys()
    # Gradients to float32 accuracy: transformers' RMSNorm computes in float32 even for a float64 model, so its
    # backward rounds the gradient reaching a shared prompt (the sum of its completions' gradients) once, where the
    # unshared layout rounds each copy's part and sums afterwards (measured: 3.7e-7 on weights of gradient ~6).
    # GPT-NeoX (LayerNorm in the model's dtype) shows the layouts agree to float64 accuracy: grad_tol=1e-10.
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=min(grad_tol, 1e-6), atol=grad_tol, msg=name)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("multiple", [None, 16])
def test_shared_pairs_equal_unshared(kind, multiple):
    pairs = random_pairs(7, seed=5)
    rows = [[0, 1, 2], [3], [4, 5, 6]]
    model = make_model(kind, False, "packed_sdpa")
    plain = collate_packed(pairs, rows, pad_to_multiple_of=multiple)
    shared = collate_packed(pairs, rows, pad_to_multiple_of=multiple, share_prompts=True)
    assert shared.real_tokens == plain.real_tokens  # tokens count every sequence's prompt, as before
    saved = sum(len(pairs[i].prompt) for i in range(7))
    assert shared.positions == plain.positions - saved and shared.shared_tokens == saved
    _assert_same(_outputs(model, shared, pair_tails=True, wpo=True), _outputs(model, plain, pair_tails=True, wpo=True),
                 grad_tol=1e-10 if kind == "gpt_neox" else 2e-6)


def test_a_four_completion_group_equals_four_unshared_sequences():
    rng = np.random.default_rng(2)
    groups = [(rng.integers(1, VOCAB, n), [rng.integers(1, VOCAB, m) for m in ms])
              for n, ms in ((9, (4, 1, 7, 3)), (1, (5, 2)), (6, (2, 8, 1, 4)))]
    model = make_model("llama", False, "packed_sdpa")
    rows = [[0], [1, 2]]
    shared = collate_groups(groups, rows, ids=[10, 11, 12], share_prompts=True)
    plain = collate_groups(groups, rows, ids=[10, 11, 12])
    assert shared.num_sequences == plain.num_sequences == 10
    _assert_same(_outputs(model, shared), _outputs(model, plain))


def test_sliding_window_layers_see_the_same_keys_shared_or_not():
    import transformers as tf

    from prefpack.model.attention.packed_sdpa import register

    register()
    cfg = tf.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    cfg._attn_implementation = "packed_sdpa"
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg).double().eval()
    pairs = random_pairs(5, seed=8)
    rows = [[0, 1], [2, 3, 4]]
    _assert_same(_outputs(model, collate_packed(pairs, rows, share_prompts=True)),
                 _outputs(model, collate_packed(pairs, rows)))


def test_siblings_do_not_see_each_other():
    """Changing the chosen completion must not move the rejected one's log-probs (and the reverse)."""
    pairs = random_pairs(3, seed=1)
    model = make_model("llama", False, "packed_sdpa")
    base = sequence_logps(model, collate_packed(pairs, [[0, 1, 2]], share_prompts=True)).logp_sum
    changed = list(pairs)
    p = changed[1]
    changed[1] = type(p)(p.prompt, (p.chosen + 7) % VOCAB, p.rejected)
    moved = sequence_logps(model, collate_packed(changed, [[0, 1, 2]], share_prompts=True)).logp_sum
    same = [i for i in range(6) if i != 2]  # sequence 2 is pair 1's chosen
    torch.testing.assert_close(moved[same], base[same], rtol=0, atol=0)
    assert not torch.allclose(moved[2], base[2])


def test_flattening_kernels_refuse_shared_rows():
    pairs = random_pairs(2, seed=0)
    model = make_model("llama", False, "packed_sdpa")
    with pytest.raises(ValueError, match="prompt-shared"):
        sequence_logps(model, collate_packed(pairs, [[0, 1]], share_prompts=True), flatten=True)
    with pytest.raises(ValueError, match="packed layout"):
        collate_groups([(pairs[0].prompt, (pairs[0].chosen,))], None, ids=[0], share_prompts=True)


def _train_metrics(tmp_path, model, store, name, *extra, log=None):
    import json

    from prefpack.config import load_config
    from prefpack.training import train

    cfg = load_config(None, [f"model.name_or_path={model}", f"data.train={store}", "train.global_batch_pairs=4",
                             "train.max_steps=3", "train.device=cpu", "optim.lr=1e-2", "train.micro_batch_tokens=256",
                             f"run.output_dir={tmp_path / name}", "run.plot=false", "run.tensorboard=false", *extra])
    train(cfg, progress=False, log=log or (lambda m: None))
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_training_with_prefix_sharing_equals_training_without(tmp_path, toy_tokenizers, hh_train, one_thread):
    """Three DPO steps through `train()`: same losses and tokens; positions fall by the prompt tokens laid out once."""
    from conftest import prepare_hh_splits, tiny_llama

    from prefpack.data.store import Store

    stores = prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 12})
    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "model", seed=0)
    plain = _train_metrics(tmp_path, model, stores["train"], "plain", "data.prefix_sharing=false")
    shared = _train_metrics(tmp_path, model, stores["train"], "shared")  # auto: on for pairs on packed_sdpa
    lengths = Store(stores["train"]).index[:, 1:4].astype(int)
    assert sum(r["tokens"] for r in shared) == sum(r["tokens"] for r in plain) == int(
        (2 * lengths[:, 0] + lengths[:, 1] + lengths[:, 2]).sum())
    assert sum(r["positions"] for r in plain) == sum(r["tokens"] for r in plain)
    assert sum(r["positions"] for r in shared) == int(lengths.sum())  # each prompt once
    assert [r["loss"] for r in shared] == pytest.approx([r["loss"] for r in plain], abs=2e-5)
    assert plain[-1]["loss"] != plain[0]["loss"]
    assert all(0 < r["filling"] <= 1 for r in shared)


def test_prefix_sharing_refuses_kernels_and_layouts_it_does_not_serve(tmp_path, toy_tokenizers, hh_train):
    from conftest import prepare_hh_splits, tiny_llama

    from prefpack.model import ModelError

    stores = prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 4})
    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "model", seed=0)
    with pytest.raises(ModelError, match="packed_sdpa"):
        _train_metrics(tmp_path, model, stores["train"], "sdpa", "data.prefix_sharing=true",
                       "model.attn_implementation=sdpa")
    with pytest.raises(ModelError, match="packed rows"):
        _train_metrics(tmp_path, model, stores["train"], "padded", "data.prefix_sharing=true", "data.packing=false")
    # KTO is served (its examples by prompt group, tests/test_kto_sharing.py): true trains with prompts laid out once
    (row,) = _train_metrics(tmp_path, model, stores["train"], "kto", "data.prefix_sharing=true", "train.max_steps=1",
                            "loss.terms=[{name: kto}]", "data.paired_as_kto=true")
    assert row["positions"] < row["tokens"]


def test_auto_shares_prompts_only_where_it_can(tmp_path, toy_tokenizers, hh_train):
    from conftest import prepare_hh_splits, tiny_llama

    stores = prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 4})
    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "model", seed=0)
    for name, extra, on in (("pairs", [], True), ("sdpa", ["model.attn_implementation=sdpa"], False),
                            ("kto", ["loss.terms=[{name: kto}]", "data.paired_as_kto=true"], True),
                            ("padded", ["data.packing=false"], False)):
        logged = []
        rows = _train_metrics(tmp_path, model, stores["train"], name, "train.max_steps=1", *extra, log=logged.append)
        assert any("laid out once" in m for m in logged) == on, name
        assert (rows[0]["positions"] < rows[0]["tokens"]) == on, name


def test_the_layers_of_one_forward_share_each_prompt_groups_mask(monkeypatch):
    """sdpa keeps its mask for backward: built once per forward (keyed on the position ids every layer receives),
    a prompt group's mask is held once, not once per layer; new position ids build their own."""
    from prefpack.model.attention import packed_sdpa as ps

    built = []
    make = ps._prefix_mask
    monkeypatch.setattr(ps, "_prefix_mask", lambda *a, **k: built.append(a[:2]) or make(*a, **k))
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 0, 1]])  # a group (prompt 5, two completions), then 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 12, 8, generator=g) for h in (4, 2, 2))
    outs = [ps.packed_sdpa_attention(None, q, k, v, None, position_ids=position_ids)[0] for _layer in range(3)]
    assert built == [(5, 3)]  # the second completion's mask, once for three layers
    assert all(torch.equal(o, outs[0]) for o in outs)
    ps.packed_sdpa_attention(None, q, k, v, None, position_ids=position_ids.clone())  # the next forward
    assert built == [(5, 3), (5, 3)]
    # the shared mask is the definition: the completion sees the prompt and itself causally, never its sibling
    mask = make(5, 3, None, torch.device("cpu"))
    assert torch.equal(mask == 0, torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0],
                                                [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool))


@pytest.mark.parametrize("window", [None, 3, 40])
def test_a_prompt_groups_mask_is_built_in_its_own_memory(window):
    """The mask equals the position-difference rule (written out here), and building it allocates about the mask
    itself: a difference matrix (int64) and boolean copies held 2.5x more on every sequence-parallel rank."""
    from torch.profiler import profile

    from prefpack.model.attention.packed_sdpa import _prefix_mask

    prefix, length = 300, 200
    q_pos, k_pos = np.arange(prefix, prefix + length)[:, None], np.arange(prefix + length)[None, :]
    seen = (q_pos >= k_pos) & (True if window is None else (q_pos - k_pos < window))
    with profile(profile_memory=True) as prof:
        mask = _prefix_mask(prefix, length, window, torch.device("cpu"))
    assert torch.equal(mask, torch.from_numpy(np.where(seen, 0.0, -np.inf)).float())
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())
    assert allocated <= (2 if window else 1) * mask.numel() * 4 + 4096, allocated
