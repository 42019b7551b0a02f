"""Where generate's prompts come from, as the token ids training reads: a prepared store's prompts (read back from
its tokens, never re-tokenised), or rows of prompts / chat messages rendered and tokenised by prepare's own code
(``ExampleTokenizer.encode_prompt``: the same chat template, generation prompt, tools, template variables and BOS
convention), so a store later prepared from the same rows starts its completions from the same ids."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from prefpack.data.formats import VISION_FIELDS, Example, InvalidRow
from prefpack.data.row_checks import (
    DOCUMENTS_FIELD,
    KWARGS_FIELD,
    TOOLS_FIELD,
    get_messages,
    get_str,
    parse_documents,
    parse_template_kwargs,
    parse_tools,
)
from prefpack.data.sources import file_sha256, iter_rows, resolve_inputs
from prefpack.data.store import FLAG_OPEN_PROMPT, Store
from prefpack.data.tokenize import ExampleTokenizer, TokenizeConfig
from prefpack.generation.engine import GenerationError
from prefpack.tokenizer import HASH_VERSION, load_tokenizer, special_tokens, tokenizer_hash, tokenizer_name

PROMPT_FIELDS = ("prompt", "messages")  # where a row's prompt is looked for when no field is named
# the samples' own keys (samples.SAMPLE_KEYS), which a source row's field of the same name cannot pass through as
RESERVED = ("prompt_ids", "completion_ids", "prompt", "completions", "truncated", "row", "messages",
            "logprobs")


@dataclass(frozen=True)
class Prompt:
    """One prompt: its row in the source (stores: its example, or its group in a ranked store), its token ids, the
    source's message list when it was one, and the source row's other fields, passed through to the samples."""

    row: int
    ids: tuple[int, ...]
    messages: list | None = None
    fields: dict = field(default_factory=dict)


class PromptSource:
    """Prompts in source order, with the tokenizer that made (or decodes) them and what the samples' meta records."""

    tok = None
    notes: list[str]
    only: frozenset[int] | None = None  # rows to read (a round's subset: generation.subsets); None = every row

    def __iter__(self) -> Iterator[Prompt]:
        raise NotImplementedError

    def count(self) -> int:
        """How many prompts the source holds, read without tokenising (the "N of M" of a stopped run's hint)."""
        raise NotImplementedError

    def rows(self) -> list[int]:
        """Every prompt's row, in source order (what a round's subset chooses from)."""
        return list(range(self.count()))

    def tokenizer_record(self) -> dict:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError

    def inputs(self) -> list[str]:
        """The files or folders the prompts are read from (what generate's output must not be)."""
        raise NotImplementedError

    def content_sha256(self) -> dict[str, str]:
        """Each input's content hash, by its path: the samples' meta records it (``prompts.sha256``), and a file is
        continued only while they are unchanged."""
        raise NotImplementedError

    def chat_template_record(self) -> dict | None:
        template = self.tok.chat_template
        if not template:
            return None
        text = "\n".join(str(t) for t in template.values()) if isinstance(template, dict) else str(template)
        return {"sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "source": str(self.tok.name_or_path)}


def tokenizer_record(tok, given) -> dict:
    """The tokenizer's identity as a store's meta.json records it (``meta["tokenizer"]``)."""
    return {"name": tokenizer_name(tok, given), "hash": tokenizer_hash(tok), "hash_version": HASH_VERSION,
            "has_chat_template": bool(tok.chat_template), **special_tokens(tok).to_json()}


class StorePrompts(PromptSource):
    """A store's distinct prompts, in store order: each pair's, each KTO example's, each ranked group's; a prompt
    several examples share is sampled once (the first such example's row; the repeats are counted in a note)."""

    def __init__(self, path: str, *, trust_remote_code: bool = False):
        self.store = Store(path)
        if self.store.num_images:
            raise GenerationError(f"store {path!r} holds images: generate samples text-only models for now")
        self.tok = load_tokenizer(self.store.tokenizer_path(), trust_remote_code=trust_remote_code)
        self.path, self.notes, self.repeats = path, [], 0

    def _prompts(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """(row, index.bin row of its source columns, prompt ids) of every example or group; not of a chat row whose
        stored prompt stops before the generation prompt (``FLAG_OPEN_PROMPT``: a reply scored turn by turn), which
        a sampler would continue without it (counted in ``open_prompts``)."""
        s = self.store
        flags = s.column("flags")
        self.open_prompts = 0
        if s.kind == "ranked":
            starts = s.group_starts()
            for g in range(len(starts) - 1):
                if self._open(flags, int(starts[g])):
                    continue
                yield g, int(starts[g]), s.ranked_group(g)[0]
        else:
            for i in range(len(s)):
                if self._open(flags, i):
                    continue
                yield i, i, (s.pair(i).prompt if s.kind == "pairs" else s.unpaired(i).prompt)

    def _open(self, flags, row: int) -> bool:
        is_open = bool(int(flags[row]) & FLAG_OPEN_PROMPT)
        self.open_prompts += is_open
        return is_open

    def __iter__(self) -> Iterator[Prompt]:
        seen: set[bytes] = set()
        sources = self.store.meta.get("sources") or []
        file_col, row_col = self.store.column("source_file"), self.store.column("source_row")
        self.repeats = 0
        for row, at, ids in self._prompts():
            key = hashlib.blake2b(np.asarray(ids).tobytes(), digest_size=16).digest()
            if key in seen:
                self.repeats += 1
                continue
            seen.add(key)
            f = int(file_col[at])
            origin = sources[f].get("path") if 0 <= f < len(sources) and isinstance(sources[f], dict) else None
            yield Prompt(row, tuple(int(t) for t in ids), None, {"source_file": origin, "source_row": int(row_col[at])})
        self.notes = []
        if self.repeats:
            self.notes.append(f"{self.repeats} examples repeat an earlier prompt of the store; each prompt was "
                              "sampled once (its first example's row)")
        if self.open_prompts:
            self.notes.append(f"{self.open_prompts} examples not sampled: their stored prompt stops before the "
                              "generation prompt (replies scored turn by turn, docs/data.md); sample from the source "
                              "rows instead")

    def count(self) -> int:
        return len(self.rows())

    def rows(self) -> list[int]:
        seen: set[bytes] = set()
        out = []
        for row, _, ids in self._prompts():
            key = hashlib.blake2b(np.asarray(ids).tobytes(), digest_size=16).digest()
            if key not in seen:
                seen.add(key)
                out.append(row)
        return out

    def tokenizer_record(self) -> dict:
        return self.store.meta["tokenizer"]

    def describe(self) -> dict:
        return {"store": str(self.path), "kind": self.store.kind, "examples": len(self.store)}

    def inputs(self) -> list[str]:
        return [str(self.path)]

    def content_sha256(self) -> dict[str, str]:
        """The hash of the store's files' own hashes (meta.json's ``files``: the tokens and the index), as score
        identifies a store; the folder's bytes where the meta lists none."""
        files = {name: info.get("sha256") for name, info in (self.store.meta.get("files") or {}).items()
                 if isinstance(info, dict)}
        if not files:
            return {str(self.path): file_sha256(str(self.path))}
        return {str(self.path): hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()}


class RowPrompts(PromptSource):
    """Rows holding a prompt (a string, tokenised as it is) or a message list (rendered through the chat template
    with the generation prompt), under ``field`` or the first of ``PROMPT_FIELDS`` a row has; numbered across the
    inputs in order. A row's own ``tools`` / ``documents`` / ``chat_template_kwargs`` apply as in prepare."""

    def __init__(self, inputs: list[str], tokenizer: str, *, field: str | None = None,
                 chat_template_kwargs: dict | None = None, tools: list | None = None,
                 trust_remote_code: bool = False):
        self.sources = resolve_inputs(inputs)
        self.tok = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code)
        self.tokenizer_given, self.field, self.notes = tokenizer, field, []
        self.kwargs, self.tools = dict(chat_template_kwargs or {}), tools
        cfg = TokenizeConfig(chat_template_kwargs=self.kwargs, tools=tools)
        self.encoder = ExampleTokenizer(self.tok, special_tokens(self.tok), cfg)

    def __iter__(self) -> Iterator[Prompt]:
        n, dropped = 0, set()
        for src in self.sources:
            for raw in iter_rows(src):
                if raw.row is None:
                    raise GenerationError(f"{raw.loc}: {raw.message}")
                if self.only is not None and n not in self.only:  # outside a round's subset: not tokenised
                    n += 1
                    continue
                try:
                    prompt = self._prompt(n, raw.row)
                except InvalidRow as err:
                    where = f", field {err.field!r}" if err.field else ""
                    raise GenerationError(f"{raw.loc}{where}: {err.message}") from None
                dropped |= set(raw.row) & set(RESERVED) - {self._field_of(raw.row)}
                yield prompt
                n += 1
        if dropped:
            self.notes = [f"input fields not passed through (the samples' own keys): {sorted(dropped)}"]

    def _field_of(self, row: dict) -> str:
        if self.field:
            return self.field
        found = next((f for f in PROMPT_FIELDS if f in row), None)
        if found is None:
            raise InvalidRow("missing_field", None, f"no prompt: the row has none of the fields "
                             f"{', '.join(map(repr, PROMPT_FIELDS))} (name it with --prompt-field); it has "
                             f"{sorted(row)}")
        return found

    def _prompt(self, n: int, row: dict) -> Prompt:
        name = self._field_of(row)
        for key, value in row.items():
            if str(key).lower() in VISION_FIELDS and value not in (None, [], ""):
                raise InvalidRow("vision_not_supported", key, f"field {key!r} holds images or video: generate "
                                 "samples text-only models for now")
        chat = isinstance(row.get(name), list)
        value = get_messages(row, name, allow_empty=True) if chat else get_str(row, name)
        ex = Example(value, (), chat=chat)
        tools = parse_tools(row.get(TOOLS_FIELD), TOOLS_FIELD)
        documents = parse_documents(row.get(DOCUMENTS_FIELD), DOCUMENTS_FIELD)
        kwargs = {k: v for k, v in parse_template_kwargs(row.get(KWARGS_FIELD), KWARGS_FIELD).items() if v is not None}
        if chat:
            ex.tools, ex.template_kwargs, ex.documents = tools, kwargs, documents
        elif tools or kwargs or documents:  # as prepare: they only reach the model through the chat template
            what = TOOLS_FIELD if tools else DOCUMENTS_FIELD if documents else KWARGS_FIELD
            raise InvalidRow("tools_without_chat", what, f"field {name!r} is a plain string, tokenised as it is: "
                             "tools, documents and chat_template_kwargs need a message list")
        ids = self.encoder.encode_prompt(ex)
        fields = {k: v for k, v in row.items() if k != name and k not in RESERVED}
        return Prompt(n, tuple(ids), value if chat else None, fields)

    def count(self) -> int:
        return sum(1 for src in self.sources for _ in iter_rows(src))

    def tokenizer_record(self) -> dict:
        return tokenizer_record(self.tok, self.tokenizer_given)

    def describe(self) -> dict:
        return {"inputs": [s.path for s in self.sources], "field": self.field,
                "chat_template_kwargs": self.kwargs or None, "tools": self.tools}

    def inputs(self) -> list[str]:
        return [s.path for s in self.sources]

    def content_sha256(self) -> dict[str, str]:
        return {s.path: file_sha256(s.path) for s in self.sources}
