"""kvtier as SGLang's hierarchical-cache storage (L3), against the installed SGLang 0.5.23.

The backend is built by SGLang's own ``StorageBackendFactory`` (the
``dynamic`` backend), subclasses SGLang's abstract ``HiCacheStorage``, and
reads and writes pages of a real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``
allocated on the CPU, on real files and a real redis-server.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from needs import need_module, need_redis_server

need_module("sglang.srt.mem_cache.storage.backend_factory", "run `make venv` (installs SGLang)")
torch = need_module("torch")

from redis_servers import RedisServer  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang_pools import mha_host_pool, mla_host_pool  # noqa: E402

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.errors import UnsupportedReleaseError  # noqa: E402
from kvtier.integrations.sglang import require_sglang  # noqa: E402
from kvtier.integrations.sglang import storage as kst  # noqa: E402

PAGE = 4


def page_hashes(tokens: list[int], prior: str | None = None) -> list[str]:
    """Chained per-page SHA-256 hex digests, the form SGLang's page hashes take."""
    out = []
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        h = hashlib.sha256(bytes.fromhex(prior) if prior else b"")
        h.update(b"".join(t.to_bytes(4, "little") for t in tokens[i : i + PAGE]))
        prior = h.hexdigest()
        out.append(prior)
    return out


def storage_config(tier: str, *, tp_rank: int = 0, mla: bool = False, v1: bool = True,
                   model: str = "org/model") -> Any:
    extra = {
        "backend_name": "kvtier",
        "module_path": kst.MODULE_PATH,
        "class_name": kst.CLASS_NAME,
        "tier": tier,
    }
    if v1:
        extra["interface_v1"] = 1
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model, extra_config=extra,
    )


def backend(tier: str, pool: Any, **config: Any) -> Any:
    """The backend as SGLang's cache controller makes it: factory, then the host pool."""
    made = StorageBackendFactory.create_backend("dynamic", storage_config(tier, **config), pool)
    made.register_mem_pool_host(pool)
    return made


def fill_pages(pool: Any, host_indices: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, host_indices.numel(), PAGE):
        page = pool.get_data_page(int(host_indices[start]), flat=True)
        values = torch.randn(page.numel(), generator=gen).to(page.dtype)
        pool.set_from_flat_data_page(int(host_indices[start]), values)


def pages_of(pool: Any, host_indices: Any) -> list[Any]:
    return [
        pool.get_data_page(int(host_indices[i]), flat=True).clone()
        for i in range(0, host_indices.numel(), PAGE)
    ]


@pytest.fixture
def pool() -> Any:
    return mha_host_pool(page_size=PAGE, layout="page_first")


def test_sglangs_factory_builds_the_backend(tmp_path: Path, pool: Any) -> None:
    store = backend(f"disk:{tmp_path}?size=1MiB", pool)
    assert isinstance(store, HiCacheStorage) and isinstance(store, kst.KvTierHiCacheStorage)
    assert store.interface_v1
    assert store.namespace.startswith("sglang-org-model-tp0of2-")
    assert store.tier is not None and store.tier.capacity == (1 << 20) // store.pages.blob_size


def test_version_gate_says_what_to_install() -> None:
    assert require_sglang() == "0.5.23"
    with pytest.raises(UnsupportedReleaseError, match=r"pip install sglang==0\.5\.23"):
        require_sglang("0.4.9")
    with pytest.raises(UnsupportedReleaseError, match="KVTIER_SGLANG_ALLOW_UNTESTED"):
        require_sglang("0.6.0")


