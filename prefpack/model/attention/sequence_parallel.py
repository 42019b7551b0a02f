"""Attention over token shards (sequence parallelism, ``prefpack.sequence_parallel``): the kernel sees whole rows.

Each rank of a sequence group holds ``tokens / N`` of a row with all heads. Before the kernel, an all-to-all gives
every rank the whole row for ``heads / N`` of the heads; the kernel the model was loaded with (``packed_sdpa``,
``varlen``: prompt groups and sliding windows as without sharding) runs on full sequences for those heads, reading
the whole row's position ids (and, for ``varlen``, its host-computed boundaries) handed down as :data:`SHARDS`;
a second all-to-all gives each rank its tokens back with all heads. Key/value heads the group cannot split evenly
(fewer than N) are repeated first (``sequence_parallel.kv_repeats``); the backward of either exchange is the
reverse exchange.

The wrapper (:func:`shardable`) is what ``packed_sdpa`` and ``varlen`` register; called without the keyword
:data:`SHARDS` it calls the kernel unchanged. The layout travels as a keyword of the body's call, which transformers
hands every attention layer, rather than as state around the call: gradient checkpointing replays a layer's forward
in backward with the same keywords, long after the call returned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from prefpack.sequence_parallel import SeqPar, all_to_all, kv_repeats

__all__ = ["SHARDS", "TokenShards", "shardable"]

SHARDS = "prefpack_token_shards"  # the body keyword carrying a :class:`TokenShards` down to attention


class TokenShards(NamedTuple):
    """Attention layers exchange heads for tokens over ``sp`` and hand the kernel ``row_kwargs`` (the whole row's
    ``position_ids``, and its boundary keywords) in place of the shard's."""

    sp: SeqPar
    row_kwargs: dict


def shardable(kernel: Callable) -> Callable:
    """``kernel`` (transformers' attention contract) run on whole rows when called with :data:`SHARDS`."""

    @functools.wraps(kernel)
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args, **kwargs) -> tuple[torch.Tensor, None]:
        shards = kwargs.pop(SHARDS, None)
        if shards is None:
            return kernel(module, query, key, value, attention_mask, *args, **kwargs)
        sp, row_kwargs = shards
        if attention_mask is not None:
            raise ValueError("sequence-parallel attention runs packed rows only (no padding mask)")
        repeats = kv_repeats(key.shape[1], sp.size)
        if repeats > 1:
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        # [B, H, L / N, D] -> [B, H / N, L, D]: this rank's heads over the whole row
        query, key, value = (all_to_all(t, sp, scatter=1, gather=2) for t in (query, key, value))
        out, _ = kernel(module, query, key, value, None, *args, **{**kwargs, **row_kwargs})
        # [B, L, H / N, D] -> [B, L / N, H, D]: this rank's tokens with every head
        return all_to_all(out, sp, scatter=1, gather=2), None

    return attention
