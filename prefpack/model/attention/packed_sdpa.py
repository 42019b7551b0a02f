"""Attention for packed rows that computes only the diagonal blocks: one causal sdpa call per sequence.

transformers' sdpa on a packed row builds a [L, L] block-diagonal mask and attends over the whole row, so a
512-token row of five sequences pays for 512^2 scores where the sequences need sum(l_i^2) (about a third
here). Registered as the attention implementation ``packed_sdpa`` (prefpack's CPU default):

* packed batches (no padding mask, position ids restarting at 0 per sequence): each row is cut where
  position ids restart and every block runs ``scaled_dot_product_attention(is_causal=True)``; a one-token
  block's output is its value vector (softmax over one score), copied without a call;
* sliding-window layers get a banded mask for blocks longer than the window;
* prompt groups (``collate_groups(share_prompts=True)``): a block whose position ids start at p > 0 is a later
  completion of the group that began at the row's last block starting at 0; it attends to that block's first
  p tokens (the prompt) and causally to itself;
* anything else (a padding mask, no position ids, a cache, logit softcapping): plain transformers sdpa with
  its usual mask (and its own error for softcapping).

On CUDA the per-block loop would launch many small kernels; flash-attention varlen does this job there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NAME = "packed_sdpa"

__all__ = ["NAME", "block_bounds", "causal_block", "no_mask_when_packed", "packed_sdpa_attention", "register"]


def block_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) spans where position ids run n, n+1, n+2, ... (a new span wherever they don't)."""
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    rows: list[list[int]] = [[] for _ in range(pos.shape[0])]
    for r, i in starts.nonzero().tolist():
        rows[r].append(i)
    length = pos.shape[-1]
    return [list(zip(r, [*r[1:], length], strict=True)) for r in rows]


def causal_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                 window: int | None = None) -> torch.Tensor:
    """Causal attention within one sequence: q [1, H, l, D], k/v [1, Hkv, l, D] -> [1, H, l, D]. A sliding
    ``window`` lets query i see keys j with i - window < j <= i (a banded mask when the block is longer)."""
    gqa = q.shape[1] != k.shape[1]
    length = q.shape[2]
    if window is not None and length > window:
        d = torch.arange(length, device=q.device)
        d = d[:, None] - d[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(d >= 0) & (d < window), scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def _shared_prefix_block(q, k, v, root: int, prefix: int, s: int, e: int, *, scale: float | None,
                         window: int | None) -> torch.Tensor:
    """A completion laid out after its group's prompt and earlier siblings: q [1, H, l, D] attends to the prompt's
    keys ``k[root:root + prefix]`` and causally to its own ``k[s:e]`` (positions ``prefix ..``), never to a
    sibling's. Exactly what the completion would see right after its own copy of the prompt."""
    keys = torch.cat([k[:, :, root:root + prefix], k[:, :, s:e]], dim=2)
    values = torch.cat([v[:, :, root:root + prefix], v[:, :, s:e]], dim=2)
    q_pos = torch.arange(prefix, prefix + (e - s), device=q.device)
    k_pos = torch.cat([torch.arange(prefix, device=q.device), q_pos])
    d = q_pos[:, None] - k_pos[None, :]
    allowed = (d >= 0) if window is None else (d >= 0) & (d < window)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def packed_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, L, D], key/value [B, Hkv, L, D] -> ([B, L, H, D], None), transformers' attention contract."""
    position_ids = kwargs.get("position_ids")
    if (attention_mask is not None or position_ids is None or key.shape[2] != query.shape[2]
            or position_ids.shape[-1] != query.shape[2] or kwargs.get("softcap") is not None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout and module.training:
        raise ValueError("packed_sdpa attention has no dropout (prefpack disables dropout for preference losses)")
    batch, heads = query.shape[:2]
    groups = heads // key.shape[1]
    window = kwargs.get("sliding_window")  # set on sliding-window layers (Mistral, Gemma's local layers, ...)
    if position_ids.shape[0] != batch:
        position_ids = position_ids.expand(batch, -1)
    rows = []
    for b, spans in enumerate(block_bounds(position_ids)):
        pieces = []
        root = 0  # where the row's latest block starting at position 0 (a prompt group's start) begins
        for s, e in spans:
            first = int(position_ids[b, s])
            if first == 0:
                root = s
            elif first > 0:  # a later completion of a prompt group: it sees the group's first `first` tokens
                pieces.append(_shared_prefix_block(query[b:b + 1, :, s:e], key[b:b + 1], value[b:b + 1],
                                                   root, first, s, e, scale=scaling, window=window)[0].transpose(0, 1))
                continue
            if e - s == 1:  # softmax over a single score is 1: the output is the value
                v = value[b, :, s:e].transpose(0, 1)  # [1, Hkv, D]
                pieces.append(v.repeat_interleave(groups, dim=1) if groups > 1 else v)
                continue
            o = causal_block(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e], scale=scaling,
                             window=window)
            pieces.append(o[0].transpose(0, 1))  # [l, H, D]
        rows.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    out = torch.stack(rows)
    return out, None


def no_mask_when_packed(*args, **kwargs):
    """No [L, L] mask for packed batches (the blocks come from position ids); the usual one otherwise."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Make ``packed_sdpa`` a valid ``attn_implementation`` for every transformers model (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_sdpa_attention)
    AttentionMaskInterface.register(NAME, no_mask_when_packed)
