"""What ``prefpack score`` writes: a ranked store (each row's completions with their scores, the prompt once), a pair
store of the pairs ``--pairs`` draws, or JSONL rows with a ``scores`` list. Stores go through the store writer (a
temporary folder renamed into place); token ids are written as read, with each completion's unscored spans kept, and
a ranked store keeps the sampler's per-token log-probs of completions that have them (logprobs.bin,
``data.store_format``; a pair store does not).
Nothing time-dependent is recorded, so a resumed run writes exactly the store an uninterrupted one writes.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

import prefpack
from prefpack.data.spans import mask_to_spans
from prefpack.data.store import FLAG_COMPLETION_TRUNCATED, StoreWriter
from prefpack.errors import PrefpackError
from prefpack.rewards.pairs import PairSelection
from prefpack.rewards.rows import ScoreInput, ScoreRow
from prefpack.tokenizer import HASH_VERSION, tokenizer_hash, tokenizer_name


class ScoreOutputError(PrefpackError, ValueError):
    """Nothing to write (every row skipped), or an output that exists without --overwrite."""


class NothingToWrite(ScoreOutputError):
    """Every row was skipped (a pair store: every prompt's samples tie). Carries what was scored, so the on-policy
    rounds can record a round that ties without scoring it again."""

    def __init__(self, message: str, scoring: dict, pairs: dict | None):
        super().__init__(message)
        self.scoring, self.pairs = scoring, pairs


def score_bits(score: float) -> int:
    """A float64 score as the int64 bit pattern a ranked store's index holds (``Store.scores`` reads it back)."""
    return int(np.array(score, dtype=np.float64).view(np.int64))


def write_store(source: ScoreInput, rows: Iterable[tuple[ScoreRow, list[float]]], output: str, *, meta: dict,
                selection: PairSelection | None, overwrite: bool, log: Callable[[str], None]) -> dict:
    """A ranked store (``selection`` None) or a pair store of the selected pairs; returns the counts recorded."""
    writer = StoreWriter(output, kind="ranked" if selection is None else "pairs",
                         vocab_size=source.specials.vocab_size, overwrite=overwrite, log=log)
    skipped: Counter = Counter()
    try:
        for row, scores in rows:
            if selection is not None:
                _append_pairs(writer, row, selection(scores), skipped)
            elif len(row.completion_ids) < 2:
                skipped["fewer_than_two_completions"] += 1  # a ranked group holds two or more
            else:
                _append_group(writer, row, scores)
        if writer.n_rows == 0:
            raise NothingToWrite(f"nothing to write to {output}: every row was skipped ({dict(skipped)})",
                                 meta["scoring"], selection.counts() if selection is not None else None)
        source.tok.save_pretrained(writer.tmp / "tokenizer")
        counts = {"rows_read": meta["sources"][0]["rows"], "examples": writer.n_rows, "skipped": dict(skipped)}
        full = {**meta, "counts": counts, **({"pairs": selection.counts()} if selection is not None else {})}
        writer.commit(full, overwrite=overwrite)
    except BaseException:
        writer.abort()
        raise
    return full


def _flags(row: ScoreRow, k: int) -> int:
    return FLAG_COMPLETION_TRUNCATED if row.truncated[k] else 0


def _append_group(writer: StoreWriter, row: ScoreRow, scores: list[float]) -> None:
    flat, index, spans = list(row.prompt_ids), [], []
    logprobs = [np.full(len(row.prompt_ids), np.nan, np.float32)]  # the sampler's, per token; NaN: none (prompt)
    for k, (ids, score) in enumerate(zip(row.completion_ids, scores)):
        index.append([len(flat), len(row.prompt_ids), len(ids), score_bits(score), 0, _flags(row, k), 0, row.row])
        if row.scored[k] is not None:
            spans.append(mask_to_spans(row.scored[k], len(flat)))
        lp = row.logprobs_of(k)
        logprobs.append(np.full(len(ids), np.nan, np.float32) if lp is None else np.asarray(lp, np.float32))
        flat.extend(ids)
    given = any(row.logprobs_of(k) is not None for k in range(len(row.completion_ids)))
    _append(writer, flat, index, spans, np.concatenate(logprobs) if given else None)


def _append_pairs(writer: StoreWriter, row: ScoreRow, pairs: list[tuple[int, int]], skipped: Counter) -> None:
    if not pairs:
        skipped["tied"] += 1
        return
    flat, index, spans = [], [], []
    for c, r in pairs:
        p, chosen, rejected = row.prompt_ids, row.completion_ids[c], row.completion_ids[r]
        index.append([len(flat), len(p), len(chosen), len(rejected), _flags(row, c) | _flags(row, r), 0, row.row])
        for k, start in ((c, len(flat) + len(p)), (r, len(flat) + len(p) + len(chosen))):
            if row.scored[k] is not None:
                spans.append(mask_to_spans(row.scored[k], start))
        flat.extend([*p, *chosen, *rejected])
    _append(writer, flat, index, spans)


def _append(writer: StoreWriter, flat: list[int], index: list[list[int]], spans: list[np.ndarray],
            logprobs: np.ndarray | None = None) -> None:
    tokens = np.asarray(flat, dtype=np.int64)
    writer.append(tokens, np.asarray(index, dtype=np.int64), np.concatenate(spans) if spans else None,
                  logprobs=logprobs)


def write_jsonl(rows: Iterable[tuple[ScoreRow, list[float]]], output: str, *, overwrite: bool) -> int:
    """Each input row with ``scores`` (and its ids and texts when the input had none), written to a temporary file
    renamed into place; returns the rows written."""
    out = Path(output)
    if out.exists() and not overwrite:
        raise ScoreOutputError(f"output {output!r} exists; pass --overwrite to replace it")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for row, scores in rows:
                record = {"row": row.row, "prompt": row.prompt, "completions": row.completions,
                          "prompt_ids": row.prompt_ids, "completion_ids": row.completion_ids, **row.fields,
                          "scores": scores}
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
                n += 1
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n


def store_meta(source: ScoreInput, scorer_identity: dict, scores: list[list[float]], args: dict) -> dict:
    """The output store's meta.json (the writer adds the format fields): the tokenizer record prepare writes, where
    the rows came from, the scorer, and the scores' spread."""
    tok = source.tok
    flat = [s for row in scores for s in row]
    return {
        "prefpack_version": prefpack.__version__,
        "layout": "scored",
        "source_layout": source.kind,
        "tokenizer": {"name": tokenizer_name(tok, source.tokenizer_dir), "hash": tokenizer_hash(tok),
                      "hash_version": HASH_VERSION, "has_chat_template": bool(tok.chat_template),
                      **source.specials.to_json()},
        "sources": [{"path": str(source.path), "kind": source.kind, "rows": len(scores),
                     "sha256": source.identity()["sha256"]}],
        "scoring": {**scorer_identity, "completions": len(flat),
                    "min": min(flat) if flat else None, "max": max(flat) if flat else None,
                    "mean": math.fsum(flat) / len(flat) if flat else None},
        **({"samples": source.meta} if source.kind == "samples" and source.meta else {}),
        "args": args,
    }
