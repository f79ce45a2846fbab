"""kvtier media as secondary tiers of vLLM 0.33's real TieringOffloadingManager.

vLLM's own spec factory loads the tier by module path; the tests store chunks
through vLLM's CPU tier, wipe it, and read them back through promotions from
the kvtier tier, on real files and a real redis-server.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from needs import need_module, need_redis_server

need_module("vllm.v1.kv_offload.tiering.spec")

from redis_servers import RedisServer  # noqa: E402

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.vllm import tiering  # noqa: E402
from kvtier.integrations.vllm.driver import (  # noqa: E402
    MISS,
    RETRY,
    kvtier_tier,
)
from kvtier.integrations.vllm.driver import SchedulerDriver as TieringDriver  # noqa: E402
from kvtier.integrations.vllm.driver import offload_key as K  # noqa: E402

CHUNK = 4096


def chunks(names: list[str | int], seed: int = 0) -> dict[Any, bytes]:
    rng = random.Random(seed)
    return {K(n): rng.randbytes(CHUNK) for n in names}


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[TieringDriver]:
    d = TieringDriver([kvtier_tier(f"disk:{tmp_path}?size=1MiB")])
    yield d
    d.shutdown()


def test_vllm_loads_the_tier_by_module_path(disk: TieringDriver) -> None:
    (tier,) = disk.tiers
    assert isinstance(tier, tiering.KvTierSecondaryTier)
    assert tier.tier_type == "KvTierSecondaryTier"
    assert tier.capacity == (1 << 20) // tier.pages.blob_size
    # vLLM's file-tier fields name the namespace: the model, then a digest.
    assert tier.namespace.startswith("vllm-m_") and tier.namespace.endswith("_r0")


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({}, "needs a kvtier tier URL"),
        ({"url": "disk:/tmp/x", "colour": "red"}, "has no setting colour"),
        ({"url": "disk:/tmp/x?write=through"}, "drop write="),
        ({"url": "disk:/tmp/x?size=100"}, "hold no chunk"),
        ({"url": "disk:/tmp/x?codec=zstd"}, "unknown codec"),
        ({"url": "nowhere:/tmp/x"}, "names no registered medium"),
        ({"url": "disk:/tmp/x", "copy_inline_bytes": -1}, "copy_inline_bytes must be"),
        ({"url": "disk:/tmp/x", "write_backlog_bytes": "1GiB"}, "write_backlog_bytes must be"),
    ],
)
def test_bad_settings_fail_at_startup(settings: dict[str, Any], match: str) -> None:
    tier = {"type": "KvTierSecondaryTier", "module_path": tiering.MODULE_PATH, **settings}
    with pytest.raises(ConfigError, match=match):
        TieringDriver([tier])


def test_lossy_codec_needs_a_float_kv_cache(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="use codec=raw"):
        TieringDriver([kvtier_tier(f"disk:{tmp_path}?codec=int8")], dtype="fp8_e4m3")


def test_chunks_round_trip_exactly_through_disk(disk: TieringDriver, tmp_path: Path) -> None:
    data = chunks(list(range(6)))
    ctx = disk.request()
    assert disk.store(ctx, data) == list(data)
    disk.finish(ctx)
    disk.settle()
    assert len(block_files(tmp_path)) == 6
    disk.wipe_cpu_tier()

    ctx = disk.request()
    # The CPU tier is empty; the disk tier holds them: promoted, then HIT.
    assert disk.fetch(ctx, list(data)) == list(data.values())
    (tier,) = disk.tiers
    assert tier.bytes_written == 6 * tier.pages.blob_size
    assert tier.bytes_read == 6 * tier.pages.blob_size
    tier.offload_manager.check()


def test_a_new_process_serves_the_chunks_of_an_earlier_one(tmp_path: Path) -> None:
    url = f"disk:{tmp_path}?size=1MiB"
    data = chunks(["a", "b", "c"], seed=1)
    first = TieringDriver([kvtier_tier(url)], engine_id="first")
    ctx = first.request()
    first.store(ctx, data)
    first.settle()
    first.shutdown()

    second = TieringDriver([kvtier_tier(url)], engine_id="second")
    try:
        second.settle()  # the background scan of the directory
        (tier,) = second.tiers
        assert tier.adopted == 3
        assert second.fetch(second.request(), list(data)) == list(data.values())
    finally:
        second.shutdown()


def test_a_scan_keeps_the_newest_that_fit_and_deletes_the_rest(tmp_path: Path) -> None:
    big = TieringDriver([kvtier_tier(f"disk:{tmp_path}?size=1MiB")], engine_id="big")
    names = [f"x{i}" for i in range(5)]
    big.store(big.request(), chunks(names))
    big.settle()
    (tier,) = big.tiers
    for i, name in enumerate(names):  # x0 oldest ... x4 newest
        path = tier._medium.path(tiering.key_id(K(name)))
        os.utime(path, ns=((i + 1) * 10**9, (i + 1) * 10**9))
    big.shutdown()

    blob = tiering.FlatPages.make(CHUNK).blob_size
    small = TieringDriver([kvtier_tier(f"disk:{tmp_path}?size={3 * blob}")], engine_id="small")
    try:
        small.settle()  # the scan, then the deletions it started
        small.settle()
        (tier,) = small.tiers
        assert tier.adopted == 3
        assert len(block_files(tmp_path)) == 3
        held = [tier.offload_manager.is_ready(tiering.key_id(K(n))) for n in names]
        assert held == [False, False, True, True, True]
    finally:
        small.shutdown()


@pytest.mark.parametrize("damage", ["flip", "truncate", "other key", "delete"])
def test_a_damaged_or_vanished_chunk_is_a_miss(
    disk: TieringDriver, tmp_path: Path, damage: str
) -> None:
    data = chunks(["p0", "p1", "p2"], seed=2)
    disk.store(disk.request(), data)
    disk.settle()
    disk.wipe_cpu_tier()
    (tier,) = disk.tiers
    path = tier._medium.path(tiering.key_id(K("p1")))  # type: ignore[attr-defined]
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[-7] ^= 0x20
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "other key":
        other = tier._medium.path(tiering.key_id(K("p2")))  # type: ignore[attr-defined]
        path.write_bytes(other.read_bytes())
    else:
        path.unlink()

    ctx = disk.request()
    # vLLM promotes all three, the load of p1 fails: its bytes never reach the CPU
    # tier and the prefix ends before it; p0 is served exactly.
    assert disk.fetch(ctx, [K("p0"), K("p1"), K("p2")]) == [data[K("p0")]]
    assert disk.lookup(ctx, [K("p1")]) == [MISS]
    disk.settle()
    assert not tier.offload_manager.is_ready(tiering.key_id(K("p1")))
    assert (tier.corrupt, tier.vanished) == ((0, 1) if damage == "delete" else (1, 0))
    assert not path.exists()  # a damaged file is purged too
    tier.offload_manager.check()
    # Stored again, it is served again.
    disk.store(ctx, {K("p1"): data[K("p1")]})
    disk.settle()
    disk.wipe_cpu_tier()
    assert disk.fetch(disk.request(), [K("p1")]) == [data[K("p1")]]


def test_the_policy_keeps_the_tier_within_its_size(tmp_path: Path) -> None:
    blob = tiering.FlatPages.make(CHUNK).blob_size
    d = TieringDriver(
        [kvtier_tier(f"disk:{tmp_path}?size={4 * blob}&policy=lru")], cpu_chunks=16
    )
    try:
        shared = chunks(["s0", "s1"], seed=3)
        d.store(d.request(), shared)
        d.settle()
        for i in range(4):
            ctx = d.request()
            d.m.touch(list(shared), ctx)  # the shared prefix is reused by every request
            d.store(ctx, chunks([f"u{i}"], seed=10 + i))
            d.settle()
        (tier,) = d.tiers
        assert len(tier.offload_manager) == 4 == len(block_files(tmp_path))
        held = {k for k in [*shared, *(K(f"u{i}") for i in range(4))]
                if tier.offload_manager.is_ready(tiering.key_id(k))}
        assert held == {*shared, K("u2"), K("u3")}  # LRU kept the reused prefix
    finally:
        d.shutdown()


def test_int8_halves_an_fp16_chunk_within_its_error(tmp_path: Path) -> None:
    torch = need_module("torch")
    d = TieringDriver([kvtier_tier(f"disk:{tmp_path}?codec=int8")], dtype="float16")
    try:
        values = torch.randn(CHUNK // 2, generator=torch.Generator().manual_seed(0)).half()
        data = {K("q"): values.view(torch.uint8).numpy().tobytes()}
        d.store(d.request(), data)
        d.settle()
        (tier,) = d.tiers
        assert block_files(tmp_path)[0].stat().st_size == tier.pages.blob_size < CHUNK * 0.6
        d.wipe_cpu_tier()
        (got,) = d.fetch(d.request(), [K("q")])
        back = torch.frombuffer(bytearray(got), dtype=torch.float16).float()
        err = (back - values.float()).abs().max().item()
        assert 0 < err <= values.float().abs().max().item() / 127 * 0.51 + 1e-3
    finally:
        d.shutdown()


def test_any_registered_medium_serves_as_a_tier() -> None:
    # host memory, and a medium defined outside kvtier (tests/dict_medium.py)
    for url in ("host:64KiB", "dict:vllm-tier?module=dict_medium"):
        d = TieringDriver([kvtier_tier(url)])
        try:
            data = chunks(["h0", "h1"], seed=4)
            d.store(d.request(), data)
            d.settle()
            d.wipe_cpu_tier()
            assert d.fetch(d.request(), list(data)) == list(data.values()), url
        finally:
            d.shutdown()


def test_events_name_vllms_keys(tmp_path: Path) -> None:
    blob = tiering.FlatPages.make(CHUNK).blob_size
    d = TieringDriver(
        [kvtier_tier(f"disk:{tmp_path}?size={2 * blob}", enable_kv_events=True)], events=True
    )
    try:
        d.store(d.request(), chunks(["e0", "e1", "e2"]))
        d.settle()
        mine = [ev for ev in d.m.take_events() if ev.medium.value == "STORAGE"]
        stored = [k for ev in mine if not ev.removed for k in ev.keys]
        removed = [k for ev in mine if ev.removed for k in ev.keys]
        assert sorted(stored) == sorted([K("e0"), K("e1")])
        assert removed == []
    finally:
        d.shutdown()


class _ThreadRecorder:
    """A medium wrapper that notes which thread made each call."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            return attr(*args, **kwargs)

        return call


