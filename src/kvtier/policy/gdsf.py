"""GreedyDual-Size-Frequency eviction: value per byte, inflated over time.

Cherkasova, "Improving WWW Proxies Performance with Greedy-Dual-Size-Frequency
Caching Policy" (HP Labs, 1998), after Cao and Irani's GreedyDual-Size. Each
key has priority ``H = L + freq * cost / size``; the victim is the lowest H,
and the inflation value ``L`` becomes the victim's H, so keys not touched for
a long time fall behind newly refreshed ones (aging without a timer).

The device pool has one size and cost for every block, so ``size`` and
``cost`` default to 1 there; tiers and the replay pass real values (bytes of
a block, recompute time of a prefix).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import ClassVar

from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.policy.base import PolicyBase

# Stale entries are dropped lazily; rebuild once they outnumber live ones.
_SLACK = 64


def _check(size: int, cost: float) -> None:
    if size <= 0:
        raise ConfigError(f"an entry's size must be positive, got {size}")
    if cost < 0:
        raise ConfigError(f"an entry's cost must be non-negative, got {cost}")


class GDSFPolicy(PolicyBase):
    """GDSF over unpinned resident keys, with a lazily invalidated min-heap.

    ``_heap`` holds ``(H, seq, key)``; an entry is live while ``_live[key]``
    is its ``seq``. A hit or a release pushes a fresh entry (O(log n)) and
    leaves the old one stale. A release recomputes H with the current L: it
    is the key's last use, so it counts as recent.
    """

    name: ClassVar[str] = "gdsf"

    def __init__(self) -> None:
        self.capacity = 0
        #: The inflation value: H of the last victim.
        self.L = 0.0
        self._freq: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self._cost: dict[int, float] = {}
        self._pinned: set[int] = set()
        self._live: dict[int, int] = {}
        self._heap: list[tuple[float, int, int]] = []
        self._seq = 0

    def priority(self, key: int) -> float:
        """H for a resident key as it would be computed now."""
        return self.L + self._freq[key] * self._cost[key] / self._size[key]

    def _push(self, key: int) -> None:
        seq = self._seq = self._seq + 1
        self._live[key] = seq
        heapq.heappush(self._heap, (self.priority(key), seq, key))
        if len(self._heap) > 2 * len(self._live) + _SLACK:
            live = self._live
            self._heap = [e for e in self._heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    # -- transitions -------------------------------------------------------------
    def insert(self, key: int, pinned: bool = False, *, size: int = 1, cost: float = 1.0) -> None:
        _check(size, cost)
        self._freq[key] = 1
        self._size[key] = size
        self._cost[key] = cost
        if pinned:
            self._pinned.add(key)
        else:
            self._push(key)

    def insert_many(
        self,
        keys: Sequence[int],
        pinned: bool = False,
        *,
        sizes: Sequence[int] | None = None,
        costs: Sequence[float] | None = None,
    ) -> None:
        n = len(keys)
        if (sizes is not None and len(sizes) != n) or (costs is not None and len(costs) != n):
            raise ConfigError("insert_many needs one size and one cost per key")
        # Check everything first so a bad entry leaves the policy unchanged.
        for i in range(n):
            _check(1 if sizes is None else sizes[i], 1.0 if costs is None else costs[i])
        for i, key in enumerate(keys):
            self.insert(
                key,
                pinned,
                size=1 if sizes is None else sizes[i],
                cost=1.0 if costs is None else costs[i],
            )

    def access(self, key: int) -> None:
        f = self._freq.get(key)
        if f is None:
            return
        self._freq[key] = f + 1
        if key in self._live:
            self._push(key)

    def pin(self, key: int) -> None:
        if self._live.pop(key, None) is None:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
        self._pinned.add(key)

    def unpin(self, key: int) -> None:
        try:
            self._pinned.remove(key)
        except KeyError:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned") from None
        self._push(key)

    def remove(self, key: int) -> None:
        if self._freq.pop(key, None) is None:
            return
        del self._size[key], self._cost[key]
        if self._live.pop(key, None) is None:
            self._pinned.discard(key)

    def evict(self) -> int | None:
        heap = self._heap
        live = self._live
        while heap:
            h, seq, key = heapq.heappop(heap)
            if live.get(key) == seq:
                del live[key], self._freq[key], self._size[key], self._cost[key]
                self.L = h
                return key
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    @property
    def num_evictable(self) -> int:
        return len(self._live)
