"""The binary preference store: written atomically, read zero-copy.

A store is one folder:
- `tokens.bin`: every example's tokens back to back (prompt once, then chosen and rejected; or prompt
  then completion), uint16 when the vocabulary fits, else uint32.
- `index.bin`: int64 rows, one per example, columns named in meta (`offset`, `prompt_len`, then
  `chosen_len`, `rejected_len` for pairs or `completion_len`, `label` for unpaired data, then `flags`,
  `source_file`, `source_row`).
- `meta.json`: format version, layout, tokenizer identity, counts, drops by reason, sources, arguments.
- `tokenizer/`: a copy of the tokenizer, so the store can be decoded and trained on by itself.
- `skipped.jsonl` (only with --skip-invalid): every skipped row with its location and reason.

The writer fills a temporary sibling folder and renames it into place only when complete, so a crash
never leaves something that opens as a store; meta.json is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_NAME = "prefpack-store"
FORMAT_VERSION = 1
PAIR_COLUMNS = ("offset", "prompt_len", "chosen_len", "rejected_len", "flags", "source_file", "source_row")
UNPAIRED_COLUMNS = ("offset", "prompt_len", "completion_len", "label", "flags", "source_file", "source_row")
FLAG_PROMPT_TRUNCATED = 1
FLAG_COMPLETION_TRUNCATED = 2


class StoreError(ValueError):
    """A store that is missing, incomplete, corrupt or of another format version."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def columns_for(kind: str) -> tuple[str, ...]:
    return PAIR_COLUMNS if kind == "pairs" else UNPAIRED_COLUMNS


