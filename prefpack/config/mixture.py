"""``data.train`` as a list of stores (a mixture) and ``data.eval`` as a map of stores, read into plain specs.

Torch-free: the config validates them, ``training.setup.build`` opens them. docs/mixtures.md has the semantics.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SourceSpec", "eval_sources", "mixture_problems", "mixture_warnings", "train_sources"]

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_RESERVED = {"loss", "rewards", "logps", "entropy", "count"}  # would read as a metric's own prefix


@dataclass(frozen=True)
class SourceSpec:
    """One training store: its name in the metrics, its folder, and a weight or a fixed count per epoch."""

    name: str
    path: str
    weight: float | None = None  # sampling proportion (None when ``pairs`` is given)
    pairs: int | None = None  # fixed examples per epoch


def _default_name(path: str) -> str:
    return Path(str(path).rstrip("/\\")).name or str(path)


def train_sources(train: Any) -> list[SourceSpec]:
    """``data.train`` as specs: a string is one store of weight 1; list entries keep their order."""
    if train is None:
        return []
    if isinstance(train, str):
        return [SourceSpec(_default_name(train), train, 1.0)]
    out = []
    for e in train:
        weight = e.weight if e.weight is not None or e.pairs is not None else 1.0
        out.append(SourceSpec(e.name or _default_name(e.path), e.path, weight, e.pairs))
    return out


def is_mixture(train: Any) -> bool:
    """Whether ``data.train`` was given as a list (even of one store)."""
    return isinstance(train, list)


def eval_sources(eval_: Any) -> dict[str, str]:
    """``data.eval`` as ``{name: path}``: a single store is named ``eval`` (its metrics stay ``eval/loss``)."""
    if eval_ is None:
        return {}
    if isinstance(eval_, str):
        return {"": eval_}
    return dict(eval_)


def mixture_problems(train: Any, eval_: Any) -> list[str]:
    """What is wrong with a ``data.train`` list or ``data.eval`` map, naming the entry and its field."""
    errs: list[str] = []
    if isinstance(train, list):
        if not train:
            errs.append("data.train is an empty list; give a store folder or at least one {path, weight} entry")
        seen: dict[str, int] = {}
        for i, (e, spec) in enumerate(zip(train, train_sources(train))):
            where = f"data.train[{i}]"
            if not e.path:
                errs.append(f"{where}.path must not be empty")
            if e.weight is not None and e.pairs is not None:
                errs.append(f"{where} gives both weight and pairs; give one (a proportion, or a count per epoch)")
            if e.weight is not None and not (math.isfinite(e.weight) and e.weight > 0):
                errs.append(f"{where}.weight must be a finite number > 0, got {e.weight}")
            if e.pairs is not None and e.pairs < 1:
                errs.append(f"{where}.pairs must be >= 1, got {e.pairs}")
            errs.extend(_name_problems(spec.name, f"{where}.name"))
            if spec.name in seen:
                errs.append(f"{where}: the name {spec.name!r} is also data.train[{seen[spec.name]}]'s; give each "
                            "entry its own name (two stores in folders of the same name need `name:`)")
            seen.setdefault(spec.name, i)
        stores: dict[str, int] = {}
        for i, e in enumerate(train):
            j = stores.setdefault(same_store_key(e.path), i) if e.path else i
            if j != i:
                errs.append(f"data.train[{i}] ({e.path!r}) is the same store as data.train[{j}] ({train[j].path!r}): "
                            "each entry draws its own examples, so every example would come twice per epoch. Give "
                            "the store one entry; to draw it more often, a larger weight (or pairs: N)")
    if isinstance(eval_, dict):
        for name, path in eval_.items():
            errs.extend(_name_problems(name, f"data.eval key {name!r}"))
            if not path:
                errs.append(f"data.eval.{name} must be a store folder, got an empty path")
    return errs


def mixture_warnings(eval_: Any) -> list[str]:
    """A ``data.eval`` map naming one store twice: evaluated twice, the same numbers under two names."""
    out: list[str] = []
    if isinstance(eval_, dict):
        seen: dict[str, str] = {}
        for name, path in eval_.items():
            first = seen.setdefault(same_store_key(path), name) if path else name
            if first != name:
                out.append(f"data.eval.{name} ({path!r}) is the same store as data.eval.{first} "
                           f"({eval_[first]!r}): it is evaluated twice, the same numbers under both names")
    return out


def same_store_key(path: str) -> str:
    """What makes two store paths one store: the same folder once links and relative parts are resolved."""
    return os.path.realpath(str(path))


def _name_problems(name: str, where: str) -> list[str]:
    if not _NAME.fullmatch(name):
        return [f"{where} {name!r} must be letters, digits, '_', '-' or '.' (it prefixes metric names: NAME/loss)"]
    if name in _RESERVED:
        return [f"{where} {name!r} is reserved (it would read as a metric's own prefix, as in {name}/...); give the "
                "entry another `name:`"]
    return []