def test_a_missing_tier_url_is_a_config_error(pool: Any) -> None:
    with pytest.raises(ConfigError, match='needs a kvtier tier URL as "tier"'):
        backend("", pool)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_zero_copy_pages_round_trip_exactly(tmp_path: Path, layout: str) -> None:
    pool = mha_host_pool(page_size=PAGE, layout=layout)
    store = backend(f"disk:{tmp_path}?size=1MiB", pool)
    keys = page_hashes(list(range(5 * PAGE)))
    src = pool.alloc(5 * PAGE)
    fill_pages(pool, src, seed=1)
    want = pages_of(pool, src)
    assert store.batch_set_v1(keys, src) == [True] * 5
    assert store.batch_exists(keys) == 5

    dst = pool.alloc(5 * PAGE)
    assert store.batch_get_v1(keys, dst) == [True] * 5
    for a, b in zip(pages_of(pool, dst), want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_batch_exists_is_the_leading_run(tmp_path: Path, pool: Any) -> None:
    store = backend(f"disk:{tmp_path}?size=1MiB", pool)
    keys = page_hashes(list(range(6 * PAGE)))
    idx = pool.alloc(6 * PAGE)
    fill_pages(pool, idx, seed=2)
    stored = [0, 1, 2, 4]  # a hole at 3
    assert all(store.batch_set_v1([keys[i] for i in stored], torch.cat(
        [idx[i * PAGE : (i + 1) * PAGE] for i in stored])))
    assert store.batch_exists(keys) == 3
    assert store.batch_exists(keys[4:]) == 1
    assert store.batch_exists(keys[3:]) == 0
    assert store.exists(keys[4]) and not store.exists(keys[5])


def test_flat_page_interface_round_trips(tmp_path: Path, pool: Any) -> None:
    store = backend(f"disk:{tmp_path}?size=1MiB", pool, v1=False)
    keys = page_hashes(list(range(2 * PAGE)))
    idx = pool.alloc(2 * PAGE)
    fill_pages(pool, idx, seed=3)
    values = pages_of(pool, idx)
    assert store.batch_set(keys, values)
    got = store.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(g, v) for g, v in zip(got, values, strict=True))
    assert store.get(page_hashes([9] * PAGE)[0], pool.get_dummy_flat_data_page()) is None


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_page_fails_its_read_and_is_dropped(
    tmp_path: Path, pool: Any, damage: str
) -> None:
    store = backend(f"disk:{tmp_path}?size=1MiB", pool)
    keys = page_hashes(list(range(3 * PAGE)))
    src = pool.alloc(3 * PAGE)
    fill_pages(pool, src, seed=4)
    store.batch_set_v1(keys, src)
    path = store.tier.medium.path(kst.key_id(keys[1]))
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[200] ^= 1
        path.write_bytes(bytes(raw))
    else:
        path.unlink()
    dst = pool.alloc(3 * PAGE)
    before = pages_of(pool, dst)
    assert store.batch_get_v1(keys, dst) == [True, False, True]
    assert torch.equal(pages_of(pool, dst)[1], before[1])  # nothing written into the pool
    assert store.batch_exists(keys) == 1
    counters = store.tier.counters
    assert (counters.corrupt, counters.vanished) == ((1, 0) if damage == "flip" else (0, 1))
    store.tier.offload_manager.check()


def test_a_restarted_engine_finds_its_pages(tmp_path: Path, pool: Any) -> None:
    url = f"disk:{tmp_path}?size=1MiB"
    keys = page_hashes(list(range(3 * PAGE)))
    src = pool.alloc(3 * PAGE)
    fill_pages(pool, src, seed=5)
    backend(url, pool).batch_set_v1(keys, src)

    again = backend(url, pool)
    assert again.batch_exists(keys) == 3
    dst = pool.alloc(3 * PAGE)
    assert again.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(pages_of(pool, dst), pages_of(pool, src),
                                                    strict=True))


def test_ranks_and_models_are_namespaced(tmp_path: Path, pool: Any) -> None:
    url = f"disk:{tmp_path}?size=1MiB"
    keys = page_hashes(list(range(PAGE)))
    src = pool.alloc(PAGE)
    fill_pages(pool, src, seed=6)
    backend(url, pool, tp_rank=0).batch_set_v1(keys, src)
    assert backend(url, pool, tp_rank=0).batch_exists(keys) == 1
    assert backend(url, pool, tp_rank=1).batch_exists(keys) == 0
    assert backend(url, pool, model="org/other").batch_exists(keys) == 0


