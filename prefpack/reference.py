"""Reference log-probs: a frozen copy, the policy with its adapter off, a precomputed sidecar, or none.

The reference never runs under autograd. The sidecar (`ref_logps.safetensors` beside the store) holds
one chosen and one rejected log-prob sum per pair (and, since LD-DPO, their sums past the shorter completion, so
one sidecar serves every `loss.ld_alpha`), tagged with the store's content hash and the
reference weights' hash, so training refuses a sidecar computed for other data or another model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from prefpack.data.packing import Batch, collate, plan_micro_batches
from prefpack.data.store import Store
from prefpack.forward import SequenceLogps, sequence_logps

SIDECAR_NAME = "ref_logps.safetensors"
SIDECAR_FORMAT = "prefpack-ref-logps"
SIDECAR_VERSION = "1"


class ReferenceMismatch(ValueError):
    """A sidecar that is missing, corrupt or does not match the store or the reference model."""


def store_hash(store: Store) -> str:
    files = store.meta.get("files", {})
    return f"{files.get('tokens.bin', {}).get('sha256', '')}:{files.get('index.bin', {}).get('sha256', '')}"


class StorePairs:
    """Indexable view of a pair store as (prompt, chosen, rejected) arrays, optionally over a subset."""

    def __init__(self, store: Store, ids: np.ndarray | None = None):
        self.store = store
        self.ids = np.arange(len(store)) if ids is None else np.asarray(ids, dtype=np.int64)
        idx = store.index
        self._lengths = np.stack([np.asarray(idx[self.ids, c]) for c in (1, 2, 3)], axis=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        p = self.store.pair(int(self.ids[i]))
        return p.prompt, p.chosen, p.rejected

    def lengths(self) -> np.ndarray:
        return self._lengths


def iter_store_batches(store: Store, *, micro_batch_tokens: int, row_tokens: int, packing: bool = True,
                       pad_id: int = 0, pad_to_multiple_of: int | None = None):
    """Every pair of a store once, in deterministic micro-batches; yields (batch, global pair ids)."""
    pairs = StorePairs(store)
    plan = plan_micro_batches(pairs.lengths(), token_budget=micro_batch_tokens, packing=packing,
                              row_budget=min(row_tokens, micro_batch_tokens), pad_to_multiple_of=pad_to_multiple_of,
                              seed=None)
    for mb in plan:
        batch = collate(pairs, mb, packing=packing, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of)
        yield batch, pairs.ids[batch.pair_indices.numpy()]


@torch.no_grad()
def compute_store_logps(model: nn.Module, store: Store, *, micro_batch_tokens: int = 4096, row_tokens: int = 2048,
                        chunk_size: int = 1024, progress: bool = False, ctx=None) -> dict[str, np.ndarray]:
    """Chosen and rejected log-prob sums of every pair of a store, and their LD-DPO tail sums (float64 arrays in
    store order, keys ``chosen``, ``rejected``, ``chosen_tail``, ``rejected_tail``).

    Under torchrun (`ctx` from prefpack.distributed) each rank scores every world-th micro-batch with its
    own full copy of the model, and the results are summed across ranks (each pair is scored by one rank).
    """
    rank, world = (ctx.rank, ctx.world) if ctx is not None else (0, 1)
    was_training = model.training
    model.eval()
    keys = ("chosen", "rejected", "chosen_tail", "rejected_tail")
    table = np.zeros((len(keys) + 1, len(store)), dtype=np.float64)  # + how often each pair was scored
    batches = iter_store_batches(store, micro_batch_tokens=micro_batch_tokens, row_tokens=row_tokens)
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


def write_sidecar(path: str | Path, store: Store, chosen: np.ndarray, rejected: np.ndarray, *,
                  reference_hash: str, reference_name: str, chosen_tail: np.ndarray | None = None,
                  rejected_tail: np.ndarray | None = None) -> Path:
    """Write the sidecar atomically (temporary name, then rename); the tails are optional (LD-DPO)."""
    from safetensors.numpy import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    meta = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "store_hash": store_hash(store),
            "reference_hash": reference_hash, "reference": reference_name, "pairs": str(len(store))}
    tensors = {"chosen": chosen, "rejected": rejected, "chosen_tail": chosen_tail, "rejected_tail": rejected_tail}
    save_file({k: np.ascontiguousarray(v, dtype=np.float64) for k, v in tensors.items() if v is not None}, str(tmp),
              metadata=meta)
    os.replace(tmp, path)
    return path


def read_sidecar(path: str | Path, store: Store, *, reference_hash: str | None,
                 need_tails: bool = False) -> tuple[np.ndarray, ...]:
    """Load a sidecar as ``(chosen, rejected, chosen_tail, rejected_tail)``, refusing one made for another store or
    (when given) other reference weights; the tails are None in a sidecar written before LD-DPO (refused when
    ``need_tails``)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ReferenceMismatch(f"no precomputed reference log-probs at {str(path)!r}; run "
                                f"`prefpack precompute-ref --model REF --data {store.path}` first")
    try:
        with safe_open(str(path), framework="numpy") as fh:
            meta = fh.metadata() or {}
            chosen, rejected = fh.get_tensor("chosen"), fh.get_tensor("rejected")
            names = set(fh.keys())
            tails = tuple(fh.get_tensor(k) if k in names else None for k in ("chosen_tail", "rejected_tail"))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ReferenceMismatch(f"{path}: cannot read reference log-probs ({exc})") from exc
    if meta.get("format") != SIDECAR_FORMAT or meta.get("version") != SIDECAR_VERSION:
        raise ReferenceMismatch(f"{path}: not a prefpack reference sidecar of version {SIDECAR_VERSION}")
    if meta.get("store_hash") != store_hash(store) or len(chosen) != len(store) or len(rejected) != len(store):
        raise ReferenceMismatch(f"{path} was computed for other data than the store {str(store.path)!r}; run "
                                "precompute-ref again on this store")
    if reference_hash is not None and meta.get("reference_hash") != reference_hash:
        raise ReferenceMismatch(
            f"{path} was computed with other reference weights ({meta.get('reference')!r}) than this run's "
            "reference; run precompute-ref again with the reference model of this run")
    if any(t is not None and len(t) != len(store) for t in tails) or (tails[0] is None) != (tails[1] is None):
        raise ReferenceMismatch(f"{path}: its tail log-probs do not match its pairs; run precompute-ref again")
    if need_tails and tails[0] is None:
        raise ReferenceMismatch(f"{path} was written by an earlier prefpack without the log-probs past the shorter "
                                "completion that loss.ld_alpha (LD-DPO) needs; run precompute-ref again on this store")
    return chosen, rejected, *tails


