"""Chunked completion-only log-probs against naive full-logits log_softmax, and the model plumbing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from prefpack.model.head import body_and_head, head_spec
from prefpack.model.logprobs import completion_logprobs, segment_sum

V, H = 37, 6


def naive(h, w, b, t, scale=1.0, softcap=None):
    z = h @ w.t()
    if b is not None:
        z = z + b
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z.log_softmax(-1).gather(1, t[:, None]).squeeze(1)


def make(n, bias=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True) if bias else None
    t = torch.randint(0, V, (n,), generator=g)
    return h, w, b, t


def grads(out, params, seed=1):
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad((out * weights).sum(), [p for p in params if p is not None])


@pytest.mark.parametrize("chunk", [1, 3, 4, 10, 64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("transform", [(1.0, None), (0.5, None), (1.0, 2.5), (2.0, 3.0)])
def test_matches_naive_values_and_grads(chunk, bias, transform):
    scale, softcap = transform
    h, w, b, t = make(10, bias=bias)
    ours = completion_logprobs(h, t, w, b, chunk_size=chunk, scale=scale, softcap=softcap)
    ref = naive(h, w, b, t, scale, softcap)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for go, gr in zip(grads(ours, (h, w, b)), grads(ref, (h, w, b)), strict=True):
        torch.testing.assert_close(go, gr, rtol=1e-10, atol=1e-12)


def test_frozen_weight_only_h_grad():
    h, w, b, t = make(9)
    w.requires_grad_(False)
    b.requires_grad_(False)
    ours = completion_logprobs(h, t, w, b, chunk_size=4)
    (gh,) = torch.autograd.grad(ours.sum(), [h])
    (gr,) = torch.autograd.grad(naive(h, w, b, t).sum(), [h])
    torch.testing.assert_close(gh, gr, rtol=1e-10, atol=1e-12)


def test_empty():
    h, w, b, t = make(0)
    out = completion_logprobs(h, t, w, b, chunk_size=4)
    assert out.shape == (0,)
    s = segment_sum(out, torch.zeros(0, dtype=torch.long), 3)
    assert s.tolist() == [0.0, 0.0, 0.0]
    gh, gw, gb = torch.autograd.grad(s.sum(), [h, w, b], allow_unused=True)
    assert gh.shape == (0, H)
    assert torch.count_nonzero(gw) == 0 and torch.count_nonzero(gb) == 0


def test_bf16_logsumexp_in_float32():
    h, w, b, t = make(12, dtype=torch.float32)
    hb, wb, bb = (x.detach().bfloat16().requires_grad_() for x in (h, w, b))
    ours = completion_logprobs(hb, t, wb, bb, chunk_size=5)
    assert ours.dtype == torch.float32
    # Reference: the same bf16 logits, log-softmax in float64.
    z = (hb.detach() @ wb.detach().t() + bb.detach()).double()
    ref = z.log_softmax(-1).gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=1e-5)
    gh, gw, gb = torch.autograd.grad(ours.sum(), [hb, wb, bb])
    assert gh.dtype == gw.dtype == gb.dtype == torch.bfloat16
    rh, rw, rb = torch.autograd.grad(naive(h, w, b, t).sum(), [h, w, b])
    for a, r in ((gh, rh), (gw, rw), (gb, rb)):
        assert (a.float() - r).abs().max() <= 0.05 * r.abs().max() + 1e-3


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_never_materialises_more_than_chunk_logits():
    n, chunk = 96, 4
    h, w, b, t = make(n)
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    with _MaxNumel() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = completion_logprobs(h, t, w, b, chunk_size=chunk)
        out.sum().backward()
    bound = max(chunk * V, V * H, n * H)
    assert n * V > 4 * bound  # the bound is meaningful: full logits would break it
    assert mode.largest <= bound, mode.largest
    assert max(saved) <= max(V * H, n * H)  # no logits saved through autograd (one chunk is kept: below)

    # The check has teeth: the naive path does allocate the full logits.
    with _MaxNumel() as mode:
        naive(h, w, b, t).sum().backward()
    assert mode.largest >= n * V


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_backward_reuses_the_last_chunk_kept_by_forward():
    """Forward keeps its last chunk's logits: backward recomputes the logits of every chunk but that one (chunks of
    equal size, so the kept one is as large as any), and gives bitwise the same gradients on a second backward
    (retain_graph), when nothing is kept any more."""
    n, chunk = 10, 4  # three chunks: 4, 3, 3
    h, w, b, t = make(n)
    out = completion_logprobs(h, t, w, b, chunk_size=chunk)
    weights = torch.randn(n, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    with _CountMatmuls() as mode:
        first = torch.autograd.grad((out * weights).sum(), [h, w, b], retain_graph=True)
    assert mode.count == 3 * 3 - 1  # per chunk grad_h and grad_w, plus logits for the two chunks not kept
    with _CountMatmuls() as mode:
        second = torch.autograd.grad((out * weights).sum(), [h, w, b])
    assert mode.count == 3 * 3  # nothing kept any more: every chunk recomputed
    ref = torch.autograd.grad((naive(h, w, b, t) * weights).sum(), [h, w, b])
    for a, c, r in zip(first, second, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(c, r, rtol=1e-10, atol=1e-12)
    # the kept chunk goes through the same ops as a recomputed one: its gradients are bitwise those of a run that
    # kept nothing (the same chunks recomputed after a no-grad forward gave these values), so which chunk a
    # micro-batch happens to keep cannot change a run
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)
    # without grad (the reference model's forward) nothing is kept; a softcapped head keeps its chunk too
    with torch.no_grad(), _CountMatmuls() as mode:
        completion_logprobs(h, t, w, b, chunk_size=chunk)
    assert mode.count == 3
    capped = completion_logprobs(h, t, w, b, chunk_size=chunk, softcap=2.0)
    with _CountMatmuls() as mode:
        got = torch.autograd.grad(capped.sum(), [h, w, b])
    assert mode.count == 3 * 3 - 1
    ref = torch.autograd.grad(naive(h, w, b, t, softcap=2.0).sum(), [h, w, b])
    for a, r in zip(got, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_segment_sum_grad():
    v = torch.arange(6, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 2, 2, 1, 0, 2])
    s = segment_sum(v, idx, 4)
    assert s.tolist() == [4.0, 3.0, 8.0, 0.0]
    (g,) = torch.autograd.grad((s * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)).sum(), [v])
    assert g.tolist() == [1.0, 3.0, 3.0, 2.0, 1.0, 3.0]


def test_validation():
    h, w, b, t = make(4)
    with pytest.raises(ValueError):
        completion_logprobs(h, t, w, b, chunk_size=0)
    with pytest.raises(ValueError):
        completion_logprobs(h, t[:3], w, b)
    with pytest.raises(ValueError):
        completion_logprobs(h[:, :3], t, w, b)


# --------------------------------------------------------------------------------------------------------
# Model plumbing


def _llama(tied=False, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        **kw,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_body_and_head_llama(tied):
    from prefpack.model import check_against_model

    model = _llama(tied)
    body, head = body_and_head(model)
    assert body is model.model and head is model.lm_head
    assert (head.weight is model.model.embed_tokens.weight) == tied
    assert check_against_model(model) < 1e-5


def test_body_and_head_gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from prefpack.model import check_against_model

    cfg = GPTNeoXConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    model = GPTNeoXForCausalLM(cfg).eval()
    body, head = body_and_head(model)
    assert body is model.gpt_neox and head is model.get_output_embeddings()
    assert check_against_model(model) < 1e-5


def test_head_transforms_match_model():
    """Gemma-2 soft-capping and Granite logit scaling reproduce the model's own log-probs."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM

    from prefpack.model import check_against_model

    small = dict(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(
        Gemma2Config(**small, num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.5)
    )
    assert head_spec(gemma).softcap == 0.5
    assert check_against_model(gemma.eval()) < 1e-5
    granite = GraniteForCausalLM(GraniteConfig(**small, logits_scaling=4.0))
    assert head_spec(granite).scale == 0.25
    assert check_against_model(granite.eval()) < 1e-5
    # The check has teeth: if head_spec forgot the soft-cap, check_against_model would see it.
    import prefpack.model.checks as fwd

    real = fwd.head_spec
    fwd.head_spec = lambda m: dataclasses.replace(real(m), softcap=None)
    try:
        assert check_against_model(gemma) > 1e-2
    finally:
        fwd.head_spec = real


def test_body_and_head_errors():
    model = _llama()
    with pytest.raises(TypeError, match="output embedding"):
        body_and_head(model.model)  # a bare body has no head

    class Adapted(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base
            self.weight = base.weight

    model.lm_head = Adapted(model.lm_head)
    with pytest.raises(NotImplementedError, match="adapter"):
        body_and_head(model)

    class NoBody(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(4, 10)

        def get_output_embeddings(self):
            return self.lm_head

    with pytest.raises(TypeError, match="decoder body"):
        body_and_head(NoBody())


def test_mixed_dtypes_and_autocast():
    """bf16 hidden states with an fp32 head (autocast training) must not crash in backward."""
    h, w, b, t = make(11, dtype=torch.float32)
    hb = h.detach().bfloat16().requires_grad_()
    out = completion_logprobs(hb, t, w, b, chunk_size=4)  # no autocast: matmul in float32
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, naive(hb.detach().float(), w, b, t), rtol=1e-5, atol=1e-5)
    gh, gw, gb = torch.autograd.grad(out.sum(), [hb, w, b])
    assert (gh.dtype, gw.dtype, gb.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = completion_logprobs(h, t, w, b, chunk_size=4)
    assert out.dtype == torch.float32
    gh, gw, gb = torch.autograd.grad(out.sum(), [h, w, b])
    rh, rw, rb = torch.autograd.grad(naive(h, w, b, t).sum(), [h, w, b])
    assert (gh.dtype, gw.dtype) == (torch.float32, torch.float32)
    for a, r in ((gh, rh), (gw, rw), (gb, rb)):
        assert (a - r).abs().max() <= 0.05 * r.abs().max() + 1e-3


def test_chunk_rows_caps_logits_per_chunk():
    from prefpack.model.logprobs import chunk_rows

    assert chunk_rows(1024, 32768, 1 << 25) == 1024
    assert chunk_rows(1024, 151936, 1 << 25) == 220
    assert chunk_rows(1024, 10**9, 1 << 25) == 1
    n = 50
    h, w, b, t = make(n)
    with _MaxNumel() as mode:
        out = completion_logprobs(h, t, w, b, chunk_size=1024, max_chunk_elements=3 * V)
        out.sum().backward()
    assert mode.largest <= max(3 * V, V * H, n * H), mode.largest
    torch.testing.assert_close(out, naive(h, w, b, t), rtol=1e-12, atol=1e-12)
