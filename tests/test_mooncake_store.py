"""MooncakeStore against a real ``mooncake_master`` and storage node on loopback.

Blocks go through the medium and come back checksummed; a damaged or
missing object is a miss; a killed master makes calls fail fast with
TierUnavailableError and a restarted one serves again; two engines share
blocks through one master; and a state machine checks put / get / purge /
contains against a dict. Skipped only where the mooncake package cannot be
imported, and never in CI (``KVTIER_REQUIRE_ALL=1``: see ``needs.py``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from mooncake_servers import MooncakePool, free_port, mooncake_binary, mooncake_import_error
from needs import missing, need_module

torch = need_module("torch")
if (why := mooncake_import_error()) is not None:
    missing(
        f"the Python module mooncake.store ({why})",
        "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 and apt-get install "
        "libibverbs1",
    )
if mooncake_binary("mooncake_master") is None or mooncake_binary("mooncake_client") is None:
    missing("mooncake_master / mooncake_client", "reinstall mooncake-transfer-engine-non-cuda")

import mooncake.store  # type: ignore[import-untyped]  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

from kvtier.errors import ConfigError, CorruptBlockError, TierUnavailableError  # noqa: E402
from kvtier.offload.codec import RawCodec, make_codec, verify  # noqa: E402
from kvtier.offload.config import TierSpec  # noqa: E402
from kvtier.offload.media import ItemFormat, Stored  # noqa: E402
from kvtier.offload.mooncake_store import MooncakeStore  # noqa: E402
from kvtier.offload.registry import make_medium, probe_medium  # noqa: E402

# Blocks read back are views of a buffer torch did not allocate; it warns once about that.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

SHAPE = (2, 2, 4, 2, 8)
DTYPE = torch.float32
FMT = ItemFormat(make_codec("raw"), SHAPE, DTYPE)
CODEC = RawCodec()
_T = TypeVar("_T")


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


def put_blocks(store: MooncakeStore, data: dict[int, torch.Tensor]) -> None:
    store.put([(k, i, CODEC.encode(t), FMT) for i, (k, t) in enumerate(data.items())])


def check_block(stored: Stored | None, key: int, expected: torch.Tensor) -> None:
    assert stored is not None, f"block {key:#x} is missing"
    header, payload = stored
    codec = verify(header, payload, key, SHAPE, DTYPE)
    assert torch.equal(codec.decode(payload, SHAPE, DTYPE), expected)


def make_store(pool: MooncakePool, namespace: str = "t1", **kwargs: Any) -> MooncakeStore:
    kwargs.setdefault("segment_bytes", 0)  # the pool's storage node holds the data
    kwargs.setdefault("buffer_bytes", 16 << 20)
    store = MooncakeStore(pool.address, metadata=pool.metadata, **kwargs)
    store.bind(namespace, 1024, FMT.payload_size)
    return store


def eventually(fn: Callable[[], _T], timeout_s: float = 30.0) -> _T:
    """``fn()`` once it stops raising TierUnavailableError (a master coming back)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except TierUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture(scope="module")
def pool() -> Iterator[MooncakePool]:
    with MooncakePool() as p:
        yield p


@pytest.fixture(scope="module")
def raw(pool: MooncakePool) -> Iterator[Any]:
    """A plain Mooncake client of the same pool, for what kvtier would never write."""
    client = mooncake.store.MooncakeDistributedStore()
    assert client.setup("127.0.0.1", pool.metadata, 0, 16 << 20, "tcp", "", pool.address) == 0
    yield client
    client.close()


@pytest.fixture
def store(pool: MooncakePool) -> Iterator[MooncakeStore]:
    s = make_store(pool)
    yield s
    s.close()


# ------------------------------------------------------------------ round trips


def test_roundtrip_of_a_batch(store: MooncakeStore) -> None:
    data = blocks(keys(40, seed=1))
    put_blocks(store, data)
    got = store.get([(k, 0) for k in data])
    assert len(got) == 40
    for (k, t), stored in zip(data.items(), got, strict=True):
        check_block(stored, k, t)
    assert store.available and store.errors == 0
    put_blocks(store, data)  # storing a block again is harmless
    check_block(store.get([(next(iter(data)), 0)])[0], next(iter(data)), next(iter(data.values())))


