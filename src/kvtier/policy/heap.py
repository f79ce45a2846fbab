"""The priority heap shared by the score-based policies (GDSF, hybrid).

Such a policy gives every unpinned resident key a priority and evicts the
lowest. The heap holds ``(priority, seq, key)`` entries, valid while
``_live[key] == seq``: a hit or a release pushes a fresh entry in O(log n) and
leaves the old one stale, and stale entries are compacted once they outnumber
the live ones. Pinned keys are held aside in ``_pinned`` and never scanned.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from kvtier.errors import InternalInvariantError
from kvtier.policy.base import PolicyBase

# Stale entries are dropped lazily; compact once they outnumber live ones.
_SLACK = 64


class HeapPolicy(PolicyBase):
    """Base of the score-based policies; a subclass defines :meth:`_priority`.

    Subclasses keep per-key metadata next to ``_freq`` and the sizes (which
    every score-based policy here uses) and extend :meth:`_forget` to drop it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._freq: dict[int, int] = {}
        self._pinned: set[int] = set()
        self._live: dict[int, int] = {}
        self._heap: list[tuple[float, int, int]] = []
        self._seq = 0

    # -- hooks for subclasses -------------------------------------------------------
    def _priority(self, key: int) -> float:
        raise NotImplementedError

    def _forget(self, key: int) -> None:
        """Drop a key's metadata (it is no longer resident)."""
        del self._freq[key]
        if self._sizes:
            self._forget_size(key)

    def _pinned_keys(self) -> Iterable[int]:
        return self._pinned

    def snapshot(self) -> dict[str, Any]:
        return {
            **self._state(),
            "freq": sorted(self._freq.items()),
            "pinned": sorted(self._pinned),
            "live": sorted(self._live.items()),
            "heap": list(self._heap),
            "seq": self._seq,
        }

    def _on_unpin(self, key: int) -> None:
        """Called before a released key re-enters the heap."""

    def _on_evict(self, key: int, priority: float) -> None:
        """Called with the victim and its priority, before its metadata is dropped."""

    # -- heap upkeep ------------------------------------------------------------------
    def _push(self, key: int) -> None:
        seq = self._seq = self._seq + 1
        self._live[key] = seq
        heapq.heappush(self._heap, (self._priority(key), seq, key))
        if len(self._heap) > 2 * len(self._live) + _SLACK:
            live = self._live
            self._heap = [e for e in self._heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def _rebuild(self) -> None:
        """Recompute every live priority (after a change of scale)."""
        self._heap = [(self._priority(k), seq, k) for k, seq in self._live.items()]
        heapq.heapify(self._heap)

    def _admit_resident(self, key: int, pinned: bool) -> None:
        """Make a key whose metadata is set resident, pinned or in the heap."""
        if pinned:
            self._pinned.add(key)
        else:
            self._push(key)

    # -- transitions --------------------------------------------------------------------
    def pin(self, key: int) -> None:
        if self._live.pop(key, None) is None:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
        self._pinned.add(key)

    def unpin(self, key: int) -> None:
        try:
            self._pinned.remove(key)
        except KeyError:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned") from None
        self._on_unpin(key)
        self._push(key)

    def remove(self, key: int) -> None:
        if key not in self._freq:
            return
        self._forget(key)
        if self._live.pop(key, None) is None:
            self._pinned.discard(key)

    def evict(self) -> int | None:
        heap = self._heap
        live = self._live
        while heap:
            priority, seq, key = heapq.heappop(heap)
            if live.get(key) == seq:
                del live[key]
                self._on_evict(key, priority)
                self._forget(key)
                return key
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    @property
    def num_evictable(self) -> int:
        return len(self._live)
