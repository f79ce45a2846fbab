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
from collections.abc import Iterable

#: ``(-depth, key)``: a pinned key and its place in its chain, as pushed.
Pair = tuple[int, int]
#: Above any sequence number :class:`LatestPins` gives an entry.
AFTER = 1 << 62


def successive(items: list[Pair]) -> tuple[list[Pair], list[Pair]]:
    """``items`` without its last and without its first: the pairs of neighbours."""
    return items[:-1], items[1:]


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

    def pop_due(self, now: float) -> tuple[float, list[Pair]] | None:
        """The soonest end if it is no later than ``now``, with every key pushed for it.

        The keys come in no particular order, duplicates included (a key
        pushed twice for one end is stale the second time); the list is the
        caller's.
        """
        heap = self._heap
        if not heap or heap[0][0] > now:
            return None
        until, _, pairs = heapq.heappop(heap)
        if heap and heap[0][0] == until:
            pairs = list(pairs)
            while heap and heap[0][0] == until:
                pairs.extend(heapq.heappop(heap)[2])
        return until, pairs

    def due(self, now: float) -> tuple[float, list[Pair]] | None:
        """:meth:`pop_due` with the keys in ``(-depth, key)`` order."""
        due = self.pop_due(now)
        if due is None:
            return None
        until, pairs = due
        return until, sorted(pairs)


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
