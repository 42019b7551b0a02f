"""Vision-language models (issue 27): telling one from a causal LM, loading it, its parts, its image features.

A vision-language model is a config with a ``vision_config``. Two families are supported, each tested on a tiny
model (``prefpack.toy_vision``): the Qwen2-VL / Qwen2.5-VL family (a vision tower ending in a patch merger, 3-D
rotary positions in the language model) and LLaVA (``LlavaForConditionalGeneration``: a CLIP-style tower, a
``multi_modal_projector``); any other is refused with a message naming these. The parts:

* the language model's body and head (``prefpack.model.head.body_and_head`` finds them as for a causal LM);
* the vision encoder and the projector (Qwen2-VL: ``visual`` without / with its ``merger``; LLaVA: ``vision_tower``
  and ``multi_modal_projector``), frozen by default (``model.freeze_vision``, ``model.freeze_projector``);
* :func:`image_features`: the vision tower run ONCE over a micro-batch's ``pixel_values`` (every image of the
  batch, each once, however many sequences show it), the concatenated per-image features [rows, H], under
  ``torch.no_grad`` when encoder and projector are both frozen.

The forward (``prefpack.model.forward``) writes feature row ``Batch.image_feature_rows[k]`` at flat position
``Batch.image_positions[k]`` of the embedded input ids and runs the body on ``inputs_embeds``. Qwen2-VL's body takes
position ids [4, B, L]: row 0 the 1-D text positions, which its mask code and prefpack's kernels read for the
sequence boundaries, rows 1..3 the rotary (t, h, w) positions. Given 2-D position ids it reads NO boundaries and lets
packed sequences attend to each other, silently (:func:`body_positions` never hands it those).

Attention: the language model gets the run's kernel (``packed_sdpa``, ``varlen``, ...); the vision tower, whose
attention is bidirectional over each image's patches and never packed by prefpack, keeps a transformers kernel
(:func:`vision_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MROPE_TYPES", "SUPPORTED", "VisionParts", "apply_freeze", "attention_setting", "body_positions",
           "check_processor", "hf_model", "image_features", "is_vision_language", "lora_targets", "mrope", "unsupported_message",
           "vision_attention", "vision_parts"]

# model_type -> the family's name in messages
MROPE_TYPES = ("qwen2_vl", "qwen2_5_vl")
SUPPORTED = {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "llava": "LLaVA (LlavaForConditionalGeneration)"}

# transformers' own kernels, which a vision tower may run; anything else (prefpack's packed kernels, hub kernels)
# gives the tower sdpa
_TOWER_KERNELS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


def _config(model_or_config):
    config = getattr(model_or_config, "config", None)
    if config is None and isinstance(model_or_config, nn.Module):
        config = getattr(getattr(model_or_config, "module", None), "config", None)
    return model_or_config if config is None else config


def is_vision_language(model_or_config) -> bool:
    """Whether a model (or its config) is a vision-language model: its config has a ``vision_config``."""
    return getattr(_config(model_or_config), "vision_config", None) is not None


def mrope(model_or_config) -> bool:
    """Whether the model's language model reads 3-D rotary positions (the Qwen2-VL family): its body must get
    position ids [4, B, L] (see the module docstring). Cheap: two attribute reads."""
    return getattr(_config(model_or_config), "model_type", None) in MROPE_TYPES


def unsupported_message(model_or_config, what: str = "model") -> str | None:
    """None for a supported vision-language model (or a text model), else the message refusing it."""
    config = _config(model_or_config)
    if not is_vision_language(config):
        return None
    kind = getattr(config, "model_type", None)
    if kind in SUPPORTED:
        return None
    names = ", ".join(SUPPORTED.values())
    return (f"{what} is a vision-language model of type {kind!r}, which prefpack does not train yet; the supported "
            f"vision-language families are {names}")


def vision_attention(attn_implementation: str) -> str:
    """The kernel of the vision tower when the language model runs ``attn_implementation``."""
    return attn_implementation if attn_implementation in _TOWER_KERNELS else "sdpa"


def attention_setting(attn_implementation: str) -> dict:
    """``attn_implementation`` for ``from_pretrained`` of a vision-language model: the run's kernel for the model and
    its language model, :func:`vision_attention` for the vision tower."""
    return {"": attn_implementation, "text_config": attn_implementation,
            "vision_config": vision_attention(attn_implementation)}


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / torch.compile / peft wrappers."""
    for _ in range(6):
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None) if not hasattr(model, "get_output_embeddings") else None
        if isinstance(inner, nn.Module):
            model = inner
            continue
        base = getattr(model, "get_base_model", None)  # peft
        if callable(base) and base() is not model:
            model = base()
            continue
        break
    return model


