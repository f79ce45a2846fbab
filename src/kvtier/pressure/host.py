"""Host memory monitor that respects container limits (cgroup v2, then v1).

In a container the machine's total is the wrong denominator: the kernel kills
the process at the cgroup's limit. So the monitor reads the process's own
cgroup first (``memory.max`` / ``memory.current`` under v2,
``memory.limit_in_bytes`` / ``memory.usage_in_bytes`` under v1), counting
the working set the way the kernel's reclaim does (usage less inactive file
pages, which it can drop). Without a limit it reads the machine's memory
through psutil, or ``/proc/meminfo`` where psutil is not installed.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from kvtier.errors import MonitorUnavailableError
from kvtier.pressure.monitor import MemoryReading

#: cgroup v1 reports "no limit" as a page-rounded 2**63 - 1.
_NO_LIMIT = 2**62


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("max", ""):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_field(path: Path, field: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == field:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _own_cgroup_v2(root: Path, proc_cgroup: Path) -> Path | None:
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            rel = line[3:].strip().lstrip("/")
            for base in (root / rel, root):
                if (base / "memory.max").exists():
                    return base
    return root if (root / "memory.max").exists() else None


def _machine_memory(meminfo: Path) -> tuple[int, int]:
    """``(used, total)`` bytes of the whole machine."""
    try:
        psutil = importlib.import_module("psutil")
    except ImportError:
        fields: dict[str, int] = {}
        try:
            for line in meminfo.read_text().splitlines():
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError) as exc:
            raise MonitorUnavailableError(f"host: cannot read {meminfo} ({exc})") from exc
        total = fields.get("MemTotal", 0)
        available = fields.get("MemAvailable", fields.get("MemFree", 0))
        if total <= 0:
            raise MonitorUnavailableError(f"host: {meminfo} has no MemTotal") from None
        return total - available, total
    vm = psutil.virtual_memory()
    return int(vm.total - vm.available), int(vm.total)


class HostMemoryMonitor:
    """Memory of this process's container (its cgroup limit) or of the machine.

    ``cgroup_root`` and ``proc_root`` exist so tests can point the monitor
    at a prepared directory tree.
    """

    def __init__(
        self, cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup", proc_root: str = "/proc"
    ) -> None:
        root = Path(cgroup_root)
        self._meminfo = Path(proc_root) / "meminfo"
        self._current: Path | None = None
        self._stat: Path | None = None
        self._limit = 0
        self._inactive = "inactive_file"
        v2 = _own_cgroup_v2(root, Path(proc_root) / "self" / "cgroup")
        if v2 is not None:
            limit = _read_int(v2 / "memory.max")
            if limit is not None:
                self._current, self._stat, self._limit = (
                    v2 / "memory.current",
                    v2 / "memory.stat",
                    limit,
                )
        else:
            v1 = root / "memory"
            limit = _read_int(v1 / "memory.limit_in_bytes")
            if limit is not None and limit < _NO_LIMIT:
                self._current, self._stat, self._limit = (
                    v1 / "memory.usage_in_bytes",
                    v1 / "memory.stat",
                    limit,
                )
                self._inactive = "total_inactive_file"
        # A limit above the machine's memory binds nothing: the machine does.
        _, machine_total = _machine_memory(self._meminfo)
        if self._current is not None and self._limit < machine_total:
            self.name = "host:cgroup"
        else:
            self._current = None
            self.name = "host"

    def read(self) -> MemoryReading:
        if self._current is None:
            used, total = _machine_memory(self._meminfo)
            return MemoryReading(used, total, self.name)
        usage = _read_int(self._current)
        if usage is None:
            raise MonitorUnavailableError(f"host: {self._current} is unreadable")
        inactive = _stat_field(self._stat, self._inactive) if self._stat else 0
        return MemoryReading(max(usage - inactive, 0), self._limit, self.name)

    def close(self) -> None:
        pass
