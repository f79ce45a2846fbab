"""KVCacheManager: prefix reuse, extend, fork/CoW, errors, rollback, pressure, stats."""

from __future__ import annotations

import pytest
from helpers import snapshot

from kvtier import (
    BadRequestError,
    ConfigError,
    DuplicateRequestError,
    InternalInvariantError,
    KVCacheManager,
    Namespace,
    OutOfBlocksError,
    PressureEvent,
    UnknownRequestError,
)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_second_request_reuses_the_prefix() -> None:
    m = KVCacheManager(16, 4)
    a = m.allocate("a", tokens(10))
    assert a.num_cached_tokens == 0 and len(a.block_table.blocks) == 3
    b = m.allocate("b", tokens(10))
    assert b.num_cached_tokens == 8
    assert b.block_table.blocks[:2] == a.block_table.blocks[:2]
    assert b.block_table.blocks[2] != a.block_table.blocks[2], "partial tails are private"
    assert b.new_blocks == [b.block_table.blocks[2]]
    s = m.stats()
    assert (s.hit_tokens, s.queried_tokens, s.hit_ratio) == (8, 20, 0.4)
    m.check()


def test_last_token_is_never_reported_cached() -> None:
    m = KVCacheManager(16, 4)
    m.allocate("a", tokens(8))
    m.free("a")
    b = m.allocate("b", tokens(8))
    assert b.num_cached_tokens == 4, "one block is recomputed so the last token has logits"
    # The recomputed block duplicates a cached one; holding the cached copy keeps
    # the chain that b publishes under it from being stranded.
    assert m.stats().duplicate_blocks == 1
    assert len(m.held_blocks("b")) == 3
    m.extend("b", tokens(4, 100))
    m.free("b")
    c = m.allocate("c", [*tokens(8), *tokens(4, 100), 7])
    assert c.num_cached_tokens == 12
    m.check()
    m.free("c")
    assert m.pool.num_used == 0


def test_extend_commits_newly_full_blocks() -> None:
    m = KVCacheManager(16, 4)
    m.allocate("a", tokens(6))
    e = m.extend("a", [50, 51])
    assert e.new_blocks == [] and e.block_table.num_tokens == 8
    e = m.extend("a", [52])
    assert len(e.new_blocks) == 1 and len(e.block_table.blocks) == 3
    m.free("a")
    b = m.allocate("b", [*tokens(6), 50, 51, 52, 9])
    assert b.num_cached_tokens == 8
    m.check()


def test_fork_shares_blocks_and_copies_on_write() -> None:
    m = KVCacheManager(16, 4)
    a = m.allocate("a", tokens(6))
    table = m.fork("a", "b")
    assert table == a.block_table
    shared_tail = a.block_table.blocks[1]
    assert m.pool.ref[shared_tail] == 2
    eb = m.extend("b", [70])
    assert eb.copies == [(shared_tail, eb.block_table.blocks[1])]
    assert m.pool.ref[shared_tail] == 1
    ea = m.extend("a", [80])
    assert ea.copies == [], "the other holder writes in place once it is the only one"
    assert m.stats().cow_copies == 1
    # A fork whose shared last block is full needs no copy.
    m.extend("a", [81])
    m.fork("a", "c")
    ec = m.extend("c", [90])
    assert ec.copies == [] and len(ec.new_blocks) == 1
    m.check()
    for rid in ("a", "b", "c"):
        m.free(rid)
    assert m.pool.num_used == 0
    m.check()


