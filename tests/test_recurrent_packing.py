"""Recurrent layers in packed forwards (issue 38, items 1 and 2): tiny random hybrids built from transformers'
configs (one recurrent and one attention layer, float64). Packed log-probs equal each sequence run alone through the
HF model's own forward; a packed training step equals the padded one (``data.packing=false``); prompts laid out once
equal prompts repeated; the load-time guard packs the covered families and refuses another recurrent family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_packing import VOCAB, random_pairs

from prefpack.batching.collate import collate_packed, collate_padded
from prefpack.model import ModelError, load_causal_lm, packing_leak, sequence_logps, sibling_leak
from prefpack.model.recurrent import install_boundaries, installed_kinds, uncovered_layers
from prefpack.model.recurrent.kind import LayerKind, run_blocks, run_gathered
from prefpack.model.recurrent.layout import Piece, read_segments

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
           layer_types=["linear_attention", "full_attention"])
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8)


def hybrid_config(kind: str):
    """A two-layer config of the family: a recurrent layer, then an attention layer (chunk sizes of 8, so a
    sequence spans several chunks of the Mamba-2 scan); Qwen3.5 and Nemotron-H have a second recurrent layer."""
    import transformers as tf

    if kind == "qwen3_5":
        return tf.Qwen3_5TextConfig(**{**SMALL, "num_hidden_layers": 3}, head_dim=8, **{
            **GDN, "layer_types": ["linear_attention", "full_attention", "linear_attention"]})
    if kind == "qwen3_next":  # dense MLPs: the experts' grouped matmul has no float64 kernel
        return tf.Qwen3NextConfig(**SMALL, head_dim=8, **GDN, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[0, 1])
    if kind == "olmo_hybrid":
        return tf.OlmoHybridConfig(**SMALL, **GDN, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    if kind == "nemotron_h":
        return tf.NemotronHConfig(**{k: v for k, v in SMALL.items() if k != "num_hidden_layers"}, head_dim=8,
                                  mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8,
                                  layers_block_type=["linear_attention", "full_attention", "linear_attention"])
    if kind == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(**SMALL, **MAMBA2, layer_types=["mamba", "attention"], num_local_experts=0,
                                         shared_intermediate_size=64)
    if kind == "bamba":
        return tf.BambaConfig(**SMALL, **MAMBA2, attn_layer_indices=[1])
    if kind == "lfm2":
        return tf.Lfm2Config(**SMALL, layer_types=["conv", "full_attention"])
    if kind == "zamba":  # Zamba (v1)'s multi-head Mamba-1 mixer: not covered
        return tf.ZambaConfig(**{**SMALL, "num_hidden_layers": 3}, mamba_d_state=8, n_mamba_heads=2,
                              layers_block_type=["mamba", "hybrid", "hybrid"])  # one hybrid layer: ties fail
    if kind == "jamba":  # Mamba-1 layers, in decoder layers that keep their keywords to themselves
        return tf.JambaConfig(**SMALL, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=100,
                              expert_layer_offset=50, num_experts=1, mamba_d_state=8, mamba_dt_rank=4)
    raise ValueError(kind)


def hybrid(kind: str, install: bool = True) -> torch.nn.Module:
    import transformers as tf

    from prefpack.model.attention.packed_sdpa import register

    register()
    cfg = hybrid_config(kind)
    cfg._attn_implementation = "packed_sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).double().eval()
    if install:
        install_boundaries(model)
    return model


MAIN = ["qwen3_5", "qwen3_next", "nemotron_h", "granitemoehybrid", "jamba"]
COVERED = [*MAIN, "olmo_hybrid", "bamba", "lfm2"]


@pytest.fixture(scope="module")
def pairs():
    return random_pairs(5, seed=3, max_prompt=9, max_completion=9)


def alone_sums(model, pairs, order) -> torch.Tensor:
    """Each completion's log-prob sum from the HF model's own forward on prompt + completion alone (float64)."""
    sums = []
    with torch.no_grad():
        for p in order:
            prompt = pairs[p].prompt
            for completion in (pairs[p].chosen, pairs[p].rejected):
                ids = torch.from_numpy(np.concatenate([prompt, completion]).astype(np.int64))[None]
                logp = model(input_ids=ids, use_cache=False).logits[0, :-1].double().log_softmax(-1)
                sums.append(logp.gather(-1, ids[0, 1:, None])[len(prompt) - 1:].sum())
    return torch.stack(sums)


@pytest.mark.parametrize("kind", COVERED)
def test_packed_log_probs_equal_each_sequence_alone(kind, pairs):
    model = hybrid(kind)
    rows = [[0, 1, 2], [3, 4]]  # several rows, row padding: blocks in a row and across rows
    with torch.no_grad():
        packed = sequence_logps(model, collate_packed(pairs, rows, pad_to_multiple_of=8)).logp_sum
    want = alone_sums(model, pairs, [p for row in rows for p in row])
    torch.testing.assert_close(packed, want, rtol=1e-6, atol=1e-6)
    assert packing_leak(model) == 0.0 and sibling_leak(model) == 0.0


def _values_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = sequence_logps(model, batch, chunk_size=5)
    weights = torch.linspace(0.5, 1.5, out.logp_sum.numel(), dtype=out.logp_sum.dtype)
    (out.logp_sum * weights).sum().backward()
    return out.logp_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    (va, ga), (vb, gb) = a, b
    torch.testing.assert_close(va, vb, rtol=1e-6, atol=1e-6)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for name in ga:  # the recurrences compute in float32 inside transformers, whatever the model's dtype
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", MAIN)
def test_packed_and_prompts_once_training_steps_equal_the_padded_step(kind, pairs):
    """Log-probs and gradients of a packed step, and of one with each prompt laid out once (each completion after
    its shared prompt, and after its sibling, starts from the prompt's final state: the recurrent state and the
    convolution window), equal the padded step's (``data.packing=false``)."""
    model = hybrid(kind)
    rows = [[0, 1], [2, 3, 4]]
    padded = _values_and_grads(model, collate_padded(pairs, [p for row in rows for p in row]))
    _assert_same(_values_and_grads(model, collate_packed(pairs, rows)), padded)
    shared = collate_packed(pairs, rows, pad_to_multiple_of=8, share_prompts=True)
    assert shared.shared_tokens > 0
    _assert_same(_values_and_grads(model, shared), padded)


