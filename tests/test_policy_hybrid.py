"""The hybrid policy: recency, frequency and size each matter; pressure favours size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import ConfigError
from kvtier.policy import HybridPolicy


def test_recency_orders_equal_keys() -> None:
    p = HybridPolicy()
    p.bind(100)
    p.insert_many([1, 2, 3])
    p.pin(1)
    p.unpin(1)  # a release is a use
    assert p.evict_many(3) == [2, 3, 1]


def test_frequency_beats_a_small_age_difference() -> None:
    p = HybridPolicy()
    p.bind(100)
    p.insert(1)
    for _ in range(9):
        p.access(1)
    p.insert(2)  # newer by one use, but seen once
    assert p.evict() == 2


def test_a_long_idle_key_loses_however_hot() -> None:
    p = HybridPolicy(horizon=10)
    p.bind(100)
    p.insert(1)
    for _ in range(50):
        p.access(1)
    p.insert(2, pinned=True)
    for _ in range(30):  # far more than the horizon of uses elsewhere
        p.access(2)
    p.unpin(2)
    p.insert(3)
    assert p.score(1) < 0 <= p.score(3)
    assert p.evict() == 1


def _small_old_vs_big_new(pressure: float) -> int | None:
    p = HybridPolicy(horizon=10)
    p.bind(100)
    p.insert(1, size=1)
    for k in range(10, 14):  # uses elsewhere make 1 older than 2
        p.insert(k, pinned=True)
    p.insert(2, size=8)
    p.pressure = pressure
    return p.evict()


def test_size_matters_and_pressure_shifts_toward_it() -> None:
    assert _small_old_vs_big_new(0.0) == 1, "no pressure: recency wins"
    assert _small_old_vs_big_new(1.0) == 2, "full pressure: the big entry goes"


def test_size_alone_decides_between_otherwise_equal_keys() -> None:
    p = HybridPolicy()
    p.bind(100)
    p.insert(1, size=4, pinned=True)
    p.insert(2, size=1, pinned=True)
    p.unpin_many([2, 1])  # 1 is the more recent, yet the bigger one
    assert p.evict() == 1


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("iaupe"), st.integers(0, 20), st.integers(1, 40)),
        max_size=80,
    ),
    st.floats(0.0, 1.0),
)
def test_evicts_the_lowest_score(ops: list[tuple[str, int, int]], pressure: float) -> None:
    p = HybridPolicy(horizon=8)
    p.bind(400)
    evictable: set[int] = set()
    pinned: set[int] = set()
    n = 0
    for op, i, size in ops:
        if op == "i" and len(evictable) + len(pinned) < 10:
            n += 1
            p.insert(n, size=size, pinned=i % 2 == 0)
            (pinned if i % 2 == 0 else evictable).add(n)
        elif op == "a" and evictable | pinned:
            keys = sorted(evictable | pinned)
            p.access(keys[i % len(keys)])
        elif op == "u" and pinned:
            k = sorted(pinned)[i % len(pinned)]
            p.unpin(k)
            pinned.remove(k)
            evictable.add(k)
        elif op == "p":
            p.pressure = pressure if i % 2 else 0.0
        elif op == "e" and evictable:
            scores = {k: p.score(k) for k in evictable}
            victim = p.evict()
            assert victim in scores
            assert scores[victim] == pytest.approx(min(scores.values()), abs=1e-9)
            evictable.remove(victim)


def test_bad_parameters() -> None:
    with pytest.raises(ConfigError):
        HybridPolicy(recency_weight=-1)
    with pytest.raises(ConfigError):
        HybridPolicy(pressure=1.5)
    p = HybridPolicy()
    with pytest.raises(ConfigError):
        p.pressure = -0.1
    with pytest.raises(ConfigError):
        p.insert(1, size=0)
