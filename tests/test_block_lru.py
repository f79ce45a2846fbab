"""The device pool's block-ordered LRU against the keyed LRU, step for step.

A plain :class:`LRUPolicy` given to a pool keeps its order by block id
(:class:`~kvtier.policy.lru.BlockOrder`), and the pool drives it directly; any
subclass stays keyed and is driven through the policy protocol. The state
machine runs the same requests through one manager of each kind and, after
every step, requires the same answers, the same KV events, the same blocks
announced to evict listeners, the same snapshot (the LRU order and pins
included) and a clean invariant check on both.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import snapshot
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvtier import BlockPool, ConfigError, InternalInvariantError, KVCacheManager, LRUPolicy
from kvtier.errors import KvTierError


class KeyedLRU(LRUPolicy):
    """An LRU the pool does not attach: every call goes through the key protocol."""

    name = "test-keyed-lru"


# A tiny alphabet makes shared prefixes (and so hits, duplicates, cascades) common.
token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=14)


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """What a call returned, or the type of the kvtier error it raised."""
    try:
        return ("ok", fn(*args, **kwargs))
    except KvTierError as exc:
        return ("error", type(exc).__name__)


class TwinManagers(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3]))
    def configure(self, num_blocks: int, block_size: int) -> None:
        self.fast = KVCacheManager(num_blocks, block_size, policy=LRUPolicy())
        self.keyed = KVCacheManager(num_blocks, block_size, policy=KeyedLRU())
        assert self.fast.pool._lru is not None and self.keyed.pool._lru is None
        self.announced: dict[str, list[tuple[list[int], list[int]]]] = {"fast": [], "keyed": []}
        for name, m in (("fast", self.fast), ("keyed", self.keyed)):
            m.record_events()
            log = self.announced[name]
            m.add_evict_listener(lambda keys, blocks, log=log: log.append((keys, blocks)))
        self.next_id = 0

    def _both(self, method: str, *args: Any, **kwargs: Any) -> Any:
        a = _outcome(getattr(self.fast, method), *args, **kwargs)
        b = _outcome(getattr(self.keyed, method), *args, **kwargs)
        assert a == b, f"{method}: block-ordered {a!r}, keyed {b!r}"
        return a

    @rule(target=requests, toks=token_lists, precomputed=st.booleans())
    def allocate(self, toks: list[int], precomputed: bool) -> int:
        rid = self.next_id
        self.next_id += 1
        keys = self.fast.keys_for(toks) if precomputed else None
        self._both("allocate", rid, toks, block_keys=keys)
        return rid

    @rule(target=requests, toks=token_lists, seed=st.integers(0, 3))
    def allocate_external_keys(self, toks: list[int], seed: int) -> int:
        """Keys that are not chained (an engine's own hashes) collide across parents."""
        rid = self.next_id
        self.next_id += 1
        n_full = len(toks) // self.fast.block_size
        keys = [(seed + t) % 5 for t in toks[:n_full]]
        self._both("allocate", rid, toks, block_keys=keys)
        return rid

    @rule(rid=requests, toks=token_lists)
    def extend(self, rid: int, toks: list[int]) -> None:
        self._both("extend", rid, toks)

    @rule(target=requests, rid=requests)
    def fork(self, rid: int) -> int:
        dst = self.next_id
        self.next_id += 1
        self._both("fork", rid, dst)
        return dst

    @rule(rid=consumes(requests))
    def free(self, rid: int) -> None:
        self._both("free", rid)

    @rule(rid=consumes(requests))
    def free_and_drop(self, rid: int) -> None:
        self._both("free_and_drop", rid)

    @rule(rid=consumes(requests), data=st.data())
    def abort(self, rid: int, data: st.DataObject) -> None:
        if rid not in self.fast:
            return
        n = data.draw(st.integers(0, self.fast.num_tokens(rid)))
        self._both("abort", rid, n)

    @rule(n=st.integers(0, 4))
    def gc(self, n: int) -> None:
        self._both("gc", n)

    @rule()
    def reset(self) -> None:
        self._both("reset_prefix_cache")

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "fast"):
            return
        self.fast.check()
        self.keyed.check()
        fast, keyed = snapshot(self.fast), snapshot(self.keyed)
        fast_stats, keyed_stats = fast.pop("stats"), keyed.pop("stats")
        assert fast == keyed
        assert {**vars_of(fast_stats), "policy": ""} == {**vars_of(keyed_stats), "policy": ""}
        assert self.fast.take_events() == self.keyed.take_events()
        assert self.announced["fast"] == self.announced["keyed"]


def vars_of(stats: Any) -> dict[str, Any]:
    return {name: getattr(stats, name) for name in stats.__dataclass_fields__}


TestTwinManagers = TwinManagers.TestCase
TestTwinManagers.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_pool_drives_a_plain_lru_by_block_and_a_subclass_by_key() -> None:
    plain, sub = BlockPool(4, 2, LRUPolicy()), BlockPool(4, 2, KeyedLRU())
    assert plain._lru is not None and sub._lru is None
    shared = LRUPolicy()
    first = BlockPool(4, 2, shared)
    second = BlockPool(4, 2, shared)
    assert first._lru is not None and second._lru is None, "one pool per block order"


def test_the_key_protocol_reaches_the_block_order() -> None:
    p = LRUPolicy()
    pool = BlockPool(4, 1, p)
    a, b, c = pool.allocate(3)
    assert pool.commit_chain([a, b, c], [10, 11, 12], None) == [a, b, c]
    assert len(p) == 3 and p.num_evictable == 0 and 11 in p and 99 not in p
    pool.release([c, b, a])
    assert p.snapshot()["order"] == [12, 11, 10] and p.snapshot()["pinned"] == []
    p.access(12)  # a hit on an evictable key makes it the most recent
    assert p.snapshot()["order"] == [11, 10, 12]
    p.pin(10)
    assert p.snapshot()["pinned"] == [10] and p.num_evictable == 2
    p.unpin(10)
    assert p.evict_many(2) == [11, 12]
    with pytest.raises(InternalInvariantError):
        p.pin(99)
    with pytest.raises(ConfigError):
        p.insert(10, size=2)


def test_a_first_key_cached_below_another_block_is_not_a_hit() -> None:
    """External keys: a request's first key names a cached block that has a parent.

    Holding it would leave its parent evictable, and evicting the parent would
    have to cascade through a held block; so it is a miss.
    """
    for policy in (LRUPolicy(), KeyedLRU()):
        m = KVCacheManager(2, 2, policy=policy)
        m.allocate(1, [0, 1, 0, 0], block_keys=[0, 1])
        m.free(1)
        a = m.allocate(2, [1, 0, 0], block_keys=[1])
        assert a.num_cached_tokens == 0
        m.check()
