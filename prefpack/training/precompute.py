"""``prefpack precompute-ref``: the run's own objective evaluated over its whole store, with the reference's sums
recorded by sequence key into the store's sidecar. Each store kind is laid out in one place (its objective), so
the sidecar holds exactly the sequences training reads, laid out as training lays them out (prompts once where the
kernel reads prompt groups, KTO's fixed KL sequences beside their examples)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from prefpack.objectives import (
    Objective,
    Term,
    make_objectives,
    open_store,
    read_only_unpaired,
    settings_from_config,
)
from prefpack.parallel import ONE_PROCESS, Parallel
from prefpack.progress import progress as show_progress
from prefpack.reference import (
    CopyReference,
    KeyedLogps,
    NoReference,
    check_sidecar_writable,
    existing_sidecar,
    sidecar_path,
    write_keyed_sidecar,
)

__all__ = ["PrecomputeOptions", "precompute_reference", "record_reference", "scoring_objective"]


@dataclass
class PrecomputeOptions:
    """What ``precompute-ref`` is asked (its flags); budgets are numbers or ``"auto"``."""

    model: str
    data: str
    kto: bool = False
    seed: int = 0
    micro_batch_tokens: int | str = "auto"
    chunk_size: int | str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    allow_tokenizer_mismatch: bool = False
    trust_remote_code: bool = False  # run code the model, tokenizer or processor folder names (prefpack.remote_code)
    overwrite: bool = False  # score again even when the store holds this very sidecar already


def scoring_objective(store, *, kto: bool, seed: int, micro_batch_tokens: int, row_tokens: int, chunk_size: int,
                      shares_prompts: bool, group_by_prompt: bool | None = None, vision=None) -> Objective:
    """The objective whose keys a sidecar of ``store`` holds: KTO (the store's examples with their fixed KL
    sequences of ``seed``), a pair store's pairs (over its prompt groups when its pairs repeat prompts, so each
    prompt and completion is computed once; ``group_by_prompt`` decides instead when given), or a ranked store's
    prompt groups."""
    from prefpack.config import Config
    from prefpack.data.views import UnpairedView

    cfg = Config()
    cfg.data.paired_as_kto = kto  # read only for a pair store
    cfg.data.packing = True
    cfg.train.seed = seed
    cfg.loss.kl_pairing = "fixed"
    if kto:  # a one-example store has no KL partner: its completion alone
        several = len(UnpairedView(store, paired_as_kto=cfg.data.paired_as_kto)) > 1
        terms = [Term("kto" if several else "apo_zero_unpaired")]
    else:
        terms = [Term("sigmoid")]
    repeats = bool((store.meta.get("counts", {}).get("repeated_prompts") or {}).get("prompts"))
    if group_by_prompt is not None:
        repeats = group_by_prompt
    settings = settings_from_config(cfg, pad_id=0, micro_batch_tokens=micro_batch_tokens, row_tokens=row_tokens,
                                    chunk_size=chunk_size, shares_prompts=shares_prompts, vision=vision)
    task, _ = make_objectives(settings, terms, store, None, NoReference(), kto=kto, group_by_prompt=repeats,
                              log=lambda _m: None)
    return task


@torch.no_grad()
def record_reference(task: Objective, model: nn.Module, *, parallel: Parallel = ONE_PROCESS,
                     progress: bool = False) -> KeyedLogps:
    """The reference sums (and LD-DPO tails, where the key space keeps them) of every sequence the objective reads
    over its whole store, by sequence key; float64, NaN at keys no example reads.

    Under torchrun (``parallel``) the store's micro-batches are dealt to the ranks as evaluation deals them, each rank
    runs its share with its own full copy of the model (a sequence group's ranks the same share, each its token
    shards), and the tables are summed across ranks."""
    ctx = parallel.dist
    space = task.key_space()
    reference = CopyReference(model, chunk_size=task.settings.chunk_size)
    reference.configure(chunk_size=task.settings.chunk_size, pair_tails=space.tails, seq=parallel.seq)
    share = parallel.share(task, np.arange(len(task)), seed=None)
    table = np.zeros((4, space.size))  # sums, times scored, tails, times scored
    planned = [p for p, w in zip(share.planned, share.weights) if w]  # padding batches only keep ranks in step
    record = parallel.counts_sums  # every rank of a group returns the group's sums: recorded once
    ahead = planned if task.settings.vision is not None else []  # images: read the next ones meanwhile
    # a bar on a terminal, plain lines in a batch log
    shown = show_progress(planned, desc="reference log-probs", unit="batch", enabled=progress and ctx.is_main)
    for i, p in enumerate(shown):
        if ahead:
            task.prefetch(ahead[i + 1:i + 3])
        for part in task.reference_batches(task.collate(p)):
            out = reference.sequence_logps(part)
            if not record:
                continue
            keys = part.sequence_keys.numpy()
            table[0, keys] = out.logp_sum[:len(keys)].double().cpu().numpy()
            table[1, keys] += 1
            tail_keys = part.sequence_keys if part.tail_pairs is None else part.tail_keys
            if space.tails and tail_keys is not None:
                tails = out.tail_sum if part.tail_pairs is not None else out.tail_sum[:len(keys)]
                table[2, tail_keys.numpy().reshape(-1)] = tails.double().cpu().numpy().reshape(-1)
                table[3, tail_keys.numpy().reshape(-1)] += 1
    if ctx.world > 1:
        both = torch.from_numpy(table).to(ctx.device)  # NCCL needs device tensors
        ctx.all_reduce_sum(both)
        table = both.cpu().numpy()
    if (table[1] > 1).any() or (table[3] > 1).any():
        raise RuntimeError("precompute-ref scored a sequence twice; the objective's keys overlap")
    logps, tails = _filled(table[0], table[1], space.copies), _filled(table[2], table[3], space.copies)
    return KeyedLogps(logps, tails if space.tails else None)


def _filled(values: np.ndarray, seen: np.ndarray, copies: np.ndarray | None) -> np.ndarray:
    """``values`` where scored, each repeated sequence's value at its own key too, NaN where nothing was."""
    out = np.where(seen > 0, values, np.nan)
    if copies is not None:
        take = (seen == 0) & (seen[copies] > 0)
        out[take] = values[copies[take]]
    return out


