"""Budgets for ``auto``: today's values on CPU; on CUDA sized from free memory (simulated here) and the model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers as tf

from prefpack.engine import budgets as b

CUDA = torch.device("cuda")


def _model(layers=24, hidden=1024, vocab=151936):
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64)
    with torch.device("meta"):  # sizes only; nothing is allocated
        return tf.LlamaForCausalLM(cfg)


def _auto():
    return (SimpleNamespace(micro_batch_tokens="auto", chunk_size="auto"), SimpleNamespace(max_tokens_per_row="auto"))


def _cuda(monkeypatch, free_gib, model, **kw):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * 2**30), 80 * 2**30))
    args = dict(autocast=True, checkpointing=False, flattened=True) | kw
    return b.resolve_budgets(*_auto(), model, CUDA, **args)


def test_cpu_keeps_todays_budgets():
    budgets, line = b.resolve_budgets(*_auto(), _model(2, 64, 1000), torch.device("cpu"), autocast=False,
                                      checkpointing=False, flattened=False)
    assert budgets == b.CPU_BUDGETS == b.Budgets(4096, 2048, 1024)
    assert line.startswith("budgets (cpu defaults)")


def test_cuda_budgets_follow_free_memory_and_the_model(monkeypatch):
    model = _model()  # the 0.7B-class preset of the GPU measurements
    small, _ = _cuda(monkeypatch, 20, model)
    big, line = _cuda(monkeypatch, 74, model)
    assert "from 74.0 GiB free on cuda" in line and "micro-batch" in line
    assert small.micro_batch_tokens < big.micro_batch_tokens <= b.MAX_MICRO_BATCH_TOKENS
    assert big.micro_batch_tokens % 1024 == 0 and big.micro_batch_tokens >= 16384  # a GPU, not a CPU, budget
    assert big.row_tokens == 8192 and big.chunk_size >= 2048
    # the estimate, written out: what training holds (float32 weights, their bfloat16 autocast copies, float32
    # gradients, AdamW's two float32 moments; the meta model is not on the device yet), then 60% of the rest
    params = sum(p.numel() for p in model.parameters())
    room = (74 * 2**30 - params * (4 + 2 + 4 + 8)) * 0.6
    per_token = 24 * (34 * 1024 + 10 * 4096)
    assert big.micro_batch_tokens == min(65536, int(room // per_token) // 1024 * 1024)
    ckpt, _ = _cuda(monkeypatch, 20, model, checkpointing=True)
    assert ckpt.micro_batch_tokens > small.micro_batch_tokens  # checkpointing keeps one layer's activations
    masked, _ = _cuda(monkeypatch, 74, model, flattened=False)
    assert masked.row_tokens == 2048  # masked sdpa pays row^2
    tiny, _ = _cuda(monkeypatch, 0.5, model)
    assert tiny.micro_batch_tokens == b.MIN_MICRO_BATCH_TOKENS


def test_explicit_budgets_are_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    train = SimpleNamespace(micro_batch_tokens=5000, chunk_size=77)
    budgets, _ = b.resolve_budgets(train, SimpleNamespace(max_tokens_per_row=999), _model(), CUDA,
                                   autocast=True, checkpointing=False, flattened=True)
    assert budgets == b.Budgets(5000, 999, 77)


@pytest.mark.parametrize("autocast", [True, False])
def test_activation_estimate_grows_with_the_model(autocast):
    small = b.activation_bytes_per_token(_model(24, 1024).config, autocast=autocast, checkpointing=False)
    large = b.activation_bytes_per_token(_model(28, 1536).config, autocast=autocast, checkpointing=False)
    assert large > small > 0


def test_memory_first_holds_the_micro_batch_and_head_chunk_to_trls_defaults(monkeypatch):
    model = _model()
    speed, _ = _cuda(monkeypatch, 74, model, checkpointing=True)
    first, line = _cuda(monkeypatch, 74, model, checkpointing=True, memory_first=True)
    assert "memory first, from 74.0 GiB free" in line
    assert speed.micro_batch_tokens > 16384 and speed.chunk_size > 1024  # the estimate alone would fill memory
    assert first == b.Budgets(16384, 8192, 1024)
    tiny, _ = _cuda(monkeypatch, 0.5, model, memory_first=True)
    assert tiny.micro_batch_tokens == b.MIN_MICRO_BATCH_TOKENS  # still never below the floor


@pytest.mark.parametrize(("setting", "device", "memory", "on"), [
    ("auto", "cuda", "first", True), ("auto", "cuda", "speed", False), ("auto", "cpu", "first", False),
    (True, "cpu", "speed", True), (False, "cuda", "first", False)])
def test_gradient_checkpointing_auto_is_on_only_on_cuda_when_memory_comes_first(setting, device, memory, on):
    assert b.checkpointing_on(setting, torch.device(device), memory) is on


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_changes_no_loss_and_warns_nothing(tmp_path, toy_tokenizers, hh_train, lora):
    """model.gradient_checkpointing=true (what memory first turns on on CUDA) recomputes the same activations: the
    same losses as without it, and no deprecation warning from transformers on the way."""
    import warnings

    from conftest import metrics_lines, prepare_hh_splits, quiet, tiny_llama

    from prefpack.config import load_config
    from prefpack.training import train

    stores = prepare_hh_splits(tmp_path, toy_tokenizers["llama"], hh_train, {"train": 8})
    model = tiny_llama(toy_tokenizers["llama"], tmp_path / "model", seed=0)
    extra = ["lora.enabled=true", "lora.r=4", "reference.mode=adapter"] if lora else []
    runs = {}
    for ckpt in ("false", "true"):
        out = tmp_path / ckpt
        cfg = load_config(None, [f"model.name_or_path={model}", f"data.train={stores['train']}", "train.max_steps=2",
                                 "train.global_batch_pairs=4", "optim.lr=1e-2", f"model.gradient_checkpointing={ckpt}",
                                 f"run.output_dir={out}", "run.plot=false", "run.report_to=none", *extra])
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*gradient_checkpointing_enable.*deprecated", category=FutureWarning)
            train(cfg, progress=False, log=quiet)
        runs[ckpt] = [m["loss"] for m in metrics_lines(out)]
    assert runs["true"] == pytest.approx(runs["false"], abs=1e-6) and runs["true"][1] != runs["true"][0]
