"""The workflow policy's TTL pin queues: when each pin ends, and which pin ends latest.

:class:`~kvtier.agents.policy.WorkflowPolicy` pins a request's blocks until
its session is due back (``cache_ttl_s``). Two orders over those pins decide
what it does:

* :class:`EndQueue`: pins to expire, soonest first, and among pins that end
  together the deepest block of a chain first, then the lowest key;
* :class:`LatestPins`: protected blocks, the pin that ends latest first (it
  yields when the pin cap is reached), then the deepest, then the lowest key.

A session's every turn re-pins its whole chain until one new time, so both
take a batch of keys that end together as one heap entry instead of one per
key. Entries are never updated in place: the policy checks each key it is
given against its own tables and skips keys whose pin moved since (stale).
The order in which valid keys come out is exactly that of a heap holding one
``(time, -depth, key)`` entry per pinned key.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvtier.agents.ranks import DEFAULT, ByReturn
from kvtier.agents.sessions import Session
from kvtier.agents.tags import Tag
from kvtier.policy.base import EvictionPolicy

#: ``(-depth, key)``: a pinned key and its place in its chain, as pushed.
Pair = tuple[int, int]


class EndQueue:
    """Pin ends, soonest first; the keys of one end in ``(-depth, key)`` order."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, list[Pair]]] = []
        self._seq = 0

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, until: float, pairs: list[Pair]) -> None:
        """Keys whose pin ends at ``until``; ``pairs`` is the queue's from now on."""
        self._seq += 1
        heapq.heappush(self._heap, (until, self._seq, pairs))

    def due(self, now: float) -> tuple[float, list[Pair]] | None:
        """The soonest end if it is no later than ``now``, with every key pushed for it.

        The keys come in ``(-depth, key)`` order, duplicates included (a key
        pushed twice for one end is stale the second time).
        """
        heap = self._heap
        if not heap or heap[0][0] > now:
            return None
        until, _, pairs = heapq.heappop(heap)
        if heap and heap[0][0] == until:
            pairs = list(pairs)
            while heap and heap[0][0] == until:
                pairs.extend(heapq.heappop(heap)[2])
            pairs.sort()
        elif len(pairs) > 1:
            pairs = sorted(pairs)
        return until, pairs


class LatestPins:
    """Protected keys, the pin that ends latest first, then the deepest, then the lowest key.

    The heap holds one entry per batch of keys pinned until the same time,
    ``(-until, -depth, key, seq, rest)`` for the batch's next key, ``rest``
    sorted so that the next key is last: a k-way merge of the batches, which
    pops keys in the order a heap of one entry per key would. ``size`` is
    the number of keys pushed and not yet popped, stale ones included: what
    that heap's length would be.
    """

    __slots__ = ("_heap", "_seq", "size")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int, list[Pair]]] = []
        self._seq = 0
        self.size = 0

    def push(self, until: float, neg_depth: int, key: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (-until, neg_depth, key, self._seq, [(neg_depth, key)]))
        self.size += 1

    def push_many(self, until: float, pairs: list[Pair]) -> None:
        """Keys protected until ``until``; ``pairs`` is the heap's from now on."""
        if not pairs:
            return
        pairs.sort(reverse=True)
        neg_depth, key = pairs[-1]
        self._seq += 1
        heapq.heappush(self._heap, (-until, neg_depth, key, self._seq, pairs))
        self.size += len(pairs)

    def top(self) -> tuple[float, int]:
        """``(until, key)`` of the first entry (valid or stale); the heap must not be empty."""
        entry = self._heap[0]
        return -entry[0], entry[2]

    def pop(self) -> None:
        """Drop the first entry."""
        heap = self._heap
        neg_until, _, _, seq, rest = heap[0]
        rest.pop()
        if rest:
            neg_depth, key = rest[-1]
            heapq.heapreplace(heap, (neg_until, neg_depth, key, seq, rest))
        else:
            heapq.heappop(heap)
        self.size -= 1

    def rebuild(self, entries: Iterable[tuple[float, int, int]]) -> None:
        """Hold exactly ``(until, -depth, key)`` of ``entries`` (the stale ones go)."""
        heap: list[tuple[float, int, int, int, list[Pair]]] = []
        seq = self._seq
        for until, neg_depth, key in entries:
            seq += 1
            heap.append((-until, neg_depth, key, seq, [(neg_depth, key)]))
        heapq.heapify(heap)
        self._seq = seq
        self._heap = heap
        self.size = len(heap)


