"""The binary preference store: read zero-copy (``Store``), written atomically (``store_writer.StoreWriter``). What a
store folder holds (names, version, index columns, flags) is defined in ``store_format``, the output folder's safety
(``--overwrite``, a killed prepare) in ``store_output``; their names, and the writer, are importable from here too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from prefpack.data.spans import (
    SEGMENTS_FILE,
    SPANS_FILE,
    ScoredTokens,
    check_segments,
    check_spans,
    scored_mask,
    segment_lengths,
    segments_in,
)
from prefpack.data.store_format import (
    FLAG_COMPLETION_TRUNCATED,
    FLAG_OPEN_PROMPT,
    FLAG_PROMPT_TRUNCATED,
    FORMAT_NAME,
    FORMAT_VERSION,
    IMAGE_COLUMNS,
    IMAGE_INDEX_FILE,
    IMAGES_FILE,
    LOGPROBS_FILE,
    MARGINS_FILE,
    READABLE_VERSIONS,
    STORE_KINDS,
    StoreError,
    columns_for,
    completion_bounds,
    token_dtype,
)
from prefpack.data.store_output import check_output, foreign_entries, recover_interrupted
from prefpack.data.store_writer import StoreWriter

__all__ = ["FLAG_COMPLETION_TRUNCATED", "FLAG_OPEN_PROMPT", "FLAG_PROMPT_TRUNCATED", "FORMAT_NAME", "FORMAT_VERSION", "STORE_KINDS", "Pair",
           "Store", "StoreError", "StoreWriter", "Unpaired", "check_output", "columns_for", "foreign_entries",
           "recover_interrupted", "token_dtype"]


class Pair(NamedTuple):
    """Token ids of one preference pair (1-D integer arrays); unpacks as ``prompt, chosen, rejected``."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


class Unpaired(NamedTuple):
    """One KTO example: prompt and completion ids, label 1 = desirable."""

    prompt: np.ndarray
    completion: np.ndarray
    label: int


def _not_a_store(path: Path) -> str | None:
    """What a folder without meta.json is when it is no store at all: a training run's folder or a model folder
    (the names users give a store's place by mistake), said with what a store is; None for anything else (an
    interrupted prepare)."""
    store = ("a store is the folder `prefpack prepare --output DIR` writes (meta.json, tokens.bin, ...), which "
             "inspect, train (data.train, data.eval) and eval (--data) read")
    if (path / "config.yaml").is_file() and ((path / "metrics.jsonl").is_file() or (path / "final").is_dir()
                                             or (path / "checkpoints").is_dir()):
        train = None
        try:
            import yaml

            train = ((yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}).get("data")
                     or {}).get("train")
        except Exception:  # an unreadable config: the folder is still a run's
            pass
        trained = f"; this run trained on {train}" if isinstance(train, str) else ""
        return (f"{str(path)!r} is a training run's folder (config.yaml, metrics.jsonl, final/), not a prepared "
                f"store: {store}{trained}")
    if (path / "config.json").is_file():
        return f"{str(path)!r} is a model folder (config.json), not a prepared store: {store}"
    return None


