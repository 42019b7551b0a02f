"""Hand-built vision-language batches for tests/test_vision_forward.py (no collator's vision side needed): the text
fields from ``collate_groups``, the image fields computed here from each sequence's images."""

from __future__ import annotations

import io

import numpy as np
import torch

from prefpack.batching.collate import Batch, collate_groups
from prefpack.toy_vision import image_processor, png_image, tiny_vlm, vision_tokenizer

TOK = vision_tokenizer()
IMAGE_ID = TOK.convert_tokens_to_ids("<|image_pad|>")
START_ID = TOK.convert_tokens_to_ids("<|vision_start|>")
END_ID = TOK.convert_tokens_to_ids("<|vision_end|>")
LLAVA_TOKENS = 4  # a 28-pixel image in 14-pixel patches, CLS dropped


def model(kind: str, attn: str = "sdpa", seed: int = 0):
    """A tiny float64 model whose language model runs ``attn`` (the vision tower sdpa)."""
    from prefpack.model.attention.kernels import kernel_named
    from prefpack.model.vision import attention_setting

    kernel = kernel_named(attn)
    if kernel.register is not None:
        kernel.register()
    m = (tiny_qwen2_5_vl(seed) if kind == "qwen2_5_vl" else tiny_vlm(kind, TOK, seed=seed)).double()
    m.set_attn_implementation(attention_setting(attn))
    return m


