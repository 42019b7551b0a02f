"""LLaMA-Factory's layouts read directly, each turned into a row of one of prefpack's own layouts (``formats``).

- `sharegpt`: ``conversations``, a list of ``{"from", "value"}`` messages, with ``chosen`` and ``rejected`` each one
  such message (LLaMA-Factory's ``dpo_en_demo.json``); becomes a `messages` row.
- `kto-messages`: ``messages`` (role/content, or from/value) whose last message is the completion, and ``label``
  (LLaMA-Factory's ``kto_en_demo.json``); becomes an `unpaired` row.
- `alpaca`: ``instruction`` / ``input`` / ``chosen`` / ``rejected`` strings (LLaMA-Factory's alpaca preference rows,
  optional ``system`` and ``history``); becomes a `messages` row rendered through the chat template, or, for a
  tokenizer without one, a `pairs` row of raw text (prepare says so).

ShareGPT's role names are LLaMA-Factory's: human -> user, gpt -> assistant, system, observation -> tool, and
function_call -> an assistant message whose ``tool_calls`` are the call(s) its value holds as JSON. A ``system``
column becomes the first message; a ``tools`` column (JSON text or a list) is read as TRL's ``tools``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from prefpack.data.layouts import Fields
from prefpack.data.row_checks import InvalidRow, get_str, json_type, require

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "observation": "tool", "tool": "tool", "function_call": "assistant"}
SYSTEM_FIELD, INPUT_FIELD, HISTORY_FIELD = "system", "input", "history"


def to_messages(value: Any, name: str) -> list[dict]:
    """A ShareGPT message list (or one message) as role/content messages; role/content ones keep their other keys."""
    items = value if isinstance(value, list) else [value]
    out = []
    for i, msg in enumerate(items):
        if not isinstance(msg, dict):
            raise InvalidRow("wrong_type", name, f"field {name!r}: message {i} must be an object, got {json_type(msg)}")
        role, text = (msg.get("from"), msg.get("value")) if "from" in msg else (msg.get("role"), msg.get("content"))
        if role not in SHAREGPT_ROLES:
            raise InvalidRow("wrong_type", name, f"field {name!r}: message {i} has role {role!r}; ShareGPT roles are "
                             f"{', '.join(SHAREGPT_ROLES)}")
        if role == "function_call":
            out.append({"role": "assistant", "tool_calls": _calls(text, name, i)})
            continue
        rest = {} if "from" in msg else {k: v for k, v in msg.items() if k not in ("role", "content")}
        out.append({**rest, "role": SHAREGPT_ROLES[role], "content": text})
    return out


def _calls(text: Any, name: str, i: int) -> list[dict]:
    """A function_call message's value: JSON text of one call {"name", "arguments"} or a list of them."""
    try:
        calls = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as exc:
        raise InvalidRow("wrong_type", name, f"field {name!r}: message {i} (function_call) must hold a JSON call "
                         f"{{\"name\": ..., \"arguments\": {{...}}}}; {exc.msg} at column {exc.colno}") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise InvalidRow("wrong_type", name, f"field {name!r}: message {i} (function_call) must hold a call "
                         "{\"name\": ..., \"arguments\": {...}} or a list of them")
    return [{"type": "function", "function": {"name": c["name"], "arguments": _arguments(c.get("arguments"))}}
            for c in calls]


def _arguments(args: Any) -> Any:
    if isinstance(args, str):  # LLaMA-Factory writes them as an object; some data as JSON text
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return {} if args is None else args


def canonical_row(row: dict, layout: str, f: Fields, *, chat: bool) -> tuple[dict, str, Fields]:
    """`row` of a foreign `layout` as a row of prefpack's own layout, that layout's name and the fields to read it
    by (the row's own names, so errors name its columns). `chat`: the tokenizer has a chat template (alpaca rows are
    rendered through it, else kept as raw text)."""
    out = {k: v for k, v in row.items() if k not in (SYSTEM_FIELD, INPUT_FIELD, HISTORY_FIELD)}
    system = row.get(SYSTEM_FIELD)
    head = [{"role": "system", "content": get_str(row, SYSTEM_FIELD)}] if system not in (None, "") else []
    if layout == "alpaca":
        return _alpaca(row, out, f, head, chat=chat)
    messages = head + to_messages(require(row, f.prompt), f.prompt)
    if layout == "kto-messages":
        if not messages or messages[-1]["role"] != "assistant":
            raise InvalidRow("wrong_type", f.prompt, f"field {f.prompt!r}: its last message is the completion and "
                             "must be the assistant's")
        last = f"{f.prompt}[-1]"
        out[f.prompt], out[last] = messages[:-1], messages[-1:]
        return out, "unpaired", replace(f, completion=last)
    out[f.prompt] = messages
    for name in (f.chosen, f.rejected):
        out[name] = to_messages(require(row, name), name)
    return out, "messages", f


def _alpaca(row: dict, out: dict, f: Fields, head: list[dict], *, chat: bool) -> tuple[dict, str, Fields]:
    instruction = get_str(row, f.prompt)
    extra = row.get(INPUT_FIELD)
    query = instruction if extra in (None, "") else instruction + "\n" + get_str(row, INPUT_FIELD)
    turns = []
    for k, pair in enumerate(row.get(HISTORY_FIELD) or []):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise InvalidRow("wrong_type", HISTORY_FIELD, f"field {HISTORY_FIELD!r}: entry {k} must be a [query, "
                             "response] pair of strings")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    if not chat:
        if head or turns:
            raise InvalidRow("no_chat_template", SYSTEM_FIELD if head else HISTORY_FIELD, "this alpaca row has a "
                             "system prompt or a history, which only a chat template can lay out, and the tokenizer "
                             "has none; use a tokenizer with a chat template")
        out[f.prompt] = query
        return out, "pairs", f
    out[f.prompt] = head + turns + [{"role": "user", "content": query}]
    for name in (f.chosen, f.rejected):
        out[name] = [{"role": "assistant", "content": get_str(row, name)}]
    return out, "messages", f
