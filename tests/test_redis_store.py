"""RedisStore against real redis-server processes: one server, a small LRU server, a cluster.

Skipped only where ``redis-server`` is not installed, and never in CI
(``KVTIER_REQUIRE_ALL=1``: see ``needs.py``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
from needs import need_module, need_redis_server
from redis_servers import RedisClusterServers, RedisServer, command, free_port

from kvtier.errors import ConfigError, CorruptBlockError, TierUnavailableError
from kvtier.offload.codec import RawCodec, make_codec, verify
from kvtier.offload.media import ItemFormat, Stored
from kvtier.offload.redis_store import RedisStore

need_redis_server()
redis = need_module("redis", "install the redis extra")
torch = need_module("torch")

# Blocks read back are read-only views of the reply bytes; torch warns once about that.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

SHAPE = (2, 2, 4, 2, 8)
DTYPE = torch.float32
FMT = ItemFormat(make_codec("raw"), SHAPE, DTYPE)
CODEC = RawCodec()


def keys(n: int, seed: int) -> list[int]:
    """``n`` distinct 128-bit keys, the first one with its top bit set."""
    rng = random.Random(seed)
    out = [(1 << 127) | rng.getrandbits(127)]
    while len(out) < n:
        k = rng.getrandbits(128)
        if k not in out:
            out.append(k)
    return out


def blocks(ks: list[int], seed: int = 0) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(SHAPE, generator=gen) for k in ks}


def put_blocks(store: RedisStore, data: dict[int, torch.Tensor]) -> None:
    store.put([(k, i, CODEC.encode(t), FMT) for i, (k, t) in enumerate(data.items())])


def check_block(stored: Stored | None, key: int, expected: torch.Tensor) -> None:
    assert stored is not None, f"block {key:#x} is missing"
    header, payload = stored
    codec = verify(header, payload, key, SHAPE, DTYPE)
    assert torch.equal(codec.decode(payload, SHAPE, DTYPE), expected)


def make_store(url: str, namespace: str = "t1", **kwargs: object) -> RedisStore:
    store = RedisStore(url, **kwargs)  # type: ignore[arg-type]
    store.bind(namespace, 1024, FMT.payload_size)
    return store


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def lru_server() -> Iterator[RedisServer]:
    with RedisServer(("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")) as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers() as servers:
        yield servers


@pytest.fixture
def store(server: RedisServer) -> Iterator[RedisStore]:
    s = make_store(server.url)
    yield s
    s.close()


@pytest.fixture
def raw(server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


# ----------------------------------------------------------------- one server


def test_roundtrip_of_a_batch(store: RedisStore) -> None:
    data = blocks(keys(20, seed=1))
    put_blocks(store, data)
    got = store.get([(k, 0) for k in data])
    assert len(got) == 20
    for (k, t), stored in zip(data.items(), got, strict=True):
        check_block(stored, k, t)
    assert store.available
    assert store.errors == 0


def test_absent_keys_read_back_as_none(store: RedisStore) -> None:
    present = blocks(keys(3, seed=2))
    absent = keys(3, seed=3)
    put_blocks(store, present)
    order = [absent[0], *present, absent[1], absent[2]]
    got = store.get([(k, 0) for k in order])
    assert got[0] is None and got[4] is None and got[5] is None
    for k, stored in zip(present, got[1:4], strict=True):
        check_block(stored, k, present[k])
    assert store.get([]) == []


def test_contains(store: RedisStore) -> None:
    present = blocks(keys(4, seed=4))
    absent = keys(2, seed=5)
    put_blocks(store, present)
    assert store.contains([*present, *absent]) == [True] * 4 + [False] * 2
    assert store.contains([]) == []


def test_key_layout_has_prefix_namespace_and_no_hash_tag(
    server: RedisServer, raw: redis.Redis
) -> None:
    s = make_store(server.url, key_prefix="pfx")
    key = keys(1, seed=6)[0]
    put_blocks(s, blocks([key]))
    name = f"pfx:t1:{key:032x}"
    assert raw.exists(name) == 1
    assert "{" not in name
    s.close()


def test_delete_only_with_delete_on_evict(server: RedisServer, store: RedisStore) -> None:
    data = blocks(keys(4, seed=7))
    put_blocks(store, data)
    items = [(k, 0) for k in data]
    store.delete(items)
    assert store.contains(list(data)) == [True] * 4

    evicting = make_store(server.url, delete_on_evict=True)
    evicting.delete(items[:2])
    assert store.contains(list(data)) == [False, False, True, True]
    evicting.close()


def test_purge_always_deletes(store: RedisStore) -> None:
    data = blocks(keys(3, seed=8))
    put_blocks(store, data)
    assert not store.delete_on_evict
    store.purge([(k, 0) for k in data])
    assert store.contains(list(data)) == [False] * 3
    assert store.get([(k, 0) for k in data]) == [None] * 3


def test_ttl_sets_an_expiry(server: RedisServer, raw: redis.Redis, store: RedisStore) -> None:
    k1, k2 = keys(2, seed=9)
    expiring = make_store(server.url, ttl_s=100)
    put_blocks(expiring, blocks([k1]))
    put_blocks(store, blocks([k2]))
    assert 0 < raw.ttl(f"kvtier:t1:{k1:032x}") <= 100
    assert raw.ttl(f"kvtier:t1:{k2:032x}") == -1  # no expiry without ttl_s
    expiring.close()


def test_namespaces_isolate(server: RedisServer) -> None:
    a, b = make_store(server.url, "t1"), make_store(server.url, "t2")
    key, only_a = keys(2, seed=10)
    da, db = blocks([key, only_a], seed=1), blocks([key], seed=2)
    put_blocks(a, da)
    put_blocks(b, db)
    check_block(a.get([(key, 0)])[0], key, da[key])
    check_block(b.get([(key, 0)])[0], key, db[key])
    assert b.get([(only_a, 0)]) == [None]
    assert b.contains([only_a]) == [False]
    a.close()
    b.close()


def test_corrupt_values_fail_verify(store: RedisStore, raw: redis.Redis) -> None:
    k1, k2 = keys(2, seed=11)
    put_blocks(store, blocks([k1, k2]))
    name1, name2 = f"kvtier:t1:{k1:032x}", f"kvtier:t1:{k2:032x}"
    good = raw.get(name1)
    assert isinstance(good, bytes)

    flipped = bytearray(good)
    flipped[-1] ^= 0x01
    raw.set(name1, bytes(flipped))
    header, payload = store.get([(k1, 0)])[0] or (b"", torch.empty(0))
    with pytest.raises(CorruptBlockError):
        verify(header, payload, k1, SHAPE, DTYPE)

    raw.set(name1, good[: len(good) // 2])
    header, payload = store.get([(k1, 0)])[0] or (b"", torch.empty(0))
    with pytest.raises(CorruptBlockError):
        verify(header, payload, k1, SHAPE, DTYPE)

    raw.set(name2, good)  # block k1's bytes under k2's name
    header, payload = store.get([(k2, 0)])[0] or (b"", torch.empty(0))
    with pytest.raises(CorruptBlockError):
        verify(header, payload, k2, SHAPE, DTYPE)

    raw.set(name1, b"garbage")
    header, payload = store.get([(k1, 0)])[0] or (b"", torch.empty(0))
    with pytest.raises(CorruptBlockError):
        verify(header, payload, k1, SHAPE, DTYPE)

    store.purge([(k1, 0), (k2, 0)])
    assert store.get([(k1, 0), (k2, 0)]) == [None, None]


def test_client_argument_is_used_and_closed(server: RedisServer) -> None:
    client = redis.Redis.from_url(server.url)
    s = RedisStore(client=client)
    s.bind("t1", 1)
    key = keys(1, seed=12)[0]
    data = blocks([key])
    put_blocks(s, data)
    check_block(s.get([(key, 0)])[0], key, data[key])
    s.close()
    s.close()
    with pytest.raises(TierUnavailableError, match="closed"):
        s.get([(key, 0)])
    assert not s.available


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="url="):
        RedisStore()
    with pytest.raises(ConfigError, match="redis://"):
        RedisStore("http://127.0.0.1:6379")
    with pytest.raises(ConfigError, match="ttl_s"):
        RedisStore("redis://127.0.0.1:6379", ttl_s=0)
    with pytest.raises(ConfigError, match="bind"):
        RedisStore("redis://127.0.0.1:6379").get([(1, 0)])


# ----------------------------------------------------- server-side eviction


def test_server_eviction_reads_as_a_miss(lru_server: RedisServer) -> None:
    s = make_store(lru_server.url)
    ks = keys(4000, seed=13)  # ~4.3 MB of blocks into a 2 MB server
    data = blocks(ks, seed=3)
    for i in range(0, len(ks), 200):
        put_blocks(s, {k: data[k] for k in ks[i : i + 200]})
    got = s.get([(k, 0) for k in ks])
    hits = [(k, stored) for k, stored in zip(ks, got, strict=True) if stored is not None]
    assert 0 < len(hits) < len(ks) // 2
    for k, stored in hits:
        check_block(stored, k, data[k])
    assert int(command(lru_server.port, "INFO", "stats").split(b"evicted_keys:")[1].split()[0]) > 0
    assert s.errors == 0 and s.available
    s.close()


# ---------------------------------------------------------------- failures


def test_killed_server_raises_tier_unavailable_then_recovers() -> None:
    with RedisServer() as srv:
        s = make_store(srv.url, retry_interval_s=0.2)
        every_call = make_store(srv.url, retry_interval_s=0)
        data = blocks(keys(5, seed=14))
        items = [(k, 0) for k in data]
        put_blocks(s, data)
        assert every_call.contains(list(data)) == [True] * 5

        srv.stop(kill=True)
        with pytest.raises(TierUnavailableError, match=f"127.0.0.1:{srv.port}") as info:
            put_blocks(s, data)
        assert "server is up" in str(info.value)
        assert not isinstance(info.value, redis.exceptions.RedisError)
        assert s.errors == 1 and not s.available
        with pytest.raises(TierUnavailableError):
            s.get(items)
        with pytest.raises(TierUnavailableError):
            s.contains(list(data))

        for call in (
            lambda: put_blocks(every_call, data),
            lambda: every_call.get(items),
            lambda: every_call.contains(list(data)),
            lambda: every_call.purge(items),
        ):
            with pytest.raises(TierUnavailableError):
                call()
        assert every_call.errors == 4 and not every_call.available

        srv.start()  # same port; data is gone with the killed process
        deadline = time.monotonic() + 5.0
        while True:
            try:
                got = s.get(items)
                break
            except TierUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert got == [None] * 5
        assert s.available
        put_blocks(s, data)
        for (k, t), stored in zip(data.items(), s.get(items), strict=True):
            check_block(stored, k, t)
        assert every_call.contains(list(data)) == [True] * 5
        assert every_call.available
        s.close()
        every_call.close()


def test_circuit_breaker_refuses_without_touching_the_network() -> None:
    with RedisServer() as srv:
        s = make_store(srv.url, retry_interval_s=600)
        key = keys(1, seed=15)[0]
        put_blocks(s, blocks([key]))

        srv.stop(kill=True)
        with pytest.raises(TierUnavailableError, match="cannot reach"):
            s.get([(key, 0)])
        assert (s.errors, s.rejected) == (1, 0)

        # The server is back, so only a call that skips the network can still fail.
        srv.start()
        assert command(srv.port, "PING") == b"PONG"
        for _ in range(3):
            with pytest.raises(TierUnavailableError, match="retried in"):
                s.contains([key])
        assert (s.errors, s.rejected) == (1, 3)
        assert not s.available
        s.close()


def test_nothing_listening_is_unavailable_and_hides_the_password() -> None:
    port = free_port()
    s = make_store(f"redis://:s3cret@127.0.0.1:{port}/0", retry_interval_s=0)
    with pytest.raises(TierUnavailableError) as info:
        s.contains([1])
    assert f"127.0.0.1:{port}" in str(info.value)
    assert "s3cret" not in str(info.value)

    c = make_store(f"redis://127.0.0.1:{port}", cluster=True, retry_interval_s=0)
    with pytest.raises(TierUnavailableError, match="cannot reach"):
        c.get([(1, 0)])
    assert c.errors == 1
    s.close()
    c.close()


# ------------------------------------------------------------------ cluster


def test_cluster_roundtrip_spreads_over_masters(cluster: RedisClusterServers) -> None:
    def dbsizes() -> list[int]:
        sizes = []
        for port in cluster.ports:
            node = redis.Redis(host="127.0.0.1", port=port)
            sizes.append(int(node.dbsize()))
            node.close()
        return sizes

    s = make_store(cluster.url, cluster=True)
    data = blocks(keys(60, seed=16))
    before = dbsizes()
    put_blocks(s, data)
    added = [after - b for after, b in zip(dbsizes(), before, strict=True)]
    assert sum(added) == 60
    assert sum(1 for n in added if n > 0) > 1
    items = [(k, 0) for k in data]
    for (k, t), stored in zip(data.items(), s.get(items), strict=True):
        check_block(stored, k, t)
    assert s.contains(list(data)) == [True] * 60
    absent = keys(3, seed=17)
    assert s.get([(k, 0) for k in absent]) == [None] * 3

    s.purge(items[:10])
    assert s.contains([k for k, _ in items[:12]]) == [False] * 10 + [True] * 2
    s.close()


def test_cluster_master_down_is_unavailable_then_recovers(cluster: RedisClusterServers) -> None:
    s = make_store(cluster.url, cluster=True, retry_interval_s=0.2)
    data = blocks(keys(30, seed=18))
    items = [(k, 0) for k in data]
    put_blocks(s, data)
    victim = cluster.nodes[1]
    try:
        victim.stop(kill=True)
        with pytest.raises(TierUnavailableError, match="cluster") as info:
            s.get(items)
        assert not isinstance(info.value, redis.exceptions.RedisError)
        assert s.errors == 1 and not s.available
    finally:
        victim.start()  # rejoins from its nodes.conf, without the blocks it held
        cluster.wait_ok()
    deadline = time.monotonic() + 15.0
    while True:
        try:
            got = s.get(items)
            break
        except TierUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert s.available
    lost = [stored is None for stored in got]
    assert 0 < sum(lost) < len(items)
    for (k, t), stored in zip(data.items(), got, strict=True):
        if stored is not None:
            check_block(stored, k, t)
    s.purge(items)
    s.close()
