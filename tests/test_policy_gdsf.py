"""GDSF: value per unit of size, frequency, and inflation by the last victim."""

from __future__ import annotations

import pytest

from kvtier import ConfigError
from kvtier.policy import GDSFPolicy


def test_large_entry_goes_before_small_one() -> None:
    p = GDSFPolicy()
    p.bind(16)
    p.insert(1, size=1)
    p.insert(2, size=8)  # newer, but eight times the space for the same value
    assert p.evict() == 2


def test_cheap_entry_goes_before_costly_one() -> None:
    p = GDSFPolicy()
    p.bind(4)
    p.insert(1, cost=5.0)
    p.insert(2, cost=1.0)
    assert p.evict() == 2


def test_frequency_and_inflation() -> None:
    p = GDSFPolicy()
    p.bind(4)
    p.insert_many([1, 2], sizes=[2, 2], costs=[1.0, 1.0])
    p.access(1)  # H(1) = 0 + 2 * 1 / 2 = 1.0; H(2) = 0.5
    assert p.evict() == 2 and p.L == 0.5
    p.insert(3)  # H = 0.5 + 1 = 1.5
    assert p.priority(3) == 1.5
    assert p.evict() == 1 and p.L == 1.0


def test_release_refreshes_priority_with_current_inflation() -> None:
    p = GDSFPolicy()
    p.bind(4)
    p.insert(1, pinned=True)
    p.insert_many([2, 3])
    p.access(2)  # H(2) = 2, H(3) = 1
    assert p.evict() == 3 and p.L == 1.0
    p.unpin(1)  # H(1) = L + 1 = 2, a tie with 2 that the older entry loses
    assert p.evict_many(2) == [2, 1]


def test_stale_entries_are_compacted() -> None:
    p = GDSFPolicy()
    p.bind(4)
    p.insert(1)
    for _ in range(1000):
        p.access(1)
    assert len(p._heap) <= 2 * p.num_evictable + 64 + 1
    assert p.evict() == 1 and p.evict() is None


def test_bad_sizes_and_costs_change_nothing() -> None:
    p = GDSFPolicy()
    with pytest.raises(ConfigError):
        p.insert(1, size=0)
    with pytest.raises(ConfigError):
        p.insert_many([1, 2], sizes=[1, -1])
    with pytest.raises(ConfigError):
        p.insert_many([1, 2], costs=[1.0])
    assert len(p) == 0
