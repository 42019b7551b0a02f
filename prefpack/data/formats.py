"""One raw row of a detected layout turned into a checked, text-level example (:func:`extract`, :class:`Example`). The
layouts, their field names and their detection are in ``layouts``; their names are importable from here too.

Chat rows may also carry, as TRL's conversational datasets do, a `tools` column (a list of JSON-schema function
definitions) and a `chat_template_kwargs` column (an object of extra template variables such as
`enable_thinking`); both are passed to the chat template when the row is rendered. Assistant messages may
carry `tool_calls` (then their `content` may be null or absent) and prompts may hold `tool` messages; messages
reach the template unchanged.

The checks of one field (types, Unicode, messages, the chat columns) and ``InvalidRow`` are in ``row_checks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefpack.data.foreign_layouts import canonical_row
from prefpack.data.image_files import refuse_url
from prefpack.data.layouts import (
    ASSISTANT_MARKER_FAMILIES,
    ASSISTANT_MARKERS,
    FIELD_HELP,
    FOREIGN_PROMPT_FIELDS,
    IMAGES_FIELD,
    LAYOUTS,
    PAIR_LAYOUTS,
    RANKED_COMPLETIONS_FIELDS,
    RANKED_PROMPT_FIELDS,
    RANKED_RANK_KEY,
    RANKED_RANK_LIST,
    RANKED_SCORE_KEYS,
    RANKED_SCORE_LISTS,
    RANKED_TEXT_KEYS,
    RLAIFV_IMAGE,
    RLAIFV_QUESTION,
    VISION_FIELDS,
    VISION_LAYOUTS,
    Fields,
    detect_layout,
    ranked_fields,
    resolve_fields,
    used_fields,
    whole_conversation,
)
from prefpack.data.row_checks import (
    DOCUMENTS_FIELD,
    KWARGS_FIELD,
    TOOLS_FIELD,
    VISION_MESSAGE,
    InvalidRow,
    content_text,
    count_image_parts,
    get_label,
    get_margin,
    get_messages,
    get_str,
    json_type,
    parse_documents,
    parse_template_kwargs,
    parse_tools,
    require,
)
from prefpack.data.text_spans import PAIR_KEYS, read_text_spans

__all__ = [
    "ASSISTANT_MARKERS",
    "ASSISTANT_MARKER_FAMILIES",
    "Example",
    "FIELD_HELP",
    "Fields",
    "IMAGES_FIELD",
    "InvalidRow",
    "LAYOUTS",
    "RANKED_COMPLETIONS_FIELDS",
    "RANKED_PROMPT_FIELDS",
    "RANKED_RANK_KEY",
    "RANKED_RANK_LIST",
    "RANKED_SCORE_KEYS",
    "RANKED_SCORE_LISTS",
    "RANKED_TEXT_KEYS",
    "RLAIFV_IMAGE",
    "RLAIFV_QUESTION",
    "VISION_FIELDS",
    "VISION_LAYOUTS",
    "detect_layout",
    "extract",
    "implicit_prompt",
    "parse_template_kwargs",
    "parse_tools",
    "ranked_fields",
    "resolve_fields",
    "used_fields",
]


@dataclass
class Example:
    """A checked example before tokenisation.

    For chat rows `prompt` is a message list and `completions` are assistant message lists; otherwise all
    are strings. Paired examples have two completions (chosen, rejected), unpaired ones one and a label.
    """

    prompt: Any
    completions: tuple[Any, ...]
    chat: bool
    label: int | None = None
    completion_fields: tuple[str, ...] = field(default_factory=tuple)
    scores: tuple[float, ...] | None = None  # ranked rows: one per completion, higher is better
    tools: list[dict] | None = None  # the row's own `tools` (None: not given)
    documents: list[dict] | None = None  # the row's own `documents` (RAG rows; None: not given)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # the row's own `chat_template_kwargs`
    # text rows with `loss_masking_spans`: per completion, the character ranges that are not scored (None: none)
    unscored: tuple[list[tuple[int, int]] | None, ...] | None = None
    unscored_fields: tuple[str, ...] = ()  # where they came from, named when they leave nothing scored
    images: tuple[Any, ...] = ()  # vision rows: the prompt's images in order, as given (path, bytes, dict)
    images_field: str | None = None  # where they came from
    image_dir: str | None = None  # the input file's folder, where relative image paths are read from
    prompt_at_difference: bool = False  # implicit text rows with no chat marker: prompt cut where the replies differ
    margin: float | None = None  # pair rows: the reward model's target margin (the optional ``margin`` field)

    def empty_fields(self) -> tuple[str, ...]:
        """Completions that are empty or only whitespace: kept (they become their whitespace and EOS, as in
        TRL), and counted so the summary can say so."""
        return tuple(name for c, name in zip(self.completions, self.completion_fields) if _is_empty(c))


def _is_empty(value: Any) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return not any(content_text(m.get("content")).strip() or m.get("tool_calls") for m in value)


def extract(row: dict, layout: str, f: Fields, *, vision: bool = False, chat_template: bool = True) -> Example:
    """Check one row's fields and types and return its example, or raise InvalidRow. With `vision` (prepare
    --processor) TRL's image rows (pairs, unpaired and ranked message prompts with an images column) and RLAIF-V's
    are read; without it any image or video column is refused. LLaMA-Factory's layouts are read as the layout they
    stand for (``foreign_layouts``); `chat_template`: the tokenizer has one (else alpaca rows stay raw text). A pair
    row's optional margin is read too."""
    ex = _extract_checked(row, layout, f, vision=vision, chat_template=chat_template)
    if layout in PAIR_LAYOUTS:
        ex.margin = get_margin(row, f.margin)
    return ex


