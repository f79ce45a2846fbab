"""SIEVE: visited keys survive a pass, and the hand agrees with a list-based reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy import SIEVEPolicy


def test_visited_key_survives_one_pass() -> None:
    p = SIEVEPolicy()
    p.bind(4)
    for k in (1, 2, 3):
        p.insert(k)
    p.access(1)
    assert p.evict() == 2, "the hand clears 1's bit and moves on"
    p.insert(4)
    assert p.evict() == 3, "the hand resumes where it stopped, not at the tail"
    assert p.evict_many(2) == [4, 1], "then on toward the head, and 1 only after the wrap"


def test_hand_wraps_and_bits_are_cleared_once() -> None:
    p = SIEVEPolicy()
    p.bind(3)
    for k in (1, 2, 3):
        p.insert(k)
    p.access_many([1, 2, 3])
    # A full sweep clears every bit; the tail goes first after the wrap.
    assert p.evict_many(3) == [1, 2, 3]


def test_unpin_restores_at_head_with_its_bit() -> None:
    p = SIEVEPolicy()
    p.bind(4)
    for k in (1, 2, 3):
        p.insert(k)
    p.pin(1)
    p.access(1)
    p.unpin(1)  # back at the head, visited
    assert p.evict_many(3) == [2, 3, 1]


def test_pinning_the_last_key_before_the_wrap() -> None:
    p = SIEVEPolicy()
    p.bind(4)
    p.insert_many([1, 2, 3])
    p.access(1)
    assert p.evict() == 2  # the hand now points at 3, the head
    p.pin(3)  # ... which leaves: the hand wraps to the tail
    p.insert(4)
    assert p.evict_many(3) == [1, 4]


class _Reference:
    """SIEVE as in the paper's pseudo-code: a list (tail first) and a hand index."""

    def __init__(self) -> None:
        self.q: list[int] = []
        self.visited: dict[int, bool] = {}
        self.pinned: set[int] = set()
        self.hand: int | None = None

    def _drop(self, i: int) -> None:
        del self.q[i]
        if self.hand is not None:
            if i < self.hand:
                self.hand -= 1
            if self.hand >= len(self.q):
                self.hand = None

    def insert(self, key: int) -> None:
        self.q.append(key)
        self.visited[key] = False

    def pin(self, key: int) -> None:
        self._drop(self.q.index(key))
        self.pinned.add(key)

    def unpin(self, key: int) -> None:
        self.pinned.remove(key)
        self.q.append(key)

    def evict(self) -> int | None:
        if not self.q:
            return None
        i = 0 if self.hand is None else self.hand
        while self.visited[self.q[i]]:
            self.visited[self.q[i]] = False
            i = (i + 1) % len(self.q)
        key = self.q[i]
        self.hand = i
        self._drop(i)
        del self.visited[key]
        return key


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("iapue"), st.integers(0, 30)), max_size=60))
def test_matches_reference(ops: list[tuple[str, int]]) -> None:
    p, ref = SIEVEPolicy(), _Reference()
    p.bind(8)
    n = 0
    for op, i in ops:
        if op == "i" and len(ref.q) + len(ref.pinned) < 8:
            n += 1
            p.insert(n)
            ref.insert(n)
        elif op == "a" and ref.visited:
            k = sorted(ref.visited)[i % len(ref.visited)]
            p.access(k)
            ref.visited[k] = True
        elif op == "p" and ref.q:
            k = ref.q[i % len(ref.q)]
            p.pin(k)
            ref.pin(k)
        elif op == "u" and ref.pinned:
            k = sorted(ref.pinned)[i % len(ref.pinned)]
            p.unpin(k)
            ref.unpin(k)
        elif op == "e":
            assert p.evict() == ref.evict()
    assert p.evict_many(20) == [ref.evict() for _ in range(len(ref.q))]
