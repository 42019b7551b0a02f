"""LLaVA (``LlavaForConditionalGeneration``), model side: a CLIP-style ``vision_tower`` (the encoder) and a
``multi_modal_projector``, called through the model's ``get_image_features`` on whole images of the tower's
``image_size``; 1-D positions in the language model. The prepare side: ``prefpack/vision_families/llava.py``."""

from __future__ import annotations

import torch
from torch import nn

from prefpack.model.vision.parts import VisionParts, dtype_of
from prefpack.vision_families.llava import LLAVA

FAMILY = LLAVA


def parts(hf: nn.Module) -> VisionParts:
    config = hf.config
    inner = getattr(hf, "model", hf)
    return VisionParts(hf, config.model_type, inner.vision_tower, (inner.vision_tower,),
                       (inner.multi_modal_projector,), inner.language_model, int(config.image_token_id), 1)


def tower_features(parts: VisionParts, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    inner = getattr(parts.model, "model", parts.model)
    out = inner.get_image_features(pixel_values=pixel_values.to(dtype_of(parts.tower)), return_dict=True)
    pooled = out.pooler_output
    return torch.cat(list(pooled), 0) if isinstance(pooled, (list, tuple)) else pooled.reshape(-1, pooled.shape[-1])


def _image_shape(parts: VisionParts) -> tuple[int, int, int, int]:
    vc = parts.model.config.vision_config
    size = int(vc.image_size)
    return 1, int(getattr(vc, "num_channels", 3)), size, size


def placeholder_pixels(parts: VisionParts, device: torch.device) -> tuple[torch.Tensor, None]:
    """One crop."""
    return torch.zeros(*_image_shape(parts), device=device), None


def processor_checks(settings: dict) -> list[tuple[str, object, str]]:
    """The crop is the tower's ``image_size``."""
    crop = settings.get("crop_size")
    return [("crop", crop.get("height") if isinstance(crop, dict) else crop, "image_size")]


def sample_image(parts: VisionParts, generator: torch.Generator) -> tuple[torch.Tensor, None]:
    """One ``image_size`` image."""
    return torch.randn(*_image_shape(parts), generator=generator), None


def reference_inputs(parts: VisionParts, ids: torch.Tensor, grid: torch.Tensor | None,
                     device: torch.device) -> tuple[dict, None]:
    return {}, None
