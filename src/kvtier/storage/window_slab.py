"""Which blocks still keep their sliding-window layers' K/V, and in which slot.

A model with sliding-window layers (Gemma 3, Mistral) needs those layers'
K/V only for the last ``window`` positions before each query. A block of a
long sequence still needs its *full* layers' K/V for as long as it is
cached, but its sliding layers' K/V only while some query can still see
it, or while it may be where a later request resumes (the last window of a
cached prefix). So the sliding layers' share of blocks lives apart, in a
smaller set of *slots*; :class:`WindowSlab` is the bookkeeping of those
slots, with no tensors (:class:`~kvtier.storage.windowed.WindowedKVStorage`
holds them).

- Each block has at most one slot (``slot_of``); a block without one has
  lost its sliding K/V (a *tombstone*, in SGLang's words): it can still be
  part of a cached prefix, but not within the last window before the point
  where a request resumes.
- Each step, the scheduler says which blocks running sequences still see
  or write (:meth:`WindowSlab.hold`); held slots are never reclaimed.
  Every other slot is *idle* and reclaimed least recently used first when
  a block needs one.
- Not every idle slot is worth the same (Marconi's observation for hybrid
  models): the window a request ends on is where its next turn resumes,
  and a window a request resumed from is a branch point of the prefix
  tree; a window a request merely slid past is rarely resumed from.
  :meth:`WindowSlab.mark_valuable` flags the first kind; a released slot
  without the flag goes to the reclaim-first end of the idle order, one
  with it to the keep-longest end.
- :meth:`WindowSlab.resumable` says how much of a cached prefix a request
  can resume from: the longest run of leading blocks whose last window
  still has its slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError, InternalInvariantError, KvTierError


class WindowDroppedError(KvTierError):
    """A block's sliding-window K/V was reclaimed, so its payload cannot be exported whole."""


@dataclass(frozen=True, slots=True)
class WindowSlabStats:
    """A snapshot of the slots: how many exist, hold a block, and are held by running requests."""

    num_slots: int
    used: int
    held: int
    #: Blocks that lost their slot to another block since the slab was built.
    reclaimed: int


def window_blocks(position: int, window: int, block_size: int) -> int:
    """The first block a query at ``position`` reads in a layer of ``window`` positions."""
    return max(0, position - window + 1) // block_size


def first_read_block(position: int, block_size: int, window: int, chunk: int = 0) -> int:
    """The first block a query at ``position`` reads: from its window's start, or, in a
    chunked local layer (``chunk`` > 0, Llama 4), from the start of its own chunk."""
    if chunk:
        return position // chunk * chunk // block_size
    return window_blocks(position, window, block_size)


