"""Memory monitors: scripted, pool, host (cgroup v2, v1, none), NVML/AMD/torch.cuda, detection."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
from needs import need_module, skip_for_hardware

from kvtier import (
    BlockPool,
    ConfigError,
    HostMemoryMonitor,
    KVCacheManager,
    MemoryMonitor,
    MemoryReading,
    MonitorUnavailableError,
    PoolMonitor,
    ScriptedMonitor,
    detect_monitor,
    make_monitor,
)
from kvtier.pressure import AmdSmiMonitor, NvmlMonitor, TorchCudaMonitor


def test_reading_fraction_and_validation() -> None:
    assert MemoryReading(25, 100, "x").fraction == 0.25
    assert MemoryReading(150, 100, "x").fraction == 1.0  # over-commit reads as full
    with pytest.raises(ConfigError, match="positive total"):
        MemoryReading(0, 0, "x")
    with pytest.raises(ConfigError, match="negative"):
        MemoryReading(-1, 10, "x")


def test_scripted_monitor_replays_then_holds_and_raises_on_cue() -> None:
    boom = RuntimeError("driver gone")
    m = ScriptedMonitor(0.1, total=1000, script=[0.5, boom, 0.9])
    assert isinstance(m, MemoryMonitor)
    assert m.read() == MemoryReading(500, 1000, "scripted")
    with pytest.raises(RuntimeError, match="driver gone"):
        m.read()
    assert m.read().fraction == 0.9
    assert m.read().fraction == 0.9  # the queue is empty: the last value holds
    m.set(0.3)
    assert m.read().used == 300
    assert m.reads == 5
    with pytest.raises(ConfigError):
        m.set(1.5)


def test_pool_monitor_counts_held_blocks_not_cached_ones() -> None:
    mgr = KVCacheManager(10, 4)
    mon = PoolMonitor(mgr.pool, bytes_per_block=256)
    assert mon.read() == MemoryReading(0, 2560, "pool")
    mgr.allocate("a", list(range(16)))  # 4 blocks held
    assert mon.read().used == 4 * 256
    mgr.free("a")  # the blocks stay cached but are reclaimable
    assert mgr.pool.num_cached == 4
    assert mon.read().used == 0
    with pytest.raises(ConfigError):
        PoolMonitor(BlockPool(4, 4), bytes_per_block=0)


def _cgroup_v2(tmp: Path, limit: str, current: int, inactive: int) -> tuple[Path, Path]:
    root = tmp / "cgroup"
    own = root / "kubepods" / "pod1"
    own.mkdir(parents=True)
    (own / "memory.max").write_text(f"{limit}\n")
    (own / "memory.current").write_text(f"{current}\n")
    (own / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file 5\n")
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/kubepods/pod1\n")
    (proc / "meminfo").write_text(Path("/proc/meminfo").read_text())
    return root, proc


def test_host_monitor_respects_a_cgroup_v2_limit(tmp_path: Path) -> None:
    root, proc = _cgroup_v2(tmp_path, str(2**30), current=600 * 2**20, inactive=100 * 2**20)
    mon = HostMemoryMonitor(root, str(proc))
    assert mon.name == "host:cgroup"
    # The working set: usage less the inactive file pages the kernel can drop.
    assert mon.read() == MemoryReading(500 * 2**20, 2**30, "host:cgroup")
    (root / "kubepods" / "pod1" / "memory.current").write_text(f"{2**30}\n")
    assert mon.read().fraction == pytest.approx(1 - 100 / 1024)


def test_host_monitor_without_a_limit_reads_the_machine(tmp_path: Path) -> None:
    root, proc = _cgroup_v2(tmp_path, "max", current=1, inactive=0)
    mon = HostMemoryMonitor(root, str(proc))
    assert mon.name == "host"
    r = mon.read()
    assert r.total > 2**28 and 0 < r.used < r.total


def test_host_monitor_reads_cgroup_v1(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    v1 = root / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2**30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{700 * 2**20}\n")
    (v1 / "memory.stat").write_text(f"total_inactive_file {200 * 2**20}\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(Path("/proc/meminfo").read_text())
    mon = HostMemoryMonitor(root, str(proc))
    assert mon.read() == MemoryReading(500 * 2**20, 2**30, "host:cgroup")
    # v1's "unlimited" is a huge number: the machine's memory is the limit then.
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert HostMemoryMonitor(root, str(proc)).name == "host"


def test_host_monitor_on_this_machine() -> None:
    r = HostMemoryMonitor().read()
    assert r.source.startswith("host") and 0 < r.used <= r.total


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_nvml_without_a_driver_is_unavailable_not_a_crash() -> None:
    need_module("pynvml", "install the dev extra (nvidia-ml-py)")
    if _cuda():
        skip_for_hardware("a GPU is present: the real NVML test covers it")
    with pytest.raises(MonitorUnavailableError, match="NVML"):
        NvmlMonitor()


def test_nvml_sees_a_tensor_fill_device_memory() -> None:
    need_module("pynvml", "install the dev extra (nvidia-ml-py)")
    torch = need_module("torch")
    if not _cuda():
        skip_for_hardware("no CUDA device")

    mon = NvmlMonitor(0)
    before = mon.read()
    block = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    after = mon.read()
    del block
    torch.cuda.empty_cache()
    mon.close()
    assert after.total == before.total
    assert after.used - before.used >= 2**30  # NVML sees the whole device, every process


def test_amd_smi_absent_is_unavailable() -> None:
    if _has("amdsmi"):
        skip_for_hardware("amdsmi is installed: this is an AMD GPU machine")
    with pytest.raises(MonitorUnavailableError, match="cannot import amdsmi"):
        AmdSmiMonitor()


def test_torch_cuda_without_a_device_is_unavailable() -> None:
    if _cuda():
        r = TorchCudaMonitor().read()
        assert 0 < r.used < r.total
        return
    with pytest.raises(MonitorUnavailableError, match="no CUDA device"):
        TorchCudaMonitor()


def test_absent_gpu_index_is_unavailable() -> None:
    with pytest.raises(MonitorUnavailableError):
        TorchCudaMonitor(99)


def test_auto_detection_falls_back_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    if _cuda():
        skip_for_hardware("a GPU is present: detection picks it")
    pool = BlockPool(8, 4)
    with caplog.at_level(logging.INFO, logger="kvtier.pressure"):
        mon, skipped = detect_monitor(pool=pool)
    assert mon.name == "pool"
    assert [s.split(":")[0] for s in skipped] == ["nvml", "amdsmi", "torch-cuda"]
    chosen = [r for r in caplog.records if "memory pressure source: pool" in r.getMessage()]
    assert chosen and chosen[0].levelno == logging.WARNING
    assert "torch.cuda: no CUDA device" in chosen[0].getMessage()
    # Without a pool the fallback is host memory, never a made-up total.
    host, _ = detect_monitor()
    assert host.name.startswith("host") and host.read().total > 0


def test_make_monitor_by_name() -> None:
    pool = BlockPool(8, 4)
    assert make_monitor("pool", pool=pool).name == "pool"
    assert make_monitor("host").name.startswith("host")
    assert make_monitor("auto", pool=pool).name in ("pool", "nvml:0", "amdsmi:0", "torch.cuda:0")
    with pytest.raises(ConfigError, match="needs the block pool"):
        make_monitor("pool")
    with pytest.raises(ConfigError, match="unknown memory monitor 'gpu'"):
        make_monitor("gpu")