def test_the_scheduler_thread_never_touches_the_medium(disk: TieringDriver, tmp_path: Path) -> None:
    (tier,) = disk.tiers
    recorder = _ThreadRecorder(tier._medium)
    tier._medium = recorder
    data = chunks([f"t{i}" for i in range(8)], seed=5)
    disk.store(disk.request(), data)
    disk.settle()
    disk.wipe_cpu_tier()
    path = recorder._inner.path(tiering.key_id(K("t3")))
    path.write_bytes(b"\0" * 10)
    assert disk.fetch(disk.request(), list(data)) == list(data.values())[:3]
    disk.settle()
    assert recorder.threads, "the medium was never used"
    assert all(name.startswith("kvtier-transfer") for name in recorder.threads), set(
        recorder.threads
    )
    assert tier.call_stats["lookup"].calls > 0 and tier.call_stats["submit_load"].calls > 0


# -- Redis -------------------------------------------------------------------------------------


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    need_redis_server()
    need_module("redis", "install the redis extra")
    with RedisServer() as server:
        yield server


def test_engines_share_chunks_through_redis(redis_server: RedisServer) -> None:
    url = f"{redis_server.url}?size=1MiB"
    a = TieringDriver([kvtier_tier(url)], engine_id="a")
    b = TieringDriver([kvtier_tier(url)], engine_id="b")
    try:
        data = chunks(["r0", "r1", "r2"], seed=6)
        a.store(a.request(), data)
        a.settle()
        ctx = b.request()
        # b never stored them: it asks Redis in the background (RETRY), then HITs.
        assert b.lookup(ctx, [K("r0")]) == [RETRY]
        assert b.fetch(ctx, list(data)) == list(data.values())
        (tier,) = b.tiers
        assert tier.adopted == 3
        assert b.lookup(b.request(), [K("zz")]) == [RETRY]
    finally:
        a.shutdown()
        b.shutdown()


