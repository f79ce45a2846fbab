"""Monitors that need no device: the block pool's own occupancy, and a scripted one.

:class:`PoolMonitor` is the only source on a CPU-only machine. It counts the
blocks that requests hold; cached blocks nobody holds are reclaimable on
demand, so they are not pressure. :class:`ScriptedMonitor` replays readings
(or raises) on cue, for tests and demos.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import Protocol

from kvtier.errors import ConfigError
from kvtier.pressure.monitor import MemoryReading


class _Pool(Protocol):
    @property
    def num_used(self) -> int: ...

    num_blocks: int


class PoolMonitor:
    """Blocks held by requests, of all blocks in ``pool`` (``bytes_per_block`` scales them)."""

    def __init__(self, pool: _Pool, bytes_per_block: int = 1) -> None:
        if not isinstance(bytes_per_block, int) or bytes_per_block < 1:
            raise ConfigError(
                f"bytes_per_block must be a positive integer, got {bytes_per_block!r}"
            )
        self._pool = pool
        self._bpb = bytes_per_block
        self.name = "pool"

    def read(self) -> MemoryReading:
        pool = self._pool
        # One racy read of two ints is fine: a reading is a sample, not a ledger.
        used = min(max(pool.num_used, 0), pool.num_blocks)
        return MemoryReading(used * self._bpb, pool.num_blocks * self._bpb, self.name)

    def close(self) -> None:
        pass


class ScriptedMonitor:
    """Readings set by hand or queued in advance; an exception in the queue is raised.

    ``read`` pops the next queued item, or repeats the current value when the
    queue is empty. Values are fractions of ``total``.
    """

    def __init__(
        self,
        fraction: float = 0.0,
        *,
        total: int = 1 << 30,
        script: Iterable[float | BaseException] = (),
        name: str = "scripted",
    ) -> None:
        if total <= 0:
            raise ConfigError(f"total must be positive, got {total}")
        self.name = name
        self.total = total
        self.reads = 0
        self._lock = threading.Lock()
        self._fraction = self._check(fraction)
        self._queue: deque[float | BaseException] = deque()
        self.push(*script)

    @staticmethod
    def _check(fraction: float) -> float:
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"a scripted reading must be within [0, 1], got {fraction}")
        return fraction

    def set(self, fraction: float) -> None:
        """Make every later read (after the queue drains) return ``fraction``."""
        with self._lock:
            self._fraction = self._check(fraction)

    def push(self, *items: float | BaseException) -> None:
        """Queue readings (or exceptions to raise), one per ``read``."""
        with self._lock:
            for item in items:
                self._queue.append(item if isinstance(item, BaseException) else self._check(item))

    def read(self) -> MemoryReading:
        with self._lock:
            self.reads += 1
            if self._queue:
                item = self._queue.popleft()
                if isinstance(item, BaseException):
                    raise item
                self._fraction = item
            fraction = self._fraction
        return MemoryReading(round(fraction * self.total), self.total, self.name)

    def close(self) -> None:
        pass
