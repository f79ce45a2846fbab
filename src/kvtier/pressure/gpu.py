"""Accelerator memory monitors: NVML (NVIDIA), AMD SMI and ``torch.cuda.mem_get_info``.

Each is built for one device index and raises
:class:`~kvtier.errors.MonitorUnavailableError` at construction when its
library does not import or the device is absent, so auto-detection can say
why and move on. NVML and AMD SMI read the whole device (every process);
``torch.cuda.mem_get_info`` asks the CUDA driver the same question through
torch, which costs a CUDA context.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvtier.errors import MonitorUnavailableError
from kvtier.pressure.monitor import MemoryReading


def _import(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a library that fails to load its .so
        raise MonitorUnavailableError(
            f"{what}: cannot import {module} ({type(exc).__name__}: {exc})"
        ) from exc


class NvmlMonitor:
    """Device memory of one NVIDIA GPU through NVML (``pip install nvidia-ml-py``)."""

    def __init__(self, index: int = 0) -> None:
        nvml = _import("pynvml", "NVML")
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise MonitorUnavailableError(f"NVML: no driver or device ({exc})") from exc
        try:
            count = int(nvml.nvmlDeviceGetCount())
            if not 0 <= index < count:
                raise MonitorUnavailableError(f"NVML: GPU {index} absent ({count} present)")
            self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except MonitorUnavailableError:
            nvml.nvmlShutdown()
            raise
        except Exception as exc:
            nvml.nvmlShutdown()
            raise MonitorUnavailableError(f"NVML: cannot open GPU {index} ({exc})") from exc
        self._nvml = nvml
        self.name = f"nvml:{index}"

    def read(self) -> MemoryReading:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return MemoryReading(int(info.used), int(info.total), self.name)

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None


class AmdSmiMonitor:
    """VRAM of one AMD GPU through AMD SMI (the ``amdsmi`` package ROCm ships)."""

    def __init__(self, index: int = 0) -> None:
        amdsmi = _import("amdsmi", "AMD SMI")
        try:
            amdsmi.amdsmi_init()
        except Exception as exc:
            raise MonitorUnavailableError(f"AMD SMI: no driver or device ({exc})") from exc
        try:
            handles = amdsmi.amdsmi_get_processor_handles()
        except Exception as exc:
            amdsmi.amdsmi_shut_down()
            raise MonitorUnavailableError(f"AMD SMI: cannot list GPUs ({exc})") from exc
        if not 0 <= index < len(handles):
            amdsmi.amdsmi_shut_down()
            raise MonitorUnavailableError(f"AMD SMI: GPU {index} absent ({len(handles)} present)")
        self._amdsmi = amdsmi
        self._handle = handles[index]
        self._vram = amdsmi.AmdSmiMemoryType.VRAM
        self.name = f"amdsmi:{index}"

    def read(self) -> MemoryReading:
        a = self._amdsmi
        total = int(a.amdsmi_get_gpu_memory_total(self._handle, self._vram))
        used = int(a.amdsmi_get_gpu_memory_usage(self._handle, self._vram))
        return MemoryReading(used, total, self.name)

    def close(self) -> None:
        if self._amdsmi is not None:
            self._amdsmi.amdsmi_shut_down()
            self._amdsmi = None


class TorchCudaMonitor:
    """Free and total memory of one CUDA (or ROCm) device as torch's driver reports it."""

    def __init__(self, index: int = 0) -> None:
        torch = _import("torch", "torch.cuda")
        if not torch.cuda.is_available():
            raise MonitorUnavailableError("torch.cuda: no CUDA device (torch.cuda.is_available())")
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise MonitorUnavailableError(f"torch.cuda: GPU {index} absent ({count} present)")
        self._torch = torch
        self._index = index
        self.name = f"torch.cuda:{index}"

    def read(self) -> MemoryReading:
        free, total = self._torch.cuda.mem_get_info(self._index)
        return MemoryReading(int(total - free), int(total), self.name)

    def close(self) -> None:
        pass
