"""Memory pressure: monitors, one mode ladder with hysteresis, and admission control.

* :mod:`~kvtier.pressure.monitor`: the monitor protocol and a reading;
* :mod:`~kvtier.pressure.gpu`, :mod:`~kvtier.pressure.host`,
  :mod:`~kvtier.pressure.local`: NVML, AMD SMI, ``torch.cuda``, host memory
  (cgroup-aware), the pool's occupancy and a scripted monitor;
* :mod:`~kvtier.pressure.detect`: monitors by name and auto-detection;
* :mod:`~kvtier.pressure.ladder`: modes, thresholds, hysteresis, actions;
* :mod:`~kvtier.pressure.controller`: sampling, mode changes, admission;
* :mod:`~kvtier.pressure.config`: :class:`PressureSpec` for engines and the CLI.

A :class:`PressureController` attached with
:meth:`kvtier.KVCacheManager.set_pressure_gate` is what the manager consults.
"""

from __future__ import annotations

from kvtier.pressure.config import PressureSpec
from kvtier.pressure.controller import ModeChange, PressureController, PressureStats
from kvtier.pressure.detect import MONITOR_NAMES, detect_monitor, make_monitor
from kvtier.pressure.gpu import AmdSmiMonitor, NvmlMonitor, TorchCudaMonitor
from kvtier.pressure.host import HostMemoryMonitor
from kvtier.pressure.ladder import DEFAULT_ACTIONS, DEFAULT_THRESHOLDS, Ladder, Mode, ModeActions
from kvtier.pressure.local import PoolMonitor, ScriptedMonitor
from kvtier.pressure.monitor import MemoryMonitor, MemoryReading

__all__ = [
    "DEFAULT_ACTIONS",
    "DEFAULT_THRESHOLDS",
    "MONITOR_NAMES",
    "AmdSmiMonitor",
    "HostMemoryMonitor",
    "Ladder",
    "MemoryMonitor",
    "MemoryReading",
    "Mode",
    "ModeActions",
    "ModeChange",
    "NvmlMonitor",
    "PoolMonitor",
    "PressureController",
    "PressureSpec",
    "PressureStats",
    "ScriptedMonitor",
    "TorchCudaMonitor",
    "detect_monitor",
    "make_monitor",
]
