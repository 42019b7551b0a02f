"""Attention for packed rows that computes only the diagonal blocks: one causal sdpa call per sequence.

transformers' sdpa on a packed row builds a [L, L] block-diagonal mask and attends over the whole row, so a
512-token row of five sequences pays for 512^2 scores where the sequences need sum(l_i^2) (about a third
here). Registered as the attention implementation ``packed_sdpa`` (prefpack's CPU default):

* packed batches (no padding mask, position ids restarting at 0 per sequence): each row is cut where
  position ids restart and every block runs ``scaled_dot_product_attention(is_causal=True)``; a one-token
  block's output is its value vector (softmax over one score), copied without a call;
* sliding-window layers get a banded mask for blocks longer than the window;
* chunked local attention (Llama-4): blocks are also cut where a position id is a multiple of the chunk size, and
  a completion reads only its prompt's tokens in its own first chunk; attention sinks (gpt-oss): one more softmax
  term per head (``features.sink_sdpa``);
* prompt groups (``collate_groups(share_prompts=True)``): a block whose position ids start at p > 0 is a later
  completion of the group that began at the row's last block starting at 0; it attends to that block's first
  p tokens (the prompt) and causally to itself;
* anything else (a padding mask, no position ids, a cache, logit softcapping): plain transformers sdpa with
  its usual mask (and its own error for softcapping).

On CUDA the per-block loop would launch many small kernels; flash-attention varlen does this job there.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from prefpack.model.attention import features

NAME = "packed_sdpa"

__all__ = ["NAME", "block_bounds", "causal_block", "chunk_spans", "no_mask_when_packed", "packed_sdpa_attention",
           "register"]


def _blocks(position_ids: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """Per row, (start, end, first position id) of each span where position ids run n, n+1, ...; read from the host
    in one transfer (a first position id > 0 marks a later completion of a prompt group)."""
    pos = position_ids.reshape(-1, position_ids.shape[-1]).cpu()
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    rows: list[list[tuple[int, int]]] = [[] for _ in range(pos.shape[0])]
    for (r, i), first in zip(starts.nonzero().tolist(), pos[starts].tolist(), strict=True):
        rows[r].append((i, first))
    length = pos.shape[-1]
    return [[(i, e, f) for (i, f), e in zip(r, [*(i for i, _ in r[1:]), length], strict=True)] for r in rows]


def block_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) spans where position ids run n, n+1, n+2, ... (a new span wherever they don't)."""
    return [[(s, e) for s, e, _ in row] for row in _blocks(position_ids)]


def chunk_spans(blocks: list[tuple[int, int, int]], chunk: int | None) -> list[tuple[int, int, int, int]]:
    """A row's blocks (start, end, first position id) as spans (start, end, source, prefix): the queries of
    [start, end) see the first ``prefix`` tokens of span ``source`` (a prompt), then their own tokens causally.

    A block starting at position p > 0 is a later completion of the group whose prompt is the row's last block
    starting at 0 (when that block holds p tokens; else it sees only itself). With ``chunk`` (chunked local
    attention) every block is also cut where a position id is a multiple of ``chunk``, and a completion sees only
    the prompt tokens of its own first chunk (positions ``chunk * (p // chunk) .. p - 1``, the start of a span).
    """
    spans: list[tuple[int, int, int, int]] = []
    root: tuple[int, int] | None = None  # (first span index, length) of the row's last block starting at 0
    for start, end, first in blocks:
        member = first > 0 and root is not None and root[1] >= first
        if first == 0:
            root = (len(spans), end - start)
        step = chunk or (end - start + first + 1)
        source, prefix = len(spans), 0
        if member:
            source, prefix = root[0] + first // step, first % step
        i, pos = start, first
        while i < end:
            nxt = min(end, i + step - pos % step)
            spans.append((i, nxt, source, prefix) if i == start else (i, nxt, len(spans), 0))
            pos, i = pos + nxt - i, nxt
    return spans


