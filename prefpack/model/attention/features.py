"""What some families' attention layers need beyond causal attention and a sliding window, read from the layer and
its keywords, so that the packed kernels (``packed_sdpa``, ``varlen``) compute what the family's own eager attention
computes for each sequence alone:

* **attention sinks** (gpt-oss): a learned logit per query head, one more term in the softmax denominator with no
  value (transformers hands it to the kernel as ``s_aux``). :func:`sink_sdpa` runs it as sdpa over one extra key
  whose score is the sink (a zero key, the sink as its additive mask, a zero value): exact, gradients included;
* **chunked local attention** (Llama-4's ``chunked_attention`` layers): a query at position p sees the keys at
  positions q <= p with q // C == p // C. transformers counts chunks from a sequence's own start (its first
  unpadded token), so packed sequences restart theirs; the kernels read chunks from position ids
  (:func:`chunk_of` gives C for a layer);
* **position ids dropped before attention** (Llama-4's decoder layer and Dory's model keep them from attention):
  :func:`restore_positions` hooks those layers to hand them down as :data:`POSITIONS`;
* **a query temperature from row positions** (Llama-4's NoPE layers scale queries by
  ``1 + attn_scale * log1p(floor((i + 1) / floor_scale))`` with i the token's index in the *row*, not its position):
  :func:`fix_query` rescales packed queries to the sequence's own positions (a factor 1 below ``floor_scale - 1``).

Which kernels handle sinks and chunks is the kernel table's ``sinks`` / ``chunks``; :func:`unsupported` is the load
check that refuses a model whose features its kernel would silently drop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["POSITIONS", "chunk_of", "fix_query", "has_chunks", "has_sinks", "restore_positions", "sink_sdpa",
           "takes_over_eager", "unsupported", "with_features"]

POSITIONS = "prefpack_position_ids"  # the keyword carrying position ids past a layer that drops them

# Modules that take ``position_ids`` and do not pass them on to their attention: Llama-4's decoder layer, and Dory's
# model (transformers 5.24), which hands its layers only the rotary embeddings made from them.
_DROPS_POSITIONS = ("Llama4TextDecoderLayer", "DoryModel")


def chunk_of(module: nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (``config.layer_types[layer_idx] == "chunked_attention"``). The
    layer index is read only for a model with such layers: a compiled layer specialises on it (a graph per layer)."""
    types = getattr(getattr(module, "config", None), "layer_types", None) or ()
    if "chunked_attention" not in types:
        return None
    index = getattr(module, "layer_idx", None)
    if index is None or types[index] != "chunked_attention":
        return None
    return getattr(module.config, "attention_chunk_size", None)


def has_sinks(model: nn.Module) -> bool:
    """Whether some attention layer carries learned sinks (a ``sinks`` parameter, gpt-oss)."""
    return any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in model.modules())


def has_chunks(model: nn.Module) -> bool:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return "chunked_attention" in (getattr(config, "layer_types", None) or ())


def unsupported(model: nn.Module, kernel, packed: bool = True) -> str | None:
    """Why ``kernel`` (a kernel-table row) cannot run this model exactly (``packed``: on packed rows), or None."""
    if has_sinks(model) and not kernel.sinks:
        return (f"has attention sinks, which the {kernel.name!r} kernel leaves out; set model.attn_implementation="
                "varlen or packed_sdpa")
    if packed and has_chunks(model) and not kernel.chunks:
        return (f"has chunked local attention, which the {kernel.name!r} kernel counts from the packed row's start "
                "rather than each sequence's; set model.attn_implementation=varlen or packed_sdpa, or "
                "data.packing=false")
    return None


def takes_over_eager(model: nn.Module, kernel) -> bool:
    """Whether ``kernel`` may run a model transformers keeps off sdpa: one with sinks (its sdpa would drop them)
    whose attention dispatches through transformers' kernel interface, when ``kernel`` is one of prefpack's and
    computes sinks; or one without attention (Mamba, Falcon-Mamba, Mamba-2: no kernel runs, and the name lets
    prompt-shared rows through to its recurrent layers, the load guard measuring both). transformers refuses any
    kernel named like sdpa for such a model, so it is loaded with eager and switched."""
    if kernel.register is not None and not _has_attention(model):
        return True
    return (kernel.register is not None and kernel.sinks and has_sinks(model)
            and bool(getattr(model, "_supports_attention_backend", False)))


