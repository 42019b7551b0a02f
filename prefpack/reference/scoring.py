"""Score every pair (or KTO example with its fixed KL sequence) of a store once with a reference model: what
``prefpack precompute-ref`` writes into a sidecar."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from prefpack.batching.collate import collate, collate_groups, collate_packed
from prefpack.batching.plan import balanced_rows, fit_runs, plan_groups, plan_micro_batches
from prefpack.data.kl_pairing import fixed_kl_partners
from prefpack.data.store import Store
from prefpack.data.views import StorePairs, UnpairedView
from prefpack.model import reads_prompt_groups, sequence_logps

__all__ = ["compute_kto_store_logps", "compute_store_logps", "iter_store_batches"]


def iter_store_batches(store: Store, *, micro_batch_tokens: int, row_tokens: int, packing: bool = True,
                       pad_id: int = 0, pad_to_multiple_of: int | None = None, share_prompts: bool = False):
    """Every pair of a store once, in deterministic micro-batches; yields (batch, global pair ids).

    ``share_prompts`` (packed only, for a kernel that reads prompt groups): each pair's prompt is laid out once and
    the plan budgets the positions computed, as training does."""
    pairs = StorePairs(store)
    share = share_prompts and packing
    plan = plan_micro_batches(pairs.lengths(), token_budget=micro_batch_tokens, packing=packing,
                              row_budget=min(row_tokens, micro_batch_tokens), pad_to_multiple_of=pad_to_multiple_of,
                              seed=None, share_prompts=share)
    for mb in plan:
        if share:
            batch = collate_packed(pairs, mb, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of, share_prompts=True)
        else:
            batch = collate(pairs, mb, packing=packing, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of)
        yield batch, pairs.ids[batch.pair_indices.numpy()]


@torch.no_grad()
def compute_store_logps(model: nn.Module, store: Store, *, micro_batch_tokens: int = 4096, row_tokens: int = 2048,
                        chunk_size: int = 1024, progress: bool = False, ctx=None) -> dict[str, np.ndarray]:
    """Chosen and rejected log-prob sums of every pair of a store, and their LD-DPO tail sums (float64 arrays in
    store order, keys ``chosen``, ``rejected``, ``chosen_tail``, ``rejected_tail``).

    Under torchrun (`ctx` from prefpack.distributed) each rank scores every world-th micro-batch with its
    own full copy of the model, and the results are summed across ranks (each pair is scored by one rank).
    A model whose attention reads prompt groups scores each pair after one copy of its prompt (same values).
    """
    rank, world = (ctx.rank, ctx.world) if ctx is not None else (0, 1)
    was_training = model.training
    model.eval()
    keys = ("chosen", "rejected", "chosen_tail", "rejected_tail")
    table = np.zeros((len(keys) + 1, len(store)), dtype=np.float64)  # + how often each pair was scored
    batches = iter_store_batches(store, micro_batch_tokens=micro_batch_tokens, row_tokens=row_tokens,
                                 share_prompts=reads_prompt_groups(model))
    if progress and rank == 0:
        from tqdm import tqdm

        batches = tqdm(batches, desc="reference log-probs", unit="batch")
    for k, (batch, ids) in enumerate(batches):
        if k % world != rank:
            continue
        out = sequence_logps(model, batch, chunk_size=chunk_size, pair_tails=True)
        total, tail = out.logp_sum.double().cpu().numpy(), out.tail_sum.double().cpu().numpy()
        for row, values in enumerate((total[0::2], total[1::2], tail[0::2], tail[1::2])):
            table[row, ids] = values
        table[-1, ids] += 1
    model.train(was_training)
    if world > 1:
        both = torch.from_numpy(table)
        ctx.all_reduce_sum(both)
        table = both.numpy()
    assert (table[-1] == 1).all(), "every pair must be scored exactly once"
    return {k: table[i] for i, k in enumerate(keys)}


@torch.no_grad()
def compute_kto_store_logps(model: nn.Module, store: Store, *, paired_as_kto: bool = False, seed: int = 0,
                            micro_batch_tokens: int = 4096, row_tokens: int = 2048, chunk_size: int = 1024,
                            progress: bool = False, ctx=None) -> dict[str, np.ndarray]:
    """Reference log-prob sums of every example's completion and of its fixed KL sequence (seed ``seed``).

    Returns float64 ``completion`` and ``kl`` and int64 ``kl_partner`` arrays in the view's example order
    (``kl`` is NaN and ``kl_partner`` -1 when the store has a single example). Under torchrun (``ctx`` from
    ``prefpack.distributed``) each rank scores every world-th micro-batch and the results are summed."""
    rank, world = (ctx.rank, ctx.world) if ctx is not None else (0, 1)
    view = UnpairedView(store, paired_as_kto=paired_as_kto)
    n = len(view)
    partners = fixed_kl_partners(view.groups, seed)
    completion = np.zeros(n)
    kl = np.zeros(n)
    seen = np.zeros(n)
    was_training = model.training
    model.eval()
    row_budget = min(row_tokens, micro_batch_tokens)
    # A kernel that reads prompt groups scores a group's examples after one copy of their prompt (and their KL
    # sequences likewise): groups of examples with identical prompts, in order of first appearance; else one each.
    share = reads_prompt_groups(model)
    kl_completion = view.completion_len[np.maximum(partners, 0)]
    members = ([np.array([i]) for i in range(n)] if not share else
               np.split(np.argsort(view.groups, kind="stable"), np.cumsum(np.bincount(view.groups))[:-1]))

    sizes = np.stack([view.completion_len, kl_completion], axis=1)  # both passes must fit a row
    if share:  # a group longer than a row is cut into runs that fit
        members = [run for g in members for run in fit_runs(g, int(view.prompt_len[g[0]]), sizes, row_budget)]
    first = np.array([g[0] for g in members], dtype=np.int64)
    cost = view.prompt_len[first] + np.array([view.completion_len[g].sum() for g in members], dtype=np.int64)
    kl_cost = view.prompt_len[first] + np.array([kl_completion[g].sum() for g in members], dtype=np.int64)
    plans = plan_groups(cost, token_budget=micro_batch_tokens, row_budget=row_budget, seed=None)
    if progress and rank == 0:
        from tqdm import tqdm

        plans = tqdm(plans, desc="reference log-probs", unit="batch")
    for k, mb in enumerate(plans):
        if k % world != rank:
            continue
        gs = [g for r in mb for g in r]
        flat = [int(i) for g in gs for i in members[g]]
        at, local = 0, []
        for r in mb:
            local.append(list(range(at, at + len(r))))
            at += len(r)
        shared = share and len(gs) < len(flat)  # some group holds several examples
        main = collate_groups([(view.prompt(first[g]), tuple(view.completion(i) for i in members[g])) for g in gs],
                              local, ids=[int(first[g]) for g in gs], share_prompts=shared)
        logp = sequence_logps(model, main, chunk_size=chunk_size).logp_sum
        completion[flat] = logp[: len(flat)].double().cpu().numpy()
        seen[flat] += 1
        if (partners[flat] >= 0).all():  # every example has a partner, except in a one-example store
            kl_batch = collate_groups([(view.prompt(first[g]), tuple(view.completion(int(partners[i]))
                                                                     for i in members[g])) for g in gs],
                                      balanced_rows(kl_cost[gs], row_budget), ids=[int(first[g]) for g in gs],
                                      share_prompts=shared)
            logp = sequence_logps(model, kl_batch, chunk_size=chunk_size).logp_sum
            kl[flat] = logp[: len(flat)].double().cpu().numpy()
    model.train(was_training)
    if world > 1:
        both = torch.from_numpy(np.stack([completion, kl, seen])).to(ctx.device)  # NCCL needs device tensors
        ctx.all_reduce_sum(both)
        completion, kl, seen = (x.numpy() for x in both.cpu())
    assert (seen == 1).all(), "every example must be scored exactly once"
    kl = np.where(partners >= 0, kl, np.nan)
    return {"completion": completion, "kl": kl, "kl_partner": partners.astype(np.int64)}


