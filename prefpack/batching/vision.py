"""The vision fields of a collated micro-batch (issue 27, docs/images.md): where each image token sits, which row of
the micro-batch's image features it takes, and Qwen2-VL's 3-D rotary positions.

Pure functions of a :class:`~prefpack.batching.collate.Batch` (any layout: packed rows, prompt-shared rows, padded
rows) and of its groups' images. A group's prompt holds its images' placeholder runs (images sit in prompts only), so
every sequence of a group holds the same runs at the same 1-D positions: both sequences of a pair without prompt
sharing, each completion of a prompt group, a KTO example and its KL sequence (example i's prompt with another
example's completion). Prompt-shared rows lay the prompt out once, inside the group's first sequence; the later
completions continue its position ids, so their rotary positions continue its own too.

Each image is preprocessed and encoded once per micro-batch: the images are numbered in the batch's feature order
(groups' order, each group's images in prompt order, an image shared by several groups once) and every copy of a
placeholder run maps to the same feature rows.

Rotary positions (``mrope``) follow ``Qwen2VLModel.get_rope_index`` on each sequence alone: a text token's three
positions are ``current_pos``; an image's tokens are its (t, h, w) index in the merged grid plus ``current_pos``,
after which ``current_pos`` grows by ``max(h, w) // merge_size``. So a text token at 1-D position p has
``p + delta``, delta being the sum over earlier images of ``max(h, w) // merge - tokens``.

No transformers or PIL here (``batching`` is a low import floor): ``VisionSettings.preprocess`` is a callable the
caller builds (``prefpack.data.vision_inputs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from prefpack.batching.collate import Batch

__all__ = ["BatchImage", "ImageLayoutError", "VisionFields", "VisionSettings", "fill_vision", "images_per_group",
           "vision_fields"]


class ImageLayoutError(ValueError):
    """A batch's image tokens disagree with its images' stored counts or grids: a damaged store (prepare it again)
    or a processor other than the one the store was prepared with."""


@dataclass(frozen=True)
class VisionSettings:
    """What collating a vision-language micro-batch needs (``RunSettings.vision``; None for text runs).

    ``image_token_id``: the placeholder token an image's features replace. ``mrope``: compute Qwen2-VL's 3-D rotary
    positions (``Batch.rope_positions``). ``merge_size``: the vision tower's spatial merge (Qwen2-VL: 2; a grid of
    h x w patches gives h * w / merge**2 tokens). ``preprocess``: a list of decoded images -> a dict with
    ``pixel_values`` and, for the Qwen2-VL family, ``image_grid_thw`` (tensors or arrays), one call per micro-batch.
    """

    image_token_id: int
    mrope: bool = False
    merge_size: int = 1
    preprocess: Callable[[list], dict] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.image_token_id, bool) or not isinstance(self.image_token_id, int | np.integer) \
                or self.image_token_id < 0:
            raise ValueError(f"VisionSettings.image_token_id must be a token id, got {self.image_token_id!r}")
        if isinstance(self.merge_size, bool) or not isinstance(self.merge_size, int | np.integer) \
                or self.merge_size < 1:
            raise ValueError(f"VisionSettings.merge_size must be a positive integer, got {self.merge_size!r}")


class BatchImage(NamedTuple):
    """One image of a group's prompt, as the micro-batch holds it.

    ``index``: its number among the micro-batch's preprocessed images (feature order); ``tokens``: its placeholder
    tokens (the store's count); ``grid_thw``: its patch grid (Qwen2-VL family; None otherwise); ``start``: where its
    run starts in the prompt, when known (checked against the batch).
    """

    index: int
    tokens: int
    grid_thw: tuple[int, int, int] | None = None
    start: int | None = None


@dataclass
class VisionFields:
    """The positional vision fields of a batch (see ``Batch``)."""

    image_positions: torch.Tensor  # [K] int64
    image_feature_rows: torch.Tensor  # [K] int64
    rope_positions: torch.Tensor | None  # [3, B, L] int64 (mrope) or None


def images_per_group(groups: Sequence[Sequence[tuple[Any, int]]]) -> list[list[BatchImage]]:
    """Groups' images given as ``(grid_thw or None, token count)`` per image, each its own image (numbered in group
    order, then prompt order), as :func:`vision_fields` reads them."""
    out, at = [], 0
    for images in groups:
        row = []
        for grid, tokens in images:
            row.append(BatchImage(at, int(tokens), None if grid is None else tuple(int(x) for x in grid)))
            at += 1
        out.append(row)
    return out


def _feature_starts(group_images: Sequence[Sequence[BatchImage]]) -> np.ndarray:
    """Each image's first row in the concatenated features (images 0..I-1 in order), checking the numbering."""
    tokens: dict[int, int] = {}
    for images in group_images:
        for im in images:
            if tokens.setdefault(int(im.index), int(im.tokens)) != int(im.tokens):
                raise ImageLayoutError(f"image {im.index} is given with {tokens[int(im.index)]} and {im.tokens} tokens")
    if sorted(tokens) != list(range(len(tokens))):
        raise ImageLayoutError(f"the micro-batch's images must be numbered 0..{len(tokens) - 1}, got {sorted(tokens)}")
    counts = np.asarray([tokens[i] for i in range(len(tokens))], dtype=np.int64)
    if (counts < 1).any():
        raise ImageLayoutError("an image has no placeholder tokens: the store is damaged; prepare it again")
    return np.concatenate([[0], np.cumsum(counts)])


