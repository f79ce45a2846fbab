"""The two-phase offloading manager: protocol behaviour and a stateful model check per policy."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier import BadRequestError, ConfigError
from kvtier.offload import OffloadingManager
from kvtier.policy import available_policies, make_policy


def state(m: OffloadingManager) -> dict[str, Any]:
    """Everything the manager keeps, its policy's whole state included, as plain data."""
    return {
        "entries": sorted((k, e.slot, e.ready, e.ref) for k, e in m._entries.items()),
        "free": list(m._free),
        "policy": m.policy.snapshot(),
        "counters": (m.stores, m.failed_stores, m.evictions, m.declined),
    }


def stored(m: OffloadingManager, keys: list[int]) -> None:
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.keys_to_store)


def test_lookup_prepare_load_complete() -> None:
    m = OffloadingManager(4, "lru")
    assert m.lookup([1, 2]) == 0
    out = m.prepare_store([1, 2, 3])
    assert out is not None
    assert out.keys_to_store == [1, 2, 3] and len(set(out.slots)) == 3
    assert out.evicted_keys == []
    # Pending stores: not loadable, lookup says retry later.
    assert m.lookup([1]) is None
    with pytest.raises(BadRequestError):
        m.prepare_load([1])
    m.complete_store([1, 2, 3])
    assert m.lookup([1, 2, 3, 4]) == 3
    assert m.lookup([2, 9, 3]) == 1
    slots = m.prepare_load([1, 2])
    assert slots == out.slots[:2]
    assert m.is_pinned(1) and not m.is_pinned(3)
    m.complete_load([1, 2])
    assert not m.is_pinned(1)
    with pytest.raises(BadRequestError):
        m.complete_load([1])
    m.check()


def test_events_match_stores_and_evictions() -> None:
    m = OffloadingManager(2, "lru", medium="disk")
    stored(m, [1, 2])
    ev = m.take_events()
    assert [(e.keys, e.removed, e.medium) for e in ev] == [((1, 2), False, "disk")]
    assert m.take_events() == []
    m.touch([1])  # 2 is now the least recent
    out = m.prepare_store([3])
    assert out is not None and out.evicted_keys == [2]
    m.complete_store([3])
    assert [(e.keys, e.removed) for e in m.take_events()] == [((2,), True), ((3,), False)]


def test_prepare_store_is_atomic_when_no_room() -> None:
    m = OffloadingManager(3, "lru")
    stored(m, [1, 2, 3])
    m.take_events()
    m.prepare_load([1, 2])  # pinned by loads
    before = (m.lookup([1, 2, 3]), m.num_free, len(m), m.policy.num_evictable)
    assert m.prepare_store([4, 5]) is None  # only key 3 is evictable
    assert (m.lookup([1, 2, 3]), m.num_free, len(m), m.policy.num_evictable) == before
    assert m.take_events() == []
    assert m.store_rejections == 1
    m.check()


def test_prepare_store_never_evicts_keys_of_the_same_call() -> None:
    m = OffloadingManager(3, "lru")
    stored(m, [1, 2, 3])
    m.touch([2, 3])  # order now 1, 3, 2: 1 is least recent, but the call names it
    out = m.prepare_store([1, 4])
    assert out is not None
    assert out.keys_to_store == [4]
    assert 1 not in out.evicted_keys and out.evicted_keys == [3]
    m.complete_store([4])
    assert m.is_ready(1) and m.is_ready(4)
    m.check()


def test_pending_stores_are_never_evicted() -> None:
    m = OffloadingManager(2, "lru")
    out = m.prepare_store([1, 2])
    assert out is not None
    assert m.prepare_store([3]) is None  # both slots pending
    m.complete_store([1])
    out3 = m.prepare_store([3])
    assert out3 is not None and out3.evicted_keys == [1]
    m.complete_store([2, 3])
    m.check()


def test_a_refused_store_leaves_the_policy_order_alone() -> None:
    m = OffloadingManager(2, "lru")
    stored(m, [1])
    stored(m, [2])  # LRU order: 1, then 2
    before = state(m)
    assert m.prepare_store([1, 3, 4]) is None  # two new keys, and 1 must stay
    assert state(m) == before, "the refusal must not count as a use of key 1"
    out = m.prepare_store([5])
    assert out is not None and out.evicted_keys == [1]


def test_failed_store_frees_its_slots() -> None:
    m = OffloadingManager(2, "lru")
    out = m.prepare_store([1, 2])
    assert out is not None
    m.complete_store([1, 2], success=False)
    assert len(m) == 0 and m.num_free == 2 and m.lookup([1]) == 0
    assert m.take_events() == []
    assert m.failed_stores == 2
    m.check()


@pytest.mark.parametrize("policy", available_policies())
def test_touch_ignores_unknown_and_pending_keys(policy: str) -> None:
    m = OffloadingManager(3, policy)
    stored(m, [5])
    m.prepare_store([1])
    before = state(m)
    m.touch([1, 99])  # neither is ready: no KeyError, nothing changes
    assert state(m) == before
    m.touch([5, 1])  # the ready key is a use; only the policy's state may move
    after = state(m)
    assert {k: v for k, v in after.items() if k != "policy"} == {
        k: v for k, v in before.items() if k != "policy"
    }
    m.check()


def test_remove_and_adopt() -> None:
    m = OffloadingManager(3, "lru")
    stored(m, [1, 2])
    m.prepare_load([1])
    assert m.remove([1, 2, 7]) == [2]  # 1 is pinned, 7 unknown
    m.complete_load([1])
    assert m.adopt([5, 6, 7, 8]) == [5, 6]  # room for two only after 1 is evicted? no: 1 is kept
    m.check()


