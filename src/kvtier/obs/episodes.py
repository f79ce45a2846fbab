"""Logging a degraded condition once per episode instead of once per failure.

A Redis tier that is down fails every call for as long as it is down; a log
line per call drowns the one that matters. :class:`Episodes` logs a
condition when it starts (with what to do) and once when it ends (with how
long it lasted and how often it struck), and stays quiet in between.
:class:`Summary` does the same for events that come in bursts (corrupt
blocks, pressure-mode flaps): the first is logged at once, the rest are
counted and summarised at most once per interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Open:
    since: float
    count: int


class Episodes:
    """Conditions that start and end; logged at each edge, not at every occurrence."""

    def __init__(self, logger: logging.Logger, *, clock: Callable[[], float] = time.monotonic):
        self._log = logger
        self._clock = clock
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()
        #: Episodes that started, per key (for tests and metrics).
        self.started: dict[str, int] = {}

    def fail(self, key: str, message: str, *, level: int = logging.WARNING) -> bool:
        """Record an occurrence of condition ``key``; logs ``message`` if it just started."""
        with self._lock:
            ep = self._open.get(key)
            if ep is not None:
                ep.count += 1
                return False
            self._open[key] = _Open(self._clock(), 1)
            self.started[key] = self.started.get(key, 0) + 1
        self._log.log(level, message)
        return True

    def ok(self, key: str, message: str, *, level: int = logging.WARNING) -> bool:
        """Condition ``key`` is over (if it was on): logs ``message`` with its duration."""
        with self._lock:
            ep = self._open.pop(key, None)
        if ep is None:
            return False
        self._log.log(
            level,
            "%s (after %.1f s and %d failure%s)",
            message,
            self._clock() - ep.since,
            ep.count,
            "" if ep.count == 1 else "s",
        )
        return True

    def active(self, key: str) -> bool:
        with self._lock:
            return key in self._open

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._open)


class Summary:
    """Bursty events: the first is logged now, later ones as one line per ``interval``."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 60.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._pending: dict[str, int] = {}
        self._lock = threading.Lock()

    def event(
        self,
        key: str,
        message: str,
        summary: Callable[[int], str],
        *,
        level: int = logging.WARNING,
    ) -> None:
        """Log ``message`` unless ``key`` was logged within the interval; then count it.

        ``summary(n)`` words the line for ``n`` events held back, logged with
        the next event after the interval (or by :meth:`flush`).
        """
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._pending[key] = self._pending.get(key, 0) + 1
                return
            held = self._pending.pop(key, 0)
            self._last[key] = now
        if held:
            self._log.log(level, summary(held))
        self._log.log(level, message)

    def flush(
        self, key: str, summary: Callable[[int], str], *, level: int = logging.WARNING
    ) -> None:
        """Log the held-back count of ``key`` now if its interval has passed."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            held = self._pending.get(key, 0)
            if not held or last is None or now - last < self.interval:
                return
            del self._pending[key]
            self._last[key] = now
        self._log.log(level, summary(held))
