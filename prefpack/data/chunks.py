"""The parallel part of `prefpack prepare`: raw rows cut into chunks, each chunk checked and tokenised into token
ids and index rows by a worker process, and the results handed back in input order.

Apart from ``prepare`` (options, layout choice, the store and the report) because this side runs in other
processes: what it reads is set up once per worker (``init_worker``), and what crosses back is a ``ChunkResult``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prefpack.data.formats import InvalidRow, extract, resolve_fields, used_fields
from prefpack.data.layouts import IMAGES_FIELD, RLAIFV_IMAGE
from prefpack.data.row_checks import check_no_image_token
from prefpack.data.sources import RawRow, Source, iter_rows
from prefpack.data.spans import mask_to_spans
from prefpack.data.store import FLAG_COMPLETION_TRUNCATED, FLAG_OPEN_PROMPT, FLAG_PROMPT_TRUNCATED
from prefpack.data.tokenize import Dropped, ExampleTokenizer, TokenizeConfig, TokenizedExample
from prefpack.data.truncation import BELOW_MINIMUM, TruncationStats, prompt_field
from prefpack.tokenizer import load_tokenizer, special_tokens

_WORKER: dict[str, Any] = {}


def init_worker(tokenizer: Any, trust_remote_code: bool, layout: str, fields: dict, tcfg: TokenizeConfig,
                threads: bool) -> None:
    """Set up a worker; `tokenizer` is a loaded tokenizer (in-process or forked) or a path (spawned)."""
    if not threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    tok = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code) if isinstance(tokenizer, str | Path) else tokenizer
    _WORKER.update(
        layout=layout,
        fields=resolve_fields(layout, fields),
        tokenize=ExampleTokenizer(tok, special_tokens(tok), tcfg),
    )


@dataclass
class ChunkResult:
    tokens: np.ndarray
    index: np.ndarray  # int64 [n, columns], offsets relative to `tokens`
    problems: list[dict]  # invalid rows and drops, in input order: {loc, reason, field, message, raw, kind}
    truncated: Counter
    empty: Counter  # completions kept although empty or whitespace-only, by field
    chat: Counter  # examples rendered by the chat template ("examples"), with tools ("with_tools"), "with_documents"
    spans: np.ndarray  # int64 [m, 2]: unscored completion tokens [start, end), positions in `tokens`
    unused: set  # input columns no row of the chunk was read from
    cuts: TruncationStats  # prompts and completions --max-length cut, and by how many tokens
    # vision rows: per image (its index row in this chunk, encoded bytes, width, height, where its image tokens
    # start in `tokens`, how many)
    images: list[tuple[int, bytes, int, int, int, int]]
    left_out: list[str]  # per row whose chat template left text of a reply out: where, and what (counted, reported)
    margins: np.ndarray | None = None  # float64 per pair or unpaired index row, NaN where it gives no margin
    segments: np.ndarray | None = None  # int64 [k]: where later segments of completions start, positions in `tokens`


def process_chunk(chunk: list[RawRow]) -> ChunkResult:
    """One chunk in a worker set up by ``init_worker``: its rows checked, tokenised and laid out as the store's
    token ids and index rows; bad and dropped rows become problems."""
    layout, fields, tokenize = _WORKER["layout"], _WORKER["fields"], _WORKER["tokenize"]
    problems: list[dict] = []
    examples, origin = [], []
    used, unused = used_fields(layout, fields), set()
    vision = tokenize.cfg.vision is not None
    for raw in chunk:
        if raw.row is None:
            problems.append(_problem(raw, raw.error or "unreadable", None, raw.message or "", raw.raw))
            continue
        unused.update(k for k in raw.row if k not in used)
        try:
            ex = extract(raw.row, layout, fields, vision=vision, chat_template=bool(tokenize.tok.chat_template))
            if vision:  # the image token's text in a row would be image tokens with no image
                check_no_image_token(raw.row, used - {IMAGES_FIELD, RLAIFV_IMAGE}, tokenize.cfg.vision.image_token)
            if ex.images:
                src = os.path.abspath(raw.loc.file)  # relative image paths: from the file's folder (or the folder)
                ex.image_dir = src if os.path.isdir(src) else os.path.dirname(src)
            examples.append(ex)
            origin.append(raw)
        except InvalidRow as err:
            problems.append(_problem(raw, err.reason, err.field, err.message, raw.row))
    results = tokenize(examples)
    flat: list[int] = []
    rows: list[list[int]] = []
    truncated: Counter = Counter()
    offset = 0
    empty: Counter = Counter()
    chat: Counter = Counter()
    groups = 0  # ranked rows written by this chunk (the store writer numbers them globally)
    spans: list[np.ndarray] = []
    images: list[tuple[int, bytes, int, int, int, int]] = []
    margins: list[float] = []
    segments: list[np.ndarray] = []

    def add_completion(c: list[int], scored: list[bool] | None, cuts: list[int] | None = None) -> None:
        if scored is not None:
            spans.append(mask_to_spans(scored, len(flat)))
        if cuts:
            segments.append(np.asarray(cuts, dtype=np.int64) + len(flat))
        flat.extend(c)

    cuts = TruncationStats()
    left_out: list[str] = []
    for raw, ex, res in zip(origin, examples, results):
        if isinstance(res, InvalidRow):
            where = prompt_field(layout, fields) if res.reason == BELOW_MINIMUM else res.field
            problems.append(_problem(raw, res.reason, where, res.message, raw.row))
            continue
        if isinstance(res, Dropped):
            problems.append(_problem(raw, res.reason, None, "longer than --max-length", raw.row, kind="dropped"))
            continue
        assert isinstance(res, TokenizedExample)
        empty.update(ex.empty_fields())
        if res.left_out:
            left_out.append(f"{raw.loc}: {'; '.join(res.left_out)}")
        if ex.prompt_at_difference:
            chat["prompt_at_difference"] += 1
        if ex.chat:
            chat["examples"] += 1
            chat["with_tools"] += bool(ex.tools if ex.tools is not None else tokenize.cfg.tools)
            if ex.documents:  # counted only where present (the report's chat counts name what happened)
                chat["with_documents"] += 1
            chat.update(f"unread:{k}" for k in tokenize.reads.unread(ex.template_kwargs))
        if res.cut:  # texts far over --max-length, cut before tokenising (counted apart; not an index flag)
            truncated["cut_before_tokenising"] += res.cut
        if res.truncated:
            cuts.rows += 1
            cuts.chat_prompts += ex.chat and "prompt" in res.truncated
            cuts.prompts.add(res.before[0], len(res.prompt))
            for before, c in zip(res.before[1:], res.completions):
                cuts.completions.add(before, len(c))
        flags = FLAG_OPEN_PROMPT if res.open_prompt else 0
        if any(res.segments):  # a reply its template forces into several sequences (turn_contexts)
            chat["split_rows"] += 1
            chat["split_sequences"] += sum(len(s or []) for s in res.segments)
        for what in res.truncated:
            truncated[what] += 1
            flags |= FLAG_PROMPT_TRUNCATED if what == "prompt" else FLAG_COMPLETION_TRUNCATED
        if ex.scores is not None:  # ranked: one row per completion, the prompt once before the first
            # the prompt's images belong to the group's first row (the one its prompt precedes)
            images.extend((len(rows), data, w, h, len(flat) + start, n) for data, w, h, start, n in res.images)
            flat.extend(res.prompt)
            for k, (c, score, scored) in enumerate(zip(res.completions, ex.scores, res.scored)):
                rows.append([len(flat), len(res.prompt), len(c), _score_bits(score), groups, flags,
                             raw.loc_file_index, raw.loc.row])
                add_completion(c, scored, _segments_of(res, k))
            groups += 1
            offset = len(flat)
            continue
        lens = [len(res.prompt)] + [len(c) for c in res.completions]
        if res.label is not None:
            lens.append(res.label)
        rows.append([offset, *lens, flags, raw.loc_file_index, raw.loc.row])
        margins.append(np.nan if ex.margin is None else ex.margin)
        images.extend((len(rows) - 1, data, w, h, offset + start, n) for data, w, h, start, n in res.images)
        flat.extend(res.prompt)
        for k, (c, scored) in enumerate(zip(res.completions, res.scored)):
            add_completion(c, scored, _segments_of(res, k))
        offset = len(flat)
    tokens = np.array(flat, dtype=np.int64)
    width = 8 if layout == "ranked" else 7
    index = np.asarray(rows, dtype=np.int64).reshape(-1, width)
    problems.sort(key=lambda p: (p["file_index"], p["row"]))
    span_rows = np.concatenate(spans) if spans else np.zeros((0, 2), np.int64)
    return ChunkResult(tokens, index, problems, truncated, empty, chat, span_rows, unused, cuts, images, left_out,
                       np.asarray(margins, dtype=np.float64),
                       np.concatenate(segments) if segments else np.zeros(0, np.int64))


def _segments_of(res: TokenizedExample, k: int) -> list[int] | None:
    """Completion ``k``'s segment starts (None: one sequence); ``segments`` may be empty (no completion cut)."""
    segments = getattr(res, "segments", ())
    return segments[k] if k < len(segments) else None


