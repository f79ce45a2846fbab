"""SIEVE eviction: a FIFO queue, one visited bit per key and a moving hand.

Zhang, Yang, Yue, Vigfusson and Rashmi, "SIEVE is Simpler than LRU: an
Efficient Turn-Key Eviction Algorithm for Web Caches" (NSDI 2024). A hit only
sets the key's visited bit. To evict, the hand walks from the tail (oldest)
toward the head, clearing visited bits, and takes the first unvisited key;
it resumes from there next time and wraps to the tail after the head. Kept
keys stay where they are, which is what separates SIEVE from CLOCK.

The queue is stored as two ordered dicts split at the hand, so every step is
O(1) without a linked list: ``_ahead`` runs from the hand to the head (not
yet examined in this sweep) and ``_behind`` from the tail to just before the
hand (examined, bits cleared). Pinned keys are out of the queue; a release
puts the key back at the head with its visited bit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, ClassVar

from kvtier.errors import InternalInvariantError
from kvtier.policy.base import PolicyBase


class SIEVEPolicy(PolicyBase):
    """SIEVE over unpinned resident keys; values in the dicts are visited bits.

    Invariant: ``_ahead`` is empty only when ``_behind`` is too, i.e. the hand
    wraps to the tail as soon as it passes the head.
    """

    name: ClassVar[str] = "sieve"

    def __init__(self) -> None:
        super().__init__()
        self._ahead: OrderedDict[int, bool] = OrderedDict()
        self._behind: OrderedDict[int, bool] = OrderedDict()
        self._pinned: dict[int, bool] = {}

    def _wrap(self) -> None:
        if not self._ahead and self._behind:
            self._ahead, self._behind = self._behind, self._ahead

    def _enqueue(self, key: int, visited: bool) -> None:
        # The head is the newest end of the whole queue, i.e. the end of _ahead.
        self._ahead[key] = visited

    def _pinned_keys(self) -> Iterable[int]:
        return self._pinned

    def snapshot(self) -> dict[str, Any]:
        return {
            **self._state(),
            "ahead": list(self._ahead.items()),
            "behind": list(self._behind.items()),
            "pinned": sorted(self._pinned.items()),
        }

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        if pinned:
            self._pinned[key] = False
        else:
            self._enqueue(key, False)

    def access(self, key: int) -> None:
        for part in (self._ahead, self._behind, self._pinned):
            if key in part:
                part[key] = True
                return

    def pin(self, key: int) -> None:
        if key in self._ahead:
            visited = self._ahead.pop(key)
            self._wrap()
        elif key in self._behind:
            visited = self._behind.pop(key)
        else:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
        self._pinned[key] = visited

    def unpin(self, key: int) -> None:
        try:
            visited = self._pinned.pop(key)
        except KeyError:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned") from None
        self._enqueue(key, visited)

    def remove(self, key: int) -> None:
        if key in self._ahead:
            del self._ahead[key]
            self._wrap()
        elif key in self._behind:
            del self._behind[key]
        elif self._pinned.pop(key, None) is None:
            return
        if self._sizes:
            self._forget_size(key)

    def evict(self) -> int | None:
        # Terminates: a full sweep clears every bit.
        while self._ahead:
            key, visited = self._ahead.popitem(last=False)
            if visited:
                self._behind[key] = False
                self._wrap()
                continue
            self._wrap()
            if self._sizes:
                self._forget_size(key)
            return key
        return None

    def __len__(self) -> int:
        return len(self._ahead) + len(self._behind) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._ahead or key in self._behind or key in self._pinned

    @property
    def num_evictable(self) -> int:
        return len(self._ahead) + len(self._behind)
