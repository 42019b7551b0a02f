"""Images of vision-language rows, for `prepare --processor DIR` (docs/images.md).

An image is read as its encoded bytes (a file path, raw bytes, or the ``{"bytes": ..., "path": ...}`` dict a
`datasets` Image feature stores), decoded once to check it and learn its size, and stored as those same bytes
(no pixels). Its placeholder in the prompt text is expanded to the exact number of tokens the processor gives it,
as its family counts them (``prefpack.vision_families``: Qwen2-VL's patch grid over ``merge_size**2``, LLaVA's
patches of the processor's crop), so token budgets count the image exactly. A row's images are untrusted input:
reading and decoding them (allowed folders, regular files, a size limit, an allow-list of formats) is
``image_files``'s job.

Supported: the processors of the families in ``prefpack.vision_families.FAMILIES`` (``SUPPORTED_PROCESSORS``);
any other is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from prefpack.data.image_files import image_bytes, image_size  # noqa: F401 - read and decoded there
from prefpack.remote_code import check_processor_code
from prefpack.vision_families import (
    FAMILIES,
    ProcessorError,
    VisionFamily,
    family_for_processor,
    family_named,
)

__all__ = ["PROCESSOR_CONFIG", "SUPPORTED_PROCESSORS", "ProcessorError", "Vision", "image_bytes", "image_size",
           "load_vision", "processor_identity"]

PROCESSOR_CONFIG = "processor_config.json"
SUPPORTED_PROCESSORS = tuple(f.processor for f in FAMILIES.values())


@dataclass
class Vision:
    """What a prepare worker needs to expand images: the image processor and the image token (text and id)."""

    processor: Any
    image_token: str
    image_token_id: int
    kind: str = "qwen2_vl"  # the family's name (prefpack.vision_families.FAMILIES), stored in meta.json
    # the processor's own settings that decide token counts (the family's read_settings; LLaVA: LLAVA_SETTINGS from
    # processor_config.json); empty for qwen2_vl
    settings: dict = field(default_factory=dict)

    @property
    def family(self) -> VisionFamily:
        return family_named(self.kind)

    def placeholder_tokens(self, width: int, height: int) -> int:
        """The number of image tokens the processor gives an image of this size (the one place that counts them)."""
        return self.family.count_tokens(self.processor, self.settings, width, height)


def load_vision(path: str, tok, *, trust_remote_code: bool = False) -> Vision:
    """The image processor of the folder `path` and the image token of `tok` (the same folder's tokenizer). A folder
    naming processor code is refused unless ``trust_remote_code`` (prefpack.remote_code)."""
    try:
        from PIL import Image  # noqa: F401
    except ImportError:
        raise ProcessorError("--processor needs Pillow to read images: pip install 'prefpack[vision]'") from None
    from transformers import AutoImageProcessor

    if not os.path.isdir(path):
        raise ProcessorError(f"--processor {path!r} is not a folder (give a processor folder holding "
                             "preprocessor_config.json and the tokenizer)")
    check_processor_code(path, allowed=trust_remote_code, what="--processor")
    try:
        proc = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # a missing or unreadable preprocessor_config.json
        raise ProcessorError(f"--processor {path!r}: cannot load an image processor from it ({type(exc).__name__}: "
                             f"{exc})") from None
    config = _processor_config(path)
    pclass = config.get("processor_class")
    family = family_for_processor(config, proc)
    if family is None:
        what = f"{pclass} with {type(proc).__name__}" if pclass else type(proc).__name__
        raise ProcessorError(f"--processor {path!r}: {what} is not supported yet; prefpack expands images for "
                             f"{' and '.join(SUPPORTED_PROCESSORS)}, see docs/images.md")
    where = f"--processor {path!r}" + (f" ({pclass})" if pclass in family.processor_classes else "")
    settings = family.read_settings(where, proc, config, tok) if family.read_settings is not None else {}
    token = settings.get("image_token") or getattr(tok, "image_token", None) or family.default_image_token
    return Vision(proc, token, _token_id(path, tok, token), kind=family.name, settings=settings)


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


def processor_identity(vision: Vision, path: str, tokenizer_hash: str) -> dict:
    """meta.json's record of the processor: its class and settings, the image token, and one hash over them and
    the tokenizer's content hash (the same settings and tokenizer give the same image token counts)."""
    settings = json.loads(json.dumps(vision.processor.to_dict(), sort_keys=True, default=str))
    fields = {"settings": settings, "image_token": vision.image_token, "tokenizer": tokenizer_hash}
    if vision.family.hashes_kind:  # (a Qwen2-VL store's hash is the same as before LLaVA was added)
        fields.update(kind=vision.kind, processor_settings=vision.settings)
    body = json.dumps(fields, sort_keys=True)
    out = {"path": path, "class": type(vision.processor).__name__, "kind": vision.kind,
           "image_token": vision.image_token, "image_token_id": vision.image_token_id, "settings": settings}
    if vision.settings:
        out["processor_settings"] = dict(vision.settings)
    return {**out, "hash": hashlib.sha256(body.encode()).hexdigest()}