def test_a_batch_larger_than_the_staging_buffer_is_split(pool: MooncakePool) -> None:
    s = make_store(pool, buffer_bytes=1 << 20)  # 256 KiB per transfer, blocks of ~2 KiB
    data = blocks(keys(600, seed=2), seed=2)
    put_blocks(s, data)
    got = s.get([(k, 0) for k in data])
    for (k, t), stored in zip(data.items(), got, strict=True):
        check_block(stored, k, t)
    s.purge([(k, 0) for k in data])
    s.close()


def test_blocks_outlive_the_reader_and_its_staging_buffer(store: MooncakeStore) -> None:
    data = blocks(keys(8, seed=3), seed=3)
    put_blocks(store, data)
    got = store.get([(k, 0) for k in data])
    store.get([(k, 0) for k in data])  # reuses the staging buffer
    store.close()
    for (k, t), stored in zip(data.items(), got, strict=True):
        check_block(stored, k, t)


def test_repeated_keys_in_one_batch(store: MooncakeStore) -> None:
    # Mooncake's own batch calls return wrong objects for a name asked twice in a batch.
    k1, k2, absent = keys(3, seed=30)
    data = blocks([k1, k2], seed=30)
    store.put([(k, 0, CODEC.encode(data[k]), FMT) for k in (k1, k2, k1)])
    got = store.get([(k, 0) for k in (k1, k1, absent, k2, k1, absent)])
    for i in (0, 1, 4):
        check_block(got[i], k1, data[k1])
    check_block(got[3], k2, data[k2])
    assert got[2] is None and got[5] is None
    assert store.contains([k1, absent, k1, k2]) == [True, False, True, True]
    store.purge([(k1, 0), (k1, 0)])
    assert store.contains([k1, k2]) == [False, True]


def test_absent_keys_read_back_as_none_and_contains(store: MooncakeStore) -> None:
    present = blocks(keys(3, seed=4))
    absent = keys(3, seed=5)
    put_blocks(store, present)
    order = [absent[0], *present, absent[1], absent[2]]
    got = store.get([(k, 0) for k in order])
    assert got[0] is None and got[4] is None and got[5] is None
    for k, stored in zip(present, got[1:4], strict=True):
        check_block(stored, k, present[k])
    assert store.contains([*present, *absent]) == [True] * 3 + [False] * 3
    assert store.get([]) == [] and store.contains([]) == []


def test_object_names_carry_prefix_and_namespace(pool: MooncakePool, raw: Any) -> None:
    s = make_store(pool, key_prefix="pfx")
    key = keys(1, seed=6)[0]
    put_blocks(s, blocks([key]))
    assert raw.is_exist(f"pfx:t1:{key:032x}") == 1
    assert raw.is_exist(f"kvtier:t1:{key:032x}") == 0
    s.close()


def test_namespaces_isolate(pool: MooncakePool) -> None:
    a, b = make_store(pool, "n1"), make_store(pool, "n2")
    key, only_a = keys(2, seed=7)
    da, db = blocks([key, only_a], seed=1), blocks([key], seed=2)
    put_blocks(a, da)
    put_blocks(b, db)
    check_block(a.get([(key, 0)])[0], key, da[key])
    check_block(b.get([(key, 0)])[0], key, db[key])
    assert b.get([(only_a, 0)]) == [None]
    assert b.contains([only_a]) == [False]
    a.close()
    b.close()


def test_delete_only_with_delete_on_evict_and_purge_always(pool: MooncakePool) -> None:
    s = make_store(pool)
    evicting = make_store(pool, delete_on_evict=True)
    data = blocks(keys(4, seed=8))
    put_blocks(s, data)
    items = [(k, 0) for k in data]
    s.delete(items)
    assert s.contains(list(data)) == [True] * 4
    evicting.delete(items[:2])  # right after the put: the objects still hold a lease
    assert s.contains(list(data)) == [False, False, True, True]
    s.purge(items)
    s.purge(items)  # purging what is gone is not an error
    assert s.get(items) == [None] * 4
    s.close()
    evicting.close()


def test_a_store_with_its_own_segment(pool: MooncakePool) -> None:
    s = make_store(pool, segment_bytes=32 << 20)
    data = blocks(keys(10, seed=9), seed=9)
    put_blocks(s, data)
    for (k, t), stored in zip(data.items(), s.get([(k, 0) for k in data]), strict=True):
        check_block(stored, k, t)
    s.purge([(k, 0) for k in data])
    s.close()


