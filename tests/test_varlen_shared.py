"""Prompt-shared rows on the CUDA ``varlen`` path, on CPU: the key gather, the bottom-right causal alignment, the
sibling leak guard.

A flattened row keeps its queries; a later completion of a prompt group (a block whose position ids start at p > 0)
gets as keys the first p tokens of its row's last block starting at 0, then its own (``varlen.group_bounds``). The
fake kernel below has torch's ``varlen_attn`` signature and computes with ``reference_varlen``, which aligns the
causal mask bottom-right as the flash kernel does; per-sequence log-probs and gradients in float64 must equal the
unshared layout run through transformers' sdpa (its own block mask, none of this code).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_packing import VOCAB, make_model, random_pairs
from test_prefix_sharing import _assert_same, _outputs
from test_varlen import FakeKernel

from prefpack.batching.collate import collate_groups, collate_packed
from prefpack.model import PACKING_LEAK_TOLERANCE, ModelError, load_causal_lm, packing_leak
from prefpack.model.attention import varlen as va
from prefpack.model.checks import sibling_leak
from prefpack.model.forward import _boundary_kwargs, reads_prompt_groups

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only contend on shared cores


@pytest.fixture
def kernel(monkeypatch):
    """The fake torch kernel (torch 2.13's contract, enable_gqa) in place of the CUDA one."""
    fake = FakeKernel(has_gqa=True)
    monkeypatch.setattr(va, "_usable_kernel", lambda q: (fake, True, True))
    va.register()
    return fake


# group A: prompt 3 + c1 2 | c2 2; a plain sequence of 3; group B: prompt 2 + c1 1 | c2 3 | c3 1
ROW = [0, 1, 2, 3, 4, 3, 4, 0, 1, 2, 0, 1, 2, 2, 3, 4, 2]


def test_group_bounds_of_a_hand_built_row():
    b = va.group_bounds(torch.tensor([ROW]))
    assert b.cu_q.tolist() == [0, 5, 7, 10, 13, 16, 17] and b.max_q == 5
    assert b.cu_q.dtype == b.cu_k.dtype == torch.int32 and b.key_index.dtype == torch.int64
    assert b.cu_k.tolist() == [0, 5, 10, 13, 16, 21, 24] and b.max_k == 5
    assert b.key_index.tolist() == [0, 1, 2, 3, 4,  0, 1, 2, 5, 6,  7, 8, 9,  10, 11, 12,  10, 11, 13, 14, 15,
                                    10, 11, 16]
    plain = va.group_bounds(torch.tensor([[0, 1, 2, 0, 1]]))
    assert plain.key_index is None and plain.cu_k is plain.cu_q and plain.max_k == plain.max_q == 3
    # rows are read one after the other; a block starting at p > 0 with no prompt before it in ITS row (row 2
    # starts at 2), or one reading more prompt than its root block holds (the last one), reads nothing: plain causal
    rows = va.group_bounds(torch.tensor([[0, 1, 2, 3, 2, 3], [2, 3, 0, 1, 5, 6]]))
    assert rows.cu_q.tolist() == [0, 4, 6, 8, 10, 12]
    assert rows.key_index.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11]
    assert rows.cu_k.tolist() == [0, 4, 8, 10, 12, 14]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("has_gqa", [True, False], ids=["torch-2.13-gqa", "torch-2.11-repeat"])