def test_a_redis_outage_misses_and_recovers(redis_server: RedisServer) -> None:
    d = TieringDriver([kvtier_tier(f"{redis_server.url}?size=1MiB", retry_interval_s=0.2)])
    try:
        (tier,) = d.tiers
        data = chunks(["o0", "o1"], seed=7)
        d.store(d.request(), data)
        d.settle()
        d.wipe_cpu_tier()
        redis_server.stop(kill=True)

        ctx = d.request()
        assert d.fetch(ctx, list(data)) == []  # the load fails: recompute, no data
        assert not tier.available
        assert d.lookup(ctx, list(data)) == [MISS, MISS]
        later = chunks(["o2"], seed=8)
        d.store(ctx, later)  # dropped at once while Redis is down
        d.settle()
        assert tier.dropped_stores >= 1

        redis_server.start()  # back, empty
        # The first stores after the restart may meet the tier's (or the Redis
        # client's) wait before retrying; it comes back by itself.
        payload = random.Random(9).randbytes(CHUNK)
        for attempt in range(150):
            again = {K(f"o3-{attempt}"): payload}
            d.store(d.request(), again)
            d.settle()
            if tier.offload_manager.is_ready(tiering.key_id(K(f"o3-{attempt}"))):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the tier did not come back after Redis did")
        assert tier.available
        d.wipe_cpu_tier()
        assert d.fetch(d.request(), list(again)) == list(again.values())
        # What Redis lost in the restart is a miss, found out on the load.
        assert d.fetch(d.request(), [K("o0")]) == []
        assert d.lookup(d.request(), [K("o0")]) in ([MISS], [RETRY])
    finally:
        d.shutdown()