def _merged_grid(im: BatchImage, merge: int, where: str) -> tuple[int, int, int]:
    if im.grid_thw is None:
        raise ImageLayoutError(f"{where}: image {im.index} has no grid (image_grid_thw): 3-D rotary positions need "
                               "the Qwen2-VL family's image processor")
    t, h, w = (int(x) for x in im.grid_thw)
    if h % merge or w % merge or t * (h // merge) * (w // merge) != im.tokens:
        raise ImageLayoutError(f"{where}: image {im.index}'s grid {(t, h, w)} with merge size {merge} gives "
                               f"{t * h * w // merge ** 2} tokens, the store holds {im.tokens}: the store was prepared "
                               "with another processor, or is damaged; prepare it again")
    return t, h // merge, w // merge


def vision_fields(batch: Batch, group_images: Sequence[Sequence[BatchImage]], group_sizes: Sequence[int],
                  settings: VisionSettings) -> VisionFields:
    """``image_positions``, ``image_feature_rows`` and (``settings.mrope``) ``rope_positions`` of ``batch``.

    ``group_images[g]``: group g's images in prompt order (:class:`BatchImage`); ``group_sizes[g]``: its sequences
    (completions), in the batch's group order (the order ``collate_groups`` numbered the sequences in). Raises
    :class:`ImageLayoutError` where a sequence's image tokens do not match its images' stored counts.
    """
    sizes = np.asarray(group_sizes, dtype=np.int64)
    if len(group_images) != len(sizes):
        raise ValueError(f"{len(group_images)} groups' images for {len(sizes)} group sizes")
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    if int(offsets[-1]) != batch.num_sequences:
        raise ValueError(f"the group sizes add up to {int(offsets[-1])} sequences; the batch has {batch.num_sequences}")
    starts = _feature_starts(group_images)
    shared = batch.score_positions is not None
    merge = int(settings.merge_size)
    b, length = batch.input_ids.shape
    ids = batch.input_ids.reshape(-1).numpy()
    pos = batch.position_ids.reshape(-1).numpy()
    seq = batch.seq_index.reshape(-1).numpy()
    group_of = np.repeat(np.arange(len(sizes)), sizes)
    grp = np.where(seq >= 0, group_of[np.maximum(seq, 0)], -1)
    is_image = (ids == int(settings.image_token_id)) & (seq >= 0)
    image_flat = np.flatnonzero(is_image)
    image_flat = image_flat[np.argsort(seq[image_flat], kind="stable")]  # by sequence; a sequence's in token order
    by_seq = np.split(image_flat, np.cumsum(np.bincount(seq[image_flat], minlength=len(group_of)))[:-1])
    rope = None
    if settings.mrope:
        rope = np.broadcast_to(pos, (3, pos.shape[0])).copy()
        in_group = np.flatnonzero(grp >= 0)
        order = in_group[np.argsort(grp[in_group], kind="stable")]  # each group's tokens, every sequence of it
        per_group = np.split(order, np.cumsum(np.bincount(grp[in_group], minlength=len(sizes)))[:-1])
    out_pos, out_rows = [], []
    for g, images in enumerate(group_images):
        expected = sum(int(im.tokens) for im in images)
        bounds = np.cumsum([0] + [int(im.tokens) for im in images])
        starts_1d = None  # the 1-D position of each image's first token (the same in every copy of the prompt)
        for j in range(int(sizes[g])):
            s = int(offsets[g]) + j
            flat = by_seq[s]
            where = f"group {g} (id {int(batch.group_ids[g])}), sequence {j}"
            if flat.shape[0] == 0 and expected and shared and j > 0:
                continue  # a later completion of a prompt-shared group: its prompt is the first sequence's
            if flat.shape[0] != expected:
                raise ImageLayoutError(f"{where}: {flat.shape[0]} image tokens, but its {len(images)} images hold "
                                       f"{expected} by the store's counts: the store is damaged; prepare it again")
            if not expected:
                continue
            breaks = np.flatnonzero(np.diff(flat) != 1) + 1  # where a new run of image tokens starts
            if not np.isin(breaks, bounds[1:-1]).all():
                lens = np.diff(np.concatenate([[0], breaks, [flat.shape[0]]])).tolist()
                raise ImageLayoutError(f"{where}: runs of {lens} image tokens do not match its images' stored counts "
                                       f"{[int(im.tokens) for im in images]}: the store is damaged; prepare it again")
            first = pos[flat[bounds[:-1]]]
            for im, a in zip(images, first.tolist()):
                if im.start is not None and int(im.start) != a:
                    raise ImageLayoutError(f"{where}: image {im.index}'s tokens start at position {a} of the prompt, "
                                           f"the store says {im.start}: the store is damaged; prepare it again")
            if starts_1d is not None and not np.array_equal(starts_1d, first):
                raise ImageLayoutError(f"{where}: its prompt's images sit elsewhere than in the group's other "
                                       "sequences")
            starts_1d = first
            out_pos.append(flat)
            out_rows.append(np.concatenate([starts[im.index] + np.arange(im.tokens) for im in images]))
        if rope is not None and expected and starts_1d is not None:
            _group_rope(rope, pos, per_group[g], images, starts_1d, is_image, merge, f"group {g}")
    positions = np.concatenate(out_pos).astype(np.int64) if out_pos else np.zeros(0, np.int64)
    rows = np.concatenate(out_rows).astype(np.int64) if out_rows else np.zeros(0, np.int64)
    order = np.argsort(positions, kind="stable")
    return VisionFields(image_positions=torch.from_numpy(positions[order]),
                        image_feature_rows=torch.from_numpy(rows[order]),
                        rope_positions=None if rope is None else torch.from_numpy(rope.reshape(3, b, length)))


def _group_rope(rope: np.ndarray, pos: np.ndarray, flat: np.ndarray, images: Sequence[BatchImage],
                starts_1d: np.ndarray, is_image: np.ndarray, merge: int, where: str) -> None:
    """Fill ``rope`` [3, B * L] at the group's tokens ``flat`` (every sequence of it): text ``pos + delta``, images
    their grid index plus where their run starts."""
    grids = [_merged_grid(im, merge, where) for im in images]
    step = np.asarray([max(h, w) - im.tokens for im, (_, h, w) in zip(images, grids)], dtype=np.int64)
    ends = starts_1d + np.asarray([im.tokens for im in images], dtype=np.int64)  # first position after each image
    p = pos[flat]
    shift = np.concatenate([[0], np.cumsum(step)])  # delta after k images
    delta = shift[np.searchsorted(ends, p, side="right")]
    rope[:, flat] = p + delta
    img = flat[is_image[flat]]
    if img.shape[0] == 0:
        return
    p_img = pos[img]
    k = np.searchsorted(ends, p_img, side="right")  # the image a token belongs to
    base = starts_1d[k] + shift[k]
    inner = p_img - starts_1d[k]  # index inside the image's run: raster order over (t, h, w)
    hw = np.asarray([h * w for _, h, w in grids], dtype=np.int64)[k]
    w_ = np.asarray([w for _, _, w in grids], dtype=np.int64)[k]
    rope[0, img] = base + inner // hw
    rope[1, img] = base + (inner % hw) // w_
    rope[2, img] = base + inner % w_


def fill_vision(batch: Batch, group_images: Sequence[Sequence[BatchImage]], group_sizes: Sequence[int],
                settings: VisionSettings, *, pixel_values: Any, image_grid_thw: Any = None) -> Batch:
    """Set ``batch``'s vision fields (in place; returns it): the micro-batch's preprocessed images and what
    :func:`vision_fields` gives. A micro-batch whose groups hold no image (an image store's text-only rows) has
    ``pixel_values`` None and no image positions; its ``rope_positions`` (mrope) are its text positions."""
    fields = vision_fields(batch, group_images, group_sizes, settings)
    if pixel_values is None and fields.image_positions.numel():
        raise ValueError("a batch with image tokens needs its pixel_values")
    batch.pixel_values = None if pixel_values is None else torch.as_tensor(pixel_values)
    batch.image_grid_thw = None if image_grid_thw is None else torch.as_tensor(image_grid_thw, dtype=torch.int64)
    batch.image_positions = fields.image_positions
    batch.image_feature_rows = fields.image_feature_rows
    batch.rope_positions = fields.rope_positions
    return batch
