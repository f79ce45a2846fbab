"""FIFO: insertion order, whatever the hits and releases."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy import FIFOPolicy


def test_insertion_order_regardless_of_access() -> None:
    p = FIFOPolicy()
    p.bind(4)
    p.insert_many([1, 2, 3])
    p.access(1)
    p.access_many([1, 2])
    p.pin(2)
    p.unpin(2)  # a release does not send 2 to the back
    assert p.evict_many(4) == [1, 2, 3]


def test_pinned_keys_are_skipped_then_keep_their_place() -> None:
    p = FIFOPolicy()
    p.bind(4)
    p.insert(1, pinned=True)
    p.insert_many([2, 3])
    assert p.evict() == 2
    p.insert(4)
    p.unpin(1)
    assert p.evict_many(3) == [1, 3, 4]


def test_reinserted_key_goes_to_the_back() -> None:
    p = FIFOPolicy()
    p.bind(4)
    p.insert_many([1, 2])
    assert p.evict() == 1
    p.insert(1)
    assert p.evict_many(2) == [2, 1]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ipure"), st.integers(0, 30)), max_size=200))
def test_evicts_oldest_unpinned_and_stays_compact(ops: list[tuple[str, int]]) -> None:
    p = FIFOPolicy()
    p.bind(8)
    order: list[int] = []  # resident keys in insertion order
    pinned: set[int] = set()
    n = 0
    for op, i in ops:
        if op == "i" and len(order) < 8:
            n += 1
            p.insert(n)
            order.append(n)
        elif op == "p" and len(order) > len(pinned):
            k = sorted(set(order) - pinned)[i % (len(order) - len(pinned))]
            p.pin(k)
            pinned.add(k)
        elif op == "u" and pinned:
            k = sorted(pinned)[i % len(pinned)]
            p.unpin(k)
            pinned.remove(k)
        elif op == "r" and order:
            k = order[i % len(order)]
            p.remove(k)
            order.remove(k)
            pinned.discard(k)
        elif op == "e":
            expected = next((k for k in order if k not in pinned), None)
            assert p.evict() == expected
            if expected is not None:
                order.remove(expected)
        assert len(p._heap) <= 2 * p.num_evictable + 64 + 1
