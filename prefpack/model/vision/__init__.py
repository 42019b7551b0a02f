"""Vision-language models (issue 27): telling one from a causal LM, loading it, its parts, its image features.

A vision-language model is a config with a ``vision_config``. The families prefpack trains are the table
``prefpack.vision_families.FAMILIES`` (torch-free: prepare reads it too); each has its model-side module here, named
as the family (``qwen2_vl.py``: the Qwen2-VL / Qwen2.5-VL family, a vision tower ending in a patch merger, 3-D rotary
positions in the language model; ``llava.py``: ``LlavaForConditionalGeneration``, a CLIP-style tower and a
``multi_modal_projector``), each tested on a tiny model (``prefpack.toy_vision``); any other model is refused with a
message naming the supported ones. The parts (:class:`~prefpack.model.vision.parts.VisionParts`):

* the language model's body and head (``prefpack.model.head.body_and_head`` finds them as for a causal LM);
* the vision encoder and the projector, frozen by default (``model.freeze_vision``, ``model.freeze_projector``);
* :func:`image_features`: the vision tower run ONCE over a micro-batch's ``pixel_values`` (every image of the
  batch, each once, however many sequences show it), the concatenated per-image features [rows, H], under
  ``torch.no_grad`` when encoder and projector are both frozen.

The forward (``prefpack.model.forward``) writes feature row ``Batch.image_feature_rows[k]`` at flat position
``Batch.image_positions[k]`` of the embedded input ids and runs the body on ``inputs_embeds``. A family with 3-D
rotary positions (``VisionFamily.mrope``: Qwen2-VL) has a body taking position ids [4, B, L]: row 0 the 1-D text
positions, which its mask code and prefpack's kernels read for the sequence boundaries, rows 1..3 the rotary
(t, h, w) positions. Given 2-D position ids it reads NO boundaries and lets packed sequences attend to each other,
silently (:func:`body_positions` never hands it those).

Attention: the language model gets the run's kernel (``packed_sdpa``, ``varlen``, ...); the vision tower, whose
attention is bidirectional over each image's patches and never packed by prefpack, keeps a transformers kernel
(:func:`vision_attention`, the kernel table's ``runs_vision_tower``).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from prefpack.model.attention.kernels import kernel_named
from prefpack.model.vision import llava, qwen2_vl
from prefpack.model.vision.parts import VisionParts, config_of, frozen, hf_model, is_vision_language
from prefpack.vision_families import SUPPORTED, family_of_model_type

__all__ = ["FAMILY_MODULES", "SUPPORTED", "VisionParts", "apply_freeze", "attention_setting", "body_positions",
           "check_processor", "family_module", "hf_model", "image_features", "is_vision_language", "lora_targets",
           "mrope", "unsupported_message", "vision_attention", "vision_parts"]

# family name -> its model-side module (the same keys as prefpack.vision_families.FAMILIES: tested)
FAMILY_MODULES: dict[str, ModuleType] = {m.FAMILY.name: m for m in (qwen2_vl, llava)}


def family_module(parts: VisionParts) -> ModuleType:
    """The model-side module of the model's family (``parts.FamilyModule``)."""
    return FAMILY_MODULES[parts.family.name]


def mrope(model_or_config) -> bool:
    """Whether the model's language model reads 3-D rotary positions (its family's ``mrope``: Qwen2-VL): its body
    must get position ids [4, B, L] (see the module docstring). Cheap: two attribute reads."""
    family = family_of_model_type(getattr(config_of(model_or_config), "model_type", None))
    return family is not None and family.mrope


def unsupported_message(model_or_config, what: str = "model") -> str | None:
    """None for a supported vision-language model (or a text model), else the message refusing it."""
    config = config_of(model_or_config)
    if not is_vision_language(config):
        return None
    kind = getattr(config, "model_type", None)
    if kind in SUPPORTED:
        return None
    names = ", ".join(SUPPORTED.values())
    return (f"{what} is a vision-language model of type {kind!r}, which prefpack does not train yet; the supported "
            f"vision-language families are {names}")