def tiny_qwen2_5_vl(seed: int = 0):
    """A tiny Qwen2.5-VL (two vision blocks: a windowed one and a full-attention one), toy_vision's settings."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from prefpack.toy_vision import _text_settings

    text = _text_settings(TOK, 32, 2)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    cfg = Qwen2_5_VLConfig(text_config=text,
                           vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                                              out_hidden_size=32, patch_size=14, spatial_merge_size=2,
                                              temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
                           image_token_id=IMAGE_ID, vision_start_token_id=START_ID, vision_end_token_id=END_ID,
                           tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg).float().eval()


class Images:
    """Images 0..n-1 of a test and what the model's processor makes of them."""

    def __init__(self, kind: str, n: int, seed: int = 0):
        self.kind = kind
        sizes = [(56, 56), (84, 56), (56, 112), (56, 84)]
        if kind in ("qwen2_vl", "qwen2_5_vl"):
            from PIL import Image

            self.pil = [Image.open(io.BytesIO(png_image(*sizes[i % len(sizes)], seed=seed + i))).convert("RGB")
                        for i in range(n)]
            proc = image_processor()
            self.per_image = [proc(images=[im], return_tensors="pt") for im in self.pil]
            self.tokens = [int(o["image_grid_thw"][0].prod()) // 4 for o in self.per_image]
        else:
            g = torch.Generator().manual_seed(seed)
            self.pixels = torch.randn(n, 3, 28, 28, generator=g, dtype=torch.float64)
            self.tokens = [LLAVA_TOKENS] * n

    def inputs(self, which: list[int]) -> dict:
        """The processor's output for images ``which`` in that order (one call), as the model takes it."""
        if self.kind in ("qwen2_vl", "qwen2_5_vl"):
            if not which:
                return {}
            out = image_processor()(images=[self.pil[i] for i in which], return_tensors="pt")
            return {"pixel_values": out["pixel_values"].double(), "image_grid_thw": out["image_grid_thw"]}
        return {"pixel_values": self.pixels[which]} if which else {}


def prompt_ids(images: Images, which: list[int], rng: np.random.Generator) -> np.ndarray:
    """Text, then each image's placeholder run (Qwen2-VL: between vision start / end), then text."""
    parts = [rng.integers(5, 250, int(rng.integers(2, 5)))]
    for i in which:
        run = [IMAGE_ID] * images.tokens[i]
        parts.append(np.array([START_ID, *run, END_ID] if images.kind in ("qwen2_vl", "qwen2_5_vl") else run))
        parts.append(rng.integers(5, 250, int(rng.integers(1, 4))))
    return np.concatenate(parts).astype(np.int64)


def vision_batch(mdl, images: Images, groups, rows, group_images: list[list[int]], *, padded: bool = False,
                 share_prompts: bool = False) -> Batch:
    """``collate_groups`` of ``groups`` plus the image fields: the batch's images = each group's images in group
    order, each ONCE (``image_feature_rows`` point every copy of a placeholder run at the same features)."""
    batch = collate_groups(groups, None if padded else rows, ids=list(range(len(groups))),
                           share_prompts=share_prompts)
    order = [i for imgs in group_images for i in imgs]
    first_row = np.cumsum([0] + [images.tokens[i] for i in order])
    # sequence -> its group; a group's images, as feature row ranges
    seq_group = [g for g, (_, comps) in enumerate(groups) for _ in comps]
    base = np.cumsum([0] + [len(x) for x in group_images])
    ids = batch.input_ids
    flat_ids = ids.reshape(-1)
    seq = batch.seq_index.reshape(-1)
    positions, rows_, rope = [], [], None
    qwen = images.kind in ("qwen2_vl", "qwen2_5_vl")
    if qwen:
        rope = batch.position_ids[None].repeat(3, 1, 1).clone()
    B, L = ids.shape
    for s in range(batch.num_sequences):
        g = seq_group[s]
        at = (seq == s).nonzero().squeeze(1)
        if share_prompts and comps_index(groups, s) > 0:
            continue  # a later completion: its prompt's placeholders are the first completion's block
        if share_prompts:  # the whole block of a group: prompt and every completion
            at = torch.cat([(seq == t).nonzero().squeeze(1) for t in group_sequences(groups, g)]).sort().values
        img_at = at[flat_ids[at] == IMAGE_ID]
        feats = torch.cat([torch.arange(first_row[base[g] + j], first_row[base[g] + j + 1])
                           for j in range(len(group_images[g]))]) if group_images[g] else torch.zeros(0, dtype=torch.long)
        assert img_at.numel() == feats.numel()
        positions.append(img_at)
        rows_.append(feats)
        if qwen and not share_prompts:
            r, c = at // L, at % L
            mdl_inner = mdl.model
            tokens = flat_ids[at][None]
            grids = images.inputs(group_images[g]).get("image_grid_thw")
            pos, _ = mdl_inner.get_rope_index(tokens, mm_token_type_ids=(tokens == IMAGE_ID).int(),
                                              image_grid_thw=grids)
            rope[:, r, c] = pos[:, 0]
    if qwen and share_prompts:
        for g in range(len(groups)):
            prompt, comps = groups[g]
            grids = images.inputs(group_images[g]).get("image_grid_thw")
            for j, t in enumerate(group_sequences(groups, g)):
                # every completion's positions are those of its unshared sequence prompt + completion
                tokens = torch.as_tensor(np.concatenate([prompt, comps[j]]))[None]
                pos, _ = mdl.model.get_rope_index(tokens, mm_token_type_ids=(tokens == IMAGE_ID).int(),
                                                  image_grid_thw=grids)
                at = (seq == t).nonzero().squeeze(1)
                if j == 0:  # the prompt's tokens carry the first completion's sequence index
                    r, c = at // L, at % L
                    rope[:, r, c] = pos[:, 0]
                else:
                    r, c = at // L, at % L
                    rope[:, r, c] = pos[:, 0, len(prompt):]
    batch.pixel_values = images.inputs(order).get("pixel_values")
    batch.image_grid_thw = images.inputs(order).get("image_grid_thw")
    batch.image_positions = torch.cat(positions)
    batch.image_feature_rows = torch.cat(rows_)
    batch.rope_positions = rope
    return batch


def group_sequences(groups, g: int) -> list[int]:
    start = sum(len(c) for _, c in groups[:g])
    return list(range(start, start + len(groups[g][1])))


def comps_index(groups, s: int) -> int:
    for _, comps in groups:
        if s < len(comps):
            return s
        s -= len(comps)
    raise IndexError(s)


def hf_sequence_logps(mdl, images: Images, groups, group_images, *, grad: bool = False) -> torch.Tensor:
    """Each sequence ``prompt + completion`` alone through the model's own forward: its completion log-prob sum
    (under autograd with ``grad``)."""
    out = []
    for (prompt, comps), which in zip(groups, group_images):
        for c in comps:
            ids = torch.as_tensor(np.concatenate([prompt, c]))[None]
            extra = images.inputs(which)
            if images.kind in ("qwen2_vl", "qwen2_5_vl") and which:
                extra["mm_token_type_ids"] = (ids == IMAGE_ID).int()
            with torch.set_grad_enabled(grad):
                logits = mdl(input_ids=ids, use_cache=False, **extra).logits.double()
            logp = logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
            out.append(logp[len(prompt) - 1:].sum())
    return torch.stack(out)


__all__ = ["END_ID", "IMAGE_ID", "Images", "START_ID", "TOK", "hf_sequence_logps", "model", "prompt_ids",
           "vision_batch"]
_ = tiny_vlm