@dataclass(frozen=True)
class VisionParts:
    """Where a vision-language model's pieces are. ``encoder``: the modules whose parameters ``model.freeze_vision``
    freezes; ``projector``: those ``model.freeze_projector`` freezes; ``tower``: the module called once per
    micro-batch (Qwen2-VL: ``visual``, merger included; LLaVA: ``vision_tower``)."""

    model: nn.Module  # the transformers model (ForConditionalGeneration)
    kind: str  # config.model_type
    tower: nn.Module
    encoder: tuple[nn.Module, ...]
    projector: tuple[nn.Module, ...]
    language_model: nn.Module
    image_token_id: int
    merge_size: int  # image-grid patches merged into one image token per side (Qwen2-VL: 2; LLaVA: 1)

    @property
    def mrope(self) -> bool:
        return self.kind in MROPE_TYPES

    def prefixes(self) -> dict[str, list[str]]:
        """Qualified module names (in :attr:`model`) of the encoder, the projector and the language model."""
        names = {id(m): n for n, m in self.model.named_modules()}
        return {"encoder": [names[id(m)] for m in self.encoder], "projector": [names[id(m)] for m in self.projector],
                "language_model": [names[id(self.language_model)]]}


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
    kind = config.model_type
    inner = getattr(hf, "model", hf)
    image_token_id = int(config.image_token_id)
    if kind in MROPE_TYPES:
        tower = inner.visual
        encoder = tuple(m for name, m in tower.named_children() if name != "merger")
        return VisionParts(hf, kind, tower, encoder, (tower.merger,), inner.language_model, image_token_id,
                           int(config.vision_config.spatial_merge_size))
    return VisionParts(hf, kind, inner.vision_tower, (inner.vision_tower,), (inner.multi_modal_projector,),
                       inner.language_model, image_token_id, 1)


def _frozen(modules) -> bool:
    return not any(p.requires_grad for m in modules for p in m.parameters())


def image_features(parts: VisionParts, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every image's features, concatenated in image order [rows, hidden] (image 0's tokens first): ONE call of the
    vision tower over ``pixel_values``; under no_grad when the encoder and the projector are both frozen."""
    frozen = _frozen(parts.encoder) and _frozen(parts.projector)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
        if parts.mrope:
            if image_grid_thw is None:
                raise ValueError(f"{SUPPORTED[parts.kind]} images need image_grid_thw (the processor's patch grids)")
            tower = parts.tower
            feats = tower(pixel_values.to(_dtype_of(tower)), grid_thw=image_grid_thw).pooler_output
        else:
            inner = getattr(parts.model, "model", parts.model)
            out = inner.get_image_features(pixel_values=pixel_values.to(_dtype_of(parts.tower)), return_dict=True)
            pooled = out.pooler_output
            feats = torch.cat(list(pooled), 0) if isinstance(pooled, (list, tuple)) else pooled.reshape(
                -1, pooled.shape[-1])
    return feats if dtype is None else feats.to(dtype)


def frozen_key(parts: VisionParts) -> tuple | None:
    """A key of the vision weights when the encoder and the projector are both frozen (None otherwise): two models
    whose frozen vision weights are equal (the policy and its copied reference loaded from one checkpoint, or the
    adapter-off reference, which is the policy) get the same key, so one's image features serve the other
    (``Batch.vision_cache``). The key is each vision tensor's shape, dtype and float64 sum, computed once per model;
    equal weights give equal sums, other checkpoints different ones."""
    if not (_frozen(parts.encoder) and _frozen(parts.projector)):
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
    vc = parts.model.config.vision_config
    if parts.mrope:
        m = parts.merge_size
        channels = int(getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3))
        width = channels * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
        grid = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
        return torch.zeros(m * m, width, device=device), grid
    size = int(vc.image_size)
    return torch.zeros(1, int(getattr(vc, "num_channels", 3)), size, size, device=device), None


def _dtype_of(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def body_positions(model_or_parts, position_ids: torch.Tensor, rope_positions: torch.Tensor | None = None,
                   ) -> torch.Tensor:
    """The position ids a body takes: ``position_ids`` [B, L] as they are for a model without 3-D rotary positions;
    for the Qwen2-VL family [4, B, L] = text positions, then ``rope_positions`` [3, B, L] (None, a text batch: the
    text positions three times, which is what ``get_rope_index`` gives text)."""
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
    for modules, frozen in ((parts.encoder, freeze_vision), (parts.projector, freeze_projector)):
        for m in modules:
            for p in m.parameters():
                p.requires_grad_(not frozen)
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
    ``meta["processor"]`` (``image_token_id``, the image processor's ``settings``). The image token must be the
    model's, and the processor's patch grid the vision tower's (Qwen2-VL family: ``patch_size``,
    ``temporal_patch_size``, ``merge_size``; LLaVA: the crop is the tower's ``image_size``), else the placeholder
    counts would not match the features. A ValueError naming the first difference."""
    parts = vision_parts(model)
    kind = processor.get("kind")  # the processor family prepare expanded the images for (older stores: none)
    want = "qwen2_vl" if parts.mrope else "llava"
    if kind is not None and kind != want:
        raise ValueError(f"{where} was prepared with a {kind} processor, whose image token counts and pixels a "
                         f"{SUPPORTED[parts.kind]} model does not read: prepare it again with --processor set to this "
                         "model's folder (its own processor)")
    token = processor.get("image_token_id")
    if token is not None and int(token) != parts.image_token_id:
        raise ValueError(f"{where} marks images with token id {token} ({processor.get('image_token')!r}) but the "
                         f"model's image token id is {parts.image_token_id}: prepare it again with this model's "
                         "processor")
    settings = processor.get("settings") or {}
    vc = parts.model.config.vision_config
    if parts.mrope:
        pairs = (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                 ("merge_size", "spatial_merge_size"))
    else:
        crop = settings.get("crop_size")
        settings = {"crop": crop.get("height") if isinstance(crop, dict) else crop}
        pairs = (("crop", "image_size"),)
    for key, attr in pairs:
        have, want = settings.get(key), getattr(vc, attr, None)
        if have is not None and want is not None and int(have) != int(want):
            raise ValueError(f"{where} was prepared with an image processor whose {key} is {have}, but the model's "
                             f"vision tower has {attr}={want}: the image token counts would not match its features; "
                             "prepare it again with this model's processor")
