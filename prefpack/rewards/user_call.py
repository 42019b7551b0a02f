"""User code (a reward function, the import of its file) called so that it cannot take the run down with it: a call
is bounded by a timeout, cut off by SIGTERM or Ctrl-C, and whatever it raises, ``sys.exit`` included, is a
:class:`CallFailed` the caller names in one line.

On the main thread (where ``prefpack score`` and the rounds call a reward function) a call runs under
``signal.setitimer(ITIMER_REAL)``: when the limit passes, SIGALRM's handler raises inside the function, so a call
stuck in ``time.sleep`` or in a pure-Python loop is stopped. For the call's length SIGTERM and SIGINT go through a
handler that first runs the one installed before it (``StopSignal``'s flag, or Python's Ctrl-C) and then raises
inside the function: a stop signal cuts the call off (:class:`CallStopped`, a ``Terminated``) instead of waiting for
a call that may never return. What is raised inside the function is a ``BaseException``, so the function's own
``except Exception`` does not swallow it; and should the function swallow it anyway and return, the call still
counts as timed out or stopped. A function that swallows every ``BaseException`` in a loop is interrupted again
every second past its limit, and a second stop signal during one call ends the process by that signal, as it would
with no handler installed (every checkpoint already written is whole).

Limits: code stuck inside a C extension that never returns to Python (a catastrophic regular expression, a blocking
C call that retries on EINTR) is interrupted only once it returns: only ``kill -9`` ends it. On another thread
signals cannot be installed nor delivered: the call runs to its end, and a timeout is then checked after it returns
(a call longer than the limit fails, its value unused).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from prefpack.stop_signal import STOP_SIGNALS, Terminated

__all__ = ["DEFAULT_TIMEOUT", "CallFailed", "CallStopped", "call_contained", "one_line", "short_repr"]

DEFAULT_TIMEOUT = 60.0  # seconds a reward function's call may take (--reward-timeout, rounds.reward_timeout)
_AGAIN_S = 1.0  # a function that swallowed the timeout is interrupted again this often


class CallFailed(Exception):
    """The user's code failed: ``str()`` is what it did, as a phrase (``raised ZeroDivisionError: division by zero``,
    ``called sys.exit(0)``, ``did not return within 60 s``); ``raised``: the exception's ``Type: message`` when it
    raised one; ``timed_out``: it ran past the limit."""

    def __init__(self, what: str, raised: str | None = None, timed_out: bool = False):
        super().__init__(what)
        self.raised, self.timed_out = raised, timed_out


class CallStopped(Terminated):
    """SIGTERM or Ctrl-C arrived while the user's code ran: the call was cut off (``what`` says which call)."""


class _CutOff(BaseException):
    """Raised inside the user's function by the handlers below (not an ``Exception``: the function's own ``except
    Exception`` passes it on)."""


class _Guard:
    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self.inside = False
        self.timed_out = False
        self.signum = 0
        self.previous: dict[int, Any] = {}

    def on_alarm(self, _signum, _frame) -> None:
        if self.inside:
            self.timed_out = True
            signal.setitimer(signal.ITIMER_REAL, _AGAIN_S)  # again, should the function swallow this one
            raise _CutOff

    def on_stop(self, signum, frame) -> None:
        if self.inside and self.signum:  # a second one, and the function still runs (it swallowed the first):
            signal.signal(signum, signal.SIG_DFL)  # the process ends by this signal, as with no handler; what was
            signal.raise_signal(signum)  # checkpointed is whole (each file written to a temporary and renamed)
        if self.inside:
            self.signum = signum
        previous = self.previous.get(signum)
        if callable(previous):
            previous(signum, frame)  # StopSignal's flag (acted on by the caller); Python's Ctrl-C raises here
        if self.inside:
            raise _CutOff


