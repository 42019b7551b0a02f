"""Progress for long commands, readable both on a terminal and in a batch job's log.

On a terminal, a tqdm bar. Off a terminal (stderr redirected to a file), a bar's carriage-return frames make one
endless line, so plain lines are written instead: one every ``every_s`` seconds, and one at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["Every", "clock", "is_terminal", "progress"]

T = TypeVar("T")


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def clock(seconds: float) -> str:
    """``HH:MM:SS`` for durations under a day, whole hours beyond."""
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 3600:.0f}h"


def progress(items: Iterable[T], *, total: int | None = None, desc: str, unit: str, enabled: bool = True,
             every_s: float = 30.0, stream=None) -> Iterator[T]:
    """``items`` with progress on ``stream`` (stderr): a bar on a terminal, otherwise a plain line every
    ``every_s`` seconds ("DESC: 120/480 UNITs, 4.1 UNIT/s, eta 00:01:27") and a last one when done."""
    stream = sys.stderr if stream is None else stream
    if not enabled:
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if is_terminal(stream):
        from tqdm import tqdm

        yield from tqdm(items, total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True)
        return
    t0 = last = time.monotonic()
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            print(_line(desc, unit, done, total, now - t0), file=stream, flush=True)
    print(_line(desc, unit, done, total, time.monotonic() - t0, finished=True), file=stream, flush=True)


def _line(desc: str, unit: str, done: int, total: int | None, elapsed: float, *, finished: bool = False) -> str:
    rate = done / elapsed if elapsed > 0 else 0.0
    count = f"{done}/{total}" if total is not None else str(done)
    plural = unit + ("es" if unit.endswith(("ch", "s", "x")) else "s")
    parts = [f"{desc}: {count} {plural}", f"{rate:.2f} {unit}/s"]
    if finished:
        parts.append(f"done in {clock(elapsed)}")
    elif total is not None and rate > 0:
        parts.append(f"eta {clock((total - done) / rate)}")
    return ", ".join(parts)


class Every:
    """True from :meth:`due` once every ``seconds`` (for a plain progress line where no total is known ahead)."""

    def __init__(self, seconds: float = 30.0):
        self.seconds = seconds
        self.start = self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True

    def elapsed(self) -> str:
        return clock(time.monotonic() - self.start)