def _extract_checked(row: dict, layout: str, f: Fields, *, vision: bool, chat_template: bool) -> Example:
    if layout in FOREIGN_PROMPT_FIELDS:
        row, layout, f = canonical_row(row, layout, f, chat=chat_template)
    if vision and layout in ("messages", "rlaif-v"):
        return _extract_vision(row, layout, f)
    if vision and layout in ("unpaired", "ranked") and (isinstance(row.get(f.prompt), list)
                                                        or row.get(IMAGES_FIELD) not in (None, [], "")):
        return _extract_vision(row, layout, f)
    for key, value in row.items():
        if str(key).lower() in VISION_FIELDS and value not in (None, [], ""):
            why = (f"with --processor, images are read for the {', '.join(VISION_LAYOUTS)} layouts only, not "
                   f"{layout!r}") if vision else VISION_MESSAGE
            raise InvalidRow("vision_not_supported", key, f"field {key!r} holds images or video: {why}")
    if layout == "rlaif-v":
        raise InvalidRow("vision_not_supported", RLAIFV_IMAGE, f"the rlaif-v layout holds images: {VISION_MESSAGE}")
    ex = _extract(row, layout, f)
    spans = row.get(f.spans)
    if spans is not None:
        if ex.chat:
            raise InvalidRow("spans_on_chat", f.spans, f"field {f.spans!r} gives character spans, but this row's "
                             "replies are message lists: chat replies are masked by prepare --train-on")
        if layout not in ("pairs", "text-pairs", "unpaired"):
            raise InvalidRow("spans_unsupported", f.spans, f"field {f.spans!r} is read for pairs, text-pairs and "
                             f"unpaired text rows, not the {layout!r} layout")
        ex.unscored = read_text_spans(spans, f.spans, ex.completions, paired=layout != "unpaired")
        ex.unscored_fields = tuple(f"{f.spans}.{k}" for k in PAIR_KEYS) if layout != "unpaired" else (f.spans,)
    tools = parse_tools(row.get(TOOLS_FIELD), TOOLS_FIELD)
    documents = parse_documents(row.get(DOCUMENTS_FIELD), DOCUMENTS_FIELD)
    kwargs = parse_template_kwargs(row.get(KWARGS_FIELD), KWARGS_FIELD)
    # A key set to null counts as unset: Parquet and `datasets` fill the keys other rows have with null.
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if not ex.chat:
        for name, value in ((TOOLS_FIELD, tools), (DOCUMENTS_FIELD, documents), (KWARGS_FIELD, kwargs)):
            if value:
                raise InvalidRow("tools_without_chat", name, f"field {name!r} is set but this row's prompt and "
                                 "replies are plain strings, tokenised as they are; tools, documents and "
                                 "chat_template_kwargs only reach the model through the chat template: give them as "
                                 "message lists")
        return ex
    ex.tools = tools
    ex.documents = documents
    ex.template_kwargs = kwargs
    return ex


