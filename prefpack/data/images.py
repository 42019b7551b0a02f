"""Images of vision-language rows, for `prepare --processor DIR` (docs/images.md).

An image is read as its encoded bytes (a file path, raw bytes, or the ``{"bytes": ..., "path": ...}`` dict a
`datasets` Image feature stores), decoded once to check it and learn its size, and stored as those same bytes
(no pixels). Its placeholder in the prompt text is expanded to the exact number of tokens the processor gives it:
for the Qwen2-VL family ``(grid_t * grid_h * grid_w) / merge_size**2`` image tokens between ``<|vision_start|>``
and ``<|vision_end|>``, so token budgets count the image exactly.

Only image processors with Qwen2-VL's grid (``merge_size`` and ``get_number_of_image_patches``) are supported now.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from typing import Any

from prefpack.data.row_checks import InvalidRow
from prefpack.errors import PrefpackError

DEFAULT_IMAGE_TOKEN = "<|image_pad|>"  # Qwen2-VL, Qwen2.5-VL


class ProcessorError(PrefpackError, ValueError):
    """A --processor folder prefpack cannot use."""


@dataclass
class Vision:
    """What a prepare worker needs to expand images: the image processor and the image token (text and id)."""

    processor: Any
    image_token: str
    image_token_id: int

    def placeholder_tokens(self, width: int, height: int) -> int:
        """The number of image tokens the processor gives an image of this size."""
        merge = int(self.processor.merge_size)
        return int(self.processor.get_number_of_image_patches(height, width, {})) // (merge * merge)


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
    if not hasattr(proc, "merge_size") or not hasattr(proc, "get_number_of_image_patches"):
        raise ProcessorError(f"--processor {path!r}: {type(proc).__name__} is not supported yet; prefpack expands "
                             "images for Qwen2-VL-style processors (an image grid with merge_size), see docs/images.md")
    token = getattr(tok, "image_token", None) or DEFAULT_IMAGE_TOKEN
    tid = tok.convert_tokens_to_ids(token)
    if tid is None or tid == tok.unk_token_id or tok.convert_ids_to_tokens(tid) != token:
        raise ProcessorError(f"--processor {path!r}: the tokenizer has no {token!r} token, which stands for the "
                             "image's tokens in the text")
    return Vision(proc, token, int(tid))


def processor_identity(vision: Vision, path: str, tokenizer_hash: str) -> dict:
    """meta.json's record of the processor: its class and settings, the image token, and one hash over them and
    the tokenizer's content hash (the same settings and tokenizer give the same image token counts)."""
    settings = json.loads(json.dumps(vision.processor.to_dict(), sort_keys=True, default=str))
    body = json.dumps({"settings": settings, "image_token": vision.image_token, "tokenizer": tokenizer_hash},
                      sort_keys=True)
    return {"path": path, "class": type(vision.processor).__name__, "image_token": vision.image_token,
            "image_token_id": vision.image_token_id, "settings": settings,
            "hash": hashlib.sha256(body.encode()).hexdigest()}


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
