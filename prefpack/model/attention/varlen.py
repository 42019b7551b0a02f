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
* chunked local attention (Llama-4): a chunked layer's sequences are cut into their chunks (:func:`group_bounds`
  with ``chunk``, from the position ids, once per forward and chunk size), each chunk attending causally to itself
  and, for a completion's first chunk, to its prompt's tokens of that chunk;
* attention sinks (gpt-oss's ``s_aux``): torch's kernel has no sink term, and its backward takes no gradient of the
  log-sum-exp a rescale would need, so layers with sinks run :func:`reference_varlen` on CUDA too (exact; not
  measured for speed, no GPU was lent);
* prompt groups (``collate_groups(share_prompts=True)``, read from position ids as ``packed_sdpa`` reads them): a
  block whose position ids start at p > 0 is a later completion of the group that began at the row's last block
  starting at 0. Its keys are *gathered*: that block's first p tokens (the prompt), then its own tokens
  (:func:`group_bounds`: ``cu_seq_lens_k`` and a key index into the flattened tokens, one ``index_select`` per
  layer, whose backward sums the completions' gradients into the prompt's keys). The kernel aligns a causal mask
  with more keys than queries bottom-right (query i of an l-token block sees keys up to i + k_len - l), which is
  exactly "the prompt, then causally itself", and its window counts back from that diagonal, as positions do.
  Rows without such blocks take no gather at all;
* grouped-query attention: torch 2.13's kernel takes ``enable_gqa``, 2.11's does not, so key/value heads are
  repeated there;
* the kernel needs half precision on CUDA: float32 compute, CPU tensors (the tests) and anything the kernel
  cannot run go to :func:`reference_varlen`, a per-sequence causal sdpa loop that gives the same values;
* a padding mask or a cache (not a packed batch) goes to transformers' sdpa; logit softcapping is refused.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from prefpack.model.attention import features
from prefpack.model.attention.packed_sdpa import causal_block, chunk_spans, no_mask_when_packed

NAME = "varlen"

__all__ = ["KEY_INDEX", "NAME", "GroupBounds", "group_bounds", "register", "reference_varlen", "sequence_bounds",
           "torch_varlen_kernel", "varlen_attention"]

KEY_INDEX = "varlen_key_index"  # the attention keyword carrying the key gather index of prompt-shared rows


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


class GroupBounds(NamedTuple):
    """What the kernel reads for a flattened row: query and key boundaries, longest of each, the key gather."""

    cu_q: torch.Tensor  # int32 [n + 1]
    cu_k: torch.Tensor  # int32 [n + 1]; cu_q itself when no block reads a prompt
    max_q: int
    max_k: int
    key_index: torch.Tensor | None  # int64 [T_k] into the flattened tokens; None when no block reads a prompt


def group_bounds(position_ids: torch.Tensor, chunk: int | None = None) -> GroupBounds:
    """:func:`sequence_bounds` plus the prompt groups of shared rows, computed once per forward on the host.

    A block whose position ids start at p > 0 reads the first p tokens of its row's last block starting at 0 (its
    prompt), then its own tokens; every other block reads its own. A block starting at p > 0 with no such block
    before it in its row, or one shorter than p, is no group member and stays plain causal (nothing to read).
    With ``chunk`` (a chunked-attention layer) the blocks are cut into their chunks first (``chunk_spans``).
    """
    if chunk is not None:
        return _chunk_bounds(position_ids, chunk)
    cu, longest = sequence_bounds(position_ids)
    starts, lengths = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
    first = position_ids.reshape(-1)[starts]
    block = torch.arange(starts.numel(), device=starts.device)
    root = torch.cummax(torch.where(first == 0, block, -1), 0).values  # each block's latest block starting at 0
    safe = root.clamp(min=0)
    row = starts // position_ids.shape[-1]
    member = (first > 0) & (root >= 0) & (row[safe] == row) & (lengths[safe] >= first)
    if not bool(member.any()):
        return GroupBounds(cu, cu, longest, longest, None)
    prefix = torch.where(member, first, 0)
    return _gathered(cu, starts[safe], prefix, longest)


def _gathered(cu: torch.Tensor, prompt_starts: torch.Tensor, prefix: torch.Tensor, longest: int) -> GroupBounds:
    """The bounds of blocks ``cu`` whose keys are ``prefix`` tokens from ``prompt_starts``, then their own."""
    starts, lengths = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
    key_lengths = prefix + lengths
    cu_k = torch.cat([cu.new_zeros(1), key_lengths.cumsum(0).to(torch.int32)])
    # each block's keys are two runs, [prompt start, + prefix) and [own start, + length): expand runs to indices
    run_start = torch.stack([prompt_starts, starts], 1).reshape(-1)
    run_length = torch.stack([prefix, lengths], 1).reshape(-1)
    run_offset = run_length.cumsum(0) - run_length
    total = int(key_lengths.sum())
    key_index = torch.repeat_interleave(run_start - run_offset, run_length, output_size=total) \
        + torch.arange(total, device=starts.device)
    return GroupBounds(cu, cu_k, longest, int(key_lengths.max()), key_index)


def _chunk_bounds(position_ids: torch.Tensor, chunk: int) -> GroupBounds:
    """:func:`group_bounds` of a chunked layer: the rows' chunk spans as blocks, read on the host."""
    from prefpack.model.attention.packed_sdpa import _blocks

    pos = position_ids.reshape(-1, position_ids.shape[-1])
    starts, ends, prompts, prefixes = [], [], [], []
    for r, row in enumerate(_blocks(pos)):
        spans = chunk_spans(row, chunk)
        base = r * pos.shape[-1]
        for start, end, source, prefix in spans:
            starts.append(base + start)
            ends.append(base + end)
            prompts.append(base + spans[source][0])
            prefixes.append(prefix)
    cu = torch.tensor([*starts, ends[-1]], dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    prefix = torch.tensor(prefixes)
    if not bool((prefix > 0).any()):
        return GroupBounds(cu, cu, longest, longest, None)
    return _gathered(cu, torch.tensor(prompts), prefix, longest)


def reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     scale: float | None = None, window: int | None = None,
                     cu_seqlens_k: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """What the varlen kernel computes, one causal sdpa per sequence: q [T, H, D], k/v [T_k, Hkv, D] -> [T, H, D].

    The CPU stand-in for the CUDA kernel (tests compare the two paths' inputs and outputs through it) and the
    fallback for dtypes or devices the kernel does not take. With ``cu_seqlens_k`` (gathered keys: a block's
    prompt, then its own tokens) the causal mask is aligned bottom-right and the window counts back from that
    diagonal, as the flash kernel does. ``sinks`` [H]: each head's sink as one more softmax term.
    """
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    out = []
    for s, e, sk, ek in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), cu_k[:-1].tolist(),
                            cu_k[1:].tolist()):
        if e == s:
            continue
        qs = q[s:e].transpose(0, 1)[None]  # [1, H, l, D]
        ks, vs = (t[sk:ek].transpose(0, 1)[None] for t in (k, v))
        if ek - sk == e - s:
            o = causal_block(qs, ks, vs, scale=scale, window=window, sinks=sinks)
        else:
            o = _bottom_right_block(qs, ks, vs, scale=scale, window=window, sinks=sinks)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out) if len(out) > 1 else out[0]


