"""Where a vision-language model's pieces are (:class:`VisionParts`), found through DDP / compile / peft wrappers;
what every family's model-side module (``qwen2_vl.py``, ``llava.py``: :class:`FamilyModule`) is written against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from prefpack.vision_families import VisionFamily, family_of_model_type

__all__ = ["FamilyModule", "VisionParts", "config_of", "dtype_of", "frozen", "hf_model", "is_vision_language"]


def config_of(model_or_config):
    """The config of a model (through a distributed wrapper), or the config itself."""
    config = getattr(model_or_config, "config", None)
    if config is None and isinstance(model_or_config, nn.Module):
        config = getattr(getattr(model_or_config, "module", None), "config", None)
    return model_or_config if config is None else config


def is_vision_language(model_or_config) -> bool:
    """Whether a model (or its config) is a vision-language model: its config has a ``vision_config``."""
    return getattr(config_of(model_or_config), "vision_config", None) is not None


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / torch.compile / peft wrappers."""
    for _ in range(6):
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None) if not hasattr(model, "get_output_embeddings") else None
        if isinstance(inner, nn.Module):
            model = inner
            continue
        base = getattr(model, "get_base_model", None)  # peft
        if callable(base) and base() is not model:
            model = base()
            continue
        break
    return model


def frozen(modules) -> bool:
    return not any(p.requires_grad for m in modules for p in m.parameters())


def dtype_of(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


@dataclass(frozen=True)
class VisionParts:
    """Where a vision-language model's pieces are. ``encoder``: the modules whose parameters ``model.freeze_vision``
    freezes; ``projector``: those ``model.freeze_projector`` freezes; ``tower``: the module called once per
    micro-batch (Qwen2-VL: ``visual``, merger included; LLaVA: ``vision_tower``)."""

    model: nn.Module  # the transformers model (ForConditionalGeneration)
    kind: str  # config.model_type
    tower: nn.Module
    encoder: tuple[nn.Module, ...]
    projector: tuple[nn.Module, ...]
    language_model: nn.Module
    image_token_id: int
    merge_size: int  # image-grid patches merged into one image token per side (Qwen2-VL: 2; LLaVA: 1)

    @property
    def family(self) -> VisionFamily:
        """The model's family (``prefpack.vision_families``)."""
        return family_of_model_type(self.kind)

    @property
    def label(self) -> str:
        """The model's name in messages ("Qwen2.5-VL")."""
        return self.family.model_types[self.kind]

    @property
    def mrope(self) -> bool:
        """Whether its language model reads 3-D rotary positions (position ids [4, B, L])."""
        return self.family.mrope

    def prefixes(self) -> dict[str, list[str]]:
        """Qualified module names (in :attr:`model`) of the encoder, the projector and the language model."""
        names = {id(m): n for n, m in self.model.named_modules()}
        return {"encoder": [names[id(m)] for m in self.encoder], "projector": [names[id(m)] for m in self.projector],
                "language_model": [names[id(self.language_model)]]}


class FamilyModule(Protocol):
    """The model side of one family: a module in this folder named as its family (``FAMILY.name``)."""

    FAMILY: VisionFamily

    def parts(self, hf: nn.Module) -> VisionParts:
        """Where the tower, encoder, projector and language model of the transformers model ``hf`` are."""

    def tower_features(self, parts: VisionParts, pixel_values: torch.Tensor,
                       image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """Every image's features [rows, hidden] in image order: one call of the tower (gradients as the caller set)."""

    def placeholder_pixels(self, parts: VisionParts, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The smallest input the tower takes, all zeros, and its grid (None without one)."""

    def processor_checks(self, settings: dict) -> list[tuple[str, Any, str]]:
        """(setting, the store's value, vision_config attribute) pairs that must agree: the image processor's
        ``settings`` (meta.json) against the tower."""

    def sample_image(self, parts: VisionParts, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Random pixels (and grid) of a small image the tower takes: the load-time self-check's image."""

    def reference_inputs(self, parts: VisionParts, ids: torch.Tensor, grid: torch.Tensor | None,
                         device: torch.device) -> tuple[dict, torch.Tensor | None]:
        """For the self-check's one sequence ``ids`` [L]: the keywords the model's own forward needs beside
        ``input_ids`` and ``pixel_values``, and the sequence's ``Batch.rope_positions`` (None without 3-D rope)."""
