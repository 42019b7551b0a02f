"""What ``prefpack precompute-ref`` computes for prompt groups: a ranked store's completions, or a pair store whose
pairs repeat prompts; every completion's reference sum once, however many pairs it joins, with each prompt laid
out once where the model's attention reads prompt groups."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from prefpack.batching.collate import collate_groups
from prefpack.batching.plan import plan_groups
from prefpack.data.store import Store
from prefpack.data.views import PairGroups
from prefpack.model import reads_prompt_groups, sequence_logps

__all__ = ["compute_pair_group_logps", "compute_ranked_store_logps", "score_prompt_groups"]


@torch.no_grad()
def score_prompt_groups(model: nn.Module, group: Callable[[int], tuple], sizes: np.ndarray, prompt_len: np.ndarray,
                        completion_len: np.ndarray, *, pairs: Sequence[Sequence[tuple[int, int]]] | None = None,
                        micro_batch_tokens: int = 4096, row_tokens: int = 2048, chunk_size: int = 1024,
                        progress: bool = False, ctx=None) -> tuple[np.ndarray, np.ndarray | None]:
    """Reference sums of every completion of prompt groups (``group(i) = (prompt, [completion, ...])`` with
    ``sizes[i]`` completions; ``completion_len`` flat, groups in order), each group the unit as in training.

    Returns float64 sums, flat in the same order, and with ``pairs`` (per group its (chosen, rejected) completion
    indices) LD-DPO's [2, total pairs] tails of those pairs. Under torchrun (``ctx`` from prefpack.distributed)
    each rank scores every world-th micro-batch and the results are summed."""
    rank, world = (ctx.rank, ctx.world) if ctx is not None else (0, 1)
    sizes = np.asarray(sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    share = reads_prompt_groups(model)
    completions = np.add.reduceat(np.asarray(completion_len, dtype=np.int64), starts[:-1])
    cost = (prompt_len if share else prompt_len * sizes) + completions
    plans = plan_groups(cost, token_budget=micro_batch_tokens, row_budget=min(row_tokens, micro_batch_tokens),
                        seed=None)
    if progress and rank == 0:
        from tqdm import tqdm

        plans = tqdm(plans, desc="reference log-probs", unit="batch")
    pair_starts = np.concatenate([[0], np.cumsum([len(p) for p in pairs])]) if pairs is not None else None
    n_pairs = int(pair_starts[-1]) if pairs is not None else 0
    table = np.zeros(2 * starts[-1] + 2 * n_pairs, dtype=np.float64)  # sums, times scored, tails
    sums, seen, tails = table[:starts[-1]], table[starts[-1]:2 * starts[-1]], table[2 * starts[-1]:].reshape(2, -1)
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
        batch = collate_groups([group(g) for g in flat], local, ids=flat, share_prompts=share)
        if pairs is not None:  # the drawn pairs as sequence indices of the batch, for their tails
            firsts = np.concatenate([[0], np.cumsum(sizes[flat])])
            batch.tail_pairs = torch.as_tensor([[int(firsts[j]) + p[s] for j, g in enumerate(flat) for p in pairs[g]]
                                                for s in (0, 1)], dtype=torch.long)
        out = sequence_logps(model, batch, chunk_size=chunk_size, pair_tails=pairs is not None)
        rows = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in flat])
        sums[rows] = out.logp_sum.double().cpu().numpy()
        seen[rows] += 1
        if pairs is not None:
            drawn = np.concatenate([np.arange(pair_starts[g], pair_starts[g + 1]) for g in flat])
            tails[:, drawn] = out.tail_sum.double().cpu().numpy()
    model.train(was_training)
    if world > 1:
        both = torch.from_numpy(table).to(ctx.device)  # NCCL needs device tensors
        ctx.all_reduce_sum(both)
        table[:] = both.cpu().numpy()
    assert (seen == 1).all(), "every completion must be scored exactly once"
    return sums.copy(), (tails.copy() if pairs is not None else None)


def compute_ranked_store_logps(model: nn.Module, store: Store, **kw) -> np.ndarray:
    """The reference log-prob sum of every completion of a ranked store (float64, one per store row), every prompt
    group scored (those whose scores all tie too: the sidecar covers the store)."""
    starts = store.group_starts()
    sums, _ = score_prompt_groups(model, store.ranked_group, np.diff(starts),
                                  store.column("prompt_len")[starts[:-1]].astype(np.int64),
                                  store.column("completion_len"), **kw)
    return sums


def compute_pair_group_logps(model: nn.Module, store: Store, **kw) -> dict[str, np.ndarray]:
    """What :func:`prefpack.reference.compute_store_logps` returns for a pair store (chosen, rejected and their LD-DPO
    tails per pair, float64, store order), computed over its prompt groups (``PairGroups``): each prompt once per
    group and each distinct completion once, however many pairs repeat it."""
    view = PairGroups(store)
    sums, tails = score_prompt_groups(model, view.__getitem__, view.sizes, view.prompt_len,
                                      np.concatenate(view.completion_len), pairs=view.pairs, **kw)
    starts = np.concatenate([[0], np.cumsum(view.sizes)])
    rows = np.concatenate(view.pair_rows)
    chosen = np.concatenate([starts[g] + np.array([c for c, _ in p]) for g, p in enumerate(view.pairs)])
    rejected = np.concatenate([starts[g] + np.array([r for _, r in p]) for g, p in enumerate(view.pairs)])
    out = {k: np.zeros(len(store)) for k in ("chosen", "rejected", "chosen_tail", "rejected_tail")}
    out["chosen"][rows], out["rejected"][rows] = sums[chosen], sums[rejected]
    out["chosen_tail"][rows], out["rejected_tail"][rows] = tails[0], tails[1]
    return out