def vision_attention(attn_implementation: str) -> str:
    """The kernel of the vision tower when the language model runs ``attn_implementation``: the same when the kernel
    table says a tower may run it (transformers' own kernels), else sdpa."""
    return attn_implementation if kernel_named(attn_implementation).runs_vision_tower else "sdpa"


def attention_setting(attn_implementation: str) -> dict:
    """``attn_implementation`` for ``from_pretrained`` of a vision-language model: the run's kernel for the model and
    its language model, :func:`vision_attention` for the vision tower."""
    return {"": attn_implementation, "text_config": attn_implementation,
            "vision_config": vision_attention(attn_implementation)}


def vision_parts(model: nn.Module) -> VisionParts:
    """The parts of a supported vision-language model (through DDP / compile / peft wrappers); a ValueError for a
    text model or an unsupported one."""
    hf = hf_model(model)
    config = hf.config
    if not is_vision_language(config):
        raise ValueError(f"{type(hf).__name__} is not a vision-language model (its config has no vision_config)")
    message = unsupported_message(config)
    if message:
        raise ValueError(message)
    return FAMILY_MODULES[family_of_model_type(config.model_type).name].parts(hf)


def image_features(parts: VisionParts, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every image's features, concatenated in image order [rows, hidden] (image 0's tokens first): ONE call of the
    vision tower over ``pixel_values``; under no_grad when the encoder and the projector are both frozen."""
    is_frozen = frozen(parts.encoder) and frozen(parts.projector)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not is_frozen):
        feats = family_module(parts).tower_features(parts, pixel_values, image_grid_thw)
    return feats if dtype is None else feats.to(dtype)


def frozen_key(parts: VisionParts) -> tuple | None:
    """A key of the vision weights when the encoder and the projector are both frozen (None otherwise): two models
    whose frozen vision weights are equal (the policy and its copied reference loaded from one checkpoint, or the
    adapter-off reference, which is the policy) get the same key, so one's image features serve the other
    (``Batch.vision_cache``). The key is each vision tensor's shape, dtype and float64 sum, computed once per model;
    equal weights give equal sums, other checkpoints different ones."""
    if not (frozen(parts.encoder) and frozen(parts.projector)):
        return None
    key = getattr(parts.model, "_prefpack_vision_key", None)
    if key is None:
        tensors = [p.to_local() if hasattr(p, "to_local") else p  # FSDP2: this rank's shard (models shard alike)
                   for m in (*parts.encoder, *parts.projector) for p in m.parameters()]
        with torch.no_grad():
            sums = torch.stack([p.detach().double().sum() for p in tensors]).cpu().tolist() if tensors else []
        key = (parts.kind, tuple((tuple(p.shape), str(p.dtype), s) for p, s in zip(tensors, sums)))
        parts.model._prefpack_vision_key = key
    return key


def cached_image_features(parts: VisionParts, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None,
                          cache: dict | None) -> torch.Tensor:
    """:func:`image_features`, read from (or written to) ``cache`` when the vision weights are frozen: a second model
    with the same frozen vision weights does not encode the batch's images again."""
    key = frozen_key(parts) if cache is not None else None
    if key is not None and key in cache:
        return cache[key]
    feats = image_features(parts, pixel_values, image_grid_thw)
    if key is not None:
        cache[key] = feats.detach()
    return feats


