"""``attn_implementation: auto`` reads the model (issue 38): on CUDA it passes over a kernel the load would refuse for
the model's features (gpt-oss's sinks, Llama-4's chunks and missing flash support, Gemma-2's softcapping) and says
which it picked and why. The device and the flash-attn package are faked: no GPU runs here."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from model_families import FAMILIES, SMALL
from transformers import AutoConfig

from prefpack.model.attention import varlen
from prefpack.model.attention.auto import choose_attention

CUDA = torch.device("cuda")
BY_TYPE = {f.model_type: f for f in FAMILIES}
needs_varlen = pytest.mark.skipif(not varlen.torch_varlen_kernel(), reason="this torch has no varlen_attn")


@pytest.fixture
def folder(tmp_path):
    def write(model_type: str) -> str:
        family = BY_TYPE[model_type]
        AutoConfig.for_model(model_type, vocab_size=64, **SMALL, **family.config).save_pretrained(tmp_path / model_type)
        return str(tmp_path / model_type)

    return write


@pytest.fixture
def flash_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))


@needs_varlen
def test_auto_on_cuda_passes_over_flash_attention_where_the_model_needs_more(folder, flash_installed):
    plain = choose_attention("auto", CUDA, torch.bfloat16, source=folder("llama"))
    assert (plain.name, plain.skipped) == ("flash_attention_2", ())
    assert plain.describe() == "attention: flash_attention_2 (auto on cuda)"
    sinks = choose_attention("auto", CUDA, torch.bfloat16, source=folder("gpt_oss"))
    assert sinks.name == "varlen" and [k for k, _ in sinks.skipped] == ["flash_attention_2"]
    assert "attention sinks" in sinks.describe()
    chunks = choose_attention("auto", CUDA, torch.bfloat16, source=folder("llama4_text"))
    assert chunks.name == "varlen" and "chunked local attention" in chunks.skipped[0][1]
    unpacked = choose_attention("auto", CUDA, torch.bfloat16, source=folder("llama4_text"), packed=False)
    assert unpacked.name == "varlen" and "_supports_flash_attn is False" in unpacked.skipped[0][1]
    # float32 compute: no varlen; gpt-oss has no sdpa and loads eager, which computes its sinks
    assert choose_attention("auto", CUDA, torch.float32, source=folder("gpt_oss")).name == "sdpa"
    assert choose_attention("auto", CUDA, torch.float32, source=folder("llama")).name == "flash_attention_2"


@needs_varlen
def test_auto_passes_over_varlen_for_softcapping_and_keeps_explicit_choices(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: varlen first for half precision
    gemma = choose_attention("auto", CUDA, torch.bfloat16, source=folder("gemma2"))
    assert gemma.name == "sdpa" and gemma.skipped[0][0] == "varlen" and "attn_logit_softcapping" in gemma.skipped[0][1]
    assert choose_attention("auto", CUDA, torch.bfloat16, source=folder("llama")).name == "varlen"
    explicit = choose_attention("flash_attention_2", CUDA, torch.bfloat16, source=folder("gpt_oss"))
    assert explicit.name == "flash_attention_2" and not explicit.auto  # the load refuses it, naming varlen


def test_auto_on_cpu_reads_no_config():
    # packed_sdpa computes every feature: nothing to read, even from a folder that does not exist
    choice = choose_attention("auto", torch.device("cpu"), source="/nonexistent/model")
    assert choice.describe() == "attention: packed_sdpa (auto on cpu)"
