"""The Qwen2-VL family (Qwen2-VL, Qwen2.5-VL), model side: a vision tower (``visual``) ending in a patch merger (the
projector), taking flattened patches with their grids (``image_grid_thw``); 3-D rotary positions in the language
model. The prepare side: ``prefpack/vision_families/qwen2_vl.py``."""

from __future__ import annotations

import torch
from torch import nn

from prefpack.model.vision.parts import VisionParts, dtype_of
from prefpack.vision_families.qwen2_vl import QWEN2_VL

FAMILY = QWEN2_VL


def parts(hf: nn.Module) -> VisionParts:
    config = hf.config
    inner = getattr(hf, "model", hf)
    tower = inner.visual
    encoder = tuple(m for name, m in tower.named_children() if name != "merger")
    return VisionParts(hf, config.model_type, tower, encoder, (tower.merger,), inner.language_model,
                       int(config.image_token_id), int(config.vision_config.spatial_merge_size))


def tower_features(parts: VisionParts, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    if image_grid_thw is None:
        raise ValueError(f"{parts.label} images need image_grid_thw (the processor's patch grids)")
    tower = parts.tower
    return tower(pixel_values.to(dtype_of(tower)), grid_thw=image_grid_thw).pooler_output


def _patch_width(vc) -> int:
    channels = int(getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3))
    return channels * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2


def placeholder_pixels(parts: VisionParts, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One merged token's patches."""
    m = parts.merge_size
    grid = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
    return torch.zeros(m * m, _patch_width(parts.model.config.vision_config), device=device), grid


def processor_checks(settings: dict) -> list[tuple[str, object, str]]:
    """The patch grid: patch, temporal patch and merge sizes."""
    return [(key, settings.get(key), attr) for key, attr in (
        ("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
        ("merge_size", "spatial_merge_size"))]


def sample_image(parts: VisionParts, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A (2 * merge) x (2 * merge) patch grid: 4 image tokens."""
    side = 2 * parts.merge_size
    width = _patch_width(parts.model.config.vision_config)
    return torch.randn(side * side, width, generator=generator), torch.tensor([[1, side, side]])


def reference_inputs(parts: VisionParts, ids: torch.Tensor, grid: torch.Tensor | None,
                     device: torch.device) -> tuple[dict, torch.Tensor]:
    """The grid and the image tokens' type ids; the rope positions ``get_rope_index`` gives the sequence."""
    mm_token_type_ids = (ids == parts.image_token_id).int()[None].to(device)
    rope = parts.model.model.get_rope_index(ids[None].to(device), image_grid_thw=grid,
                                            mm_token_type_ids=mm_token_type_ids)[0]
    return {"image_grid_thw": grid, "mm_token_type_ids": mm_token_type_ids}, rope