def _bottom_right_block(q, k, v, *, scale: float | None, window: int | None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [1, H, l, D] over k/v [1, Hkv, m, D] with m > l: query i sees key j when 0 <= i + (m - l) - j (< window)."""
    length, keys = q.shape[2], k.shape[2]
    d = torch.arange(length, device=q.device)[:, None] + (keys - length) - torch.arange(keys, device=q.device)
    allowed = (d >= 0) if window is None else (d >= 0) & (d < window)
    if sinks is not None:
        return features.sink_sdpa(q, k, v, allowed, sinks, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class _BoundsCache:
    """:func:`group_bounds` of the position ids every layer of one forward reads, per chunk size (a host transfer
    each): keyed on the position ids tensor itself, moved to its device."""

    def __init__(self) -> None:
        self._ids: weakref.ref | None = None
        self._bounds: dict = {}

    def of(self, position_ids: torch.Tensor, chunk: int | None, rows: int) -> GroupBounds:
        """The bounds of ``rows`` rows (one row of position ids stands for all when there is one)."""
        if self._ids is None or self._ids() is not position_ids:
            self._ids, self._bounds = weakref.ref(position_ids), {}
        if (chunk, rows) not in self._bounds:
            pos = position_ids.cpu()
            b = group_bounds(pos.expand(rows, -1) if pos.shape[0] != rows else pos, chunk)
            move = functools.partial(torch.Tensor.to, device=position_ids.device)
            self._bounds[chunk, rows] = GroupBounds(move(b.cu_q), move(b.cu_k), b.max_q, b.max_k,
                                              None if b.key_index is None else move(b.key_index))
        return self._bounds[chunk, rows]


_BOUNDS = _BoundsCache()

_KERNEL: list = []  # torch_varlen_kernel(), looked up by register(): a compiled layer reads it without tracing it


def _usable_kernel(q: torch.Tensor):
    """torch's kernel when it can run these inputs (CUDA, half precision), else None (tests replace this)."""
    kernel = _KERNEL[0] if _KERNEL else torch_varlen_kernel()
    if kernel is None or q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    return kernel


def _run_kernel(q, k, v, cu, longest, scale, window, cu_k=None, longest_k=None, sinks=None):
    """The kernel (or the reference) over q [T, H, D] and k/v [T_k, Hkv, D]; ``cu_k``/``longest_k`` default to the
    query's (keys not gathered). Sinks always take the reference (see the module doc)."""
    kernel = _usable_kernel(q)
    if kernel is None or sinks is not None:
        return reference_varlen(q, k, v, cu, scale=scale, window=window, cu_seqlens_k=cu_k, sinks=sinks)
    fn, has_gqa, has_window = kernel
    if not has_window and window is not None:  # a kernel with only is_causal cannot band the attention
        return reference_varlen(q, k, v, cu, scale=scale, window=window, cu_seqlens_k=cu_k)
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
    if cu_k is None:
        cu_k, longest_k = cu, longest
    else:
        cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu, cu_k, longest, longest_k, scale=scale, **extra)


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
    sinks = kwargs.get("s_aux")  # gpt-oss's per-head sinks
    if not packed and sinks is not None:
        return features.padded_sink_attention(module, query, key, value, attention_mask, scaling, sinks)
    if not packed:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout and module.training:
        raise ValueError("varlen attention has no dropout (prefpack disables dropout for preference losses)")
    chunk = features.chunk_of(module)
    if cu is None or chunk is not None:  # a chunked layer reads its own bounds (once per forward and chunk size)
        cu, cu_k, longest, longest_k, index = _BOUNDS.of(position_ids, chunk, query.shape[0])
    else:
        longest = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
        index = kwargs.get(KEY_INDEX)
        cu_k, longest_k = (cu, longest) if index is None else (kwargs["cu_seq_lens_k"], int(kwargs["max_length_k"]))
    batch, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    dev = q.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else value.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)  # rotary embeddings may have promoted q and k to float32
    if index is not None:  # prompt groups: each block's keys are its prompt's, then its own
        k, v = k.index_select(0, index), v.index_select(0, index)
    out = _run_kernel(q, k, v, cu, longest, scaling, kwargs.get("sliding_window"), cu_k, longest_k, sinks)
    return out.reshape(batch, length, heads, dim), None


def register() -> None:
    """Make ``varlen`` a valid ``attn_implementation`` for every transformers model (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not _KERNEL:
        _KERNEL.append(torch_varlen_kernel())
    from prefpack.model.attention.sequence_parallel import shardable

    AttentionInterface.register(NAME, features.with_features(shardable(varlen_attention)))
    AttentionMaskInterface.register(NAME, no_mask_when_packed)
