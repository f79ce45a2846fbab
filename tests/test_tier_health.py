"""Degraded tiers are logged once per episode and their bookkeeping follows the medium.

A Redis killed and restarted logs one warning when it goes and one when it
comes back, not one per failed call; blocks a medium lost behind the
chain's back (a flushed Redis, a deleted directory) leave the tier's count;
a disk directory removed at runtime is made again; pressure-mode flaps are
summarised. Real redis-server processes, real files, real tensors.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from needs import need_redis_server
from redis_servers import RedisServer, command

from kvtier import KVCacheManager
from kvtier.engine import KvTierCache
from kvtier.layout import KVLayout
from kvtier.offload.chain import Tier, TierChain
from kvtier.offload.config import TierSpec
from kvtier.offload.disk import DiskStore
from kvtier.offload.redis_store import RedisStore
from kvtier.pressure import Ladder, PressureController, ScriptedMonitor
from kvtier.storage import KVBlockStorage

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype="float32")

@pytest.fixture
def needs_redis() -> None:
    need_redis_server()


def device(num_blocks: int = 8) -> tuple[KVBlockStorage, KVCacheManager]:
    return KVBlockStorage(LAYOUT, num_blocks), KVCacheManager(num_blocks, BS)


def compute(storage: KVBlockStorage, mgr: KVCacheManager, rid: str, tokens: list[int]) -> None:
    alloc = mgr.allocate(rid, tokens)
    blocks = alloc.block_table.blocks
    storage.import_blocks(blocks, torch.randn((len(blocks), *storage.block_shape)))
    mgr.free(rid)


def prompt(base: int, n_blocks: int) -> list[int]:
    return [base + i for i in range(n_blocks * BS + 1)]


def warnings_from(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and needle in r.getMessage()
    ]


@pytest.mark.usefixtures("needs_redis")
def test_a_redis_outage_is_logged_once_and_its_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvtier")
    with RedisServer() as server:
        storage, mgr = device(8)
        store = RedisStore(server.url, retry_interval_s=0.0, socket_timeout_s=0.5)
        chain = TierChain(storage, mgr, [Tier(store, 64, write_mode="write_through")])
        for i in range(3):
            cache = KvTierCache(storage, mgr, f"up{i}", prompt(100 * i, 2), tiers=chain)
            cache.release()
        chain.flush()
        server.stop(kill=True)
        for i in range(12):  # every lookup and store fails now
            cache = KvTierCache(storage, mgr, f"down{i}", prompt(5000 + 100 * i, 2), tiers=chain)
            cache.release()
            chain.flush()
        errors = chain.stats()["redis"]["unavailable_errors"]
        assert errors >= 12
        assert len(warnings_from(caplog, "cannot be reached")) == 1
        server.start()
        for i in range(3):
            cache = KvTierCache(storage, mgr, f"back{i}", prompt(9000 + 100 * i, 2), tiers=chain)
            cache.release()
            chain.flush()
        back = warnings_from(caplog, "answers again")
        assert len(back) == 1 and "failures" in back[0]
        assert len(warnings_from(caplog, "cannot be reached")) == 1
        chain.close()


@pytest.mark.usefixtures("needs_redis")
def test_blocks_redis_lost_leave_the_bookkeeping(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier")
    with RedisServer() as server:
        storage, mgr = device(8)
        chain = TierChain(
            storage,
            mgr,
            [Tier(RedisStore(server.url), 64)],  # shared: writes through by default
            reconcile_interval_s=3600,
        )
        for i in range(4):
            rid = f"r{i}"
            alloc = mgr.allocate(rid, prompt(1000 * i, 3))
            blocks = alloc.block_table.blocks[:3]
            storage.import_blocks(blocks, torch.randn((3, *storage.block_shape)))
            chain.store_computed(mgr.block_keys(rid), blocks)  # as a forward pass would
            mgr.free(rid)
        chain.flush()
        tracked = chain.stats()["redis"]["used_blocks"]
        assert tracked == 12
        # Redis loses a third of them on its own (its eviction, a restart without persistence).
        keys = [k.decode() for k in _keys(server.url)]
        for name in keys[:4]:
            command(server.port, "DEL", name)
        assert chain.reconcile() == 4
        assert chain.stats()["redis"]["used_blocks"] == 8 == len(_keys(server.url))
        assert chain.stats()["redis"]["reconciled_blocks"] == 4
        assert warnings_from(caplog, "no longer holds 4 blocks")
        command(server.port, "FLUSHALL")
        chain.reconcile_interval_s = 0.0  # poll() reconciles on its own from now on
        chain.poll()
        assert chain.stats()["redis"]["used_blocks"] == 0
        chain.check()
        chain.close()


def _keys(url: str) -> list[bytes]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return list(client.keys("*"))
    finally:
        client.close()


def test_a_removed_disk_directory_is_made_again_and_reconciled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvtier")
    storage, mgr = device(8)
    root = tmp_path / "tier"
    chain = TierChain(storage, mgr, [Tier(DiskStore(root), 64)], reconcile_interval_s=3600)
    for i in range(3):  # fill the device; evictions demote to disk
        compute(storage, mgr, f"a{i}", prompt(1000 * (i + 1), 4))
    chain.flush()
    before = chain.stats()["disk"]["used_blocks"]
    assert before > 0
    shutil.rmtree(root)
    for i in range(3):
        compute(storage, mgr, f"b{i}", prompt(7000 + 1000 * i, 4))
    chain.flush()
    assert warnings_from(caplog, "disappeared; creating it again")
    stats = chain.stats()["disk"]
    assert stats["store_failures"] == 0, "writes must go on after the directory is gone"
    assert any(root.rglob("*.kvb"))
    dropped = chain.reconcile()
    assert dropped == before
    assert chain.stats()["disk"]["used_blocks"] == len(list(root.rglob("*.kvb")))
    chain.check()
    chain.close()


def test_a_disk_that_cannot_store_is_logged_once_per_episode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvtier")
    storage, mgr = device(8)
    root = tmp_path / "tier"
    store = DiskStore(root)
    chain = TierChain(storage, mgr, [Tier(store, 256)], reconcile_interval_s=3600)
    shutil.rmtree(root)
    root.write_text("not a directory")  # every write fails now
    for i in range(6):
        compute(storage, mgr, f"a{i}", prompt(1000 * (i + 1), 4))
        chain.flush()
    assert chain.stats()["disk"]["store_failures"] > 6
    failing = warnings_from(caplog, "cannot be reached") + warnings_from(caplog, "fails (")
    assert len(failing) == 1, failing
    root.unlink()
    for i in range(3):
        compute(storage, mgr, f"b{i}", prompt(20000 + 1000 * i, 4))
        chain.flush()
    assert len(warnings_from(caplog, "answers again")) == 1
    chain.close()


def test_pressure_flaps_are_summarised(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.pressure")
    readings = [0.86, 0.70] * 100  # across PRESSURE's threshold and back, 200 times
    monitor = ScriptedMonitor(0.0, total=1000, script=readings)
    ctrl = PressureController(monitor, Ladder(), log_interval=3600)
    for _ in readings:
        ctrl.sample()
    assert ctrl.mode_changes >= 199
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.pressure"]
    assert len(lines) == 1, lines  # the first change; the rest wait for the summary
    ctrl._mode_log.flush(float("inf"), ctrl.mode)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.pressure"]
    assert len(lines) == 2 and "more times" in lines[1] and "hysteresis" in lines[1]


def test_unreachable_redis_is_a_warning_at_startup() -> None:
    from redis_servers import free_port

    spec = TierSpec("redis", 2**20, location=f"redis://127.0.0.1:{free_port()}/0")
    warning = spec.probe(timeout_s=0.5)
    assert warning is not None and "cannot reach Redis" in warning
    assert "Serving without the Redis tier until it answers" in warning


def test_an_unusable_disk_directory_is_an_error_at_startup(tmp_path: Path) -> None:
    from kvtier.errors import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot be used"):
        TierSpec("disk", 2**20, location=str(blocker / "sub")).probe()
    assert TierSpec("disk", 2**20, location=str(tmp_path / "ok")).probe() is None
