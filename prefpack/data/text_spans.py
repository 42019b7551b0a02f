"""A text row's ``loss_masking_spans`` (Fast-LLM's name): character ranges ``[start, end)`` of a completion's text
that are not scored, read and checked. Pair rows give ``{"chosen": [[s, e], ...], "rejected": [...]}``, unpaired
rows a list. Apart from ``row_checks`` because only text rows have them; chat replies are masked by ``--train-on``.
"""

from __future__ import annotations

from typing import Any

from prefpack.data.row_checks import InvalidRow, json_type

PAIR_KEYS = ("chosen", "rejected")


def read_text_spans(value: Any, name: str, texts: tuple[str, ...], paired: bool) -> tuple[list | None, ...]:
    """Per completion (chosen, rejected; or the one completion) its checked unscored ranges, None for none."""
    if not paired:
        return (_ranges(value, name, texts[0]),)
    if not isinstance(value, dict) or set(value) - set(PAIR_KEYS):
        raise InvalidRow("wrong_type", name, f"field {name!r} must be an object {{\"chosen\": [[start, end], ...], "
                         f"\"rejected\": [...]}} (character ranges that are not scored), got "
                         f"{json_type(value) if not isinstance(value, dict) else 'keys ' + str(sorted(value))}")
    return tuple(_ranges(value.get(key), f"{name}.{key}", text) for key, text in zip(PAIR_KEYS, texts))


def _ranges(value: Any, name: str, text: str) -> list[tuple[int, int]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRow("wrong_type", name, f"field {name!r} must be a list of [start, end] character ranges, got "
                         f"{json_type(value)}")
    out: list[tuple[int, int]] = []
    for i, span in enumerate(value):
        if not (isinstance(span, list | tuple) and len(span) == 2 and
                all(isinstance(x, int) and not isinstance(x, bool) for x in span)):
            raise InvalidRow("wrong_type", name, f"field {name!r}: span {i} must be [start, end] (two integers), got "
                             f"{span!r}")
        start, end = int(span[0]), int(span[1])
        if not 0 <= start < end <= len(text):
            raise InvalidRow("span_out_of_range", name, f"field {name!r}: span {i} [{start}, {end}) is not a "
                             f"non-empty range inside the completion's {len(text)} characters")
        if out and start < out[-1][0]:
            raise InvalidRow("spans_unsorted", name, f"field {name!r}: span {i} [{start}, {end}) starts before span "
                             f"{i - 1} {list(out[-1])}; give the spans sorted by start")
        if out and start < out[-1][1]:
            raise InvalidRow("spans_overlap", name, f"field {name!r}: span {i} [{start}, {end}) overlaps span "
                             f"{i - 1} {list(out[-1])}")
        out.append((start, end))
    return out or None
