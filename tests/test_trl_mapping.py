"""docs/coming-from-trl.md's "Coming from TRL: DPOConfig key by key" table against TRL 1.16's DPOConfig and prefpack's own keys.

The TRL side is tests/data/trl_dpo_config_fields.json (written by benchmarks/trl_config_fields.py with TRL
installed), so this test needs neither TRL nor the network: every field there has exactly one row, every config
key the table names exists in `prefpack.config.Config` (and a `key: value` form is a value the config accepts),
every `prefpack SUBCOMMAND --flag` exists in the command line, and a row that maps to nothing says why.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from prefpack.config import Config, load_config

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "coming-from-trl.md"
FIELDS = REPO / "tests" / "data" / "trl_dpo_config_fields.json"
HEADING = "# Coming from TRL: DPOConfig key by key"
NONE = "—"

_KEY = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+)(?:\s*[:=]\s*(.+))?$")  # section.key, section.key: value / =value
_FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def split_cells(line: str) -> list[str]:
    """The cells of a markdown table row; a `|` inside backticks does not split."""
    cells, cur, code = [], [], False
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") else body
    for ch in body:
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    cells.append("".join(cur).strip())
    return cells


def section_lines(text: str) -> list[str]:
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == HEADING]
    assert len(starts) == 1, f"{PAGE.name} must have exactly one {HEADING!r} heading, found {len(starts)}"
    out = []
    for line in lines[starts[0] + 1:]:
        if line.startswith("## "):
            break
        out.append(line)
    return out


def table_rows(text: str) -> list[tuple[str, str, str]]:
    """(TRL field, prefpack cell, notes) of every body row of the section's tables."""
    rows = []
    for line in section_lines(text):
        if not line.lstrip().startswith("|"):
            continue
        cells = split_cells(line)
        if all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
            continue  # the separator row
        if cells[0].startswith("TRL 1.16 DPOConfig"):
            assert cells[1:] == ["prefpack", "notes"], f"table header {cells}"
            continue
        assert len(cells) == 3, f"row must have 3 cells (TRL field, prefpack, notes): {line!r}"
        m = re.fullmatch(r"`([A-Za-z_][A-Za-z0-9_]*)`", cells[0])
        assert m, f"first cell must be one TRL field name in backticks: {line!r}"
        rows.append((m.group(1), cells[1], cells[2]))
    return rows


def config_keys() -> dict[str, object]:
    """Every dotted leaf key of the config tree, with its default (walks the dataclass instances)."""
    out: dict[str, object] = {}

    def walk(node: object, prefix: str) -> None:
        for f in fields(node):
            value = getattr(node, f.name)
            path = f"{prefix}.{f.name}" if prefix else f.name
            if is_dataclass(value) and not isinstance(value, type):
                walk(value, path)
            else:
                out[path] = value

    walk(Config(), "")
    return out


def cli_options() -> dict[str, set[str]]:
    """Subcommand -> its option strings, from the parser `prefpack --help` prints."""
    from prefpack.cli import build_parser

    parser = build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subs) == 1
    return {name: {s for act in sub._actions for s in act.option_strings} for name, sub in subs[0].choices.items()}


def problems_in(cell: str, keys: dict, options: dict[str, set[str]], sections: set[str]) -> tuple[list[str], int]:
    """What in the backticked spans of `cell` names no prefpack key or flag; and how many spans were checked."""
    bad, checked = [], 0
    for span in re.findall(r"`([^`]+)`", cell):
        span = span.strip()
        if span.startswith("prefpack "):
            checked += 1
            words = span.split()
            sub = words[1]
            if sub not in options:
                bad.append(f"`{span}`: no subcommand {sub!r}")
                continue
            bad += [f"`{span}`: `prefpack {sub}` has no {flag}" for flag in _FLAG.findall(span)
                    if flag not in options[sub]]
            continue
        flags = _FLAG.findall(span)
        if flags:
            checked += 1
            everywhere = set().union(*options.values())
            bad += [f"`{span}`: no subcommand has {flag}" for flag in flags if flag not in everywhere]
            continue
        m = _KEY.match(span)
        if not m or m.group(1).split(".")[0] not in sections:
            continue  # not a config key (a TRL value, a file, a loss name...)
        checked += 1
        key, value = m.group(1), m.group(2)
        if key not in keys:
            bad.append(f"`{span}`: no config key {key!r}")
        elif value is not None:
            try:
                load_config(None, [f"{key}={value.strip()}"])
            except ValueError as exc:
                bad.append(f"`{span}`: the config refuses it ({exc})")
    return bad, checked


