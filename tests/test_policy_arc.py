"""ARC: scan resistance, ghost hits adapting p, and pinned entries."""

from __future__ import annotations

from kvtier.policy import ARCPolicy


def test_scan_does_not_flush_reused_keys() -> None:
    p = ARCPolicy()
    p.bind(4)
    p.insert_many([1, 2])
    p.access_many([1, 2])  # seen twice: T2
    for k in range(100, 120):  # a long scan of one-time keys
        if len(p) == 4:
            assert p.evict() not in (1, 2)
        p.insert(k)
    assert 1 in p and 2 in p
    t1, t2, b1, b2 = p.sizes
    assert t2 == 2 and t1 + b1 <= 4 and b1 + b2 <= 4


def test_ghost_hit_in_b1_grows_p_and_lands_in_t2() -> None:
    p = ARCPolicy()
    p.bind(2)
    p.insert_many([1, 2])
    assert p.evict() == 1  # T1's LRU, remembered in B1
    assert p.sizes == (1, 0, 1, 0)
    p.insert(1)
    assert p.p == 1.0
    assert p.sizes == (1, 1, 0, 0), "a ghost hit enters T2"


def test_ghost_hit_in_b2_shrinks_p() -> None:
    p = ARCPolicy()
    p.bind(2)
    p.insert_many([1, 2])
    p.evict()  # 1 -> B1
    p.insert(1)  # p = 1, 1 in T2
    p.access(2)  # 2 moves to T2 as well; T1 is empty
    assert p.evict() == 1  # T2's LRU, remembered in B2
    p.insert(3)
    p.insert(1)  # B2 ghost hit
    assert p.p == 0.0
    t1, t2, _, b2 = p.sizes
    assert (t1, t2, b2) == (1, 2, 0)


def test_falls_back_to_the_other_list_when_one_is_pinned() -> None:
    p = ARCPolicy()
    p.bind(4)
    p.insert_many([1, 2])
    p.access(2)  # T2
    p.pin(1)  # T1 is now all pinned, though REPLACE prefers it (p = 0)
    assert p.evict() == 2
    assert p.evict() is None
    p.access(1)  # a hit while held moves it to T2 ...
    p.unpin(1)  # ... where it returns on release
    assert p.sizes[:2] == (0, 1)
    assert p.evict() == 1