@pytest.mark.parametrize("kind", ["qwen3_5", "jamba"])
def test_checkpointed_layers_replay_their_blocks(kind, pairs):
    """Under activation checkpointing the backward recomputes each layer: its blocks travel with its keywords (or,
    for Jamba's Mamba-1 layers, with its decoder layer's relaying class, ``relay.py``)."""
    model = hybrid(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = [[0, 1], [2, 3, 4]]
    shared = _values_and_grads(model, collate_packed(pairs, rows, share_prompts=True))
    _assert_same(shared, _values_and_grads(model, collate_padded(pairs, [p for row in rows for p in row])))


def test_blocks_are_read_from_position_ids():
    positions = torch.tensor([[0, 1, 2, 3, 4, 2, 3, 0, 1, 0], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    segments = read_segments(positions)  # row 0: prompt 0-1 + completion, its sibling (2, 3), a pair, padding
    assert segments.pieces == (Piece(5, 0, 0), Piece(2, 0, 2), Piece(2, 2, 0), Piece(1, 3, 0),
                               Piece(4, 4, 0), Piece(6, 5, 0))
    layout = segments.gathered  # the sibling runs after its own copy of the prompt (flat positions 0, 1)
    assert layout.index.tolist() == [0, 1, 2, 3, 4, 0, 1, 5, 6, *range(7, 20)]
    assert layout.cu_seqlens.tolist() == [0, 5, 9, 11, 12, 16, 22]
    assert layout.own.tolist() == [0, 1, 2, 3, 4, 7, 8, *range(9, 22)]
    assert layout.seq_idx[0, :10].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="row 0 has a block starting at position 3"):
        read_segments(torch.tensor([[0, 1, 3, 4]]))  # a completion reading more prompt than there is


class _ToyRecurrence(torch.nn.Module):
    """A decaying running sum after a 2-token causal window, reset where ``seq_idx`` changes: what the CUDA
    kernels do with boundaries, written out, so the gathered call is checked on CPU."""

    def forward(self, hidden, seq_idx=None, cu_seq_lens_q=None):
        x = hidden[0]
        idx = torch.zeros(x.shape[0], dtype=torch.int32) if seq_idx is None else seq_idx[0]
        assert cu_seq_lens_q is None or cu_seq_lens_q[-1] == x.shape[0]
        state, prev, out = torch.zeros_like(x[0]), torch.zeros_like(x[0]), []
        for t in range(x.shape[0]):
            if t and idx[t] != idx[t - 1]:
                state, prev = torch.zeros_like(state), torch.zeros_like(prev)
            window = x[t] + 0.5 * prev
            state = 0.9 * state + window
            prev = x[t]
            out.append(state)
        return torch.stack(out)[None]


def test_the_gathered_call_equals_the_blocks_run_apart():
    positions = torch.tensor([[0, 1, 2, 3, 2, 3, 4, 0, 1], [0, 1, 2, 0, 1, 2, 3, 0, 0]])
    segments = read_segments(positions)
    hidden = torch.randn(2, 9, 3, dtype=torch.float64, requires_grad=True)
    kind = LayerKind("toy", (), (), (), lambda layout: {"seq_idx": layout.seq_idx, "cu_seq_lens_q": layout.cu_seqlens})
    layer = _ToyRecurrence()
    apart = run_blocks(layer, hidden, segments)
    (g_apart,) = torch.autograd.grad(apart.square().sum(), hidden)
    gathered = run_gathered(layer, kind, hidden, segments)
    (g_gathered,) = torch.autograd.grad(gathered.square().sum(), hidden)
    torch.testing.assert_close(gathered, apart, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_gathered, g_apart, rtol=0, atol=1e-12)
    # and a completion continues its prompt's state: equal to prompt + completion run as one sequence
    alone = layer(torch.cat([hidden[0, :2], hidden[0, 4:7]])[None])[0]
    torch.testing.assert_close(apart[0, 4:7], alone[2:], rtol=0, atol=1e-12)


def _save(tmp_path, kind):
    path = tmp_path / kind
    hybrid(kind, install=False).save_pretrained(path)
    return str(path)


def test_the_load_guard_packs_covered_hybrids_and_refuses_other_recurrent_layers(tmp_path):
    cpu = torch.device("cpu")
    model = load_causal_lm(_save(tmp_path, "qwen3_5"), dtype=torch.float64, attn_implementation="packed_sdpa",
                           device=cpu)
    assert installed_kinds(model) == ["gated_deltanet"] and uncovered_layers(model) == []
    zamba = _save(tmp_path, "zamba")
    with pytest.raises(ModelError, match=r"ZambaForCausalLM\) has recurrent layers .*\(ZambaMambaMixer: .*"
                                         r"qwen3_5.*data\.packing=false") as err:
        load_causal_lm(zamba, dtype=torch.float64, attn_implementation="packed_sdpa", device=cpu)
    assert "\n" not in str(err.value)
    model = load_causal_lm(zamba, dtype=torch.float64, attn_implementation="packed_sdpa", device=cpu, packed=False)
    assert uncovered_layers(model) == ["ZambaMambaMixer"]


def test_token_shards_refuse_recurrent_layers(pairs):
    """A sequence split over the ranks of a sequence group would start its second shard from a zero state: refused
    on every rank alike, before any collective."""
    from prefpack.sequence_parallel import SeqPar, SequenceParallelError

    with pytest.raises(SequenceParallelError, match="recurrent layers.*sequence_parallel=1"):
        sequence_logps(hybrid("nemotron_h"), collate_packed(pairs, [[0, 1]]), seq=SeqPar(size=2))