# -- the documented configuration ---------------------------------------------------------------


def documented_transfer_config() -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON of docs/vllm.md's secondary-tier section."""
    text = (Path(__file__).parents[1] / "docs" / "vllm.md").read_text()
    section = text.split("## kvtier media as vLLM 0.33 secondary tiers", 1)[1]
    command = section.split("```", 2)[1]
    assert command.strip().startswith("vllm serve")
    config: dict[str, Any] = json.loads(command.split("--kv-transfer-config '", 1)[1].split("'")[0])
    return config


def test_the_documented_config_builds(tmp_path: Path) -> None:
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvtier.integrations.vllm.driver import offloading_config

    config = documented_transfer_config()
    transfer = KVTransferConfig(**config)  # what vLLM's --kv-transfer-config parses into
    assert transfer.kv_connector == "OffloadingConnector"
    extra = dict(transfer.kv_connector_extra_config)
    (entry,) = extra["secondary_tiers"]
    assert entry["url"].startswith("disk:/var/cache/kvtier?")
    # The same entry, on a scratch directory and a CPU tier of a few chunks.
    entry = {**entry, "url": entry["url"].replace("/var/cache/kvtier", str(tmp_path))}
    extra.update(cpu_bytes_to_use=8 * CHUNK, secondary_tiers=[entry])
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, CHUNK))
    manager = spec.get_manager()
    try:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, tiering.KvTierSecondaryTier)
        assert tier.spec.policy == "s3fifo" and tier.spec.medium == "disk"
        assert tier.capacity == (200 << 30) // tier.pages.blob_size
    finally:
        manager.shutdown()


