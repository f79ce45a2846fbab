"""The replay-speed shortcuts decide exactly what the plain bookkeeping decides.

* The TTL class's lazy-deletion heap (batch pins and releases, compaction
  after a batch) against a sorted list of ``(-until, -seq, key)``: the same
  victims, counts and membership after every random operation.
* The workflow policy's shortcut for pinned inserts (a key's TTL protection
  settled before it joins a class) against a policy that inserts and then
  moves the key, as the plain code path does: the same victims and the same
  state over random hinted requests.
* The block-model simulator's inlined loop against a plain per-access loop
  written here: the same counters and the same resident set.
"""

from __future__ import annotations

import bisect
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier import make_policy
from kvtier.agents.policy import DEFAULT, WorkflowPolicy
from kvtier.agents.ranks import ByReturn
from kvtier.errors import InternalInvariantError
from kvtier.policy.base import PolicyBase
from kvtier.replay.simulator import simulate_block
from kvtier.replay.traces import Trace, TraceRequest

KEYS = st.integers(0, 24)


class ByReturnMachine(RuleBasedStateMachine):
    """``ByReturn`` against a sorted list: the latest pin end first, then the deepest key
    in its chain, then the latest push."""

    @initialize()
    def setup(self) -> None:
        self.expiry: dict[int, float] = {}
        self.depth: dict[int, int] = {}
        self.policy = ByReturn(self.expiry, self.depth)
        self.policy.bind(64)
        #: Reference: sorted (-until, -depth, -seq, key) of the evictable keys, and the held ones.
        self.order: list[tuple[float, int, int, int]] = []
        self.entry: dict[int, tuple[float, int, int, int]] = {}
        self.held: set[int] = set()
        self.seq = 0

    def _push(self, key: int) -> None:
        self.seq += 1
        old = self.entry.pop(key, None)
        if old is not None:
            self.order.remove(old)
        e = (-self.expiry.get(key, float("inf")), -self.depth.get(key, 0), -self.seq, key)
        self.entry[key] = e
        bisect.insort(self.order, e)

    def _resident(self) -> set[int]:
        return set(self.entry) | self.held

    @rule(key=KEYS, until=st.one_of(st.none(), st.floats(0, 100, allow_nan=False)))
    def set_expiry(self, key: int, until: float | None) -> None:
        # The owner's table: a change is seen by the next push of the key only.
        if until is None:
            self.expiry.pop(key, None)
        else:
            self.expiry[key] = until

    @rule(key=KEYS, depth=st.integers(0, 5))
    def set_depth(self, key: int, depth: int) -> None:
        # Like the pin end, a key's depth is read when the key is pushed.
        self.depth[key] = depth

    @rule(key=KEYS, pinned=st.booleans())
    def insert(self, key: int, pinned: bool) -> None:
        if key in self._resident():
            return
        self.policy.insert(key, pinned)
        if pinned:
            self.held.add(key)
        else:
            self._push(key)

    @rule(key=KEYS)
    def access(self, key: int) -> None:
        self.policy.access(key)
        if key in self.entry:
            self._push(key)

    @rule(keys=st.lists(KEYS, max_size=8, unique=True))
    def pin_many(self, keys: list[int]) -> None:
        keys = [k for k in keys if k in self.entry]
        self.policy.pin_many(keys)
        for k in keys:
            self.order.remove(self.entry.pop(k))
            self.held.add(k)

    @rule(keys=st.lists(KEYS, max_size=8, unique=True))
    def unpin_many(self, keys: list[int]) -> None:
        keys = [k for k in keys if k in self.held]
        self.policy.unpin_many(keys)
        for k in keys:
            self.held.remove(k)
            self._push(k)

    @rule(key=KEYS)
    def unpin_missing_raises(self, key: int) -> None:
        if key in self.held:
            return
        try:
            self.policy.unpin_many([key])
        except InternalInvariantError:
            pass
        else:
            raise AssertionError("unpin of a key that is not pinned was accepted")

    @rule(key=KEYS)
    def remove(self, key: int) -> None:
        self.policy.remove(key)
        old = self.entry.pop(key, None)
        if old is not None:
            self.order.remove(old)
        self.held.discard(key)

    @rule()
    def evict(self) -> None:
        expected = self.order.pop(0)[3] if self.order else None
        if expected is not None:
            del self.entry[expected]
        assert self.policy.evict() == expected

    @rule(n=st.integers(1, 5))
    def evict_many(self, n: int) -> None:
        expected = [e[3] for e in self.order[:n]]
        del self.order[:n]
        for k in expected:
            del self.entry[k]
        assert self.policy.evict_many(n) == expected

    @rule(n=st.integers(1, 40))
    def churn(self, n: int) -> None:
        # Many re-sorts of few keys: the stale entries pile up until a compaction.
        live = sorted(self.entry)
        for i in range(n):
            if live:
                self.access(live[i % len(live)])

    @invariant()
    def same(self) -> None:
        p = self.policy
        assert len(p) == len(self._resident())
        assert p.num_evictable == len(self.entry)
        for k in range(25):
            assert (k in p) == (k in self._resident())
        # The lazy heap stays bounded (a batch may overshoot until its end).
        assert len(p._heap) <= 4 * len(p._live) + 64 + 40


TestByReturn = ByReturnMachine.TestCase
TestByReturn.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


class _InsertThenMove(WorkflowPolicy):
    """The plain path for every insert: join the class the key ranks in now, then protect it."""

    def _place_indexed(self, key: int, pinned: bool, size: int) -> None:
        rank = self._rank(key)
        self._cls(rank).insert(key, pinned, size)
        if rank != DEFAULT:
            self._class_of[key] = rank
        until = self._expiry.get(key)
        if until is not None:
            self._protect(key, until)