def test_mla_pages_are_shared_by_every_tp_rank(tmp_path: Path) -> None:
    pool = mla_host_pool(page_size=PAGE)
    url = f"disk:{tmp_path}?size=1MiB"
    keys = page_hashes(list(range(2 * PAGE)))
    src = pool.alloc(2 * PAGE)
    fill_pages(pool, src, seed=7)
    assert backend(url, pool, tp_rank=0, mla=True).batch_set_v1(keys, src) == [True, True]
    other = backend(url, pool, tp_rank=1, mla=True)
    dst = pool.alloc(2 * PAGE)
    assert other.batch_get_v1(keys, dst) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(pages_of(pool, dst), pages_of(pool, src),
                                                    strict=True))


def test_the_policy_bounds_the_tier(tmp_path: Path, pool: Any) -> None:
    blob = backend("host:1MiB", pool).pages.blob_size
    store = backend(f"disk:{tmp_path}?size={4 * blob}&policy=lru", pool)
    keys = page_hashes(list(range(6 * PAGE)))
    idx = pool.alloc(6 * PAGE)
    fill_pages(pool, idx, seed=8)
    assert store.batch_set_v1(keys[:4], idx[: 4 * PAGE]) == [True] * 4
    store.batch_get_v1(keys[:2], pool.alloc(2 * PAGE))  # the first two are reused
    assert store.batch_set_v1(keys[4:], idx[4 * PAGE :]) == [True, True]
    held = [store.tier.offload_manager.is_ready(kst.key_id(k)) for k in keys]
    assert held == [True, True, False, False, True, True]
    assert len(list(tmp_path.rglob("*.kvb"))) == 4


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    need_redis_server()
    need_module("redis", "install the redis extra")
    with RedisServer() as server:
        yield server


def test_engines_share_pages_through_redis(redis_server: RedisServer, pool: Any) -> None:
    url = f"{redis_server.url}?size=1MiB"
    keys = page_hashes(list(range(3 * PAGE)))
    src = pool.alloc(3 * PAGE)
    fill_pages(pool, src, seed=9)
    assert all(backend(url, pool).batch_set_v1(keys, src))
    other = backend(url, pool)  # another engine: knows nothing, asks Redis
    assert other.batch_exists(keys) == 3
    dst = pool.alloc(3 * PAGE)
    assert other.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(pages_of(pool, dst), pages_of(pool, src),
                                                    strict=True))


def test_a_redis_outage_reads_nothing_and_recovers(redis_server: RedisServer, pool: Any) -> None:
    store = backend(f"{redis_server.url}?size=1MiB", pool)
    store.tier.retry_interval_s = 0.0
    keys = page_hashes(list(range(2 * PAGE)))
    src = pool.alloc(2 * PAGE)
    fill_pages(pool, src, seed=10)
    store.batch_set_v1(keys, src)
    redis_server.stop(kill=True)
    dst = pool.alloc(2 * PAGE)
    assert store.batch_get_v1(keys, dst) == [False, False]
    # Pages it holds still count as held (the outage is no proof they are lost);
    # new pages are not written.
    fresh = page_hashes(list(range(100, 100 + 2 * PAGE)))
    assert store.batch_set_v1(fresh, src) == [False, False]
    assert store.batch_exists(fresh) == 0
    assert store.tier.counters.unavailable >= 2
    redis_server.start()  # back, empty: what it held is gone
    deadline = time.monotonic() + 15
    while True:  # the client waits a moment before it tries a failed server again
        store.batch_set_v1(keys, src)
        if store.batch_get_v1(keys, dst) == [True, True]:
            break
        assert time.monotonic() < deadline, "the tier did not come back"
        time.sleep(0.2)
    assert all(torch.equal(a, b) for a, b in zip(pages_of(pool, dst), pages_of(pool, src),
                                                    strict=True))
    assert store.tier.counters.vanished == 2  # the pages Redis lost, found out on a read
