"""The reference a loss compares the policy with: a frozen copy, the policy with its adapter off, a
precomputed sidecar, or none. The reference never runs under autograd."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from prefpack.batching.collate import Batch
from prefpack.forward import SequenceLogps

__all__ = ["Reference"]


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
