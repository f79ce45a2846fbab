"""The memory-monitor protocol: one reading of used and total bytes, and its source.

Every source (NVML, AMD SMI, ``torch.cuda.mem_get_info``, host memory, the
block pool's own occupancy, a scripted one for tests) implements
:class:`MemoryMonitor`. A monitor whose library or device is absent raises
:class:`~kvtier.errors.MonitorUnavailableError` when it is built, never
later and never with an invented total; :func:`~kvtier.pressure.detect.auto_monitor`
uses that to fall back to the next source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvtier.errors import ConfigError


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """``used`` of ``total`` bytes, as ``source`` saw them."""

    used: int
    total: int
    source: str

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise ConfigError(f"{self.source}: a reading needs a positive total, got {self.total}")
        if self.used < 0:
            raise ConfigError(f"{self.source}: used bytes cannot be negative, got {self.used}")

    @property
    def fraction(self) -> float:
        """Share of ``total`` in use, clamped to [0, 1]."""
        return min(self.used / self.total, 1.0)


@runtime_checkable
class MemoryMonitor(Protocol):
    """A source of memory readings. ``read`` may raise; the controller isolates it."""

    #: Short name of the source, e.g. ``"nvml:0"`` or ``"pool"``.
    name: str

    def read(self) -> MemoryReading: ...

    def close(self) -> None: ...
