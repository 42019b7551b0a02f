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
