"""What ``prefpack precompute-ref`` computes for a ranked store: every completion's reference sum once, however
many pairs it joins, with each prompt laid out once where the model's attention reads prompt groups."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from prefpack.batching.collate import collate_groups
from prefpack.batching.plan import plan_groups
from prefpack.data.store import Store
from prefpack.model import reads_prompt_groups, sequence_logps

__all__ = ["compute_ranked_store_logps"]

@torch.no_grad()
def compute_ranked_store_logps(model: nn.Module, store: Store, *, micro_batch_tokens: int = 4096,
                               row_tokens: int = 2048, chunk_size: int = 1024, progress: bool = False,
                               ctx=None) -> np.ndarray:
    """The reference log-prob sum of every completion of a ranked store (float64, one per store row).

    Each prompt group (the prompt with all its completions) is the unit, as in training. Under torchrun (``ctx``
    from prefpack.distributed) each rank scores every world-th micro-batch and the results are summed."""
    rank, world = (ctx.rank, ctx.world) if ctx is not None else (0, 1)
    starts = store.group_starts()
    share = reads_prompt_groups(model)
    prompt = store.column("prompt_len")[starts[:-1]].astype(np.int64)
    completions = np.add.reduceat(store.column("completion_len").astype(np.int64), starts[:-1])
    sizes = np.diff(starts)
    cost = (prompt if share else prompt * sizes) + completions
    plans = plan_groups(cost, token_budget=micro_batch_tokens, row_budget=min(row_tokens, micro_batch_tokens),
                        seed=None)
    if progress and rank == 0:
        from tqdm import tqdm

        plans = tqdm(plans, desc="reference log-probs", unit="batch")
    table = np.zeros((2, len(store)), dtype=np.float64)  # sums, and how often each completion was scored
    was_training = model.training
    model.eval()
    for k, mb in enumerate(plans):
        if k % world != rank:
            continue
        flat = [g for r in mb for g in r]
        local, at = [], 0
        for r in mb:
            local.append(list(range(at, at + len(r))))
            at += len(r)
        batch = collate_groups([store.ranked_group(g) for g in flat], local, ids=flat, share_prompts=share)
        rows = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in flat])
        table[0, rows] = sequence_logps(model, batch, chunk_size=chunk_size).logp_sum.double().cpu().numpy()
        table[1, rows] += 1
    model.train(was_training)
    if world > 1:
        both = torch.from_numpy(table).to(ctx.device)  # NCCL needs device tensors
        ctx.all_reduce_sum(both)
        table = both.cpu().numpy()
    assert (table[1] == 1).all(), "every completion must be scored exactly once"
    return table[0]
