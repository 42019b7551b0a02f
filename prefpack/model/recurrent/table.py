"""The recurrent layer kinds prefpack keeps apart at sequence boundaries, one row each (one module per kind), and
how a layer is told apart: by its class (or a class it derives from: FSDP2's ``FSDP<Layer>``)."""

from __future__ import annotations

from torch import nn

from prefpack.model.recurrent import gated_deltanet, kda, mamba1, mamba2, short_conv
from prefpack.model.recurrent.kind import LayerKind

__all__ = ["KINDS", "kind_of", "looks_recurrent", "packed_families"]

KINDS: tuple[LayerKind, ...] = (gated_deltanet.KIND, kda.KIND, mamba1.KIND, mamba2.KIND, short_conv.KIND)

_BY_CLASS = {name: kind for kind in KINDS for name in kind.classes}


def kind_of(module: nn.Module) -> LayerKind | None:
    for cls in type(module).__mro__:
        kind = _BY_CLASS.get(cls.__name__)
        if kind is not None:
            return kind
    return None


def looks_recurrent(module: nn.Module) -> bool:
    """A layer that carries a state along the sequence, by its parts: a state-space decay (``A_log``, as Mamba,
    Gated DeltaNet and their relatives hold) or a causal convolution over tokens (a ``Conv1d`` child). Only names
    the layers a refusal blames; the leak guard itself measures."""
    return isinstance(getattr(module, "A_log", None), nn.Parameter) or any(
        isinstance(child, nn.Conv1d) for child in module.children())


def packed_families() -> str:
    """The model types whose recurrent layers prefpack keeps apart, for messages."""
    return ", ".join(f for kind in KINDS for f in kind.families)
