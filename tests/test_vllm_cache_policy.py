"""kvtier policies inside vLLM 0.33's real CPUOffloadingManager (KvTierCachePolicy)."""

from __future__ import annotations

from typing import Any

import pytest
from needs import need_module

need_module("vllm.v1.kv_offload.cpu.manager")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from kvtier.integrations.vllm import cache_policy as cp  # noqa: E402
from kvtier.policy import available_policies  # noqa: E402

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
SHIPPED = ["arc", "fifo", "gdsf", "hybrid", "lfu", "lru", "s3fifo", "sieve"]
POLICIES = available_policies()


def K(name: str) -> Any:
    """The offload key of block ``name`` in KV cache group 0."""
    return make_offload_key(name.encode(), 0)


def names(keys: Any) -> list[str]:
    return [bytes(k[:-4]).decode() for k in keys]


class Driver:
    """A CPUOffloadingManager with a kvtier policy, driven the way vLLM's scheduler drives it."""

    def __init__(self, capacity: int, policy: str) -> None:
        self.m = CPUOffloadingManager(
            capacity,
            cache_policy=cp.policy_class_name(*policy.split("+")) if "+" in policy
            else f"kvtier:{policy}",
            cache_policy_module_path=cp.MODULE_PATH,
            enable_events=True,
        )
        self.policy: cp.KvTierCachePolicy = self.m._policy
        self.capacity = capacity
        self._n = 0

    def request(self) -> ReqContext:
        self._n += 1
        ctx = ReqContext(req_id=f"r{self._n}")
        self.m.on_new_request(ctx)
        return ctx

    def lookup(self, ctx: ReqContext, *blocks: str) -> list[LookupResult]:
        return [self.m.lookup(K(b), ctx) for b in blocks]

    def prepare_store(self, ctx: ReqContext, *blocks: str) -> tuple[list[str], list[str]] | None:
        out = self.m.prepare_store([K(b) for b in blocks], ctx)
        if out is None:
            return None
        return names(out.keys_to_store), names(out.evicted_keys)

    def store(self, ctx: ReqContext, *blocks: str, success: bool = True) -> list[str]:
        """prepare_store + complete_store; returns the evicted blocks."""
        out = self.prepare_store(ctx, *blocks)
        assert out is not None, f"no room for {blocks}"
        self.m.complete_store([K(b) for b in out[0]], ctx, success=success)
        return out[1]

    def events(self) -> list[tuple[str, list[str]]]:
        out = []
        for ev in self.m.take_events():
            kind = "stored" if not ev.removed else ("failed" if ev.metadata_only else "removed")
            out.append((kind, names(ev.keys)))
        return out

    def ready(self) -> set[str]:
        return {n for n in names(self.policy.chunks) if self.policy.chunks[K(n)].is_ready}

    def check(self) -> None:
        self.policy.check()
        m = self.m
        assert len(self.policy.chunks) <= self.capacity
        assert m._num_evictable_cache_chunks == self.policy.num_evictable
        assert m._get_num_free_chunks() + len(self.policy.chunks) == self.capacity


def test_shipped_policies_are_registered() -> None:
    assert set(SHIPPED) <= set(POLICIES)


# Victims on a prefix-sharing stream (see test_exact_victims): step 3 needs two
# victims, step 4 one. Every policy keeps the reused a1/a2 at step 3 except FIFO,
# which ignores reuse; step 4 separates recency, frequency and queue policies.
EXPECTED_VICTIMS = {
    "lru": (["a3", "b3"], ["a2"]),
    "lfu": (["a3", "b3"], ["c2"]),
    "arc": (["a3", "b3"], ["c2"]),
    "s3fifo": (["a3", "b3"], ["a1"]),
    "sieve": (["a3", "b3"], ["c2"]),
    "fifo": (["a3", "a2"], ["a1"]),
    "gdsf": (["a3", "b3"], ["a2"]),
    "hybrid": (["a3", "b3"], ["a2"]),
}


