"""The Qwen2-VL family (Qwen2-VL, Qwen2.5-VL), prepare side: an image processor with a patch grid and
``merge_size``; ``(grid_t * grid_h * grid_w) / merge_size**2`` image tokens per image (its own resize of that image
decides the grid), between ``<|vision_start|>`` and ``<|vision_end|>``; 3-D rotary positions in the language model.
The model side: ``prefpack/model/vision/qwen2_vl.py``.
"""

from __future__ import annotations

from typing import Any

from prefpack.vision_families.family import VisionFamily

__all__ = ["DEFAULT_IMAGE_TOKEN", "QWEN2_VL"]

DEFAULT_IMAGE_TOKEN = "<|image_pad|>"  # Qwen2-VL, Qwen2.5-VL


def _fits(image_processor: Any) -> bool:
    return hasattr(image_processor, "merge_size") and hasattr(image_processor, "get_number_of_image_patches")


def _merge_size(image_processor: Any) -> int:
    return int(image_processor.merge_size)


def _count_tokens(image_processor: Any, settings: dict, width: int, height: int) -> int:
    merge = _merge_size(image_processor)
    return int(image_processor.get_number_of_image_patches(height, width, {})) // (merge * merge)


QWEN2_VL = VisionFamily(
    name="qwen2_vl",
    model_types={"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL"},
    processor="the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL: an image processor with merge_size)",
    count_tokens=_count_tokens,
    default_image_token=DEFAULT_IMAGE_TOKEN,
    image_processor_fits=_fits,
    merge_size=_merge_size,
    mrope=True,
    hashes_kind=False,
)
