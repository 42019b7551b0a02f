"""Tiny vision-language assets built offline, for tests, benchmarks and the images example (docs/images.md).

Everything is generated: a toy ChatML tokenizer with Qwen2-VL's image tokens (``toy_tokenizer.add_vision_tokens``),
a processor folder (that tokenizer + Qwen2-VL's image processor), random-weight models from configs (a Qwen2-VL
and a LLaVA-style model whose language model is a Qwen2), PNG images of random pixels, and preference rows in
TRL's vision layout. Nothing is downloaded.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from prefpack.toy_tokenizer import add_vision_tokens, build_toy_tokenizer

__all__ = ["VLM_KINDS", "png_image", "processor", "save_processor_dir", "tiny_vlm", "vision_rows", "vision_tokenizer",
           "unpaired_vision_rows"]

_WORDS = ("a cat on a mat", "a dog in the fog", "a red square", "two blue circles", "a green tree by a lake",
          "nothing at all", "a small boat", "a bright yellow sun", "a striped shirt", "an old brown chair")
_QUESTIONS = ("what is in the picture?", "describe the image.", "what colour is it?", "how many things are there?")


def vision_tokenizer(vocab_size: int = 300):
    """A toy ChatML tokenizer that holds Qwen2-VL's image tokens and a template writing image parts."""
    texts = [f"user: {q} assistant: {w}." for q in _QUESTIONS for w in _WORDS] * 4
    return add_vision_tokens(build_toy_tokenizer(texts, style="chatml", vocab_size=vocab_size))


# The toy LLaVA processor: CLIP's image processor at the tiny LLaVA's 28 pixels (resize the shortest edge to 28, crop
# 28 x 28), 14-pixel patches, the CLS feature dropped ("default"): (28 // 14) ** 2 + 1 - 1 = 4 image tokens per image.
LLAVA_IMAGE_SIZE, LLAVA_PATCH_SIZE = 28, 14
LLAVA_SETTINGS = dict(patch_size=LLAVA_PATCH_SIZE, vision_feature_select_strategy="default",
                      num_additional_image_tokens=1, image_token="<|image_pad|>")


def _text_settings(tok, hidden: int, layers: int) -> dict:
    return dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                tie_word_embeddings=False)


# --- Qwen2-VL: its own image processor (28 pixels per image token); the folder is that and the tokenizer


def _qwen2_vl_image_processor(**settings):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**settings)


def _qwen2_vl_model(text: dict, ids: dict, hidden: int):
    """A one-block vision tower with 2x2 patch merging, 3-D rotary positions."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    half = hidden // 4 // 2  # rotary frequencies per head (4 heads): split over temporal, height, width
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                               "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]}
    cfg = Qwen2VLConfig(text_config=text,
                        vision_config=dict(depth=1, embed_dim=16, hidden_size=hidden, num_heads=2, mlp_ratio=2,
                                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
                        image_token_id=ids["image"], vision_start_token_id=ids["start"],
                        vision_end_token_id=ids["end"], tie_word_embeddings=False)
    return Qwen2VLForConditionalGeneration(cfg)


# --- LLaVA: a LlavaProcessor (LLAVA_SETTINGS) around CLIP's image processor at 28 x 28 pixels


def _llava_image_processor(**settings):
    try:
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:  # transformers before the PIL / torchvision split
        from transformers import CLIPImageProcessor
    size = LLAVA_IMAGE_SIZE
    return CLIPImageProcessor(**{"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size},
                                 **settings})


def _llava_processor(image_processor, tokenizer, **settings):
    from transformers import LlavaProcessor

    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, **{**LLAVA_SETTINGS, **settings})


def _llava_model(text: dict, ids: dict, hidden: int):
    """A one-layer CLIP vision tower on 28-pixel images, a two-layer projector, a Qwen2 language model."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2Config

    cfg = LlavaConfig(text_config=Qwen2Config(**text),
                      vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=28, patch_size=14),
                      image_token_id=ids["image"], projector_hidden_act="gelu", tie_word_embeddings=False)
    return LlavaForConditionalGeneration(cfg)


class _Toy(NamedTuple):
    """One family's toy assets (keyed by its name in ``prefpack.vision_families.FAMILIES``: tested)."""

    image_processor: Callable  # (**settings) -> the image processor
    processor: Callable | None  # (image processor, tokenizer, **settings) -> the whole processor; None: the image
    # processor alone is what prepare reads (saved beside the tokenizer)
    model: Callable  # (text config dict, image token ids, hidden) -> the model


_TOYS = {"qwen2_vl": _Toy(_qwen2_vl_image_processor, None, _qwen2_vl_model),
         "llava": _Toy(_llava_image_processor, _llava_processor, _llava_model)}
VLM_KINDS = tuple(_TOYS)


def _toy(kind: str) -> _Toy:
    if kind not in _TOYS:
        raise ValueError(f"no toy vision-language assets for {kind!r}; one of {VLM_KINDS}")
    return _TOYS[kind]


def image_processor(kind: str = "qwen2_vl", **settings):
    """The image processor of a toy processor folder: Qwen2-VL's (default settings: 28 pixels per image token), or
    for ``llava`` CLIP's at 28 x 28 pixels (`settings` override its own, e.g. ``do_center_crop=False``)."""
    return _toy(kind).image_processor(**settings)


