"""Decoder layers that call their recurrent layer without handing their keywords on (Mamba's and Falcon-Mamba's
blocks, Jamba's Mamba layer): the blocks reach it through the decoder layer's class instead. The instance's class
becomes a subclass (same name, as FSDP2 does) whose forward holds the blocks on its recurrent children for the
call; transformers' activation checkpointing wraps the outermost forward, this one, so its replay in backward
holds them again."""

from __future__ import annotations

import functools

from torch import nn

__all__ = ["HELD", "relay"]

HELD = "_prefpack_held_segments"  # on a recurrent layer during its decoder layer's call: the packed blocks


def relay(layer: nn.Module, keyword: str, mark: str) -> None:
    """Make ``layer`` hold its ``keyword`` (the blocks) on its children marked ``mark`` while it runs. Idempotent."""
    if not getattr(type(layer), "_prefpack_relays", False):
        layer.__class__ = _relaying(type(layer), keyword, mark)


@functools.cache
def _relaying(cls: type, keyword: str, mark: str) -> type:
    base_forward = cls.forward

    def forward(self, *args, **kwargs):
        segments = kwargs.pop(keyword, None)
        held = [m for m in self.children() if m.__dict__.get(mark) is not None]
        for module in held:
            module.__dict__[HELD] = segments
        try:
            return base_forward(self, *args, **kwargs)
        finally:
            for module in held:
                module.__dict__.pop(HELD, None)

    return type(cls.__name__, (cls,), {"forward": forward, "_prefpack_relays": True, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
