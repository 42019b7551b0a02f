"""What only a GPU can show: torch's flash varlen kernel against the reference, in bfloat16 (prompt-shared rows
with gathered keys too), training with prompts laid out once on it, and device budgets.

Skipped without CUDA (CI has none). On a GPU machine: ``PREFPACK_TEST_CUDA=1 pytest tests/test_gpu.py`` (the
conftest hides CUDA from every other test so that CPU-exactness tests stay on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from prefpack.model.attention import varlen as va

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: PREFPACK_TEST_CUDA=1 on a GPU")


def _packed_qkv(lengths, heads=8, kv_heads=2, dim=64, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(total, kv_heads, dim, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(total, kv_heads, dim, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


@pytest.mark.parametrize("window", [None, 16])
def test_torch_varlen_kernel_equals_the_reference(window):
    assert va.torch_varlen_kernel() is not None, "this torch has no torch.nn.attention.varlen"
    lengths = [1, 37, 200, 64, 5]
    q, k, v, cu = _packed_qkv(lengths)
    out = va._run_kernel(q, k, v, cu, max(lengths), None, window)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = va.reference_varlen(q32, k32, v32, cu.cpu(), window=window)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q32, k32, v32))
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2)


def test_varlen_model_equals_sdpa_in_bfloat16():
    import transformers as tf

    va.register()
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).cuda().eval()
    position_ids = torch.cat([torch.arange(n) for n in (70, 3, 1, 150)])[None].cuda()
    ids = torch.randint(0, 300, position_ids.shape, device="cuda")
    out = {}
    for attn in ("sdpa", "varlen"):
        model.set_attn_implementation(attn)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out[attn] = model.model(input_ids=ids, position_ids=position_ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(out["varlen"].float(), out["sdpa"].float(), rtol=3e-2, atol=3e-2)


# group (prompt 100 + c1 37 | c2 50 | c3 1), a plain sequence of 64, group (prompt 5 + c1 200 | c2 3)
SHARED_ROW = [*range(137), *range(100, 150), 100, *range(64), *range(205), *range(5, 8)]


@pytest.mark.parametrize("window", [None, 16])
def test_torch_varlen_kernel_on_prompt_shared_rows_equals_the_reference(window):
    """The gathered keys (cu_seq_k != cu_seq_q) through torch's kernel in bfloat16: its bottom-right causal
    alignment and window equal ``reference_varlen`` on the same inputs (float32), values and gradients."""
    from prefpack.model.forward import _boundary_kwargs

    va.register()
    assert va.torch_varlen_kernel() is not None, "this torch has no torch.nn.attention.varlen"
    position_ids = torch.tensor([SHARED_ROW])
    kwargs = _boundary_kwargs(position_ids[0], torch.device("cuda"))
    n = len(SHARED_ROW)
    assert kwargs[va.KEY_INDEX].device.type == "cuda" and int(kwargs["cu_seq_lens_k"][-1]) == n + 100 * 2 + 5
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 64, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    module = torch.nn.Module()
    outs, grads = [], []
    for dtype in (torch.bfloat16, torch.float32):  # bfloat16: the kernel; float32: the reference, same inputs
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = va.varlen_attention(module, *inputs, None, position_ids=position_ids.cuda(), sliding_window=window,
                                  **kwargs)[0]
        outs.append(out.float())
        grads.append([x.float() for x in torch.autograd.grad(out.float().square().sum(), inputs)])
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for a, b in zip(*grads):  # a prompt's keys sum the gradients of every completion: relative to the whole
        assert float((a - b).norm() / b.norm()) < 2e-2


def test_training_on_varlen_with_prefix_sharing_equals_without(tmp_path, toy_tokenizers, hh_train):
    """Three DPO steps on CUDA (bfloat16 autocast, varlen): prompts laid out once give the losses of the unshared
    run, the same tokens and fewer positions."""
    import json

    from conftest import prepare_hh_splits, tiny_llama

    from prefpack.config import load_config
    from prefpack.training import train

    stores = prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 24})
    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "model", seed=0)
    runs = {}
    for setting in ("true", "false"):
        out = tmp_path / setting
        cfg = load_config(None, [f"model.name_or_path={model}", f"data.train={stores['train']}",
                                 "train.global_batch_pairs=8", "train.max_steps=3", "train.device=cuda",
                                 "model.attn_implementation=varlen", "model.compile=false", "optim.lr=1e-2",
                                 f"data.prefix_sharing={setting}", f"run.output_dir={out}", "run.plot=false",
                                 "run.tensorboard=false"])
        train(cfg, progress=False, log=lambda m: None)
        runs[setting] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    shared, plain = runs["true"], runs["false"]
    assert [r["tokens"] for r in shared] == [r["tokens"] for r in plain]
    assert sum(r["positions"] for r in shared) < sum(r["positions"] for r in plain)
    assert [r["loss"] for r in shared] == pytest.approx([r["loss"] for r in plain], abs=2e-2)


def test_cuda_budgets_grow_with_free_memory():
    import transformers as tf

    from prefpack.engine.budgets import MAX_MICRO_BATCH_TOKENS, MIN_MICRO_BATCH_TOKENS, cuda_budgets

    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8)
    model = tf.LlamaForCausalLM(cfg).cuda()
    budgets, free = cuda_budgets(model, torch.device("cuda"), autocast=True, checkpointing=False, flattened=True)
    assert MIN_MICRO_BATCH_TOKENS <= budgets.micro_batch_tokens <= MAX_MICRO_BATCH_TOKENS
    assert budgets.chunk_size >= 1024 and budgets.row_tokens == min(budgets.micro_batch_tokens, 8192)
    assert free > 0


def test_chunked_head_keeps_its_last_chunk_on_cuda_in_bfloat16():
    """The chunked head under bf16 autocast on CUDA: log-probs and gradients against a float64 log_softmax of the
    same bf16 logits, and the backward that starts from the kept chunk gives bitwise the gradients of a second
    backward that recomputes every chunk."""
    from prefpack.model.logprobs import completion_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = 3000, 256, 32000
    h = torch.randn(n, hidden, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    weights = torch.rand(n, device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = completion_logprobs(h, t, w, chunk_size=1024)  # three chunks of 1,000
    assert out.dtype == torch.float32
    first = torch.autograd.grad((out * weights).sum(), (h, w), retain_graph=True)
    second = torch.autograd.grad((out * weights).sum(), (h, w))
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    hb, wb = h.detach().bfloat16().double().requires_grad_(), w.detach().bfloat16().double().requires_grad_()
    ref = (hb @ wb.t()).log_softmax(-1).gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)
    ref_grads = torch.autograd.grad((ref * weights.double()).sum(), (hb, wb))
    for a, r in zip(first, ref_grads):
        assert (a.double() - r).abs().max() <= 0.05 * r.abs().max() + 1e-3