def test_the_kernel_gets_gathered_keys_and_computes_each_completion_after_its_prompt(window, has_gqa, monkeypatch):
    """One attention call on the hand-built row: the kernel receives cu_seq_k != cu_seq_q and the keys at the
    gather index; every completion's output equals causal attention over its own copy ``prompt + completion``."""
    fake = FakeKernel(has_gqa)
    monkeypatch.setattr(va, "_usable_kernel", lambda q: (fake, has_gqa, True))
    g = torch.Generator().manual_seed(0)
    n = len(ROW)
    query, key, value = (torch.randn(1, h, n, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    position_ids = torch.tensor([ROW])
    module = torch.nn.Module()
    extra = {"sliding_window": window}
    computed = va.varlen_attention(module, query, key, value, None, position_ids=position_ids, **extra)[0][0]
    given = va.varlen_attention(module, query, key, value, None, position_ids=position_ids,
                                **_boundary_kwargs(position_ids[0], torch.device("cpu")), **extra)[0][0]
    torch.testing.assert_close(given, computed, rtol=0, atol=0)  # host keywords = derived from position ids
    index = [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 10, 11, 13, 14, 15, 10, 11, 16]
    for call in fake.calls:
        assert call["cu"].tolist() == [0, 5, 7, 10, 13, 16, 17] and call["cu_k"].tolist() == [
            0, 5, 10, 13, 16, 21, 24] and call["max"] == (5, 5)
        k = key[0].transpose(0, 1)[index]  # [T_k, Hkv, D]
        if not has_gqa:  # torch 2.11: heads repeated after the gather
            k = k.repeat_interleave(2, dim=1)
        torch.testing.assert_close(call["k"], k, rtol=0, atol=0)
        assert call["window"] == (-1 if window is None else window - 1, 0)
    # (prompt span, completion span) of every sequence, as laid out alone
    alone = [((0, 3), (3, 5)), ((0, 3), (5, 7)), ((7, 7), (7, 10)), ((10, 12), (12, 13)), ((10, 12), (13, 16)),
             ((10, 12), (16, 17))]
    for (ps, pe), (cs, ce) in alone:
        rows = torch.cat([torch.arange(ps, pe), torch.arange(cs, ce)])
        q, k, v = (t[0, :, rows][None] for t in (query, key, value))
        d = torch.arange(len(rows))[:, None] - torch.arange(len(rows))[None]
        mask = (d >= 0) if window is None else (d >= 0) & (d < window)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(computed[cs:ce], want[pe - ps:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_shared_rows_on_varlen_equal_unshared_sdpa(kind, kernel):
    """Pairs and a row padded to a multiple, flattened through varlen with prompts laid out once = each sequence
    after its own prompt under sdpa's block mask, in float64 (values, LD-DPO tails, WPO means, gradients)."""
    pairs = random_pairs(7, seed=5)
    rows = [[0, 1, 2], [3], [4, 5, 6]]
    shared = collate_packed(pairs, rows, pad_to_multiple_of=16, share_prompts=True)
    plain = collate_packed(pairs, rows, pad_to_multiple_of=16)
    got = _outputs(make_model(kind, False, "varlen"), shared, pair_tails=True, wpo=True)
    assert kernel.calls and any(c["k"].shape[0] > c["cu"][-1] for c in kernel.calls)  # keys were gathered
    _assert_same(got, _outputs(make_model(kind, False, "sdpa"), plain, pair_tails=True, wpo=True))


def _masked(pairs, seed):
    """The pairs with some completion tokens unscored (issue 23's spans), a first and a last token among them."""
    from prefpack.data.spans import ScoredTokens
    from prefpack.data.store import Pair

    rng = np.random.default_rng(seed)

    def mask(c):
        scored = rng.random(len(c)) > 0.35
        scored[rng.integers(len(c))] = True  # at least one scored token
        return ScoredTokens(c, scored)

    return [Pair(p.prompt, mask(p.chosen), mask(p.rejected)) for p in pairs]


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
def test_rows_with_unscored_spans_on_varlen_equal_sdpa(share, kernel):
    """Unscored completion tokens on the varlen path (flattened rows, prompts once or not): per-sequence sums over
    the scored tokens, their counts, LD-DPO tails, WPO means and gradients equal sdpa's unshared layout in float64.
    On CPU the fake kernel stands in for CUDA's; the GPU run of this path is still to be done."""
    pairs = _masked(random_pairs(7, seed=8), seed=1)
    rows = [[0, 1, 2], [3], [4, 5, 6]]
    batch = collate_packed(pairs, rows, pad_to_multiple_of=16, share_prompts=share)
    plain = collate_packed(pairs, rows, pad_to_multiple_of=16)
    scored = [int(np.asarray(c.scored).sum()) for p in pairs for c in (p.chosen, p.rejected)]
    assert plain.completion_tokens.tolist() == scored and sum(scored) < sum(len(c) for p in pairs for c in p[1:])
    got = _outputs(make_model("llama", False, "varlen"), batch, pair_tails=True, wpo=True)
    assert kernel.calls
    _assert_same(got, _outputs(make_model("llama", False, "sdpa"), plain, pair_tails=True, wpo=True))


def test_a_four_completion_group_and_unflattened_rows_on_varlen(kernel):
    """Groups of 4 and 2 completions; also with flatten=False (the kernel derives the groups per row)."""
    rng = torch.Generator().manual_seed(2)
    groups = [(torch.randint(1, VOCAB, (n,), generator=rng).numpy(),
               [torch.randint(1, VOCAB, (m,), generator=rng).numpy() for m in ms])
              for n, ms in ((9, (4, 1, 7, 3)), (1, (5, 2)), (6, (2, 8, 1, 4)))]
    rows = [[0], [1, 2]]
    shared = collate_groups(groups, rows, ids=[10, 11, 12], share_prompts=True)
    want = _outputs(make_model("llama", False, "sdpa"), collate_groups(groups, rows, ids=[10, 11, 12]))
    model = make_model("llama", False, "varlen")
    _assert_same(_outputs(model, shared), want)
    _assert_same(_outputs(model, shared, flatten=False), want)


def test_sliding_window_shared_rows_on_varlen(kernel):
    """Mistral, window 4 (shorter than most prompt + completion): the window counts back from the bottom-right
    diagonal, so a completion sees exactly the keys it sees after its own prompt."""
    import transformers as tf

    cfg = tf.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg).double().eval()
    pairs = random_pairs(5, seed=8)
    rows = [[0, 1], [2, 3, 4]]
    model.set_attn_implementation("sdpa")
    want = _outputs(model, collate_packed(pairs, rows))
    model.set_attn_implementation("varlen")
    _assert_same(_outputs(model, collate_packed(pairs, rows, share_prompts=True)), want)
    assert {c["window"] for c in kernel.calls} == {(3, 0)}


def _leaky_bounds(position_ids, real=va.group_bounds):
    """A wrong gather: a later completion reads everything from its prompt's start, its siblings included."""
    b = real(position_ids)
    if b.key_index is None:
        return b
    pos = position_ids.reshape(-1).tolist()
    runs, root = [], 0
    for s, e in zip(b.cu_q[:-1].tolist(), b.cu_q[1:].tolist()):
        root = s if pos[s] == 0 else root
        runs.append(torch.arange(root if pos[s] else s, e))
    lengths = torch.tensor([len(r) for r in runs])
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    return va.GroupBounds(b.cu_q, cu_k, b.max_q, int(lengths.max()), torch.cat(runs))


@pytest.mark.parametrize("attn", ["varlen", "packed_sdpa", "sdpa"])
def test_the_kernels_that_read_prompt_groups_keep_siblings_apart(attn, kernel):
    model = make_model("qwen2", False, attn)
    assert reads_prompt_groups(model) == (attn != "sdpa")
    assert packing_leak(model) == 0.0 and sibling_leak(model) == 0.0


def test_the_leak_guard_flags_siblings_that_see_each_other(tmp_path, kernel, monkeypatch):
    import transformers as tf

    model = make_model("llama", False, "varlen")
    monkeypatch.setattr(va, "group_bounds", _leaky_bounds)
    assert packing_leak(model, siblings=False) == 0.0  # separate sequences stay apart: only siblings leak
    assert sibling_leak(model) > PACKING_LEAK_TOLERANCE and packing_leak(model) == sibling_leak(model)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    with pytest.raises(ModelError, match=r"completions of a prompt group attend to each other.*prefix_sharing=false"):
        load_causal_lm(str(tmp_path / "llama"), dtype=torch.float32, attn_implementation="varlen",
                       device=torch.device("cpu"))


@pytest.mark.parametrize("flatten", [True, False])
def test_kernels_that_do_not_read_prompt_groups_refuse_shared_rows(flatten):
    """sdpa (flattened as flash-attn is, or not) would run a later completion without its prompt: refused."""
    pairs = random_pairs(2, seed=0)
    model = make_model("llama", False, "sdpa")
    with pytest.raises(ValueError, match=r"prompt-shared rows run on the packed_sdpa and varlen kernels.*\(sdpa"):
        _outputs(model, collate_packed(pairs, [[0, 1]], share_prompts=True), flatten=flatten)


@torch.library.custom_op("prefpack_test::varlen_reference", mutates_args=())
def _traced_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   max_q: int, max_k: int, left: int) -> torch.Tensor:
    """The reference as one opaque op, as torch's kernel is one: a compiled layer traces it without a break."""
    return va.reference_varlen(q, k, v, cu_q, window=None if left < 0 else left + 1, cu_seqlens_k=cu_k)


@_traced_kernel.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, left):
    return torch.empty_like(q)


def test_a_compiled_layer_traces_shared_rows_once(monkeypatch):
    """Two shared micro-batches of different lengths through compiled layers (aot_eager): one graph for both
    (the key index is a tensor input, the maximum lengths symbolic ints), the eager values."""
    from prefpack.model import sequence_logps
    from prefpack.model.compile import compile_decoder_layers

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        return _traced_kernel(q, k, v, cu_q, cu_k, max_q, max_k, window_size[0])

    monkeypatch.setattr(va, "_usable_kernel", lambda q: (kernel, False, True))
    va.register()
    torch._dynamo.reset()
    try:
        model, eager = make_model("llama", False, "varlen"), make_model("llama", False, "varlen")
        compile_decoder_layers(model, backend="aot_eager")
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the counter is process-wide
        for seed, rows in ((3, [[0, 1, 2], [3], [4, 5, 6]]), (4, [[0, 1], [2, 3, 4, 5, 6]])):
            batch = collate_packed(random_pairs(7, seed=seed), rows, pad_to_multiple_of=8, share_prompts=True)
            with torch.no_grad():
                got, want = (sequence_logps(m, batch, chunk_size=5).logp_sum for m in (model, eager))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    finally:
        torch._dynamo.reset()


def test_training_on_varlen_with_prefix_sharing_equals_training_without(tmp_path, toy_tokenizers, hh_train):
    """`data.prefix_sharing=true` runs on varlen (and auto turns it on there, measured faster on an H100): three DPO
    steps, same losses and tokens, each prompt computed once."""
    from conftest import prepare_hh_splits, tiny_llama
    from test_prefix_sharing import _train_metrics

    stores = prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 12})
    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "model", seed=0)
    runs = {}
    for setting in ("true", "false", "auto"):
        logged = []
        runs[setting] = _train_metrics(tmp_path, model, stores["train"], setting, "model.attn_implementation=varlen",
                                       f"data.prefix_sharing={setting}", log=logged.append)
        assert any("laid out once" in m for m in logged) == (setting != "false"), setting
    shared, plain = runs["true"], runs["false"]
    assert [r["loss"] for r in shared] == pytest.approx([r["loss"] for r in plain], abs=2e-5)
    assert [r["tokens"] for r in shared] == [r["tokens"] for r in plain]
    assert sum(r["positions"] for r in shared) < sum(r["positions"] for r in plain) == sum(r["tokens"] for r in plain)
    assert [r["positions"] for r in runs["auto"]] == [r["positions"] for r in shared]
    assert plain[-1]["loss"] != plain[0]["loss"]
