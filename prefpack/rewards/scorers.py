"""Scorers behind one small interface: ``Scorer.score(rows) -> list[list[float]]``, one float per completion, higher
is better. ``prefpack score`` and the on-policy rounds call only this.

- :class:`RewardFunctionScorer`: ``--reward-fn path/to/file.py:function``, user code (a verifier), imported only when
  that flag names it; called as ``function(prompt, completion)`` or, when it takes a third parameter,
  ``function(prompt, completion, row)`` with the input row (passthrough fields such as ``label`` included).
- ``reward_model.RewardModelScorer``: ``--reward-model FOLDER``, a sequence-classification model with one label.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import numbers
import sys
from pathlib import Path

from prefpack.errors import PrefpackError
from prefpack.rewards.rows import ScoreRow


class ScorerError(PrefpackError, ValueError):
    """A scorer that cannot be loaded, or that fails on (or returns no usable number for) a row."""


class Scorer:
    """Scores each completion of each row. ``identity()`` says what a resumed run must find again (the same code or
    weights), and is recorded in the output's meta.json."""

    name = "scorer"

    def identity(self) -> dict:
        raise NotImplementedError

    def score(self, rows: list[ScoreRow]) -> list[list[float]]:
        raise NotImplementedError


class RewardFunctionScorer(Scorer):
    """A Python function from a file, imported here and only here (the file is the user's own code)."""

    name = "reward_fn"

    def __init__(self, spec: str):
        path, sep, fn_name = spec.rpartition(":")
        if not sep or not path or not fn_name:
            raise ScorerError(f"--reward-fn {spec}: give it as path/to/file.py:function")
        self.spec, self.path, self.fn_name = spec, Path(path), fn_name
        if not self.path.is_file():
            raise ScorerError(f"--reward-fn {spec}: no such file {path!r}")
        self.fn = _load_function(self.path, fn_name, spec)
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):  # a builtin or C function: called with two arguments
            params = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.takes_row = len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)

    def identity(self) -> dict:
        sha = hashlib.sha256(self.path.read_bytes()).hexdigest()
        return {"scorer": self.name, "function": self.fn_name, "file": str(self.path), "sha256": sha}

    def score(self, rows: list[ScoreRow]) -> list[list[float]]:
        return [[self._one(r, k) for k in range(len(r.completions))] for r in rows]

    def _one(self, r: ScoreRow, k: int) -> float:
        where = f"--reward-fn {self.spec}: row {r.row}, completion {k}"
        try:
            args = (r.prompt, r.completions[k], r.fields) if self.takes_row else (r.prompt, r.completions[k])
            value = self.fn(*args)
        except Exception as exc:  # the user's code: any failure becomes one line naming the row
            raise ScorerError(f"{where}: the function raised {type(exc).__name__}: {_one_line(exc)}") from None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ScorerError(f"{where}: the function returned {type(value).__name__} {_short(value)}, not a number")
        value = float(value)
        if not math.isfinite(value):
            raise ScorerError(f"{where}: the function returned {value}, not a finite number")
        return value


def _load_function(path: Path, fn_name: str, spec: str):
    name = "prefpack_reward_fn_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ScorerError(f"--reward-fn {spec}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as exc:  # SyntaxError, ImportError, anything the file raises, even SystemExit
        sys.modules.pop(name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ScorerError(f"--reward-fn {spec}: importing {path} failed: {type(exc).__name__}: "
                          f"{_one_line(exc)}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        found = "not defined" if fn is None else f"a {type(fn).__name__}, not a function"
        raise ScorerError(f"--reward-fn {spec}: {fn_name!r} is {found} in {path}")
    return fn


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or "(no message)"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
