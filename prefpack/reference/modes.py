"""The reference a loss compares the policy with, one class per ``reference.mode``: a frozen copy, the policy
with its adapter off, a precomputed sidecar (which owns its tables), or none. Objectives ask every mode the same
two questions (:meth:`Reference.pair_logps`, :meth:`Reference.example_logps`), so no code outside this module
tests the mode's name. The reference never runs under autograd."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from prefpack.batching.collate import Batch
from prefpack.data.store import Store
from prefpack.data.views import UnpairedView
from prefpack.model import ModelError, SequenceLogps
from prefpack.reference.sidecar import (
    KTO_SIDECAR_NAME,
    RANKED_SIDECAR_NAME,
    SIDECAR_NAME,
    ReferenceMismatch,
    read_kto_sidecar,
    read_ranked_sidecar,
    read_sidecar,
)

__all__ = ["REFERENCE_MODES", "AdapterReference", "CopyReference", "NoReference", "PrecomputedReference",
           "Reference", "ReferenceSetup", "make_reference"]


@dataclass
class ReferenceSetup:
    """What a mode may need at set-up, each computed only if the mode asks: ``load()`` the reference weights as a
    model run like the policy, ``weights_hash()`` of the reference weights (what a sidecar is tagged with), and
    whether LoRA is on."""

    load: Callable[[], nn.Module]
    weights_hash: Callable[[], str]
    lora: bool = False


class Reference:
    """What every reference mode answers. ``module`` maps a batch to a ``prefpack.model.forward.SequenceOutput`` (it may
    be wrapped for several ranks: FSDP2 shards a frozen copy too); ``model`` is a reference model held in memory
    (only ``copy``: TR-DPO syncs it and checkpoints save it); ``pair_tails``: also LD-DPO's tail sums."""

    mode = ""
    model: nn.Module | None = None
    reads_weights = False  # whether the mode reads the reference weights (reference.model) at set-up

    @classmethod
    def set_up(cls, setup: ReferenceSetup) -> Reference:
        """The reference of this mode for a run (modes override what they need from ``setup``)."""
        return cls()

    def bind_policy(self, policy: nn.Module) -> None:
        """The policy as finally wrapped (LoRA); only the adapter mode runs it."""

    def __init__(self, *, chunk_size: int = 1024):
        self.chunk_size = chunk_size
        self.module: nn.Module | None = None
        self.pair_tails = False

    def configure(self, *, chunk_size: int, pair_tails: bool) -> None:
        """The run's head chunk size and whether LD-DPO needs tail sums (known once budgets are resolved)."""
        self.chunk_size, self.pair_tails = chunk_size, pair_tails
        if self.module is not None:
            self.module.chunk_size, self.module.pair_tails = chunk_size, pair_tails

    def attach(self, wrap, policy_module: nn.Module) -> None:
        """Give the reference its training-time forward: ``wrap(module, model)`` wraps a module for the run's
        ranks; ``policy_module`` is the policy's own (wrapped) forward."""

    def release(self) -> None:
        """Drop what the reference holds in memory (before the final save)."""
        self.model = self.module = None

    def outputs(self, batch: Batch):
        """The reference forward over a batch (modes that run a model)."""
        raise ValueError(f"reference mode {self.mode!r} computes no log-probs")

    @torch.no_grad()
    def sequence_logps(self, batch: Batch) -> torch.Tensor:
        return self.outputs(batch)[0]

    @torch.no_grad()
    def pair_logps(self, batch: Batch, store: Store, ids: np.ndarray, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor | None, ...] | None:
        """``(chosen, rejected, chosen_tail, rejected_tail)`` reference sums of a pair batch in its pair order
        (tails None unless ``pair_tails``); None when there is no reference. ``ids``: the pairs' store rows."""
        out = self.outputs(batch)
        seq, tail = out[0].to(device, dtype), out[3] if len(out) > 3 else None
        tails = (None, None) if tail is None else (tail[0::2].to(device, dtype), tail[1::2].to(device, dtype))
        return seq[0::2], seq[1::2], *tails

    @torch.no_grad()
    def example_logps(self, batch: Batch, store: Store, ids: np.ndarray, *, kl: bool, device: torch.device,
                      dtype: torch.dtype) -> torch.Tensor:
        """Reference sums of a KTO batch's sequences (``kl``: its KL sequences), one per example of ``ids``."""
        n = int(batch.completion_tokens.shape[0])
        return self.sequence_logps(batch)[:n].to(device=device, dtype=dtype)

    @torch.no_grad()
    def completion_logps(self, batch: Batch, store: Store, rows: np.ndarray, device: torch.device,
                         dtype: torch.dtype, *, pairs: np.ndarray | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Reference sums of a prompt-group batch's sequences, one per completion (``rows``: their keys in sequence
        order, ``PromptGroups.rows``: a ranked store's rows, or ``2 * pair + side`` in a pair store), and LD-DPO's
        [2, P] tails of the batch's ``tail_pairs`` (None unless ``pair_tails``; ``pairs``: a pair store's rows of
        those pairs, where a precomputed reference reads them); None when there is no reference."""
        out = self.outputs(batch)
        tail = out[3] if len(out) > 3 and out[3] is not None else None
        return out[0].to(device=device, dtype=dtype), None if tail is None else tail.to(device=device, dtype=dtype)


class CopyReference(Reference):
    """A frozen copy of the reference weights, run exactly like the policy (same dtype and autocast)."""

    mode = "copy"
    reads_weights = True

    @classmethod
    def set_up(cls, setup: ReferenceSetup) -> CopyReference:
        return cls(setup.load())

    def __init__(self, model: nn.Module, *, chunk_size: int = 1024):
        super().__init__(chunk_size=chunk_size)
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.module = SequenceLogps(model, chunk_size=chunk_size)

    def attach(self, wrap, policy_module: nn.Module) -> None:
        self.module = wrap(SequenceLogps(self.model, chunk_size=self.chunk_size, pair_tails=self.pair_tails),
                           self.model)

    @torch.no_grad()
    def outputs(self, batch: Batch):
        return self.module(batch)


class AdapterReference(Reference):
    """The policy itself with its LoRA adapter disabled: no second copy of the weights."""

    mode = "adapter"

    @classmethod
    def set_up(cls, setup: ReferenceSetup) -> AdapterReference:
        if not setup.lora:
            raise ModelError("reference.mode 'adapter' needs lora.enabled=true (the reference is the policy with "
                             "its LoRA adapter disabled)")
        return cls()

    def __init__(self, policy: nn.Module | None = None, *, chunk_size: int = 1024):
        super().__init__(chunk_size=chunk_size)
        self.policy = policy

    def bind_policy(self, policy: nn.Module) -> None:
        self.policy = policy

    def attach(self, wrap, policy_module: nn.Module) -> None:
        self.module = policy_module

    @torch.no_grad()
    def outputs(self, batch: Batch):
        was_training = self.policy.training
        self.policy.eval()  # dropout is off anyway; eval keeps the reference pass free of train-only hooks
        try:
            with self.policy.disable_adapter():
                module = self.module if self.module is not None else SequenceLogps(
                    self.policy, self.chunk_size, pair_tails=self.pair_tails)
                return module(batch)
        finally:
            self.policy.train(was_training)


class PrecomputedReference(Reference):
    """Log-probs read from each store's sidecar (``prefpack precompute-ref``): no reference model in memory.
    It owns the tables, one per store (the eval store needs its own)."""

    mode = "precomputed"
    reads_weights = True

    @classmethod
    def set_up(cls, setup: ReferenceSetup) -> PrecomputedReference:
        return cls(reference_hash=setup.weights_hash())

    def __init__(self, *, reference_hash: str | None = None, chunk_size: int = 1024):
        super().__init__(chunk_size=chunk_size)
        self.reference_hash = reference_hash
        self.tables: dict[Path, tuple | dict] = {}

    def load_pairs(self, store: Store, *, need_tails: bool = False) -> None:
        self.tables[Path(store.path)] = read_sidecar(Path(store.path) / SIDECAR_NAME, store,
                                                     reference_hash=self.reference_hash, need_tails=need_tails)

    def load_examples(self, view: UnpairedView, *, partners: np.ndarray | None) -> None:
        self.tables[Path(view.store.path)] = read_kto_sidecar(Path(view.store.path) / KTO_SIDECAR_NAME, view,
                                                              reference_hash=self.reference_hash, partners=partners)

    def _table(self, store: Store):
        table = self.tables.get(Path(store.path))
        if table is None:
            raise ReferenceMismatch(f"no precomputed reference log-probs loaded for the store {str(store.path)!r}")
        return table

    def pair_logps(self, batch, store, ids, device, dtype):
        table = (*self._table(store), None, None)[:4]
        return tuple(None if t is None else torch.as_tensor(t[ids], device=device, dtype=dtype) for t in table)

    def example_logps(self, batch, store, ids, *, kl, device, dtype):
        values = self._table(store)["kl" if kl else "completion"][ids]
        return torch.as_tensor(values, device=device, dtype=dtype)

    def load_completions(self, store: Store) -> None:
        self.tables[Path(store.path)] = read_ranked_sidecar(Path(store.path) / RANKED_SIDECAR_NAME, store,
                                                            reference_hash=self.reference_hash)

    def completion_logps(self, batch, store, rows, device, dtype, *, pairs=None):
        table = self._table(store)
        if store.kind != "pairs":
            return torch.as_tensor(table["completion"][rows], device=device, dtype=dtype), None
        # a pair store read as prompt groups: keys 2 * pair + side (PairGroups); the drawn pairs' tails per pair
        rows = np.asarray(rows, dtype=np.int64)
        values = np.where(rows % 2 == 0, table[0][rows // 2], table[1][rows // 2])
        tails = None
        if self.pair_tails and pairs is not None and table[2] is not None:
            tails = torch.as_tensor(np.stack([table[2][pairs], table[3][pairs]]), device=device, dtype=dtype)
        return torch.as_tensor(values, device=device, dtype=dtype), tails


class NoReference(Reference):
    """No reference (reference-free losses)."""

    mode = "none"

    def pair_logps(self, batch, store, ids, device, dtype):
        return None

    def example_logps(self, batch, store, ids, *, kl, device, dtype):
        raise ValueError("this loss needs reference log-probs; reference.mode 'none' gives none")

    def completion_logps(self, batch, store, rows, device, dtype, *, pairs=None):
        return None


REFERENCE_MODES: dict[str, type[Reference]] = {
    cls.mode: cls for cls in (CopyReference, AdapterReference, PrecomputedReference, NoReference)}
"""Every ``reference.mode`` by name (the config's choices must be these: tests/test_layout.py checks)."""


def make_reference(mode: str, *, model: nn.Module | None = None, reference_hash: str | None = None,
                   chunk_size: int = 1024) -> Reference:
    """The reference object of a ``reference.mode`` from what it needs, given directly (tests, tools); a run uses
    ``REFERENCE_MODES[mode].set_up(ReferenceSetup(...))``."""
    if mode not in REFERENCE_MODES:
        raise ValueError(f"unknown reference mode {mode!r}; choose {', '.join(REFERENCE_MODES)}")
    if mode == "copy":
        if model is None:
            raise ValueError("reference.mode 'copy' needs a reference model")
        return CopyReference(model, chunk_size=chunk_size)
    if mode == "precomputed":
        return PrecomputedReference(reference_hash=reference_hash, chunk_size=chunk_size)
    return REFERENCE_MODES[mode](chunk_size=chunk_size)
