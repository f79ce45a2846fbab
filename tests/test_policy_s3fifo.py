"""S3-FIFO: one-hit wonders leave from the small queue, hot keys reach main."""

from __future__ import annotations

import pytest

from kvtier import ConfigError
from kvtier.policy import S3FIFOPolicy


def test_one_hit_wonders_go_to_ghost_and_hot_keys_to_main() -> None:
    p = S3FIFOPolicy()
    p.bind(10)  # S targets 1 key
    p.insert_many([1, 2, 3])
    p.access_many([1, 1, 2])  # 1 hit twice (> 1), 2 once
    assert p.evict() == 2, "1 moves to main, 2 is a one-hit wonder"
    assert p.sizes == (1, 1, 1)
    assert p.evict() == 3
    assert p.evict() == 1  # main: its bits were cleared on the move


def test_promote_threshold_is_configurable() -> None:
    p = S3FIFOPolicy(promote_above=0)  # one hit is enough
    p.bind(10)
    p.insert_many([1, 2])
    p.access(1)
    assert p.evict() == 2


def test_main_gives_second_chances() -> None:
    p = S3FIFOPolicy()
    p.bind(10)
    p.insert(1)
    assert p.evict() == 1  # into the ghost
    p.insert_many([1, 2])  # 1 is a ghost hit: straight to main
    assert p.sizes == (1, 1, 0)
    p.insert(3)
    p.access(1)
    # S holds 2 and 3 (at its target), so S is evicted from first.
    assert p.evict() == 2 and p.evict() == 3
    p.insert(4)
    p.insert(5)
    # S is now at its target again: its oldest goes first, then main's 1 after its second chance.
    assert p.evict_many(3) == [4, 5, 1]


def test_ghost_is_bounded_by_capacity() -> None:
    p = S3FIFOPolicy()
    p.bind(5)
    for k in range(50):
        p.insert(k)
        assert p.evict() == k
    assert p.sizes[2] == 5


def test_pinned_small_keys_fall_back_to_main() -> None:
    p = S3FIFOPolicy()
    p.bind(10)
    p.insert(1)
    p.evict()
    p.insert(1)  # main
    p.insert(2, pinned=True)  # small, held
    assert p.evict() == 1
    assert p.evict() is None
    p.unpin(2)
    assert p.evict() == 2


def test_bad_parameters() -> None:
    with pytest.raises(ConfigError):
        S3FIFOPolicy(small_ratio=0.0)
    with pytest.raises(ConfigError):
        S3FIFOPolicy(promote_above=3)
