"""Mixed precision: compute in bfloat16, keep float32 master weights and float32 optimizer state.

A bfloat16 weight cannot take an AdamW update smaller than half its ulp (about 2^-9 of its size); at DPO learning
rates (5e-7 .. 5e-6) that is most updates (measured: 0.49% of the weights changed in 3 steps at lr 5e-7 with
bfloat16 weights, 53% in float32). So by default the weights stay float32 and the model runs under
``torch.autocast`` in the compute dtype.

Why autocast rather than bfloat16 working copies of float32 masters: gradients come out in float32 and are
accumulated in float32 over the micro-batches of a step; DDP all-reduces them as they are; a checkpoint is the
weights themselves, so resume stays exact; and there is no second copy of the parameters to keep in sync. The
price is one cast of each weight per forward (amortised over micro-batches of thousands of tokens).

The reference runs the same way as the policy (same weights dtype, same autocast), so at step 0 its log-probs
equal the policy's exactly, as they do in float32: the DPO loss starts at ln 2 and the rewards at 0.

Under FSDP2 with several ranks the weights are float32 and FSDP2's ``MixedPrecisionPolicy`` casts them to the
compute dtype per layer (no autocast); see ``prefpack.distributed.wrap``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Precision", "compute_context", "lost_update_fraction", "pure_bfloat16_warning", "resolve_precision",
           "set_compute_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ATTR = "_prefpack_compute_dtype"


@dataclass(frozen=True)
class Precision:
    """``weights``: dtype the model is loaded in (the master weights); ``compute``: dtype its matmuls run in;
    ``four_bit``: the linear layers' base weights held in bitsandbytes' 4 bits instead (``nf4`` | ``fp4``, with
    ``double_quant``: its scales quantised too), LoRA adapters trained over them."""

    weights: torch.dtype
    compute: torch.dtype
    autocast: bool = False
    sharded_mixed: bool = False  # FSDP2 casts per layer; no autocast
    four_bit: str | None = None
    double_quant: bool = False

    def describe(self) -> str:
        w, c = _name(self.weights), _name(self.compute)
        if self.four_bit:
            double = " (double quant)" if self.double_quant else ""
            return (f"4-bit {self.four_bit.upper()} base weights{double}, embeddings, norms and head {w}, compute {c}"
                    f"{' (autocast)' if self.autocast else ''}, LoRA adapters float32")
        if self.sharded_mixed:
            return f"{c} compute, {w} master weights (FSDP2 mixed precision)"
        if self.autocast and self.weights == self.compute:
            return f"{c} compute (autocast), {w} frozen base weights, float32 LoRA adapters"
        if self.autocast:
            return f"{c} compute (autocast), {w} master weights and optimizer state"
        return f"{c} weights and compute"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_precision(model_dtype: str, master_dtype: str, device: torch.device, *,
                      fsdp_sharded: bool = False, lora: bool = False) -> Precision:
    """The run's precision from ``model.dtype`` (compute) and ``optim.master_dtype`` (weights).

    ``auto`` compute is bfloat16 on CUDA and float32 elsewhere; ``auto`` masters are float32. float16 compute
    (inference only: eval and precompute-ref) keeps float16 weights. With LoRA only the adapters train: the
    frozen base stays in the compute dtype and peft keeps the adapters in float32, under autocast.
    """
    compute = DTYPES[model_dtype] if model_dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    if compute in (torch.float16, torch.float32):
        return Precision(compute, compute)
    if master_dtype == "bfloat16":
        return Precision(compute, compute)
    if lora:
        return Precision(compute, compute, autocast=True)
    if fsdp_sharded:
        return Precision(torch.float32, compute, sharded_mixed=True)
    return Precision(torch.float32, compute, autocast=True)


def set_compute_dtype(model: nn.Module, precision: Precision) -> None:
    """Record on the model how it runs, so every caller of ``prefpack.model.forward`` (policy, reference, eval,
    precompute-ref) computes the same way without passing the precision around."""
    setattr(model, _ATTR, precision.compute if precision.autocast else None)


def compute_context(model: nn.Module, device: torch.device):
    """``torch.autocast`` in the model's recorded compute dtype, or a no-op."""
    dtype = getattr(model, _ATTR, None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def lost_update_fraction(params: list[torch.Tensor], lr: float) -> float:
    """Fraction of bfloat16 weights for which an update of size ``lr`` rounds away (|lr| < half an ulp).

    An Adam step moves a weight by about ``lr`` (|m / sqrt(v)| is about 1 in the first steps and at most about 1
    after). bfloat16 keeps 8 significant bits: for |w| = f * 2^e with f in [0.5, 1) the ulp is 2^(e - 8).
    Zero weights are counted as keeping their update.
    """
    lost = total = 0
    for p in params:
        w = p.detach().float().flatten()
        _, exp = torch.frexp(w)
        half_ulp = torch.ldexp(torch.ones_like(w), exp - 9)
        lost += int(((half_ulp > lr) & (w != 0)).sum())
        total += w.numel()
    return lost / max(total, 1)


def pure_bfloat16_warning(params: list[torch.Tensor], lr: float) -> str:
    frac = lost_update_fraction(params, lr)
    return (f"warning: optim.master_dtype=bfloat16 trains bfloat16 weights directly: at lr {lr:g} an update of that "
            f"size is rounded away for every weight with |w| > about {256 * lr:.2g}, which is {frac:.1%} of the "
            "trained weights; leave optim.master_dtype at auto (float32 masters) unless memory forces this")
