"""A micro-batch's images read from an image store, decoded and preprocessed once (issue 27, docs/images.md).

:func:`read_batch_images` takes, per group of a collated micro-batch, the store example whose prompt (and so whose
images) the group holds; it reads each example's images once (``Store.images_of``), decodes them with Pillow and
calls the run's ``VisionSettings.preprocess`` ONCE over all of them, in feature order (groups' order, each group's
images in prompt order; an example met again, e.g. a pair's two KTO halves, adds no image). It checks that the
processor's grid gives each image the token count the store holds. :func:`attach_images` then fills one or more
batches laid out over those groups (a KTO micro-batch's main and KL batches share the images: one preprocessing).

:func:`processor_preprocess` and :func:`vision_settings` build the preprocess callable and the settings from a
store's ``processor/`` folder (``AutoImageProcessor.from_pretrained``). transformers and Pillow are imported on use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefpack.batching.collate import Batch
from prefpack.batching.vision import BatchImage, ImageLayoutError, VisionSettings, fill_vision
from prefpack.data.image_files import open_image
from prefpack.data.store import Store, StoreError
from prefpack.vision_families import VisionFamily, family_of_store

__all__ = ["BatchImages", "ImagePrefetcher", "attach_images", "attach_store_images", "check_store_vision", "decode_image",
           "processor_preprocess", "prompt_start", "read_batch_images", "vision_settings"]


@dataclass
class BatchImages:
    """A micro-batch's preprocessed images: ``pixel_values`` / ``image_grid_thw`` (one processor call over every
    image, in feature order) and, per group, its images (:class:`~prefpack.batching.vision.BatchImage`)."""

    pixel_values: torch.Tensor | None  # None: no group of the micro-batch holds an image
    image_grid_thw: torch.Tensor | None
    group_images: list[list[BatchImage]]
    examples: tuple[int, ...]  # the store examples the groups read, in group order (what this was built for)

    @property
    def num_images(self) -> int:
        return len({im.index for images in self.group_images for im in images})


def decode_image(data: bytes):
    """A stored image's encoded bytes as a decoded Pillow image (loaded, so the bytes can go): the allowed formats'
    decoders only, EXIF orientation applied, exactly as prepare decoded it to count its tokens (``open_image``)."""
    return open_image(data)


def _decoded(store: Store, example: int, k: int, info: dict):
    """Image ``k`` of store example ``example``, decoded; bytes that no longer decode (prepare decoded every image)
    mean a damaged store, said by name, not a Pillow traceback in the middle of training."""
    try:
        return decode_image(info["data"])
    except Exception as exc:  # Pillow raises several types (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise StoreError(f"{store.path}: image {k} of example {example} ({info['bytes']} bytes at offset "
                         f"{info['offset']} of images.bin) no longer decodes ({type(exc).__name__}: {exc}); prepare "
                         "decoded it, so images.bin is damaged: prepare the store again") from None


def prompt_start(store: Store, example: int) -> int:
    """Where example ``example``'s prompt starts in ``tokens.bin`` (a ranked row: its group's prompt, before its
    group's first row)."""
    if store.kind == "ranked":
        starts = store.group_starts()
        first = int(starts[np.searchsorted(starts, example, side="right") - 1])
        return int(store.index[first, 0]) - int(store.index[first, 1])
    return int(store.index[example, 0])


def _as_tensor(x, dtype=None) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x, dtype=dtype)


