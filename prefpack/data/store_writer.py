"""Writing a store: examples appended to a temporary sibling folder, renamed into place only when complete (meta.json
written last), so a crash never leaves something that opens as a store. What the folder holds is defined in
``store_format``, the output folder's safety (``--overwrite``, a killed prepare) in ``store_output``; reading is
``store.Store``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefpack.data.spans import SEGMENTS_FILE, SPANS_FILE, check_segments
from prefpack.data.store_format import (
    FLAG_OPEN_PROMPT,
    FORMAT_NAME,
    FORMAT_VERSION,
    IMAGE_COLUMNS,
    IMAGE_FORMAT_VERSION,
    IMAGE_INDEX_FILE,
    IMAGES_FILE,
    LOGPROB_SLACK,
    LOGPROBS_FILE,
    MARGIN_FORMAT_VERSION,
    MARGINS_FILE,
    SEGMENT_FORMAT_VERSION,
    STORE_KINDS,
    StoreError,
    columns_for,
    completion_bounds,
    token_dtype,
)
from prefpack.data.store_output import check_output, recover_interrupted, remove_backup
from prefpack.stale import OWNER_FILE, write_owner

__all__ = ["StoreWriter"]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


class StoreWriter:
    """Appends examples to a temporary folder; `commit` renames it to the final path."""

    def __init__(self, path: str | Path, *, kind: str, vocab_size: int, overwrite: bool = False,
                 log: Callable[[str], None] | None = _stderr):
        self.path = Path(path)
        self.log = log
        if kind not in STORE_KINDS:
            raise ValueError(f"store kind must be one of {STORE_KINDS}, not {kind!r}")
        recover_interrupted(self.path, log=log)
        check_output(self.path, overwrite=overwrite)
        self.kind = kind
        self.columns = columns_for(kind)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self.tmp = self.path.parent / f".{self.path.name}.tmp-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        try:  # a folder that cannot be written, or a full disk: leave no temporary folder behind
            self.tmp.mkdir(parents=True)
            write_owner(self.tmp)
            self._tokens = open(self.tmp / "tokens.bin", "wb")
            self._index = open(self.tmp / "index.bin", "wb")
            self._spans = open(self.tmp / SPANS_FILE, "wb")
        except OSError:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self._tok_hash = hashlib.sha256()
        self._idx_hash = hashlib.sha256()
        self._span_hash = hashlib.sha256()
        self.n_spans = 0
        self._span_end = 0  # where the last span written ends: spans must come sorted and apart
        self.n_tokens = 0
        self.n_rows = 0
        self.n_groups = 0  # ranked stores: prompts written so far
        self.n_images = 0
        self.n_image_bytes = 0
        self._images = self._image_index = None  # opened with the first image
        self._margins = None  # margins.bin, opened with the first row that gives a margin
        self._margin_hash = hashlib.sha256()
        self.n_margins = 0  # rows that gave a margin
        self._logprobs = None  # logprobs.bin, opened with the first block that gives a sampler log-prob
        self._segments = None  # segments.bin, opened with the first block that cuts a completion into segments
        self._segment_hash = hashlib.sha256()
        self.n_segments = 0
        self.n_open_prompts = 0  # rows flagged FLAG_OPEN_PROMPT (their prompt stops before the generation prompt)
        self._logprob_hash = hashlib.sha256()
        self.n_logprobs = 0  # completions (ranked rows) that have them
        self._img_hash = hashlib.sha256()
        self._img_idx_hash = hashlib.sha256()
        self._closed = False

    def append(self, tokens: np.ndarray, index_rows: np.ndarray, spans: np.ndarray | None = None,
               images: list | None = None, margins: np.ndarray | None = None,
               logprobs: np.ndarray | None = None, segments: np.ndarray | None = None) -> None:
        """Append a block: `tokens` for several examples and their index rows with offsets relative to it, and the
        block's unscored completion tokens as ``[start, end)`` rows relative to it too (sorted, apart; the store
        keeps them as absolute positions in tokens.bin, see ``prefpack.data.spans``); and its images, each
        ``(row in the block, encoded bytes, width, height, token position in the block, tokens)``; and a pair store's
        margins, one float64 per row, NaN where the row gives none (written as 0.0); and a ranked store's sampler
        log-probs, one float32 per token of the block, NaN where there is none (prompt tokens; a completion without
        them), None for a block with none at all (``store_format``: logprobs.bin); and where later segments of its
        completions start, positions relative to the block (sorted, each strictly inside one completion;
        ``store_format``: segments.bin)."""
        rows_in = np.asarray(index_rows, dtype=np.int64).reshape(-1, len(self.columns))
        self.n_open_prompts += int((rows_in[:, self.columns.index("flags")] & FLAG_OPEN_PROMPT).astype(bool).sum())
        if segments is not None and len(segments):
            if images or self.n_images:  # an image's tokens would be laid out once per segment
                raise StoreError(f"{self.path}: completions cut into segments (a chat template that rewrites earlier "
                                 "turns) cannot be stored with images")
            self._append_segments(np.asarray(segments, dtype=np.int64).reshape(-1), rows_in)
        elif images and self.n_segments:
            raise StoreError(f"{self.path}: images cannot be stored with completions cut into segments (a chat "
                             "template that rewrites earlier turns)")
        if logprobs is not None:
            self._append_logprobs(np.asarray(logprobs, dtype=np.float32), rows_in, int(tokens.size))
        elif self._logprobs is not None:
            self._write_nan_logprobs(int(tokens.size))
        if margins is not None and len(margins):
            self._append_margins(np.asarray(margins, dtype=np.float64), self.n_rows)
        elif self._margins is not None:
            self._write_margins(np.zeros(len(np.asarray(index_rows).reshape(-1, len(self.columns))), np.float64))
        if images:
            self._append_images(images)
        if spans is not None and len(spans):
            self._append_spans(np.asarray(spans, dtype=np.int64).reshape(-1, 2), int(tokens.size))
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise StoreError(f"token id out of range [0, {self.vocab_size}) while writing the store")
        rows = np.array(index_rows, dtype=np.int64, copy=True).reshape(-1, len(self.columns))
        rows[:, 0] += self.n_tokens
        if self.kind == "ranked" and rows.shape[0]:  # group numbers of a block start at 0
            group = self.columns.index("group")
            rows[:, group] += self.n_groups
            self.n_groups = int(rows[-1, group]) + 1
        tb = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        ib = rows.tobytes()
        self._tokens.write(tb)
        self._index.write(ib)
        self._tok_hash.update(tb)
        self._idx_hash.update(ib)
        self.n_tokens += int(tokens.size)
        self.n_rows += int(rows.shape[0])

    def _append_images(self, images: list) -> None:
        if self._images is None:
            self._images = open(self.tmp / IMAGES_FILE, "wb")
            self._image_index = open(self.tmp / IMAGE_INDEX_FILE, "wb")
        rows = []
        for row, data, width, height, position, n in images:
            rows.append([self.n_rows + row, self.n_image_bytes, len(data), width, height, self.n_tokens + position, n])
            self._images.write(data)
            self._img_hash.update(data)
            self.n_image_bytes += len(data)
        b = np.asarray(rows, dtype=np.int64).tobytes()
        self._image_index.write(b)
        self._img_idx_hash.update(b)
        self.n_images += len(rows)

    def _append_margins(self, margins: np.ndarray, rows_before: int) -> None:
        given = ~np.isnan(margins)
        if self._margins is None:
            if not given.any():
                return
            if self.kind != "pairs":
                raise StoreError(f"margins are a pair store's; this store holds {self.kind} examples")
            self._margins = open(self.tmp / MARGINS_FILE, "wb")
            self._write_margins(np.zeros(rows_before, np.float64))  # the rows before the first margin: none
        self.n_margins += int(given.sum())
        self._write_margins(np.where(given, margins, 0.0))

    def _write_margins(self, values: np.ndarray) -> None:
        b = np.ascontiguousarray(values, dtype=np.float64).tobytes()
        self._margins.write(b)
        self._margin_hash.update(b)

    def _append_logprobs(self, values: np.ndarray, rows: np.ndarray, block: int) -> None:
        """A block's log-probs, checked: one per token; NaN outside completions; per completion all NaN or all
        finite and <= ``LOGPROB_SLACK``."""
        if self.kind != "ranked":
            raise StoreError(f"sampler log-probs are a ranked store's; this store holds {self.kind} examples")
        if values.shape != (block,):
            raise StoreError(f"{values.size} sampler log-probs for a block of {block} tokens while writing the store")
        given = ~np.isnan(values)
        inside = np.zeros(block, bool)
        have = 0
        for off, length in rows[:, :3:2].tolist():  # ranked columns: offset, prompt_len, completion_len
            part = given[off:off + length]
            inside[off:off + length] = True
            if part.any() and not part.all():
                raise StoreError("a completion with sampler log-probs for some of its tokens only while writing the "
                                 "store")
            have += bool(length) and bool(part.all())
        if (given & ~inside).any():
            raise StoreError("sampler log-probs on prompt tokens while writing the store (only completion tokens "
                             "have them)")
        if not np.isfinite(values[given]).all() or (values[given] > LOGPROB_SLACK).any():
            raise StoreError("sampler log-probs that are not finite numbers <= 0 while writing the store")
        if self._logprobs is None:
            if not have:
                return
            self._logprobs = open(self.tmp / LOGPROBS_FILE, "wb")
            self._write_nan_logprobs(self.n_tokens)  # the groups before the first with log-probs: none
        self.n_logprobs += have
        self._write_logprobs(values)

    def _write_nan_logprobs(self, count: int, chunk: int = 1 << 20) -> None:
        for start in range(0, count, chunk):
            self._write_logprobs(np.full(min(chunk, count - start), np.nan, np.float32))

    def _write_logprobs(self, values: np.ndarray) -> None:
        b = np.ascontiguousarray(values, dtype=np.float32).tobytes()
        self._logprobs.write(b)
        self._logprob_hash.update(b)

    def _append_segments(self, segments: np.ndarray, rows: np.ndarray) -> None:
        wrong = check_segments(segments, *completion_bounds(self.kind, rows))
        if wrong:
            raise StoreError(f"{self.path}: completion segments while writing the store: {wrong}")
        if self._segments is None:
            self._segments = open(self.tmp / SEGMENTS_FILE, "wb")
        b = np.ascontiguousarray(segments + self.n_tokens).tobytes()
        self._segments.write(b)
        self._segment_hash.update(b)
        self.n_segments += len(segments)

    def _append_spans(self, spans: np.ndarray, block: int) -> None:
        s = spans + self.n_tokens
        if (spans[:, 0] >= spans[:, 1]).any() or spans.min() < 0 or spans.max() > block or \
                int(s[0, 0]) < self._span_end or (s[1:, 0] < s[:-1, 1]).any():
            raise StoreError("unscored spans out of order, overlapping or outside their block while writing the store")
        b = np.ascontiguousarray(s).tobytes()
        self._spans.write(b)
        self._span_hash.update(b)
        self.n_spans += len(s)
        self._span_end = int(s[-1, 1])

    def commit(self, meta: dict[str, Any], *, overwrite: bool = False) -> Path:
        """Close files, write meta.json last, and rename the folder into place."""
        self._close_files()
        full = dict(meta)
        full.update({
            "format": FORMAT_NAME,
            # version 5: a chat store scored turn by turn (segments.bin, or prompts that stop before the generation
            # prompt), which an older prefpack would sample or train on wrongly
            "format_version": SEGMENT_FORMAT_VERSION if self.n_segments or self.n_open_prompts
            else MARGIN_FORMAT_VERSION if self.n_margins
            else IMAGE_FORMAT_VERSION if self.n_images else FORMAT_VERSION,
            "kind": self.kind,
            "dtype": self.dtype.name,
            "index_columns": list(self.columns),
            "num_examples": self.n_rows,
            "num_tokens": self.n_tokens,
            **({"num_groups": self.n_groups} if self.kind == "ranked" else {}),
            "files": {
                "tokens.bin": {"bytes": self.n_tokens * self.dtype.itemsize, "sha256": self._tok_hash.hexdigest()},
                "index.bin": {"bytes": self.n_rows * len(self.columns) * 8, "sha256": self._idx_hash.hexdigest()},
                **({SPANS_FILE: {"bytes": self.n_spans * 16, "sha256": self._span_hash.hexdigest()}}
                   if self.n_spans else {}),
                **({MARGINS_FILE: {"bytes": self.n_rows * 8, "sha256": self._margin_hash.hexdigest()}}
                   if self.n_margins else {}),
                **({SEGMENTS_FILE: {"bytes": self.n_segments * 8, "sha256": self._segment_hash.hexdigest()}}
                   if self.n_segments else {}),
                **({LOGPROBS_FILE: {"bytes": self.n_tokens * 4, "sha256": self._logprob_hash.hexdigest()}}
                   if self.n_logprobs else {}),
                **({IMAGES_FILE: {"bytes": self.n_image_bytes, "sha256": self._img_hash.hexdigest()},
                    IMAGE_INDEX_FILE: {"bytes": self.n_images * len(IMAGE_COLUMNS) * 8,
                                       "sha256": self._img_idx_hash.hexdigest()}} if self.n_images else {}),
            },
            "num_spans": self.n_spans,
            **({"num_images": self.n_images, "image_columns": list(IMAGE_COLUMNS)} if self.n_images else {}),
            **({"num_margins": self.n_margins} if self.n_margins else {}),
            **({"num_segments": self.n_segments} if self.n_segments else {}),
            **({"num_logprobs": self.n_logprobs} if self.n_logprobs else {}),
        })
        if not self.n_spans:  # every completion token scored: no spans.bin, as in a version-1 store
            (self.tmp / SPANS_FILE).unlink()
        with open(self.tmp / "meta.json", "w", encoding="utf-8") as fh:
            json.dump(full, fh, indent=2, ensure_ascii=False)
            fh.flush()
            os.fsync(fh.fileno())
        (self.tmp / OWNER_FILE).unlink(missing_ok=True)
        if not os.path.lexists(self.path):
            try:
                os.replace(self.tmp, self.path)
            except OSError as exc:  # something took the path meanwhile
                raise StoreError(f"cannot move the new store into {str(self.path)!r}: {exc}") from exc
            return self.path
        if not overwrite:
            raise StoreError(f"output {str(self.path)!r} appeared while writing; pass --overwrite to replace it")
        check_output(self.path, overwrite=True)  # it may have changed while the store was written
        # The new store is complete: move the old one aside, put the new one in place, then delete the old.
        # A crash between the two renames leaves the old store in `.NAME.old-PID`; the next prepare puts it back.
        backup = self.path.parent / f".{self.path.name}.old-{os.getpid()}"
        try:
            os.replace(self.path, backup)
        except OSError as exc:
            raise StoreError(f"cannot move the old store {str(self.path)!r} aside to replace it: {exc}") from exc
        try:
            os.replace(self.tmp, self.path)
        except OSError as exc:
            os.replace(backup, self.path)
            raise StoreError(f"cannot move the new store into {str(self.path)!r} (the old one is kept): {exc}") from exc
        remove_backup(backup, self.log)
        return self.path

    def abort(self) -> None:
        self._close_files()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _close_files(self) -> None:
        if not self._closed:
            self._tokens.close()
            self._index.close()
            self._spans.close()
            if self._margins is not None:
                self._margins.close()
            if self._logprobs is not None:
                self._logprobs.close()
            if self._segments is not None:
                self._segments.close()
            if self._images is not None:
                self._images.close()
                self._image_index.close()
            self._closed = True