def causal_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within one sequence: q [1, H, l, D], k/v [1, Hkv, l, D] -> [1, H, l, D]. A sliding
    ``window`` lets query i see keys j with i - window < j <= i (a banded mask when the block is longer); ``sinks``
    [H] add each head's sink to the softmax denominator."""
    gqa = q.shape[1] != k.shape[1]
    length = q.shape[2]
    if sinks is not None:
        d = torch.arange(length, device=q.device)
        d = d[:, None] - d[None, :]
        allowed = (d >= 0) if window is None else (d >= 0) & (d < window)
        return features.sink_sdpa(q, k, v, allowed, sinks, scale=scale)
    if window is not None and length > window:
        d = torch.arange(length, device=q.device)
        d = d[:, None] - d[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(d >= 0) & (d < window), scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def _prefix_mask(prefix: int, length: int, window: int | None, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[length, prefix + length] additive mask (0 or -inf, in ``dtype``): a completion at positions ``prefix ..``
    sees every prompt key (within the window) and its own keys causally.

    Row i is query position ``prefix + i`` and column c key position c, so key c is seen when
    ``i + prefix - window < c <= i + prefix``: bands of the matrix, cut with ``triu_``/``tril_`` in the mask itself.
    Building it from a position-difference matrix held an int64 [length, prefix + length] (twice the float mask)
    and two boolean copies on every rank: at a 4k completion after an 8k prompt, 480 MiB on top of the 192 MiB mask,
    whatever the sequence-parallel size (benchmarks/README.md)."""
    mask = torch.full((length, prefix + length), float("-inf"), dtype=dtype, device=device).triu_(prefix + 1)
    if window is not None:  # keys at or before i + prefix - window are out of the window
        mask.add_(torch.full_like(mask, float("-inf")).tril_(prefix - window))
    return mask


class _ForwardCache:
    """What every layer of one forward would otherwise build again from the same position ids: the blocks (a host
    transfer) and the prompt groups' masks. sdpa keeps its mask for backward, so a mask per layer held one
    [length, prefix + length] float copy per completion and layer (196 MiB a layer for a 4k completion after an 8k
    prompt); shared, the layers hold one. Keyed on the position ids tensor itself; a new one starts afresh."""

    def __init__(self) -> None:
        self._ids: weakref.ref | None = None
        self._blocks: list | None = None
        self._masks: dict = {}
        self._spans: dict = {}

    def _of(self, position_ids: torch.Tensor) -> None:
        if self._ids is None or self._ids() is not position_ids:
            self._ids, self._blocks, self._masks, self._spans = weakref.ref(position_ids), None, {}, {}

    def spans(self, position_ids: torch.Tensor, chunk: int | None) -> list[list[tuple[int, int, int, int]]]:
        """Each row's :func:`chunk_spans`."""
        blocks = self.blocks(position_ids)
        if chunk not in self._spans:
            self._spans[chunk] = [chunk_spans(row, chunk) for row in blocks]
        return self._spans[chunk]

    def blocks(self, position_ids: torch.Tensor) -> list[list[tuple[int, int, int]]]:
        self._of(position_ids)
        if self._blocks is None:
            self._blocks = _blocks(position_ids)
        return self._blocks

    def mask(self, prefix: int, length: int, window: int | None, device: torch.device,
             dtype: torch.dtype) -> torch.Tensor:
        key = (prefix, length, window, device, dtype)
        if key not in self._masks:
            self._masks[key] = _prefix_mask(prefix, length, window, device, dtype)
        return self._masks[key]


_CACHE = _ForwardCache()


def _shared_prefix_block(q, k, v, prompt_k, prompt_v, *, scale: float | None, window: int | None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A completion laid out after its group's prompt and earlier siblings: q [1, H, l, D] attends to the prompt's
    keys ``prompt_k`` [1, Hkv, p, D] and causally to its own ``k`` [1, Hkv, l, D] (positions ``p ..``), never to a
    sibling's. Exactly what the completion would see right after its own copy of the prompt."""
    prefix, length = prompt_k.shape[2], q.shape[2]
    keys, values = torch.cat([prompt_k, k], dim=2), torch.cat([prompt_v, v], dim=2)
    mask = _CACHE.mask(prefix, length, window, q.device, q.dtype)
    if sinks is not None:
        return features.sink_sdpa(q, keys, values, mask == 0, sinks, scale=scale)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _row_attention(q, k, v, spans: list[tuple[int, int, int, int]], *, scale: float | None, window: int | None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One row, q [H, L, D] and k/v [Hkv, L, D] -> [L, H, D], span by span (:func:`chunk_spans`). The row is cut
    with ``split`` (one gradient copy per tensor in backward, where a slice per span would zero-fill a whole-row
    gradient each)."""
    sizes = [e - s for s, e, _, _ in spans]
    qs, ks, vs = (x.split(sizes, dim=1) for x in (q, k, v))
    groups = q.shape[0] // k.shape[0]
    pieces = []
    for i, (_, _, source, prefix) in enumerate(spans):
        qi, ki, vi = qs[i][None], ks[i][None], vs[i][None]
        if prefix > 0:  # a later completion of a prompt group: it sees the prompt's tokens of its chunk
            o = _shared_prefix_block(qi, ki, vi, ks[source][None, :, :prefix], vs[source][None, :, :prefix],
                                     scale=scale, window=window, sinks=sinks)
        elif sizes[i] == 1 and sinks is None:  # softmax over a single score is 1: the output is the value
            pieces.append(vs[i].transpose(0, 1).repeat_interleave(groups, dim=1) if groups > 1
                          else vs[i].transpose(0, 1))
            continue
        else:
            o = causal_block(qi, ki, vi, scale=scale, window=window, sinks=sinks)
        pieces.append(o[0].transpose(0, 1))  # [l, H, D]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


@torch.compiler.disable  # a compiled layer runs this eagerly: its span loop is host data, a new graph per layout
def packed_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, L, D], key/value [B, Hkv, L, D] -> ([B, L, H, D], None), transformers' attention contract."""
    position_ids = kwargs.get("position_ids")
    sinks = kwargs.get("s_aux")  # gpt-oss's per-head sinks
    if (attention_mask is not None or position_ids is None or key.shape[2] != query.shape[2]
            or position_ids.shape[-1] != query.shape[2] or kwargs.get("softcap") is not None):
        if sinks is not None:
            return features.padded_sink_attention(module, query, key, value, attention_mask, scaling, sinks)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout and module.training:
        raise ValueError("packed_sdpa attention has no dropout (prefpack disables dropout for preference losses)")
    window = kwargs.get("sliding_window")  # set on sliding-window layers (Mistral, Gemma's local layers, ...)
    spans = _CACHE.spans(position_ids, features.chunk_of(module))  # the same tensor in every layer of a forward
    if len(spans) != query.shape[0]:
        spans = spans * query.shape[0]  # one row of position ids for every row
    rows = [_row_attention(q, k, v, row, scale=scaling, window=window, sinks=sinks)
            for q, k, v, row in zip(query.unbind(0), key.unbind(0), value.unbind(0), spans, strict=True)]
    return torch.stack(rows), None


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

    from prefpack.model.attention.sequence_parallel import shardable

    AttentionInterface.register(NAME, features.with_features(shardable(packed_sdpa_attention)))
    AttentionMaskInterface.register(NAME, no_mask_when_packed)
