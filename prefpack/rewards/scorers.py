"""Scorers behind one small interface: ``Scorer.score(rows) -> list[list[float]]``, one float per completion, higher
is better. ``prefpack score`` and the on-policy rounds call only this.

- :class:`RewardFunctionScorer`: ``--reward-fn path/to/file.py:function``, user code (a verifier), imported only when
  that flag names it; called as ``function(prompt, completion)`` or, when it takes a third parameter,
  ``function(prompt, completion, row)`` with the input row (passthrough fields such as ``label`` included); each
  call contained by ``user_call``: bounded by ``timeout`` seconds, cut off by SIGTERM / Ctrl-C, its failures (an
  exception, ``sys.exit``, a value that is no finite float) one line naming the function, the row and the completion.
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
from prefpack.rewards.user_call import DEFAULT_TIMEOUT, CallFailed, CallStopped, call_contained, short_repr


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
    """A Python function from a file, imported here and only here (the file is the user's own code). ``timeout``:
    the seconds one call may take (None or 0: no limit); the import is not bounded (it may load a model), but a stop
    signal cuts it off too."""

    name = "reward_fn"

    def __init__(self, spec: str, timeout: float | None = DEFAULT_TIMEOUT):
        self.timeout = timeout
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
        args = (r.prompt, r.completions[k], r.fields) if self.takes_row else (r.prompt, r.completions[k])
        try:  # the value checked inside the call too: float() and repr() of a returned object are user code as well
            number, problem = call_contained(lambda: _finite_float(self.fn(*args)), self.timeout)
        except CallFailed as exc:
            limit = " (--reward-timeout, rounds.reward_timeout)" if exc.timed_out else ""
            raise ScorerError(f"{where}: the function {exc}{limit}") from None
        except CallStopped as stop:
            raise CallStopped(f"the reward function {self.spec} was cut off at row {r.row}, completion {k}",
                              stop.signum) from None
        if problem is not None:
            raise ScorerError(f"{where}: the function returned {problem}")
        return number


def _finite_float(value) -> tuple[float | None, str | None]:
    """A returned value as a float (a bool or an int in float range converted), or why it is refused."""
    if not isinstance(value, numbers.Real):
        return None, f"{type(value).__name__} {short_repr(value)}, not a number"
    try:
        number = float(value)
    except OverflowError:
        return None, f"{type(value).__name__} {short_repr(value)}, too large for a float"
    except Exception as exc:  # a Real whose __float__ fails
        return None, f"{type(value).__name__} {short_repr(value)}, which float() refused ({type(exc).__name__})"
    if not math.isfinite(number):
        return None, f"{number}, not a finite number"
    return number, None


def _load_function(path: Path, fn_name: str, spec: str):
    name = "prefpack_reward_fn_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ScorerError(f"--reward-fn {spec}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:  # SyntaxError, ImportError, anything the file raises, even SystemExit; not bounded in time (it may load a
        call_contained(lambda: module_spec.loader.exec_module(module), None)  # model), but a stop signal cuts it off
    except CallFailed as exc:
        sys.modules.pop(name, None)
        raise ScorerError(f"--reward-fn {spec}: importing {path} failed: {exc.raised or exc}") from None
    except CallStopped as stop:
        sys.modules.pop(name, None)
        raise CallStopped(f"importing the reward function's file {path} was cut off", stop.signum) from None
    except BaseException:
        sys.modules.pop(name, None)
        raise
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        found = "not defined" if fn is None else f"a {type(fn).__name__}, not a function"
        raise ScorerError(f"--reward-fn {spec}: {fn_name!r} is {found} in {path}")
    return fn
