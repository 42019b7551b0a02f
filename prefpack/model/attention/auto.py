"""``attn_implementation: auto`` for one model: the first kernel of the table available on the device
(``kernels.auto_candidates``) that the model's features leave usable. On CUDA the flash-attn package comes first,
but it drops gpt-oss's attention sinks, counts Llama-4's attention chunks from the packed row's start (and
transformers refuses it for Llama-4), and varlen cannot softcap Gemma-2's logits: the load would refuse those, so
``auto`` passes over them and says so (:class:`AttentionChoice`), instead of leaving the user to name a kernel.

The features are read before the weights load: the config, and for attention sinks (a parameter of the attention
layers, not a config value) the model built on the meta device, which allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from prefpack.model.attention import features
from prefpack.model.attention.kernels import Kernel, auto_candidates, kernel_named

__all__ = ["AttentionChoice", "choose_attention"]


@dataclass(frozen=True)
class AttentionChoice:
    """The kernel a run loads and, for ``auto``, why (the kernels passed over and their reason), for the load line."""

    name: str
    auto: bool = False
    device: str = ""
    skipped: tuple[tuple[str, str], ...] = ()  # (kernel, why the model rules it out)

    def describe(self) -> str:
        if not self.auto:
            return f"attention: {self.name} (model.attn_implementation)"
        why = "; ".join(f"{name} skipped: the model {reason}" for name, reason in self.skipped)
        return f"attention: {self.name} (auto on {self.device}" + (f"; {why})" if why else ")")


class _ModelTraits:
    """What the kernels' refusals read, from a model folder's config; the meta-device model only when asked."""

    def __init__(self, config: Any, trust_remote_code: bool) -> None:
        self.config = config
        self.text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.trust_remote_code = trust_remote_code

    @cached_property
    def meta_model(self) -> nn.Module | None:
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(self.text, attn_implementation="eager",
                                                        trust_remote_code=self.trust_remote_code)
        except Exception:  # a config transformers cannot build here: the load itself reports it, or its kernel's
            return None

    def reason(self, kernel: Kernel, packed: bool) -> str | None:
        """Why the load would refuse ``kernel`` for this model (None: it would not)."""
        for attribute, _ in kernel.refuses:
            if getattr(self.text, attribute, None):
                return f"sets {attribute}, which it cannot compute"
        if packed and not kernel.chunks and "chunked_attention" in (getattr(self.text, "layer_types", None) or ()):
            return "has chunked local attention, which it counts from the packed row's start"
        if _keeps_sinks(kernel) and not kernel.class_flag:
            return None  # nothing left that needs the model built
        model = self.meta_model
        if model is None:
            return None
        if kernel.class_flag and not getattr(model, kernel.class_flag, True):
            return f"is one transformers does not run on it ({type(model).__name__}.{kernel.class_flag} is False)"
        if kernel.fallback and not getattr(model, "_supports_sdpa", True) \
                and not features.takes_over_eager(model, kernel):
            kernel = kernel_named(kernel.fallback)  # what the load falls back to (gpt-oss, Gemma-2 on sdpa)
        if not kernel.sinks and features.has_sinks(model):
            return "has attention sinks, which it leaves out"
        return None


def choose_attention(name: str, device: torch.device, compute_dtype: Any = None, *, source: str | None = None,
                     packed: bool = True, trust_remote_code: bool = False) -> AttentionChoice:
    """The kernel to load ``source`` (a model folder or hub id) with: ``name`` itself unless it is ``auto``; for
    ``auto`` the first kernel available here that the model's features leave usable (the first available when
    none is, or when ``source`` is None or its config cannot be read: the load then says what is wrong)."""
    if name != "auto":
        return AttentionChoice(name)
    candidates = auto_candidates(device, compute_dtype)
    refusable = not (candidates[0].chunks and _keeps_sinks(candidates[0]) and not candidates[0].refuses
                     and not candidates[0].class_flag)
    traits = _traits(source, trust_remote_code) if source is not None and refusable else None
    skipped: list[tuple[str, str]] = []
    if traits is not None:
        for kernel in candidates:
            why = traits.reason(kernel, packed)
            if why is None:
                return AttentionChoice(kernel.name, True, device.type, tuple(skipped))
            skipped.append((kernel.name, why))
    return AttentionChoice(candidates[0].name, True, device.type, tuple(skipped))


def _keeps_sinks(kernel: Kernel) -> bool:
    """Whether the kernel computes sinks, and so does the one the load falls back to without sdpa support."""
    return kernel.sinks and (kernel.fallback is None or kernel_named(kernel.fallback).sinks)


def _traits(source: str, trust_remote_code: bool) -> _ModelTraits | None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception:  # loading the model reports a bad path or config
        return None
    return _ModelTraits(config, trust_remote_code)
