"""What ``prefpack score`` reads, as one stream of :class:`ScoreRow`: a prompt's token ids and its completions' ids,
never re-tokenised when the input holds ids (a reward model of another tokenizer re-tokenises the rows' text for
itself: ``retokenise``; the output keeps these ids).

Three inputs:
- a samples file (``prefpack generate``'s JSONL: ``prompt_ids``, ``completion_ids``, ``truncated``, ``row``, the
  sampler's per-token ``logprobs`` when the engine gave them, and any passthrough field, with ``samples.meta.json``
  beside it naming the tokenizer by name and hash);
- JSONL rows of text, ``{prompt, completions}`` (no scores needed) or pairs, checked and tokenised by prepare's own
  code (``data.formats.extract``, ``data.tokenize.ExampleTokenizer``), so the ids are those ``prepare`` writes;
- a store (pairs: each pair is a row of two completions; ranked: each prompt group is a row).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefpack.data.formats import InvalidRow, detect_layout, extract, resolve_fields
from prefpack.data.layouts import RANKED_RANK_LIST, RANKED_SCORE_LISTS
from prefpack.data.sources import file_sha256
from prefpack.data.spans import scored_of
from prefpack.data.store import FLAG_COMPLETION_TRUNCATED, Store
from prefpack.errors import PrefpackError

TEXT_BATCH = 64  # text rows tokenised per call


class ScoreInputError(PrefpackError, ValueError):
    """An input ``prefpack score`` cannot read: its file, row and field are named."""


@dataclass
class ScoreRow:
    """One prompt and its completions, as scorers see it. ``row`` numbers the input's rows from 0 (a store's pair or
    prompt group); ``fields`` is the input row as read (passthrough fields such as ``label`` reach a reward function
    and the JSONL output); ``scored`` is a completion's score mask (None: every token is scored); ``logprobs`` a
    completion's sampler log-probs, one per token (None: the sampler gave none; an empty list: none for any)."""

    row: int
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    prompt: str
    completions: list[str]
    truncated: list[bool]
    scored: list[np.ndarray | None] = field(default_factory=list)
    fields: dict = field(default_factory=dict)
    logprobs: list[np.ndarray | None] = field(default_factory=list)

    def logprobs_of(self, k: int) -> np.ndarray | None:
        """Completion ``k``'s sampler log-probs (float64, one per token), None when it has none."""
        return self.logprobs[k] if k < len(self.logprobs) else None


