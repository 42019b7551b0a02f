"""Attention over a flattened packed micro-batch from sequence boundaries, with no mask: ``varlen``.

On CUDA, transformers' sdpa on a packed row builds a block mask from position ids and runs masked kernels over
the whole row (4.9-7.0% MFU measured on an H100), and cuDNN's sdpa plans anew for every packed shape. torch ships
a flash varlen kernel (``torch.nn.attention.varlen.varlen_attn``, no extra package) that reads the boundaries as
``cu_seqlens`` instead (29.6-37.8% MFU on the same rows). Registered through transformers' AttentionInterface as
``varlen`` (prefpack's CUDA default when flash-attn is not installed):

* the micro-batch arrives as one flattened row (``prefpack.model.forward`` drops row padding); the boundaries
  (``cu_seq_lens_q`` and ``max_length_q``, transformers' flash keyword names) are computed once per forward by the
  caller and passed down to every layer; without them they are derived from the position ids;
* causal attention; sliding-window layers through the kernel's window (query i sees keys i - w < j <= i);
* grouped-query attention: torch 2.13's kernel takes ``enable_gqa``, 2.11's does not, so key/value heads are
  repeated there;
* the kernel needs half precision on CUDA: float32 compute, CPU tensors (the tests) and anything the kernel
  cannot run go to :func:`reference_varlen`, a per-sequence causal sdpa loop that gives the same values;
* a padding mask or a cache (not a packed batch) goes to transformers' sdpa; logit softcapping is refused.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from prefpack.model.attention.packed_sdpa import causal_block, no_mask_when_packed

NAME = "varlen"

__all__ = ["NAME", "register", "reference_varlen", "sequence_bounds", "torch_varlen_kernel", "varlen_attention"]


def sequence_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32 [n + 1], longest)`` of the sequences in a flattened row of position ids.

    A sequence starts wherever a position id does not continue the previous one by +1 (and at every row start
    when ``position_ids`` has several rows, which are then read one after the other).
    """
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    idx = starts.reshape(-1).nonzero().squeeze(1)
    total = pos.numel()
    cu = torch.cat([idx, idx.new_tensor([total])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return cu, longest


@functools.cache
def torch_varlen_kernel():
    """torch's flash varlen function and whether it takes ``enable_gqa`` (None when this torch has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "enable_gqa" in params, "window_size" in params  # 2.11: window, no gqa; 2.13: both


def reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """What the varlen kernel computes, one causal sdpa per sequence: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].

    The CPU stand-in for the CUDA kernel (tests compare the two paths' inputs and outputs through it) and the
    fallback for dtypes or devices the kernel does not take.
    """
    out = []
    for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        if e == s:
            continue
        qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, l, D]
        out.append(causal_block(qs, ks, vs, scale=scale, window=window)[0].transpose(0, 1))
    return torch.cat(out) if len(out) > 1 else out[0]


_KERNEL: list = []  # torch_varlen_kernel(), looked up by register(): a compiled layer reads it without tracing it


def _usable_kernel(q: torch.Tensor):
    """torch's kernel when it can run these inputs (CUDA, half precision), else None (tests replace this)."""
    kernel = _KERNEL[0] if _KERNEL else torch_varlen_kernel()
    if kernel is None or q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    return kernel


def _run_kernel(q, k, v, cu, longest, scale, window):
    kernel = _usable_kernel(q)
    if kernel is None:
        return reference_varlen(q, k, v, cu, scale=scale, window=window)
    fn, has_gqa, has_window = kernel
    if not has_window and window is not None:  # a kernel with only is_causal cannot band the attention
        return reference_varlen(q, k, v, cu, scale=scale, window=window)
    extra = {}
    if k.shape[1] != q.shape[1]:
        if has_gqa:
            extra["enable_gqa"] = True
        else:  # torch 2.11: repeat each key/value head for its group of query heads
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if has_window:
        extra["window_size"] = (window - 1 if window is not None else -1, 0)  # (left, right): causal, banded
    else:
        extra["is_causal"] = True
    cu = cu.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu, cu, longest, longest, scale=scale, **extra)


def varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, L, D], key/value [B, Hkv, L, D] -> ([B, L, H, D], None), transformers' attention contract."""
    if kwargs.get("softcap") is not None:
        raise ValueError("this model softcaps its attention logits, which the varlen kernel cannot do; set "
                         "model.attn_implementation=eager")
    position_ids = kwargs.get("position_ids")
    cu = kwargs.get("cu_seq_lens_q")
    packed = attention_mask is None and key.shape[2] == query.shape[2] and (
        cu is not None or (position_ids is not None and position_ids.shape[-1] == query.shape[2]))
    if not packed:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout and module.training:
        raise ValueError("varlen attention has no dropout (prefpack disables dropout for preference losses)")
    if cu is None:
        if position_ids.shape[0] != query.shape[0]:
            position_ids = position_ids.expand(query.shape[0], -1)
        cu, longest = sequence_bounds(position_ids)
    else:
        longest = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
    batch, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    dev = q.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else value.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)  # rotary embeddings may have promoted q and k to float32
    out = _run_kernel(q, k, v, cu, longest, scaling, kwargs.get("sliding_window"))
    return out.reshape(batch, length, heads, dim), None


def register() -> None:
    """Make ``varlen`` a valid ``attn_implementation`` for every transformers model (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not _KERNEL:
        _KERNEL.append(torch_varlen_kernel())
    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, no_mask_when_packed)
