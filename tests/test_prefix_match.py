"""``KVCacheManager.match`` and ``allocate(match=...)``: one hash per request, the same bookkeeping.

A hypothesis state machine drives two managers side by side with the same
requests: one allocates from tokens (hashing them itself), the other matches
first and allocates from the match, sometimes long after, over a prefix of
the matched tokens, or after a ``rematch``. Every step the two must be in
exactly the same state, and a fresh match must report the device hit the
allocation then finds. The tier half of a match is checked against a real
tier chain over host memory.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import snapshot
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier import BadRequestError, KVCacheManager, OutOfBlocksError, PrefixMatch
from kvtier.keys import BlockHasher

token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=14)
extras = st.sampled_from([(), ("lora-a",), ("salt", 7)])


class MatchTwins(RuleBasedStateMachine):
    requests = Bundle("requests")
    matches = Bundle("matches")

    @initialize(num_blocks=st.integers(2, 10), block_size=st.integers(1, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.plain = KVCacheManager(num_blocks, block_size)
        self.matched = KVCacheManager(num_blocks, block_size)
        self.bs = block_size
        self.next_id = 0

    @rule(target=matches, tokens=token_lists, extra=extras)
    def match(self, tokens: list[int], extra: tuple[Any, ...]) -> tuple[list[int], Any, Any]:
        m = self.matched.match(tokens, extra_keys=extra)
        assert len(m.keys) == len(tokens) // self.bs
        assert m.keys == tuple(self.matched.hasher.chain(tokens, extra=extra))
        assert m.tier_blocks == 0 and m.hit_blocks == m.device_blocks
        return tokens, extra, m

    @rule(target=requests, entry=consumes(matches), cut=st.integers(0, 14), refresh=st.booleans())
    def allocate(
        self, entry: tuple[list[int], Any, PrefixMatch], cut: int, refresh: bool
    ) -> str:
        tokens, extra, m = entry
        if refresh:
            m = self.matched.rematch(m)
        given = tokens[: max(1, len(tokens) - cut)]
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            want = self.plain.allocate(rid, given, extra_keys=extra, request_keys=None)
        except OutOfBlocksError:
            with pytest.raises(OutOfBlocksError):
                self.matched.allocate(rid, given, match=m)
            return rid
        got = self.matched.allocate(rid, given, match=m)
        assert got.num_cached_tokens == want.num_cached_tokens
        assert got.block_table.blocks == want.block_table.blocks
        assert got.new_blocks == want.new_blocks
        return rid

    @rule(rid=consumes(requests))
    def free(self, rid: str) -> None:
        if rid in self.plain:
            self.plain.free(rid)
            self.matched.free(rid)

    @precondition(lambda self: len(self.plain) > 0)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(map(str, self.plain.request_ids()))))
        new = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=5))
        try:
            want = self.plain.extend(rid, new)
        except OutOfBlocksError:
            with pytest.raises(OutOfBlocksError):
                self.matched.extend(rid, new)
            return
        got = self.matched.extend(rid, new)
        assert got.block_table.blocks == want.block_table.blocks and got.copies == want.copies

    @rule(tokens=token_lists, extra=extras)
    def fresh_match_reports_the_hit_allocate_finds(
        self, tokens: list[int], extra: tuple[Any, ...]
    ) -> None:
        m = self.matched.match(tokens, extra_keys=extra)
        rid = "probe"
        try:
            alloc = self.matched.allocate(rid, tokens, match=m)
        except OutOfBlocksError:
            with pytest.raises(OutOfBlocksError):
                self.plain.allocate(rid, tokens, extra_keys=extra)
            return
        assert alloc.num_cached_tokens == m.device_blocks * self.bs
        self.matched.abort(rid, alloc.num_cached_tokens)
        # The twin sees the same probe, so the two stay alike.
        twin = self.plain.allocate(rid, tokens, extra_keys=extra)
        self.plain.abort(rid, twin.num_cached_tokens)

    @invariant()
    def twins_agree(self) -> None:
        if not hasattr(self, "plain"):
            return
        a, b = snapshot(self.plain), snapshot(self.matched)
        assert a == b
        self.matched.check()


TestMatchTwins = MatchTwins.TestCase
TestMatchTwins.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_rematch_refreshes_hits_without_hashing() -> None:
    m = KVCacheManager(8, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    first = m.match(tokens)
    assert first.device_blocks == 0
    m.allocate("a", tokens, match=first)
    m.free("a")

    class NoHashing(BlockHasher):
        __slots__ = ()

        def chain(self, *args: object, **kwargs: object) -> list[int]:  # type: ignore[override]
            raise AssertionError("rematch hashed the tokens again")

    m.hasher.__class__ = NoHashing
    again = m.rematch(first)
    assert again.keys == first.keys and again.device_blocks == 3  # never the last token's block


def test_match_refuses_bad_input_and_allocate_a_longer_request() -> None:
    m = KVCacheManager(8, 2)
    with pytest.raises(BadRequestError, match="empty"):
        m.match([])
    with pytest.raises(BadRequestError, match="negative"):
        m.match([1, -2, 3])
    with pytest.raises(BadRequestError, match="hints"):
        m.match([1, 2], hints={"no_such_hint": 1})
    match = m.match([1, 2, 3])
    with pytest.raises(BadRequestError, match="match of 3"):
        m.allocate("a", [1, 2, 3, 4], match=match)
    assert len(m) == 0 and m.stats().allocations == 0


def test_match_plans_tier_loads_past_the_device_hit() -> None:
    torch = pytest.importorskip("torch")
    from kvtier.layout import KVLayout
    from kvtier.offload.chain import Tier, TierChain
    from kvtier.offload.host import HostStore
    from kvtier.storage import KVBlockStorage

    bs = 4
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=bs, dtype="float32")
    storage, mgr = KVBlockStorage(layout, 8), KVCacheManager(8, bs)
    chain = TierChain(storage, mgr, [Tier(HostStore(), 16)])
    a = list(range(1000, 1000 + 4 * bs + 1))
    for rid, tokens in (("a", a), ("b", list(range(2000, 2017))), ("c", list(range(3000, 3017)))):
        alloc = mgr.allocate(rid, tokens)
        storage.import_blocks(
            alloc.block_table.blocks,
            torch.randn((len(alloc.block_table.blocks), *storage.block_shape)),
        )
        mgr.free(rid)  # b and c push a's blocks down to host memory
    m = mgr.match(a, tiers=chain)
    assert m.device_blocks == 0 and m.tier_blocks == 4 and m.tier_plan == (0, 0, 0, 0)
    assert m.hit_blocks == 4
    assert mgr.match(a).tier_blocks == 0  # without tiers, only the device is asked
    chain.close()
