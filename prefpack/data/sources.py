"""Read input rows from JSONL/JSON/Parquet/CSV files or `datasets` folders, one row at a time.

Every row carries its location (file and row number) so that a bad row can be named exactly. JSON lines
are read here line by line (bounded memory and exact line numbers, which the `datasets` JSON loader
cannot give when a line is malformed); CSV goes through `datasets` in streaming mode. Parquet files and
`save_to_disk` folders are read as Arrow batches and turned into plain rows with pyarrow: nothing is decoded
(an ``Image`` feature stays its ``{"bytes", "path"}`` struct, so a bad image is a bad row at prepare's checks, and
a URL in it is never fetched), and the nulls Arrow adds to unify tool structs across rows are dropped
(``arrow_rows``). Memory stays bounded whatever the input size.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefpack.data.arrow_rows import plain_rows
from prefpack.errors import PrefpackError

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
ARROW_BATCH_ROWS = 64  # rows per Arrow batch turned into Python rows at once (image rows may be megabytes each)
TABLE_SUFFIXES = {".parquet": "parquet", ".csv": "csv"}


class SourceError(PrefpackError, ValueError):
    """An input path that cannot be read as a dataset."""


@dataclass(frozen=True)
class Location:
    file: str
    row: int  # 0-based row number in the file (data rows only)
    line: int | None = None  # 1-based line number for JSON lines files

    def __str__(self) -> str:
        if self.line is not None:
            return f"{self.file} line {self.line}"
        return f"{self.file} row {self.row}"

    def to_json(self) -> dict:
        out: dict[str, Any] = {"file": self.file, "row": self.row}
        if self.line is not None:
            out["line"] = self.line
        return out


@dataclass(frozen=True)
class RawRow:
    """A row as read, or the reason it could not be read (then `row` is None and `raw` holds the text)."""

    loc: Location
    row: dict | None
    error: str | None = None  # reason code when the row could not be parsed
    message: str | None = None
    raw: str | None = None
    nulls_dropped: int = 0  # Parquet / datasets rows: null keys Arrow filled in, dropped (``arrow_rows``)


@dataclass(frozen=True)
class Source:
    path: str
    kind: str  # "json" | "parquet" | "csv" | "dataset"
    file_index: int


def resolve_inputs(inputs: list[str], *, allow_duplicates: bool = False) -> list[Source]:
    """Expand globs and check every input exists and has a readable kind, in the order given.

    A file reached twice (named twice, or by a name and a glob, or through a link) would be stored twice;
    that is refused unless `allow_duplicates`.
    """
    paths: list[tuple[str, str]] = []  # (path, the input spec that gave it)
    for spec in inputs:
        matches = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
        if not matches:
            raise SourceError(f"input {spec!r} matches no file")
        paths.extend((m, spec) for m in matches)
    sources = []
    seen: dict[str, tuple[str, str]] = {}
    for i, (p, spec) in enumerate(paths):
        if not os.path.exists(p):
            raise SourceError(f"input {p!r} does not exist")
        real = os.path.realpath(p)
        if real in seen and not allow_duplicates:
            first, first_spec = seen[real]
            how = f" (as {first_spec!r} and {spec!r})" if first_spec != spec else ""
            also = f" ({first!r} and {p!r} are the same file)" if first != p else ""
            raise SourceError(f"input {p!r} is given twice{how}{also}: its rows would be stored twice. Drop the "
                              "repeat, or pass --allow-duplicate-inputs to store them twice on purpose.")
        seen.setdefault(real, (p, spec))
        sources.append(Source(path=p, kind=_kind_of(p), file_index=i))
    if not sources:
        raise SourceError("no input files given")
    return sources


def _kind_of(path: str) -> str:
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
            return "dataset"
        raise SourceError(
            f"{path!r} is a folder but not one written by datasets.Dataset.save_to_disk "
            "(no dataset_info.json, state.json or dataset_dict.json); pass its files or a glob instead"
        )
    lower = path.lower()
    if lower.endswith(JSON_SUFFIXES):
        return "json"
    for suffix, kind in TABLE_SUFFIXES.items():
        if lower.endswith(suffix):
            return kind
    raise SourceError(
        f"cannot read {path!r}: unknown file type (expected .jsonl, .json, .jsonl.gz, .parquet, .csv "
        "or a datasets folder)"
    )


def file_sha256(path: str) -> str:
    """Content hash of a file, or of every file of a folder in name order."""
    h = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
    for f in files:
        if os.path.isdir(path):
            h.update(os.path.relpath(f, path).encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def iter_rows(source: Source, *, split: str | None = None) -> Iterator[RawRow]:
    if source.kind == "json":
        yield from _iter_json(source.path)
    elif source.kind == "parquet":
        yield from _iter_parquet(source.path)
    elif source.kind == "csv":
        yield from _iter_table(source.path, source.kind)
    else:
        yield from _iter_dataset_dir(source.path, split)


def peek_first_row(sources: list[Source], split: str | None) -> tuple[Source, dict] | None:
    """The first well-formed row of the inputs, used to detect the layout."""
    for src in sources:
        for raw in iter_rows(src, split=split):
            if raw.row is not None:
                return src, raw.row
    return None


def _open_text(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _damaged(path: str, exc: Exception, line: int) -> SourceError:
    """A compressed file that ends early (a partial download or copy) is a damaged file, not a bad row."""
    where = f"after line {line} (the rows before it were read)" if line else "before its first line"
    return SourceError(f"{path}: the compressed file is damaged or truncated {where}: {type(exc).__name__}: {exc}. "
                       "Download or copy it again (`gzip -t` checks it); --skip-invalid does not skip a damaged file")


def _iter_json(path: str) -> Iterator[RawRow]:
    try:
        with _open_text(path) as fh:
            head = fh.read(4096).lstrip()
    except (EOFError, OSError, zlib.error) as exc:
        if not path.lower().endswith(".gz"):
            raise
        raise _damaged(path, exc, _lines_before_damage(path)) from None
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    try:
        yield from _iter_json_array(path) if head.startswith(b"[") else _json_lines(path)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise _damaged(path, exc, _lines_before_damage(path)) from None


def _lines_before_damage(path: str) -> int:
    n = 0
    try:
        with _open_text(path) as fh:
            for _ in fh:
                n += 1
    except (EOFError, OSError, zlib.error):
        pass
    return n


def _json_lines(path: str) -> Iterator[RawRow]:
    row_no = 0
    with _open_text(path) as fh:
        for line_no, line in enumerate(fh, start=1):
            if line_no == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if not line.strip():
                continue  # blank lines separate nothing in JSON lines; they hold no data
            loc = Location(path, row_no, line_no)
            row_no += 1
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RawRow(loc, None, "undecodable_text", f"line is not valid UTF-8 ({exc.reason} at byte "
                             f"{exc.start})", raw=line.decode("utf-8", errors="replace").rstrip("\n"))
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                yield RawRow(loc, None, "malformed_json", f"malformed JSON: {exc.msg} at column {exc.colno}",
                             raw=text.rstrip("\n"))
                continue
            if not isinstance(obj, dict):
                yield RawRow(loc, None, "wrong_type", f"a row must be a JSON object, got {type(obj).__name__}",
                             raw=text.rstrip("\n"))
                continue
            yield RawRow(loc, obj)


def _iter_json_array(path: str) -> Iterator[RawRow]:
    with _open_text(path) as fh:
        data = fh.read()
    try:
        rows = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path}: file is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise SourceError(f"{path}: malformed JSON array: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    for i, obj in enumerate(rows):
        loc = Location(path, i)
        if isinstance(obj, dict):
            yield RawRow(loc, obj)
        else:
            yield RawRow(loc, None, "wrong_type", f"a row must be a JSON object, got {type(obj).__name__}",
                         raw=json.dumps(obj, ensure_ascii=False))


def _iter_table(path: str, kind: str) -> Iterator[RawRow]:
    import datasets

    try:
        ds = datasets.load_dataset(kind, data_files=path, split="train", streaming=True)
        for i, row in enumerate(ds):
            yield RawRow(Location(path, i), dict(row))
    except Exception as exc:  # pyarrow / datasets raise many types for unreadable files
        if isinstance(exc, SourceError):
            raise
        raise SourceError(f"{path}: cannot read as {kind}: {exc}") from exc


def _iter_dataset_dir(path: str, split: str | None) -> Iterator[RawRow]:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:
        raise SourceError(f"{path}: cannot open datasets folder: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds.keys())
        if split is None:
            if len(names) != 1:
                raise SourceError(f"{path} holds several splits ({', '.join(names)}); choose one with --split")
            split = names[0]
        if split not in ds:
            raise SourceError(f"{path} has no split {split!r}; it has {', '.join(names)}")
        ds = ds[split]
    elif split is not None:
        raise SourceError(f"{path} is a single Dataset, not a DatasetDict; drop --split")
    # The stored Arrow table, not `datasets`' decoded rows: decoding an Image feature raises on one bad image
    # (a traceback, whatever --skip-invalid says) and fetches a URL path.
    yield from _arrow_rows(path, "datasets folder", ds.with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS))


def _iter_parquet(path: str) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=ARROW_BATCH_ROWS)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError... for a file that is not Parquet
        raise SourceError(f"{path}: cannot read as parquet: {exc}") from exc
    yield from _arrow_rows(path, "parquet", batches)


def _arrow_rows(path: str, kind: str, batches) -> Iterator[RawRow]:
    try:
        for i, (row, nulls) in enumerate(plain_rows(batches)):
            yield RawRow(Location(path, i), row, nulls_dropped=nulls)
    except Exception as exc:  # a damaged page or file part: pyarrow raises many types
        if isinstance(exc, SourceError):
            raise
        raise SourceError(f"{path}: cannot read as {kind}: {type(exc).__name__}: {exc}") from exc
