"""The attention cases of the sequence-parallel tests (shared by the test and its torchrun worker, tests/sp_ranks.py):
seeded float64 q/k/v over packed rows, prompt-shared rows and grouped-query heads."""

import torch

# position ids of each row; every row's length is even (2 ranks); a block starting at p > 0 is a later completion of
# a prompt group (it reads the first p tokens of the row's last block starting at 0)
_PACKED = [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2]]
_SHARED = [[0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 0, 1, 2, 0]]  # prompt 4 + c1 3, c2 (5) after it, a sequence, padding

ATTENTION_CASES = {
    "packed_sdpa": {"kernel": "packed_sdpa", "pos": _PACKED, "heads": 4, "kv_heads": 2},
    "packed_sdpa_window": {"kernel": "packed_sdpa", "pos": _PACKED, "heads": 4, "kv_heads": 4, "window": 3},
    "packed_sdpa_shared": {"kernel": "packed_sdpa", "pos": _SHARED, "heads": 4, "kv_heads": 2},
    "gqa_one_kv_head": {"kernel": "packed_sdpa", "pos": _SHARED, "heads": 4, "kv_heads": 1, "scale": 0.3},
    "gqa_three_kv_heads": {"kernel": "packed_sdpa", "pos": _PACKED, "heads": 6, "kv_heads": 3},
    "varlen_shared": {"kernel": "varlen", "pos": _SHARED, "heads": 4, "kv_heads": 1, "boundaries": True},
    "varlen_rows": {"kernel": "varlen", "pos": _PACKED, "heads": 2, "kv_heads": 2},
}


def case_tensors(case: dict):
    """q [B, H, L, D], k/v [B, Hkv, L, D], position ids [B, L] and a cotangent [B, L, H, D], float64, seeded."""
    g = torch.Generator().manual_seed(7)
    pos = torch.tensor(case["pos"])
    b, length, dim = pos.shape[0], pos.shape[1], 8
    q = torch.randn(b, case["heads"], length, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, case["kv_heads"], length, dim, generator=g, dtype=torch.float64) for _ in range(2))
    cot = torch.randn(b, length, case["heads"], dim, generator=g, dtype=torch.float64)
    return q, k, v, pos, cot


def kernel_kwargs(case: dict, pos: torch.Tensor) -> dict:
    """The whole row's boundary keywords training hands varlen (host-computed), for the cases that ask for them."""
    if not case.get("boundaries"):
        return {}
    from prefpack.model.forward import _boundary_kwargs

    return _boundary_kwargs(pos.reshape(1, -1), torch.device("cpu"))


# ------------------------------------------------------------------------------- the forward over token shards

FORWARD_CASES = {  # kernel, flattened, prompt-shared rows, (prompt, chosen, rejected) lengths, rows of pairs
    "packed_sdpa_rows": ("packed_sdpa", False, False, [(5, 4, 7), (3, 6, 2), (4, 9, 5)], [[0, 1], [2]]),
    "packed_sdpa_shared": ("packed_sdpa", False, True, [(5, 4, 7), (3, 6, 2), (4, 9, 5)], [[0, 1], [2]]),
    "varlen_flat_shared": ("varlen", True, True, [(5, 4, 7), (3, 6, 2), (4, 9, 5)], [[0, 1], [2]]),
    # one pair whose prompt fills the first shard: rank 0 scores no position at all
    "first_shard_unscored": ("packed_sdpa", False, True, [(20, 2, 3)], [[0]]),
    # gradient checkpointing: backward replays each layer's forward, attention's exchanges included
    "checkpointed": ("packed_sdpa", False, True, [(5, 4, 7), (3, 6, 2), (4, 9, 5)], [[0, 1], [2]]),
}


def tiny_model():
    """A 2-layer float64 Llama with 4 query heads over 1 key/value head (fewer than the ranks), seeded."""
    import transformers as tf

    from prefpack.model.attention import packed_sdpa, varlen

    packed_sdpa.register()
    varlen.register()
    cfg = tf.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128)
    cfg._attn_implementation = "packed_sdpa"
    torch.manual_seed(11)
    return tf.LlamaForCausalLM(cfg).double().train()


def forward_batch(shared: bool, lengths, rows):
    """Seeded pairs of these lengths packed in these rows (odd row lengths: padded for two ranks); prompt-shared
    when ``shared``."""
    import numpy as np

    from prefpack.batching.collate import collate_groups

    g = np.random.default_rng(5)
    groups = [(g.integers(1, 50, p), (g.integers(1, 50, c), g.integers(1, 50, r))) for p, c, r in lengths]
    return collate_groups(groups, rows, ids=list(range(len(groups))), share_prompts=shared)


def forward_case(name: str, model):
    """The case's kernel set on ``model``, its batch and its forward options."""
    kernel, flatten, shared, lengths, rows = FORWARD_CASES[name]
    model.config._attn_implementation = kernel
    if name == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    return forward_batch(shared, lengths, rows), {"flatten": flatten, "pair_tails": True, "wpo": True}


def forward_loss(out) -> torch.Tensor:
    """A scalar reading every differentiable output with distinct weights."""
    w = torch.arange(1, out.logp_sum.numel() + 1, dtype=out.logp_sum.dtype)
    return (out.logp_sum * w).sum() + (out.tail_sum * w.flip(0)).sum() * 0.5
