"""Retention pins on a tier's offloading manager: pinned keys are evicted after unpinned
ones, the pin that ends latest first; pins lapse on the manager's clock and leave with
their keys. Unit cases and a stateful model check per policy."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    initialize,
    invariant,
    precondition,
    rule,
)
from test_offload_manager import OffloadMachine
from test_offload_manager import state as manager_state

from kvtier.offload import OffloadingEvent, OffloadingManager
from kvtier.offload.manager import PinEvent
from kvtier.policy import available_policies
from kvtier.policy.base import PolicyBase, pin_ends_of


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def state(m: OffloadingManager) -> dict[str, Any]:
    """Everything the manager keeps, its pins and its policy's whole state included."""
    return {
        **manager_state(m),
        "pins": sorted(m._pins.items()),
        "pin_evictable": m._pin_evictable,
        "pinned_evictions": m.pinned_evictions,
    }


def stored(m: OffloadingManager, keys: list[int], pins: dict[int, float] | None = None) -> Any:
    out = m.prepare_store(keys, pins)
    assert out is not None
    m.complete_store(out.keys_to_store)
    return out


def test_a_pinned_key_outlives_unpinned_keys_stored_after_it() -> None:
    clock = Clock()
    m = OffloadingManager(3, "lru", clock=clock)
    stored(m, [1], {1: 10.0})
    stored(m, [2])
    stored(m, [3])
    # LRU would evict 1 first; its pin keeps it while unpinned keys are left.
    assert stored(m, [4]).evicted_keys == [2]
    assert stored(m, [5]).evicted_keys == [3]
    assert m.num_pinned == 1 and m.pin_end(1) == 10.0
    m.check()
    # Only pinned keys left to evict besides the call's: the pin goes, and says so.
    stored(m, [6], {6: 20.0})  # evicts 4 (unpinned)
    out = stored(m, [7])
    assert out.evicted_keys == [5]
    out = stored(m, [8], {8: 15.0})
    # 1 (until 10) and 6 (until 20) are pinned, 7 is not: 7 goes first.
    assert out.evicted_keys == [7]
    out = stored(m, [9])
    assert out.evicted_keys == [6] and dict(out.evicted_pins) == {6: 20.0}, "latest end first"
    assert m.pinned_evictions == 1
    m.check()


def test_a_pin_lapses_on_the_clock_and_the_key_is_evicted_as_usual() -> None:
    clock = Clock()
    m = OffloadingManager(2, "lru", clock=clock)
    stored(m, [1], {1: 5.0})
    stored(m, [2])
    clock.now = 5.0  # the pin ends exactly now
    assert m.num_pinned == 0 and m.pin_end(1) is None
    m.check()
    # It rejoined the order at the recent end (as a release does): 2 is older.
    assert stored(m, [3]).evicted_keys == [2]
    assert stored(m, [4]).evicted_keys == [1]
    m.check()


def test_pins_in_the_past_are_ignored_and_unknown_keys_too() -> None:
    clock = Clock()
    clock.now = 3.0
    m = OffloadingManager(4, "lru", clock=clock)
    stored(m, [1, 2], {1: 2.0, 2: 3.0, 9: 50.0})
    assert m.pins() == {}
    m.set_pins({1: 7.0, 8: 9.0})
    assert m.pins() == {1: 7.0}
    m.set_pins({1: 4.0})  # a pin is replaced, sooner or later
    assert m.pins() == {1: 4.0}
    m.check()


def test_remove_and_a_failed_store_take_the_pin_along() -> None:
    clock = Clock()
    m = OffloadingManager(4, "lru", clock=clock)
    stored(m, [1, 2], {1: 9.0, 2: 9.0})
    out = m.prepare_store([3], {3: 9.0})
    assert out is not None and m.pins() == {1: 9.0, 2: 9.0, 3: 9.0}
    m.complete_store([3], success=False)
    assert m.remove([1]) == [1]
    assert m.pins() == {2: 9.0}
    m.check()


