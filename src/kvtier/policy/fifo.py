"""First-in-first-out eviction: the victim is the key inserted longest ago.

The classic baseline (Belady's FIFO, "A study of replacement algorithms for a
virtual-storage computer", 1966): neither hits nor releases reorder anything.
Pinned keys are skipped without being demoted: they leave the candidate heap
while pinned and rejoin it at their original insertion position.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from kvtier.errors import InternalInvariantError
from kvtier.policy.base import PolicyBase

# Stale heap entries (pinned, removed or evicted keys) are dropped lazily; the
# heap is rebuilt once they outnumber the live ones, so memory stays O(n).
_SLACK = 64


class FIFOPolicy(PolicyBase):
    """FIFO over unpinned resident keys, ordered by insertion number.

    ``_seq`` numbers every resident key at insertion; ``_heap`` holds
    ``(seq, key)`` for evictable keys, possibly with stale entries that
    ``evict`` discards. A heap (rather than a queue) is what lets an unpinned
    key return to its old place instead of the back of the line.
    """

    name: ClassVar[str] = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._seq: dict[int, int] = {}
        self._pinned: set[int] = set()
        self._heap: list[tuple[int, int]] = []
        self._next = 0

    def _pinned_keys(self) -> Iterable[int]:
        return self._pinned

    def snapshot(self) -> dict[str, Any]:
        return {
            **self._state(),
            "seq": sorted(self._seq.items()),
            "pinned": sorted(self._pinned),
            "heap": list(self._heap),
            "next": self._next,
        }

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        seq = self._next
        self._next = seq + 1
        self._seq[key] = seq
        if pinned:
            self._pinned.add(key)
        else:
            heapq.heappush(self._heap, (seq, key))

    def insert_many(
        self, keys: Sequence[int], pinned: bool = False, sizes: Sequence[int] | None = None
    ) -> None:
        if sizes is not None:
            self._record_sizes(keys, sizes)
        start = self._next
        self._next = start + len(keys)
        numbered = dict(zip(keys, range(start, self._next), strict=True))
        self._seq.update(numbered)
        if pinned:
            self._pinned.update(keys)
        else:
            # Fresh numbers exceed every entry already there, so appending
            # keeps the heap property without sifting.
            self._heap.extend((s, k) for k, s in numbered.items())

    def access(self, key: int) -> None:
        pass

    def access_many(self, keys: Sequence[int]) -> None:
        pass

    def pin(self, key: int) -> None:
        if key not in self._seq or key in self._pinned:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
        # Its heap entry goes stale; evict() checks membership in _pinned.
        self._pinned.add(key)

    def unpin(self, key: int) -> None:
        try:
            self._pinned.remove(key)
        except KeyError:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned") from None
        heapq.heappush(self._heap, (self._seq[key], key))
        self._maybe_compact()

    def remove(self, key: int) -> None:
        if self._seq.pop(key, None) is not None:
            self._pinned.discard(key)
            if self._sizes:
                self._forget_size(key)
            self._maybe_compact()

    def evict(self) -> int | None:
        heap = self._heap
        seq = self._seq
        pinned = self._pinned
        while heap:
            s, key = heapq.heappop(heap)
            if seq.get(key) == s and key not in pinned:
                del seq[key]
                if self._sizes:
                    self._forget_size(key)
                return key
        return None

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * self.num_evictable + _SLACK:
            pinned = self._pinned
            self._heap = sorted((s, k) for k, s in self._seq.items() if k not in pinned)

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, key: object) -> bool:
        return key in self._seq

    @property
    def num_evictable(self) -> int:
        return len(self._seq) - len(self._pinned)
