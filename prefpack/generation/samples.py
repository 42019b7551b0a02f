"""The samples file: JSONL, one row per prompt, and ``<name>.meta.json`` beside it.

A row: ``prompt_ids`` (the ids the completions continue, as training reads them), ``completion_ids`` (n lists: each
sampled token, ending with the stop token unless cut), ``prompt`` and ``completions`` (decoded, for reading and for
reward functions: completions without special tokens), ``truncated`` (per completion: cut by max_new_tokens, no stop
token), ``row`` (the prompt's row in its source), ``messages`` (a chat prompt's messages, for a scorer with another
template), then the source row's other fields. The meta: the tokenizer record a store's meta.json holds, the chat
template's hash, the prompt source, the generation settings (engine, n, seed, ...) and, once finished, counts.

Rows are appended as they are made, so a killed run keeps what it wrote: run again with the same settings and it
skips the rows done (a partial last line, which a kill -9 mid-write leaves, is dropped and said, and its row made
again); other settings are refused unless ``overwrite``. An empty file (a run that failed before its first row,
e.g. on a too-long ``max_new_tokens``) holds nothing to keep: it is started again with the new settings.
"""

from __future__ import annotations

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


def _resume_view(meta: dict) -> dict:
    gen = meta.get("generation") or {}
    view = {k: meta.get(k) for k in ("tokenizer", "chat_template", "prompts")}
    view.update({k: gen.get(k) for k in RESUME_KEYS if k in gen})
    return json.loads(json.dumps(view))


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class SamplesWriter:
    """Appends rows to a samples file, continuing one a previous run with the same settings left."""

    def __init__(self, path: str | Path, meta: dict, *, overwrite: bool = False):
        self.path, self.meta_file, self.meta = Path(path), meta_path(path), dict(meta, complete=False)
        self.done: set[int] = set()
        self.torn = 0  # bytes of a partial last line an earlier run left (dropped)
        self.written = 0  # rows this writer wrote
        self.prior = {"samples": 0, "truncated": 0}  # what the rows an earlier run wrote hold
        if self.path.exists() and self.path.stat().st_size and not overwrite:
            self.done = self._resume()
        elif self.meta_file.exists() and not self.path.exists() and not overwrite:
            raise GenerationError(f"{self.meta_file} exists without its samples file {self.path}; remove it, or pass "
                                  "--overwrite")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _write_json(self.meta_file, self.meta)
        self.fh = open(self.path, "a" if self.done else "w", encoding="utf-8")

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

    def write(self, row: dict) -> None:
        self.fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.fh.flush()
        self.written += 1

    def finish(self, counts: dict) -> None:
        self.fh.close()
        self.meta.update(complete=True, counts=counts)
        _write_json(self.meta_file, self.meta)

    def close(self) -> None:
        if not self.fh.closed:
            self.fh.close()


def read_samples(path: str | Path) -> tuple[dict, Iterator[dict]]:
    """A samples file's meta and its rows (each checked: the keys, n completions each with its flag), for a scorer;
    a bad row is one line naming the file, the line and the key."""
    meta_file = meta_path(path)
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GenerationError(f"{meta_file}: cannot read the samples' meta ({exc})") from None
    if not meta.get("complete"):
        raise GenerationError(f"{path}: generate has not finished it (run the same generate command again to "
                              "complete it)")
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
