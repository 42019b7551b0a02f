"""The CUDA branch of the recurrent layers (issue 38), run on CPU: stand-ins of flash-linear-attention,
causal-conv1d and mamba_ssm with the real functions' signatures and a float64 loop of their semantics
(tests/recurrent_kernels.py), bound by transformers' own decorator, and prefpack's device rule widened to CPU. A
packed row then runs each recurrent layer in ONE gathered call with ``cu_seqlens`` / ``seq_idx``, as on a GPU: its
log-probs must equal each sequence alone through transformers' own CPU path, and prompts laid out once must equal
prompts repeated. Wrong boundaries, a wrong gather or a state carried over would show here before a GPU runs it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import recurrent_kernels
import torch
from test_packing import random_pairs
from test_recurrent_packing import alone_sums, hybrid

from prefpack.batching.collate import collate_packed
from prefpack.model import packing_leak, sequence_logps
from prefpack.model.recurrent import install as boundaries
from prefpack.model.recurrent.kind import run_gathered

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [[0, 1, 2], [3, 4]]
ORDER = [p for row in ROWS for p in row]
# transformers' CPU path computes the recurrences in float32; the stand-ins in float64
CLOSE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def kernel_path(monkeypatch):
    """Call it to install the stand-ins and send CPU hidden states down the kernel path; returns the calls list."""
    def install():
        recurrent_kernels.install(monkeypatch)
        monkeypatch.setattr(boundaries, "KERNEL_DEVICES", ("cuda", "cpu"))
        boundaries._kernels.cache_clear()  # whether the packages import, cached per kind
        recurrent_kernels.CALLS.clear()
        return recurrent_kernels.CALLS

    yield install
    boundaries._kernels.cache_clear()


def _packed(model, pairs, share_prompts=False):
    batch = collate_packed(pairs, ROWS, pad_to_multiple_of=8, share_prompts=share_prompts)
    with torch.no_grad():
        return sequence_logps(model, batch).logp_sum


def _boundaries(calls, name):
    return [b for n, b in calls if n == name]


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_the_cuda_kernel_wiring_keeps_packed_sequences_and_shared_prompts_apart(kind, kernel_path):
    pairs = random_pairs(5, seed=3, max_prompt=9, max_completion=9)
    model = hybrid(kind)
    want = alone_sums(model, pairs, ORDER)  # transformers' own CPU path, one sequence at a time
    calls = kernel_path()
    packed = _packed(model, pairs)
    scans = {"qwen3_5": "chunk_gated_delta_rule", "nemotron_h": "mamba_chunk_scan_combined"}[kind]
    bounds = _boundaries(calls, scans)
    assert len(bounds) == 2 and all(b is not None for b in bounds)  # two recurrent layers, one gathered call each
    assert _boundaries(calls, "causal_conv1d_fn") and all(b is not None for b in _boundaries(calls, "causal_conv1d_fn"))
    torch.testing.assert_close(packed, want, **CLOSE)
    calls.clear()
    shared = _packed(model, pairs, share_prompts=True)
    torch.testing.assert_close(shared, want, **CLOSE)
    assert _boundaries(calls, scans)
    if kind == "nemotron_h":  # training takes mamba_ssm's fused mixer: seq_idx must reach it too
        model.train()
        calls.clear()
        torch.testing.assert_close(_packed(model, pairs, share_prompts=True), want, **CLOSE)
        fused = _boundaries(calls, "mamba_split_conv1d_scan_combined")
        assert len(fused) == 2 and all(b is not None for b in fused)
    assert packing_leak(model) == 0.0  # the load guard's measure, through the same kernels


def test_the_wiring_check_fails_when_boundaries_do_not_reach_the_kernels(kernel_path, monkeypatch):
    """A gathered row handed to the kernels without its boundaries runs as one sequence: the check above sees it."""
    pairs = random_pairs(5, seed=3, max_prompt=9, max_completion=9)
    model = hybrid("qwen3_5")
    want = alone_sums(model, pairs, ORDER)
    kernel_path()

    def without_boundaries(layer, kind, hidden, segments):
        return run_gathered(layer, replace(kind, boundary_keywords=lambda layout: {}), hidden, segments)

    monkeypatch.setattr(boundaries, "run_gathered", without_boundaries)
    assert not torch.allclose(_packed(model, pairs), want, **CLOSE)