class TtlPins:
    """The workflow policy's TTL pins: set, capped, released and expired.

    ``cache_ttl_s`` pins a request's blocks until the owner's clock reaches
    the pin's end (expiry is by time). Pinned blocks are evicted last, but
    never more than ``pin_fraction`` of the capacity is protected: past the
    cap the pins that end latest yield and their keys wait, ranked by when
    they are due. A pin that runs out keeps ranking its key by its end for as
    long again (the key is overdue), then lets it go.
    """

    _tags: OrderedDict[int, Tag]
    _global: EvictionPolicy
    _classes: dict[int, EvictionPolicy]
    _class_of: dict[int, int]
    _size_table: dict[int, int] | None
    #: TTL pins: key -> when its pin ends.
    _expiry: dict[int, float]
    #: Keys whose pin ran out and that still wait, ranked by their end, until the
    #: deadline given (see :meth:`pin_for`); and each pin's deadline.
    _overdue: dict[int, float]
    _late: dict[int, float]
    _ends: EndQueue
    #: Keys protected now: key -> (end, size).
    _protected: dict[int, tuple[float, int]]
    #: Protected keys, latest end first; entries whose end no longer matches
    #: the key's protection are stale and skipped.
    _latest: LatestPins
    _protected_used: int
    #: Ended sessions' own keys, for the tiers to free (when ``collect_released``).
    _released: list[int]
    collect_released: bool
    _now: float
    pin_fraction: float
    capacity: int
    clock: Callable[[], float] | None

    if TYPE_CHECKING:

        def _move(self, key: int) -> None: ...

        def _shift(self, key: int, old: int, new: int) -> None: ...

        def _rank(self, key: int) -> int: ...

        def _size(self, key: int) -> int: ...

        def _depth(self, key: int) -> int: ...

    @property
    def pin_cap(self) -> int:
        """Size units TTL pins may protect at most."""
        return int(self.pin_fraction * self.capacity)

    @property
    def protected_used(self) -> int:
        """Size units TTL pins protect now."""
        return self._protected_used

    def pin_for(self, keys: Iterable[int], until: float, replacing: float | None = None) -> None:
        """Protect ``keys`` until ``until`` (the owner's clock); past the cap, latest pins go.

        A pin only ever lengthens, except that ``replacing`` names an earlier
        pin of the same owner that this one supersedes: keys pinned until
        exactly then, and used by no one else, take the new end even if it is
        sooner (a session back early, due again soon).
        """
        tags = self._tags
        expiry = self._expiry
        resident = self._global
        classes = self._classes
        class_of = self._class_of
        overdue = self._overdue
        # Past its end a pin still ranks its key by when it was due, for as long
        # again: a session seldom comes back exactly on time, and one that is late
        # is due any moment (one that never comes back is dropped after that).
        late = until + max(until - self._now, 0.0)
        late_of = self._late
        protected = self._protected
        ahead = until > self._now
        table = self._size_table
        pin_state = self._pin_state
        rank_of = self._rank
        shift = self._shift
        ends: list[Pair] = []
        # Protected keys whose pin only moves, pushed as one batch before anything
        # else reads the order of protections.
        moved: list[Pair] = []
        for key in keys:
            old = expiry.get(key, -1.0)
            if old >= until and (old != replacing or old == until):
                continue
            tag = tags.get(key)
            if old > until and (tag is None or tag.shared):
                continue
            expiry[key] = until
            if key in overdue:
                del overdue[key]
            late_of[key] = late
            neg_depth = 0 if tag is None else -tag.depth
            ends.append((neg_depth, key))
            if key in resident:
                if ahead and key in protected:
                    # _pin_state for a key protected already, inline (a session's
                    # every turn re-pins its whole chain): the pin only moves.
                    size = self._size(key) if table is None else table.get(key, 1) if table else 1
                    protected[key] = (until, size)
                    moved.append((neg_depth, key))
                else:
                    if moved:
                        self._latest.push_many(until, moved)
                        moved = []
                    # _protect, inline.
                    if pin_state(key, until):
                        was = class_of.get(key, DEFAULT)
                        rank = rank_of(key)
                        if rank != was:
                            shift(key, was, rank)
                c = classes.get(class_of.get(key, DEFAULT))
                if isinstance(c, ByReturn):
                    c.access(key)  # its pin ends at another time now: re-sort it
        if moved:
            self._latest.push_many(until, moved)
        if ends:
            self._ends.push(until, ends)

    def _protect(self, key: int, until: float) -> None:
        if self._pin_state(key, until):
            self._move(key)

    def _pin_state(self, key: int, until: float) -> bool:
        """Protect a resident ``key`` until ``until`` if the cap allows (latest pins yield).

        Every other key whose protection changes is moved to its class here;
        ``key`` itself is not: returns whether its class may have changed.
        """
        if until <= self._now:
            return False
        protected = self._protected
        table = self._size_table
        size = self._size(key) if table is None else table.get(key, 1) if table else 1
        latest = self._latest
        tag = self._tags.get(key)
        neg_depth = 0 if tag is None else -tag.depth
        if key in protected:
            protected[key] = (until, size)
            latest.push(until, neg_depth, key)
            return False
        cap = int(self.pin_fraction * self.capacity)  # pin_cap
        if size > cap:
            return True
        class_of = self._class_of
        rank_of = self._rank
        while self._protected_used + size > cap:
            # The pin that ends latest yields: a TTL is when the session is due back,
            # and MIN keeps what is needed soonest.
            end, victim = latest.top()
            entry = protected.get(victim)
            if entry is None or entry[0] != end:
                latest.pop()  # stale
                continue
            if end < until:
                # Every current pin ends sooner than this one: it waits past the cap.
                return True
            latest.pop()
            # _unprotect, inline (the victim is protected, so resident).
            del protected[victim]
            self._protected_used -= entry[1]
            was = class_of.get(victim, DEFAULT)
            rank = rank_of(victim)
            if rank != was:
                self._shift(victim, was, rank)
        protected[key] = (until, size)
        latest.push(until, neg_depth, key)
        self._protected_used += size
        if latest.size > 4 * len(protected) + 64:
            depth = self._depth
            latest.rebuild((u, -depth(k), k) for k, (u, _) in protected.items())
        return True

    def _unprotect(self, key: int) -> None:
        entry = self._protected.pop(key, None)
        if entry is None:
            return
        self._protected_used -= entry[1]
        if key in self._global:
            self._move(key)

    def expire(self, now: float) -> int:
        """Drop the TTL pins that ran out by ``now``; returns how many keys lost theirs."""
        if now > self._now:
            self._now = now
        now = self._now
        ends = self._ends
        n = 0
        expiry = self._expiry
        overdue = self._overdue
        late_of = self._late
        protected = self._protected
        resident = self._global
        while True:
            due = ends.due(now)
            if due is None:
                break
            until, pairs = due
            for _, key in pairs:
                if overdue.get(key) == until:
                    # Late for as long as it was pinned: not coming back.
                    del overdue[key]
                    del expiry[key]
                    if key in resident:
                        self._move(key)
                    continue
                if expiry.get(key) != until or key in overdue:
                    continue  # stale
                late = late_of.pop(key, until)
                if late > until:
                    overdue[key] = late
                    ends.push(late, [(-self._depth(key), key)])
                else:
                    del expiry[key]
                if key in protected:
                    self._unprotect(key)
                    n += 1
                elif key in resident:
                    self._move(key)
        return n

    def _tick(self) -> None:
        if self.clock is not None and self._ends:
            self.expire(self.clock())

    def _release(self, keys: Sequence[int], until: float) -> None:
        """End the pins a session set until ``until`` on its own ``keys`` (chain order)."""
        expiry = self._expiry
        tags = self._tags
        resident = self._global
        for key in reversed(keys):
            if expiry.get(key) != until:
                continue  # pinned later by someone else
            tag = tags.get(key)
            if tag is not None and tag.shared:
                continue
            del expiry[key]
            self._overdue.pop(key, None)
            self._late.pop(key, None)
            if key in self._protected:
                self._unprotect(key)
            elif key in resident:
                self._move(key)

    def _end(self, rec: Session) -> None:
        """Release an ended session's pins; its own blocks are never reused."""
        tags = self._tags
        resident = self._global
        for key in reversed(rec.keys):
            self._overdue.pop(key, None)
            self._late.pop(key, None)
            if self._expiry.pop(key, None) is not None and key in self._protected:
                self._unprotect(key)
            tag = tags.get(key)
            if tag is not None and not tag.shared:
                tag.reuse = "never"
                if self.collect_released:
                    self._released.append(key)
            if key in resident:
                self._move(key)
