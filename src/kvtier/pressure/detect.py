"""Building monitors by name, and auto-detecting the best source present.

``auto`` tries NVML, AMD SMI and ``torch.cuda`` for the accelerator, then the
block pool's occupancy when a pool is given, else host memory. Every source
that is skipped is logged with its reason, and the chosen one is named, so a
user can see why a GPU monitor was not used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvtier.errors import ConfigError, MonitorUnavailableError
from kvtier.pressure.gpu import AmdSmiMonitor, NvmlMonitor, TorchCudaMonitor
from kvtier.pressure.host import HostMemoryMonitor
from kvtier.pressure.local import PoolMonitor
from kvtier.pressure.monitor import MemoryMonitor

log = logging.getLogger("kvtier.pressure")

MONITOR_NAMES = ("auto", "nvml", "amdsmi", "torch-cuda", "host", "pool")
_ACCELERATORS: tuple[tuple[str, Callable[[int], MemoryMonitor]], ...] = (
    ("nvml", NvmlMonitor),
    ("amdsmi", AmdSmiMonitor),
    ("torch-cuda", TorchCudaMonitor),
)


def make_monitor(
    name: str, *, pool: Any = None, device_index: int = 0, bytes_per_block: int = 1
) -> MemoryMonitor:
    """The monitor called ``name`` (one of :data:`MONITOR_NAMES`).

    Raises :class:`MonitorUnavailableError` when that source is absent
    (``auto`` never does: host memory is always there).
    """
    if name == "auto":
        return detect_monitor(
            pool=pool, device_index=device_index, bytes_per_block=bytes_per_block
        )[0]
    if name == "pool":
        if pool is None:
            raise ConfigError("the pool monitor needs the block pool it watches")
        return PoolMonitor(pool, bytes_per_block)
    if name == "host":
        return HostMemoryMonitor()
    for key, factory in _ACCELERATORS:
        if key == name:
            return factory(device_index)
    raise ConfigError(f"unknown memory monitor {name!r}; choose one of {', '.join(MONITOR_NAMES)}")


def detect_monitor(
    *, pool: Any = None, device_index: int = 0, bytes_per_block: int = 1
) -> tuple[MemoryMonitor, list[str]]:
    """The first source present, and why each one before it was skipped."""
    skipped: list[str] = []
    for key, factory in _ACCELERATORS:
        try:
            monitor = factory(device_index)
        except MonitorUnavailableError as exc:
            skipped.append(f"{key}: {exc}")
            log.info("memory monitor %s unavailable: %s", key, exc)
            continue
        _announce(monitor, skipped)
        return monitor, skipped
    fallback: MemoryMonitor = (
        PoolMonitor(pool, bytes_per_block) if pool is not None else HostMemoryMonitor()
    )
    _announce(fallback, skipped)
    return fallback, skipped


def _announce(monitor: MemoryMonitor, skipped: list[str]) -> None:
    if skipped:
        log.warning(
            "memory pressure source: %s (no accelerator monitor: %s)",
            monitor.name,
            "; ".join(skipped),
        )
    else:
        log.info("memory pressure source: %s", monitor.name)
