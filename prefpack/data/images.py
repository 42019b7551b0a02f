"""Images of vision-language rows, for `prepare --processor DIR` (docs/images.md).

An image is read as its encoded bytes (a file path, raw bytes, or the ``{"bytes": ..., "path": ...}`` dict a
`datasets` Image feature stores), decoded once to check it and learn its size, and stored as those same bytes
(no pixels). Its placeholder in the prompt text is expanded to the exact number of tokens the processor gives it:
for the Qwen2-VL family ``(grid_t * grid_h * grid_w) / merge_size**2`` image tokens between ``<|vision_start|>``
and ``<|vision_end|>``; for LLaVA (a ``LlavaProcessor`` folder: ``processor_config.json`` with ``patch_size``,
``vision_feature_select_strategy``, ``num_additional_image_tokens``) ``(H // patch) * (W // patch)`` plus the
additional tokens, less one with the ``default`` strategy, where H x W is the size the image processor gives the image
(its crop, usually a fixed size). So token budgets count the image exactly.

Supported: image processors with Qwen2-VL's grid (``merge_size`` and ``get_number_of_image_patches``), and
LlavaProcessor folders (``SUPPORTED_PROCESSORS``); any other is refused by name.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any

from prefpack.data.row_checks import InvalidRow
from prefpack.errors import PrefpackError

DEFAULT_IMAGE_TOKEN = "<|image_pad|>"  # Qwen2-VL, Qwen2.5-VL
LLAVA_DEFAULT_IMAGE_TOKEN = "<image>"  # LlavaProcessor's default
PROCESSOR_CONFIG = "processor_config.json"
SUPPORTED_PROCESSORS = ("the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL: an image processor with merge_size)",
                        "LlavaProcessor (LLaVA 1.5 style: a CLIP-style image processor, a fixed token count per image)")
# The LlavaProcessor settings that decide an image's token count (processor_config.json).
LLAVA_SETTINGS = ("patch_size", "vision_feature_select_strategy", "num_additional_image_tokens", "image_token")


class ProcessorError(PrefpackError, ValueError):
    """A --processor folder prefpack cannot use."""


@dataclass
class Vision:
    """What a prepare worker needs to expand images: the image processor and the image token (text and id)."""

    processor: Any
    image_token: str
    image_token_id: int
    kind: str = "qwen2_vl"  # "qwen2_vl" or "llava"
    # llava: the LlavaProcessor's own settings (LLAVA_SETTINGS, from processor_config.json); empty for qwen2_vl
    settings: dict = field(default_factory=dict)

    def placeholder_tokens(self, width: int, height: int) -> int:
        """The number of image tokens the processor gives an image of this size (the one place that counts them)."""
        if self.kind == "llava":
            h, w = llava_pixel_size(self.processor, width, height)
            patch = int(self.settings["patch_size"])
            n = (h // patch) * (w // patch) + int(self.settings.get("num_additional_image_tokens") or 0)
            return n - 1 if self.settings.get("vision_feature_select_strategy") == "default" else n
        merge = int(self.processor.merge_size)
        return int(self.processor.get_number_of_image_patches(height, width, {})) // (merge * merge)


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


def load_vision(path: str, tok) -> Vision:
    """The image processor of the folder `path` and the image token of `tok` (the same folder's tokenizer)."""
    try:
        from PIL import Image  # noqa: F401
    except ImportError:
        raise ProcessorError("--processor needs Pillow to read images: pip install 'prefpack[vision]'") from None
    from transformers import AutoImageProcessor

    if not os.path.isdir(path):
        raise ProcessorError(f"--processor {path!r} is not a folder (give a processor folder holding "
                             "preprocessor_config.json and the tokenizer)")
    try:
        proc = AutoImageProcessor.from_pretrained(path)
    except Exception as exc:  # a missing or unreadable preprocessor_config.json
        raise ProcessorError(f"--processor {path!r}: cannot load an image processor from it ({type(exc).__name__}: "
                             f"{exc})") from None
    config = _processor_config(path)
    pclass = config.get("processor_class")
    if pclass == "LlavaProcessor":
        return _llava_vision(path, proc, tok, config)
    if not hasattr(proc, "merge_size") or not hasattr(proc, "get_number_of_image_patches"):
        what = f"{pclass} with {type(proc).__name__}" if pclass else type(proc).__name__
        raise ProcessorError(f"--processor {path!r}: {what} is not supported yet; prefpack expands images for "
                             f"{' and '.join(SUPPORTED_PROCESSORS)}, see docs/images.md")
    token = getattr(tok, "image_token", None) or DEFAULT_IMAGE_TOKEN
    return Vision(proc, token, _token_id(path, tok, token))


def _processor_config(path: str) -> dict:
    """The folder's processor_config.json (what ProcessorMixin.save_pretrained writes), or {} without one."""
    file = os.path.join(path, PROCESSOR_CONFIG)
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ProcessorError(f"--processor {path!r}: cannot read {PROCESSOR_CONFIG} ({exc})") from None
    if not isinstance(config, dict):
        raise ProcessorError(f"--processor {path!r}: {PROCESSOR_CONFIG} is not a JSON object")
    return config


def _token_id(path: str, tok, token: str) -> int:
    tid = tok.convert_tokens_to_ids(token)
    if tid is None or tid == tok.unk_token_id or tok.convert_ids_to_tokens(tid) != token:
        raise ProcessorError(f"--processor {path!r}: the tokenizer has no {token!r} token, which stands for the "
                             "image's tokens in the text")
    return int(tid)


def _llava_vision(path: str, proc: Any, tok, config: dict) -> Vision:
    """A LlavaProcessor folder: its settings from processor_config.json, the image token as LlavaProcessor picks it
    (the tokenizer's ``image_token`` if it names one, else the processor's), and a check that the image processor
    gives every image one fixed pixel size or one computed from the image's size."""
    where = f"--processor {path!r} (LlavaProcessor)"
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
    settings = {"patch_size": patch, "vision_feature_select_strategy": strategy,
                "num_additional_image_tokens": extra, "image_token": token}
    vision = Vision(proc, token, _token_id(path, tok, token), kind="llava", settings=settings)
    try:
        vision.placeholder_tokens(224, 224)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProcessorError(f"{where}: {type(proc).__name__}'s settings give no pixel size ({exc})") from None
    if vision.placeholder_tokens(224, 224) <= 0:
        raise ProcessorError(f"{where}: the settings give images no tokens (patch_size {patch} larger than the "
                             "image processor's output?)")
    return vision


def processor_identity(vision: Vision, path: str, tokenizer_hash: str) -> dict:
    """meta.json's record of the processor: its class and settings, the image token, and one hash over them and
    the tokenizer's content hash (the same settings and tokenizer give the same image token counts)."""
    settings = json.loads(json.dumps(vision.processor.to_dict(), sort_keys=True, default=str))
    fields = {"settings": settings, "image_token": vision.image_token, "tokenizer": tokenizer_hash}
    if vision.kind != "qwen2_vl":  # (a Qwen2-VL store's hash is the same as before LLaVA was added)
        fields.update(kind=vision.kind, processor_settings=vision.settings)
    body = json.dumps(fields, sort_keys=True)
    out = {"path": path, "class": type(vision.processor).__name__, "kind": vision.kind,
           "image_token": vision.image_token, "image_token_id": vision.image_token_id, "settings": settings}
    if vision.settings:
        out["processor_settings"] = dict(vision.settings)
    return {**out, "hash": hashlib.sha256(body.encode()).hexdigest()}


def image_bytes(value: Any, field: str, k: int, base_dir: str | None) -> bytes:
    """Image `k` of `field` as encoded bytes: a path (relative to the input file's folder), bytes, a `datasets`
    Image dict ``{"bytes", "path"}`` or a PIL image (saved as PNG)."""
    what = f"field {field!r}: image {k}"
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        else:
            raise InvalidRow("missing_image", field, f"{what} is a dict with neither 'bytes' nor 'path'")
    if isinstance(value, bytearray | memoryview):
        value = bytes(value)
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        path = value if os.path.isabs(value) or not base_dir else os.path.join(base_dir, value)
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise InvalidRow("missing_image", field, f"{what}: cannot read the file {path!r} ({exc.strerror or exc}); "
                             "relative paths are read from the input file's folder") from None
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image (a `datasets` row decoded in memory)
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    raise InvalidRow("wrong_type", field, f"{what} must be a file path, bytes or a {{'bytes', 'path'}} object, got "
                     f"{type(value).__name__}")


def image_size(data: bytes, field: str, k: int) -> tuple[int, int]:
    """Decode the image fully (a truncated file fails here, not in training) and return (width, height)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return int(img.size[0]), int(img.size[1])
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ValueError...
        raise InvalidRow("undecodable_image", field, f"field {field!r}: image {k} ({len(data)} bytes) cannot be "
                         f"decoded ({type(exc).__name__}: {exc})") from None