def load_reference_model(name_or_path: str, dtype: str, device: torch.device, *,
                         trust_remote_code: bool = False) -> nn.Module:
    """The reference model precompute-ref scores with, through the loading seam: the weights and compute dtype
    training uses (float32 masters under bfloat16 autocast on CUDA), so its log-probs and weights hash match the
    reference a run computes live; ``auto`` attention for that device and compute dtype."""
    from prefpack.model import WeightSpec, choose_attention, load_weights
    from prefpack.precision import resolve_precision

    precision = resolve_precision(dtype, "auto", device)
    attn = choose_attention("auto", device, precision.compute, source=name_or_path,
                            trust_remote_code=trust_remote_code).name
    return load_weights(WeightSpec(name_or_path, "reference", device, precision=precision, attn=attn,
                                   trust_remote_code=trust_remote_code))


def precompute_reference(opts: PrecomputeOptions, *, parallel: Parallel = ONE_PROCESS, log=print,
                         progress: bool = True, model: nn.Module | None = None) -> dict:
    """Score a store with a reference model and write its sidecar (rank 0); returns what ``precompute-ref`` prints
    and the weights hash the sidecar is tagged with. ``model``: one in memory (on-policy rounds: the policy at the
    round's start), scored in place of ``opts.model``, which then only names it; its training state is put back."""
    from prefpack.data.store import Store
    from prefpack.model import (
        check_model_source,
        pick_device,
        resolve_tokenizer,
    )

    kto = opts.kto or read_only_unpaired(Store(opts.data).kind)
    store = open_store(opts.data, "reference", unpaired=kto, paired_as_kto=opts.kto)
    check_sidecar_writable(store)  # at once, not after the whole store is scored (every rank: none waits on rank 0)
    ctx = parallel.dist
    if model is None:
        check_model_source(opts.model, "--model")
        resolve_tokenizer(opts.model, store.meta, store.tokenizer_path(),
                          allow_mismatch=opts.allow_tokenizer_mismatch, trust_remote_code=opts.trust_remote_code)
        device = ctx.device if opts.device == "auto" else pick_device(opts.device)
        model = load_reference_model(opts.model, opts.dtype, device, trust_remote_code=opts.trust_remote_code)
    else:
        device = next(model.parameters()).device
    with _scored_as_reference(model):
        return _precompute(opts, store, model, device, kto, parallel, log, progress)


