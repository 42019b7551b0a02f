"""LLaVA (1.5 style, ``LlavaForConditionalGeneration``), prepare side: a ``LlavaProcessor`` folder
(``processor_config.json`` with ``patch_size``, ``vision_feature_select_strategy``, ``num_additional_image_tokens``,
``image_token``) around a CLIP-style image processor; ``(H // patch) * (W // patch)`` image tokens plus the
additional ones, less one with the ``default`` strategy, where H x W is the size the image processor gives the image
(its crop, usually a fixed size). The model side: ``prefpack/model/vision/llava.py``.
"""

from __future__ import annotations

from typing import Any

from prefpack.vision_families.family import ProcessorError, VisionFamily

__all__ = ["LLAVA", "LLAVA_DEFAULT_IMAGE_TOKEN", "LLAVA_SETTINGS", "llava_pixel_size"]

LLAVA_DEFAULT_IMAGE_TOKEN = "<image>"  # LlavaProcessor's default
PROCESSOR_CONFIG = "processor_config.json"  # where a LlavaProcessor folder keeps LLAVA_SETTINGS
# The LlavaProcessor settings that decide an image's token count (processor_config.json).
LLAVA_SETTINGS = ("patch_size", "vision_feature_select_strategy", "num_additional_image_tokens", "image_token")


def _size(value: Any) -> dict:
    """An image processor's size setting as a plain dict (a dict, or transformers' SizeDict)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if v is not None}
    return {k: v for k, v in vars(value).items() if v is not None} if hasattr(value, "__dict__") else {}


def llava_pixel_size(proc: Any, width: int, height: int) -> tuple[int, int]:
    """(height, width) of the pixels a CLIP-style image processor gives an image of this size: its center crop, or
    without one its resize (a fixed height and width, or the shortest edge scaled as torchvision does), then its fixed
    padding; the sizes LlavaProcessor reads off ``pixel_values`` to count the image's tokens."""
    h, w = height, width
    if getattr(proc, "do_center_crop", False):  # the crop decides the size, whatever the resize gave
        crop = _size(getattr(proc, "crop_size", None))
        h, w = int(crop["height"]), int(crop["width"])
    elif getattr(proc, "do_resize", False):
        size = _size(getattr(proc, "size", None))
        if size.get("height") and size.get("width"):
            h, w = int(size["height"]), int(size["width"])
        elif size.get("shortest_edge") and not size.get("longest_edge"):
            short_edge = int(size["shortest_edge"])
            short, long = (w, h) if w <= h else (h, w)
            new_long = int(short_edge * long / short)
            h, w = (new_long, short_edge) if w <= h else (short_edge, new_long)
        else:
            raise ProcessorError(f"{type(proc).__name__}: resize setting {size} is not supported (a fixed height and "
                                 "width, or a shortest_edge alone)")
    if getattr(proc, "do_pad", False):
        pad = _size(getattr(proc, "pad_size", None))
        h, w = int(pad["height"]), int(pad["width"])
    return h, w


def _count_tokens(image_processor: Any, settings: dict, width: int, height: int) -> int:
    h, w = llava_pixel_size(image_processor, width, height)
    patch = int(settings["patch_size"])
    n = (h // patch) * (w // patch) + int(settings.get("num_additional_image_tokens") or 0)
    return n - 1 if settings.get("vision_feature_select_strategy") == "default" else n


def _read_settings(where: str, proc: Any, config: dict, tok: Any) -> dict:
    """processor_config.json's settings, checked; the image token as LlavaProcessor picks it (the tokenizer's
    ``image_token`` if it names one, else the processor's); and a check that the image processor gives every image
    one fixed pixel size or one computed from the image's size."""
    patch = config.get("patch_size")
    if isinstance(patch, bool) or not isinstance(patch, int) or patch <= 0:
        raise ProcessorError(f"{where}: {PROCESSOR_CONFIG} must give the vision tower's patch_size (a positive "
                             f"integer), got {patch!r}")
    strategy = config.get("vision_feature_select_strategy")
    if strategy not in ("default", "full"):
        raise ProcessorError(f"{where}: vision_feature_select_strategy must be 'default' or 'full' (as the model's "
                             f"config), got {strategy!r}")
    extra = config.get("num_additional_image_tokens", 0)
    if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
        raise ProcessorError(f"{where}: num_additional_image_tokens must be an integer >= 0, got {extra!r}")
    if getattr(proc, "do_pad", False) and not (_size(getattr(proc, "pad_size", None)).get("height")):
        raise ProcessorError(f"{where}: {type(proc).__name__} pads each batch to its largest image (do_pad without "
                             "pad_size), so an image's token count would depend on its batch; not supported")
    token = getattr(tok, "image_token", None) or config.get("image_token") or LLAVA_DEFAULT_IMAGE_TOKEN
    settings = dict(zip(LLAVA_SETTINGS, (patch, strategy, extra, token), strict=True))
    try:
        n = _count_tokens(proc, settings, 224, 224)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProcessorError(f"{where}: {type(proc).__name__}'s settings give no pixel size ({exc})") from None
    if n <= 0:
        raise ProcessorError(f"{where}: the settings give images no tokens (patch_size {patch} larger than the "
                             "image processor's output?)")
    return settings


LLAVA = VisionFamily(
    name="llava",
    model_types={"llava": "LLaVA (LlavaForConditionalGeneration)"},
    processor="LlavaProcessor (LLaVA 1.5 style: a CLIP-style image processor, a fixed token count per image)",
    count_tokens=_count_tokens,
    default_image_token=LLAVA_DEFAULT_IMAGE_TOKEN,
    processor_classes=("LlavaProcessor",),
    read_settings=_read_settings,
    shown_as=" (LlavaProcessor)",
)
