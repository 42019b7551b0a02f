"""The reference a loss compares the policy with, one class per ``reference.mode``: a frozen copy, the policy
with its adapter off, a precomputed sidecar (which owns its tables), or none. Objectives ask every mode one
question, :meth:`Reference.sequence_logps` (a batch's per-sequence sums, addressed by its sequence keys), so no
code outside this module tests the mode's name. The reference never runs under autograd."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from prefpack.batching.collate import Batch
from prefpack.data.store import Store
from prefpack.model import ModelError, SequenceLogps, SequenceOutput
from prefpack.reference.sidecar import KeyedLogps, KeySpace, ReferenceMismatch, read_keyed_sidecar
from prefpack.sequence_parallel import SINGLE_SP, SeqPar

__all__ = ["REFERENCE_MODES", "AdapterReference", "CopyReference", "NoReference",
           "PrecomputedReference", "Reference", "ReferenceSetup", "as_sequence_output", "make_reference"]


def as_sequence_output(out) -> SequenceOutput:
    """A forward's result as a :class:`SequenceOutput` (a wrapper may hand back a plain tuple of its fields)."""
    return out if isinstance(out, SequenceOutput) else SequenceOutput(*out)


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
    (only ``copy``: TR-DPO syncs it and checkpoints save it); ``pair_tails``: also LD-DPO's tail sums; ``seq``: the
    rank's sequence group its forwards run on (``prefpack.parallel``)."""

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
        self.token_logps = False
        self.seq = SINGLE_SP

    def configure(self, *, chunk_size: int, pair_tails: bool, seq: SeqPar = SINGLE_SP,
                  token_logps: bool = False) -> None:
        """The run's head chunk size, whether LD-DPO needs tail sums (known once budgets are resolved), the
        sequence group the forwards run on, and whether the objective reads per-token log-probs (a KL per token)."""
        self.chunk_size, self.pair_tails, self.seq, self.token_logps = chunk_size, pair_tails, seq, token_logps
        if self.module is not None:
            self.module.chunk_size, self.module.pair_tails, self.module.seq = chunk_size, pair_tails, seq
            self.module.token_logps = token_logps

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
    def sequence_logps(self, batch: Batch) -> SequenceOutput | None:
        """The reference's sums of the batch's sequences, in its sequence order (``logp_sum``), and LD-DPO's tails
        when ``pair_tails`` (``tail_sum``: [S], or [2, P] for a batch's ``tail_pairs``); None without a reference."""
        return as_sequence_output(self.outputs(batch))


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
        self.module = wrap(SequenceLogps(self.model, chunk_size=self.chunk_size, pair_tails=self.pair_tails,
                                         seq=self.seq, token_logps=self.token_logps), self.model)

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
                    self.policy, self.chunk_size, pair_tails=self.pair_tails, seq=self.seq,
                    token_logps=self.token_logps)
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
        self.tables: dict[Path, KeyedLogps] = {}

    def load(self, store: Store, space: KeySpace, *, need_tails: bool = False) -> None:
        """The sidecar of a store for an objective's key space (``Objective.key_space()``)."""
        self.tables[Path(store.path)] = read_keyed_sidecar(store, space, reference_hash=self.reference_hash,
                                                           need_tails=need_tails)

    @torch.no_grad()
    def sequence_logps(self, batch: Batch) -> SequenceOutput:
        if batch.sequence_keys is None or batch.key_store is None:
            raise ValueError("a precomputed reference reads a batch by its sequence keys; this batch has none")
        table = self.tables.get(Path(batch.key_store))
        if table is None:
            raise ReferenceMismatch(f"no precomputed reference log-probs loaded for the store {batch.key_store!r}")
        tail = None
        tail_keys = batch.sequence_keys if batch.tail_pairs is None else batch.tail_keys
        if self.pair_tails and table.tails is not None and tail_keys is not None:
            tail = torch.as_tensor(table.tails[tail_keys.cpu().numpy()])
        logps = torch.as_tensor(table.logps[batch.sequence_keys.cpu().numpy()])
        if torch.isnan(logps).any() or (tail is not None and torch.isnan(tail).any()):
            raise ReferenceMismatch(f"the sidecar of {batch.key_store!r} holds no reference log-probs for some "
                                    "sequences this run reads; run precompute-ref again on this store")
        return SequenceOutput(logps, batch.completion_tokens, tail_sum=tail)


class NoReference(Reference):
    """No reference (reference-free losses)."""

    mode = "none"

    def sequence_logps(self, batch: Batch) -> None:
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
