"""The host syncs of a steady-state training step, counted as benchmarks/host_syncs.py counts them (issue 43, item 2):
a regression (a new `.item()`, a boolean-mask index of a device tensor, a per-micro-batch read) fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

TOOL = Path(__file__).resolve().parents[1] / "benchmarks" / "host_syncs.py"


def _tool():
    spec = importlib.util.spec_from_file_location("host_syncs", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_steady_step_makes_few_host_syncs(tmp_path, one_thread):
    counter = _tool().count(tmp_path, steps=3)
    per_step = counter.per_step()
    step = per_step[3]  # steady state: steps 2 and 3 have 4 micro-batches each, policy and reference forwards
    assert per_step[2] == step
    by_site = {}
    for (kind, site), n in step.items():
        by_site[site.split(":")[0] + " " + kind] = by_site.get(site.split(":")[0] + " " + kind, 0) + n
    # what remains, and why:
    # - one read a step of the loss/metric sums with the gradient norm (the non-finite guard and the metrics line
    #   need them on the host every step); it was two (the norm alone, then the sums)
    assert by_site.pop("prefpack/objectives/base.py Tensor.tolist") == 1
    # - packed_sdpa (the CPU kernel; CUDA runs flash varlen) reads a forward's position ids once for its blocks
    assert by_site.pop("prefpack/model/attention/packed_sdpa.py Tensor.cpu") == 8
    # - transformers' own mask code reads the packed position ids inside the model body, once per forward
    assert by_site.pop("prefpack/model/forward.py aten::_local_scalar_dense") <= 8
    # before: one more per forward for `bool(token_mask.all())`, and the flattened rows took two boolean-mask reads
    assert by_site == {}, by_site
    assert sum(step.values()) <= 17


def test_flattened_rows_by_host_index_equal_the_boolean_mask():
    """`real_tokens` (index_select by the index `Batch.to` builds on the host) takes what the mask takes."""
    from prefpack.batching.collate import Batch
    from prefpack.model.forward import real_tokens

    g = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 7, generator=g) > 0.4
    x = torch.randn(3, 7, 5, generator=g)
    z = torch.zeros(3, 7, dtype=torch.long)
    batch = Batch(z, z, z, mask, z, mask, None, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                  True).to("cpu")
    assert batch.real_index is not None
    assert torch.equal(real_tokens(x, batch), x[mask][None])