@pytest.mark.parametrize("policy", SHIPPED)
def test_exact_victims(policy: str) -> None:
    d = Driver(4, policy)
    # 1. r1 computes the chain a1 a2 a3 and offloads it.
    r1 = d.request()
    assert d.lookup(r1, "a1") == [MISS]
    assert d.prepare_store(r1, "a1", "a2", "a3") == (["a1", "a2", "a3"], [])
    assert d.lookup(r1, "a1", "a2", "a3") == [PENDING] * 3
    d.m.complete_store([K("a1"), K("a2"), K("a3")], r1)
    d.m.on_request_finished(r1)
    assert d.lookup(r1, "a1", "a2", "a3", "b3") == [HIT, HIT, HIT, MISS]
    assert d.events() == [("stored", ["a1", "a2", "a3"])]
    d.check()

    # 2. r2 shares the prefix a1 a2: loads it (pinned meanwhile) and offloads b3.
    r2 = d.request()
    assert d.lookup(r2, "a1", "a2", "b3") == [HIT, HIT, MISS]
    d.m.prepare_load([K("a1"), K("a2")], r2)
    assert d.prepare_store(r2, "a1", "a2", "b3") == (["b3"], [])
    d.m.complete_store([K("b3")], r2)
    d.check()
    d.m.complete_load([K("a1"), K("a2")], r2)
    d.m.on_request_finished(r2)
    assert d.events() == [("stored", ["b3"])]
    d.check()

    # 3. r3 offloads two new blocks: two victims.
    r3 = d.request()
    out = d.prepare_store(r3, "c1", "c2")
    assert out == (["c1", "c2"], EXPECTED_VICTIMS[policy][0])
    d.m.complete_store([K("c1"), K("c2")], r3)
    d.m.on_request_finished(r3)
    assert d.events() == [("removed", EXPECTED_VICTIMS[policy][0]), ("stored", ["c1", "c2"])]
    d.check()

    # 4. r4 offloads one more block.
    r4 = d.request()
    assert d.store(r4, "d1") == EXPECTED_VICTIMS[policy][1]
    assert d.events() == [("removed", EXPECTED_VICTIMS[policy][1]), ("stored", ["d1"])]
    evicted = set(EXPECTED_VICTIMS[policy][0] + EXPECTED_VICTIMS[policy][1])
    assert d.ready() == {"a1", "a2", "a3", "b3", "c1", "c2", "d1"} - evicted
    d.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_loading_chunks_are_never_evicted(policy: str) -> None:
    d = Driver(3, policy)
    r1 = d.request()
    d.store(r1, "a", "b", "c")
    r2 = d.request()
    assert d.lookup(r2, "a", "b") == [HIT, HIT]
    d.m.prepare_load([K("a"), K("b")], r2)
    d.events()
    # Two victims needed, only c can go: refused, and nothing changed.
    assert d.prepare_store(r2, "x", "y") is None
    assert d.events() == []
    assert d.ready() == {"a", "b", "c"}
    assert d.lookup(r2, "a", "b", "c") == [HIT, HIT, HIT]
    d.check()
    # One victim: c, whatever the policy.
    assert d.store(r2, "x") == ["c"]
    d.check()
    # A second load of a pinned block keeps it pinned until both loads complete.
    r3 = d.request()
    d.m.prepare_load([K("a")], r3)
    d.m.complete_load([K("a"), K("b")], r2)
    out = d.prepare_store(r3, "y", "z")
    assert out is not None and out[0] == ["y", "z"] and sorted(out[1]) == ["b", "x"]
    d.m.complete_store([K("y"), K("z")], r3)
    assert d.lookup(r3, "a") == [HIT]
    # Three victims needed, only y and z can go.
    assert d.prepare_store(r3, "w", "v", "u") is None
    d.check()
    d.m.complete_load([K("a")], r3)
    out = d.prepare_store(r3, "w", "v", "u")
    assert out is not None and sorted(out[1]) == ["a", "y", "z"]
    d.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_store_is_cleaned_up(policy: str) -> None:
    d = Driver(2, policy)
    r1 = d.request()
    assert d.prepare_store(r1, "a", "b") == (["a", "b"], [])
    assert d.m._get_num_free_chunks() == 0
    d.m.complete_store([K("a"), K("b")], r1, success=False)
    assert d.lookup(r1, "a", "b") == [MISS, MISS]
    assert d.m._get_num_free_chunks() == 2
    assert d.events() == [("failed", ["a", "b"])]
    d.check()
    # A retry gets the chunks back.
    assert d.store(r1, "a", "b") == []
    assert d.lookup(r1, "a", "b") == [HIT, HIT]
    assert d.events() == [("stored", ["a", "b"])]
    # A failure reported for blocks already stored changes nothing.
    d.m.complete_store([K("a")], r1, success=False)
    assert d.lookup(r1, "a") == [HIT]
    d.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_pending_chunks_are_never_evicted(policy: str) -> None:
    d = Driver(2, policy)
    r1 = d.request()
    assert d.prepare_store(r1, "a", "b") == (["a", "b"], [])
    r2 = d.request()
    assert d.lookup(r2, "a") == [PENDING]
    # Both chunks are being written: no room.
    assert d.prepare_store(r2, "c") is None
    d.m.complete_store([K("a")], r1)
    # a is ready, b still pending: a is the only candidate.
    assert d.prepare_store(r2, "c") == (["c"], ["a"])
    assert d.lookup(r2, "a", "b", "c") == [MISS, PENDING, PENDING]
    d.m.complete_store([K("b"), K("c")], r2)
    assert d.lookup(r2, "b", "c") == [HIT, HIT]
    # The CPU manager never answers RETRY (that is for tiers with async lookups).
    assert LookupResult.RETRY not in d.lookup(r2, "a", "b", "c", "d")
    d.check()