def _extract_vision(row: dict, layout: str, f: Fields) -> Example:
    """A vision row (TRL's messages with an images column, its unpaired and ranked rows with a message prompt, or
    RLAIF-V's): a chat example with its prompt's images; the number of {"type": "image"} parts in the prompt must
    equal the number of images, and replies hold text only."""
    for key in ("videos", "video", "pixel_values"):
        if row.get(key) not in (None, [], ""):
            raise InvalidRow("vision_not_supported", key, f"field {key!r}: video and preprocessed pixels are not "
                             "supported; give encoded images")
    if row.get(f.spans) is not None:
        raise InvalidRow("spans_on_chat", f.spans, f"field {f.spans!r} gives character spans, but vision rows are "
                         "chat rows: their replies are masked by prepare --train-on")
    if layout == "rlaif-v":
        image = require(row, RLAIFV_IMAGE)
        question = get_str(row, RLAIFV_QUESTION)
        chosen, rejected = get_str(row, f.chosen), get_str(row, f.rejected)
        _check_distinct(chosen, rejected, f)
        _refuse_urls((image,), RLAIFV_IMAGE)
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        replies = tuple([{"role": "assistant", "content": c}] for c in (chosen, rejected))
        return Example(prompt, replies, chat=True, completion_fields=(f.chosen, f.rejected), images=(image,),
                       images_field=RLAIFV_IMAGE)
    if row.get(RLAIFV_IMAGE) not in (None, [], ""):
        raise InvalidRow("vision_not_supported", RLAIFV_IMAGE, f"field {RLAIFV_IMAGE!r}: message rows take their "
                         f"images from an {IMAGES_FIELD!r} list (TRL's layout)")
    if not isinstance(require(row, f.prompt), list) and row.get(IMAGES_FIELD) not in (None, [], ""):
        raise InvalidRow("vision_not_supported", IMAGES_FIELD, f"field {IMAGES_FIELD!r} holds images but the prompt "
                         f"{f.prompt!r} is a plain string: images are placed by {{'type': 'image'}} parts of a "
                         "message-list prompt (TRL's layout)")
    if layout == "ranked":
        ex = _extract_ranked(row, f, vision=True)
    elif layout == "unpaired":
        label = get_label(row, f.label)
        prompt = get_messages(row, f.prompt, allow_empty=True, parts="image")
        completion = get_messages(row, f.completion, as_reply=True, parts="text")
        ex = Example(prompt, (completion,), chat=True, label=label, completion_fields=(f.completion,))
    else:
        prompt = get_messages(row, f.prompt, allow_empty=True, parts="image")
        chosen = get_messages(row, f.chosen, as_reply=True, parts="text")
        rejected = get_messages(row, f.rejected, as_reply=True, parts="text")
        _check_distinct(chosen, rejected, f)
        ex = Example(prompt, (chosen, rejected), chat=True, completion_fields=(f.chosen, f.rejected))
    images = row.get(IMAGES_FIELD)
    if images is None:
        images = []
    if not isinstance(images, list | tuple):
        raise InvalidRow("wrong_type", IMAGES_FIELD, f"field {IMAGES_FIELD!r} must be a list of images, got "
                         f"{json_type(images)}")
    parts = count_image_parts(ex.prompt)
    if parts != len(images):
        raise InvalidRow("image_count_mismatch", IMAGES_FIELD, f"field {IMAGES_FIELD!r} holds {len(images)} "
                         f"image(s) but the prompt {f.prompt!r} has {parts} {{'type': 'image'}} part(s); they must "
                         "match one to one, in order")
    _refuse_urls(images, IMAGES_FIELD)
    ex.images, ex.images_field = tuple(images), IMAGES_FIELD
    ex.tools = parse_tools(row.get(TOOLS_FIELD), TOOLS_FIELD)
    ex.documents = parse_documents(row.get(DOCUMENTS_FIELD), DOCUMENTS_FIELD)
    kwargs = parse_template_kwargs(row.get(KWARGS_FIELD), KWARGS_FIELD)
    ex.template_kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return ex


def _refuse_urls(images: Any, name: str) -> None:
    """An image given as a URL (a path with a scheme, and no bytes: a hub dataset's ``Image`` feature can hold one)
    is a bad row at extraction, before any reader could be asked to fetch it."""
    for k, image in enumerate(images):
        path = image.get("path") if isinstance(image, dict) and image.get("bytes") is None else image
        refuse_url(path, name, f"field {name!r}: image {k}")