def read_batch_images(store: Store, examples: Sequence[int], settings: VisionSettings) -> BatchImages:
    """The images of groups whose prompts are store examples ``examples`` (one per group, in the batch's group
    order), preprocessed in one ``settings.preprocess`` call (see the module docstring)."""
    if settings.preprocess is None:
        raise ValueError("VisionSettings.preprocess is not set: build it with processor_preprocess(store folder)")
    first: dict[int, list[BatchImage]] = {}
    decoded: list = []
    group_images: list[list[BatchImage]] = []
    for ex in (int(e) for e in examples):
        if ex not in first:
            infos = store.images_of(ex)
            start = prompt_start(store, ex) if infos else 0
            first[ex] = [BatchImage(len(decoded) + k, int(info["tokens"]), None, int(info["position"]) - start)
                         for k, info in enumerate(infos)]
            decoded.extend(_decoded(store, ex, k, info) for k, info in enumerate(infos))
        group_images.append(first[ex])
    if not decoded:
        return BatchImages(None, None, group_images, tuple(int(e) for e in examples))
    out = settings.preprocess(decoded)
    if "pixel_values" not in out:
        raise ValueError(f"the image preprocessing returned {sorted(out)}, no pixel_values")
    pixels = _as_tensor(out["pixel_values"])
    grid = out.get("image_grid_thw")
    grid = None if grid is None else _as_tensor(grid, torch.int64)
    if grid is not None:
        if tuple(grid.shape) != (len(decoded), 3):
            raise ValueError(f"the image processor gave image_grid_thw of shape {tuple(grid.shape)} for "
                             f"{len(decoded)} images")
        merge = int(settings.merge_size)
        counts = (grid.prod(dim=1) // merge ** 2).tolist()
        grids = [tuple(int(x) for x in row) for row in grid.tolist()]
        by_index = {}
        for images in first.values():
            for im in images:
                if counts[im.index] != im.tokens:
                    raise ImageLayoutError(
                        f"store {str(store.path)!r}: image {im.index} of this micro-batch (size "
                        f"{decoded[im.index].size}) has the grid {grids[im.index]}, i.e. {counts[im.index]} tokens "
                        f"with merge size {merge}, but the store holds {im.tokens}: the processor differs from the "
                        "one the store was prepared with, or the store is damaged; prepare it again")
                by_index[im.index] = im._replace(grid_thw=grids[im.index])
        group_images = [[by_index[im.index] for im in images] for images in group_images]
    return BatchImages(pixels, grid, group_images, tuple(int(e) for e in examples))


def attach_images(batches: Sequence[Batch | None], images: BatchImages, group_sizes: Sequence[int],
                  settings: VisionSettings) -> None:
    """Fill the vision fields of each batch (laid out over the same groups, e.g. KTO's main and KL batches) from one
    preprocessing (the batches share ``pixel_values``, and the frozen towers' features: ``Batch.vision_cache``)."""
    cache: dict = {}
    for batch in batches:
        if batch is not None:
            fill_vision(batch, images.group_images, group_sizes, settings, pixel_values=images.pixel_values,
                        image_grid_thw=images.image_grid_thw)
            batch.vision_cache = cache


def check_store_vision(store: Store, settings: VisionSettings | None) -> None:
    """An objective's store against the run's vision settings: an image store needs them (a text model would train on
    its placeholder tokens) and the image token they name; a text store reads with or without them."""
    if not store.num_images:
        return
    if settings is None:
        raise StoreError(f"store {str(store.path)!r} holds {store.num_images} images: training on it needs the run's "
                         "vision settings (RunSettings.vision)")
    token = int((store.meta.get("processor") or {}).get("image_token_id", -1))
    if token != int(settings.image_token_id):
        raise StoreError(f"store {str(store.path)!r} marks images with token {token}, the run with "
                         f"{settings.image_token_id}: prepare the store with the model's processor")


def attach_store_images(batches: Sequence[Batch | None], store: Store, examples: Sequence[int],
                        group_sizes: Sequence[int], settings: VisionSettings,
                        prefetcher: ImagePrefetcher | None = None) -> BatchImages:
    """:func:`read_batch_images` (or the prefetcher's result) then :func:`attach_images`: the vision fields of
    ``batches``, whose groups read store examples ``examples`` (one per group) and hold ``group_sizes`` sequences."""
    images = prefetcher.get(examples) if prefetcher is not None else read_batch_images(store, examples, settings)
    attach_images(batches, images, group_sizes, settings)
    return images


class ImagePrefetcher:
    """Reads and preprocesses micro-batches' images on one background thread: :meth:`submit` a micro-batch's
    examples (one store row per group, as :func:`read_batch_images` takes them) ahead of time, :meth:`get` them when
    collating (read on the spot if not submitted). A result is kept until taken; at most ``depth`` are pending (a
    further submit is ignored: that micro-batch is read when collated). Reading in the background is safe: the store
    opens its image file per read, and the preprocess call keeps no state."""

    def __init__(self, store: Store, settings: VisionSettings, depth: int = 16):
        self.store, self.settings, self.depth = store, settings, int(depth)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefpack-images")
        self._pending: dict[tuple[int, ...], Future] = {}
        self._lock = threading.Lock()

    def submit(self, examples: Sequence[int]) -> None:
        key = tuple(int(e) for e in examples)
        with self._lock:
            if key in self._pending or len(self._pending) >= self.depth:
                return
            self._pending[key] = self._pool.submit(read_batch_images, self.store, key, self.settings)

    def submit_all(self, batches: Sequence[Sequence[int]]) -> None:
        """Submit each micro-batch (in order) and drop what was submitted before and is not among them (a plan that
        changed, e.g. after a resume)."""
        keys = [tuple(int(e) for e in ex) for ex in batches]
        wanted = set(keys)
        with self._lock:
            for key in [k for k in self._pending if k not in wanted]:
                self._pending.pop(key).cancel()
        for key in keys:
            self.submit(key)

    def get(self, examples: Sequence[int]) -> BatchImages:
        key = tuple(int(e) for e in examples)
        with self._lock:
            future = self._pending.pop(key, None)
        if future is None:
            return read_batch_images(self.store, key, self.settings)
        return future.result()

    def close(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for f in pending:
            f.cancel()
        self._pool.shutdown(wait=True)


def processor_preprocess(path: str | Path, *, trust_remote_code: bool = False
                         ) -> tuple[Callable[[list], dict], Any]:
    """The preprocess callable of the image processor saved in ``path`` (a store's ``processor/``), and the processor.
    It returns torch tensors: ``pixel_values`` and, where the processor gives one, ``image_grid_thw``. A folder naming
    processor code is refused unless ``trust_remote_code`` (prefpack.remote_code)."""
    from transformers import AutoImageProcessor

    from prefpack.remote_code import check_processor_code

    check_processor_code(path, allowed=trust_remote_code, what="store processor folder")
    processor = AutoImageProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)

    def preprocess(images: list) -> dict:
        out = processor(images=images, return_tensors="pt")
        return {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}

    return preprocess, processor


def vision_settings(store: Store, *, family: VisionFamily | None = None,
                    trust_remote_code: bool = False) -> VisionSettings:
    """A store's :class:`VisionSettings`: the image token from its meta.json, the processor from its ``processor/``
    folder; 3-D rotary positions and the merge size as ``family`` has them (default: the family the store was
    prepared for, meta.json's ``processor.kind``). The run passes the model's family."""
    meta = store.meta.get("processor")
    if not store.num_images or not meta:
        raise StoreError(f"store {str(store.path)!r} holds no images (prepared without --processor)")
    folder = store.path / "processor"
    if not folder.is_dir():
        raise StoreError(f"store {str(store.path)!r}: its processor/ folder is missing; prepare it again")
    preprocess, processor = processor_preprocess(folder, trust_remote_code=trust_remote_code)
    family = family or family_of_store(meta)
    return VisionSettings(image_token_id=int(meta["image_token_id"]), mrope=family.mrope,
                          merge_size=family.merge_size(processor), preprocess=preprocess)


def run_vision(stores: Sequence[tuple[str, Store]], model_parts, check_processor: Callable[[dict, str], None], *,
               trust_remote_code: bool = False) -> VisionSettings | None:
    """The run's :class:`VisionSettings`, or None when no store holds images. ``stores``: (what, store) of every
    store the run reads (train, a mixture's, eval); ``model_parts``: ``prefpack.model.vision.vision_parts`` of the
    model, or None for a text model; ``check_processor(meta_processor, what)`` raises where a store's images were
    expanded for another model. Every image store must share one processor (its hash), since one run preprocesses
    every micro-batch alike."""
    with_images = [(what, s) for what, s in stores if s.num_images]
    if not with_images:
        return None
    what, first = with_images[0]
    try:
        import PIL  # noqa: F401 - each micro-batch's images are decoded with Pillow
    except ImportError:
        raise StoreError(f"{what} store {str(first.path)!r} holds images, and reading them needs Pillow: pip install "
                         "'prefpack[vision]'") from None
    if model_parts is None:
        raise StoreError(f"{what} store {str(first.path)!r} holds {first.num_images} images, but the model is a text "
                         "model: train a vision-language model on it (Qwen2-VL, Qwen2.5-VL or LLaVA; docs/images.md), "
                         "or prepare the rows without --processor")
    digest = first.meta["processor"].get("hash")
    for other_what, store in with_images:
        if store.meta["processor"].get("hash") != digest:
            raise StoreError(f"{other_what} store {str(store.path)!r} was prepared with another image processor than "
                             f"{what} store {str(first.path)!r}: one run preprocesses every image alike, so prepare "
                             "them with the same --processor")
        check_processor(store.meta["processor"], f"{other_what} store {str(store.path)!r}")
    settings = vision_settings(first, family=model_parts.family, trust_remote_code=trust_remote_code)
    if settings.merge_size != model_parts.merge_size:
        raise StoreError(f"{what} store {str(first.path)!r}: its image processor merges {settings.merge_size}x"
                         f"{settings.merge_size} patches, the model's vision tower {model_parts.merge_size}x"
                         f"{model_parts.merge_size}; prepare it again with this model's processor")
    return settings
