"""The CUDA ``varlen`` attention path on CPU: flattening, cu_seqlens, GQA and window logic, with a stand-in kernel.

torch's flash varlen kernel runs only on CUDA in half precision. Here a fake kernel with its exact signature
records what the wrapper hands it ([T, H, D] tensors, int32 cu_seqlens, max lengths, the (left, right) window,
GQA by ``enable_gqa`` or by repeated heads as torch 2.11 needs) and computes it with the per-sequence reference;
values and gradients must equal transformers' sdpa with its block mask, in float64.
"""

from __future__ import annotations

import pytest
import torch
from test_packing import _value_and_grads, collate_packed, make_model, random_pairs

from prefpack.model import sequence_logps
from prefpack.model.attention import varlen as va


def test_sequence_bounds_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    cu, longest = va.sequence_bounds(pos)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 10] and longest == 4
    rows = torch.tensor([[0, 1, 2], [3, 4, 5]])  # a row start is a boundary even where positions continue
    assert va.sequence_bounds(rows)[0].tolist() == [0, 3, 6]


class FakeKernel:
    """torch.nn.attention.varlen.varlen_attn's contract, computed by the reference; records every call."""

    def __init__(self, has_gqa: bool):
        self.has_gqa = has_gqa
        self.calls = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert q.ndim == k.ndim == v.ndim == 3 and q.shape[0] == int(cu_q[-1]) and k.shape[0] == v.shape[0] == int(
            cu_k[-1])
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.numel() == cu_k.numel()
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
        if k.shape[0] == q.shape[0]:  # keys not gathered (no prompt groups): the very same boundaries
            assert cu_q is cu_k and max_q == max_k
        assert window_size[1] == 0  # causal
        if k.shape[1] != q.shape[1]:
            assert enable_gqa and self.has_gqa
        self.calls.append({"heads": (q.shape[1], k.shape[1]), "window": window_size, "gqa": enable_gqa,
                           "cu": cu_q, "cu_k": cu_k, "max": (max_q, max_k), "k": k, "v": v})
        window = None if window_size[0] < 0 else window_size[0] + 1
        return va.reference_varlen(q, k, v, cu_q, scale=scale, window=window, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("has_gqa", [True, False], ids=["torch-2.13-gqa", "torch-2.11-repeat"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_varlen_equals_sdpa_values_and_grads(kind, has_gqa, monkeypatch):
    """Packed rows (several rows, one-token blocks, row padding) through varlen equal sdpa in float64."""
    kernel = FakeKernel(has_gqa)
    monkeypatch.setattr(va, "_usable_kernel", lambda q: (kernel, has_gqa, True))
    va.register()
    pairs = random_pairs(7, seed=1)
    packed = collate_packed(pairs, [[0, 1, 2], [3], [4, 5, 6]], pad_to_multiple_of=8)
    v_sdpa, g_sdpa = _value_and_grads(make_model(kind, False, "sdpa"), packed, chunk_size=5)
    v_var, g_var = _value_and_grads(make_model(kind, False, "varlen"), packed, chunk_size=5)
    torch.testing.assert_close(v_var, v_sdpa, rtol=0, atol=1e-10)
    for name in g_sdpa:
        torch.testing.assert_close(g_var[name], g_sdpa[name], rtol=0, atol=1e-10, msg=name)
    assert kernel.calls, "the kernel was never called"
    # 4 query heads, 2 key/value heads: handed over as they are with enable_gqa, else repeated to 4
    assert {c["heads"] for c in kernel.calls} == ({(4, 2)} if has_gqa else {(4, 4)})
    assert all(c["gqa"] == has_gqa for c in kernel.calls)
    assert {c["window"] for c in kernel.calls} == {(-1, 0)}


def test_boundaries_are_computed_once_per_forward(monkeypatch):
    """sequence_logps computes cu_seqlens once on the host and every layer reuses the same tensor."""
    kernel = FakeKernel(True)
    monkeypatch.setattr(va, "_usable_kernel", lambda q: (kernel, True, True))
    calls = []
    real = va.sequence_bounds
    monkeypatch.setattr(va, "sequence_bounds", lambda pos: calls.append(pos.shape) or real(pos))
    va.register()
    model = make_model("llama", False, "varlen")
    pairs = random_pairs(5, seed=2)
    packed = collate_packed(pairs, [[0, 1], [2, 3, 4]], pad_to_multiple_of=8)
    with torch.no_grad():
        sequence_logps(model, packed, chunk_size=5)
    assert len(calls) == 1
    assert len(kernel.calls) == model.config.num_hidden_layers
    assert all(c["cu"] is kernel.calls[0]["cu"] for c in kernel.calls)
    expected = packed.position_ids[packed.token_mask]
    assert kernel.calls[0]["cu"].tolist() == va.sequence_bounds(expected[None])[0].tolist()


def test_varlen_under_autocast_hands_the_kernel_one_half_dtype(monkeypatch):
    """Under bfloat16 autocast rotary embeddings promote q and k to float32; the kernel needs one half dtype."""
    seen = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen.append({q.dtype, k.dtype, v.dtype})
        return va.reference_varlen(q, k, v, cu_q, scale=scale)

    monkeypatch.setattr(va, "_usable_kernel", lambda q: (kernel, True, True))
    va.register()
    model = make_model("llama", False, "varlen").float()
    pairs = random_pairs(4, seed=3)
    packed = collate_packed(pairs, [[0, 1, 2, 3]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = sequence_logps(model, packed, chunk_size=5).logp_sum
    assert seen and all(s == {torch.bfloat16} for s in seen)
    assert torch.isfinite(out).all()


def test_padded_batches_and_float32_use_the_correct_fallbacks():
    """A padding mask goes to sdpa; float32 on CPU uses the reference kernel; both equal sdpa."""
    va.register()
    pairs = random_pairs(5, seed=4)
    packed = collate_packed(pairs, [[0, 1], [2, 3, 4]], pad_to_multiple_of=8)
    ref = make_model("llama", False, "sdpa")
    model = make_model("llama", False, "varlen")
    ids = packed.input_ids[:2]
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        for kw in ({"attention_mask": mask}, {"position_ids": packed.position_ids[:2]}):
            a = model.model(input_ids=ids, use_cache=False, **kw).last_hidden_state
            b = ref.model(input_ids=ids, use_cache=False, **kw).last_hidden_state
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_cuda_auto_attention_choice(monkeypatch):
    from prefpack.model import pick_attention

    cuda = torch.device("cuda")
    assert pick_attention("auto", cuda, torch.bfloat16) == "varlen"
    assert pick_attention("auto", cuda, torch.float32) == "sdpa"  # the flash kernel has no float32
    assert pick_attention("auto", torch.device("cpu"), torch.bfloat16) == "packed_sdpa"
    assert pick_attention("eager", cuda, torch.bfloat16) == "eager"
    monkeypatch.setattr(va, "torch_varlen_kernel", lambda: None)  # a torch without the kernel
    assert pick_attention("auto", cuda, torch.bfloat16) == "sdpa"
