"""The workflow-aware policy: its order, TTL pins and their cap, and equivalence without hints.

Two state machines: one drives the workflow policy and its bare fallback with
the same random owner calls and no hints, and requires the same victims and
the same fallback state after every step (the policy *is* its fallback
without hints); the other pins keys with random TTLs while time moves and
checks that pins expire on time, never exceed their cap, and that a pinned
key is a victim only when nothing unpinned is left.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier import BadRequestError, ConfigError, KVCacheManager, make_policy
from kvtier.agents import WorkflowPolicy, WorkflowTracker, sequential
from kvtier.agents.policy import workflow_policy_of
from kvtier.agents.ranks import DEFAULT, PINNED, WAITING

FALLBACKS = ["lru", "learned-reuse", "arc", "s3fifo", "lfu", "fifo", "sieve", "gdsf", "hybrid"]


class EquivalenceMachine(RuleBasedStateMachine):
    """Random owner calls, no hints: the same victims as the fallback, always."""

    @initialize(fallback=st.sampled_from(FALLBACKS), capacity=st.integers(2, 12))
    def setup(self, fallback: str, capacity: int) -> None:
        self.w = make_policy("workflow", fallback=fallback)
        self.f = make_policy(fallback)
        for p in (self.w, self.f):
            p.bind(capacity)
        self.capacity = capacity
        self.resident: set[int] = set()
        self.pinned: set[int] = set()
        self.next = 0
        self.now = 0.0

    def _both(self, method: str, *args: Any) -> Any:
        a = getattr(self.w, method)(*args)
        b = getattr(self.f, method)(*args)
        assert a == b, (method, args, a, b)
        return a

    def _drop(self, victims: list[int] | None) -> None:
        for v in victims or ():
            assert v in self.resident and v not in self.pinned
            self.resident.discard(v)

    @rule(pinned=st.booleans(), reuse=st.integers(0, 30))
    def insert(self, pinned: bool, reuse: int) -> None:
        key = reuse if reuse < self.next and reuse not in self.resident else self.next
        self.next = max(self.next, key + 1)
        if key in self.resident:
            return
        if not self._both("admit", key):
            return
        self._drop(self._both("evict_for", 1))
        if len(self.resident) >= self.capacity:
            return
        self._both("insert", key, pinned)
        self.resident.add(key)
        if pinned:
            self.pinned.add(key)

    @rule(keys=st.lists(st.integers(0, 30), max_size=6, unique=True))
    def request(self, keys: list[int]) -> None:
        self.now += 1.0
        hit = 0
        while hit < len(keys) and keys[hit] in self.resident:
            hit += 1
        self.w.on_request(keys, hit, self.now, None)
        self.f.on_request(keys, hit, self.now, None)  # type: ignore[attr-defined]

    @rule(i=st.integers(0, 30))
    def access(self, i: int) -> None:
        if i in self.resident:
            self._both("access", i)

    @rule(i=st.integers(0, 30))
    def pin(self, i: int) -> None:
        if i in self.resident and i not in self.pinned:
            self._both("pin_many", [i])
            self.pinned.add(i)

    @rule(i=st.integers(0, 30))
    def unpin(self, i: int) -> None:
        if i in self.pinned:
            self._both("unpin_many", [i])
            self.pinned.discard(i)

    @rule(i=st.integers(0, 30))
    def remove(self, i: int) -> None:
        self._both("remove", i)
        self.resident.discard(i)
        self.pinned.discard(i)

    @rule(n=st.integers(1, 4))
    def evict_many(self, n: int) -> None:
        self._drop(self._both("evict_many", n))

    @rule()
    def evict(self) -> None:
        v = self._both("evict")
        self._drop(None if v is None else [v])

    @invariant()
    def same_state(self) -> None:
        assert self.w.snapshot()["global"] == self.f.snapshot()
        assert (len(self.w), self.w.num_evictable, self.w.used) == (
            len(self.f),
            self.f.num_evictable,
            self.f.used,
        )


TestEquivalenceMachine = EquivalenceMachine.TestCase
TestEquivalenceMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class PinMachine(RuleBasedStateMachine):
    """TTL pins as time moves: expiry on time, a cap that holds, pinned keys evicted last."""

    @initialize(capacity=st.integers(4, 16), fraction=st.sampled_from([0.25, 0.5, 1.0]))
    def setup(self, capacity: int, fraction: float) -> None:
        self.p = WorkflowPolicy(pin_fraction=fraction, guard=False)
        self.p.bind(capacity)
        self.capacity = capacity
        self.resident: set[int] = set()
        self.expiry: dict[int, float] = {}
        self.now = 0.0
        self.next = 0

    @rule(n=st.integers(1, 4), ttl=st.none() | st.floats(0.5, 20.0))
    def request(self, n: int, ttl: float | None) -> None:
        keys = list(range(self.next, self.next + n))
        self.next += n
        hints = {"session_id": f"s{keys[0] % 3}"}
        if ttl is not None:
            hints["cache_ttl_s"] = ttl  # type: ignore[assignment]
        self.p.on_request(keys, 0, self.now, hints)
        for k in keys:
            self.protected_before = set(dict(self.p.snapshot()["protected"]))
            victims = self.p.evict_for(1)
            assert victims is not None
            for v in victims:
                self._check_victim(v)
                self.resident.discard(v)
            self.p.insert(k, False)
            self.resident.add(k)
            if ttl is not None:
                self.expiry[k] = max(self.expiry.get(k, 0.0), self.now + ttl)

    def _check_victim(self, v: int) -> None:
        # A protected victim means every evictable key was protected.
        if v in self.protected_before:
            assert all(k in self.protected_before for k in self.resident)

    @rule(dt=st.floats(0.1, 8.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.p.expire(self.now)

    @rule()
    def evict(self) -> None:
        self.protected_before = set(dict(self.p.snapshot()["protected"]))
        v = self.p.evict()
        if v is not None:
            self._check_victim(v)
            self.resident.discard(v)

    @invariant()
    def pins_hold_their_rules(self) -> None:
        snap = self.p.snapshot()
        protected = dict(snap["protected"])
        self.protected_before = set(protected)
        assert self.p.protected_used == len(protected) <= self.p.pin_cap
        for k, (until, _size) in protected.items():
            assert k in self.resident and until > self.now and self.p.rank_of(k) == PINNED
        # Pins ran out by time alone: nothing expired is still protected.
        for k in self.resident - set(protected):
            assert self.p.rank_of(k) != PINNED
        assert len(self.p) == len(self.resident)


TestPinMachine = PinMachine.TestCase
TestPinMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def _cycle_policy(**kwargs: Any) -> tuple[WorkflowPolicy, WorkflowTracker]:
    t = WorkflowTracker()
    t.register(sequential("w", ["a", "b", "c", "d"], cyclic=True))
    p = WorkflowPolicy(tracker=t, guard=False, **kwargs)
    return p, t


def test_the_agent_due_soonest_is_evicted_last() -> None:
    p, _ = _cycle_policy()
    p.bind(100)
    for step, agent in enumerate("abcd"):
        keys = [10 * step + j for j in range(3)]
        p.on_request(keys, 0, float(step), {"workflow_id": "w", "agent_id": agent, "step": step})
        p.insert_many(keys)
    # d ran last: a is next (0 steps), then b, c; d is needed last.
    order = p.evict_many(12)
    # Within an agent's chain, the tail goes first (its head stays a usable prefix).
    assert order[:3] == [32, 31, 30] and order[-3:] == [2, 1, 0]
    assert order[3:6] == [22, 21, 20]


def test_a_prefetch_may_take_blocks_due_later_shared_or_not() -> None:
    t = WorkflowTracker()
    spec = sequential("w", ["a", "b", "c", "d"], cyclic=True)
    prefixes = {"a": (1, 2), "b": (3, 4), "c": (5, 6), "d": (7, 8)}
    agents = tuple(replace(x, prefix_keys=prefixes[x.agent_id]) for x in spec.agents)
    t.register(replace(spec, agents=agents))
    p = WorkflowPolicy(tracker=t, guard=False)
    p.bind(100)
    for step, agent in enumerate("abcd"):
        keys = [*prefixes[agent], 100 + step]  # the prefix (shared) and one dynamic block
        p.on_request(keys, 0, float(step), {"workflow_id": "w", "agent_id": agent, "step": step})
        p.insert_many(keys)
    p.insert_many([50])  # no hint: due never
    # d ran last: a is 0 steps away, b 1, c 2, d 3. Due later than 1: c's and d's
    # prefixes and dynamic blocks, and the unhinted block.
    assert p.evictable_due_after(1) == 2 * 3 + 1
    assert p.evictable_due_after(3) == 1
    assert p.evictable_due_after(0) == 3 * 3 + 1


def test_dynamic_suffixes_go_before_shared_prefixes() -> None:
    p = WorkflowPolicy(guard=False)
    p.bind(100)
    p.on_request([1, 2, 3], 0, 0.0, {"session_id": "x"})
    p.insert_many([1, 2, 3])
    p.on_request([1, 2, 4], 2, 1.0, {"session_id": "y"})
    p.insert_many([4])
    # 1 and 2 serve two sessions (shared); 3 and 4 one each.
    assert p.evict_many(4)[:2] == [3, 4]


def test_reuse_never_goes_first_and_never_demotes_shared_blocks() -> None:
    p = WorkflowPolicy(guard=False)
    p.bind(100)
    p.insert_many([1, 2])
    p.on_request([5, 6], 0, 0.0, {"session_id": "a"})
    p.insert_many([5, 6])
    p.on_request([5, 6, 7], 2, 1.0, {"session_id": "b", "reuse": "never"})
    p.insert_many([7])
    assert p.evict() == 7
    assert p.rank_of(5) > DEFAULT


def test_a_full_level_does_not_admit_what_is_needed_last() -> None:
    p, _ = _cycle_policy()
    p.bind(6)
    for step, agent in enumerate("abc"):
        keys = [10 * step, 10 * step + 1]
        p.on_request(keys, 0, float(step), {"workflow_id": "w", "agent_id": agent})
        if step < 3:
            p.insert_many(keys)
    p.on_request([30, 31], 0, 3.0, {"workflow_id": "w", "agent_id": "d"})
    # d just ran: everything resident (a, b, c) is needed before d again.
    assert not p.admit(30) and p.bypassed == 1


def test_ttl_pins_expire_by_time_alone() -> None:
    clock = [0.0]
    p = WorkflowPolicy(guard=False, clock=lambda: clock[0])
    p.bind(10)
    p.on_request([1, 2], 0, 0.0, {"session_id": "s", "cache_ttl_s": 5})
    p.insert_many([1, 2])
    p.insert_many([3])
    assert p.evict() == 3 and p.protected_used == 2
    clock[0] = 6.0
    p.expire(6.0)
    assert p.protected_used == 0 and p.rank_of(1) != PINNED
    p.on_finish([1, 2], 6.0, {"session_id": "s", "cache_ttl_s": 3})
    assert p.protected_used == 2
    clock[0] = 9.5  # evict() reads the clock: the pin ends without a request arriving
    assert p.evict() in (1, 2) and p.protected_used <= 1


def test_the_pin_cap_yields_the_pins_that_end_latest() -> None:
    p = WorkflowPolicy(guard=False, pin_fraction=0.5)
    p.bind(8)
    p.on_request([1, 2], 0, 0.0, {"cache_ttl_s": 20})
    p.insert_many([1, 2])
    p.on_request([3, 4, 5], 0, 0.0, {"cache_ttl_s": 10})
    p.insert_many([3, 4, 5])
    # The session due back sooner (TTL 10) takes the room of the one due later.
    protected = dict(p.snapshot()["protected"])
    assert p.protected_used == 4 == p.pin_cap and {3, 4, 5} <= set(protected)
    # A pin that would end after every current one does not get in.
    p.on_request([6], 0, 0.0, {"cache_ttl_s": 30})
    p.insert_many([6])
    assert 6 not in dict(p.snapshot()["protected"]) and p.protected_used == 4


def test_bad_hints_are_refused_by_name() -> None:
    p = WorkflowPolicy()
    p.bind(4)
    for hints, match in (
        ({"sesion_id": "x"}, "unknown hint 'sesion_id'"),
        ({"step": -1, "workflow_id": "w", "agent_id": "a"}, "step"),
        ({"cache_ttl_s": "5"}, "cache_ttl_s"),
        ({"reuse": "sometimes"}, "reuse"),
        ({"session_id": ""}, "session_id"),
    ):
        with pytest.raises(BadRequestError, match=match):
            p.on_request([1], 0, 0.0, hints)
    m = KVCacheManager(8, 2, policy="workflow")
    with pytest.raises(BadRequestError, match="unknown hint"):
        m.allocate("r", [1, 2, 3], hints={"agent": "a"})
    assert len(m) == 0


def test_the_fallback_is_configurable_and_cannot_be_itself() -> None:
    wrapped = make_policy("workflow", fallback="arc", admission="tinylfu")
    assert workflow_policy_of(wrapped) is not None
    with pytest.raises(ConfigError, match="another policy"):
        make_policy("workflow", fallback="workflow")


def test_a_session_end_releases_its_pins_and_sends_its_blocks_first() -> None:
    p = make_policy("workflow")
    p.bind(100)
    shared, own, other = [1, 2], [3, 4], [5, 6]
    p.on_request(shared + own, 0, 0.0, {"session_id": "s", "cache_ttl_s": 30})
    p.insert_many(shared + own)
    p.on_request(shared + other, 2, 0.0, {"session_id": "t", "cache_ttl_s": 60})
    p.insert_many(other)
    inner = workflow_policy_of(p)
    assert inner is not None
    assert all(inner.rank_of(k) == PINNED for k in own + other)
    stats = inner.session_stats()
    assert stats["tracked"] == stats["live"] == 2 and stats["pinned_blocks"] == 6
    assert stats["ttls_followed"] is True  # no pause judged yet
    p.on_request(shared + own, 4, 1.0, {"session_id": "s", "session_end": True})
    assert inner.session_stats()["ended"] == 1 and inner.session_stats()["tracked"] == 1
    # The ending request's finish repeats its hints: the session is not counted again,
    # nor tracked anew.
    inner.on_finish(shared + own, 1.5, {"session_id": "s", "session_end": True})
    assert inner.session_stats()["ended"] == 1 and inner.session_stats()["tracked"] == 1
    # Its own blocks go first, tail first; the shared prefix stays with the live session.
    assert p.evict_many(2) == [4, 3]
    assert not inner.end_session("s")


def test_session_end_needs_a_session_id() -> None:
    with pytest.raises(BadRequestError, match="session_id"):
        make_policy("workflow").on_request([1], 0, 0.0, {"session_end": True})
    with pytest.raises(BadRequestError, match="session_end"):
        make_policy("workflow").on_request([1], 0, 0.0, {"session_id": "s", "session_end": 1})


def test_a_session_back_early_is_ranked_by_its_new_return() -> None:
    # pin_fraction 0: every pin waits, ordered by when its session is due back.
    p = WorkflowPolicy(guard=False, pin_fraction=0.0)
    p.bind(100)
    p.on_request([1, 2], 0, 0.0, {"session_id": "a", "cache_ttl_s": 100})
    p.insert_many([1, 2])
    p.on_request([3, 4], 0, 0.0, {"session_id": "b", "cache_ttl_s": 50})
    p.insert_many([3, 4])
    # a is back after 10 s, not 100, and its next tool call takes 5 s: it is due at
    # 15 s now, before b (50 s), although its first pin ran to 100 s.
    p.on_request([1, 2, 5], 2, 10.0, {"session_id": "a", "cache_ttl_s": 5})
    p.insert_many([5])
    assert dict(p.snapshot()["expiry"])[1] == 15.0
    assert p.evict_many(2) == [4, 3]


def test_a_shared_prefix_keeps_the_pin_of_its_latest_user() -> None:
    p = WorkflowPolicy(guard=False)
    p.bind(100)
    p.on_request([1, 2], 0, 0.0, {"session_id": "a", "cache_ttl_s": 100})
    p.insert_many([1, 2])
    p.on_request([1, 3], 1, 0.0, {"session_id": "b", "cache_ttl_s": 100})
    p.insert_many([3])
    p.on_request([1, 2, 4], 2, 10.0, {"session_id": "a", "cache_ttl_s": 5})
    expiry = dict(p.snapshot()["expiry"])
    assert expiry[2] == 15.0 and expiry[1] == expiry[3] == 100.0


def test_a_session_that_stops_naming_a_ttl_releases_its_pins() -> None:
    p = WorkflowPolicy(guard=False)
    p.bind(100)
    p.on_request([1, 2], 0, 0.0, {"session_id": "a", "cache_ttl_s": 30})
    p.insert_many([1, 2])
    p.on_request([3, 4], 0, 0.0, {"session_id": "b", "cache_ttl_s": 60})
    p.insert_many([3, 4])
    # No TTL after TTLs: a is answering, not waiting on a tool; it is not due back soon.
    p.on_request([1, 2, 5], 2, 5.0, {"session_id": "a"})
    p.insert_many([5])
    assert not {1, 2, 5} & set(dict(p.snapshot()["expiry"]))
    assert all(p.rank_of(k) not in (PINNED, WAITING) for k in (1, 2, 5))
    assert all(p.rank_of(k) == PINNED for k in (3, 4))
    assert set(p.evict_many(3)) == {1, 2, 5}


def test_a_late_session_keeps_its_rank_for_as_long_again() -> None:
    p = WorkflowPolicy(guard=False, pin_fraction=0.0)
    p.bind(100)
    p.on_request([1], 0, 0.0, {"session_id": "a", "cache_ttl_s": 10})
    p.insert_many([1])
    p.on_request([2], 0, 0.0, {"session_id": "b", "cache_ttl_s": 30})
    p.insert_many([2])
    p.expire(12.0)
    # a is 2 s late: due any moment, so it stays, ranked by its due time, after b.
    assert p.rank_of(1) == WAITING
    assert p.evict() == 2
    p.insert_many([2])
    p.expire(21.0)  # late by more than its 10 s pin: not coming back
    assert p.rank_of(1) not in (PINNED, WAITING) and p.rank_of(2) == WAITING
    assert p.evict() == 1


def test_keys_due_back_together_go_tail_first_whatever_their_insert_order() -> None:
    p = WorkflowPolicy(guard=False, pin_fraction=0.0)
    p.bind(100)
    p.on_request([1, 2, 3], 0, 0.0, {"session_id": "a", "cache_ttl_s": 10})
    for key in (3, 1, 2):
        p.insert_many([key])
    assert p.evict_many(3) == [3, 2, 1]