def placeholder_pixels(parts: VisionParts, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The smallest image the tower takes, all zeros (Qwen2-VL: one merged token's patches; LLaVA: one crop): what a
    rank whose micro-batch holds no image encodes so that every rank runs the tower (see ``forward``)."""
    return family_module(parts).placeholder_pixels(parts, device)


def body_positions(model_or_parts, position_ids: torch.Tensor, rope_positions: torch.Tensor | None = None,
                   ) -> torch.Tensor:
    """The position ids a body takes: ``position_ids`` [B, L] as they are for a model without 3-D rotary positions;
    for a family with them (Qwen2-VL) [4, B, L] = text positions, then ``rope_positions`` [3, B, L] (None, a text
    batch: the text positions three times, which is what ``get_rope_index`` gives text)."""
    is_mrope = model_or_parts.mrope if isinstance(model_or_parts, VisionParts) else mrope(hf_model(model_or_parts))
    if not is_mrope:
        if rope_positions is not None:
            raise ValueError("rope_positions given for a model without 3-D rotary positions")
        return position_ids
    if rope_positions is None:
        return position_ids[None].expand(4, *position_ids.shape)
    return torch.cat([position_ids[None], rope_positions.to(position_ids.device)], 0)


def apply_freeze(model: nn.Module, *, freeze_vision: bool = True, freeze_projector: bool = True) -> VisionParts:
    """``model.freeze_vision`` / ``model.freeze_projector``: no gradient for the vision encoder / the projector
    (their parameters' ``requires_grad`` off); the other is left trainable."""
    parts = vision_parts(model)
    for modules, is_frozen in ((parts.encoder, freeze_vision), (parts.projector, freeze_projector)):
        for m in modules:
            for p in m.parameters():
                p.requires_grad_(not is_frozen)
    return parts


def lora_targets(model: nn.Module, target_modules: str | list[str], *, freeze_vision: bool = True,
                 freeze_projector: bool = True) -> list[str]:
    """LoRA's target modules on a vision-language model, as qualified names: the linear layers of the language model
    (and of the encoder / projector when not frozen) that ``target_modules`` names ("all-linear", or names a module's
    name ends with, as peft matches them); never the LM head."""
    parts = vision_parts(model)
    where = parts.prefixes()
    allowed = list(where["language_model"])
    if not freeze_vision:
        allowed += where["encoder"]
    if not freeze_projector:
        allowed += where["projector"]
    head = parts.model.get_output_embeddings()
    out = []
    for name, module in parts.model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        if not any(name == a or name.startswith(a + ".") for a in allowed):
            continue
        if target_modules != "all-linear":
            wanted = [target_modules] if isinstance(target_modules, str) else list(target_modules)
            if not any(name == t or name.endswith("." + t) for t in wanted):
                continue
        out.append(name)
    if not out:
        raise ValueError(f"lora.target_modules={target_modules!r} names no linear layer of the language model")
    return out


def check_processor(model: nn.Module, processor: dict, where: str = "the store") -> None:
    """Refuse a store whose images were expanded for another model: ``processor`` is the store's
    ``meta["processor"]`` (``kind``: the family's name, ``image_token_id``, the image processor's ``settings``). The
    family and the image token must be the model's, and the processor's settings the vision tower's (the family
    module's ``processor_checks``: Qwen2-VL's patch grid, LLaVA's crop), else the placeholder counts would not match
    the features. A ValueError naming the first difference."""
    parts = vision_parts(model)
    kind = processor.get("kind")  # the processor family prepare expanded the images for (older stores: none)
    if kind is not None and kind != parts.family.name:
        raise ValueError(f"{where} was prepared with a {kind} processor, whose image token counts and pixels a "
                         f"{parts.label} model does not read: prepare it again with --processor set to this "
                         "model's folder (its own processor)")
    token = processor.get("image_token_id")
    if token is not None and int(token) != parts.image_token_id:
        raise ValueError(f"{where} marks images with token id {token} ({processor.get('image_token')!r}) but the "
                         f"model's image token id is {parts.image_token_id}: prepare it again with this model's "
                         "processor")
    vc = parts.model.config.vision_config
    for key, have, attr in family_module(parts).processor_checks(processor.get("settings") or {}):
        want = getattr(vc, attr, None)
        if have is not None and want is not None and int(have) != int(want):
            raise ValueError(f"{where} was prepared with an image processor whose {key} is {have}, but the model's "
                             f"vision tower has {attr}={want}: the image token counts would not match its features; "
                             "prepare it again with this model's processor")