@pytest.mark.parametrize("policy", POLICIES)
def test_blocks_of_the_same_store_call_are_protected(policy: str) -> None:
    d = Driver(3, policy)
    for b in ("a", "b", "c"):
        r = d.request()
        d.store(r, b)
        d.m.on_request_finished(r)
    r = d.request()
    # Re-offering a (already stored) with a new block x: a must survive.
    out = d.prepare_store(r, "a", "x")
    assert out is not None
    assert out[0] == ["x"] and len(out[1]) == 1 and out[1][0] in ("b", "c")
    assert "a" in d.ready()
    d.check()


def test_protected_block_skipped_by_lru_and_fifo() -> None:
    for policy, victim in (("lru", "b"), ("fifo", "b")):
        d = Driver(3, policy)
        for b in ("a", "b", "c"):
            d.store(d.request(), b)
        r = d.request()
        assert d.prepare_store(r, "a", "x") == (["x"], [victim])


def test_completed_batch_enters_tails_first() -> None:
    # One store of a chain: under LRU the tail is the oldest, so it goes first.
    d = Driver(4, "lru")
    d.store(d.request(), "p1", "p2", "p3", "p4")
    assert d.store(d.request(), "q1") == ["p4"]
    assert d.store(d.request(), "q2") == ["p3"]


def test_stores_completing_together_keep_request_order() -> None:
    d = Driver(4, "lru")
    r1, r2 = d.request(), d.request()
    assert d.prepare_store(r1, "p1", "p2") == (["p1", "p2"], [])
    assert d.prepare_store(r2, "q1", "q2") == (["q1", "q2"], [])
    d.m.complete_store([K("p1"), K("p2")], r1)
    d.m.complete_store([K("q1"), K("q2")], r2)
    # r1's chunks completed first: older than r2's; each chain tail first.
    out = d.prepare_store(d.request(), "x1", "x2", "x3")
    assert out == (["x1", "x2", "x3"], ["p2", "p1", "q2"])


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]])
def test_a_chain_completing_in_any_order_enters_tails_first(order: list[int]) -> None:
    # vLLM completes a store job's chunks in the order of a set of their keys (Python's
    # hash seed decides it): the chain still joins the policy in its own order.
    d = Driver(4, "lru")
    ctx = d.request()
    assert d.prepare_store(ctx, "p1", "p2", "p3", "p4") == (["p1", "p2", "p3", "p4"], [])
    d.m.complete_store([K(f"p{i + 1}") for i in order], ctx)
    assert d.store(d.request(), "q1") == ["p4"]
    assert d.store(d.request(), "q2") == ["p3"]
    d.check()


def test_reuse_counts_once_per_request_and_stores_do_not_count() -> None:
    d = Driver(3, "lfu")
    r1 = d.request()
    d.store(r1, "a", "b")
    d.m.on_request_finished(r1)
    d.check()  # also makes the completed stores resident
    lfu: Any = d.policy.policy
    ka, kb = cp.offload_key_id(K("a")), cp.offload_key_id(K("b"))
    assert (lfu.count(ka), lfu.count(kb)) == (1, 1)
    r2 = d.request()
    d.m.prepare_load([K("a")], r2)
    d.m.complete_load([K("a")], r2)
    # Offering the stored a again in the same request is the same access.
    assert d.prepare_store(r2, "a", "c") == (["c"], [])
    d.m.complete_store([K("c")], r2)
    d.m.on_request_finished(r2)
    d.check()
    assert (lfu.count(ka), lfu.count(kb)) == (2, 1)
    assert lfu.count(cp.offload_key_id(K("c"))) == 1
    d.check()


def test_admission_filter_declines_then_admits_on_reuse() -> None:
    d = Driver(3, "lru+tinylfu")
    r1 = d.request()
    d.store(r1, "a", "b")
    d.m.on_request_finished(r1)
    # First sighting: stored (vLLM wrote it) but declined, so evicted first.
    assert d.policy.declined_keys() == [K("b"), K("a")]
    assert d.policy.resident_keys() == set()
    assert d.lookup(r1, "a", "b") == [HIT, HIT]
    # a is reused: the filter has now seen it twice and admits it.
    r2 = d.request()
    d.m.prepare_load([K("a")], r2)
    d.m.complete_load([K("a")], r2)
    d.m.on_request_finished(r2)
    assert d.policy.resident_keys() == {K("a")}
    assert d.policy.declined_keys() == [K("b")]
    d.check()
    # A new block needs room: the declined b goes before the admitted a.
    r3 = d.request()
    d.store(r3, "c")
    assert d.store(r3, "e") == ["b"]
    d.check()