REQUEST = st.tuples(
    st.integers(0, 3),  # session
    st.integers(1, 6),  # blocks the turn adds
    st.one_of(st.none(), st.floats(0.5, 20.0)),  # cache_ttl_s
    st.floats(0.0, 6.0),  # time since the last request
    st.booleans(),  # session ends
)


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(REQUEST, min_size=1, max_size=40),
    capacity=st.integers(4, 24),
    pin_fraction=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
)
def test_workflow_pinned_inserts_decide_as_insert_then_move(
    requests: list[tuple[int, int, float | None, float, bool]],
    capacity: int,
    pin_fraction: float,
) -> None:
    policies: list[WorkflowPolicy] = []
    for cls in (WorkflowPolicy, _InsertThenMove):
        p = cls(pin_fraction=pin_fraction)
        p.bind(capacity)
        policies.append(p)
    chains: dict[int, list[int]] = {}
    next_key = 0
    now = 0.0
    for session, grow, ttl, gap, end in requests:
        now += gap
        chain = chains.setdefault(session, [])
        chain.extend(range(next_key, next_key + grow))
        next_key += grow
        keys = chain[-capacity:] if len(chain) > capacity else list(chain)
        hints: dict[str, Any] = {"session_id": f"s{session}"}
        if ttl is not None:
            hints["cache_ttl_s"] = ttl
        if end:
            hints["session_end"] = True
            del chains[session]
        outcomes = [_one_request(p, keys, now, hints, capacity) for p in policies]
        assert outcomes[0] == outcomes[1]
        assert _state(policies[0]) == _state(policies[1])


def _state(p: WorkflowPolicy) -> dict[str, Any]:
    """The snapshot less empty classes (the shortcut may skip creating a class it never fills)."""
    state = p.snapshot()
    state["classes"] = [(rank, c) for rank, c in state["classes"] if c["used"]]
    return state


def _one_request(
    p: WorkflowPolicy, keys: list[int], now: float, hints: dict[str, Any], capacity: int
) -> tuple[list[int], list[int]]:
    """What an owner does for one request: hear of it, pin hits, make room, insert, release."""
    hits = [k for k in keys if k in p]
    n_hit = 0
    while n_hit < len(keys) and keys[n_hit] in p:
        n_hit += 1
    p.on_request(keys, n_hit, now, hints)
    if hits:  # owners call the batch forms with something to do only
        p.pin_many(hits)
        p.access_many(hits)
    new = [k for k in keys if k not in p]
    victims: list[int] = []
    over = len(p) + len(new) - capacity
    if over > 0:
        victims = p.evict_many(over)
    room = capacity - len(p)
    admitted = [k for k in new[:room] if p.admit(k)]
    if admitted:
        p.insert_many(admitted, True)
    held = [k for k in reversed(keys) if k in p]
    if held:
        p.unpin_many(held)
    return victims, admitted


# -- the simulator loop --------------------------------------------------------------------


def _reference_block(trace: Trace, policy_name: str, capacity: int) -> tuple[Any, ...]:
    """The block model one access at a time, with the policy calls written out."""
    policy = make_policy(policy_name)
    policy.bind(capacity)
    hook = getattr(policy, "on_request", None)
    if getattr(type(policy), "on_request", None) is PolicyBase.on_request:
        hook = None
    resident: set[int] = set()
    hits = prefix_hits = cached_tokens = evictions = 0

    def miss(key: int) -> int:
        if not policy.admit(key):
            return 0
        dropped = 0
        if len(resident) >= capacity:
            victim = policy.evict()
            assert victim is not None and victim in resident
            resident.remove(victim)
            dropped = 1
        policy.insert(key, False)
        resident.add(key)
        return dropped

    now = 0.0
    for index, req in enumerate(trace.requests):
        if hook is not None:
            n_hit = 0
            while n_hit < len(req.keys) and req.keys[n_hit] in resident:
                n_hit += 1
            now = max(now, float(index))
            hook(req.keys, n_hit, now, req.hints)
        lead = -1
        for j, key in enumerate(req.keys):
            if key in resident:
                hits += 1
                policy.access(key)
            else:
                if lead < 0:
                    lead = j
                evictions += miss(key)
        if lead < 0:
            lead = len(req.keys)
        prefix_hits += lead
        cached_tokens += min(lead * trace.block_size, req.input_length)
        for key in req.output_keys:
            if key in resident:
                policy.access(key)
            else:
                evictions += miss(key)
    return hits, prefix_hits, cached_tokens, evictions, sorted(resident)


BLOCK_REQUEST = st.tuples(
    st.lists(st.integers(0, 40), min_size=0, max_size=10),
    st.lists(st.integers(41, 60), max_size=3),
)


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(BLOCK_REQUEST, min_size=1, max_size=30),
    capacity=st.integers(1, 16),
    policy=st.sampled_from(["lru", "learned-reuse", "workflow", "arc", "s3fifo"]),
)
def test_block_simulator_matches_a_plain_loop(
    requests: list[tuple[list[int], list[int]]], capacity: int, policy: str
) -> None:
    bs = 4
    reqs = [
        TraceRequest(input_length=max(1, bs * len(keys) - 1), keys=keys, output_keys=out)
        for keys, out in requests
    ]
    trace = Trace("random", "mooncake", bs, reqs)
    got = simulate_block(trace, policy, capacity)
    hits, prefix_hits, cached_tokens, evictions, _ = _reference_block(trace, policy, capacity)
    assert (got.block_hits, got.prefix_hit_blocks, got.cached_tokens, got.evictions) == (
        hits,
        prefix_hits,
        cached_tokens,
        evictions,
    )
    assert got.block_accesses == sum(len(r.keys) for r in reqs)