def _extract(row: dict, layout: str, f: Fields) -> Example:
    if layout in ("pairs", "text-pairs"):
        prompt = get_str(row, f.prompt)
        for name in (f.chosen, f.rejected):
            if whole_conversation(row.get(name)):
                raise InvalidRow("wrong_type", name, f"field {name!r} is a whole conversation (a message list opening "
                                 f"with a user turn) but {f.prompt!r} is a string: read the row with --format implicit "
                                 f"(the prompt is the conversations' shared prefix; {f.prompt!r} is not read), or give "
                                 f"{f.prompt!r} as a message list and {name!r} as the reply alone")
        chosen = get_str(row, f.chosen)
        rejected = get_str(row, f.rejected)
        _check_distinct(chosen, rejected, f)
        return Example(prompt, (chosen, rejected), chat=False, completion_fields=(f.chosen, f.rejected))
    if layout == "messages":
        prompt = get_messages(row, f.prompt, allow_empty=True)
        chosen = get_messages(row, f.chosen, as_reply=True)
        rejected = get_messages(row, f.rejected, as_reply=True)
        _check_distinct(chosen, rejected, f)
        return Example(prompt, (chosen, rejected), chat=True, completion_fields=(f.chosen, f.rejected))
    if layout == "implicit":
        return _extract_implicit(row, f)
    if layout == "unpaired":
        label = get_label(row, f.label)
        value = require(row, f.prompt)
        if isinstance(value, list):
            prompt = get_messages(row, f.prompt, allow_empty=True)
            completion = get_messages(row, f.completion, as_reply=True)
            return Example(prompt, (completion,), chat=True, label=label, completion_fields=(f.completion,))
        prompt = get_str(row, f.prompt)
        completion = get_str(row, f.completion)
        return Example(prompt, (completion,), chat=False, label=label, completion_fields=(f.completion,))
    if layout == "ranked":
        return _extract_ranked(row, f)
    raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def _check_distinct(chosen: Any, rejected: Any, f: Fields) -> None:
    if chosen == rejected:
        raise InvalidRow("identical_completions", f.rejected,
                         f"fields {f.chosen!r} and {f.rejected!r} are identical: the pair carries no preference")


def _extract_implicit(row: dict, f: Fields) -> Example:
    chosen_raw = require(row, f.chosen)
    if isinstance(chosen_raw, list):
        chosen = get_messages(row, f.chosen)
        rejected = get_messages(row, f.rejected)
        _check_distinct(chosen, rejected, f)
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        # The prompt ends before the first assistant message that differs.
        while n > 0 and chosen[n - 1]["role"] == "assistant":
            n -= 1
        prompt, c_reply, r_reply = chosen[:n], chosen[n:], rejected[n:]
        for reply, name in ((c_reply, f.chosen), (r_reply, f.rejected)):
            if not reply or reply[0]["role"] != "assistant":
                raise InvalidRow("no_shared_prompt", name, f"field {name!r}: after the shared prefix the "
                                 "conversation does not continue with an assistant message")
        return Example(prompt, (c_reply, r_reply), chat=True, completion_fields=(f.chosen, f.rejected))
    chosen = get_str(row, f.chosen)
    rejected = get_str(row, f.rejected)
    _check_distinct(chosen, rejected, f)
    prompt = implicit_prompt(chosen, rejected)
    at_difference = prompt is None
    if at_difference:  # no chat markers at all: TRL's rule (trl.data_utils.extract_prompt), counted in the summary
        prompt = first_difference_prompt(chosen, rejected)
    c_reply, r_reply = chosen[len(prompt):], rejected[len(prompt):]
    return Example(prompt, (c_reply, r_reply), chat=False, completion_fields=(f.chosen, f.rejected),
                   prompt_at_difference=at_difference)