def test_errors_are_typed_and_clear() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        KVCacheManager(8, 0)
    with pytest.raises(ConfigError, match="num_blocks"):
        KVCacheManager(0, 4)
    with pytest.raises(ConfigError, match="high_watermark"):
        KVCacheManager(8, 4, high_watermark=0)
    with pytest.raises(ConfigError, match="unknown policy"):
        KVCacheManager(8, 4, policy="nope")
    m = KVCacheManager(8, 4)
    m.allocate("a", tokens(3))
    before = snapshot(m)
    with pytest.raises(DuplicateRequestError, match="already allocated"):
        m.allocate("a", tokens(3))
    with pytest.raises(BadRequestError, match="empty"):
        m.allocate("x", [])
    with pytest.raises(BadRequestError, match="negative"):
        m.allocate("x", [1, -1])
    with pytest.raises(BadRequestError, match="limit"):
        m.allocate("x", [2**32])
    with pytest.raises(BadRequestError, match="integer"):
        m.allocate("x", "hello")  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match="integer"):
        m.allocate("x", [1, None])  # type: ignore[list-item]
    with pytest.raises(BadRequestError, match="hashable"):
        m.allocate(["x"], [1])  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match="block_keys"):
        m.allocate("x", tokens(8), block_keys=[1])
    with pytest.raises(BadRequestError, match="empty"):
        m.extend("a", [])
    with pytest.raises(BadRequestError, match="negative"):
        m.extend("a", [3, -5])
    with pytest.raises(BadRequestError):
        m.can_allocate(-1)
    with pytest.raises(BadRequestError):
        m.gc(-1)
    for op in (lambda: m.extend("zz", [1]), lambda: m.free("zz"), lambda: m.fork("zz", "y"),
               lambda: m.block_table("zz"), lambda: m.num_tokens(["unhashable"])):
        with pytest.raises(UnknownRequestError, match="unknown request id"):
            op()
    with pytest.raises(DuplicateRequestError):
        m.fork("a", "a")
    assert snapshot(m) == before, "rejected calls change nothing"


def test_out_of_blocks_rolls_back_completely() -> None:
    m = KVCacheManager(4, 4)
    m.allocate("a", tokens(8))
    m.free("a")
    m.allocate("b", tokens(8, 100))  # 2 blocks held, 2 evictable cached
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError) as info:
        m.allocate("c", [*tokens(8), *tokens(9, 500)])  # hits 2, needs 3 more, only 0 left
    assert info.value.needed == 3
    after = snapshot(m)
    assert after.pop("stats").allocation_failures == 1
    before.pop("stats")
    assert after == before
    m.allocate("d", tokens(2, 900))
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.extend("d", tokens(20))
    after = snapshot(m)
    assert after.pop("stats").allocation_failures == 2
    before.pop("stats")
    assert after == before
    m.check()


def test_can_allocate_counts_evictable_blocks() -> None:
    m = KVCacheManager(4, 4)
    assert m.can_allocate(16) and not m.can_allocate(17) and m.can_allocate(0)
    m.allocate("a", tokens(8))
    assert not m.can_allocate(9) and m.can_allocate(8)
    m.free("a")
    assert m.can_allocate(16), "cached-but-unreferenced blocks can be reclaimed"


def test_eviction_happens_under_pressure_and_keeps_the_pool_bounded() -> None:
    m = KVCacheManager(6, 4)
    for i in range(20):
        m.allocate(i, tokens(9, 1000 * i))
        m.free(i)
        m.check()
    s = m.stats()
    assert s.evictions > 0 and s.cached_blocks <= 6 and s.used_blocks == 0
    assert s.free_blocks == 6


def test_pressure_callback_can_free_a_request_and_the_allocation_then_succeeds() -> None:
    m = KVCacheManager(4, 4, high_watermark=0.5)
    events: list[PressureEvent] = []

    def on_pressure(event: PressureEvent) -> None:
        events.append(event)
        if event.reason == "out_of_blocks" and "victim" in m:
            m.free("victim")

    m.set_pressure_callback(on_pressure)
    m.allocate("victim", tokens(5))
    assert [e.reason for e in events] == ["high_watermark"]
    m.allocate("b", tokens(8, 100))  # needs 2, 2 free
    a = m.allocate("c", tokens(8, 200))  # needs 2, 0 free: callback frees victim
    assert len(a.block_table.blocks) == 2
    assert [e.reason for e in events] == ["high_watermark", "out_of_blocks"]
    assert events[1].needed_blocks == 2 and events[1].free_blocks == 0
    m.check()


def test_a_failing_pressure_callback_is_counted_not_raised() -> None:
    m = KVCacheManager(2, 4, high_watermark=0.5)

    def broken(event: PressureEvent) -> None:
        raise RuntimeError("boom")

    m.set_pressure_callback(broken)
    m.allocate("a", tokens(4))
    with pytest.raises(OutOfBlocksError):
        m.allocate("b", tokens(9, 50))
    assert m.stats().callback_errors == 2
    m.check()


