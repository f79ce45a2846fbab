"""The workflow policy's resident keys: each in the global order and in its class, in step.

:class:`ResidentKeys` is the part of :class:`~kvtier.agents.policy.WorkflowPolicy`
that carries out the owner's calls on resident keys (insert, pin, release,
hit, remove, evict): every key is in the global instance of the fallback
(its order is the policy's while recency rules, see the guard) and in the
rank class its hints give it, and both hear of every change. Victims come
from the lowest class with evictable keys, or from the global order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import compress, repeat
from operator import not_
from typing import TYPE_CHECKING

from kvtier.agents.classes import group_by
from kvtier.agents.ranks import DEFAULT, ByReturn, TailFirstLRU
from kvtier.agents.tags import Owner, Tag
from kvtier.errors import InternalInvariantError
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.guard import LRUGuard
from kvtier.policy.lru import LRUPolicy


class ResidentKeys:
    """The owner's calls on resident keys, carried out in the global order and the classes."""

    _global: EvictionPolicy
    _classes: dict[int, EvictionPolicy]
    _class_of: dict[int, int]
    _pinned: set[int]
    _resident: set[int]
    _redepth: set[int]
    _tags: OrderedDict[int, Tag]
    _expiry: dict[int, float]
    _protected: dict[int, tuple[float, int]]
    _protected_used: int
    _by_agent: dict[Owner, dict[int, None]]
    _by_workflow: dict[str, dict[str, None]]
    guard: LRUGuard | None
    capacity: int

    if TYPE_CHECKING:

        def _size(self, key: int) -> int: ...

        def _cls(self, rank: int) -> EvictionPolicy: ...

        def _rank(self, key: int) -> int: ...

        def _rank_of(self, key: int) -> int: ...

        def _ranks_of(self, keys: Sequence[int]) -> list[int]: ...

        def _index(self, key: int, tag: Tag) -> None: ...

        def _unindex_owners(self, key: int, owners: list[Owner]) -> None: ...

        def _pin_state(self, key: int, until: float) -> bool: ...

        def _protect(self, key: int, until: float) -> None: ...

        def _protect_new(self, keys: list[int]) -> None: ...

        def _by_class(self, keys: Sequence[int]) -> list[tuple[EvictionPolicy, Sequence[int]]]: ...

        def _lowest_evictable(self) -> int | None: ...

        def _tick(self) -> None: ...

        def check_size(self, size: int) -> None: ...

    def _place(self, key: int, pinned: bool, size: int) -> None:
        tag = self._tags.get(key)
        if tag is not None:
            self._index(key, tag)
        self._place_indexed(key, pinned, size)

    def _place_indexed(self, key: int, pinned: bool, size: int) -> None:
        """:meth:`_place` for a key whose owners are indexed already."""
        until = self._expiry.get(key)
        if until is not None and pinned:
            # A pinned key has no place in its class's order yet, so settling its
            # protection first and inserting it once, where it ends up, decides
            # exactly what inserting it and then moving it would.
            self._pin_state(key, until)
            until = None
        rank = self._rank(key)
        c = self._classes.get(rank)
        if c is None:
            c = self._cls(rank)
        c.insert(key, pinned, size)
        if rank != DEFAULT:
            self._class_of[key] = rank
        if until is not None:
            self._protect(key, until)

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        self._global.insert(key, pinned, size)
        self._resident.add(key)
        if pinned:
            self._pinned.add(key)
        self._place(key, pinned, size)

    def insert_many(
        self, keys: Sequence[int], pinned: bool = False, sizes: Sequence[int] | None = None
    ) -> None:
        self._global.insert_many(keys, pinned, sizes)
        self._resident.update(keys)
        if pinned:
            self._pinned.update(keys)
        tags = self._tags
        expiry = self._expiry
        size_of = self._size
        if not tags:
            if expiry:
                for key in keys:
                    self._place(key, pinned, 1 if sizes is None else size_of(key))
                return
            if sizes is None and type(default := self._cls(DEFAULT)) is LRUPolicy:
                default.insert_many(keys, pinned)  # no hints: the fallback's, as one each
                return
        # A key neither hinted nor pinned by a TTL is in the fallback's class (never
        # protected: protection needs an expiry); it goes there at once, in chain
        # order, one insert each as _place would. The hint-ranked ones go tail first.
        if all(map(tags.__contains__, keys)):
            later = list(keys)  # the usual case: every key was hinted on its request
        else:
            hinted = [key in tags or key in expiry for key in keys]
            later = list(compress(keys, hinted))
            if len(later) < len(keys):
                rest = list(compress(keys, map(not_, hinted)))
                default = self._cls(DEFAULT)
                if sizes is None and type(default) is LRUPolicy:
                    default.insert_many(rest, pinned)  # the same as one insert each
                else:
                    for key in rest:
                        default.insert(key, pinned, 1 if sizes is None else size_of(key))
                if not later:
                    return
        if any(t is not None and t.owners for t in set(map(tags.get, later))):
            by_agent = self._by_agent
            by_workflow = self._by_workflow
            for key in later:  # each agent's keys indexed in chain order
                tag = tags.get(key)
                if tag is not None:
                    for owner in tag.owners:
                        keys_of = by_agent.get(owner)
                        if keys_of is None:
                            by_agent[owner] = {key: None}
                            by_workflow.setdefault(owner[0], {})[owner[1]] = None
                        else:
                            keys_of[key] = None
        later.reverse()
        place = self._place_indexed
        if type(self)._place_indexed is not ResidentKeys._place_indexed:
            for key in later:
                place(key, pinned, 1 if sizes is None else size_of(key))
            return
        if pinned and sizes is None and not self._redepth:
            # (A key whose depth changed makes when the order of protections is
            # rebuilt matter: the batch below rebuilds it at its end only.)
            self._hold_new(later)
            return
        # _place_indexed, inline.
        rank_of = self._rank
        pin_state = self._pin_state
        classes = self._classes
        class_of = self._class_of
        for key in later:
            size = 1 if sizes is None else size_of(key)
            until = expiry.get(key)
            if until is not None:
                if not pinned:
                    place(key, pinned, size)
                    continue
                pin_state(key, until)
            rank = rank_of(key)
            c = classes.get(rank)
            if c is None:
                c = self._cls(rank)
            c.insert(key, pinned, size)
            class_of[key] = rank

    def _hold_new(self, keys: list[int]) -> None:
        """:meth:`_place_indexed` for each of ``keys`` in turn: new keys of size 1, all
        pinned, hinted or pinned by a TTL (so none goes to the fallback's class).

        Their protections are settled first, in turn, as one after another would;
        pinned keys have no place in their class's order, so putting each in the
        class it ends up in afterwards decides what inserting it and moving it as
        later keys take its protection would.
        """
        self._protect_new(keys)
        classes = self._classes
        ranks = self._ranks_of(keys)
        self._class_of.update(zip(keys, ranks, strict=True))
        for rank in dict.fromkeys(ranks):
            c = classes.get(rank)
            if c is None:
                c = self._cls(rank)
            group = compress(keys, map(rank.__eq__, ranks))
            if isinstance(c, ByReturn | TailFirstLRU):
                c.hold_many(group)
            else:
                for key in group:
                    c.insert(key, True)

    def access(self, key: int) -> None:
        self._global.access(key)
        c = self._classes.get(self._class_of.get(key, DEFAULT))
        if c is not None and key in c:
            c.access(key)

    def access_many(self, keys: Sequence[int]) -> None:
        self._global.access_many(keys)
        classes = self._classes
        class_of = self._class_of
        if not class_of:
            c = classes.get(DEFAULT)
            if c is not None:
                c.access_many([k for k in keys if k in c])
            return
        # A hint-ranked class orders its unpinned keys only: a hit on a pinned key
        # there changes nothing (the owner pins its hits, then reports them).
        pinned = self._pinned
        if pinned.issuperset(keys) and class_of.keys() >= set(keys):
            return
        default = classes.get(DEFAULT)
        for key in keys:
            rank = class_of.get(key)
            if rank is None:
                if default is not None and key in default:
                    default.access(key)
            elif key not in pinned:
                c = classes[rank]
                if key in c:
                    c.access(key)

    def pin(self, key: int) -> None:
        self._global.pin(key)
        self._classes[self._rank_of(key)].pin(key)
        self._pinned.add(key)

    def unpin(self, key: int) -> None:
        self._global.unpin(key)
        self._classes[self._rank_of(key)].unpin(key)
        self._pinned.discard(key)

    def pin_many(self, keys: Sequence[int]) -> None:
        self._global.pin_many(keys)
        for c, group in self._by_class(keys):
            c.pin_many(group)
        self._pinned.update(keys)

    def unpin_many(self, keys: Sequence[int]) -> None:
        self._global.unpin_many(keys)
        for c, group in self._by_class(keys):
            c.unpin_many(group)
        self._pinned.difference_update(keys)

    def _forget_all(self, victims: list[int]) -> None:
        """``victims`` left the level: drop their class membership and protection."""
        deque(map(self._class_of.pop, victims, repeat(None)), maxlen=0)
        self._resident.difference_update(victims)
        self._pinned.difference_update(victims)
        if self._redepth:
            self._redepth.difference_update(victims)
        protected = self._protected
        if protected:
            for key in [k for k in victims if k in protected]:
                self._protected_used -= protected.pop(key)[1]
        tags = self._tags
        found = list(map(tags.get, victims))
        if any(t is not None and t.owners for t in set(found)):
            unindex = self._unindex_owners
            for key, tag in zip(victims, found, strict=True):
                if tag is not None and tag.owners:
                    unindex(key, tag.owners)

    def remove(self, key: int) -> None:
        resident = self._resident
        if key not in resident:
            return
        rank = self._class_of.pop(key, DEFAULT)
        self._global.remove(key)
        self._classes[rank].remove(key)
        # The owner drops a block's descendants with it, one call each: the rest of
        # the key's bookkeeping goes here, without a call per table.
        resident.discard(key)
        self._pinned.discard(key)
        redepth = self._redepth
        if redepth:
            redepth.discard(key)
        entry = self._protected.pop(key, None)
        if entry is not None:
            self._protected_used -= entry[1]
        tag = self._tags.get(key)
        if tag is not None and tag.owners:
            self._unindex_owners(key, tag.owners)

    def _recency(self) -> bool:
        return not self._class_of or (self.guard is not None and self.guard.recency)

    def _take_global(self, victims: list[int]) -> list[int]:
        """Victims the global order chose: leave their classes too."""
        if victims:
            classes = self._classes
            ranks = list(map(self._class_of.get, victims, repeat(DEFAULT)))
            # Each class leaves its keys in the order chosen; classes are independent.
            for rank, group in group_by(victims, ranks):
                deque(map(classes[rank].remove, group), maxlen=0)
            self._forget_all(victims)
        return victims

    def _take_class(self, victims: list[int]) -> list[int]:
        deque(map(self._global.remove, victims), maxlen=0)
        self._forget_all(victims)
        return victims

    def evict(self) -> int | None:
        self._tick()
        if self._recency():
            key = self._global.evict()
            if key is None:
                return None
            self._classes[self._rank_of(key)].remove(key)
            self._forget_all([key])
            return key
        rank = self._lowest_evictable()
        if rank is None:
            return None
        c = self._classes[rank]
        key = c.evict()
        if key is None:
            raise InternalInvariantError("a class with evictable keys found no victim")
        self._global.remove(key)
        self._forget_all([key])
        return key

    def evict_many(self, n: int) -> list[int]:
        self._tick()
        if self._recency():
            return self._take_global(self._global.evict_many(n))
        out: list[int] = []
        while len(out) < n:
            rank = self._lowest_evictable()
            if rank is None:
                break
            c = self._classes[rank]
            got = c.evict_many(min(n - len(out), c.num_evictable))
            if not got:
                raise InternalInvariantError("a class with evictable keys found no victim")
            out.extend(self._take_class(got))
        return out