def call_contained(fn: Callable[[], Any], timeout: float | None = DEFAULT_TIMEOUT) -> Any:
    """``fn()``'s value; :class:`CallFailed` when it raised, exited or ran past ``timeout`` seconds (None or 0: no
    limit); :class:`CallStopped` when a stop signal arrived meanwhile (a real Ctrl-C under Python's own handler is
    the ``KeyboardInterrupt`` it raises)."""
    timeout = timeout if timeout and timeout > 0 else None
    if threading.current_thread() is not threading.main_thread():
        return _on_a_thread(fn, timeout)
    guard = _Guard(timeout)
    for s in STOP_SIGNALS:  # only Python handlers are wrapped: under SIG_DFL the signal ends the process as ever
        current = signal.getsignal(s)
        if callable(current):
            guard.previous[s] = current
            signal.signal(s, guard.on_stop)
    alarm_handler, timer, t0 = None, (0.0, 0.0), time.monotonic()
    if timeout is not None:  # (a previous handler set outside Python reads as None: restored as SIG_DFL)
        alarm_handler = signal.signal(signal.SIGALRM, guard.on_alarm) or signal.SIG_DFL
        timer = signal.setitimer(signal.ITIMER_REAL, timeout)
    failure: CallFailed | None = None
    value = None
    try:
        try:
            guard.inside = True
            value = fn()
        finally:
            guard.inside = False
            _restore(guard, alarm_handler, timer, t0)
    except _CutOff:
        pass  # timed out or stopped: said below
    except KeyboardInterrupt:
        if guard.signum == signal.SIGINT:
            raise  # a real Ctrl-C, under Python's own handler
        failure = CallFailed("raised KeyboardInterrupt", "KeyboardInterrupt")
    except SystemExit as exc:
        failure = CallFailed(f"called sys.exit({short_repr(exc.code) if exc.code is not None else ''})")
    except BaseException as exc:  # the user's code: anything it raises is its failure
        raised = f"{type(exc).__name__}: {one_line(exc)}"
        failure = CallFailed(f"raised {raised}", raised)
    if guard.signum:
        raise CallStopped("cut off", guard.signum)
    if guard.timed_out:
        raise CallFailed(f"did not return within {timeout:g} s, and was stopped", timed_out=True)
    if failure is not None:
        raise failure
    return value


def _restore(guard: _Guard, alarm_handler, timer: tuple[float, float], t0: float) -> None:
    if alarm_handler is not None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm_handler)
        if timer[0] > 0:  # someone else's timer: re-armed with what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(timer[0] - (time.monotonic() - t0), 1e-3), timer[1])
    previous, guard.previous = guard.previous, {}
    for s, handler in previous.items():
        signal.signal(s, handler)


def _on_a_thread(fn: Callable[[], Any], timeout: float | None) -> Any:
    """Off the main thread nothing can interrupt the call: it runs to its end, and the limit is checked after."""
    t0 = time.monotonic()
    try:
        value = fn()
    except SystemExit as exc:
        raise CallFailed(f"called sys.exit({short_repr(exc.code) if exc.code is not None else ''})") from None
    except BaseException as exc:
        raised = f"{type(exc).__name__}: {one_line(exc)}"
        raise CallFailed(f"raised {raised}", raised) from None
    took = time.monotonic() - t0
    if timeout is not None and took > timeout:
        raise CallFailed(f"took {took:.1f} s, over the {timeout:g} s limit (on a thread other than the main one a "
                         "call cannot be cut off, only checked once it returns)", timed_out=True)
    return value


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, at most 300 characters (its ``str`` is the user's code: guarded)."""
    try:
        text = " ".join(str(exc).split())
    except Exception:
        text = ""
    return text[:300] or "(no message)"


def short_repr(value) -> str:
    """``repr(value)`` cut to 60 characters (a repr that raises, or an int too long to print: its type)."""
    try:
        text = repr(value)
    except Exception:  # sys.get_int_max_str_digits() limits an int's repr
        text = f"<{type(value).__name__} of {value.bit_length()} bits>" if isinstance(value, int) else \
            f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."