@pytest.fixture(scope="module")
def trl_fields() -> dict:
    doc = json.loads(FIELDS.read_text(encoding="utf-8"))
    assert doc["header"]["trl_version"] == "1.16.0", doc["header"]
    assert doc["header"]["command"].startswith("python benchmarks/trl_config_fields.py")
    assert doc["fields"] and list(doc["fields"]) == sorted(doc["fields"])
    return doc["fields"]


@pytest.fixture(scope="module")
def rows() -> list[tuple[str, str, str]]:
    return table_rows(PAGE.read_text(encoding="utf-8"))


def test_every_trl_field_has_exactly_one_row(trl_fields, rows):
    names = [r[0] for r in rows]
    missing = sorted(set(trl_fields) - set(names))
    extra = sorted(set(names) - set(trl_fields))
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not missing, f"TRL DPOConfig fields with no row in {PAGE.name}'s table: {missing}"
    assert not extra, f"rows for fields not in {FIELDS.name}: {extra}"
    assert not twice, f"fields with more than one row: {twice}"


def test_named_keys_and_flags_exist(rows):
    keys, options = config_keys(), cli_options()
    sections = {f.name for f in fields(Config)}
    bad = []
    for name, ours, notes in rows:
        found, checked = problems_in(ours, keys, options, sections)
        bad += [f"{name}: {p}" for p in found]
        if ours != NONE and not checked:
            bad.append(f"{name}: the prefpack cell {ours!r} names no config key or `prefpack` flag (or use {NONE})")
        bad += [f"{name} (notes): {p}" for p in problems_in(notes, keys, options, sections)[0]]
    assert not bad, f"{PAGE.name}'s TRL table names what prefpack does not have:\n" + "\n".join(bad)


def test_rows_that_map_to_nothing_say_why(rows):
    bare = [name for name, ours, notes in rows if ours == NONE and not notes.strip()]
    assert not bare, f"rows whose prefpack column is {NONE} need a note saying why: {bare}"
    empty = [name for name, ours, _ in rows if not ours.strip()]
    assert not empty, f"rows with an empty prefpack cell (write {NONE} and why): {empty}"


def test_checker_catches_a_wrong_key_a_wrong_flag_and_a_missing_row(trl_fields, rows):
    keys, options = config_keys(), cli_options()
    sections = {f.name for f in fields(Config)}
    assert problems_in("`loss.betaa`", keys, options, sections)[0]
    assert problems_in("`reference.mode: precomputd`", keys, options, sections)[0]
    assert problems_in("`prefpack prepare --max-lenght`", keys, options, sections)[0]
    assert problems_in("`prefpack precompute --model`", keys, options, sections)[0]
    assert problems_in("`--no-such-flag`", keys, options, sections)[0]
    assert problems_in("`loss.beta`, `prefpack train --resume`, `train.device: cpu`", keys, options,
                       sections) == ([], 3)
    text = PAGE.read_text(encoding="utf-8")
    first = next(line for line in section_lines(text) if line.startswith("| `"))
    assert len(table_rows(text.replace(first + "\n", "", 1))) == len(rows) - 1


def test_a_trl_key_in_a_config_suggests_the_row_s_key(rows):
    """A TRL name typed into a prefpack config is answered with the key the table maps it to."""
    from prefpack.config import ConfigError

    checked, wrong = 0, []
    for trl, prefpack, _ in rows:
        trl_key = trl.strip("`")
        keys = [m.group(1) for m in (_KEY.match(c.strip()) for c in re.findall(r"`([^`]+)`", prefpack)) if m]
        if not keys or trl_key in {k.rsplit(".", 1)[-1] for k in keys}:
            continue  # the same name (a valid key) or no config key in the row
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{trl_key}=1"])
        # `NAME (TRL) -> section.key: value` (prefpack.config.foreign), else a spelling's `did you mean 'key'`
        hint = re.search(r"\(TRL[^)]*\) -> ([a-z_]+\.[a-z_.]+)", str(err.value)) or \
            re.search(r"did you mean '([^']+)'", str(err.value))
        if not (hint and hint.group(1) in keys):
            wrong.append(f"{trl_key}: {hint.group(1) if hint else 'no suggestion'} (the table says {keys})")
        checked += 1
    assert not wrong, "\n".join(wrong)
    assert checked >= 15
