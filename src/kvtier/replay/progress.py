"""A minimal progress bar on stderr for long replays (no dependency).

It redraws one line with ``\\r`` at most ten times a second, so a replay of
millions of block accesses spends almost nothing on it, and it draws nothing
at all when disabled (the default when stderr is not a terminal).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``label [#####.....]  42%  3.1s`` over ``total`` units of work."""

    def __init__(
        self,
        total: int,
        *,
        enabled: bool,
        stream: TextIO | None = None,
        width: int = 28,
        min_interval: float = 0.1,
    ) -> None:
        self.total = max(total, 1)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval = min_interval
        self.done = 0
        self.label = ""
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    def set_label(self, label: str) -> None:
        self.label = label
        self._draw(force=True)

    def advance(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        self._draw()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval and self.done < self.total:
            return
        self._last_draw = now
        frac = self.done / self.total
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"\r{self.label[:32]:<32} [{bar}] {frac:4.0%} {now - self._start:6.1f}s"
        self.stream.write(line)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Finish the line so later output starts on a fresh one."""
        if self.enabled and self._drawn:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def want_progress(flag: bool | None, stream: TextIO | None = None) -> bool:
    """``--progress``/``--no-progress`` win; otherwise only when stderr is a terminal."""
    if flag is not None:
        return flag
    s = stream if stream is not None else sys.stderr
    try:
        return s.isatty()
    except (AttributeError, ValueError):
        return False
