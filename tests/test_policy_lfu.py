"""LFU: real frequency counts, least-recent tie-break, aging and history."""

from __future__ import annotations

import pytest

from kvtier import ConfigError
from kvtier.policy import LFUPolicy


def test_hot_entry_kept_over_cold_one() -> None:
    p = LFUPolicy()
    p.bind(4)
    p.insert_many([1, 2])
    for _ in range(5):
        p.access(1)
    p.access(2)
    p.access(1)  # 1 is also the most recent, so recency cannot explain the choice
    p.access(2)
    assert p.count(1) == 7 and p.count(2) == 3
    assert p.evict() == 2


def test_frequency_beats_recency() -> None:
    p = LFUPolicy()
    p.bind(4)
    p.insert(1)
    p.access(1)
    p.insert(2)  # newer, but seen once
    assert p.evict() == 2


def test_ties_go_to_the_least_recent_and_release_counts_as_recent() -> None:
    p = LFUPolicy()
    p.bind(4)
    p.insert_many([1, 2, 3])
    p.pin(1)
    p.unpin(1)  # same count, now the most recent
    assert p.evict_many(3) == [2, 3, 1]


def test_pinned_hits_count() -> None:
    p = LFUPolicy()
    p.bind(4)
    p.insert_many([1, 2], pinned=True)
    p.access_many([1, 1, 1])  # hits while held, as the pool reports them
    p.unpin_many([1, 2])
    assert p.evict() == 2


def test_aging_lets_a_new_hot_key_overtake_an_old_one() -> None:
    def run(aging_period: int) -> int | None:
        p = LFUPolicy(aging_period=aging_period)
        p.bind(4)
        p.insert(1)
        for _ in range(100):
            p.access(1)
        p.insert(2)
        for _ in range(60):
            p.access(2)
        return p.evict()

    assert run(10**9) == 2, "without aging the old key's 101 beats 61"
    assert run(40) == 1, "halving every 40 hits lets the recent traffic win"


def test_counts_survive_eviction_in_a_bounded_history() -> None:
    p = LFUPolicy()
    p.bind(2)
    p.insert(1)
    for _ in range(5):
        p.access(1)
    assert p.evict() == 1
    p.insert(1)  # comes back with its old count
    p.insert(2)
    assert p.count(1) == 7
    assert p.evict() == 2
    for k in range(10, 20):  # the history holds at most `capacity` keys
        p.insert(k)
        assert p.evict() == k
    assert len(p._history) <= 2


def test_bad_aging_period() -> None:
    with pytest.raises(ConfigError):
        LFUPolicy(aging_period=0)
