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
from collections import deque
from collections.abc import Container, Iterable, Sequence
from functools import partial
from itertools import filterfalse, repeat
from operator import neg
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
#: TTL-pinned keys within the pin cap: evicted last of the keys one session uses.
PINNED = 3 * FAR + 10
#: TTL-pinned keys within the pin cap that other sessions or agents use too: evicted
#: last of all. A shared prefix is the parent of every pinned chain that continues
#: it, and a chain is found from its root: evicting it would lose them all.
PINNED_SHARED = PINNED + 1
TIMED = frozenset((WAITING, PINNED, PINNED_SHARED))
#: Owners one key remembers at most (a block shared more widely is shared anyway).
MAX_OWNERS = 8
#: A class call a batch decided (see :meth:`ByReturn.replay`): ``(REMOVE | INSERT |
#: ACCESS, key)``.
Call = tuple[int, int]
REMOVE, INSERT, ACCESS = 0, 1, 2
#: A :class:`ByReturn` heap entry: ``(-until, -depth, -seq, key)``.
Entry = tuple[float, int, int, int]
#: Not in a dict (a key's value there may be None).
_ABSENT = object()


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

    def hold_many(self, keys: Iterable[int]) -> None:
        """Insert ``keys`` (of size 1) pinned: ``insert(key, True)`` for each."""
        self._pinned.update(keys)

    def replay(self, calls: Iterable[Call], pinned: Container[int]) -> None:
        """``remove(key)``, ``insert(key, key in pinned)`` or ``access(key)`` for each
        ``(REMOVE | INSERT | ACCESS, key)`` in turn: keys of size 1."""
        order = self._order
        held = self._pinned
        for kind, key in calls:
            if kind == ACCESS:
                if key in order:
                    order.move_to_end(key)
            elif kind == INSERT:
                if key in pinned:
                    held.add(key)
                else:
                    order[key] = None
            elif order.pop(key, _ABSENT) is _ABSENT:
                held.discard(key)

    def access_many(self, keys: Sequence[int]) -> None:
        order = self._order
        for key in reversed(keys):
            if key in order:
                order.move_to_end(key)