class Store:
    """A prepared store opened read-only; token arrays are views into a memory map (no copies)."""

    def __init__(self, path: str | Path, *, verify: bool = False):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not self.path.is_dir():
            raise StoreError(f"{str(self.path)!r} is not a prefpack store (no such folder)")
        if not meta_path.is_file():
            other = _not_a_store(self.path)
            if other:
                raise StoreError(other)
            raise StoreError(f"{str(self.path)!r} is not a complete prefpack store (meta.json missing; an "
                             "interrupted prepare leaves no meta.json). Run prefpack prepare again.")
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StoreError(f"{meta_path}: corrupt meta.json ({exc})") from exc
        m = self.meta
        if m.get("format") != FORMAT_NAME:
            raise StoreError(f"{meta_path}: not a prefpack store (format {m.get('format')!r})")
        if m.get("format_version") not in READABLE_VERSIONS:
            raise StoreError(f"{self.path}: store format version {m.get('format_version')} but this prefpack reads "
                             f"versions {', '.join(map(str, READABLE_VERSIONS))}; prepare the data again")
        try:
            self.kind = m["kind"]
            self.dtype = np.dtype(m["dtype"])
            self.columns = tuple(m["index_columns"])
            self.num_examples = int(m["num_examples"])
            self.num_tokens = int(m["num_tokens"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{meta_path}: corrupt meta.json (bad or missing {exc})") from exc
        if self.dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            raise StoreError(f"{meta_path}: corrupt meta.json (token dtype {self.dtype.name!r}, not uint16/uint32)")
        if self.kind not in STORE_KINDS or self.columns != columns_for(self.kind):
            raise StoreError(f"{meta_path}: index columns {self.columns} do not match kind {self.kind!r}")
        self._check_size("tokens.bin", self.num_tokens * self.dtype.itemsize)
        self._check_size("index.bin", self.num_examples * len(self.columns) * 8)
        self.tokens = (np.memmap(self.path / "tokens.bin", dtype=self.dtype, mode="r")
                       if self.num_tokens else np.zeros(0, dtype=self.dtype))
        self.index = (np.memmap(self.path / "index.bin", dtype=np.int64, mode="r").reshape(self.num_examples,
                      len(self.columns)) if self.num_examples else np.zeros((0, len(self.columns)), np.int64))
        spans = int(m.get("num_spans", 0) or 0)  # unscored token ranges (prefpack.data.spans); none before version 2
        self.spans = np.zeros((0, 2), np.int64)
        if spans:
            self._check_size(SPANS_FILE, spans * 16)
            self.spans = np.memmap(self.path / SPANS_FILE, dtype=np.int64, mode="r").reshape(spans, 2)
        # where later segments of completions start (version 5; prefpack.data.spans); none before
        self.num_segments = int(m.get("num_segments", 0) or 0)
        self.segments = np.zeros(0, np.int64)
        if self.num_segments:
            self._check_size(SEGMENTS_FILE, self.num_segments * 8)
            self.segments = np.memmap(self.path / SEGMENTS_FILE, dtype=np.int64, mode="r")
        self.num_images = int(m.get("num_images", 0) or 0)  # version 3 (prepare --processor); none before
        self.image_index = np.zeros((0, len(IMAGE_COLUMNS)), np.int64)
        if self.num_images:
            self._open_images()
        self.margins = self._open_margins()
        self.sampler_logprobs = self._open_logprobs()
        self._check_index()
        self._check_spans()
        self._check_segments()
        if verify:
            self.verify()

    def _open_images(self) -> None:
        if tuple(self.meta.get("image_columns") or ()) != IMAGE_COLUMNS:
            raise StoreError(f"{self.path}: image columns {self.meta.get('image_columns')} are not {IMAGE_COLUMNS}")
        self._check_size(IMAGE_INDEX_FILE, self.num_images * len(IMAGE_COLUMNS) * 8)
        self.image_index = np.memmap(self.path / IMAGE_INDEX_FILE, dtype=np.int64, mode="r").reshape(
            self.num_images, len(IMAGE_COLUMNS))
        idx = np.asarray(self.image_index)
        ex, off, size = idx[:, 0], idx[:, 1], idx[:, 2]
        ends = np.concatenate([[0], np.cumsum(size)])
        self._check_size(IMAGES_FILE, int(ends[-1]))
        tok = idx[:, 5] + idx[:, 6]
        if (size <= 0).any() or not np.array_equal(off, ends[:-1]) or (np.diff(ex) < 0).any() or ex.min() < 0 or \
                ex.max() >= self.num_examples or (idx[:, 6] <= 0).any() or tok.max() > self.num_tokens:
            raise StoreError(f"{self.path}: {IMAGE_INDEX_FILE} is inconsistent with images.bin or index.bin: the "
                             "store is corrupt; prepare it again")

    def _open_margins(self) -> np.ndarray | None:
        """Version 4 pair stores: each pair's margin (float64; 0.0 where its row gave none), None without
        margins.bin."""
        if not int(self.meta.get("num_margins", 0) or 0):
            return None
        if self.kind != "pairs":
            raise StoreError(f"{self.path}: meta.json counts margins, which only a pair store holds: the store is "
                             "corrupt")
        self._check_size(MARGINS_FILE, self.num_examples * 8)
        margins = np.memmap(self.path / MARGINS_FILE, dtype=np.float64, mode="r")
        if not np.isfinite(margins).all():
            raise StoreError(f"{self.path}: {MARGINS_FILE} holds margins that are not finite numbers: the store is "
                             "corrupt; prepare it again")
        return margins

    def _open_logprobs(self) -> np.ndarray | None:
        """Ranked stores written from samples with the sampler's log-probs: float32, one per token of tokens.bin
        (NaN where there is none); None without logprobs.bin (``store_format``); a store whose meta.json counts them
        without the file, or with one of another size, is corrupt."""
        if not (self.path / LOGPROBS_FILE).exists() and not int(self.meta.get("num_logprobs", 0) or 0):
            return None
        if self.kind != "ranked":
            raise StoreError(f"{self.path}: {LOGPROBS_FILE} is a ranked store's, but this store holds {self.kind} "
                             "examples: the store is corrupt")
        self._check_size(LOGPROBS_FILE, self.num_tokens * 4)
        if not self.num_tokens:
            return np.zeros(0, np.float32)
        return np.memmap(self.path / LOGPROBS_FILE, dtype=np.float32, mode="r")

    def completion_logprobs(self, i: int) -> np.ndarray | None:
        """Ranked row ``i``'s completion: the sampler's log-prob of each of its tokens (float32, a view of
        logprobs.bin), None when the store holds none or this completion was sampled without them (NaN)."""
        if self.kind != "ranked":
            raise StoreError(f"{self.path} holds {self.kind}, not ranked completions")
        if self.sampler_logprobs is None:
            return None
        off, length = int(self.index[i, 0]), int(self.index[i, 2])
        values = self.sampler_logprobs[off:off + length]
        return None if length == 0 or np.isnan(values).any() else values

    def images_of(self, i: int) -> list[dict]:
        """Example ``i``'s images, in prompt order: each its encoded ``data`` (bytes, as read by prepare) and the
        ``IMAGE_COLUMNS`` numbers."""
        if not self.num_images:
            return []
        col = self.image_index[:, 0]
        a, b = int(np.searchsorted(col, i, side="left")), int(np.searchsorted(col, i, side="right"))
        out = []
        with open(self.path / IMAGES_FILE, "rb") as fh:
            for row in np.asarray(self.image_index[a:b]).tolist():
                info = dict(zip(IMAGE_COLUMNS, row))
                fh.seek(info["offset"])
                info["data"] = fh.read(info["bytes"])
                out.append(info)
        return out

    def image_key(self, i: int) -> bytes:
        """A digest of example ``i``'s images' bytes (b"" without images): two prompts with the same tokens are the
        same prompt only when their images are too (their image tokens are the same placeholder ids)."""
        if not self.num_images:
            return b""
        col = self.image_index[:, 0]
        a, b = int(np.searchsorted(col, i, side="left")), int(np.searchsorted(col, i, side="right"))
        if a == b:
            return b""
        data = getattr(self, "_image_bytes", None)
        if data is None:
            data = self._image_bytes = np.memmap(self.path / IMAGES_FILE, dtype=np.uint8, mode="r")
        h = hashlib.blake2b(digest_size=16)
        for row in np.asarray(self.image_index[a:b]).tolist():
            h.update(data[row[1]:row[1] + row[2]].tobytes())
        return h.digest()

    def prompt_images(self, i: int) -> list[dict]:
        """The images of example ``i``'s prompt: ``images_of(i)``, except in a ranked store, where a group's images
        are stored with its first row (the one its prompt precedes) and every row of the group shares them."""
        if self.kind == "ranked" and self.num_images:
            starts = self.group_starts()
            i = int(starts[int(np.searchsorted(starts, i, side="right")) - 1])
        return self.images_of(i)

    def _check_size(self, name: str, expected: int) -> None:
        p = self.path / name
        if not p.is_file():
            raise StoreError(f"{self.path}: {name} is missing")
        actual = p.stat().st_size
        if actual != expected:
            raise StoreError(f"{self.path}: {name} has {actual} bytes but meta.json says {expected}: the store is "
                             "truncated or corrupt; prepare it again")

    def _check_index(self) -> None:
        if not self.num_examples:
            return
        idx = np.asarray(self.index)
        lengths = idx[:, 1:4] if self.kind == "pairs" else idx[:, 1:3]
        if (lengths < 0).any():
            raise StoreError(f"{self.path}: index.bin holds negative lengths: the store is corrupt")
        total = lengths.sum(axis=1)
        offsets = idx[:, 0]
        expected = np.concatenate([[0], np.cumsum(total)[:-1]])
        if self.kind == "ranked":
            first = self._check_groups(idx)
            total = idx[:, 2] + np.where(first, idx[:, 1], 0)  # a group's prompt counts once, before its first row
            expected = np.concatenate([[0], np.cumsum(total)[:-1]]) + np.where(first, idx[:, 1], 0)
        if not np.array_equal(offsets, expected) or int(total.sum()) != self.num_tokens:
            raise StoreError(f"{self.path}: index.bin offsets do not match the token lengths (or exceed "
                             "tokens.bin): the store is corrupt; prepare it again")
        if self.kind == "unpaired" and not np.isin(idx[:, 3], (0, 1)).all():
            raise StoreError(f"{self.path}: index.bin holds labels other than 0/1: the store is corrupt")

    def _check_groups(self, idx: np.ndarray) -> np.ndarray:
        """Ranked stores: group numbers run 0, 1, 2, ... over consecutive rows, each group has at least two rows
        and one prompt length; returns where each group starts (bool per row)."""
        group = idx[:, self.columns.index("group")]
        step = np.diff(group)
        first = np.concatenate([[True], step == 1])
        sizes = np.diff(np.flatnonzero(np.concatenate([first, [True]])))
        prompt = idx[:, 1]
        if group[0] != 0 or not np.isin(step, (0, 1)).all() or (sizes < 2).any() or \
                (np.diff(prompt)[step == 0] != 0).any() or int(self.meta.get("num_groups", -1)) != int(first.sum()):
            raise StoreError(f"{self.path}: index.bin's prompt groups are inconsistent: the store is corrupt; "
                             "prepare it again")
        if not np.isfinite(self.index[:, self.columns.index("score")].view(np.float64)).all():
            raise StoreError(f"{self.path}: index.bin holds scores that are not finite numbers: the store is corrupt")
        return first

    def verify(self) -> None:
        """Full check: file hashes against meta.json (catches any flipped bit) and token id ranges."""
        for name, info in self.meta.get("files", {}).items():
            h = hashlib.sha256()
            with open(self.path / name, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
            if h.hexdigest() != info.get("sha256"):
                raise StoreError(f"{self.path}: {name} does not match its sha256 in meta.json: the store is corrupt")
        self.check_token_ids()

    def _check_spans(self) -> None:
        """At open (a vector pass over spans.bin): a span outside its completion would otherwise surface as an
        index error or a reply with nothing scored in the loss, mid-training."""
        wrong = check_spans(self.spans, *self.completion_bounds())
        if wrong:
            raise StoreError(f"{self.path}: {SPANS_FILE}: {wrong}: the store is corrupt; prepare it again")

    def _check_segments(self) -> None:
        """At open: a segment start outside its completion (or unsorted) would cut the wrong tokens into
        sequences; images with segments are refused (an image's tokens would be laid out once per segment)."""
        if not self.num_segments:
            return
        if self.num_images:
            raise StoreError(f"{self.path}: a store with images cannot cut completions into segments "
                             f"({SEGMENTS_FILE}): the store is corrupt; prepare it again")
        wrong = check_segments(np.asarray(self.segments), *self.completion_bounds())
        if wrong:
            raise StoreError(f"{self.path}: {SEGMENTS_FILE}: {wrong}: the store is corrupt; prepare it again")

    def completion_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Every completion's ``[start, end)`` in tokens.bin, sorted by start."""
        return completion_bounds(self.kind, self.index)

    def segment_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """Per completion, in ``completion_bounds`` order (a pair store: chosen and rejected interleaved): the
        segments it has beyond its first (0 without segments) and its longest segment's length (its own length
        without). Planning reads them: unshared, each extra segment is laid out after a copy of the prompt."""
        cached = getattr(self, "_segment_lengths", None)
        if cached is None:
            cached = self._segment_lengths = segment_lengths(np.asarray(self.segments), *self.completion_bounds())
        return cached

    def require_whole_completions(self, what: str) -> None:
        """Refuse, in one line, a store with segmented completions for a reader that computes each completion as
        one sequence (``what``: the reader, and why)."""
        if self.num_segments:
            raise StoreError(f"store {str(self.path)!r} cuts {self.num_segments} completion segment(s) into sequences "
                             f"of their own ({SEGMENTS_FILE}), which {what}")

    def _vocab_size(self) -> int:
        try:
            return int(self.meta["tokenizer"]["vocab_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{self.path / 'meta.json'}: corrupt meta.json (bad or missing tokenizer "
                             f"vocab_size: {exc})") from exc

    def check_token_ids(self, chunk_tokens: int = 1 << 22) -> None:
        """Raise StoreError if any token id is >= the vocabulary size recorded in meta.json.

        One max() per chunk of the memory map (no copy; 0.1-0.3 ms per million tokens once the file is
        cached): an out-of-range id would otherwise crash the embedding lookup deep into training.
        In-range corruption needs the hashes of `verify()`.
        """
        vocab = self._vocab_size()
        if self.num_tokens == 0 or vocab > np.iinfo(self.dtype).max:
            return  # every value this dtype can hold is a valid id
        tokens = self.tokens
        for start in range(0, self.num_tokens, chunk_tokens):
            chunk = tokens[start : start + chunk_tokens]
            if int(chunk.max()) < vocab:
                continue
            pos = start + int(np.argmax(chunk >= vocab))
            raise StoreError(f"{self.path}: corrupt tokens.bin: {self._where(pos)} holds token id {int(tokens[pos])}, "
                             f"but the tokenizer has {vocab} ids (0..{vocab - 1}). The file was damaged after "
                             "prepare; prepare the store again.")

    def _where(self, pos: int) -> str:
        """'example I (part, token J; from FILE row R)' for the token at `pos` in tokens.bin."""
        row = int(np.searchsorted(self.index[:, 0], pos, side="right")) - 1
        if self.kind == "ranked":  # completion rows; tokens between a completion's end and the next row are a prompt
            if row >= 0 and pos < int(self.index[row, 0]) + int(self.index[row, 2]):
                name, k = "completion", pos - int(self.index[row, 0])
            else:
                row += 1
                name, k = "prompt", pos - int(self.index[row, 0]) + int(self.index[row, 1])
        else:
            off, *lens = (int(x) for x in self.index[row, : 4 if self.kind == "pairs" else 3])
            names = ("prompt", "chosen", "rejected") if self.kind == "pairs" else ("prompt", "completion")
            starts = np.cumsum([0, *lens])
            part = int(np.searchsorted(starts, pos - off, side="right")) - 1
            name, k = names[part], pos - off - int(starts[part])
        src = int(self.index[row, self.columns.index("source_file")])
        sources = self.meta.get("sources") or []
        origin = sources[src].get("path") if 0 <= src < len(sources) and isinstance(sources[src], dict) else None
        where = f"; from {origin} row {int(self.index[row, self.columns.index('source_row')])}" if origin else ""
        return f"example {row} ({name}, token {k}{where})"

    def __len__(self) -> int:
        return self.num_examples

    def column(self, name: str) -> np.ndarray:
        return np.asarray(self.index[:, self.columns.index(name)])

    def pair(self, i: int) -> Pair:
        if self.kind != "pairs":
            raise StoreError(f"{self.path} holds unpaired examples, not pairs")
        off, p, c, r = (int(x) for x in self.index[i, :4])
        return Pair(self.tokens[off : off + p], self._completion(off + p, c), self._completion(off + p + c, r))

    def unpaired(self, i: int) -> Unpaired:
        if self.kind != "unpaired":
            raise StoreError(f"{self.path} holds pairs, not unpaired examples")
        off, p, c, label = (int(x) for x in self.index[i, :4])
        return Unpaired(self.tokens[off : off + p], self._completion(off + p, c), label)

    def group_starts(self) -> np.ndarray:
        """Ranked stores: [G + 1] row numbers where each prompt group starts (its rows are consecutive)."""
        if self.kind != "ranked":
            raise StoreError(f"{self.path} holds {self.kind}, not ranked completions")
        cached = getattr(self, "_group_starts", None)
        if cached is None:
            group = self.column("group")
            first = np.concatenate([[True], np.diff(group) == 1]) if len(group) else np.zeros(0, bool)
            cached = self._group_starts = np.append(np.flatnonzero(first), len(group)).astype(np.int64)
        return cached

    def scores(self) -> np.ndarray:
        """Ranked stores: each completion's score (float64, higher is better)."""
        return np.ascontiguousarray(self.column("score")).view(np.float64)

    def ranked_group(self, g: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Ranked stores: group ``g``'s prompt ids and its completions' ids (in store order)."""
        starts = self.group_starts()
        a, b = int(starts[g]), int(starts[g + 1])
        t = self.tokens
        first_off, p = int(self.index[a, 0]), int(self.index[a, 1])
        comps = [self._completion(int(self.index[i, 0]), int(self.index[i, 2])) for i in range(a, b)]
        return t[first_off - p : first_off], comps

    def _completion(self, offset: int, length: int) -> np.ndarray:
        """A completion's tokens; a :class:`ScoredTokens` where some of them are not scored or it is cut into
        segments."""
        tokens, mask = self.tokens[offset : offset + length], scored_mask(self.spans, offset, length)
        segments = segments_in(self.segments, offset, length)
        return tokens if mask is None and segments is None else ScoredTokens(tokens, mask, segments)

    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer"