def test_declined_chunks_can_be_pinned() -> None:
    d = Driver(2, "fifo+tinylfu")
    r1 = d.request()
    d.store(r1, "a", "b")
    r2 = d.request()
    d.m.prepare_load([K("b")], r2)
    assert d.policy.declined_keys() == [K("a"), K("b")]
    assert d.store(r2, "c") == ["a"]
    # b is being loaded, c is the only candidate: no room for two.
    assert d.prepare_store(r2, "e", "f") is None
    d.check()
    d.m.complete_load([K("b")], r2)
    assert d.store(r2, "e") == ["c"]
    assert d.store(r2, "f") == ["b"]
    d.check()


def test_reset_cache_clears_the_policy() -> None:
    d = Driver(3, "arc")
    r1 = d.request()
    d.store(r1, "a", "b")
    d.m.reset_cache()
    assert d.policy.chunks == {} and len(d.policy.policy) == 0
    r2 = d.request()
    assert d.lookup(r2, "a") == [MISS]
    assert d.store(r2, "a", "b", "c") == []
    d.check()


@pytest.mark.parametrize("policy", SHIPPED)
def test_policy_classes_by_name(policy: str) -> None:
    cls = getattr(cp, f"kvtier:{policy}")
    assert issubclass(cls, cp.KvTierCachePolicy) and cls.kvtier_policy == policy
    assert cp.cache_policy_class(policy) is cls
    with_filter = getattr(cp, f"kvtier:{policy}+tinylfu")
    assert with_filter.kvtier_admission == "tinylfu"
    assert with_filter is cp.cache_policy_class(policy, "tinylfu")
    assert with_filter(8).policy.name == f"{policy}+tinylfu"


def test_policy_by_import_path() -> None:
    cls = getattr(cp, "kvtier:kvtier.policy.fifo:FIFOPolicy")
    assert cls.kvtier_policy == "kvtier.policy.fifo:FIFOPolicy"
    d = Driver(2, "kvtier.policy.fifo:FIFOPolicy")
    assert d.policy.policy.name == "fifo"
    d.store(d.request(), "a", "b")
    assert d.store(d.request(), "c") == ["b"]  # the chain's tail entered first


def test_explicit_classes_load_by_module_path() -> None:
    m = CPUOffloadingManager(
        4, cache_policy="KvTierS3FIFOCachePolicy", cache_policy_module_path=cp.MODULE_PATH
    )
    assert isinstance(m._policy, cp.KvTierS3FIFOCachePolicy)
    assert m._policy.policy.name == "s3fifo"


def test_unknown_policy_fails_when_vllm_loads_it() -> None:
    with pytest.raises(AttributeError, match="unknown policy 'nope'"):
        CPUOffloadingManager(4, cache_policy="kvtier:nope", cache_policy_module_path=cp.MODULE_PATH)
    with pytest.raises(AttributeError):
        CPUOffloadingManager(4, cache_policy="Nope", cache_policy_module_path=cp.MODULE_PATH)


def test_zero_chunks_is_harmless() -> None:
    d = Driver(0, "lru")
    assert d.prepare_store(d.request(), "a") is None


def _offloading_config(extra: dict[str, Any], chunk_bytes: int = 4096) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=True,
        extra_config=extra,
        engine_id="engine-0",
        model=OffloadingModelConfig("m", "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def test_spec_reads_the_kvtier_policy_from_extra_config() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    extra = {
        "spec_name": "KvTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
        "cpu_bytes_to_use": 10 * 4096,
        "kvtier_policy": "s3fifo",
        "kvtier_admission": "tinylfu",
    }
    spec = OffloadingSpecFactory.create_spec(_offloading_config(extra))
    assert spec.num_chunks == 10
    manager = spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    assert isinstance(manager._policy, cp.KvTierCachePolicy)
    assert manager._policy.policy.name == "s3fifo+tinylfu"
    assert manager.events is not None  # KV events follow vLLM's setting


def test_plain_cpu_spec_with_eviction_policy_keys() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    extra = {
        "cpu_bytes_to_use": 4 * 4096,
        "eviction_policy": "kvtier:sieve",
        "cache_policy_module_path": "kvtier.integrations.vllm.cache_policy",
    }
    manager = OffloadingSpecFactory.create_spec(_offloading_config(extra)).get_manager()
    assert manager._policy.policy.name == "sieve"


def test_spec_rejects_unknown_policy() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvtier import ConfigError

    extra = {
        "spec_name": "KvTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
        "cpu_bytes_to_use": 4096,
        "kvtier_policy": "nope",
    }
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        OffloadingSpecFactory.create_spec(_offloading_config(extra))
