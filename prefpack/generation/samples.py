"""The samples file: JSONL, one row per prompt, and ``<name>.meta.json`` beside it.

A row: ``prompt_ids`` (the ids the completions continue, as training reads them), ``completion_ids`` (n lists: each
sampled token, ending with the stop token unless cut), ``prompt`` and ``completions`` (decoded, for reading and for
reward functions: completions without special tokens), ``truncated`` (per completion: cut by max_new_tokens, no stop
token), ``row`` (the prompt's row in its source), ``messages`` (a chat prompt's messages, for a scorer with another
template), ``logprobs`` (only when the engine gave them: per completion, the sampling model's raw log-prob of each of
its tokens, one per id, or null for a completion without them; ``engine.Sample``), then the source row's other
fields. The meta: the tokenizer record a store's meta.json holds, the chat
template's hash, the prompt source with its content hash (``prompts.sha256``), the generation settings (engine, n,
seed, ...), the samples file's own record (``samples``: its name and the rows it is to hold; once finished its rows
and sha256, so a meta beside another file is told apart) and, once finished, counts.

Rows are appended as they are made, so a killed run keeps what it wrote: run again with the same settings and it
skips the rows done (a partial last line, which a kill -9 mid-write leaves, is dropped and said, and its row made
again); other settings, or prompts whose content changed, are refused unless ``overwrite``. An empty file (a run
that failed before its first row, e.g. on a too-long ``max_new_tokens``) holds nothing to keep: it is started again
with the new settings. A scorer reads a file back with its meta checked to be its own (``check_meta``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from prefpack.generation.engine import GenerationError

SAMPLE_KEYS = ("prompt_ids", "completion_ids", "prompt", "completions", "truncated", "row")
# what must match for a rerun to continue a samples file (the rest of the meta may change: a server's port)
RESUME_KEYS = ("tokenizer", "chat_template", "prompts", "settings", "engine", "model", "batch_size", "dtype",
               "weights_version")


def meta_path(samples: str | Path) -> Path:
    """``round1/samples.jsonl`` -> ``round1/samples.meta.json``."""
    p = Path(samples)
    return p.with_name(p.name.removesuffix(".jsonl") + ".meta.json")


def samples_record(path: str | Path, expected_rows: int) -> dict:
    """The samples file's own record in its meta while it is written: its name and the rows it is to hold (once
    finished, :meth:`SamplesWriter.finish` adds the rows it holds and its sha256)."""
    return {"file": Path(path).name, "expected_rows": int(expected_rows)}


def file_rows_sha256(path: str | Path) -> tuple[int, str]:
    """A samples file's rows (non-blank lines) and the sha256 of its bytes (a ``.gz`` file's: once unpacked)."""
    h, rows = hashlib.sha256(), 0
    with (gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")) as fh:
        for line in fh:
            h.update(line)
            rows += bool(line.strip())
    return rows, h.hexdigest()


def find_meta(path: str | Path) -> Path | None:
    """The meta a samples file is read with: ``NAME.meta.json`` (``NAME.jsonl`` -> ``NAME.meta.json``, also for
    ``NAME.jsonl.gz``), else a ``samples.meta.json`` in the same folder; None when there is none. Whether it belongs
    to the file is :func:`check_meta`'s question."""
    p = Path(path)
    stem = p.name.removesuffix(".gz").removesuffix(".jsonl")
    for cand in (meta_path(p), p.with_name(stem + ".meta.json"), p.with_name(p.name.split(".")[0] + ".meta.json"),
                 p.with_name("samples.meta.json")):
        if cand.is_file():
            return cand
    return None