def _score_bits(score: float) -> int:
    """A float64 score stored in the int64 index (its bit pattern; ``Store.scores`` reads it back exactly)."""
    return int(np.array(score, dtype=np.float64).view(np.int64))


def _problem(raw: Any, reason: str, field_name: str | None, message: str, content: Any, kind: str = "invalid") -> dict:
    return {
        "kind": kind,
        "file_index": raw.loc_file_index,
        "row": raw.loc.row,
        "loc": raw.loc.to_json(),
        "where": str(raw.loc),
        "reason": reason,
        "field": field_name,
        "message": message,
        "content": content,
    }


@dataclass(frozen=True)
class ChunkRow(RawRow):
    """A raw row with the number of its input file (the index's ``source_file``)."""

    loc_file_index: int = 0


def read_chunks(sources: list[Source], split: str | None, size: int, counts: Counter,
                nulls: Counter | None = None) -> Iterator[list[ChunkRow]]:
    """The rows of every source in order, ``size`` a chunk; ``counts`` receives each file's row count, ``nulls`` the
    null keys dropped from Arrow rows ("keys") and the rows that had some ("rows")."""
    chunk: list[ChunkRow] = []
    for src in sources:
        n = 0
        for raw in iter_rows(src, split=split):
            chunk.append(ChunkRow(raw.loc, raw.row, raw.error, raw.message, raw.raw, loc_file_index=src.file_index))
            if nulls is not None and raw.nulls_dropped:
                nulls.update(keys=raw.nulls_dropped, rows=1)
            n += 1
            if len(chunk) >= size:
                yield chunk
                chunk = []
        counts[src.file_index] = n
    if chunk:
        yield chunk


def ordered_map(fn: Callable, items: Iterator, workers: int, init_args: tuple) -> Iterator:
    """Map in worker processes, in order, with at most 2 x workers items in flight (bounded memory).

    One worker runs in this process with the tokenizer's own threads; several are forked processes that
    inherit the loaded tokenizer (spawned ones, off Linux, load it again from its path).
    """
    tok, path, *rest = init_args
    if workers <= 1:
        init_worker(tok, *rest, True)
        yield from map(fn, items)
        return
    if sys.platform.startswith("linux"):
        ctx, initargs = mp.get_context("fork"), (tok, *rest, False)
    else:
        ctx, initargs = mp.get_context("spawn"), (path, *rest, False)
    with ctx.Pool(workers, initializer=init_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
