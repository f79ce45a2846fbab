"""Hypothesis state machine over the manager, with a simulated engine.

The machine writes each request's tokens into a simulated KV memory at the
slots the manager hands out (as an engine would), applies copy-on-write
copies, and after every step reads every live request's tokens back through
its block table. A prefix hit that served the wrong block, a held block that
was evicted and reused, or a copy that was not reported all show up as wrong
contents. After every step the full invariant check runs too: no block both
free and referenced, ref counts equal to the number of holders, capacity,
the policy agreeing with the pool, no orphaned child in a prefix chain.

Every example first draws its own pool (1 to 10 blocks of 1 to 4 tokens),
so small pools that evict on every call and larger ones that mostly hit are
both covered.
"""

from __future__ import annotations

from typing import Any

from helpers import InsertionOrderPolicy, snapshot
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvtier import KVCacheManager, OutOfBlocksError

# A tiny alphabet makes shared prefixes (and so hits, duplicates, cascades) common.
token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class ManagerMachine(RuleBasedStateMachine):
    requests = Bundle("requests")
    policy_factory: Any = staticmethod(lambda: "lru")

    def __init__(self) -> None:
        super().__init__()
        self.memory: dict[int, int] = {}
        self.expected: dict[int, list[int]] = {}
        self.next_id = 0
        #: (request, start, end) of the latest allocate/extend: the forward
        #: pass an engine would run next, which ``abort`` makes fail.
        self.last_pass: tuple[int, int, int] | None = None

    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 4]))
    def configure(self, num_blocks: int, block_size: int) -> None:
        self.m = KVCacheManager(num_blocks, block_size, policy=self.policy_factory())

    def _manager(self) -> KVCacheManager:
        return self.m

    def _write(self, rid: int, start: int) -> None:
        m = self._manager()
        table = m.block_table(rid)
        toks = self.expected[rid]
        for pos in range(start, len(toks)):
            self.memory[table.slot(pos)] = toks[pos]

    def _rejected(self, before: dict[str, Any]) -> None:
        after = snapshot(self._manager())
        b_stats, a_stats = before.pop("stats"), after.pop("stats")
        assert after == before, "a failed call must leave the state unchanged"
        assert a_stats.allocation_failures == b_stats.allocation_failures + 1

    @rule(target=requests, toks=token_lists, precomputed=st.booleans())
    def allocate(self, toks: list[int], precomputed: bool) -> int:
        m = self._manager()
        rid = self.next_id
        self.next_id += 1
        before = snapshot(m)
        keys = m.hasher.chain(toks) if precomputed else None
        try:
            alloc = m.allocate(rid, toks, block_keys=keys)
        except OutOfBlocksError:
            self._rejected(before)
            return -1
        assert 0 <= alloc.num_cached_tokens < len(toks)
        assert alloc.num_cached_tokens % m.block_size == 0
        # A hit must serve exactly the tokens asked for.
        for pos in range(alloc.num_cached_tokens):
            assert self.memory.get(alloc.block_table.slot(pos)) == toks[pos]
        self.expected[rid] = list(toks)
        self._write(rid, alloc.num_cached_tokens)
        self.last_pass = (rid, alloc.num_cached_tokens, len(toks))
        return rid

    @rule(rid=requests, toks=token_lists, precomputed=st.booleans())
    def extend(self, rid: int, toks: list[int], precomputed: bool) -> None:
        if rid not in self.expected:
            return
        m = self._manager()
        before = snapshot(m)
        start = m.num_tokens(rid)
        keys = None
        if precomputed:
            full = self.expected[rid] + toks
            keys = m.hasher.chain(full)[start // m.block_size :]
        try:
            ext = m.extend(rid, toks, block_keys=keys)
        except OutOfBlocksError:
            self._rejected(before)
            return
        bs = m.block_size
        for src, dst in ext.copies:
            for off in range(bs):
                if src * bs + off in self.memory:
                    self.memory[dst * bs + off] = self.memory[src * bs + off]
        self.expected[rid].extend(toks)
        self._write(rid, start)
        self.last_pass = (rid, start, len(self.expected[rid]))

    @rule(target=requests, rid=requests)
    def fork(self, rid: int) -> int:
        if rid not in self.expected:
            return -1
        new = self.next_id
        self.next_id += 1
        self._manager().fork(rid, new)
        self.expected[new] = list(self.expected[rid])
        self.last_pass = None
        return new

    @rule(data=st.data())
    def abort_failed_pass(self, data: st.DataObject) -> None:
        """The latest pass failed after writing its first tokens: garbage past them."""
        if self.last_pass is None:
            return
        rid, start, end = self.last_pass
        self.last_pass = None
        if rid not in self.expected:
            return
        m = self._manager()
        computed = data.draw(st.integers(start, end), label="computed")
        table = m.block_table(rid)
        for pos in range(computed, end):
            self.memory[table.slot(pos)] = -1
        m.abort(rid, computed)
        del self.expected[rid]

    @rule(rid=consumes(requests))
    def free(self, rid: int) -> None:
        if rid in self.expected:
            self._manager().free(rid)
            del self.expected[rid]
            if self.last_pass is not None and self.last_pass[0] == rid:
                self.last_pass = None

    @rule(n=st.integers(0, 4))
    def gc(self, n: int) -> None:
        self._manager().gc(n)

    @rule()
    def free_everything(self) -> None:
        m = self._manager()
        for rid in list(self.expected):
            m.free(rid)
        self.expected.clear()
        assert m.pool.num_used == 0, "freeing every request leaks no block"
        assert m.pool.num_free == m.pool.num_blocks

    @invariant()
    def contents_and_bookkeeping(self) -> None:
        m = self.m
        m.check()
        pool = m.pool
        assert pool.num_used + pool.num_free == pool.num_blocks
        assert pool.num_cached <= pool.num_blocks
        for rid, toks in self.expected.items():
            table = m.block_table(rid)
            assert table.num_tokens == len(toks)
            got = [self.memory.get(table.slot(p)) for p in range(len(toks))]
            assert got == toks, f"request {rid} reads back wrong KV"

    def teardown(self) -> None:
        if hasattr(self, "m"):  # absent only if drawing the configuration failed
            self.free_everything()
            self.m.check()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


class CascadingManagerMachine(ManagerMachine):
    """The same machine under a policy that evicts parents before children."""

    policy_factory = staticmethod(InsertionOrderPolicy)


TestCascadingManagerMachine = CascadingManagerMachine.TestCase
TestCascadingManagerMachine.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