class ScoreInput:
    """An opened input: its kind, tokenizer (decodes ids; copied into the output store) and rows."""

    def __init__(self, path: str | Path, *, tokenizer: str | None = None, fallback_tokenizer: str | None = None,
                 trust_remote_code: bool = False, allow_unfinished: bool = False):
        from prefpack.tokenizer import load_tokenizer, special_tokens

        self.path = Path(path)
        self.notes: list[str] = []  # said in a line each (an older samples meta, an unfinished file scored)
        self._sha: str | None = None
        if not self.path.exists():
            raise ScoreInputError(f"{str(self.path)!r}: no such file or folder")
        self.kind = "store" if self.path.is_dir() else _file_kind(self.path)
        self.meta: dict = {}
        if self.kind == "store":
            self.store = Store(self.path)
            if self.store.kind == "unpaired":
                raise ScoreInputError(f"{self.path}: an unpaired (KTO) store has one completion per prompt; score "
                                      "a pair store, a ranked store, or rows with several completions")
            if self.store.num_images:
                raise ScoreInputError(f"{self.path}: the store holds images; prefpack score reads text stores only")
            if self.store.num_segments:
                raise ScoreInputError(f"{self.path}: the store cuts completions into segments (segments.bin, "
                                      "several sequences each), which prefpack score does not read: a reward is "
                                      "read at one sequence's last token, and the scored store would lose them")
            tokenizer = tokenizer or str(self.store.tokenizer_path())
            self.meta = {"tokenizer": self.store.meta.get("tokenizer")}
        elif self.kind == "samples":
            self.meta = self._samples_meta(allow_unfinished)
            recorded = self.meta.get("tokenizer") or {}
            if tokenizer is None and recorded.get("name"):
                if Path(recorded["name"]).is_dir() or fallback_tokenizer is None:
                    tokenizer = recorded["name"]
                elif recorded.get("hash") and not _matches(fallback_tokenizer, recorded, trust_remote_code):
                    tokenizer = recorded["name"]  # a hub id: the reward model's own tokenizer is not the samples'
        self.fallback = tokenizer is None and fallback_tokenizer is not None
        tokenizer = tokenizer or fallback_tokenizer
        if tokenizer is None:
            raise ScoreInputError(f"{self.path}: give --tokenizer (the tokenizer that reads its rows or wrote its ids)")
        self.tokenizer_dir = tokenizer
        self.tok = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code)
        self.specials = special_tokens(self.tok)
        self._check_tokenizer()

    def _check_tokenizer(self) -> None:
        from prefpack.tokenizer import tokenizer_matches

        recorded = self.meta.get("tokenizer")
        if isinstance(recorded, dict) and recorded.get("hash") and not tokenizer_matches(self.tok, recorded):
            given = f"the reward model's {self.tokenizer_dir!r}" if self.fallback else f"--tokenizer {self.tokenizer_dir!r}"
            raise ScoreInputError(f"{self.path}: its token ids are of the tokenizer {recorded.get('name')!r} (hash "
                                  f"{str(recorded.get('hash'))[:12]}), not {given}")

    def identity(self) -> dict:
        """What a resumed run must find again: the input's kind and the hash of its bytes."""
        if self.kind == "store":
            digest = {name: info.get("sha256") for name, info in self.store.meta.get("files", {}).items()}
            sha = hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()
        else:
            sha = self._sha or file_sha256(str(self.path))
        return {"kind": self.kind, "path": str(self.path), "sha256": sha}

    def _samples_meta(self, allow_unfinished: bool) -> dict:
        """The meta beside a samples file (``generation.samples.find_meta``), checked to be this file's and the file
        finished (``check_meta``); {} when there is none."""
        from prefpack.generation.engine import GenerationError
        from prefpack.generation.samples import check_meta, file_rows_sha256, find_meta

        meta_file = find_meta(self.path)
        if meta_file is None:
            return {}
        try:
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ScoreInputError(f"{meta_file}: not JSON ({exc})") from None
        if not isinstance(meta, dict):
            raise ScoreInputError(f"{meta_file}: not a samples meta (a JSON object)")
        rows, sha = file_rows_sha256(self.path)  # a gzipped file: its rows' bytes, as generate wrote them
        self._sha = None if self.path.suffix == ".gz" else sha  # the input's identity: the bytes as they lie
        try:
            self.notes += check_meta(self.path, meta, meta_file, allow_unfinished=allow_unfinished,
                                     rows_sha=(rows, sha))
        except GenerationError as exc:
            raise ScoreInputError(str(exc)) from None
        return meta

    def count_rows(self) -> int:
        """How many rows ``rows()`` yields (for the progress bar)."""
        if self.kind == "store":
            return len(self.store) if self.store.kind == "pairs" else len(self.store.group_starts()) - 1
        with _open(self.path) as fh:
            return sum(1 for line in fh if line.strip())

    def rows(self) -> Iterator[ScoreRow]:
        if self.kind == "store":
            return self._store_rows()
        if self.kind == "samples":
            return self._sample_rows()
        return self._text_rows()

    # ---------------------------------------------------------------- the three kinds

    def _decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def _store_rows(self) -> Iterator[ScoreRow]:
        s = self.store
        flags = s.column("flags")
        if s.kind == "pairs":
            for i in range(len(s)):
                prompt, *comps = s.pair(i)
                cut = bool(flags[i] & FLAG_COMPLETION_TRUNCATED)
                yield self._row_of(i, prompt, comps, [cut, cut])
            return
        starts = s.group_starts()
        for g in range(len(starts) - 1):
            prompt, comps = s.ranked_group(g)
            cut = [bool(f & FLAG_COMPLETION_TRUNCATED) for f in flags[starts[g]:starts[g + 1]]]
            row = self._row_of(g, prompt, comps, cut)
            if s.sampler_logprobs is not None:  # a ranked store's sampler log-probs carry on to the new one
                row.logprobs = [s.completion_logprobs(i) for i in range(int(starts[g]), int(starts[g + 1]))]
            yield row

    def _row_of(self, i: int, prompt, comps, cut: list[bool], fields: dict | None = None) -> ScoreRow:
        p = [int(t) for t in prompt]
        c = [[int(t) for t in x] for x in comps]
        return ScoreRow(i, p, c, self._decode(p), [self._decode(x) for x in c], cut,
                        [scored_of(x) for x in comps], fields or {})

    def _sample_rows(self) -> Iterator[ScoreRow]:
        for i, (line, row) in enumerate(_json_rows(self.path)):
            where = f"{self.path} line {line}"
            prompt = _ids(row, "prompt_ids", where, self.specials.vocab_size)
            comps = row.get("completion_ids")
            if not isinstance(comps, list) or not comps:
                raise ScoreInputError(f"{where}, field 'completion_ids': a non-empty list of token id lists")
            comps = [_ids({"completion_ids": c}, "completion_ids", where, self.specials.vocab_size) for c in comps]
            cut = row.get("truncated", [False] * len(comps))
            if not isinstance(cut, list) or len(cut) != len(comps) or not all(isinstance(b, bool) for b in cut):
                raise ScoreInputError(f"{where}, field 'truncated': one true/false per completion")
            texts = row.get("completions")
            if not (isinstance(texts, list) and len(texts) == len(comps) and all(isinstance(t, str) for t in texts)):
                texts = [self._decode(c) for c in comps]
            prompt_text = row["prompt"] if isinstance(row.get("prompt"), str) else self._decode(prompt)
            yield ScoreRow(i, prompt, comps, prompt_text, texts, cut, [None] * len(comps), row,
                           _logprobs(row, comps, where))

    def _text_rows(self) -> Iterator[ScoreRow]:
        from prefpack.data.tokenize import Dropped, ExampleTokenizer, TokenizeConfig

        tokenize = ExampleTokenizer(self.tok, self.specials, TokenizeConfig())
        batch: list[tuple[int, int, dict]] = []
        layout = None
        for i, (line, row) in enumerate(_json_rows(self.path)):
            if layout is None:
                try:
                    layout, _ = detect_layout(row, {})
                except InvalidRow as err:
                    raise ScoreInputError(f"{self.path} line {line}: {err.message}") from None
                if layout == "unpaired":
                    raise ScoreInputError(f"{self.path}: rows of one completion each (prompt/completion/label); "
                                          "give {prompt, completions} rows or pairs")
            batch.append((i, line, row))
            if len(batch) == TEXT_BATCH:
                yield from self._tokenised(batch, layout, tokenize, Dropped)
                batch = []
        if batch:
            yield from self._tokenised(batch, layout, tokenize, Dropped)

    def _tokenised(self, batch, layout: str, tokenize, dropped) -> Iterator[ScoreRow]:
        fields = resolve_fields(layout, {})
        examples = []
        for _, line, row in batch:
            try:
                examples.append(extract(_with_scores(row, layout), layout, fields))
            except InvalidRow as err:
                raise ScoreInputError(_where(self.path, line, err)) from None
        for (i, line, row), ex, res in zip(batch, examples, tokenize(examples)):
            if isinstance(res, InvalidRow):
                raise ScoreInputError(_where(self.path, line, res))
            assert not isinstance(res, dropped)  # no --max-length here: nothing is dropped
            texts = [c if isinstance(c, str) else self._decode(ids) for c, ids in zip(ex.completions, res.completions)]
            prompt = ex.prompt if isinstance(ex.prompt, str) else self._decode(res.prompt)
            masks = [None if m is None else np.asarray(m, dtype=bool) for m in res.scored or [None] * len(texts)]
            yield ScoreRow(i, list(res.prompt), [list(c) for c in res.completions], prompt, texts,
                           [False] * len(texts), masks, row)


