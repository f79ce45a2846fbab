"""The workflow policy's batched orders decide exactly what one entry per key would.

* :class:`~kvtier.agents.queues.LatestPins` (protected keys, latest end first)
  against a plain heap of ``(-until, -depth, key)``, one entry per key pushed:
  the same first entry and the same length after every push, batch push, pop
  and rebuild.
* :class:`~kvtier.agents.queues.EndQueue` (pin ends, soonest first) against a
  plain heap of ``(until, -depth, key)``: every key pushed comes out once, in
  that heap's order, at the first ``due`` call whose time reaches its end.
* :meth:`~kvtier.agents.ranks.TailFirstLRU.join` against one ``insert`` per key.
"""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.agents.queues import EndQueue, LatestPins
from kvtier.agents.ranks import TailFirstLRU

UNTILS = st.sampled_from([1.0, 2.0, 2.5, 3.0, 7.0])
PAIRS = st.lists(st.tuples(st.integers(-4, 0), st.integers(0, 12)), max_size=6)


class LatestPinsMachine(RuleBasedStateMachine):
    """Pushes, batches, pops and rebuilds against a heap of one entry per key."""

    @initialize()
    def setup(self) -> None:
        self.pins = LatestPins()
        self.heap: list[tuple[float, int, int]] = []

    @rule(until=UNTILS, neg_depth=st.integers(-4, 0), key=st.integers(0, 12))
    def push(self, until: float, neg_depth: int, key: int) -> None:
        self.pins.push(until, neg_depth, key)
        heapq.heappush(self.heap, (-until, neg_depth, key))

    @rule(until=UNTILS, pairs=PAIRS)
    def push_many(self, until: float, pairs: list[tuple[int, int]]) -> None:
        self.pins.push_many(until, list(pairs))
        for neg_depth, key in pairs:
            heapq.heappush(self.heap, (-until, neg_depth, key))

    @precondition(lambda self: self.heap)
    @rule()
    def pop(self) -> None:
        self.pins.pop()
        heapq.heappop(self.heap)

    @rule(entries=st.lists(st.tuples(UNTILS, st.integers(-4, 0), st.integers(0, 12)), max_size=6))
    def rebuild(self, entries: list[tuple[float, int, int]]) -> None:
        self.pins.rebuild(entries)
        self.heap = [(-u, d, k) for u, d, k in entries]
        heapq.heapify(self.heap)

    @invariant()
    def same_first_entry(self) -> None:
        assert self.pins.size == len(self.heap)
        if self.heap:
            neg_until, _, key = self.heap[0]
            assert self.pins.top() == (-neg_until, key)


TestLatestPins = LatestPinsMachine.TestCase
TestLatestPins.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("push"), UNTILS, PAIRS),
            st.tuples(st.just("due"), st.sampled_from([0.5, 2.0, 2.7, 5.0, 9.0]), st.just([])),
        ),
        max_size=30,
    )
)
def test_end_queue_releases_in_heap_order(
    steps: list[tuple[str, float, list[tuple[int, int]]]],
) -> None:
    queue = EndQueue()
    heap: list[tuple[float, int, int]] = []
    for op, t, pairs in steps:
        if op == "push":
            if not pairs:
                continue  # the policy pushes no empty batch
            queue.push(t, list(pairs))
            for neg_depth, key in pairs:
                heapq.heappush(heap, (t, neg_depth, key))
            continue
        got: list[tuple[float, int, int]] = []
        while (due := queue.due(t)) is not None:
            until, batch = due
            got.extend((until, d, k) for d, k in batch)
        expected = []
        while heap and heap[0][0] <= t:
            expected.append(heapq.heappop(heap))
        assert got == expected
        assert bool(queue) == bool(heap)


@settings(max_examples=100, deadline=None)
@given(
    before=st.lists(st.integers(0, 30), unique=True, max_size=8),
    keys=st.lists(st.integers(31, 60), unique=True, max_size=8),
    pinned=st.sets(st.integers(31, 60)),
)
def test_join_is_one_insert_per_key(before: list[int], keys: list[int], pinned: set[int]) -> None:
    a, b = TailFirstLRU(), TailFirstLRU()
    for c in (a, b):
        c.bind(100)
        for k in before:
            c.insert(k)
    a.join(keys, pinned)
    for k in keys:
        b.insert(k, k in pinned)
    assert a.snapshot() == b.snapshot()
    assert a.evict_many(20) == b.evict_many(20)