def test_a_load_keeps_a_pinned_key_and_the_pin_stays_after_it() -> None:
    clock = Clock()
    m = OffloadingManager(2, "lru", clock=clock)
    stored(m, [1, 2], {1: 9.0, 2: 8.0})
    m.prepare_load([1])
    m.check()
    assert m.prepare_store([3, 4]) is None  # 1 is being read: only 2 could go
    out = stored(m, [3])
    assert out.evicted_keys == [2]
    m.complete_load([1])
    assert m.pin_end(1) == 9.0
    m.check()
    clock.now = 9.0
    assert m.num_pinned == 0
    m.check()


def test_a_refused_store_changes_nothing_with_pins() -> None:
    clock = Clock()
    m = OffloadingManager(2, "lru", clock=clock)
    stored(m, [1], {1: 9.0})
    stored(m, [2], {2: 9.0})
    before = state(m)
    assert m.prepare_store([1, 3, 4], {3: 20.0}) is None  # 1 must stay: one victim only
    assert state(m) == before


def test_without_pins_the_policy_alone_decides() -> None:
    m = OffloadingManager(2, "lru")
    stored(m, [1, 2])
    out = stored(m, [3])
    assert out.evicted_keys == [1] and not out.evicted_pins
    assert m.num_pinned == 0 and m._pin_orders.queued == 0


def test_a_policy_without_pins_has_no_pin_source() -> None:
    from kvtier.agents.policy import WorkflowPolicy
    from kvtier.policy import make_policy

    assert pin_ends_of(make_policy("lru")) is None
    assert pin_ends_of(PolicyBase()) is None
    w = WorkflowPolicy(clock=lambda: 1.0)
    assert pin_ends_of(w) == w.pin_ends
    wrapped = make_policy("workflow", admission="tinylfu")
    assert pin_ends_of(wrapped) is not None


def test_pins_are_journaled_after_the_store_and_left_out_of_take_events() -> None:
    clock = Clock()
    m = OffloadingManager(4, "lru", medium="host", clock=clock)
    out = m.prepare_store([1, 2, 3], {1: 9.0, 2: 9.0, 3: 7.0})
    assert out is not None
    assert m.take_all_events() == [], "pending keys are not announced"
    m.complete_store([1, 2, 3])
    m.set_pins({1: 9.0, 3: 8.0, 4: 9.0})  # 1 unchanged, 3 moved, 4 not held
    assert m.take_all_events() == [
        OffloadingEvent((1, 2, 3), "host", False),
        PinEvent((1, 2), "host", 9.0),
        PinEvent((3,), "host", 7.0),
        PinEvent((3,), "host", 8.0),
    ]
    m.set_pins({2: 12.0})
    stored(m, [5])
    # take_events keeps its two kinds: stores and removals.
    assert m.take_events() == [OffloadingEvent((5,), "host", False)]
    assert m.take_all_events() == []


# -- the stateful model check ------------------------------------------------------------