def _matches(folder: str, recorded: dict, trust_remote_code: bool) -> bool:
    from prefpack.tokenizer import load_tokenizer, tokenizer_matches

    return tokenizer_matches(load_tokenizer(folder, trust_remote_code=trust_remote_code), recorded)


def _where(path: Path, line: int, err: InvalidRow) -> str:
    return f"{path} line {line}" + (f", field {err.field!r}" if err.field else "") + f": {err.message}"


def _with_scores(row: dict, layout: str) -> dict:
    """A ``{prompt, completions}`` row needs no scores here: prepare's ranked check reads placeholder zeros."""
    if layout != "ranked" or any(k in row for k in (*RANKED_SCORE_LISTS, RANKED_RANK_LIST)):
        return row
    comps = next((row[k] for k in ("completions", "answers", "responses") if isinstance(row.get(k), list)), [])
    plain = all(not isinstance(c, dict) for c in comps)
    return {**row, "scores": [0.0] * len(comps)} if plain else row


def _file_kind(path: Path) -> str:
    first = next(_json_rows(path), None)
    if first is None:
        raise ScoreInputError(f"{path}: no rows to score")
    return "samples" if "prompt_ids" in first[1] and "completion_ids" in first[1] else "text"


def _json_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number from 1, object) for each non-blank line of a JSONL file; a bad line is a one-line error."""
    with _open(path) as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ScoreInputError(f"{path} line {line_no}: malformed JSON ({exc.msg} at column {exc.colno})") \
                    from None
            if not isinstance(row, dict):
                raise ScoreInputError(f"{path} line {line_no}: a row must be a JSON object")
            yield line_no, row


def _open(path: Path):
    """A JSONL file, gzipped when its name ends in .gz."""
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _logprobs(row: dict, comps: list[list[int]], where: str) -> list[np.ndarray | None]:
    """A samples row's ``logprobs`` (generate writes them when its engine gave them): absent or null, none; else one
    entry per completion, null or one finite log-prob <= 0 per completion token; else a one-line error naming the
    file, the line and the completion."""
    from prefpack.generation.engine import logprobs_problem

    given = row.get("logprobs")
    if given is None:
        return [None] * len(comps)
    if not isinstance(given, list) or len(given) != len(comps):
        raise ScoreInputError(f"{where}, field 'logprobs': one list (or null) per completion, {len(comps)} in all")
    out: list[np.ndarray | None] = []
    for k, (values, ids) in enumerate(zip(given, comps)):
        problem = None if values is None else logprobs_problem(ids, values)
        if problem is not None:
            raise ScoreInputError(f"{where}, field 'logprobs', completion {k}: {problem}")
        out.append(None if values is None else np.asarray(values, dtype=np.float64))
    return out


def _ids(row: dict, name: str, where: str, vocab: int) -> list[int]:
    ids = row.get(name)
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ScoreInputError(f"{where}, field {name!r}: a non-empty list of token ids")
    if min(ids) < 0 or max(ids) >= vocab:
        raise ScoreInputError(f"{where}, field {name!r}: token id outside the tokenizer's {vocab} ids")
    return ids