def processor(kind: str = "qwen2_vl", tokenizer=None, image_settings: dict | None = None, **settings):
    """The whole toy processor: for ``llava`` a ``LlavaProcessor`` (CLIP's image processor, the tokenizer, and
    ``LLAVA_SETTINGS`` with `settings` applied: the image token is ``<|image_pad|>``, as the tiny LLaVA's
    image_token_id); for ``qwen2_vl`` the image processor alone (what prepare reads)."""
    toy = _toy(kind)
    image = toy.image_processor(**(image_settings or {}))
    return image if toy.processor is None else toy.processor(image, tokenizer or vision_tokenizer(), **settings)


def save_processor_dir(path: str | Path, kind: str = "qwen2_vl", tokenizer=None, *,
                       image_settings: dict | None = None, **settings) -> Path:
    """Write a processor folder that `prepare --processor` reads: the tokenizer and the image processor's settings
    (``qwen2_vl``), or a LlavaProcessor's ``save_pretrained`` (``llava``: processor_config.json with patch_size,
    vision_feature_select_strategy, num_additional_image_tokens and image_token, CLIP's image processor, the
    tokenizer). `image_settings` and `settings` override the image processor's and the LlavaProcessor's."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or vision_tokenizer()
    if _toy(kind).processor is not None:
        processor(kind, tok, image_settings, **settings).save_pretrained(path)
        return path
    tok.save_pretrained(path)
    image_processor(kind, **(image_settings or {})).save_pretrained(path)
    return path


def tiny_vlm(kind: str = "qwen2_vl", tokenizer=None, *, seed: int = 0, hidden: int = 32, layers: int = 2):
    """A random-weight vision-language model (float32, eval mode) whose image token is the tokenizer's
    ``<|image_pad|>``: ``qwen2_vl`` (a one-block vision tower with 2x2 patch merging, 3-D rotary positions) or
    ``llava`` (a one-layer CLIP vision tower on 28-pixel images, a two-layer projector, a Qwen2 language model)."""
    import torch

    toy = _toy(kind)
    tok = tokenizer or vision_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in
           (("image", "<|image_pad|>"), ("start", "<|vision_start|>"), ("end", "<|vision_end|>"))}
    text = _text_settings(tok, hidden, layers)
    torch.manual_seed(seed)
    return toy.model(text, ids, hidden).float().eval()


def png_image(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of random pixels."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def vision_rows(n: int, image_dir: str | Path, *, seed: int = 0, sizes=((56, 56), (84, 56), (56, 112)),
                relative_to: str | Path | None = None) -> list[dict]:
    """``n`` preference rows in TRL's vision layout; the PNGs are written to ``image_dir`` and ``images`` holds their
    paths relative to ``relative_to`` (the folder of the .jsonl the rows go to; default ``image_dir``). Every third
    row has two images, the others one."""
    image_dir = Path(image_dir)
    base = Path(relative_to) if relative_to is not None else image_dir
    image_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        names = []
        for k in range(2 if i % 3 == 2 else 1):
            w, h = sizes[int(rng.integers(len(sizes)))]
            name = f"img_{i:04d}_{k}.png"
            (image_dir / name).write_bytes(png_image(w, h, seed=seed * 100003 + i * 7 + k))
            names.append(os.path.relpath(image_dir / name, base))
        chosen, rejected = rng.choice(len(_WORDS), size=2, replace=False)
        content = [{"type": "image"}] * len(names) + [{"type": "text", "text": _QUESTIONS[i % len(_QUESTIONS)]}]
        rows.append({"images": names, "prompt": [{"role": "user", "content": content}],
                     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": _WORDS[chosen]}]}],
                     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": _WORDS[rejected]}]}]})
    return rows


def unpaired_vision_rows(n: int, image_dir: str | Path, *, seed: int = 0, **kw) -> list[dict]:
    """``n`` unpaired (KTO) rows in TRL's vision layout (``images``, ``prompt`` messages with image parts,
    ``completion``, ``label``): the rows of ``vision_rows``, each giving its chosen reply (label true) when ``i`` is
    even and its rejected one (label false) when odd."""
    rows = vision_rows(n, image_dir, seed=seed, **kw)
    return [{"images": r["images"], "prompt": r["prompt"], "completion": r["chosen" if i % 2 == 0 else "rejected"],
             "label": i % 2 == 0} for i, r in enumerate(rows)]


COLOURS = {"red": (200, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 210), "yellow": (220, 200, 30)}


def colour_rows(n: int, image_dir: str | Path, *, seed: int = 0, relative_to: str | Path | None = None) -> list[dict]:
    """``n`` preference rows in TRL's vision layout whose answer needs the image: each image is one colour of
    ``COLOURS`` with noise (56 x 56 or 84 x 56 pixels), the question asks for it, chosen names it and rejected names
    another. A model that learns to prefer chosen must read the image (the text alone is the same for every
    colour)."""
    from PIL import Image

    image_dir = Path(image_dir)
    image_dir.mkdir(parents=True, exist_ok=True)
    base = Path(relative_to) if relative_to is not None else image_dir
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    rows = []
    for i in range(n):
        colour, other = rng.choice(len(names), size=2, replace=False)
        w, h = ((56, 56), (84, 56))[int(rng.integers(2))]
        pixels = np.clip(np.array(COLOURS[names[colour]]) + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
        path = image_dir / f"colour_{i:04d}.png"
        Image.fromarray(pixels).save(path, format="PNG")
        content = [{"type": "image"}, {"type": "text", "text": "what colour is it?"}]
        rows.append({"images": [os.path.relpath(path, base)], "prompt": [{"role": "user", "content": content}],
                     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": f"it is {names[colour]}"}]}],
                     "rejected": [{"role": "assistant",
                                   "content": [{"type": "text", "text": f"it is {names[other]}"}]}]})
    return rows


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