class Reference:
    """Reference log-prob sums of a micro-batch's sequences, never under autograd.

    `module` maps a batch to (logp_sum [S], n_tokens [S]) like `prefpack.forward.SequenceLogps`; it may be
    wrapped for several ranks (FSDP2 shards a frozen copy too). In adapter mode it is the policy's own
    module, run with the LoRA adapter disabled.
    """

    def __init__(self, mode: str, *, model: nn.Module | None = None, policy: nn.Module | None = None,
                 chunk_size: int = 1024, module: nn.Module | None = None):
        self.mode = mode
        self.model = model
        self.policy = policy
        self.chunk_size = chunk_size
        self.module = module
        self.pair_tails = False  # LD-DPO: also the sums past the shorter completion (set by train.build)
        if mode == "copy":
            assert model is not None
            model.eval()
            model.requires_grad_(False)
            if self.module is None:
                self.module = SequenceLogps(model, chunk_size=chunk_size)

    @torch.no_grad()
    def outputs(self, batch: Batch):
        """The reference forward (``prefpack.forward.SequenceOutput``) for copy/adapter modes."""
        if self.mode == "copy":
            return self.module(batch)
        if self.mode == "adapter":
            was_training = self.policy.training
            self.policy.eval()  # dropout is off anyway; eval keeps the reference pass free of train-only hooks
            try:
                with self.policy.disable_adapter():
                    module = self.module if self.module is not None else SequenceLogps(
                        self.policy, self.chunk_size, pair_tails=self.pair_tails)
                    return module(batch)
            finally:
                self.policy.train(was_training)
        raise ValueError(f"reference mode {self.mode!r} computes no log-probs")

    @torch.no_grad()
    def sequence_logps(self, batch: Batch) -> torch.Tensor:
        """Per-sequence reference sums for copy/adapter modes."""
        return self.outputs(batch)[0]

    @torch.no_grad()
    def logps(self, batch: Batch, global_ids: np.ndarray, device: torch.device,
              dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
        """Chosen and rejected reference sums of a pair batch, in its pair order (None in mode none), then their
        LD-DPO tail sums (None unless the module computes ``pair_tails``)."""
        if self.mode == "none":
            return None
        if self.mode == "precomputed":
            raise ValueError("precomputed reference log-probs are read by the task from its own store's sidecar")
        out = self.outputs(batch)
        seq, tail = out[0].to(device, dtype), out[3] if len(out) > 3 else None
        tails = (None, None) if tail is None else (tail[0::2].to(device, dtype), tail[1::2].to(device, dtype))
        return seq[0::2], seq[1::2], *tails


# ------------------------------------------------------------------------------------------------ TR-DPO


def _reshard(wrapper: nn.Module | None) -> None:
    """Put every FSDP2-sharded module of ``wrapper`` back to its sharded parameters (a no-grad forward leaves the
    root's gathered copy registered; changing that copy would be lost at the next reshard)."""
    if wrapper is None:
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for sub in wrapper.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


@torch.no_grad()
def sync_reference(policy: nn.Module, reference: nn.Module, alpha: float, *,
                   wrappers: tuple[nn.Module | None, ...] = ()) -> int:
    """TR-DPO's soft update (Gorbatovski et al. 2024, arXiv:2404.09656, Eq. 6), in place on the reference:

        ref <- alpha * policy + (1 - alpha) * ref

    computed as TRL's ``SyncRefModelCallback`` does (``ref.mul_(1 - alpha).add_(policy, alpha=alpha)``, in the
    parameters' dtype). Parameters are matched by name, not by order. Under DDP both are whole copies on every
    rank, so every rank computes the same result; under FSDP2 both models are sharded the same way, so each rank
    updates its own shard (``to_local``) and no communication is needed. ``wrappers`` are the FSDP2 roots to
    reshard first. Returns the number of parameters updated.
    """
    for wrapper in wrappers:
        _reshard(wrapper)
    ref_params = dict(reference.named_parameters())
    pol_params = dict(policy.named_parameters())
    if ref_params.keys() != pol_params.keys():
        only_ref = sorted(ref_params.keys() - pol_params.keys())[:3]
        only_pol = sorted(pol_params.keys() - ref_params.keys())[:3]
        raise ValueError("reference.sync needs the reference and the policy to have the same parameters; "
                         f"only in the reference: {only_ref}, only in the policy: {only_pol}")
    for name, ref in ref_params.items():
        pol = pol_params[name]
        ref_t = ref.to_local() if hasattr(ref, "to_local") else ref
        pol_t = pol.to_local() if hasattr(pol, "to_local") else pol
        if ref_t.shape != pol_t.shape:
            raise ValueError(f"reference.sync: parameter {name} has shape {tuple(ref_t.shape)} in the reference and "
                             f"{tuple(pol_t.shape)} in the policy (they must be sharded the same way)")
        ref_t.mul_(1.0 - alpha).add_(pol_t.to(ref_t.dtype), alpha=alpha)
    return len(ref_params)