def test_tinylfu_admission_stops_a_chain() -> None:
    m = OffloadingManager(4, make_policy("lru", admission="tinylfu"))
    # The first sighting of a chain is declined; whatever the filter says,
    # what is stored is a leading part of the chain, never a child alone.
    out = m.prepare_store([10, 11])
    assert out is not None and out.keys_to_store == [] and m.declined == 2
    for chain in ([20, 21, 22], [10, 11], [20, 21, 22, 23], [30, 31], [30, 31]):
        new = [k for k in chain if k not in m]
        out = m.prepare_store(chain)
        if out is not None:
            assert out.keys_to_store == new[: len(out.keys_to_store)]
            m.complete_store(out.keys_to_store)
        m.check()
    assert m.declined > 2 and len(m) > 0


def test_bad_capacity() -> None:
    with pytest.raises(ConfigError):
        OffloadingManager(0)


@given(st.lists(st.integers(0, 30), max_size=40))
def test_lookup_counts_leading_ready_keys(keys: list[int]) -> None:
    m = OffloadingManager(64, "fifo")
    for k in range(0, 31, 2):
        stored(m, [k])
    expect = 0
    for k in keys:
        if k % 2:
            break
        expect += 1
    assert m.lookup(keys) == expect


class OffloadMachine(RuleBasedStateMachine):
    """Random lookup / load / store / complete / fail sequences against a simple model."""

    policy_name = "lru"

    @initialize(capacity=st.integers(1, 6))
    def setup(self, capacity: int) -> None:
        self.m = OffloadingManager(capacity, self.policy_name)
        self.capacity = capacity
        self.ready: set[int] = set()
        self.pending: set[int] = set()
        self.loads: dict[int, int] = {}
        self.events_ready: set[int] = set()

    def _drain_events(self) -> None:
        for ev in self.m.take_events():
            for k in ev.keys:
                if ev.removed:
                    assert k in self.events_ready, f"removal of {k} never reported stored"
                    self.events_ready.discard(k)
                else:
                    assert k not in self.events_ready
                    self.events_ready.add(k)

    @rule(keys=st.lists(st.integers(0, 12), min_size=1, max_size=5))
    def prepare_store(self, keys: list[int]) -> None:
        before = state(self.m)
        pinned = {k for k, n in self.loads.items() if n} | self.pending
        new = list(dict.fromkeys(k for k in keys if k not in self.ready | self.pending))
        free = self.capacity - len(self.ready) - len(self.pending)
        evictable = self.ready - pinned - set(keys)
        out = self.m.prepare_store(keys)
        if out is None:
            assert len(new) - free > len(evictable), "room could have been made"
            after = state(self.m)
            assert after.pop("policy") == before.pop("policy"), "a refused store moved the policy"
            assert after == before, "a refused store changed the bookkeeping"
            return
        # No admission filter here: every new key is stored, in call order.
        assert out.keys_to_store == new
        assert len(out.evicted_keys) == max(0, len(new) - free)
        assert len(out.slots) == len(set(out.slots)) == len(new)
        for k in out.evicted_keys:
            assert k not in pinned, "a pinned or pending key was evicted"
            assert k not in keys, "a key of the same call was evicted"
            assert k in self.ready
            self.ready.discard(k)
        self.pending.update(out.keys_to_store)
        assert len(self.ready) + len(self.pending) <= self.capacity

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.pending)), min_size=1, unique=True))
        self.m.complete_store(keys, success)
        for k in keys:
            self.pending.discard(k)
            if success:
                self.ready.add(k)

    @rule(keys=st.lists(st.integers(0, 12), max_size=5))
    def lookup(self, keys: list[int]) -> None:
        got = self.m.lookup(keys)
        n = 0
        for k in keys:
            if k in self.ready:
                n += 1
                continue
            assert got == (None if k in self.pending else n)
            return
        assert got == n

    @precondition(lambda self: bool(self.ready))
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3))
        slots = self.m.prepare_load(keys)
        assert len(slots) == len(keys)
        for k in keys:
            self.loads[k] = self.loads.get(k, 0) + 1

    @precondition(lambda self: any(self.loads.values()))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(k for k, n in self.loads.items() if n)))
        self.m.complete_load([k])
        self.loads[k] -= 1

    @rule(keys=st.lists(st.integers(0, 12), max_size=4))
    def touch(self, keys: list[int]) -> None:
        self.m.touch(keys)

    @rule(keys=st.lists(st.integers(0, 12), max_size=4))
    def remove(self, keys: list[int]) -> None:
        # Ready keys no load pins are dropped (once each); the others are ignored.
        expected = [
            k for k in dict.fromkeys(keys) if k in self.ready and not self.loads.get(k)
        ]
        assert self.m.remove(keys) == expected
        self.ready.difference_update(expected)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check()
        assert set(self.m.ready_keys()) == self.ready
        assert len(self.m) <= self.capacity
        for k, n in self.loads.items():
            if n:
                assert self.m.is_ready(k), "a key being loaded vanished"
        self._drain_events()
        assert self.events_ready == self.ready


@pytest.mark.parametrize("policy", available_policies())
def test_offload_machine(policy: str) -> None:
    machine = type(f"OffloadMachine_{policy}", (OffloadMachine,), {"policy_name": policy})
    settings_ = settings(max_examples=40, stateful_step_count=30, deadline=None)
    machine.TestCase.settings = settings_
    machine.TestCase().runTest()
