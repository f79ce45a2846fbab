"""Block keys from outside (a trace's hash ids, an engine's own hashes) need not be chained.

kvtier's own keys hash the parent, so a key names one prefix. Keys given
with ``block_keys`` may not: the same key can sit at the same position after
different parents. The pool must then treat the key as a miss and keep the
later block private, never hit or hold a block whose ancestors nobody
holds (an eviction of those ancestors would cascade into a held block).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import KVCacheManager, OutOfBlocksError

BS = 4


def _serve(m: KVCacheManager, rid: str, keys: list[int]) -> None:
    """A request of ``len(keys)`` full blocks and a partial one, freed at once, as a replay does."""
    n = len(keys) * BS + 1
    try:
        m.allocate(rid, range(n), block_keys=keys)
    except OutOfBlocksError:
        return
    m.free(rid)


def test_a_key_cached_under_another_parent_is_a_miss_and_stays_private() -> None:
    m = KVCacheManager(16, BS)  # room for all: nothing is evicted, the collision stays
    _serve(m, "a", [1000])
    _serve(m, "b", [1001, 1010])  # 1010 cached under 1001
    m.check()
    # 1000 then 1010: 1010 is cached, but as 1001's child, not 1000's.
    got = m.allocate("c", range(5 * BS + 1), block_keys=[1000, 1010, 1020, 1030, 1040])
    assert got.num_cached_tokens == BS  # only 1000
    m.check()
    assert m.pool.collisions == 1  # 1010 and the blocks after it stay private to c
    m.free("c")
    m.check()
    # The small pool of the trace that showed it: evicting 1001 must not cascade into c.
    small = KVCacheManager(6, BS)
    _serve(small, "a", [1000])
    _serve(small, "b", [1001, 1010])
    _serve(small, "c", [1000, 1010, 1020, 1030, 1040])
    small.check()


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(3, 12),
    requests=st.lists(
        st.lists(st.integers(0, 5), min_size=1, max_size=6).map(
            lambda ts: [1000 + 10 * i + t for i, t in enumerate(ts)]  # position-keyed, not chained
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_unchained_keys_never_break_the_pool(num_blocks: int, requests: list[list[int]]) -> None:
    m = KVCacheManager(num_blocks, BS)
    for i, keys in enumerate(requests):
        _serve(m, f"r{i}", keys)
        m.check()
    assert len(m) == 0