def test_extra_keys_and_namespaces_isolate_caches() -> None:
    m = KVCacheManager(16, 4)
    m.allocate("a", tokens(9), extra_keys=("lora-1",))
    assert m.allocate("b", tokens(9)).num_cached_tokens == 0
    assert m.allocate("c", tokens(9), extra_keys=("lora-1",)).num_cached_tokens == 8
    # Extended blocks keep the request's extra keys.
    m.extend("a", tokens(3, 40))
    m.free("a")
    assert m.allocate("d", [*tokens(9), *tokens(3, 40), 1]).num_cached_tokens == 8
    m2 = KVCacheManager(16, 4, namespace=Namespace("other"))
    assert m2.hasher.chain(tokens(4)) != m.hasher.chain(tokens(4))


def test_precomputed_block_keys_match_internal_hashing() -> None:
    m = KVCacheManager(16, 4)
    toks = tokens(9)
    m.allocate("a", toks, block_keys=m.hasher.chain(toks))
    assert m.allocate("b", toks).num_cached_tokens == 8


def test_gc_and_reset() -> None:
    m = KVCacheManager(8, 4)
    m.allocate("a", tokens(16))
    m.free("a")
    assert m.stats().cached_blocks == 4
    assert m.gc(1) == 1
    assert m.reset_prefix_cache() == 3
    assert m.stats().cached_blocks == 0 and m.stats().empty_blocks == 8
    m.check()


def test_introspection() -> None:
    m = KVCacheManager(8, 4)
    m.allocate("a", tokens(5))
    assert "a" in m and len(m) == 1 and list(m.request_ids()) == ["a"]
    assert m.num_tokens("a") == 5
    table = m.block_table("a")
    table.blocks.append(99)
    assert m.block_table("a").blocks != table.blocks, "callers get copies"


def test_extend_with_precomputed_keys_matches_internal_hashing() -> None:
    m = KVCacheManager(16, 4)
    prompt, gen = tokens(6), tokens(7, 50)
    m.allocate("a", prompt)
    all_keys = m.hasher.chain(prompt + gen)
    m.extend("a", gen, block_keys=all_keys[1:])
    m.free("a")
    b = m.allocate("b", [*prompt, *gen, 1])
    assert b.num_cached_tokens == 12
    with pytest.raises(BadRequestError, match="fill 1 blocks"):
        m.extend("b", tokens(3), block_keys=[])
    with pytest.raises(BadRequestError, match="empty"):
        m.extend("b", [], block_keys=[])
    with pytest.raises(BadRequestError, match="negative"):
        m.extend("b", [-1], block_keys=[])
    m.check()


def test_abort_withdraws_blocks_past_the_computed_tokens() -> None:
    m = KVCacheManager(8, 2)
    m.allocate("a", [1, 2, 3, 4, 5, 6, 7])  # publishes three full blocks
    assert m.abort("a", 3) == 2  # the block of tokens 0-1 was computed; 2-3 and 4-5 were not
    m.check()
    alloc = m.allocate("b", [1, 2, 3, 4, 5, 6, 7])
    assert alloc.num_cached_tokens == 2
    m.free("b")
    assert m.pool.num_used == 0


def test_abort_keeps_hits_and_other_requests_copies() -> None:
    m = KVCacheManager(8, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.free("a")
    alloc = m.allocate("b", [1, 2, 3, 4, 9, 9, 1])
    assert alloc.num_cached_tokens == 4
    assert m.abort("b", alloc.num_cached_tokens) == 1  # only its own block [9, 9]
    assert m.allocate("c", [1, 2, 3, 4, 9, 9, 1]).num_cached_tokens == 4
    m.check()


def test_abort_rejects_bad_counts_and_changes_nothing() -> None:
    m = KVCacheManager(4, 2)
    m.allocate("a", [1, 2, 3])
    before = snapshot(m)
    for bad in (-1, 4):
        with pytest.raises(BadRequestError):
            m.abort("a", bad)
    assert snapshot(m) == before
    with pytest.raises(UnknownRequestError):
        m.abort("nope", 0)


def test_withdraw_refuses_when_a_held_descendant_would_be_stranded() -> None:
    m = KVCacheManager(8, 2)
    m.allocate("a", [1, 2, 3, 4])
    m.allocate("b", [1, 2, 3, 4, 5, 6, 7])  # b hangs its own block under a's
    before = snapshot(m)
    block = m.block_table("a").blocks[0]
    with pytest.raises(InternalInvariantError, match="held by a request"):
        m.pool.withdraw([block])
    assert snapshot(m) == before
