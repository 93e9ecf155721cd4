"""How far a run has got, on stderr: a bar redrawn in place on a terminal; a plain line
every so often when stderr is a file or a pipe (a log keeps every line)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24
TERMINAL_EVERY_SECONDS = 0.2
LOG_EVERY_SECONDS = 10.0


def clock(seconds: float) -> str:
    """h:mm:ss."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


class Progress:
    """Texts done of `total`, texts per second over this run, time left."""

    def __init__(
        self, total: int, done: int = 0, stream: TextIO | None = None, every: float | None = None
    ) -> None:
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty()
        self.every = every or (TERMINAL_EVERY_SECONDS if self.terminal else LOG_EVERY_SECONDS)
        self.total, self.done, self.start_done = total, done, done
        self.started = self.shown = time.monotonic()

    def advance(self, texts: int) -> None:
        self.done += texts
        now = time.monotonic()
        if now - self.shown >= self.every:
            self.shown = now
            self._show(now)

    def finish(self) -> None:
        self._show(time.monotonic())
        if self.terminal:
            self.stream.write("\n")
            self.stream.flush()

    def line(self, now: float) -> str:
        rate = (self.done - self.start_done) / max(now - self.started, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = clock(left) if left == left else "?"  # NaN before the first text
        share = self.done / self.total if self.total else 1.0
        text = f"{self.done}/{self.total} texts  {rate:.1f} texts/s  {eta} left"
        if not self.terminal:
            return f"score: {text} ({100 * share:.0f} %)"
        filled = round(BAR_WIDTH * share)
        return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {text}"

    def _show(self, now: float) -> None:
        if self.terminal:
            self.stream.write("\r" + self.line(now) + "\x1b[K")
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()