class StoreWriter:
    """Appends examples to a temporary folder; `commit` renames it to the final path."""

    def __init__(self, path: str | Path, *, kind: str, vocab_size: int, overwrite: bool = False):
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise StoreError(f"output {str(self.path)!r} already exists; pass --overwrite to replace it")
        if kind not in ("pairs", "unpaired"):
            raise ValueError(f"store kind must be 'pairs' or 'unpaired', not {kind!r}")
        self.kind = kind
        self.columns = columns_for(kind)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        self.tmp = self.path.parent / f".{self.path.name}.tmp-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self._tokens = open(self.tmp / "tokens.bin", "wb")
        self._index = open(self.tmp / "index.bin", "wb")
        self._tok_hash = hashlib.sha256()
        self._idx_hash = hashlib.sha256()
        self.n_tokens = 0
        self.n_rows = 0
        self._closed = False

    def append(self, tokens: np.ndarray, index_rows: np.ndarray) -> None:
        """Append a block: `tokens` for several examples and their index rows with offsets relative to it."""
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise StoreError(f"token id out of range [0, {self.vocab_size}) while writing the store")
        rows = np.array(index_rows, dtype=np.int64, copy=True).reshape(-1, len(self.columns))
        rows[:, 0] += self.n_tokens
        tb = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        ib = rows.tobytes()
        self._tokens.write(tb)
        self._index.write(ib)
        self._tok_hash.update(tb)
        self._idx_hash.update(ib)
        self.n_tokens += int(tokens.size)
        self.n_rows += int(rows.shape[0])

    def commit(self, meta: dict[str, Any], *, overwrite: bool = False) -> Path:
        """Close files, write meta.json last, and rename the folder into place."""
        self._close_files()
        full = dict(meta)
        full.update({
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "dtype": self.dtype.name,
            "index_columns": list(self.columns),
            "num_examples": self.n_rows,
            "num_tokens": self.n_tokens,
            "files": {
                "tokens.bin": {"bytes": self.n_tokens * self.dtype.itemsize, "sha256": self._tok_hash.hexdigest()},
                "index.bin": {"bytes": self.n_rows * len(self.columns) * 8, "sha256": self._idx_hash.hexdigest()},
            },
        })
        with open(self.tmp / "meta.json", "w", encoding="utf-8") as fh:
            json.dump(full, fh, indent=2, ensure_ascii=False)
            fh.flush()
            os.fsync(fh.fileno())
        if self.path.exists():
            if not overwrite:
                raise StoreError(f"output {str(self.path)!r} appeared while writing; pass --overwrite")
            trash = self.path.parent / f".{self.path.name}.old-{os.getpid()}"
            os.replace(self.path, trash)
            os.replace(self.tmp, self.path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._close_files()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _close_files(self) -> None:
        if not self._closed:
            self._tokens.close()
            self._index.close()
            self._closed = True


@dataclass
class Pair:
    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


@dataclass
class Unpaired:
    prompt: np.ndarray
    completion: np.ndarray
    label: int


class Store:
    """A prepared store opened read-only; token arrays are views into a memory map (no copies)."""

    def __init__(self, path: str | Path, *, verify: bool = False):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not self.path.is_dir():
            raise StoreError(f"{str(self.path)!r} is not a prefpack store (no such folder)")
        if not meta_path.is_file():
            raise StoreError(f"{str(self.path)!r} is not a complete prefpack store (meta.json missing; an "
                             "interrupted prepare leaves no meta.json). Run prefpack prepare again.")
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StoreError(f"{meta_path}: corrupt meta.json ({exc})") from exc
        m = self.meta
        if m.get("format") != FORMAT_NAME:
            raise StoreError(f"{meta_path}: not a prefpack store (format {m.get('format')!r})")
        if m.get("format_version") != FORMAT_VERSION:
            raise StoreError(f"{self.path}: store format version {m.get('format_version')} but this prefpack reads "
                             f"version {FORMAT_VERSION}; prepare the data again with this version")
        try:
            self.kind = m["kind"]
            self.dtype = np.dtype(m["dtype"])
            self.columns = tuple(m["index_columns"])
            self.num_examples = int(m["num_examples"])
            self.num_tokens = int(m["num_tokens"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{meta_path}: corrupt meta.json (bad or missing {exc})") from exc
        if self.columns != columns_for(self.kind):
            raise StoreError(f"{meta_path}: index columns {self.columns} do not match kind {self.kind!r}")
        self._check_size("tokens.bin", self.num_tokens * self.dtype.itemsize)
        self._check_size("index.bin", self.num_examples * len(self.columns) * 8)
        self.tokens = (np.memmap(self.path / "tokens.bin", dtype=self.dtype, mode="r")
                       if self.num_tokens else np.zeros(0, dtype=self.dtype))
        self.index = (np.memmap(self.path / "index.bin", dtype=np.int64, mode="r").reshape(self.num_examples,
                      len(self.columns)) if self.num_examples else np.zeros((0, len(self.columns)), np.int64))
        self._check_index()
        if verify:
            self.verify()

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
        if not np.array_equal(offsets, expected) or int(total.sum()) != self.num_tokens:
            raise StoreError(f"{self.path}: index.bin offsets do not match the token lengths (or exceed "
                             "tokens.bin): the store is corrupt; prepare it again")
        if self.kind == "unpaired" and not np.isin(idx[:, 3], (0, 1)).all():
            raise StoreError(f"{self.path}: index.bin holds labels other than 0/1: the store is corrupt")

    def verify(self) -> None:
        """Full check: file hashes against meta.json and every token id below the vocabulary size."""
        for name, info in self.meta.get("files", {}).items():
            h = hashlib.sha256()
            with open(self.path / name, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
            if h.hexdigest() != info.get("sha256"):
                raise StoreError(f"{self.path}: {name} does not match its sha256 in meta.json: the store is corrupt")
        vocab = int(self.meta["tokenizer"]["vocab_size"])
        if self.num_tokens and int(np.asarray(self.tokens).max()) >= vocab:
            raise StoreError(f"{self.path}: tokens.bin holds ids >= the vocabulary size {vocab}: corrupt store")

    def __len__(self) -> int:
        return self.num_examples

    def column(self, name: str) -> np.ndarray:
        return np.asarray(self.index[:, self.columns.index(name)])

    def pair(self, i: int) -> Pair:
        if self.kind != "pairs":
            raise StoreError(f"{self.path} holds unpaired examples, not pairs")
        off, p, c, r = (int(x) for x in self.index[i, :4])
        t = self.tokens
        return Pair(t[off : off + p], t[off + p : off + p + c], t[off + p + c : off + p + c + r])

    def unpaired(self, i: int) -> Unpaired:
        if self.kind != "unpaired":
            raise StoreError(f"{self.path} holds pairs, not unpaired examples")
        off, p, c, label = (int(x) for x in self.index[i, :4])
        t = self.tokens
        return Unpaired(t[off : off + p], t[off + p : off + p + c], label)

    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer"