class PinMachine(OffloadMachine):
    """:class:`OffloadMachine`'s rules and invariants, with pins, stores that carry them
    and the clock, against a model of the pins."""

    @initialize(
        capacity=st.integers(1, 5),
        fill=st.lists(st.none() | st.integers(1, 8), max_size=5),
    )
    def setup(self, capacity: int, fill: list[int | None]) -> None:  # type: ignore[override]
        self.clock = Clock()
        self.m = OffloadingManager(capacity, self.policy_name, clock=self.clock)
        self.capacity = capacity
        self.ready: set[int] = set()
        self.pending: set[int] = set()
        self.loads: dict[int, int] = {}
        self.events_ready: set[int] = set()
        #: The model's pins of held keys: key -> end (only ends later than now).
        self.pins: dict[int, float] = {}
        # Start full, or nearly, so that stores evict: keys 20.. some of them pinned.
        fill = fill[:capacity]
        keys = [20 + i for i in range(len(fill))]
        pins = {k: float(u) for k, u in zip(keys, fill, strict=True) if u is not None}
        stored(self.m, keys, pins)
        self.ready.update(keys)
        self.pins.update(pins)
        self.fresh = 100

    def _lapse(self) -> None:
        now = self.clock.now
        self.pins = {k: u for k, u in self.pins.items() if u > now}

    def _apply(self, pins: dict[int, float]) -> None:
        now = self.clock.now
        for k, u in pins.items():
            if u > now and (k in self.ready or k in self.pending):
                self.pins[k] = u

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt
        self._lapse()

    @rule(
        keys=st.lists(st.integers(0, 12), min_size=1, max_size=4),
        ends=st.lists(st.none() | st.integers(0, 8), min_size=4, max_size=4),
        complete=st.booleans(),
    )
    def prepare_store(  # type: ignore[override]
        self, keys: list[int], ends: list[int | None], complete: bool
    ) -> None:
        self._store(keys, ends, complete)

    @rule(n=st.integers(1, 3), ends=st.lists(st.none() | st.integers(0, 8), min_size=3, max_size=3))
    def store_new(self, n: int, ends: list[int | None]) -> None:
        """A demotion of blocks the tier has never seen: the tier is full, so it evicts."""
        keys = list(range(self.fresh, self.fresh + n))
        self.fresh += n
        self._store(keys, ends, True)

    def _store(self, keys: list[int], ends: list[int | None], complete: bool) -> None:
        now = self.clock.now
        # Each key's pin ends 0 to 8 seconds from now, or 2 seconds ago, or it has none.
        pins = {k: now + u - 2.0 for k, u in zip(keys, ends, strict=False) if u is not None}
        self.m.expire()
        before = state(self.m)
        loaded = {k for k, n in self.loads.items() if n}
        new = list(dict.fromkeys(k for k in keys if k not in self.ready | self.pending))
        free = self.capacity - len(self.ready) - len(self.pending)
        candidates = self.ready - loaded - set(keys)
        unpinned = candidates - set(self.pins)
        pinned = candidates & set(self.pins)
        out = self.m.prepare_store(keys, pins)
        if out is None:
            assert len(new) - free > len(candidates), "room could have been made"
            after = state(self.m)
            assert after.pop("policy") == before.pop("policy"), "a refused store moved the policy"
            assert after == before, "a refused store changed the bookkeeping"
            return
        assert out.keys_to_store == new
        victims = out.evicted_keys
        assert len(victims) == max(0, len(new) - free)
        assert set(victims) <= candidates, "a loaded, pending or named key was evicted"
        took_pinned = [k for k in victims if k in self.pins]
        if took_pinned:
            assert unpinned <= set(victims), "a pinned key went while an unpinned one was left"
            # The pins that end latest went: none left behind ends later.
            left = pinned - set(victims)
            assert all(self.pins[v] >= self.pins[k] for v in took_pinned for k in left)
            assert dict(out.evicted_pins) == {k: self.pins[k] for k in took_pinned}
        else:
            assert not out.evicted_pins
        # Unpinned victims first, in the policy's order, then the pinned ones.
        assert victims == [k for k in victims if k not in self.pins] + took_pinned
        for k in victims:
            self.ready.discard(k)
            self.pins.pop(k, None)
        self.pending.update(out.keys_to_store)
        self._apply(pins)
        if complete:  # most stores complete before anything else happens
            self.m.complete_store(out.keys_to_store)
            self.pending.difference_update(out.keys_to_store)
            self.ready.update(out.keys_to_store)

    @rule(ends=st.dictionaries(st.integers(0, 24), st.integers(0, 8), max_size=4))
    def set_pins(self, ends: dict[int, int]) -> None:
        now = self.clock.now
        pins = {k: now + u - 2.0 for k, u in ends.items()}
        self.m.set_pins(pins)
        self._apply(pins)

    # A failed store and a removal take the pins of the keys they drop along.
    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        super().complete_store(data, success)
        self._forget_gone()

    @rule(keys=st.lists(st.integers(0, 24), max_size=4))
    def remove(self, keys: list[int]) -> None:
        super().remove(keys)
        self._forget_gone()

    def _forget_gone(self) -> None:
        held = self.ready | self.pending
        self.pins = {k: u for k, u in self.pins.items() if k in held}

    @invariant()
    def pins_match(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check()
        # The pinned count is the number of held keys whose pin ends later than now.
        assert self.m.pins() == self.pins
        assert self.m.num_pinned == len(self.pins)
        self.m.check()


@pytest.mark.parametrize("policy", available_policies())
def test_pin_machine(policy: str) -> None:
    machine = type(f"PinMachine_{policy}", (PinMachine,), {"policy_name": policy})
    machine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
    machine.TestCase().runTest()
