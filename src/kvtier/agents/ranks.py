"""Rank classes of the workflow policy: which blocks go first, and how each class orders its own.

:class:`~kvtier.agents.policy.WorkflowPolicy` puts every resident block in a
class by what the hints say of it (the constants below, lowest evicted
first). Most classes order their blocks by the fallback policy. Two need an
order of their own: :class:`TailFirstLRU` (LRU over requests, a chain's tail
first) and :class:`ByReturn` (TTL-pinned blocks, the one due back latest
first).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Container, Iterable, Sequence
from itertools import filterfalse
from typing import Any

from kvtier.agents.graph import FAR
from kvtier.errors import InternalInvariantError
from kvtier.policy.base import PolicyBase
from kvtier.policy.lru import LRUPolicy

#: The class of keys no hint ranks (and of every key without hints).
DEFAULT = 1
#: ``reuse="never"`` and the blocks of ended sessions: evicted before anything else.
NEVER = 0
#: Dynamic suffixes take ranks DYNAMIC .. DYNAMIC + FAR (the agent due soonest highest).
DYNAMIC = 2
#: TTL-pinned keys past the pin cap: after every suffix, before every shared prefix.
WAITING = DYNAMIC + FAR + 1
#: Shared prefixes take ranks SHARED .. SHARED + FAR.
SHARED = WAITING + 1
#: TTL-pinned keys within the pin cap: evicted last.
PINNED = 3 * FAR + 10
TIMED = frozenset((WAITING, PINNED))
#: Owners one key remembers at most (a block shared more widely is shared anyway).
MAX_OWNERS = 8


def keep_rank(distance: int, shared: bool) -> int:
    """The class of a block ``distance`` steps from use; lower classes are evicted first.

    Every dynamic suffix ranks below every shared prefix; within each, the
    farther the block's agent, the lower.
    """
    return (SHARED if shared else DYNAMIC) + (FAR - min(max(distance, 0), FAR))


class TailFirstLRU(LRUPolicy):
    """LRU over requests, and within one request's chain the tail first.

    The owner evicts a cached block's descendants with it, so taking a
    chain's head first would drop the whole chain; tail first leaves a usable
    prefix (what the agent or session due next can still hit).
    """

    def insert_many(
        self, keys: Sequence[int], pinned: bool = False, sizes: Sequence[int] | None = None
    ) -> None:
        if pinned or sizes is not None:
            super().insert_many(keys, pinned, sizes)
        else:
            self._order.update(dict.fromkeys(reversed(keys)))

    def unpin_many(self, keys: Sequence[int]) -> None:
        super().unpin_many(keys[::-1])

    def join(self, keys: Iterable[int], pinned: Container[int]) -> None:
        """Insert ``keys`` of size 1 one after another, the ones in ``pinned`` pinned.

        The same as ``insert(key, key in pinned)`` for each in turn.
        """
        keys = list(keys)
        self._order.update(dict.fromkeys(filterfalse(pinned.__contains__, keys)))
        self._pinned.update(filter(pinned.__contains__, keys))

    def access_many(self, keys: Sequence[int]) -> None:
        order = self._order
        for key in reversed(keys):
            if key in order:
                order.move_to_end(key)


class ByReturn(PolicyBase):
    """TTL-pinned keys: the key whose pin ends latest goes first, a chain's tail first.

    ``expiry`` maps a key to when its pin ends (when its session is expected
    back); a key it does not name never expires. ``depth`` gives a key's
    position in its chain, so that of keys due back together the deepest go
    first (evicting a block evicts its descendants). The heap holds
    ``(-until, -depth, -seq, key)`` entries, valid while ``_live[key]`` is
    their first three: a re-sort pushes a fresh entry and leaves the old one
    stale.
    """

    def __init__(self, expiry: dict[int, float], depth: Callable[[int], int]) -> None:
        super().__init__()
        self._expiry = expiry
        self._depth = depth
        self._seq = 0
        #: Evictable keys -> the (-until, -depth, -seq) of their live heap entry.
        self._live: dict[int, tuple[float, int, int]] = {}
        self._heap: list[tuple[float, int, int, int]] = []
        self._held: set[int] = set()

    def _push(self, key: int) -> None:
        seq = self._seq = self._seq + 1
        entry = (-self._expiry.get(key, math.inf), -self._depth(key), -seq)
        self._live[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 4 * len(self._live) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries (their pop order never mattered: they are skipped)."""
        self._heap = [(*e, k) for k, e in self._live.items()]
        heapq.heapify(self._heap)

    def unpin_many(self, keys: Sequence[int]) -> None:
        held = self._held
        live = self._live
        get = self._expiry.get
        depth = self._depth
        push = heapq.heappush
        inf = math.inf
        seq = self._seq
        try:
            for key in keys:
                if key not in held:
                    raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned")
                held.remove(key)
                seq += 1
                entry = (-get(key, inf), -depth(key), -seq)
                live[key] = entry
                push(self._heap, (*entry, key))
        finally:
            self._seq = seq
            if len(self._heap) > 4 * len(live) + 64:
                self._compact()

    def pin_many(self, keys: Sequence[int]) -> None:
        pop = self._live.pop
        add = self._held.add
        for key in keys:
            if pop(key, None) is None:
                raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
            add(key)

    def _pinned_keys(self) -> Iterable[int]:
        return self._held

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        if pinned:
            self._held.add(key)
            return
        # _push, inline: every key that joins the class unpinned comes here.
        seq = self._seq = self._seq + 1
        entry = (-self._expiry.get(key, math.inf), -self._depth(key), -seq)
        self._live[key] = entry
        heap = self._heap
        heapq.heappush(heap, (*entry, key))
        if len(heap) > 4 * len(self._live) + 64:
            self._compact()

    def access(self, key: int) -> None:
        live = self._live
        if key in live:
            seq = self._seq = self._seq + 1
            entry = (-self._expiry.get(key, math.inf), -self._depth(key), -seq)
            live[key] = entry
            heap = self._heap
            heapq.heappush(heap, (*entry, key))
            if len(heap) > 4 * len(live) + 64:
                self._compact()

    def pin(self, key: int) -> None:
        if self._live.pop(key, None) is None:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
        self._held.add(key)

    def unpin(self, key: int) -> None:
        try:
            self._held.remove(key)
        except KeyError:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned") from None
        self._push(key)

    def remove(self, key: int) -> None:
        if self._live.pop(key, None) is None:
            if key not in self._held:
                return
            self._held.remove(key)
        if self._sizes:
            self._forget_size(key)

    def evict(self) -> int | None:
        heap, live = self._heap, self._live
        while heap:
            neg_until, neg_depth, neg_seq, key = heapq.heappop(heap)
            if live.get(key) == (neg_until, neg_depth, neg_seq):
                del live[key]
                if self._sizes:
                    self._forget_size(key)
                return key
        return None

    def evict_many(self, n: int) -> list[int]:
        heap, live = self._heap, self._live
        pop = heapq.heappop
        out: list[int] = []
        while heap and len(out) < n:
            neg_until, neg_depth, neg_seq, key = pop(heap)
            if live.get(key) == (neg_until, neg_depth, neg_seq):
                del live[key]
                out.append(key)
        if self._sizes:
            for key in out:
                self._forget_size(key)
        return out

    def __len__(self) -> int:
        return len(self._live) + len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._live or key in self._held

    @property
    def num_evictable(self) -> int:
        return len(self._live)

    def snapshot(self) -> dict[str, Any]:
        return {**self._state(), "order": sorted(self._live.items()), "pinned": sorted(self._held)}
