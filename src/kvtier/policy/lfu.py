"""Least-frequently-used eviction with aging.

Counts hits per key and evicts the lowest count, least recently used first
among equals. The bucket layout follows Shah, Mitra and Matani, "An O(1)
algorithm for implementing the LFU cache eviction scheme" (2010); the aging
follows the periodic halving ("reset") of Einziger, Friedman and Manes,
"TinyLFU: A Highly Efficient Cache Admission Policy" (2017), so a key that was
hot long ago cannot squat forever.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, ClassVar

from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.policy.base import PolicyBase

# Used until bind() says how big the level is.
_UNBOUND_CAPACITY = 1024


class LFUPolicy(PolicyBase):
    """LFU over unpinned resident keys, with counts halved every ``aging_period`` hits.

    ``_buckets[c]`` holds the evictable keys with count ``c``, least recent
    first; ``_counts`` is a min-heap of the counts that have a bucket (each at
    most once, tracked by ``_in_heap``), so finding the lowest non-empty bucket
    is O(log distinct counts). Pinned keys keep their count in ``_count`` but
    sit in no bucket. Keys that leave keep their count in a history bounded to
    the capacity, so a popular block that comes back resumes where it was.

    ``aging_period`` defaults to ten times the capacity (TinyLFU's sample size).
    """

    name: ClassVar[str] = "lfu"

    def __init__(self, aging_period: int | None = None) -> None:
        if aging_period is not None and aging_period <= 0:
            raise ConfigError(f"aging_period must be positive, got {aging_period}")
        super().__init__()
        self._aging_period = aging_period
        self._count: dict[int, int] = {}
        self._pinned: set[int] = set()
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._counts: list[int] = []
        self._in_heap: set[int] = set()
        self._history: OrderedDict[int, int] = OrderedDict()
        self._hits = 0

    @property
    def aging_period(self) -> int:
        if self._aging_period is not None:
            return self._aging_period
        return 10 * (self.key_capacity or _UNBOUND_CAPACITY)

    def count(self, key: int) -> int:
        """The current (aged) hit count of a resident key, 0 if not resident."""
        return self._count.get(key, 0)

    def _pinned_keys(self) -> Iterable[int]:
        return self._pinned

    def snapshot(self) -> dict[str, Any]:
        return {
            **self._state(),
            "count": sorted(self._count.items()),
            "pinned": sorted(self._pinned),
            "buckets": sorted((c, list(b)) for c, b in self._buckets.items()),
            "counts_heap": list(self._counts),
            "in_heap": sorted(self._in_heap),
            "history": list(self._history.items()),
            "hits": self._hits,
        }

    # -- buckets ---------------------------------------------------------------
    def _place(self, key: int, c: int) -> None:
        bucket = self._buckets.get(c)
        if bucket is None:
            bucket = self._buckets[c] = OrderedDict()
            if c not in self._in_heap:
                self._in_heap.add(c)
                heapq.heappush(self._counts, c)
        bucket[key] = None

    def _take(self, key: int, c: int) -> None:
        bucket = self._buckets[c]
        del bucket[key]
        if not bucket:
            # The count stays in the heap; evict() pops it when it surfaces.
            del self._buckets[c]

    # -- transitions -------------------------------------------------------------
    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        c = self._history.pop(key, 0) + 1
        self._count[key] = c
        if pinned:
            self._pinned.add(key)
        else:
            self._place(key, c)

    def access(self, key: int) -> None:
        c = self._count.get(key)
        if c is None:
            return
        self._count[key] = c + 1
        if key not in self._pinned:
            self._take(key, c)
            self._place(key, c + 1)
        self._hits += 1
        if self._hits >= self.aging_period:
            self._age()

    def pin(self, key: int) -> None:
        c = self._count.get(key)
        if c is None or key in self._pinned:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
        self._take(key, c)
        self._pinned.add(key)

    def unpin(self, key: int) -> None:
        try:
            self._pinned.remove(key)
        except KeyError:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned") from None
        # Most recent within its count, so ties go against keys idle longer.
        self._place(key, self._count[key])

    def remove(self, key: int) -> None:
        c = self._count.pop(key, None)
        if c is None:
            return
        if key in self._pinned:
            self._pinned.remove(key)
        else:
            self._take(key, c)
        if self._sizes:
            self._forget_size(key)
        self._remember(key, c)

    def evict(self) -> int | None:
        counts = self._counts
        buckets = self._buckets
        while counts:
            c = counts[0]
            bucket = buckets.get(c)
            if bucket:
                key = bucket.popitem(last=False)[0]
                if not bucket:
                    del buckets[c]
                del self._count[key]
                if self._sizes:
                    self._forget_size(key)
                self._remember(key, c)
                return key
            heapq.heappop(counts)
            self._in_heap.discard(c)
        return None

    # -- history and aging ---------------------------------------------------------
    def _remember(self, key: int, c: int) -> None:
        history = self._history
        history[key] = c
        if len(history) > (self.key_capacity or _UNBOUND_CAPACITY):
            history.popitem(last=False)

    def _age(self) -> None:
        """Halve every count; O(n), once per ``aging_period`` hits."""
        self._hits = 0
        self._count = {k: c >> 1 for k, c in self._count.items()}
        self._history = OrderedDict((k, c >> 1) for k, c in self._history.items() if c > 1)
        # Merging buckets c and c+1 into c // 2 puts the lower old count first:
        # it is the better victim among the new equals.
        merged: dict[int, OrderedDict[int, None]] = {}
        for c in sorted(self._buckets):
            target = merged.setdefault(c >> 1, OrderedDict())
            target.update(self._buckets[c])
        self._buckets = merged
        self._counts = sorted(merged)  # a sorted list is a valid heap
        self._in_heap = set(merged)

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key: object) -> bool:
        return key in self._count

    @property
    def num_evictable(self) -> int:
        return len(self._count) - len(self._pinned)