class _SlowPuts:
    """A medium wrapper whose writes wait until ``gate`` is set."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.gate = threading.Event()

    def put(self, items: Any) -> None:
        assert self.gate.wait(30), "the test never opened the gate"
        self._inner.put(items)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.parametrize("copy_inline_bytes", [1 << 20, 0], ids=["inline", "copy-thread"])
def test_vllms_chunks_are_free_before_the_write_ends(
    tmp_path: Path, copy_inline_bytes: int
) -> None:
    d = TieringDriver(
        [kvtier_tier(f"disk:{tmp_path}?size=1MiB", copy_inline_bytes=copy_inline_bytes)],
        cpu_chunks=4,
    )
    try:
        (tier,) = d.tiers
        slow = _SlowPuts(tier._medium)
        tier._medium = slow
        first = chunks(["f0", "f1", "f2", "f3"], seed=11)
        assert d.store(d.request(), first) == list(first)
        # The copies are taken; vLLM hears the job is done while the write waits,
        # so its CPU tier may evict and overwrite those four chunks.
        deadline = time.monotonic() + 30
        second = chunks(["g0", "g1", "g2", "g3"], seed=12)
        while not d.store(d.request(), second):
            assert time.monotonic() < deadline, "the CPU chunks stayed pinned"
            d.step()
            time.sleep(0.01)
        assert d.lookup(d.request(), [K("f0")]) == [RETRY]  # still being written
        slow.gate.set()
        d.settle()
        d.wipe_cpu_tier()
        # What was written is what the chunks held when they were copied.
        assert d.fetch(d.request(), list(first)) == list(first.values())
    finally:
        slow.gate.set()
        d.shutdown()


def test_a_full_write_backlog_keeps_vllms_chunks_pinned(tmp_path: Path) -> None:
    # Room for one job's copies: while the medium is stuck, the next jobs are not
    # copied, so vLLM keeps their chunks and must refuse new stores.
    d = TieringDriver(
        [kvtier_tier(f"disk:{tmp_path}?size=1MiB", write_backlog_bytes=4 * CHUNK)],
        cpu_chunks=8,
    )
    try:
        (tier,) = d.tiers
        slow = _SlowPuts(tier._medium)
        tier._medium = slow
        jobs = [chunks([f"{name}{i}" for i in range(4)], seed=20 + n)
                for n, name in enumerate("abcd")]
        assert d.store(d.request(), jobs[0]) == list(jobs[0])  # copied at once
        assert d.store(d.request(), jobs[1]) == list(jobs[1])  # waits for room
        for _ in range(5):
            d.step()
        # jobs[0]'s chunks were released, so jobs[2] evicts them; jobs[1]'s stay pinned.
        assert d.store(d.request(), jobs[2]) == list(jobs[2])
        for _ in range(5):
            d.step()
        assert d.store(d.request(), jobs[3]) == []
        assert tier._backlog.used == 4 * CHUNK
        slow.gate.set()
        d.settle()
        assert tier._backlog.used == 0
        d.wipe_cpu_tier()
        for job in jobs[:3]:
            assert d.fetch(d.request(), list(job)) == list(job.values())
        tier.offload_manager.check()
    finally:
        slow.gate.set()
        d.shutdown()


class _UncopyableRows:
    """Stands in for the CPU tier's rows in a test of a copy that raises."""

    def index_select(self, dim: int, index: Any) -> Any:
        raise RuntimeError("copy failed")


def test_a_failed_copy_fails_its_store_and_leaves_the_keys_out(tmp_path: Path) -> None:
    d = TieringDriver(
        [kvtier_tier(f"disk:{tmp_path}?size=1MiB", copy_inline_bytes=0)], cpu_chunks=4
    )
    try:
        (tier,) = d.tiers
        rows, tier._rows = tier._rows, _UncopyableRows()
        data = chunks(["x0", "x1"], seed=30)
        assert d.store(d.request(), data) == list(data)
        d.settle()
        tier._rows = rows
        assert tier._backlog.used == 0
        assert len(tier.offload_manager) == 0
        d.wipe_cpu_tier()
        assert d.lookup(d.request(), list(data)) == [MISS, MISS]
    finally:
        d.shutdown()
