"""`prefpack prepare`: raw rows -> checked examples -> token ids -> a binary store.

Rows are read in order, cut into chunks, and the chunks are tokenised by a pool of worker processes
(each with its own tokenizer); at most a few chunks are in flight, so memory stays bounded whatever the
input size. Results come back in input order, so the first bad row reported is the first in the files. That
parallel part is ``chunks``; this module holds the options, the layout choice, the store and the report.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import prefpack
from prefpack.data.chunks import ordered_map, process_chunk, read_chunks
from prefpack.data.formats import (
    InvalidRow,
    detect_layout,
    parse_template_kwargs,
    parse_tools,
    ranked_fields,
    resolve_fields,
)
from prefpack.data.image_files import DEFAULT_MAX_IMAGE_BYTES, ImageSource
from prefpack.data.images import ProcessorError, load_vision, processor_identity
from prefpack.data.prepare_report import PrepareReport
from prefpack.data.prompt_repeats import PromptRepeats
from prefpack.data.renderer import renderer_versions
from prefpack.data.sources import Source, file_sha256, peek_first_row, resolve_inputs
from prefpack.data.store import StoreWriter, check_output, recover_interrupted
from prefpack.data.store_format import PROCESSOR_DIR
from prefpack.data.template_vars import template_reads
from prefpack.data.tokenize import TokenizeConfig
from prefpack.data.training_templates import ChatTemplateError, select_template, template_meta
from prefpack.data.truncation import DEFAULT_MIN_PROMPT_KEEP, TRUNCATION_POLICIES, TruncationStats
from prefpack.data.turns import TRAIN_ON
from prefpack.errors import PrefpackError
from prefpack.progress import Every
from prefpack.remote_code import check_processor_code
from prefpack.tokenizer import (
    HASH_VERSION,
    load_tokenizer,
    special_tokens,
    tokenizer_hash,
    tokenizer_name,
)


class PrepareError(PrefpackError, ValueError):
    """A user-facing failure of prepare (bad row without --skip-invalid, unreadable input...)."""


@dataclass
class PrepareOptions:
    inputs: list[str]
    tokenizer: str
    output: str
    layout: str | None = None  # None: detect from the first row
    fields: dict[str, str | None] = field(default_factory=dict)
    split: str | None = None
    max_length: int | None = None
    truncation: str = "prompt-left"  # or "drop", "trl-keep-start", "llamafactory" (truncation.py's rules)
    # prompt-left: a row whose prompt would keep less than this share of its tokens is refused (truncation.py)
    min_prompt_keep: float = DEFAULT_MIN_PROMPT_KEEP
    workers: int = 0  # 0: all cores
    skip_invalid: bool = False
    overwrite: bool = False
    allow_duplicate_inputs: bool = False  # store a file given twice (by name or glob) twice, on purpose
    chunk_rows: int = 1000
    trust_remote_code: bool = False  # run code the tokenizer or processor folder names (prefpack.remote_code)
    # template variables for every chat row (an object, or its JSON text); a row's own override them per key
    chat_template_kwargs: dict | str | None = None
    tools: str | list | None = None  # JSON file (or list) of tools for chat rows that have no `tools` of their own
    train_on: str | None = None  # chat replies: "assistant" (default), "last" or "all" (turns.TRAIN_ON)
    # a Jinja file chat rows are rendered with ("tokenizer": the tokenizer's own even where prefpack ships a
    # training template for it); None: a training template for a recognised template, else the tokenizer's own
    chat_template: str | None = None
    earlier_reasoning: str | None = None  # a training template's earlier turns' reasoning: dropped, kept, scored
    # a processor folder (image processor + tokenizer): vision rows are read, their images stored (docs/images.md)
    processor: str | None = None
    # image paths may lead inside the input file's folder or this folder, nowhere else (docs/images.md)
    image_root: str | None = None
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # the largest image file (or bytes value) read
    argv: list[str] = field(default_factory=list)


class PrepareWriteError(PrefpackError, OSError):
    """The store could not be written: a folder without write permission, or a full disk."""


def prepare(opts: PrepareOptions, log: Callable[[str], None] = print) -> PrepareReport:
    """Write the store of `opts`; a permission or full-disk failure becomes a `PrepareWriteError` naming the path
    and the fix, with no partial store left."""
    try:
        return _prepare(opts, log)
    except OSError as exc:
        if isinstance(exc, PrefpackError) or exc.errno not in WRITE_ERRNOS:
            raise
        raise PrepareWriteError(write_error_message(exc, opts.output)) from None


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def write_error_message(exc: OSError, output: str) -> str:
    where = exc.filename or output
    parent = os.path.dirname(os.path.abspath(output))
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"the disk is full (errno {exc.errno}: {exc.strerror}) while writing {where}; nothing was kept "
                f"(the partial store was removed). Free space on that disk, or choose an --output on another one")
    return (f"cannot write {where} ({exc.strerror}): prepare writes a temporary folder in {parent} and renames it "
            f"to {output}. Choose an --output in a folder you can write, or fix that folder's permissions")


def _prepare(opts: PrepareOptions, log: Callable[[str], None]) -> PrepareReport:
    t0 = time.perf_counter()
    if opts.max_length is not None and opts.max_length < 2:
        raise PrepareError("--max-length must be at least 2 (one prompt token and one completion token)")
    if not 0 <= opts.min_prompt_keep <= 1:
        raise PrepareError(f"--min-prompt-keep is a share of the prompt's tokens, from 0 (any cut) to 1 (no prompt "
                           f"cut), not {opts.min_prompt_keep:g}")
    if opts.truncation not in TRUNCATION_POLICIES:
        raise PrepareError(f"--truncation must be one of {', '.join(TRUNCATION_POLICIES)}, not {opts.truncation!r} "
                           "(TRL's keep_end is not offered: it cuts chosen and rejected's prompts apart, docs/data.md)")
    if opts.truncation != "prompt-left" and opts.max_length is not None \
            and opts.min_prompt_keep != DEFAULT_MIN_PROMPT_KEEP:
        log(f"note: --min-prompt-keep has no effect with --truncation {opts.truncation} (it bounds prompt-left's cut)")
    if opts.truncation != "prompt-left" and opts.max_length is None:
        log(f"note: --truncation {opts.truncation} has no effect without --max-length (nothing is cut)")
    sources = resolve_inputs(opts.inputs, allow_duplicates=opts.allow_duplicate_inputs)
    _check_inputs_outside(sources, opts.output)
    recover_interrupted(Path(opts.output), log=log)  # before the slow part: refuse a bad --output at once
    check_output(Path(opts.output), overwrite=opts.overwrite)
    if not opts.tokenizer:
        if not opts.processor:
            raise PrepareError("give --tokenizer (or --processor, a processor folder that holds the tokenizer)")
        opts.tokenizer = opts.processor
    if opts.processor:  # before its tokenizer loads: the processor's code is refused first, in one line
        check_processor_code(opts.processor, allowed=opts.trust_remote_code, what="--processor")
    tok = load_tokenizer(opts.tokenizer, trust_remote_code=opts.trust_remote_code)
    specials = special_tokens(tok)
    vision = None
    if opts.processor:
        try:
            vision = load_vision(opts.processor, tok, trust_remote_code=opts.trust_remote_code)
        except ProcessorError as err:
            raise PrepareError(str(err)) from None
    elif opts.image_root is not None or opts.max_image_bytes != DEFAULT_MAX_IMAGE_BYTES:
        log("note: --image-root and --max-image-bytes have no effect without --processor (no image is read)")
    layout, reason, field_names = _choose_layout(opts, sources)
    log(f"layout: {layout} ({reason})")
    template_kwargs, tools, tools_sha = _template_options(opts, layout)
    try:
        template = select_template(tok, opts.chat_template, opts.earlier_reasoning, layout, log)
    except ChatTemplateError as err:
        raise PrepareError(str(err)) from None
    unread = template_reads(tok.chat_template).unread(template_kwargs)
    if unread and tok.chat_template:
        raise PrepareError(f"--chat-template-kwargs: the chat template of {opts.tokenizer!r} never reads "
                           f"{', '.join(map(repr, unread))}, so setting it changes nothing; it reads "
                           f"{', '.join(sorted(template_reads(tok.chat_template).variables))}")
    if opts.train_on is not None and opts.train_on not in TRAIN_ON:
        raise PrepareError(f"--train-on must be one of {', '.join(TRAIN_ON)}, not {opts.train_on!r}")
    train_on = opts.train_on or "assistant"
    kind = {"unpaired": "unpaired", "kto-messages": "unpaired", "ranked": "ranked"}.get(layout, "pairs")
    fields = resolve_fields(layout, field_names)
    workers = opts.workers or os.cpu_count() or 1
    tcfg = TokenizeConfig(max_length=opts.max_length, truncation=opts.truncation, min_prompt_keep=opts.min_prompt_keep,
                          chat_template_kwargs=template_kwargs, tools=tools, train_on=train_on, vision=vision,
                          image_source=_image_source(opts), template=template,
                          earlier_reasoning=opts.earlier_reasoning)
    writer = StoreWriter(opts.output, kind=kind, vocab_size=specials.vocab_size, overwrite=opts.overwrite, log=log)
    skipped: Counter = Counter()
    empty: Counter = Counter()
    dropped: Counter = Counter()
    truncated: Counter = Counter()
    cuts = TruncationStats(policy=opts.truncation)
    chat: Counter = Counter()
    rows_per_file: Counter = Counter()
    nulls: Counter = Counter()  # null keys Arrow filled into messages, tool calls and tools, dropped
    repeats = PromptRepeats()
    unused: set = set()
    left_out: list[str] = []  # the first row whose chat template left reply text out, and what
    left_out_rows = 0
    skipped_fh = None
    try:
        init = (tok, opts.tokenizer, opts.trust_remote_code, layout, field_names, tcfg)
        chunks = read_chunks(sources, opts.split, opts.chunk_rows, rows_per_file, nulls)
        ticker = Every(30.0)  # a long prepare says how far it is, in a batch log too
        for res in ordered_map(process_chunk, chunks, workers, init):
            if ticker.due():
                log(f"prepare: {sum(rows_per_file.values()):,} rows read in {ticker.elapsed()}")
            for p in res.problems:
                if p["kind"] == "dropped":
                    dropped[p["reason"]] += 1
                    continue
                if not opts.skip_invalid:
                    field_txt = f", field {p['field']!r}" if p["field"] else ""
                    raise PrepareError(f"{p['where']}{field_txt}: {p['message']} [{p['reason']}]. Fix the row, or "
                                       "pass --skip-invalid to skip such rows (each is counted and written to "
                                       "skipped.jsonl beside the store).")
                skipped[p["reason"]] += 1
                if skipped_fh is None:
                    skipped_fh = open(writer.tmp / "skipped.jsonl", "w", encoding="utf-8")
                skipped_fh.write(json.dumps({**p["loc"], "reason": p["reason"], "field": p["field"],
                                             "message": p["message"], "data": p["content"]},
                                            ensure_ascii=True, default=_jsonable) + "\n")
            truncated.update(res.truncated)
            cuts.merge(res.cuts)
            empty.update(res.empty)
            chat.update(res.chat)
            unused |= res.unused
            left_out.extend(res.left_out[:1] if not left_out else [])
            left_out_rows += len(res.left_out)
            given = kind == "pairs" and res.margins is not None and bool((res.margins == res.margins).any())  # not NaN
            margins = res.margins if given else None  # a block without: the writer fills 0.0 once it has margins
            if res.segments is not None and len(res.segments):  # completions cut into segments (version 5)
                writer.append(res.tokens, res.index, res.spans, res.images, margins=margins, segments=res.segments)
            elif res.images or margins is not None:
                writer.append(res.tokens, res.index, res.spans, res.images, margins=margins)
            elif len(res.spans):
                writer.append(res.tokens, res.index, res.spans)
            else:  # the call of a store without spans, as before
                writer.append(res.tokens, res.index)
            if kind == "pairs":
                repeats.observe(res.tokens, res.index, res.images)
        if skipped_fh is not None:
            skipped_fh.close()
            skipped_fh = None
        tok.save_pretrained(writer.tmp / "tokenizer")
        if vision is not None:
            vision.processor.save_pretrained(writer.tmp / PROCESSOR_DIR)
        rows_read = sum(rows_per_file.values())
        meta = {
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "prefpack_version": prefpack.__version__,
            "layout": layout,
            "source_layout": layout,
            "fields": fields.to_json(),
            "train_on": train_on if chat["examples"] else None,  # which chat messages are scored (None: no chat rows)
            "tokenizer": {"name": tokenizer_name(tok, opts.tokenizer), "hash": tokenizer_hash(tok),
                          "hash_version": HASH_VERSION, "has_chat_template": bool(tok.chat_template), **specials.to_json()},
            # the chat template the rows were rendered with (not part of the hash: it does not change what ids mean)
            "counts": {"rows_read": rows_read, "examples": writer.n_rows, "skipped": dict(skipped),
                       "dropped": dict(dropped), "truncated": dict(truncated), "truncation": cuts.to_json(),
                       "empty_completions": dict(empty), "chat_examples": chat["examples"],
                       "examples_with_tools": chat["with_tools"], "examples_with_documents": chat["with_documents"],
                       "null_keys_dropped": dict(nulls),
                       "template_left_out": left_out_rows,
                       "prompts_at_first_difference": chat["prompt_at_difference"],
                       "rows_split_by_turns": chat["split_rows"],  # replies scored as several sequences
                       "sequences_added_by_turns": chat["split_sequences"],
                       "unread_template_kwargs": {k[7:]: n for k, n in chat.items() if k.startswith("unread:")},
                       **({"repeated_prompts": repeats.counts()} if kind == "pairs" else {})},
            "sources": [{"path": s.path, "kind": s.kind, "rows": rows_per_file[s.file_index],
                         "sha256": file_sha256(s.path)} for s in sources],
            "args": {"inputs": opts.inputs, "tokenizer": opts.tokenizer, "format": opts.layout,
                     "fields": opts.fields, "split": opts.split, "max_length": opts.max_length,
                     "truncation": opts.truncation, "min_prompt_keep": opts.min_prompt_keep,
                     "skip_invalid": opts.skip_invalid, "workers": workers,
                     "allow_duplicate_inputs": opts.allow_duplicate_inputs,
                     "chat_template_kwargs": template_kwargs or None,
                     "tools": opts.tools, "train_on": opts.train_on,
                     "tools_sha256": tools_sha, "chat_template": opts.chat_template,
                     "earlier_reasoning": opts.earlier_reasoning},
            "chat_template": template_meta(template, opts.earlier_reasoning) if chat["examples"] else None,
            # what rendered the chat rows through that template (another version may render the same rows otherwise)
            "renderer": renderer_versions() if chat["examples"] else None,
            "argv": opts.argv,
            "unused_columns": sorted(unused),
        }
        if vision is not None:
            meta["processor"] = processor_identity(vision, opts.processor, meta["tokenizer"]["hash"])
            meta["args"].update(processor=opts.processor, image_root=opts.image_root,
                                max_image_bytes=opts.max_image_bytes)
        if writer.n_rows == 0:
            raise PrepareError(f"no examples left to write from {rows_read} rows (skipped: {dict(skipped)}, "
                               f"dropped: {dict(dropped)}); nothing was written")
        if unused:  # never drop a column silently
            log(f"note: input columns not used: {', '.join(map(repr, sorted(unused)))} (layout {layout!r} reads "
                "only its own fields, tools, documents, chat_template_kwargs and the spans field)")
        if opts.train_on is not None and not chat["examples"]:
            log("note: --train-on had no effect: no row holds chat messages (text rows are masked by their "
                f"{fields.spans!r} column)")
        if layout == "alpaca" and not tok.chat_template:
            log("note: alpaca rows are stored as raw text: the tokenizer has no chat template, so each prompt is the "
                "instruction, a newline and the input, followed directly by the reply (no role markers, no "
                "separator); use a tokenizer with a chat template to have them rendered as chat")
        elif tok.chat_template and not chat["examples"]:
            log("note: the rows hold plain strings, tokenised as they are: the tokenizer's chat template is not "
                "applied (as TRL does for such rows); give message lists to have it render them")
        if (template_kwargs or tools is not None) and not chat["examples"]:
            log("note: --chat-template-kwargs / --tools had no effect: no row was rendered through the chat "
                "template (the rows hold plain strings)")
        if left_out_rows:
            log(f"warning: the chat template left text of {left_out_rows} rows' replies out of their rendering "
                f"(not trained on); first: {left_out[0]}")
        dated = _date_note(template, tok) if chat["examples"] else None
        if dated:
            log(dated)
        path = writer.commit(meta, overwrite=opts.overwrite)
    except BaseException:
        if skipped_fh is not None:
            skipped_fh.close()
        writer.abort()
        raise
    return PrepareReport(path, layout, reason, writer.n_rows, writer.n_tokens, rows_read, dict(skipped),
                         dict(dropped), dict(truncated), time.perf_counter() - t0, dict(empty), dict(chat),
                         writer.n_groups if kind == "ranked" else None, repeats.counts(), sorted(unused),
                         writer.n_spans, cuts.to_json(), opts.max_length, writer.n_images,
                         {"rows": left_out_rows, "first": left_out[0]} if left_out_rows else {}, dict(nulls),
                         margins=writer.n_margins, margin_field=fields.margin)


def _image_source(opts: PrepareOptions) -> ImageSource:
    """--image-root and --max-image-bytes, checked (they bound what a row's image paths may read)."""
    if opts.image_root is not None and not os.path.isdir(opts.image_root):
        raise PrepareError(f"--image-root {opts.image_root!r} is not a folder")
    if isinstance(opts.max_image_bytes, bool) or not isinstance(opts.max_image_bytes, int) or opts.max_image_bytes < 1:
        raise PrepareError(f"--max-image-bytes must be a positive number of bytes, not {opts.max_image_bytes!r}")
    return ImageSource(opts.image_root, opts.max_image_bytes)


def _jsonable(value):
    """skipped.jsonl's fallback: an image's bytes as their length (not their repr), anything else as text."""
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<{len(value)} bytes>"
    return str(value)


def _template_options(opts: PrepareOptions, layout: str) -> tuple[dict, list | None, str | None]:
    """Check --chat-template-kwargs and --tools; return the variables, the tools and the tools file's sha256."""
    kwargs = opts.chat_template_kwargs
    try:
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except json.JSONDecodeError as exc:
                raise PrepareError(f"--chat-template-kwargs must be a JSON object such as '{{\"enable_thinking\": "
                                   f"false}}'; {kwargs!r} is not JSON ({exc.msg} at column {exc.colno})") from None
        kwargs = parse_template_kwargs(kwargs, "--chat-template-kwargs")
    except InvalidRow as err:
        raise PrepareError(err.message.replace("field '--chat-template-kwargs'", "--chat-template-kwargs")) from None
    tools, sha = opts.tools, None
    if isinstance(tools, str):
        path = tools
        try:
            with open(path, encoding="utf-8") as fh:
                tools = json.load(fh)
        except OSError as exc:
            raise PrepareError(f"--tools {path!r}: cannot read it ({exc.strerror or exc})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PrepareError(f"--tools {path!r}: not a JSON file ({exc})") from None
        sha = file_sha256(path)
        if not isinstance(tools, list):
            raise PrepareError(f"--tools {path!r} must hold a JSON list of function definitions, got "
                               f"{type(tools).__name__}")
    try:
        tools = parse_tools(tools, "--tools")
    except InvalidRow as err:
        raise PrepareError(err.message.replace("field '--tools'", "--tools")) from None
    if (kwargs or tools is not None) and layout in ("pairs", "text-pairs"):
        raise PrepareError(f"--chat-template-kwargs and --tools apply to chat rows, but the layout {layout!r} holds "
                           "plain strings, which are tokenised as they are; give message lists instead")
    return kwargs, tools, sha


def _check_inputs_outside(sources: list[Source], output: str) -> None:
    """An input inside the output folder would be deleted by --overwrite (and read while replaced)."""
    out = os.path.realpath(output)
    for s in sources:
        real = os.path.realpath(s.path)
        if real == out or real.startswith(out + os.sep):
            raise PrepareError(f"input {s.path!r} is inside the output {output!r}, which prepare replaces; copy it "
                               "elsewhere first or choose another --output")


def _choose_layout(opts: PrepareOptions, sources: list[Source]) -> tuple[str, str, dict[str, str | None]]:
    """The layout (forced or detected from the first row), why, and the field names to read: the user's, plus a
    ranked layout's prompt and completions fields found in the first row (``instruction``, ``answers``...)."""
    if opts.layout and opts.layout != "ranked":
        return opts.layout, "forced with --format", dict(opts.fields)
    first = peek_first_row(sources, opts.split)
    if opts.layout:
        layout, why = opts.layout, "forced with --format"
    elif first is None:
        raise PrepareError(f"no readable row in {', '.join(s.path for s in sources)}: cannot detect the layout")
    else:
        try:
            layout, why = detect_layout(first[1], opts.fields)
        except InvalidRow as err:
            raise PrepareError(f"{first[0].path}: {err.message}") from None
        why = f"detected from the first row of {first[0].path}: {why}"
    fields = dict(opts.fields)
    found = ranked_fields(first[1], opts.fields) if layout == "ranked" and first is not None else None
    if found is not None:
        fields.update(prompt=found[0], completions=found[1])
        if opts.layout:
            why += f"; fields {found[0]!r}, {found[1]!r}"
    return layout, why, fields


def _date_note(template, tok) -> str | None:
    """A template that writes the day it renders (gpt-oss's "Current date:", SmolLM3's "Today Date:") makes the store
    depend on the day it was prepared: said in one line, naming the template's date function."""
    import datetime

    source = template.source if template is not None else tok.chat_template
    text = source if isinstance(source, str) else " ".join(map(str, (source or {}).values()))
    if "strftime_now" not in text:
        return None
    return (f"note: the chat template calls strftime_now, so the rendered rows hold the day they were prepared "
            f"({datetime.date.today().isoformat()}): the same rows prepared on another day give other tokens; for a "
            "fixed date, pass --chat-template FILE with the date written in")
