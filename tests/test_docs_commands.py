"""Every prefpack command README.md and docs/*.md show parses with prefpack's own parser, and every `key.sub=value`
they show names a real config key with a value of its type.

Commands in code blocks (`prefpack ...`, `.venv/bin/prefpack ...`, `$P ...`, `torchrun ... -m prefpack ...`, backslash
lines joined, `$VAR` set in the block substituted, an unset one given a dummy path) are parsed whole, as `prefpack`
would; a train command's overrides are loaded onto its config file (when the repository has it) and validated.
A synopsis (`[--row I]`, `INPUT...`, `a | b`) and a command in an inline code span have only their options checked
against the subcommand's, and their overrides loaded one by one; every `section.key` code span must name a key.
The example configs' header comments are read as one code block each. Parsing only: nothing runs, so this costs well under
a second; the README's walkthroughs are run for real by tests/test_newcomer.py and `make demo`.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import fields
from pathlib import Path

import pytest

from prefpack.cli import build_parser, parse_command_line
from prefpack.config import Config, ConfigError, load_config
from prefpack.config.keys import _all_paths

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))  # their header comments show how each is run

_SECTIONS = {f.name for f in fields(Config)}
_OVERRIDE = re.compile(r"^([a-z_]+)(?:\.[a-z0-9_]+)+=")
_PROGRAM = r"(?:\S*/)?prefpack|\$P|\$\{P\}"
# a command line: optional VAR=value assignments, then prefpack itself or `torchrun|python ... -m prefpack`
_COMMAND = re.compile(rf"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:(?:{_PROGRAM})\s|(?:torchrun|\S*python3?)\s.*-m prefpack\s)")
_PRINTED = re.compile(rf"^(?:{_PROGRAM}) [a-z-]+: ")  # a message prefpack prints (`prefpack score: error: ...`)
_SYNOPSIS = re.compile(r"\[|\.\.\.|\s\|\s|\\\|")
_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def fenced_commands(text: str) -> list[tuple[int, str, dict]]:
    """(line number, command line, the block's variables so far) for each command in a fenced code block."""
    out, fenced, env, pending, start = [], False, {}, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\s*(```|~~~)", line):
            fenced, env, pending = not fenced, {}, ""
            continue
        if not fenced:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole, pending = (pending + line).strip(), ""
        assign = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)(?:\s+#.*)?", whole)
        if assign:
            env[assign.group(1)] = assign.group(2)
        elif _COMMAND.match(whole) and not _PRINTED.match(whole):
            out.append((start, whole, dict(env)))
    return out


def comment_commands(text: str) -> list[tuple[int, str, dict]]:
    """The commands of a YAML file's comments (`#   .venv/bin/prefpack train ...`), read as one fenced block."""
    lines = [re.sub(r"^#\s?", "", line) if line.startswith("#") else "" for line in text.splitlines()]
    return fenced_commands("\n".join(["```", *lines, "```"]))


def inline_spans(text: str) -> list[tuple[int, str]]:
    """(line number, span) for each inline code span outside fenced blocks that is a prefpack command or a run of
    `section.key=value` overrides."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for span in re.findall(r"`([^`]+)`", line):
            words = span.split()
            if _COMMAND.match(span + " ") or (words and all(_is_override(w) for w in words)):
                out.append((number, span))
    return out


# a dotted name in backticks that is no config key: a file (`lora.yaml`, `distributed.py`) or a module's function
_NOT_KEYS = re.compile(r".*\.(yaml|py|safetensors|json|jsonl|md)$|run\.build_engine$")  # generation/run.py's


def key_mentions(text: str) -> list[tuple[int, str]]:
    """(line number, key) for each `section.key` (or `section.key=value`, `section.key: value`) code span."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for key in re.findall(r"`([a-z_]+(?:\.[a-z0-9_]+)+)(?:[=:][^`]*)?`", line):
            if key.split(".")[0] in _SECTIONS and not _NOT_KEYS.match(key):
                out.append((number, key))
    return out


def _is_override(word: str) -> bool:
    m = _OVERRIDE.match(word)
    return bool(m) and m.group(1) in _SECTIONS


def prefpack_words(line: str, env: dict) -> list[str]:
    """The arguments after `prefpack` (comments dropped, variables substituted)."""
    words = shlex.split(line, comments=True)
    if "-m" in words and "prefpack" in words[words.index("-m"):]:
        words = words[words.index("-m") + 2:]
    else:
        while re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        words = words[1:]
    return [_VAR.sub(lambda m: env.get(m.group(1), f"/tmp/{m.group(1).lower()}"), w) for w in words]


def _subparsers() -> dict:
    parser = build_parser()
    action = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    return action.choices


def check_options(words: list[str], subparsers: dict) -> list[str]:
    """A partial command's problems: an unknown subcommand, an option its subcommand does not have."""
    if not words or words[0].startswith("-") or _is_override(words[0]) or words[0].isupper():  # `COMMAND --help`
        return []
    if words[0] not in subparsers:
        return [f"no subcommand {words[0]!r}"]
    known = set(subparsers[words[0]]._option_string_actions)
    found = []
    for word in words[1:]:
        for option in re.findall(r"(?:^|[\[(|])(--?[a-z][a-z0-9-]*)", word):
            if option not in known:
                found.append(f"{words[0]} has no option {option}")
    return found


def check_overrides(overrides: list[str]) -> list[str]:
    found = []
    for text in overrides:
        if not _is_override(text):
            continue
        key, value = text.split("=", 1)
        if re.fullmatch(r"[A-Z][A-Z0-9_]*", value):  # a placeholder value (N, MODEL_DIR): the key alone
            if key not in _all_paths():
                found.append(f"unknown key {key!r}")
            continue
        try:
            load_config(None, [text])
        except ConfigError as exc:
            found.append(str(exc))
    return found


def check_command(words: list[str]) -> list[str]:
    """A whole command's problems: what `prefpack` would refuse before running, and for train what its config (file
    + overrides) would refuse."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parse_command_line(words)
    except SystemExit:
        return [err.getvalue().strip().splitlines()[-1]]
    missing = [f"no such file {w.split(':')[0]} in the repository" for w in words
               if w.startswith("examples/") and not (REPO / w.split(":")[0]).exists()]
    if missing or args.command != "train":
        return missing
    config, overrides = args.config, list(args.overrides)
    if "=" in config:
        config, overrides = None, [config, *overrides]
    if config is not None and not (REPO / config).is_file():  # a placeholder (CONFIG.yaml): the keys alone
        return check_overrides(overrides)
    try:
        load_config(None if config is None else REPO / config, overrides).validate()
    except ConfigError as exc:
        return [str(exc)]
    return []


def problems(pages: list[Path]) -> tuple[list[str], int]:
    """Every problem as `page:line: command: what`, and how many commands were checked whole."""
    subparsers, found, whole = _subparsers(), [], 0
    for page in pages:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(REPO) if page.is_relative_to(REPO) else "/".join(page.parts[-2:])
        yaml = page.suffix == ".yaml"
        for number, line, env in comment_commands(text) if yaml else fenced_commands(text):
            try:
                words = prefpack_words(line, env)
            except ValueError as exc:
                found.append(f"{name}:{number}: {line}: {exc}")
                continue
            if _SYNOPSIS.search(line):
                issues = check_options(words, subparsers) + check_overrides(words)
            else:
                whole += 1
                issues = check_command(words)
            found += [f"{name}:{number}: {line}: {issue}" for issue in issues]
        for number, span in [] if yaml else inline_spans(text):
            words = span.split() if not _COMMAND.match(span + " ") else prefpack_words(span, {})
            issues = check_options(words, subparsers) + check_overrides(words)
            found += [f"{name}:{number}: `{span}`: {issue}" for issue in issues]
        paths = set(_all_paths())
        found += [f"{name}:{number}: `{key}`: no such config key" for number, key in key_mentions(text)
                  if key not in paths]
    return found, whole


def test_every_documented_command_parses_and_every_key_exists():
    found, whole = problems(PAGES + CONFIGS)
    assert not found, "\n".join(found)
    assert whole >= 35, whole  # the walkthroughs are seen: a changed fence or prompt style is not a silent pass


@pytest.mark.parametrize(("doc", "expected"), [
    ("```bash\n$P train examples/configs/dpo.yaml train.max_step=1\n```", "train.max_step"),
    ("```bash\nP=.venv/bin/prefpack\n$P eval --model M --data S --jsn\n```", "unrecognized arguments: --jsn"),
    ("```\nprefpack prepare a.jsonl --tokenizer T \\\n  --output o --truncation right\n```", "invalid choice: 'right'"),
    ("```\nprefpack train examples/configs/dpo.yaml train.max_steps=1 data.eval=null\n```", "run.eval_every"),
    ("```\nprefpack inspect DIR [--row I] [--rows]\n```", "inspect has no option --rows"),
    ("Run `prefpack precompute-ref --micro-batch-token` first.", "precompute-ref has no option --micro-batch-token"),
    ("Set `optim.lr=fast` there.", "optim.lr"),
    ("```\nprefpack train examples/configs/old.yaml\n```", "no such file examples/configs/old.yaml"),
    ("The key `run.eval_steps` sets it.", "`run.eval_steps`: no such config key"),
])
def test_a_stale_command_is_named(tmp_path, doc, expected):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(f"# A page\n\n{doc}\n")
    found, _ = problems([page])
    assert len(found) == 1 and expected in found[0] and found[0].startswith("docs/page.md:"), found