class WindowSlab:
    """Slots for the sliding layers' share of ``num_blocks`` blocks (see the module docstring)."""

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("num_slots", num_slots)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"WindowSlab {name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        #: Per block: its slot, or -1.
        self.slot_of: list[int] = [-1] * num_blocks
        self._block_of: list[int] = [-1] * num_slots
        # Popped from the end: slot 0 is handed out first.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        #: Slots with a block that nothing holds, least recently used first.
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._held: set[int] = set()
        #: Slots whose window a request ended on or resumed from (cleared when reassigned).
        self._valuable: set[int] = set()
        self._reclaimed = 0

    # -- queries ----------------------------------------------------------------------
    def has(self, block: int) -> bool:
        """Whether ``block`` still keeps its sliding K/V."""
        return self.slot_of[block] >= 0

    def slots(self, blocks: Iterable[int]) -> list[int]:
        """The slots of ``blocks``; :class:`WindowDroppedError` if one has none."""
        slot_of = self.slot_of
        out = [slot_of[b] for b in blocks]
        if -1 in out:
            raise WindowDroppedError(
                "a block's sliding-window K/V was reclaimed; export only blocks that keep it "
                "(WindowedKVStorage.exportable)"
            )
        return out

    def resumable(
        self, blocks: Sequence[int], window: int, block_size: int, chunk: int = 0
    ) -> int:
        """The most leading ``blocks`` a request may resume after.

        Resuming after ``k`` blocks means a query at position ``k * block_size``:
        its sliding layers read the blocks from :func:`first_read_block` to
        ``k - 1``, and each of those must keep its slot.
        """
        slot_of = self.slot_of
        # run[k]: how many blocks right before block k keep their slots.
        run = 0
        runs = [0]
        for b in blocks:
            run = run + 1 if slot_of[b] >= 0 else 0
            runs.append(run)
        for k in range(len(blocks), 0, -1):
            if runs[k] >= k - first_read_block(k * block_size, block_size, window, chunk):
                return k
        return 0

    def stats(self) -> WindowSlabStats:
        used = self.num_slots - len(self._free)
        return WindowSlabStats(self.num_slots, used, len(self._held), self._reclaimed)

    @property
    def held(self) -> int:
        """Slots held by running requests now."""
        return len(self._held)

    # -- changes ----------------------------------------------------------------------
    def hold(self, blocks: Iterable[int]) -> None:
        """Hold exactly the slots of ``blocks`` (those that have one), releasing the rest.

        A released slot stays with its block until another block needs it: a
        valuable one (:meth:`mark_valuable`) as the most recently used idle
        slot, any other as the first to be reclaimed.
        """
        slot_of = self.slot_of
        new = {s for s in (slot_of[b] for b in blocks) if s >= 0}
        idle = self._idle
        valuable = self._valuable
        for s in self._held - new:
            idle[s] = None
            if s not in valuable:
                idle.move_to_end(s, last=False)
        for s in new:
            idle.pop(s, None)
        self._held = new

    def pin(self, blocks: Iterable[int]) -> None:
        """Hold the slots of ``blocks`` (those that have one) as well, until the next
        :meth:`hold`: a prefix a request was just admitted on, before its first step."""
        slot_of = self.slot_of
        for s in (slot_of[b] for b in blocks):
            if s >= 0 and s not in self._held:
                self._idle.pop(s, None)
                self._held.add(s)

    def mark_valuable(self, blocks: Iterable[int]) -> None:
        """Flag the slots of ``blocks`` (those that have one) as likely resume points."""
        slot_of = self.slot_of
        self._valuable.update(s for s in (slot_of[b] for b in blocks) if s >= 0)

    def forget(self, blocks: Iterable[int]) -> None:
        """``blocks`` left the prefix cache: their idle slots go first in line to be reclaimed.

        The slots keep their data until then, so a block still being demoted to a
        tier, or handed straight to a request that writes it again, loses nothing.
        """
        slot_of = self.slot_of
        idle = self._idle
        for b in blocks:
            s = slot_of[b]
            if s >= 0 and s not in self._held:
                self._valuable.discard(s)
                idle.move_to_end(s, last=False)

    def is_valuable(self, block: int) -> bool:
        s = self.slot_of[block]
        return s >= 0 and s in self._valuable

    def assign(self, block: int, *, held: bool) -> int | None:
        """A slot for ``block`` (its own, when it has one); ``None`` when every slot is held.

        A slot taken from another block leaves that block without one. ``held``
        adds the slot to the held set (until the next :meth:`hold`).
        """
        s = self.slot_of[block]
        if s < 0:
            if self._free:
                s = self._free.pop()
            elif self._idle:
                s, _ = self._idle.popitem(last=False)
                old = self._block_of[s]
                if old < 0 or self.slot_of[old] != s:
                    raise InternalInvariantError(f"idle window slot {s} has no block")
                self.slot_of[old] = -1
                self._valuable.discard(s)
                self._reclaimed += 1
            else:
                return None
            self.slot_of[block] = s
            self._block_of[s] = block
            if not held:
                self._idle[s] = None
        elif not held and s not in self._held:
            self._idle.move_to_end(s)
        if held and s not in self._held:
            self._idle.pop(s, None)
            self._held.add(s)
        return s

    def drop(self, block: int) -> None:
        """``block`` keeps no sliding K/V any more (its slot goes back to the free list)."""
        s = self.slot_of[block]
        if s < 0:
            return
        self.slot_of[block] = -1
        self._block_of[s] = -1
        self._idle.pop(s, None)
        self._held.discard(s)
        self._valuable.discard(s)
        self._free.append(s)

    def check(self) -> None:
        """Raise :class:`InternalInvariantError` if the bookkeeping disagrees with itself."""
        free = set(self._free)
        idle = set(self._idle)
        if len(free) != len(self._free):
            raise InternalInvariantError("a window slot is free twice")
        if free & (idle | self._held) or idle & self._held:
            raise InternalInvariantError("a window slot is in two states")
        if len(free) + len(idle) + len(self._held) != self.num_slots:
            raise InternalInvariantError("a window slot is in no state")
        for s in range(self.num_slots):
            b = self._block_of[s]
            if (b >= 0) == (s in free) or (b >= 0 and self.slot_of[b] != s):
                raise InternalInvariantError(f"window slot {s} and block {b} disagree")
        if self._valuable & free:
            raise InternalInvariantError("a free window slot is marked valuable")
        if sum(1 for s in self.slot_of if s >= 0) != self.num_slots - len(free):
            raise InternalInvariantError("a block names a slot it does not own")
