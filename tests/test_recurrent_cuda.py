"""The real CUDA kernels of the recurrent layers on packed rows (issue 38): flash-linear-attention's chunked delta
rule (Qwen3.5) and mamba_ssm's scans with causal-conv1d (Nemotron-H), through prefpack's gathered call with
``cu_seqlens`` / ``seq_idx``. Packed log-probs and prompts laid out once must equal each sequence run alone.
Skipped without CUDA, and per family without its packages (tests/test_recurrent_kernel_wiring.py runs the same
wiring on CPU with stand-ins). On a GPU: ``bash benchmarks/gpu/session.sh recurrent``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_packing import VOCAB, random_pairs

from prefpack.batching.collate import collate_packed
from prefpack.model import packing_leak, sequence_logps
from prefpack.model.recurrent import install as boundaries
from prefpack.model.recurrent import install_boundaries
from prefpack.model.recurrent.kind import run_gathered
from prefpack.model.recurrent.table import KINDS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and the kernels' packages")

ROWS = [[0, 1, 2], [3, 4]]
# kernel-friendly sizes (head dims of 32 and 16, state 16, chunks of 16); the sequences span several chunks
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16)


def _config(kind: str):
    import transformers as tf

    if kind == "qwen3_5":
        return tf.Qwen3_5TextConfig(**SIZES, num_hidden_layers=3, linear_num_value_heads=4, linear_num_key_heads=2,
                                    linear_key_head_dim=32, linear_value_head_dim=32,
                                    layer_types=["linear_attention", "full_attention", "linear_attention"])
    return tf.NemotronHConfig(**SIZES, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                              chunk_size=16, layers_block_type=["linear_attention", "full_attention",
                                                                "linear_attention"])


def _model(kind: str):
    import transformers as tf

    from prefpack.model.attention.packed_sdpa import register

    needs = {"qwen3_5": "gated_deltanet", "nemotron_h": "mamba2"}[kind]
    packages = next(k for k in KINDS if k.name == needs)
    if not packages.kernels_installed():
        pytest.skip(f"{kind}: needs the packages {', '.join(packages.packages)} (pip install "
                    "flash-linear-attention / causal-conv1d / mamba-ssm)")
    register()
    config = _config(kind)
    config._attn_implementation = "packed_sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float().cuda().eval()
    install_boundaries(model)
    return model


def _alone(model, pairs, order):
    sums = []
    with torch.no_grad():
        for p in order:
            for completion in (pairs[p].chosen, pairs[p].rejected):
                ids = torch.from_numpy(np.concatenate([pairs[p].prompt, completion]).astype(np.int64))[None].cuda()
                logp = model(input_ids=ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
                sums.append(logp.gather(-1, ids[0, 1:, None])[len(pairs[p].prompt) - 1:].sum())
    return torch.stack(sums).cpu()


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_real_kernels_keep_packed_sequences_and_shared_prompts_apart(kind, monkeypatch):
    model = _model(kind)
    pairs = random_pairs(5, seed=3, max_prompt=40, max_completion=40)
    want = _alone(model, pairs, [p for row in ROWS for p in row])
    gathered = []
    monkeypatch.setattr(boundaries, "run_gathered", lambda *a: gathered.append(1) or run_gathered(*a))
    for train in (False, True):  # Nemotron-H trains through mamba_ssm's fused mixer
        model.train(train)
        for share in (False, True):
            gathered.clear()
            batch = collate_packed(pairs, ROWS, pad_to_multiple_of=8, share_prompts=share).to("cuda")
            with torch.no_grad():
                got = sequence_logps(model, batch).logp_sum.float().cpu()
            assert len(gathered) == 2, "the packed forward did not take the kernels' gathered call"
            torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-2, msg=f"train={train} share={share}")
    # the sharp check: a tiny random model's leak moves these sums by ~1e-2 only, but its hidden states by far more
    # than the load guard's 1e-4 (a sequence, or a completion, against another in its row changing)
    model.eval()
    gathered.clear()
    assert packing_leak(model) <= 1e-4 and gathered
