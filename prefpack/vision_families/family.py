"""The :class:`VisionFamily` descriptor: what prepare, the store and the run ask of a vision-language family without
loading torch (``prepare --processor`` and reading a store's meta.json must not load it; like
``model/attention/kernels.py``). The model-side half of a family (its parts, features, smallest input, processor check,
self-check inputs) is the module of the same name in ``prefpack/model/vision/``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prefpack.errors import PrefpackError

__all__ = ["ProcessorError", "VisionFamily"]


class ProcessorError(PrefpackError, ValueError):
    """A --processor folder prefpack cannot use."""


@dataclass(frozen=True)
class VisionFamily:
    """One family of vision-language models, keyed by ``name``.

    ``name`` is what a store records (meta.json ``processor.kind``, ``data.images.Vision.kind``), so it never
    changes. ``model_types``: the model configs' ``model_type`` values it trains -> their name in messages.
    ``processor``: the ``--processor`` folders it reads, in messages. A folder is this family's when its
    processor_config.json names one of ``processor_classes``, else when ``image_processor_fits(processor)``
    (:func:`prefpack.vision_families.family_for_processor`).

    Prepare side: ``read_settings(where, image_processor, processor_config, tokenizer)`` -> the processor's own
    settings that decide token counts (kept in meta.json; an ``image_token`` there is the image token), checked, a
    :class:`ProcessorError` naming ``where`` otherwise; ``count_tokens(image_processor, settings, width, height)``:
    an image's placeholder tokens (the one place that counts them); ``merge_size(image_processor)``: patches merged
    per image token per side (a grid of h x w patches gives h * w / merge**2 tokens).

    ``mrope``: the language model reads 3-D rotary positions (bodies take position ids [4, B, L]; batches carry
    ``rope_positions``, ``prefpack.batching.vision``). ``hashes_kind``: the processor's hash covers ``name`` and
    the settings (False for Qwen2-VL: its stores' hashes from before a second family existed stay valid).
    ``shown_as``: what ``prefpack inspect`` adds after the processor's class.
    """

    name: str
    model_types: Mapping[str, str]
    processor: str
    count_tokens: Callable[[Any, dict, int, int], int]
    default_image_token: str
    processor_classes: tuple[str, ...] = ()
    image_processor_fits: Callable[[Any], bool] | None = None
    read_settings: Callable[[str, Any, dict, Any], dict] | None = None  # None: no settings of its own
    merge_size: Callable[[Any], int] = lambda image_processor: 1  # noqa: E731 - no merging
    mrope: bool = False
    hashes_kind: bool = True
    shown_as: str = ""
