"""The window slots' bookkeeping, against a plain model of it, in any order of operations.

:class:`~kvtier.storage.window_slab.WindowSlab` decides which blocks keep
their sliding layers' K/V. A hypothesis state machine drives it with holds,
assignments and drops and checks, after every step, that it agrees with a
model made of a dict and a list: which block owns which slot, that held
slots are never taken, that the least recently used idle slot is the one
reclaimed, which released slots go first in line to be reclaimed (those not marked as
likely resume points), and what :meth:`~WindowSlab.resumable` answers.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.errors import ConfigError
from kvtier.storage.window_slab import WindowDroppedError, WindowSlab, window_blocks

BLOCKS = 12
SLOTS = 5


class SlabMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.slab = WindowSlab(BLOCKS, SLOTS)
        #: block -> slot
        self.owner: dict[int, int] = {}
        self.held: set[int] = set()  # blocks
        #: idle blocks, least recently used first
        self.idle: list[int] = []
        #: blocks whose slot is a likely resume point
        self.valuable: set[int] = set()

    def _touch_idle(self, b: int) -> None:
        if b in self.idle:
            self.idle.remove(b)
        self.idle.append(b)

    @rule(blocks=st.lists(st.integers(0, BLOCKS - 1), max_size=6))
    def hold(self, blocks: list[int]) -> None:
        self.slab.hold(blocks)
        new = {b for b in blocks if b in self.owner}
        released = self.held - new
        kept = [b for b in self.idle if b not in new]
        order = [self.slab._block_of[s] for s in self.slab._idle]
        # Released slots that are not likely resume points go first in line to be
        # reclaimed; valuable ones last; idle ones keep their order between (the order
        # among slots released together is the slab's choice).
        cheap = {b for b in released if b not in self.valuable}
        assert set(order[: len(cheap)]) == cheap
        assert order[len(cheap) : len(cheap) + len(kept)] == kept
        assert set(order[len(cheap) + len(kept) :]) == released - cheap
        self.idle = order
        self.held = new

    @rule(blocks=st.lists(st.integers(0, BLOCKS - 1), max_size=4))
    def mark_valuable(self, blocks: list[int]) -> None:
        self.slab.mark_valuable(blocks)
        self.valuable.update(b for b in blocks if b in self.owner)

    @rule(block=st.integers(0, BLOCKS - 1), held=st.booleans())
    def assign(self, block: int, held: bool) -> None:
        before_free = SLOTS - len(self.owner)
        got = self.slab.assign(block, held=held)
        if block in self.owner:
            assert got == self.owner[block]
            if held:
                if block in self.idle:
                    self.idle.remove(block)
                self.held.add(block)
            elif block not in self.held:
                self._touch_idle(block)
            return
        if before_free == 0 and not self.idle:
            assert got is None  # every slot is held
            return
        assert got is not None
        if before_free == 0:
            victim = self.idle.pop(0)  # the least recently used idle slot
            assert self.owner.pop(victim) == got
            self.valuable.discard(victim)
            assert not self.slab.has(victim)
        else:
            assert got not in self.owner.values()
        self.owner[block] = got
        if held:
            self.held.add(block)
        else:
            self.idle.append(block)

    @rule(blocks=st.lists(st.integers(0, BLOCKS - 1), max_size=3))
    def pin(self, blocks: list[int]) -> None:
        self.slab.pin(blocks)
        for b in blocks:
            if b in self.owner and b not in self.held:
                self.idle.remove(b)
                self.held.add(b)

    @rule(blocks=st.lists(st.integers(0, BLOCKS - 1), max_size=3, unique=True))
    def forget(self, blocks: list[int]) -> None:
        self.slab.forget(blocks)
        for b in blocks:
            if b in self.idle:  # an evicted block's idle slot: first to be reclaimed
                self.idle.remove(b)
                self.idle.insert(0, b)
                self.valuable.discard(b)

    @rule(block=st.integers(0, BLOCKS - 1))
    def drop(self, block: int) -> None:
        self.slab.drop(block)
        self.owner.pop(block, None)
        self.valuable.discard(block)
        self.held.discard(block)
        if block in self.idle:
            self.idle.remove(block)

    @rule(
        blocks=st.lists(st.integers(0, BLOCKS - 1), max_size=8, unique=True),
        window=st.integers(1, 12),
        bs=st.integers(1, 4),
    )
    def resumable(self, blocks: list[int], window: int, bs: int) -> None:
        got = self.slab.resumable(blocks, window, bs)
        want = 0
        for k in range(len(blocks), 0, -1):
            first = max(0, k * bs - window + 1) // bs
            if all(b in self.owner for b in blocks[first:k]):
                want = k
                break
        assert got == want

    @invariant()
    def agrees(self) -> None:
        self.slab.check()
        for b in range(BLOCKS):
            assert self.slab.has(b) == (b in self.owner)
            if b in self.owner:
                assert self.slab.slot_of[b] == self.owner[b]
        for b in range(BLOCKS):
            assert self.slab.is_valuable(b) == (b in self.valuable)
        stats = self.slab.stats()
        assert stats.used == len(self.owner)
        assert stats.held == len(self.held)
        assert sorted(self.slab.slots(sorted(self.owner))) == sorted(self.owner.values())


TestSlab = SlabMachine.TestCase
TestSlab.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_slots_of_a_dropped_block_raise() -> None:
    slab = WindowSlab(4, 2)
    slab.assign(1, held=False)
    with pytest.raises(WindowDroppedError, match="reclaimed"):
        slab.slots([1, 2])


def test_bad_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="num_slots"):
        WindowSlab(4, 0)
    with pytest.raises(ConfigError, match="num_blocks"):
        WindowSlab(True, 2)  # type: ignore[arg-type]


def test_window_blocks_is_the_first_block_a_query_sees() -> None:
    # A query at 37 with a window of 8 sees 30..37: blocks of 4 from block 7 on.
    assert window_blocks(37, 8, 4) == 7
    assert window_blocks(5, 8, 4) == 0
    assert window_blocks(8, 8, 4) == 0  # sees 1..8
    assert window_blocks(12, 8, 4) == 1  # sees 5..12