def _precompute(opts, store, model, device, kto, parallel, log, progress) -> dict:
    from prefpack.model import check_vocab_fits, kernel_of, weights_hash
    from prefpack.model.sharded import check_model

    ctx = parallel.dist

    check_model(model, parallel.seq)  # a kernel or head count the sequence groups cannot shard, refused now
    check_vocab_fits(model, store.meta, opts.data)
    budgets = _scoring_budgets(opts, model, device, log)
    from prefpack.training.feed import run_images

    task = scoring_objective(store, kto=kto, seed=opts.seed, micro_batch_tokens=budgets.micro_batch_tokens,
                             row_tokens=budgets.row_tokens, chunk_size=budgets.chunk_size,
                             shares_prompts=kernel_of(model).reads_prompt_groups,
                             vision=run_images(model, [("reference", store)], trust_remote_code=opts.trust_remote_code))
    space = task.key_space()
    reference_hash = weights_hash(model)
    settings = f"dtype {opts.dtype}, device {device.type}"  # what else decides the numbers (bfloat16 or not)
    table = None if opts.overwrite else existing_sidecar(store, space, reference_hash=reference_hash,
                                                         settings=settings)
    if table is not None:  # every rank reads the same file and skips alike
        if ctx.is_main:
            log(f"note: {sidecar_path(store, space)} already holds these reference log-probs (same reference weights "
                f"{reference_hash[:12]}, same store, {settings}): not scored again; --overwrite scores them anew")
        path, skipped = sidecar_path(store, space), True
    else:
        table = record_reference(task, model, parallel=parallel, progress=progress)
        skipped = False
    if not ctx.is_main:
        return {}
    if not skipped:
        path = write_keyed_sidecar(store, space, table, reference_hash=reference_hash, reference_name=opts.model,
                                   settings=settings)
    scored = np.isfinite(table.logps)
    return {"sidecar": str(path), "kind": space.kind, "rows": len(store), "sequences": int(scored.sum()),
            "reference_hash": reference_hash,
            "mean_logp": float(table.logps[scored].mean()) if scored.any() else None,
            **({"kl_seed": opts.seed} if kto else {}), **({"skipped": True} if skipped else {})}


@contextmanager
def _scored_as_reference(model: nn.Module):
    """The model frozen while it scores (``CopyReference`` freezes it), its training mode and trainable flags put
    back after: a policy in memory scored as its own reference trains on."""
    training = model.training
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for p in trainable:
            p.requires_grad_(True)
        model.train(training)


def _scoring_budgets(opts: PrecomputeOptions, model: nn.Module, device: torch.device, log):
    """precompute-ref's budgets: the flags, or from the device (nothing trains, so all free memory is for it)."""
    from types import SimpleNamespace

    from prefpack.engine.budgets import resolve_budgets
    from prefpack.engine.memory import Holding
    from prefpack.model import uses_flash_attention

    train = SimpleNamespace(micro_batch_tokens=opts.micro_batch_tokens, chunk_size=opts.chunk_size)
    budgets, line = resolve_budgets(train, SimpleNamespace(max_tokens_per_row="auto"), model, device,
                                    autocast=False, checkpointing=False, flattened=uses_flash_attention(model),
                                    holding=Holding(training=False))
    log(line)
    return budgets

