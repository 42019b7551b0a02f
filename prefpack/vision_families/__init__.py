"""The vision-language families prefpack trains, one torch-free :class:`VisionFamily` descriptor each
(``family.py``), one module per family; ``FAMILIES`` (name -> family) is the one table the package reads to tell
families apart: prepare (which family a ``--processor`` folder is, an image's token count), a store's meta.json
(``processor.kind`` is a family's name), the run (3-D rotary positions, the merge size) and the model side
(``prefpack/model/vision/``: one module per family, keyed by the same name).

Adding a family: a module here with its descriptor, its row in ``FAMILIES``, its model-side module in
``prefpack/model/vision/``, and its toy assets (``prefpack.toy_vision``); see docs/extending.md.
"""

from __future__ import annotations

from typing import Any

from prefpack.vision_families.family import ProcessorError, VisionFamily
from prefpack.vision_families.llava import LLAVA
from prefpack.vision_families.qwen2_vl import QWEN2_VL

__all__ = ["FAMILIES", "SUPPORTED", "STORED_BEFORE_FAMILIES", "ProcessorError", "VisionFamily", "family_for_processor",
           "family_named", "family_of_model_type", "family_of_store"]

# In the order messages list them.
FAMILIES: dict[str, VisionFamily] = {f.name: f for f in (QWEN2_VL, LLAVA)}

# model_type -> the family's name in messages
SUPPORTED: dict[str, str] = {t: label for f in FAMILIES.values() for t, label in f.model_types.items()}
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}

# The family of image stores prepared before meta.json recorded one (only Qwen2-VL's existed then).
STORED_BEFORE_FAMILIES = QWEN2_VL.name


def family_named(name: str) -> VisionFamily:
    """The family called ``name`` (a store's ``processor.kind``); a KeyError naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown vision-language family {name!r}; one of {', '.join(FAMILIES)}") from None


def family_of_model_type(model_type: str | None) -> VisionFamily | None:
    """The family that trains models of this ``config.model_type``, or None."""
    return _BY_MODEL_TYPE.get(model_type)


def family_of_store(processor_meta: dict) -> VisionFamily:
    """The family a store's images were expanded for, from its meta.json ``processor`` record."""
    return family_named(processor_meta.get("kind") or STORED_BEFORE_FAMILIES)


def family_for_processor(processor_config: dict, image_processor: Any) -> VisionFamily | None:
    """The family of a processor folder: the one whose ``processor_classes`` hold the class its
    processor_config.json names, else the first whose image processor test passes; None if none."""
    pclass = processor_config.get("processor_class")
    for family in FAMILIES.values():
        if pclass in family.processor_classes:
            return family
    for family in FAMILIES.values():
        if family.image_processor_fits is not None and family.image_processor_fits(image_processor):
            return family
    return None
