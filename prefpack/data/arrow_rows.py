"""Arrow batches (a Parquet file's, a `save_to_disk` folder's) as plain Python rows, without `datasets`' decoding.

Read raw so that every row reaches prepare's per-row checks as a JSON row does: an ``Image`` feature stays its
``{"bytes", "path"}`` struct (decoding it would raise on one bad image, or fetch a URL path, while reading), and a
``Sequence`` of structs stays a list of objects.

Arrow gives every struct of a column the union of the keys of all its rows, the missing ones null. Inside tool
calls and tool schemas that is wrong, not merely noisy: a function's ``parameters.properties`` would list other
tools' parameters (as null) and a call's ``arguments`` other calls' arguments. So the null keys are dropped there,
at any depth: in the ``tools`` column and in each message's ``tool_calls``. (A JSON row keeps its nulls: there they
were written on purpose.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

TOOLS_COLUMN = "tools"  # as row_checks.TOOLS_FIELD (TRL's name)


def plain_rows(batches: Iterable) -> Iterator[dict]:
    """The rows of `batches` (pyarrow RecordBatches or Tables) in order, each a dict of plain values."""
    for batch in batches:
        for row in batch.to_pylist():
            yield drop_unified_nulls(row)


def drop_unified_nulls(row: dict) -> dict:
    """`row` with null keys dropped inside its `tools` column and its messages' `tool_calls`."""
    out = {}
    for key, value in row.items():
        if key == TOOLS_COLUMN and isinstance(value, list):
            value = [_without_nulls(tool) for tool in value]
        else:
            value = _clean_calls(value)
        out[key] = value
    return out


def _clean_calls(value: Any) -> Any:
    """Messages anywhere in a value (a list of them, ranked completions holding them) with their tool calls
    cleaned."""
    if isinstance(value, list):
        return [_clean_calls(v) for v in value]
    if isinstance(value, dict):
        if "role" in value and isinstance(value.get("tool_calls"), list):
            return {**value, "tool_calls": [_without_nulls(call) for call in value["tool_calls"]]}
        return {k: _clean_calls(v) for k, v in value.items()}
    return value


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
