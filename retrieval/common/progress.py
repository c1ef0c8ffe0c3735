"""How far a long loop has got, with a rate and an ETA: a tqdm bar on a terminal, log lines elsewhere.

A loop that runs for minutes (batch recommendation of every user, and later indexing or
evaluation over a large catalogue) says how far it is::

    with Progress(total=len(users), what="recommend", unit="users") as progress:
        for block in blocks:
            ...
            progress.update(len(block))

On a terminal (``stream.isatty()``) this is a ``tqdm`` bar redrawn in place. Anywhere else
(a log file, CI, a pipe, a notebook's captured stderr) a bar's carriage returns make one
unreadable line, so it writes one line every ``interval`` seconds instead::

    recommend: 12,288 / 943,000 users (1.3%), 2,410 users/s, ETA 6m26s

and a last line when it closes (``recommend: 943,000 users in 6m31s, 2,412 users/s``). A loop
that is done before its first line is due writes nothing (nor does the bar appear before
``delay`` seconds), so a reporter costs nothing where the loop turns out short.

Foundation module: it imports nothing from the project, so every stage can use it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

DEFAULT_INTERVAL = 10.0  # seconds between lines when not on a terminal
DEFAULT_DELAY = 1.0  # seconds before a terminal's bar appears


class Progress:
    """A count of done units towards ``total``, reported as it grows.

    Args:
      total: the number of units the loop will do; None when unknown (no percentage, no ETA).
      what: the loop's name, the start of every line ("recommend").
      unit: what one unit is, plural ("users").
      stream: where to write (default ``sys.stderr``, read when the reporter is made).
      interval: seconds between lines when not on a terminal (default ``DEFAULT_INTERVAL``).
      delay: seconds before the bar appears on a terminal (default ``DEFAULT_DELAY``).
      terminal: a tqdm bar (True) or lines (False); default: whether ``stream`` is a terminal.
      clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        total: int | None,
        what: str,
        unit: str = "items",
        *,
        stream: TextIO | None = None,
        interval: float | None = None,
        delay: float = DEFAULT_DELAY,
        terminal: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if total is not None and total < 0:
            raise ValueError(f"total must be a non-negative count or None, got {total}")
        interval = DEFAULT_INTERVAL if interval is None else interval
        if interval <= 0:
            raise ValueError(f"interval must be positive seconds, got {interval}")
        self.total, self.what, self.unit = total, what, unit
        self.stream = sys.stderr if stream is None else stream
        self.interval = interval
        self.done = 0
        self._clock = clock
        self._started = self._last_line = clock()
        self._closed = False
        self._lines = 0
        on_terminal = _is_terminal(self.stream) if terminal is None else terminal
        self._bar = (
            tqdm(total=total, desc=what, unit=f" {unit}", file=self.stream, dynamic_ncols=True, delay=delay)
            if on_terminal
            else None
        )

    def update(self, count: int) -> None:
        """``count`` more units are done (a line is written if ``interval`` has passed since the last)."""
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
            return
        now = self._clock()
        if now - self._last_line >= self.interval:
            self._last_line = now
            self._write(self.line(now))

    def line(self, now: float | None = None) -> str:
        """Where the loop stands: ``what: done / total unit (percent), rate unit/s, ETA duration``."""
        elapsed = (self._clock() if now is None else now) - self._started
        rate = self.done / elapsed if elapsed > 0 else None
        shown = f"{self.done:,}" if self.total is None else f"{self.done:,} / {self.total:,}"
        parts = [f"{self.what}: {shown} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.done / self.total:.1f}%)"
        parts.append(f"{_rate(rate)} {self.unit}/s")
        if self.total is not None:
            left = self.total - self.done
            parts.append(f"ETA {format_duration(left / rate)}" if rate else "ETA unknown")
        return ", ".join(parts)

    def close(self) -> None:
        """Finish: the bar's last state, or one line with the count, the time taken and the rate
        (none if no line was written before: the loop was short)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            return
        if not self._lines:
            return
        elapsed = self._clock() - self._started
        rate = self.done / elapsed if elapsed > 0 else None
        self._write(f"{self.what}: {self.done:,} {self.unit} in {format_duration(elapsed)}, "
                    f"{_rate(rate)} {self.unit}/s")

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _write(self, line: str) -> None:
        self._lines += 1
        self.stream.write(line + "\n")
        self.stream.flush()


def format_duration(seconds: float) -> str:
    """``42s``, ``6m26s``, ``2h05m`` (rounded down to the unit shown last)."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _rate(rate: float | None) -> str:
    if rate is None:
        return "?"
    if rate >= 100:
        return f"{rate:,.0f}"
    return f"{rate:.1f}" if rate >= 1 else f"{rate:.2g}"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or file-like stream without isatty
        return False
