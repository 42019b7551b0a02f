"""One field of a raw row, read and checked: present and not null, of its JSON type, valid Unicode; message lists
as a chat template takes them; a KTO label; and the chat columns a row may carry (``tools``,
``chat_template_kwargs``, ``documents``). Every refusal is an ``InvalidRow`` that names the field.

Apart from ``formats`` (which layout a row has, and which fields make its example) because these checks are the
same whatever the layout; ``formats`` re-exports ``InvalidRow`` and the two chat-column parsers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from prefpack.errors import PrefpackError


class InvalidRow(PrefpackError, ValueError):
    """A row that cannot become an example; `reason` is a stable code used to count skips."""

    def __init__(self, reason: str, field_name: str | None, message: str):
        super().__init__(message)
        self.reason = reason
        self.field = field_name
        self.message = message


VISION_MESSAGE = ("vision-language data is not supported yet without `prepare --processor DIR` (a Qwen2-VL or LLaVA "
                  "processor folder, docs/images.md): prefpack would drop the images; remove the column (or the image "
                  "parts) only if training on the text alone is intended")

# Per-row columns read for chat rows (TRL's names).
TOOLS_FIELD = "tools"
KWARGS_FIELD = "chat_template_kwargs"
DOCUMENTS_FIELD = "documents"  # RAG rows: passed as apply_chat_template's `documents` to a template that reads it
# apply_chat_template's own arguments: a template variable of one of these names cannot be passed through.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "add_generation_prompt", "continue_final_message", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens", "messages", "documents",
})


def _object_list(value: Any, name: str, things: str, listed: str, item: str) -> list[dict] | None:
    """A list of JSON objects, or a string holding one as JSON (how Parquet stores values whose schemas differ from
    row to row); None when absent or null. ``things``: what the list holds ("function definitions"); ``listed``: how
    the type error names it; ``item``: what an element must be (its name and an example)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRow("wrong_type", name, f"field {name!r} must be a list of {things} (JSON objects); got a "
                             f"string that is not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, list):
        raise InvalidRow("wrong_type", name, f"field {name!r} must be a list of {listed}, got {json_type(value)}")
    for i, element in enumerate(value):
        if not isinstance(element, dict):
            raise InvalidRow("wrong_type", name, f"field {name!r}: {item.format(i=i)}, got {json_type(element)}")
    return value


def parse_tools(value: Any, name: str) -> list[dict] | None:
    """A `tools` value: a list of function definitions (JSON objects), or a string holding one as JSON. None when
    absent or null."""
    return _object_list(value, name, "function definitions", "function definitions (JSON objects)",
                        "tool {i} must be a JSON object (a function definition such as "
                        "{{\"type\": \"function\", \"function\": {{...}}}})")


def parse_documents(value: Any, name: str) -> list[dict] | None:
    """A `documents` value (RAG rows): a list of JSON objects (such as ``{"title": ..., "text": ...}``, as
    ``apply_chat_template(documents=...)`` takes them), or a string holding one as JSON. None when absent or null."""
    return _object_list(value, name, "documents", "documents (JSON objects such as {\"title\": ..., \"text\": ...})",
                        "document {i} must be a JSON object (such as {{\"title\": ..., \"text\": ...}})")


def parse_template_kwargs(value: Any, name: str) -> dict[str, Any]:
    """A `chat_template_kwargs` value: an object of template variables, or a string holding one as JSON."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRow("wrong_type", name, f"field {name!r} must be a JSON object of template variables, "
                             f"e.g. {{\"enable_thinking\": false}}; got a string that is not JSON ({exc.msg} at "
                             f"column {exc.colno})") from None
    if not isinstance(value, dict):
        raise InvalidRow("wrong_type", name, f"field {name!r} must be a JSON object of template variables, e.g. "
                         f"{{\"enable_thinking\": false}}; got {json_type(value)}")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidRow("wrong_type", name, f"field {name!r}: key {key!r} is not a template variable name")
        if key in RESERVED_TEMPLATE_KWARGS:
            hint = {"tools": " (give tools in the 'tools' column or with --tools)",
                    "documents": " (give a row's documents in its 'documents' column)"}.get(key, "")
            raise InvalidRow("wrong_type", name, f"field {name!r}: key {key!r} is set by prepare itself, not a "
                             f"template variable{hint}")
    return dict(value)


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def require(row: dict, name: str) -> Any:
    if name not in row:
        raise InvalidRow("missing_field", name, f"missing field {name!r} (row has {sorted(row)})")
    value = row[name]
    if value is None:
        raise InvalidRow("missing_field", name, f"field {name!r} is null")
    return value


def _check_text(value: str, name: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRow("undecodable_text", name, f"field {name!r} holds text that is not valid Unicode "
                         f"({exc.reason} at character {exc.start})") from None


def get_str(row: dict, name: str) -> str:
    value = require(row, name)
    if not isinstance(value, str):
        raise InvalidRow("wrong_type", name, f"field {name!r} must be a string, got {type(value).__name__}")
    _check_text(value, name)
    return value


def _check_message(msg: Any, name: str, i: int, parts: str = "") -> dict:
    """Check one message; it is passed to the chat template unchanged (extra keys such as `tool_call_id`,
    `name` or `reasoning_content` included)."""
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise InvalidRow("wrong_type", name, f"field {name!r}: message {i} must be an object with string "
                         "'role' and 'content'")
    calls = msg.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise InvalidRow("wrong_type", name, f"field {name!r}: message {i}'s 'tool_calls' must be a list of "
                             "objects (each e.g. {'type': 'function', 'function': {'name': ..., 'arguments': "
                             "{...}}})")
        if calls and msg["role"] != "assistant":
            raise InvalidRow("wrong_type", name, f"field {name!r}: message {i} has 'tool_calls' but role "
                             f"{msg['role']!r}; only assistant messages call tools")
        for k, call in enumerate(calls):  # the function called: OpenAI's {"function": {"name": ...}}, or "name"
            function = call.get("function") if isinstance(call.get("function"), dict) else call
            called = function.get("name")
            if not isinstance(called, str) or not called.strip():
                what = "missing or null" if called is None else "empty" if isinstance(called, str) else \
                    json_type(called)
                raise InvalidRow("wrong_type", name, f"field {name!r}: message {i}'s tool call {k} names no function "
                                 f"(its name is {what}); a template would render it as an empty or 'None' call")
    content = msg.get("content")
    if parts and isinstance(content, list):  # --processor: content parts, text and (in prompts) images
        _check_parts(content, name, i, images=parts == "image")
        return msg
    if isinstance(content, list) and any(_is_media(part) for part in content):
        raise InvalidRow("vision_not_supported", name, f"field {name!r}: message {i} has an image or video content "
                         f"part: {VISION_MESSAGE}")
    if content is None and calls:
        return msg  # a pure tool call: no text
    if not isinstance(content, str):
        raise InvalidRow("wrong_type", name, f"field {name!r}: message {i} must be an object with string "
                         "'role' and 'content' (content may be null only beside 'tool_calls')")
    _check_text(content, name)
    return msg


def _check_parts(content: list, name: str, i: int, *, images: bool) -> None:
    """Content parts of a vision row's message: ``{"type": "text", "text": ...}`` and, in a prompt,
    ``{"type": "image"}`` (the row's images, in order); nothing else."""
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            _check_text(part["text"], name)
        elif kind == "image" and images:
            continue
        elif kind == "image" or _is_media(part):
            where = "a reply" if not images else "a prompt"
            raise InvalidRow("vision_not_supported", name, f"field {name!r}: message {i} has a {kind or 'media'!r} "
                             f"content part, which {where} cannot hold yet (only {{'type': 'image'}} parts in the "
                             "prompt, whose images come from the images column)")
        else:
            raise InvalidRow("wrong_type", name, f"field {name!r}: message {i}'s content parts must be "
                             "{'type': 'text', 'text': ...} or {'type': 'image'}")


def count_image_parts(messages: list[dict]) -> int:
    """How many ``{"type": "image"}`` parts the messages hold."""
    return sum(isinstance(m.get("content"), list) and sum(isinstance(p, dict) and p.get("type") == "image"
                                                          for p in m["content"]) for m in messages)


def content_text(content: Any) -> str:
    """A message's text: its content string, or its text parts joined."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content or ""


def _is_media(part: Any) -> bool:
    """A multimodal content part (OpenAI's image_url / input_image, TRL's and HF's {"type": "image"}, video, audio)."""
    if not isinstance(part, dict):
        return False
    kind = str(part.get("type", ""))
    return any(w in kind for w in ("image", "video", "audio")) or bool({"image", "image_url", "video"} & set(part))


def get_messages(row: dict, name: str, *, allow_empty: bool = False, as_reply: bool = False,
                 parts: str = "") -> list[dict]:
    """A message list; `parts` ("text", or "image" for a prompt) accepts content-part lists (prepare --processor)."""
    value = require(row, name)
    if as_reply and isinstance(value, dict):
        value = [value]
    if as_reply and isinstance(value, str):
        raise InvalidRow("wrong_type", name, f"field {name!r} is a string but the prompt is a message list; "
                         "give the reply as [{'role': 'assistant', 'content': ...}]")
    if not isinstance(value, list):
        raise InvalidRow("wrong_type", name, f"field {name!r} must be a list of messages, got {type(value).__name__}")
    msgs = [_check_message(m, name, i, parts) for i, m in enumerate(value)]
    if as_reply:
        if not msgs:
            raise InvalidRow("empty_completion", name, f"field {name!r} holds no reply message")
        if msgs[0]["role"] != "assistant":
            raise InvalidRow("wrong_type", name, f"field {name!r} must start with an assistant message, "
                             f"got role {msgs[0]['role']!r}")
    elif not allow_empty and not msgs:
        raise InvalidRow("missing_field", name, f"field {name!r} is an empty message list")
    return msgs


def check_no_image_token(row: dict, names: Iterable[str], token: str) -> None:
    """With ``prepare --processor``, the image token's own text (Qwen2-VL's ``<|image_pad|>``, LLaVA's ``<image>``)
    inside a row's text would tokenise to image tokens with no image behind them, and training would then find the
    store damaged: such a row is refused here, naming the field (`names`: the row's text columns)."""
    for name in sorted(n for n in names if isinstance(n, str)):
        if name in row and _holds(row[name], token):
            raise InvalidRow("image_token_in_text", name, f"field {name!r} holds the text {token!r}, the processor's "
                             "image placeholder; images are placed by {'type': 'image'} parts and the images column "
                             "only, so remove that text from the row")


def _holds(value: Any, token: str) -> bool:
    if isinstance(value, str):
        return token in value
    if isinstance(value, dict):
        return any(_holds(k, token) or _holds(v, token) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_holds(v, token) for v in value)
    return False


def get_label(row: dict, name: str) -> int:
    value = require(row, name)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value in (0, 1):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return int(value.strip().lower() == "true")
    raise InvalidRow("wrong_type", name, f"field {name!r} must be a boolean (true = desirable), got {value!r}")


def get_margin(row: dict, name: str) -> float | None:
    """A pair row's optional ``margin`` (TRL's reward-model column): a finite number, or None when the row has none
    (absent or null: Parquet fills the keys other rows have with null)."""
    value = row.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or \
            value in (float("inf"), float("-inf")):
        raise InvalidRow("wrong_type", name, f"field {name!r} must be a finite number (how much the chosen reward "
                         f"must beat the rejected one by), got {value!r}")
    return float(value)