def check_meta(path: str | Path, meta: dict, meta_file: str | Path, *, allow_unfinished: bool = False,
               rows_sha: tuple[int, str] | None = None) -> list[str]:
    """That ``meta`` (read from ``meta_file``) is this samples file's and the file is finished; each refusal is one
    line naming the file, its meta and what differs. Returns notes: an older generate's meta (no ``samples`` record)
    is read with its row count checked only; an unfinished file scored anyway (``allow_unfinished``). A meta without
    ``complete`` (not generate's: written by hand) is read as it is. ``rows_sha``: the file's
    :func:`file_rows_sha256`, when the caller has it."""
    path, meta_file = Path(path), Path(meta_file)
    rows, sha = rows_sha if rows_sha is not None else file_rows_sha256(path)
    record = meta.get("samples") if isinstance(meta.get("samples"), dict) else None
    notes = []
    if record is None:
        if "complete" in meta:  # generate wrote it (a meta written by hand has no 'complete': read as it is)
            notes.append(f"{meta_file} records no samples file of its own (written by an older prefpack): it is read "
                         f"as {path.name}'s meta, only its row count checked")
    elif record.get("sha256") is not None and record["sha256"] != sha or \
            record.get("sha256") is None and record.get("file") != path.name:
        owner = record.get("file")
        if owner != path.name:
            held = f", {record['rows']} rows" if record.get("rows") is not None else ""
            raise GenerationError(f"{path} ({rows} rows): the meta beside it, {meta_file}, is that of another samples "
                                  f"file, {owner!r}{held}; give this file its own meta (the one generate wrote beside "
                                  "it, renamed with it), or score the file the meta belongs to")
        if record.get("rows") is not None and record["rows"] != rows:
            raise GenerationError(f"{path} holds {rows} rows, but its meta {meta_file} was written for "
                                  f"{record['rows']} rows of it: the file was changed after generate finished it")
        raise GenerationError(f"{path}: its bytes are not those generate finished (sha256 {sha[:12]}, its meta "
                              f"{meta_file} records {str(record['sha256'])[:12]}): the file was changed after generate "
                              "wrote it")
    elif record.get("file") != path.name:
        notes.append(f"{path} is the samples file its meta {meta_file} records as {record.get('file')!r} (the same "
                     "bytes, renamed)")
    if meta.get("complete") is False:
        expected = (record or {}).get("expected_rows")
        of = f" of the {expected} prompts it is to hold" if expected is not None else ""
        if not allow_unfinished:
            raise GenerationError(f"{path}: generate has not finished it ({meta_file} says complete: false): {rows} "
                                  f"rows{of} are sampled; run the same generate command again to finish it, or pass "
                                  "--allow-unfinished to score these rows")
        notes.append(f"{path} is unfinished: its {rows} rows{of} are scored (--allow-unfinished)")
    elif record is None and isinstance(meta.get("counts"), dict) and meta["counts"].get("prompts") is not None \
            and int(meta["counts"]["prompts"]) != rows:
        raise GenerationError(f"{path} holds {rows} rows, but the meta beside it, {meta_file}, counts "
                              f"{meta['counts']['prompts']} prompts: it is another samples file's meta, or the file "
                              "was changed after generate wrote it")
    return notes


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file: the same path once links are resolved, or (both existing) one inode."""
    try:
        return Path(a).resolve() == Path(b).resolve() or (os.path.exists(a) and os.path.exists(b)
                                                          and os.path.samefile(a, b))
    except OSError:
        return False


def check_not_inputs(writes: list[tuple[str, str | Path]], inputs: list[str | Path], command: str) -> None:
    """Refuses, in one line, a path ``command`` writes (``writes``: (what, path)) that is one of its inputs or a file
    inside an input folder (a store, a ``datasets`` folder): writing it would destroy what is read."""
    for what, out in writes:
        for inp in inputs:
            inside = [inp, *sorted(p for p in Path(inp).rglob("*") if p.is_file())] if os.path.isdir(inp) else [inp]
            hit = next((f for f in inside if same_file(out, f)), None)
            if hit is not None:
                named = f"the input {inp}" if str(hit) == str(inp) else f"{hit}, a file of the input {inp}"
                raise GenerationError(f"{command}: {what} {out} is {named}; writing it would destroy what is read: "
                                      "choose another output")


def _resume_view(meta: dict) -> dict:
    gen = meta.get("generation") or {}
    view = {k: meta.get(k) for k in ("tokenizer", "chat_template", "prompts")}
    if isinstance(view["prompts"], dict):  # their content hash is checked on its own (an older meta has none)
        view["prompts"] = {k: v for k, v in view["prompts"].items() if k != "sha256"}
    view.update({k: gen.get(k) for k in RESUME_KEYS if k in gen})
    return json.loads(json.dumps(view))


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _unwritable(path, exc) from None


def _unwritable(path: Path, exc: OSError) -> GenerationError:
    """A failed write (a full disk, a quota, a folder gone) named by its file, never a bare OSError."""
    return GenerationError(f"cannot write {path}: {exc.strerror or exc}; the whole rows written so far are kept, and "
                           "running the same command again continues them once there is room")


class SamplesWriter:
    """Appends rows to a samples file, continuing one a previous run with the same settings left."""

    def __init__(self, path: str | Path, meta: dict, *, overwrite: bool = False):
        self.path, self.meta_file, self.meta = Path(path), meta_path(path), dict(meta, complete=False)
        self.done: set[int] = set()
        self.torn = 0  # bytes of a partial last line an earlier run left (dropped)
        self.notes: list[str] = []  # what the caller says in a line (an older meta's unchecked prompts)
        self.written = 0  # rows this writer wrote
        self.prior = {"samples": 0, "truncated": 0}  # what the rows an earlier run wrote hold
        if self.path.exists() and self.path.stat().st_size and not overwrite:
            self.done = self._resume()
        elif self.meta_file.exists() and not self.path.exists() and not overwrite:
            raise GenerationError(f"{self.meta_file} exists without its samples file {self.path}; remove it, or pass "
                                  "--overwrite")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _unwritable(self.path.parent, exc) from None
        _write_json(self.meta_file, self.meta)
        try:
            self.fh = open(self.path, "a" if self.done else "w", encoding="utf-8")
        except OSError as exc:
            raise _unwritable(self.path, exc) from None

    def _resume(self) -> set[int]:
        if not self.meta_file.is_file():
            raise GenerationError(f"{self.path} exists and has no {self.meta_file.name} beside it (not a samples file "
                                  "generate wrote); choose another output, or pass --overwrite to replace it")
        try:
            old = json.loads(self.meta_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise GenerationError(f"{self.meta_file}: unreadable ({exc}); pass --overwrite to start again") from None
        before, now = _resume_view(old), _resume_view(self.meta)
        if before != now:
            keys = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
            raise GenerationError(f"{self.path} was generated with other settings ({', '.join(keys)} differ), so it "
                                  "cannot be continued; pass --overwrite to replace it, or choose another output")
        self._check_prompts(old)
        done, keep = set(), 0
        with open(self.path, "rb") as fh:
            for line in fh:
                if not line.endswith(b"\n"):
                    self.torn = len(line)  # a partial line a killed run left: dropped, and its row made again
                    break
                try:
                    row = json.loads(line)
                    done.add(int(row["row"]))
                    self.prior["samples"] += len(row["completion_ids"])
                    self.prior["truncated"] += sum(map(bool, row["truncated"]))
                except (ValueError, KeyError, TypeError) as exc:
                    raise GenerationError(f"{self.path}: line {len(done) + 1} is damaged ({exc}); pass --overwrite "
                                          "to start again") from None
                keep += len(line)
        with open(self.path, "r+b") as fh:
            fh.truncate(keep)
        return done

    def _check_prompts(self, old: dict) -> None:
        """The prompts' content now against the hash the file was begun with (an older meta has none: a note)."""
        before = (old.get("prompts") or {}).get("sha256")
        now = (self.meta.get("prompts") or {}).get("sha256")
        if not isinstance(before, dict):
            self.notes.append(f"{self.meta_file} records no hash of its prompts (written by an older prefpack): "
                              f"{self.path} is continued without checking that its prompts are unchanged")
            return
        if now is not None and before != now:
            changed = [f"{p} (sha256 {str(before.get(p))[:12]} then, {str(now.get(p))[:12]} now)"
                       for p in sorted(set(before) | set(now)) if before.get(p) != now.get(p)]
            raise GenerationError(f"{self.path} cannot be continued: its prompts changed since it was begun: "
                                  f"{'; '.join(changed)}; pass --overwrite to sample them again from the start, or "
                                  "choose another output")

    def write(self, row: dict) -> None:
        try:
            self.fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            self.fh.flush()
        except OSError as exc:  # a part-written last line is dropped when the file is continued
            raise _unwritable(self.path, exc) from None
        self.written += 1

    def finish(self, counts: dict) -> None:
        self.fh.close()
        rows, sha = file_rows_sha256(self.path)
        self.meta["samples"] = {**self.meta.get("samples", {"file": self.path.name}), "rows": rows, "sha256": sha}
        self.meta.update(complete=True, counts=counts)
        _write_json(self.meta_file, self.meta)

    def close(self) -> None:
        if not self.fh.closed:
            self.fh.close()


def read_samples(path: str | Path, *, allow_unfinished: bool = False) -> tuple[dict, Iterator[dict]]:
    """A samples file's meta and its rows (each checked: the keys, n completions each with its flag), for a scorer;
    a bad row is one line naming the file, the line and the key. The meta must be this file's (:func:`check_meta`)
    and the file finished, unless ``allow_unfinished``."""
    meta_file = find_meta(path) or meta_path(path)
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GenerationError(f"{meta_file}: cannot read the samples' meta ({exc})") from None
    if "complete" not in meta:
        raise GenerationError(f"{meta_file}: not a samples meta generate wrote (no 'complete')")
    check_meta(path, meta, meta_file, allow_unfinished=allow_unfinished)
    n = int(meta["generation"]["settings"]["n"])

    def rows() -> Iterator[dict]:
        with open(path, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, start=1):
                row = json.loads(line)
                for key in SAMPLE_KEYS:
                    if key not in row:
                        raise GenerationError(f"{path} line {line_no}: no {key!r}")
                for key in ("completion_ids", "completions", "truncated"):
                    if not isinstance(row[key], list) or len(row[key]) != n:
                        raise GenerationError(f"{path} line {line_no}, field {key!r}: not a list of n={n}")
                yield row

    return meta, rows()
