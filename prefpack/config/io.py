"""Reading and writing configs: YAML files, ``key.sub=value`` overrides, type checks (an unknown key's suggestion:
``keys``).

Apart from the schema because it is a general engine over any dataclass tree: it knows types, not fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import types
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from prefpack.config.keys import UnknownKey, unknown_keys_error
from prefpack.config.keys import join_key as _join
from prefpack.config.keys import unknown_key as _unknown_key
from prefpack.config.schema import Config, ConfigError

# --------------------------------------------------------------------------------------------------------
# Parsing: keys and types
# --------------------------------------------------------------------------------------------------------

# Type rules, chosen so that a YAML file and a command-line override mean the same thing:
#
# * ints are accepted for floats, and so are numeric strings: PyYAML (YAML 1.1) reads ``1e-5`` (no dot) as
#   the string ``"1e-5"``, which would otherwise make ``optim.lr=1e-5`` an error;
# * bools must be real YAML bools (``true``/``false``), never ``0``/``1`` or ``"yes"`` in quotes;
# * ``X | None`` fields accept ``null``; ``Literal`` fields accept exactly their choices;
# * a section given as ``null`` (an empty ``lora:`` with everything commented out) means all defaults;
# * on the command line, a value for a string field that YAML reads as a number or date (``data.train=2024``)
#   is kept as the text that was typed.

_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _describe(tp: Any, plural: bool = False) -> str:
    """Human name of a type for error messages: 'a float', 'a list of strings', "one of 'a', 'b'"."""
    s = "s" if plural else ""
    if tp is type(None):
        return "null"
    if tp is bool:
        return f"bool{s} (true/false)" if plural else "a bool (true/false)"
    if tp is int:
        return f"int{s}" if plural else "an int"
    if tp is float:
        return f"float{s}" if plural else "a float"
    if tp is str:
        return f"string{s}" if plural else "a string"
    if is_dataclass(tp):
        return f"mapping{s}" if plural else "a mapping"
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return ("lists" if plural else "a list") + " of " + _describe(args[0], plural=True)
    if origin is tuple:
        return ("lists" if plural else "a list") + f" of {len(args)} " + _describe(args[0], plural=True)
    if origin is dict:
        return ("mappings" if plural else "a mapping") + " of " + _describe(args[0], plural=True) + " to " + \
            _describe(args[1], plural=True)
    if _is_union(tp):
        return " or ".join(_describe(a, plural) for a in args)
    return getattr(tp, "__name__", str(tp))


def _type_error(path: str, tp: Any, value: Any, extra: str = "") -> ConfigError:
    return ConfigError(f"{path}: expected {_describe(tp)}, got {_show(value)}{extra}")


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it converted (int->float, list->tuple...)."""
    if is_dataclass(tp):
        return _build(tp, value, path)
    origin, args = get_origin(tp), get_args(tp)
    if _is_union(tp):
        if value is None:
            if type(None) in args:
                return None
            raise _type_error(path, tp, value)
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:  # `X | None`: report X's own, more precise error (element paths, choices)
            try:
                return _convert(value, inner[0], path)
            except ConfigError as exc:
                if not str(exc).startswith(f"{path}: expected "):
                    raise
                raise _type_error(path, tp, value) from None
        for arg in inner:
            try:
                return _convert(value, arg, path)
            except ConfigError:
                if _container_of(value) is not None and _container_of(value) == get_origin(arg) and \
                        (get_origin(arg) is dict or any(is_dataclass(a) for a in get_args(arg))):
                    raise  # a list of sections (data.train's entries) or a mapping: its own, precise error
                continue
        raise _type_error(path, tp, value)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        hint = difflib.get_close_matches(value, [str(a) for a in args], n=1) if isinstance(value, str) else []
        raise _type_error(path, tp, value, f" (did you mean {hint[0]!r}?)" if hint else "")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(path, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(path, tp, value)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, str) and value.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity"):
            raise ConfigError(f"{path} must be a finite number, got {value!r}")
        raise _type_error(path, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        hint = " (quote it to make it a string)" if isinstance(value, int | float) else ""
        raise _type_error(path, tp, value, hint)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise _type_error(path, tp, value)
        return [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not value:
            raise _type_error(path, tp, value)
        return {_convert(k, args[0], f"{path} key"): _convert(v, args[1], f"{path}.{k}") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise _type_error(path, tp, value)
        return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is Any:
        return value
    raise TypeError(f"config annotation {tp!r} at {path} is not supported")  # a bug in this module


_HINTS: dict[type, dict[str, Any]] = {}


def _container_of(value: Any) -> Any:
    """``list`` or ``dict`` for a value of that shape (the origin of the annotation that takes it), else None."""
    return list if isinstance(value, list) else dict if isinstance(value, dict) else None


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _build(cls: type, data: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys, missing required keys and bad types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of keys to values, got {_show(data)}")
    names = [f.name for f in fields(cls)]
    for key in data:
        if key not in names:
            raise _unknown_key(key, path, names)
    hints = _hints(cls)
    kwargs = {}
    for f in fields(cls):
        sub = _join(path, f.name)
        if f.name in data:
            kwargs[f.name] = _convert(data[f.name], hints[f.name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{sub}: required key is missing")
    return cls(**kwargs)


def _unknowns(cls: type, data: Any, path: str, where: str) -> list[UnknownKey]:
    """Every key of ``data`` (and of its known sections, list entries included) that ``cls`` does not have, in
    order, so that one error can name them all; values are not checked here."""
    if not isinstance(data, dict):
        return []
    names = [f.name for f in fields(cls)]
    found = []
    for key, value in data.items():
        if key not in names:
            found.append(UnknownKey(key, path, names, value, where))
        else:
            found += _unknowns_in(_hints(cls)[key], value, _join(path, key), where)
    return found


def _unknowns_in(tp: Any, value: Any, path: str, where: str) -> list[UnknownKey]:
    """The unknown keys inside a value of annotation ``tp``: a section, or a list of sections (``loss.terms``,
    ``data.train``'s entries)."""
    if is_dataclass(tp):
        return _unknowns(tp, value, path, where)
    if isinstance(value, list):
        for arg in (tp, *get_args(tp)) if _is_union(tp) else (tp,):
            if get_origin(arg) is list and is_dataclass(get_args(arg)[0]):
                return [u for i, item in enumerate(value)
                        for u in _unknowns(get_args(arg)[0], item, f"{path}[{i}]", where)]
    return []


def _override_unknowns(key: str, value: Any, where: str) -> list[UnknownKey]:
    """The unknown keys an override names: its dotted key's first unknown part, or keys inside a mapping value."""
    tp: Any = Config
    walked = ""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not is_dataclass(tp):
            return []  # `a value, not a section`: _type_at's own error
        names = [f.name for f in fields(tp)]
        if part not in names:
            return [UnknownKey(part, walked, names, value if i == len(parts) - 1 else None, where)]
        tp = _hints(tp)[part]
        walked = _join(walked, part)
    return _unknowns_in(tp, value, key, where)


def config_from_dict(data: dict | None) -> Config:
    """Build a Config from plain data (missing keys take defaults); checks keys and types, not values."""
    found = _unknowns(Config, data, "", "in the config")
    if found:
        raise unknown_keys_error(found)
    return _build(Config, data, "")


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key.sub=value`` and parse the value as YAML; returns ``(dotted_key, value)``."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"override {text!r} must look like key.sub=value, e.g. optim.lr=1e-5")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({_one_line(exc)})") from None
    return key, value


def _one_line(exc: Exception) -> str:
    """PyYAML's multi-line message as 'problem at line L, column C'."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def _type_at(key: str) -> Any:
    """The annotation of dotted ``key``; unknown keys get the same message as in a file."""
    tp: Any = Config
    walked = ""
    for part in key.split("."):
        if not is_dataclass(tp):
            raise ConfigError(f"{walked!r} is a value, not a section, so {key!r} cannot be set; "
                              f"set the whole value instead ({walked}=...)")
        names = [f.name for f in fields(tp)]
        if part not in names:
            raise _unknown_key(part, walked, names)
        tp = _hints(tp)[part]
        walked = _join(walked, part)
    return tp


def _accepts_str(tp: Any) -> bool:
    return tp is str or (_is_union(tp) and str in get_args(tp))


def _set_path(data: dict, parts: list[str], value: Any) -> None:
    """Set ``data[a][b]... = value``, merging mappings into existing sections instead of replacing them."""
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    last = parts[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        for k, v in value.items():
            _set_path(node[last], [k], v)
    else:
        node[last] = value


def _read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {_one_line(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not a UTF-8 text file ({exc.reason})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (model:, data:, ...), "
                          f"got {_show(data)}")
    return data


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (``None`` = all defaults) and apply ``key.sub=value`` overrides in order.

    Checks keys and types; call ``cfg.validate()`` before training. Each error says whether it came from
    the file or from which override.
    """
    data: dict = {}
    found: list[UnknownKey] = []  # every unknown key of the file and the overrides, reported together
    if path is not None:
        data = _read_yaml(path)
        found += _unknowns(Config, data, "", f"in {path}")
    parsed = [(text, *parse_override(text)) for text in overrides or []]
    for text, key, value in parsed:
        found += _override_unknowns(key, value, f"in override {text!r}")
    if found:
        raise unknown_keys_error(found)
    if path is not None:
        try:
            _build(Config, data, "")
        except ConfigError as exc:
            raise ConfigError(f"{exc} (in {path})") from None
    for text, key, value in parsed:
        try:
            tp = _type_at(key)
            raw = text.partition("=")[2].strip()
            if _accepts_str(tp) and value is not None and not isinstance(value, str | bool | list | dict):
                value = raw  # e.g. data.train=2024 or run.output_dir=2024-01-01: the user typed a name
            _convert(value, tp, key)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (in override {text!r})") from None
        _set_path(data, key.split("."), value)
    return _build(Config, data, "")


# --------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def config_to_dict(cfg: Config) -> dict:
    """Plain dict/list/scalar form of ``cfg`` (tuples become lists), as written by ``save_config``."""
    return _plain(cfg)


def _flow(value: Any) -> str:
    """One-line YAML for a value; JSON (a YAML subset) when PyYAML would need several lines."""
    text = yaml.safe_dump(value, default_flow_style=True, width=2**31 - 1, allow_unicode=True, sort_keys=False)
    text = text.removesuffix("\n...\n").rstrip("\n")
    if "\n" in text:
        text = json.dumps(value, ensure_ascii=False)
    return text


CONFIG_HEADER = "# prefpack config (resolved: file + overrides + defaults)"  # the first line of a file prefpack wrote


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML text with each field's meaning as a trailing comment."""
    lines = [CONFIG_HEADER]
    for section_field in fields(Config):
        section = getattr(cfg, section_field.name)
        lines.append(f"{section_field.name}:")
        for f in fields(section):
            line = f"  {f.name}: {_flow(_plain(getattr(section, f.name)))}"
            help = f.metadata.get("help")
            lines.append(f"{line}  # {help}" if help else line)
    text = "\n".join(lines) + "\n"
    if yaml.safe_load(text) != config_to_dict(cfg):  # never write something that reads back differently
        text = CONFIG_HEADER + "\n" + yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)
    return text


def save_config(cfg: Config, path: str | os.PathLike) -> Path:
    """Write ``cfg`` as YAML (atomically); ``load_config(path, [])`` gives back an equal Config."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    tmp.write_text(dump_config(cfg), encoding="utf-8")
    os.replace(tmp, p)
    return p
