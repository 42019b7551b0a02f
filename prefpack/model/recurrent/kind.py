"""What prefpack needs to know about one kind of recurrent layer (:class:`LayerKind`), and how a packed forward
runs it: per block with the layer's own code (:func:`run_blocks`, any device) or in one call of the
boundary-aware CUDA kernels transformers binds when their packages are installed (:func:`run_gathered`)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefpack.model.recurrent.layout import GatheredLayout, Segments

__all__ = ["LayerKind", "run_blocks", "run_gathered"]


@dataclass(frozen=True)
class LayerKind:
    """One kind of recurrent layer: its transformers classes (``classes``), the model types that hold it
    (``families``, for the docs), the keyword its cache arrives under up to transformers 5.23 (``cache`` from 5.24
    on, for every kind; a cached call is generation: left alone), the packages whose kernels take sequence
    boundaries (``packages``, import names) and the keywords that hand them the boundaries of a gathered row (``boundary_keywords``; None: no kernel takes them, so each block runs
    alone on every device). ``relayed``: its decoder layers call it without passing their keywords on, so the
    blocks reach it through the layer's class (``relay``)."""

    name: str
    classes: tuple[str, ...]
    families: tuple[str, ...]
    packages: tuple[str, ...]
    boundary_keywords: Callable[[GatheredLayout], dict] | None
    cache_keyword: str = "cache_params"
    relayed: bool = False

    def kernels_installed(self) -> bool:
        """Whether every package of its boundary-aware kernels imports (transformers binds them at import then)."""
        return self.boundary_keywords is not None and all(
            importlib.util.find_spec(p) is not None for p in self.packages)


def _call(layer: torch.nn.Module, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
    """The layer's own forward (its class's, not prefpack's wrapper), without a cache or padding mask."""
    return type(layer).forward(layer, hidden, **kwargs)


def run_blocks(layer: torch.nn.Module, hidden: torch.Tensor, segments: Segments) -> torch.Tensor:
    """hidden [B, L, H] -> the layer's output [B, L, H'], each block run alone through the layer's own forward from
    a zero state (a later completion after a copy of its prompt, whose outputs are dropped): exactly what each
    sequence gives alone. The row is cut with ``split`` (one gradient copy per block in backward)."""
    batch, length, _ = hidden.shape
    flat = hidden.reshape(batch * length, -1)
    blocks = flat.split([p.length for p in segments.pieces])
    outs = []
    for block, piece in zip(blocks, segments.pieces, strict=True):
        if piece.prefix:
            block = torch.cat([blocks[piece.root][:piece.prefix], block])
        out = _call(layer, block[None])[0]
        outs.append(out[piece.prefix:] if piece.prefix else out)
    return torch.cat(outs).view(batch, length, -1)


def run_gathered(layer: torch.nn.Module, kind: LayerKind, hidden: torch.Tensor, segments: Segments) -> torch.Tensor:
    """The same in ONE call of the layer on a single gathered row (each later completion after its own copy of its
    prompt), with the sequence boundaries handed to the kernels transformers bound (``cu_seqlens``, ``seq_idx``).
    For CUDA with the kind's packages installed; not measured here (no GPU)."""
    batch, length, _ = hidden.shape
    flat = hidden.reshape(batch * length, -1)
    layout = segments.gathered
    device = hidden.device
    trivial = not segments.shares_prompts
    row = flat if trivial else flat.index_select(0, layout.index.to(device, non_blocking=True))
    keywords = kind.boundary_keywords(GatheredLayout(
        layout.index, layout.own, layout.cu_seqlens.to(device, non_blocking=True),
        layout.seq_idx.to(device, non_blocking=True), layout.longest))
    out = _call(layer, row[None], **keywords)[0]
    if not trivial:
        out = out.index_select(0, layout.own.to(device, non_blocking=True))
    return out.reshape(batch, length, -1)