def test_http_metadata_server() -> None:
    with MooncakePool(http_metadata=True, segment="64MB") as p:
        spec = TierSpec.from_url(p.url + "&size=1MiB")
        assert dict(spec.options)["metadata"] == p.metadata
        s = make_medium(spec.medium, spec.location, dict(spec.options))
        assert isinstance(s, MooncakeStore)
        s.bind("h", 16, FMT.payload_size)
        data = blocks(keys(5, seed=10))
        put_blocks(s, data)
        for (k, t), stored in zip(data.items(), s.get([(k, 0) for k in data]), strict=True):
            check_block(stored, k, t)
        s.close()


# ---------------------------------------------------------- corrupt and missing


def test_corrupt_objects_fail_verify_and_purge_removes_them(store: MooncakeStore, raw: Any) -> None:
    k1, k2 = keys(2, seed=11)
    put_blocks(store, blocks([k1, k2]))
    name1, name2 = store.object_name(k1), store.object_name(k2)
    good = raw.get(name1)
    assert isinstance(good, bytes) and len(good) > 0

    def read(key: int) -> Stored:
        stored = store.get([(key, 0)])[0]
        assert stored is not None
        return stored

    flipped = bytearray(good)
    flipped[-1] ^= 0x01
    for name, value, key in (
        (name1, bytes(flipped), k1),  # a bit flipped in the payload
        (name1, good[: len(good) // 2], k1),  # truncated
        (name2, good, k2),  # another block's bytes under this name
        (name1, b"garbage", k1),  # not a block at all
    ):
        assert raw.upsert(name, value) == 0
        with pytest.raises(CorruptBlockError):
            verify(*read(key), key, SHAPE, DTYPE)

    store.purge([(k1, 0), (k2, 0)])
    assert store.get([(k1, 0), (k2, 0)]) == [None, None]
    assert raw.is_exist(name1) == 0


def test_an_object_removed_behind_the_stores_back_is_a_miss(store: MooncakeStore, raw: Any) -> None:
    data = blocks(keys(3, seed=12))
    put_blocks(store, data)
    gone = next(iter(data))
    assert raw.remove(store.object_name(gone), True) == 0
    got = store.get([(k, 0) for k in data])
    assert got[0] is None and got[1] is not None and got[2] is not None
    assert store.contains(list(data)) == [False, True, True]
    assert store.available


def test_a_lost_storage_node_is_a_miss_not_a_failure() -> None:
    with MooncakePool(segment="64MB") as p:
        s = make_store(p)
        data = blocks(keys(4, seed=13))
        put_blocks(s, data)
        p.storage.stop(kill=True)
        # The master still lists the objects until the node's TTL ends; reading
        # them fails in transfer, which the store reports as a miss.
        assert s.get([(k, 0) for k in data]) == [None] * 4
        assert s.available
        s.close()


# ------------------------------------------------------------------- failures


def test_master_killed_fails_fast_then_recovers() -> None:
    with MooncakePool(segment="64MB") as p:
        s = make_store(p, retry_interval_s=0.2)
        data = blocks(keys(5, seed=14))
        items = [(k, 0) for k in data]
        put_blocks(s, data)
        assert s.contains(list(data)) == [True] * 5

        p.master.stop(kill=True)
        failures = 0
        for call in (
            lambda: put_blocks(s, data),
            lambda: s.get(items),
            lambda: s.contains(list(data)),
            lambda: s.purge(items),
        ):
            time.sleep(0.25)  # past the retry interval: each call reaches for the master
            started = time.monotonic()
            with pytest.raises(TierUnavailableError, match=f"127.0.0.1:{p.master.rpc_port}"):
                call()
            failures += 1
            # Never Mooncake's own multi-second reconnect: the TCP check fails first.
            assert time.monotonic() - started < 2.0
        assert s.errors == failures and not s.available
        with pytest.raises(TierUnavailableError, match="retried in"):
            s.get(items)  # inside the retry interval: refused without a network attempt
        assert s.rejected >= 1

        p.master.start()  # same ports; a restarted master knows no objects
        assert eventually(lambda: s.get(items)) == [None] * 5

        def store_again() -> list[Stored | None]:
            put_blocks(s, data)  # fails until the storage node has mounted its segment again
            return s.get(items)

        for (k, t), stored in zip(data.items(), eventually(store_again), strict=True):
            check_block(stored, k, t)
        assert s.available
        s.close()


def test_no_master_at_all_is_unavailable_quickly_and_probed() -> None:
    port = free_port()
    s = MooncakeStore(f"127.0.0.1:{port}", segment_bytes=0, retry_interval_s=0)
    s.bind("t1", 8, FMT.payload_size)
    started = time.monotonic()
    with pytest.raises(TierUnavailableError, match="mooncake_master --rpc_port"):
        s.contains([1])
    assert time.monotonic() - started < 2.0
    s.close()
    with pytest.raises(TierUnavailableError, match="closed"):
        s.get([(1, 0)])
    warning = probe_medium("mooncake", f"127.0.0.1:{port}", {}, 0.5)
    assert warning is not None and f"--rpc_port={port}" in warning


def test_probe_of_a_running_master(pool: MooncakePool) -> None:
    spec = TierSpec.from_url(pool.url)
    assert spec.probe() is None


# ------------------------------------------------------------ URLs and the CLI


def test_tier_urls_parse() -> None:
    spec = TierSpec.from_url(
        "mooncake://10.0.0.5:50051?size=8GiB&segment=2GiB&buffer=128MiB&prefix=pf"
        "&metadata=http://10.0.0.5:8080/metadata&replicas=2&delete_on_evict=true"
    )
    assert spec.medium == "mooncake" and spec.location == "10.0.0.5:50051"
    assert spec.size_bytes == 8 * 2**30
    store = make_medium(spec.medium, spec.location, dict(spec.options))
    assert isinstance(store, MooncakeStore)
    assert (store.host, store.port) == ("10.0.0.5", 50051)
    assert store.segment_bytes == 2 * 2**30 and store.buffer_bytes == 128 * 2**20
    assert store.key_prefix == "pf" and store.replicas == 2 and store.delete_on_evict
    assert store.metadata == "http://10.0.0.5:8080/metadata"
    assert store.caps.shared and store.caps.purge and not store.caps.persistent
    store.close()
    # describe() writes a URL from_url reads back to the same tier.
    assert TierSpec.from_url(spec.describe()) == spec
    default = make_medium("mooncake", "127.0.0.1:50051", {})
    assert isinstance(default, MooncakeStore) and default.metadata == "P2PHANDSHAKE"
    default.close()


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("mooncake://10.0.0.5?size=1GiB", "host:port"),
        ("mooncake://10.0.0.5:0", "host:port"),
        ("mooncake://10.0.0.5:50051?colour=red", "no option colour"),
        ("mooncake://10.0.0.5:50051?metadata=etcd://x", "P2PHANDSHAKE"),
        ("mooncake://10.0.0.5:50051?segment=lots", "segment|size|lots"),
        ("mooncake://10.0.0.5:50051?replicas=0", "replicas"),
        ("mooncake://10.0.0.5:50051?protocol=udp", "tcp or rdma"),
        ("mooncake://10.0.0.5:50051?delete_on_evict=maybe", "true or false"),
        ("mooncake://10.0.0.5:50051?buffer=1KiB", "buffer"),
    ],
)
def test_bad_tier_urls_are_config_errors(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TierSpec.from_url(url)


def test_kvtier_serve_tier_flag_parses_a_mooncake_url() -> None:
    from kvtier.cli import build_parser
    from kvtier.cli.serve import engine_config

    parser, _ = build_parser()
    args = parser.parse_args(
        ["serve", "--tier", "host:64MiB", "--tier", "mooncake://127.0.0.1:50051?size=1GiB"]
    )
    tiers = engine_config(args).tiers
    assert [t.medium for t in tiers] == ["host", "mooncake"]
    assert tiers[1].location == "127.0.0.1:50051" and tiers[1].size_bytes == 2**30


# --------------------------------------------------------------- two engines


def test_two_engines_share_blocks_through_one_master(pool: MooncakePool) -> None:
    from tiny_model import solo_greedy, tiny_model_and_tokenizer

    from kvtier.engine import Engine, SamplingParams

    model, tok = tiny_model_and_tokenizer()
    url = pool.url + "&size=4MiB&prefix=engines"
    kw: dict[str, Any] = {"model_id": "tiny", "block_size": 4, "num_blocks": 64}
    a = Engine(model, tok, tiers=[TierSpec.from_url(url)], **kw)
    b = Engine(model, tok, tiers=[TierSpec.from_url(url)], **kw)
    assert a.tier_chain is not None and b.tier_chain is not None
    assert a.tier_chain.write_mode == "write_through"  # a shared medium
    prompt = list(range(5, 5 + 41))
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = [t for o in a.generate(prompt, p) for t in o.token_ids]
    a.tier_chain.flush()
    # b never saw this prompt: its prefix comes from what a stored in Mooncake.
    second = [t for o in b.generate(prompt, p) for t in o.token_ids]
    assert first == second == solo_greedy(model, prompt, 4)
    assert b.counters.loaded_prompt_tokens == 40
    assert b.tier_chain.stats()["mooncake"]["adopted_blocks"] > 0
    a.close()
    b.close()


def test_engine_requests_survive_a_master_restart() -> None:
    from tiny_model import solo_greedy, tiny_model_and_tokenizer

    from kvtier.engine import Engine, SamplingParams
    from kvtier.offload.host import HostStore
    from kvtier.offload.tier import Tier

    model, tok = tiny_model_and_tokenizer()
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 60, (29,), generator=g).tolist() for _ in range(4)]
    expected = [solo_greedy(model, q, 4) for q in prompts]

    def outputs(engine: Engine) -> list[list[int]]:
        return [[t for o in engine.generate(q, p) for t in o.token_ids] for q in prompts]

    with MooncakePool(segment="64MB") as pool:
        medium = MooncakeStore(
            pool.address, segment_bytes=0, buffer_bytes=16 << 20, retry_interval_s=0.2
        )
        eng = Engine(
            model,
            tok,
            model_id="tiny",
            block_size=4,
            num_blocks=20,
            tiers=[Tier(HostStore(), 6), Tier(medium, 500)],
            write_mode="write_through",
        )
        chain = eng.tier_chain
        assert chain is not None
        assert outputs(eng) == expected
        chain.flush()
        stored_before = chain.stats()["mooncake"]["stored_blocks"]
        assert stored_before > 0

        pool.master.stop(kill=True)
        # The master is gone: every request still completes, from host memory or recomputed.
        for _round in range(2):
            assert outputs(eng) == expected
        chain.flush()
        st = chain.stats()["mooncake"]
        assert st["unavailable_errors"] + st["store_failures"] > 0

        pool.master.start()
        deadline = time.monotonic() + 30
        while chain.stats()["mooncake"]["stored_blocks"] <= stored_before:
            assert time.monotonic() < deadline, "the Mooncake tier never came back"
            assert outputs(eng) == expected
            chain.flush()
            time.sleep(0.3)
        chain.check()
        eng.close()