class ByReturn(PolicyBase):
    """TTL-pinned keys: the key whose pin ends latest goes first, a chain's tail first.

    ``expiry`` maps a key to when its pin ends (when its session is expected
    back); a key it does not name never expires. ``depths`` gives a key's
    position in its chain (0 for a key it does not name), so that of keys due
    back together the deepest go first (evicting a block evicts its
    descendants). Both are the owner's tables, read when a key is pushed. The
    heap holds ``(-until, -depth, -seq, key)`` entries, valid while
    ``_live[key]`` is that very entry: a re-sort pushes a fresh entry and
    leaves the old one stale.

    Keys are pinned, released and re-sorted far more often than a class is
    evicted from (the class of pinned keys hardly ever is), so entries join
    the heap only when a victim is chosen: until then they wait in a list,
    and those a later push superseded never reach the heap.
    """

    def __init__(self, expiry: dict[int, float], depths: dict[int, int]) -> None:
        super().__init__()
        self._expiry = expiry
        self._depths = depths
        self._seq = 0
        #: Evictable keys -> their live heap entry.
        self._live: dict[int, Entry] = {}
        self._heap: list[Entry] = []
        #: Entries pushed since the heap last took them, in push order.
        self._fresh: list[Entry] = []
        self._held: set[int] = set()

    def _entries(self, keys: Sequence[int]) -> list[Entry]:
        """Fresh entries for ``keys``, pushed one after another in that order."""
        seq = self._seq
        self._seq = seq + len(keys)
        return list(
            zip(
                map(neg, map(self._expiry.get, keys, repeat(math.inf))),
                map(neg, map(self._depths.get, keys, repeat(0))),
                range(-seq - 1, -seq - 1 - len(keys), -1),
                keys,
                strict=True,
            )
        )

    def _push(self, key: int) -> None:
        seq = self._seq = self._seq + 1
        entry = (-self._expiry.get(key, math.inf), -self._depths.get(key, 0), -seq, key)
        self._live[key] = entry
        self._wait((entry,))

    def _wait(self, entries: Iterable[Entry]) -> None:
        """New entries wait for the heap (see the class docstring)."""
        fresh = self._fresh
        fresh.extend(entries)
        if len(fresh) > 4 * len(self._live) + 256:
            self._prune()

    def _valid(self, entries: list[Entry]) -> list[Entry]:
        """The ``entries`` still live (a later push or a pin leaves an entry stale)."""
        get = self._live.get
        return [e for e in entries if get(e[3]) is e]

    def _prune(self) -> None:
        """Drop the waiting entries a later push superseded (a class seldom evicted from)."""
        self._fresh = self._valid(self._fresh)

    def _flush(self) -> None:
        """Put the waiting entries that are still live in the heap."""
        live = self._live
        entries = self._valid(self._fresh)
        self._fresh = []
        heap = self._heap
        if len(entries) > len(heap):
            heap.extend(entries)
            heapq.heapify(heap)
        else:
            deque(map(partial(heapq.heappush, heap), entries), maxlen=0)
        if len(heap) > 4 * len(live) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries (their pop order never mattered: they are skipped)."""
        self._heap = list(self._live.values())
        self._fresh = []
        heapq.heapify(self._heap)

    def unpin_many(self, keys: Sequence[int]) -> None:
        held = self._held
        if not held.issuperset(keys):
            raise InternalInvariantError("unpin of a key that is not pinned")
        before = len(held)
        held.difference_update(keys)
        if before - len(held) != len(keys):
            raise InternalInvariantError("unpin of a key twice in one call")
        self._push_many(keys)

    def _push_many(self, keys: Sequence[int]) -> None:
        """``_push(key)`` for each of ``keys`` in turn."""
        entries = self._entries(keys)
        live = self._live
        live.update(zip(keys, entries, strict=True))
        self._wait(entries)

    def replay(self, calls: Iterable[Call], pinned: Container[int]) -> None:
        """``remove(key)``, ``insert(key, key in pinned)`` or ``access(key)`` for each
        ``(REMOVE | INSERT | ACCESS, key)`` in turn: keys of size 1, the owner's tables
        as they will be after the calls. Only each key's last push makes an entry (the
        earlier ones would be stale before anyone looked)."""
        live = self._live
        held = self._held
        pushed: dict[int, int] = {}
        seq = self._seq
        for kind, key in calls:
            if kind == ACCESS:
                if key in live or key in pushed:
                    seq += 1
                    pushed[key] = seq
            elif kind == INSERT:
                if key in pinned:
                    held.add(key)
                else:
                    seq += 1
                    pushed[key] = seq
            else:
                pushed.pop(key, None)
                if live.pop(key, None) is None:
                    held.discard(key)
        self._seq = seq
        if pushed:
            get, depth = self._expiry.get, self._depths.get
            inf = math.inf
            entries = [(-get(k, inf), -depth(k, 0), -q, k) for k, q in pushed.items()]
            live.update(zip(pushed, entries, strict=True))
            self._wait(entries)

    def pin_many(self, keys: Sequence[int]) -> None:
        live = self._live
        try:
            deque(map(live.pop, keys), maxlen=0)
        except KeyError as exc:
            raise InternalInvariantError(f"pin of key {exc} that is not evictable") from None
        self._held.update(keys)

    def hold_many(self, keys: Iterable[int]) -> None:
        """Insert ``keys`` (of size 1) pinned: ``insert(key, True)`` for each."""
        self._held.update(keys)

    def _pinned_keys(self) -> Iterable[int]:
        return self._held

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        if pinned:
            self._held.add(key)
        else:
            self._push(key)

    def access(self, key: int) -> None:
        if key in self._live:
            self._push(key)

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
        if self._fresh:
            self._flush()
        heap, live = self._heap, self._live
        while heap:
            entry = heapq.heappop(heap)
            key = entry[3]
            if live.get(key) is entry:
                del live[key]
                if self._sizes:
                    self._forget_size(key)
                return key
        return None

    def evict_many(self, n: int) -> list[int]:
        if self._fresh:
            self._flush()
        heap, live = self._heap, self._live
        pop = heapq.heappop
        out: list[int] = []
        while heap and len(out) < n:
            entry = pop(heap)
            key = entry[3]
            if live.get(key) is entry:
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
        order = sorted((k, e[:3]) for k, e in self._live.items())
        return {**self._state(), "order": order, "pinned": sorted(self._held)}