def _has_attention(model: nn.Module) -> bool:
    return any(type(m).__name__.endswith("Attention") for m in model.modules())


def _keep_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if kwargs.get("position_ids") is not None:
        kwargs[POSITIONS] = kwargs["position_ids"]
    return args, kwargs


def restore_positions(model: nn.Module) -> None:
    """Hook the modules that drop ``position_ids`` to pass them on as :data:`POSITIONS` (idempotent). A
    forward pre-hook runs again when gradient checkpointing replays the layer, with the same keywords."""
    for module in model.modules():
        if type(module).__name__ in _DROPS_POSITIONS and not getattr(module, "_prefpack_positions", False):
            module.register_forward_pre_hook(_keep_positions, with_kwargs=True)
            module._prefpack_positions = True


def _temperature(module: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def fix_query(module: nn.Module, query: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """query [B, H, L, D] as Llama-4's NoPE layers would scale it at the sequences' own positions: they scaled it
    by the temperature of ``arange(L)``; a packed row needs that of its position ids. Unchanged for other layers."""
    if (position_ids is None or not getattr(module, "attn_temperature_tuning", False)
            or getattr(module, "use_rope", True)):
        return query
    length = query.shape[2]
    used = _temperature(module, torch.arange(length, device=query.device))
    wanted = _temperature(module, position_ids.reshape(-1, length).to(query.device))
    factor = (wanted.double() / used.double())[:, None, :, None]  # [1 or B, 1, L, 1]; float64: one rounding
    return (query * factor).to(query.dtype)


def sink_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor, *,
              scale: float | None) -> torch.Tensor:
    """sdpa of q [B, H, l, D] over k/v [B, Hkv, m, D] where ``allowed`` (bool, broadcast to [B, H, l, m]) says
    which keys a query sees, with each head's sink ``sinks`` [H] as one more softmax term: one zero key in front
    whose additive mask is the sink, and a zero value. -> [B, H, l, D]."""
    batch, heads, length = q.shape[:3]
    zero = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
    keys, values = torch.cat([zero, k], dim=2), torch.cat([zero, v.to(k.dtype)], dim=2)
    allowed = allowed.expand(batch, heads, length, k.shape[2])
    scores = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, length, 1)
    mask = torch.cat([sink, scores], dim=-1)
    return F.scaled_dot_product_attention(q, keys, values.to(q.dtype), attn_mask=mask, scale=scale,
                                          enable_gqa=heads != k.shape[1])


def padded_sink_attention(module: nn.Module, query, key, value, attention_mask, scaling, sinks):
    """What a kernel's unpacked path (a padding mask, no position ids) runs for a layer with sinks: transformers'
    sdpa would drop them. ``attention_mask``: transformers' bool (True: seen) or additive mask, or None (causal,
    within the layer's window). -> ([B, L, H, D], None)."""
    length, keys = query.shape[2], key.shape[2]
    if attention_mask is None:
        d = torch.arange(length, device=query.device)[:, None] + (keys - length) \
            - torch.arange(keys, device=query.device)
        window = getattr(module, "sliding_window", None)
        allowed = (d >= 0) if window is None else (d >= 0) & (d < window)
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask[:, :, :, :keys]
    else:
        allowed = attention_mask[:, :, :, :keys] == 0
    out = sink_sdpa(query, key, value, allowed, sinks, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def with_features(kernel: Callable) -> Callable:
    """``kernel`` (transformers' attention contract) handed the position ids a layer dropped (:data:`POSITIONS`)
    and, on a packed row, queries at their sequences' own temperature (:func:`fix_query`)."""

    @functools.wraps(kernel)
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args, **kwargs):
        positions = kwargs.pop(POSITIONS, None)
        if kwargs.get("position_ids") is None and positions is not None:
            kwargs["position_ids"] = positions
        if attention_mask is None:
            query = fix_query(module, query, kwargs.get("position_ids"))
        return kernel(module, query, key, value, attention_mask, *args, **kwargs)

    return attention
