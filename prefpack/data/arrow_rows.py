"""Arrow batches (a Parquet file's, a `save_to_disk` folder's) as plain Python rows, without `datasets`' decoding.

Read raw so that every row reaches prepare's per-row checks as a JSON row does: an ``Image`` feature stays its
``{"bytes", "path"}`` struct (decoding it would raise on one bad image, or fetch a URL path, while reading), and a
``Sequence`` of structs stays a list of objects.

Arrow gives every struct of a column the union of the keys of all its rows, the missing ones null. Inside messages,
tool calls and tool schemas that is wrong, not merely noisy: a template reads ``'tool_calls' in message`` (Llama 3.1)
or prints a null ``content``, a function's ``parameters.properties`` would list other tools' parameters (as null) and
a call's ``arguments`` other calls' arguments (``{"city": "Paris", "query": null}``, scored). So the null keys are
dropped there, at any depth: in the ``tools`` and ``documents`` columns, in every message (a dict with a ``role``,
or ShareGPT's ``from``) with its tool calls, arguments and content parts, and they are counted (prepare's summary).
A null top-level column stays: it means the row has no such value. A JSON row keeps its nulls: there they were
written on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

TOOLS_COLUMN = "tools"  # as row_checks.TOOLS_FIELD (TRL's name)
DOCUMENTS_COLUMN = "documents"  # as row_checks.DOCUMENTS_FIELD (RAG rows' documents, objects as tools are)
MESSAGE_KEYS = ("role", "from")  # a dict holding one of these is a message (ShareGPT's messages have `from`)


def plain_rows(batches: Iterable) -> Iterator[tuple[dict, int]]:
    """The rows of `batches` (pyarrow RecordBatches or Tables) in order, each a dict of plain values, with the
    number of null keys dropped from it."""
    for batch in batches:
        for row in batch.to_pylist():
            yield drop_unified_nulls(row)


def drop_unified_nulls(row: dict) -> tuple[dict, int]:
    """`row` with null keys dropped inside its `tools` and `documents` columns and its messages, and how many were dropped."""
    dropped = [0]
    out = {}
    for key, value in row.items():
        if key in (TOOLS_COLUMN, DOCUMENTS_COLUMN) and isinstance(value, list):
            value = [_without_nulls(tool, dropped) for tool in value]
        else:
            value = _clean_messages(value, dropped)
        out[key] = value
    return out, dropped[0]


def _clean_messages(value: Any, dropped: list[int]) -> Any:
    """Messages anywhere in a value (a list of them, ranked completions or a single reply holding them) without
    their null keys."""
    if isinstance(value, list):
        return [_clean_messages(v, dropped) for v in value]
    if isinstance(value, dict):
        if any(isinstance(value.get(k), str) for k in MESSAGE_KEYS):
            return _without_nulls(value, dropped)
        return {k: _clean_messages(v, dropped) for k, v in value.items()}
    return value


def _without_nulls(value: Any, dropped: list[int]) -> Any:
    if isinstance(value, dict):
        dropped[0] += sum(v is None for v in value.values())
        return {k: _without_nulls(v, dropped) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v, dropped) for v in value]
    return value
