"""A tier's retention pins: when each held key's pin ends, in order of end both ways.

:class:`PinOrders` is the bookkeeping behind the retention pins of
:class:`~kvtier.offload.manager.OffloadingManager`: ``ends`` maps each pinned
key to when its pin ends, and two heaps order the pins by end, the soonest
first (they lapse in that order) and the latest first (a full tier evicts the
pinned key due back latest). Replacing or dropping a pin leaves its heap
entries stale: they are skipped when met, and the heaps are rebuilt once most
of their entries are. What a pin means for eviction (the policy's pinned keys,
which keys a load holds) stays with the manager.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kvtier.errors import InternalInvariantError

#: A heap entry: ``(end, seq, key)`` soonest first, ``(-end, seq, key)`` latest first.
_Item = tuple[float, int, int]


class PinOrders:
    """Pinned keys and when each pin ends, the soonest and the latest end first."""

    def __init__(self) -> None:
        #: key -> when its pin ends (the tier's clock).
        self.ends: dict[int, float] = {}
        self._soonest: list[_Item] = []
        self._latest: list[_Item] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self.ends)

    def __bool__(self) -> bool:
        return bool(self.ends)

    @property
    def queued(self) -> int:
        """Entries in both orders, stale ones included (none without pins)."""
        return len(self._soonest) + len(self._latest)

    def set(self, key: int, until: float) -> None:
        """Pin ``key`` until ``until`` (replacing its pin, if any)."""
        self.ends[key] = until
        self._seq += 1
        heapq.heappush(self._soonest, (until, self._seq, key))
        heapq.heappush(self._latest, (-until, self._seq, key))

    def drop(self, key: int) -> None:
        """Forget ``key``'s pin (it must have one)."""
        del self.ends[key]

    def pop_ended(self, now: float) -> list[int]:
        """Forget the pins that end at or before ``now``; their keys, soonest end first."""
        soonest, ends = self._soonest, self.ends
        out: list[int] = []
        while soonest and soonest[0][0] <= now:
            until, _, key = heapq.heappop(soonest)
            if ends.get(key) == until:  # else stale: replaced or dropped
                del ends[key]
                out.append(key)
        return out

    def compact(self) -> None:
        """Drop the stale entries once they are most of the heaps."""
        if len(self._soonest) > 4 * len(self.ends) + 64:
            ends = self.ends
            self._soonest = [x for x in self._soonest if ends.get(x[2]) == x[0]]
            heapq.heapify(self._soonest)
            self._latest = [x for x in self._latest if ends.get(x[2]) == -x[0]]
            heapq.heapify(self._latest)

    def latest(self, n: int, eligible: Callable[[int], bool], where: str) -> list[int]:
        """``n`` distinct pinned keys that are ``eligible``, the pin that ends latest first
        (ties: pinned first); there must be that many (``where`` names the tier in the
        error). Changes no pin."""
        latest, ends = self._latest, self.ends
        out: list[int] = []
        chosen: set[int] = set()
        aside: list[_Item] = []
        pop = heapq.heappop
        while len(out) < n:
            if not latest:
                raise InternalInvariantError(
                    f"{n} pinned victims wanted on the {where} tier, {len(out)} found"
                )
            item = pop(latest)
            key = item[2]
            if ends.get(key) != -item[0]:
                continue  # stale
            aside.append(item)
            if key in chosen or not eligible(key):
                continue
            chosen.add(key)
            out.append(key)
        for item in aside:
            if item[2] not in chosen:
                heapq.heappush(latest, item)
        return out

    def check(self) -> None:
        """Every pin is in both orders; raises :class:`InternalInvariantError`."""
        soonest = {(u, k) for u, _, k in self._soonest}
        latest = {(-u, k) for u, _, k in self._latest}
        for key, until in self.ends.items():
            if (until, key) not in soonest or (until, key) not in latest:
                raise InternalInvariantError(f"the pin of block {key:#x} is missing from an order")