# ------------------------------------------------------- against a dict model


class MooncakeVsDict(RuleBasedStateMachine):
    """put / get / purge / contains on the real pool agree with a dict."""

    pool: MooncakePool
    round = 0

    def __init__(self) -> None:
        super().__init__()
        # A fresh namespace per example: what earlier examples stored is invisible.
        MooncakeVsDict.round += 1
        self.store = make_store(self.pool, f"sm{MooncakeVsDict.round}", buffer_bytes=1 << 20)
        self.model: dict[int, torch.Tensor] = {}
        self.keys = keys(12, seed=100)

    @rule(picks=st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True))
    def put(self, picks: list[int]) -> None:
        fresh = {self.keys[i]: torch.full(SHAPE, float(i + MooncakeVsDict.round)) for i in picks}
        put_blocks(self.store, fresh)
        for k, t in fresh.items():
            self.model.setdefault(k, t)  # an object that exists is kept as it is

    @rule(picks=st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True))
    def purge(self, picks: list[int]) -> None:
        chosen = [self.keys[i] for i in picks]
        self.store.purge([(k, 0) for k in chosen])
        for k in chosen:
            self.model.pop(k, None)

    @rule(picks=st.lists(st.integers(0, 11), min_size=1, max_size=12))
    def get(self, picks: list[int]) -> None:
        chosen = [self.keys[i] for i in picks]
        for k, stored in zip(chosen, self.store.get([(k, 0) for k in chosen]), strict=True):
            if k in self.model:
                check_block(stored, k, self.model[k])
            else:
                assert stored is None

    @invariant()
    def contains_agrees(self) -> None:
        assert self.store.contains(self.keys) == [k in self.model for k in self.keys]

    def teardown(self) -> None:
        self.store.purge([(k, 0) for k in self.keys])
        self.store.close()


def test_state_machine_against_a_dict(pool: MooncakePool) -> None:
    MooncakeVsDict.pool = pool
    MooncakeVsDict.TestCase.settings = settings(
        max_examples=15,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    MooncakeVsDict.TestCase().runTest()