def first_difference_prompt(chosen: str, rejected: str) -> str:
    """TRL's implicit prompt of two strings without chat markers: their common prefix, less a space it ends with
    (that space starts the replies: "The sky is" + " blue." / " green.")."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n > 0 and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n]


def implicit_prompt(chosen: str, rejected: str) -> str | None:
    """Longest common prefix of two conversations, cut back to just after the last assistant marker."""
    n = 0
    limit = min(len(chosen), len(rejected))
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    common = chosen[:n]
    best = -1
    for marker in ASSISTANT_MARKERS:
        pos = common.rfind(marker)
        if pos >= 0:
            best = max(best, pos + len(marker))
    return None if best < 0 else common[:best]


def _extract_ranked(row: dict, f: Fields, *, vision: bool = False) -> Example:
    """A prompt with several scored completions: at least two, distinct texts, a finite score (or rank) each. With
    `vision` a message prompt may hold image parts and replies text parts (the images are read by the caller)."""
    chat = isinstance(require(row, f.prompt), list)
    prompt = get_messages(row, f.prompt, allow_empty=True, parts="image" if vision else "") if chat else \
        get_str(row, f.prompt)
    items = require(row, f.completions)
    if not isinstance(items, list):
        raise InvalidRow("wrong_type", f.completions, f"field {f.completions!r} must be a list of completions, each "
                         f"{{\"text\": ..., \"score\": number}}, got {json_type(items)}")
    if len(items) < 2:
        raise InvalidRow("too_few_completions", f.completions, f"field {f.completions!r} holds {len(items)} "
                         "completion(s); a ranked row needs at least two to yield a pair")
    texts, scores, names = [], [], []
    parallel = _parallel_scores(row, f, items)
    for i, item in enumerate(items):
        name = f"{f.completions}[{i}]"
        if parallel is not None:
            key, wrapped = None, {name: item}
        elif isinstance(item, dict):
            key = next((k for k in RANKED_TEXT_KEYS if k in item), None)
            if key is None:
                raise InvalidRow("missing_field", name, f"field {name!r} has no text: give it under one of "
                                 f"{', '.join(repr(k) for k in RANKED_TEXT_KEYS)} (it has {sorted(item)})")
            wrapped = {f"{name}.{key}": item[key]}
        else:
            raise InvalidRow("wrong_type", name, f"field {name!r} must be an object such as {{\"text\": ..., "
                             f"\"score\": 8.5}}, or the row must give the scores as a list under one of "
                             f"{', '.join(repr(k) for k in (*RANKED_SCORE_LISTS, RANKED_RANK_LIST))}; got "
                             f"{json_type(item)}")
        text_name = name if key is None else f"{name}.{key}"
        if chat:
            texts.append(get_messages(wrapped, text_name, as_reply=True, parts="text" if vision else ""))
        else:
            texts.append(get_str(wrapped, text_name))
        scores.append(parallel[i] if parallel is not None else _ranked_score(item, name))
        names.append(name)
    for i in range(len(texts)):
        for j in range(i):
            if texts[i] == texts[j]:
                raise InvalidRow("identical_completions", names[i], f"fields {names[j]!r} and {names[i]!r} hold "
                                 "the same completion; a pair of them would carry no preference")
    return Example(prompt, tuple(texts), chat=chat, completion_fields=tuple(names), scores=tuple(scores))


def _parallel_scores(row: dict, f: Fields, items: list) -> list[float] | None:
    """Scores given beside a plain list of completions (``"completions": [...], "scores": [...]``, or ``"ranks"``,
    or the list ``--scores-field`` names), higher is better; None when the completions are objects carrying their
    own score."""
    if f.scores:
        require(row, f.scores)
    elif all(isinstance(item, dict) and not {"role", "content"} <= set(item) for item in items):
        return None
    key = f.scores or next((k for k in (*RANKED_SCORE_LISTS, RANKED_RANK_LIST) if k in row), None)
    if key is None:
        return None  # each item is then checked (and named) on its own
    values = row[key]
    if not isinstance(values, list) or len(values) != len(items):
        raise InvalidRow("wrong_type", key, f"field {key!r} must be a list of {len(items)} numbers, one per entry of "
                         f"{f.completions!r}, got {json_type(values) if not isinstance(values, list) else len(values)}")
    return [_finite_number(v, f"{key}[{i}]", negate=key == RANKED_RANK_LIST and not f.scores)
            for i, v in enumerate(values)]


def _finite_number(value: Any, name: str, *, negate: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value in (
            float("inf"), float("-inf")):
        raise InvalidRow("wrong_type", name, f"field {name!r} must be a finite number, got {value!r}")
    return -float(value) if negate else float(value)


def _ranked_score(item: dict, name: str) -> float:
    """Higher is better: the score as given, or minus the rank (rank 1 is the best)."""
    key = next((k for k in RANKED_SCORE_KEYS if k in item), None)
    rank = key is None and RANKED_RANK_KEY in item
    key = RANKED_RANK_KEY if rank else key
    if key is None:
        raise InvalidRow("missing_field", name, f"field {name!r} has no score: give one under "
                         f"{', '.join(repr(k) for k in RANKED_SCORE_KEYS)} (higher is better) or a {RANKED_RANK_KEY!r} "
                         "(1 is best)")
    return _finite_number(item[key], f"{name}.{key}", negate=rank)
