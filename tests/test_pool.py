"""The device block pool: free list, ref counts, commit, eviction with cascades."""

from __future__ import annotations

import pytest

from kvtier import (
    BlockPool,
    ConfigError,
    InternalInvariantError,
    LRUPolicy,
    OutOfBlocksError,
)


def test_bad_sizes() -> None:
    with pytest.raises(ConfigError):
        BlockPool(0, 16)
    with pytest.raises(ConfigError):
        BlockPool(4, 0)
    with pytest.raises(ConfigError):
        BlockPool(-3, 4)


def test_allocate_release_and_out_of_blocks_is_atomic() -> None:
    pool = BlockPool(4, 2)
    blocks = pool.allocate(3)
    assert sorted(blocks) == [0, 1, 2] and all(pool.ref[b] == 1 for b in blocks)
    assert pool.num_free == 1 and pool.num_used == 3 and pool.usage == 0.75
    with pytest.raises(OutOfBlocksError) as info:
        pool.allocate(2)
    assert info.value.needed == 2 and info.value.available == 1
    assert pool.num_free == 1, "a failed allocation changes nothing"
    pool.release(blocks)
    assert pool.num_free == 4 and pool.num_cached == 0
    assert pool.allocate(0) == []
    pool.check()


def test_commit_makes_blocks_reusable_after_release() -> None:
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    assert pool.commit(a, 10, None) == a
    assert pool.commit(b, 11, 10) == b
    pool.release([b, a])
    assert pool.num_evictable == 2 and pool.num_free == 4 and pool.num_empty == 2
    assert pool.lookup([10, 11, 12]) == [a, b]
    assert pool.lookup([12, 10]) == []
    pool.acquire([a, b])
    assert pool.num_evictable == 0
    pool.release([b, a])
    pool.check(holders=[])


def test_duplicate_commit_returns_the_cached_block() -> None:
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    assert pool.commit(a, 10, None) == a
    assert pool.commit(b, 10, None) == a
    assert pool.block_key[b] is None, "the duplicate stays private"
    pool.release([a, b])
    assert pool.num_empty == 3 and pool.num_evictable == 1


def test_lru_evicts_leaves_first_when_released_tail_first() -> None:
    pool = BlockPool(3, 2)
    blocks = pool.allocate(3)
    parent = None
    for i, blk in enumerate(blocks):
        pool.commit(blk, 100 + i, parent)
        parent = 100 + i
    pool.release(blocks[::-1])  # leaf released first: oldest
    (got,) = pool.allocate(1)
    assert got == blocks[2] and pool.evictions == 1 and pool.cascade_evictions == 0
    assert pool.lookup([100, 101, 102]) == blocks[:2]
    pool.check(holders=[[got]])


def test_evicting_an_inner_block_cascades_to_its_subtree() -> None:
    pool = BlockPool(4, 2)
    blocks = pool.allocate(3)
    parent = None
    for i, blk in enumerate(blocks):
        pool.commit(blk, 100 + i, parent)
        parent = 100 + i
    pool.release(blocks)  # root released first: LRU picks the root
    (got,) = pool.allocate(1)  # the empty block 3 comes first
    assert got == 3
    (got,) = pool.allocate(1)
    assert got == blocks[0]
    assert pool.evictions == 1 and pool.cascade_evictions == 2
    assert pool.lookup([100]) == [] and pool.num_cached == 0
    assert pool.num_empty == 2, "the cascaded children went to the free list"
    pool.check(holders=[[3], [got]])


def test_versions_change_on_reuse() -> None:
    pool = BlockPool(1, 2)
    (a,) = pool.allocate(1)
    v = pool.version[a]
    pool.release([a])
    (b,) = pool.allocate(1)
    assert b == a and pool.version[b] == v + 1


class DeclineOdd(LRUPolicy):
    name = "decline-odd"

    def admit(self, key: int) -> bool:
        return key % 2 == 0


def test_admission_decline_keeps_block_private() -> None:
    pool = BlockPool(2, 2, DeclineOdd())
    a, b = pool.allocate(2)
    assert pool.commit(a, 3, None) == -1
    assert pool.declined == 1 and pool.block_key[a] is None
    assert pool.commit(b, 4, None) == b
    pool.release([a, b])
    assert pool.num_empty == 1 and pool.num_evictable == 1


def test_misuse_is_detected() -> None:
    pool = BlockPool(4, 2)
    with pytest.raises(InternalInvariantError):
        pool.acquire([0])
    with pytest.raises(InternalInvariantError):
        pool.release([0])
    (a,) = pool.allocate(1)
    with pytest.raises(InternalInvariantError, match="parent"):
        pool.commit(a, 5, 99)
    pool.commit(a, 5, None)
    (b,) = pool.allocate(1)
    with pytest.raises(InternalInvariantError, match="already cached"):
        pool.commit(a, 6, None)
    with pytest.raises(InternalInvariantError, match="holders"):
        pool.check(holders=[[a]])  # b is held too but not listed
    pool.check(holders=[[a], [b]])


def test_gc_and_clear() -> None:
    pool = BlockPool(4, 2)
    blocks = pool.allocate(4)
    for i, blk in enumerate(blocks):
        pool.commit(blk, 200 + i, None)
    pool.release(blocks)
    assert pool.evict(1) == 1 and pool.num_evictable == 3
    assert pool.clear_cache() == 3
    assert pool.num_empty == 4 and pool.num_cached == 0
    pool.check(holders=[])
