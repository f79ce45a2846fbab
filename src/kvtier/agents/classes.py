"""Rank classes of the workflow policy: which class each resident block is in.

:class:`RankClasses` keeps one eviction order per rank (the constants of
:mod:`kvtier.agents.ranks`) and each resident block in the class its rank
names: computed from the block's tag, its TTL pin and its agents'
steps-to-execution, and moved only when one of those changes (a tag that
gains an owner, a pin that starts or ends, a workflow that progresses).
Victims come from the lowest class with evictable blocks.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from functools import cache
from itertools import compress, islice, repeat
from operator import ne
from typing import TYPE_CHECKING

from kvtier.agents.graph import FAR
from kvtier.agents.ranks import (
    ACCESS,
    DEFAULT,
    DYNAMIC,
    INSERT,
    NEVER,
    PINNED,
    PINNED_SHARED,
    REMOVE,
    SHARED,
    TIMED,
    WAITING,
    ByReturn,
    Call,
    TailFirstLRU,
    keep_rank,
)
from kvtier.agents.tags import Owner, Tag
from kvtier.agents.tracker import WorkflowTracker
from kvtier.policy.base import EvictionPolicy, PolicyBase
from kvtier.policy.guard import LRUGuard

#: The class calls a batch decided, per class (rank), each class's in turn.
Journal = dict[int, list[Call]]


def moved(journal: Journal, key: int, old: int, new: int) -> None:
    """Write down ``key``'s move from class ``old`` to class ``new``."""
    calls = journal.get(old)
    if calls is None:
        journal[old] = [(REMOVE, key)]
    else:
        calls.append((REMOVE, key))
    calls = journal.get(new)
    if calls is None:
        journal[new] = [(INSERT, key)]
    else:
        calls.append((INSERT, key))


def resorted(journal: Journal, key: int, rank: int) -> None:
    """Write down that ``key`` is re-sorted in class ``rank`` (its pin ends at another time)."""
    calls = journal.get(rank)
    if calls is None:
        journal[rank] = [(ACCESS, key)]
    else:
        calls.append((ACCESS, key))


@cache
def _alone(shared: bool, reuse: str | None, distance: int) -> tuple[int, int]:
    """The class of an unprotected key whose tag names one agent, ``distance`` steps
    away (:data:`FAR`: none), without and with a TTL."""
    if reuse == "never":
        return NEVER, NEVER
    plain = keep_rank(FAR - 1 if distance >= FAR and reuse == "likely" else distance, shared)
    # A shared prefix's pin ends when its last user is due, but it is due when its
    # first one is: it ranks as a shared prefix, above every wait.
    return plain, plain if shared else WAITING


def group_by(keys: Sequence[int], ranks: list[int]) -> list[tuple[int, list[int]]]:
    """``keys`` grouped by their ``ranks`` (order kept within each), in order of first key.

    A chain's keys come in runs of one class (a shared prefix, then a session's
    own blocks), so the runs are found at C speed and each run is one slice.
    """
    first = ranks[0]
    n = len(ranks)
    if ranks.count(first) == n:
        return [(first, list(keys))]
    ends = list(compress(range(1, n), map(ne, ranks, islice(ranks, 1, None))))
    ends.append(n)
    groups: dict[int, list[int]] = {}
    start = 0
    for end in ends:
        rank = ranks[start]
        group = groups.get(rank)
        if group is None:
            groups[rank] = list(keys[start:end])
        else:
            group.extend(keys[start:end])
        start = end
    return list(groups.items())


class RankClasses:
    """One eviction order per rank, and the class of every resident key outside the default."""

    _classes: dict[int, EvictionPolicy]
    #: The classes' ranks, lowest first (a class, once made, stays).
    _ranks: list[int]
    #: Resident keys outside the default class, and their class.
    _class_of: dict[int, int]
    _pinned: set[int]
    _tags: OrderedDict[int, Tag]
    _expiry: dict[int, float]
    _depth_of: dict[int, int]
    _protected: dict[int, tuple[float, int]]
    _global: EvictionPolicy
    _size_table: dict[int, int] | None
    _by_agent: dict[Owner, dict[int, None]]
    _by_workflow: dict[str, dict[str, None]]
    #: The spec whose agent prefixes were tagged, per workflow.
    _tagged: dict[str, object]
    #: workflow -> its agents' distances, as the tracker last gave them; a
    #: workflow's entry goes whenever the tracker says it changed.
    _dists: dict[str, dict[str, int]]
    _listening: bool
    tracker: WorkflowTracker
    guard: LRUGuard | None
    capacity: int
    key_capacity: int

    if TYPE_CHECKING:

        def _new_fallback(self) -> EvictionPolicy: ...

        def _depth(self, key: int) -> int: ...

        def _tag_keys(
            self,
            keys: Sequence[int],
            owner: Owner | None,
            session: str | None,
            *,
            shared: bool = False,
            reuse: str | None = None,
            depths: Iterable[int] | None = None,
        ) -> None: ...

    def _cls(self, rank: int) -> EvictionPolicy:
        c = self._classes.get(rank)
        if c is None:
            if rank == DEFAULT:
                c = self._new_fallback()
            else:
                # Hint-ranked classes order their keys themselves: by when a pin
                # ends, or by request recency with a chain's tail first.
                c = (
                    ByReturn(self._expiry, self._depth_of)
                    if rank >= WAITING and rank in TIMED
                    else TailFirstLRU()
                )
                if self.capacity:
                    c.bind(self.capacity, max(1, self.capacity // max(self.key_capacity, 1)))
            self._classes[rank] = c
            bisect.insort(self._ranks, rank)
        return c

    def _rank_of(self, key: int) -> int:
        return self._class_of.get(key, DEFAULT)

    def _rank(self, key: int) -> int:
        """The class ``key`` belongs in now: its tag, its pin, its agents' distances."""
        tag = self._tags.get(key)
        if key in self._protected:
            return PINNED_SHARED if tag is not None and tag.shared else PINNED
        return self._tag_rank(tag, key in self._expiry)

    def _tag_rank(self, tag: Tag | None, ttl: bool) -> int:
        """The class of an unprotected key tagged ``tag``; ``ttl``: a TTL pins it."""
        if tag is None:
            return WAITING if ttl else DEFAULT
        owners = tag.owners
        if not owners:
            return _alone(tag.shared, tag.reuse, FAR)[ttl]
        reuse = tag.reuse
        if reuse == "never":
            return NEVER
        if ttl and not tag.shared:
            return WAITING
        d = FAR
        dists = self._dists
        for wid, aid in owners:
            table = dists.get(wid)
            if table is None:
                table = self._distances(wid)
            x = table.get(aid, FAR)
            if x < d:
                d = x
        if d >= FAR and reuse == "likely":
            d = FAR - 1
        # keep_rank, inline: this runs for every hinted block a request touches.
        if d < 0:
            d = 0
        return (SHARED if tag.shared else DYNAMIC) + (FAR - d)

    def _ranks_of(self, keys: Sequence[int]) -> list[int]:
        """:meth:`_rank` of each of ``keys``, looking at each distinct tag once."""
        found = list(map(self._tags.get, keys))
        tag_rank = self._tag_rank
        of_tag = {
            t: _alone(t.shared, t.reuse, FAR)
            if t is not None and not t.owners
            else (tag_rank(t, False), tag_rank(t, True))
            for t in set(found)
        }
        protected = self._protected
        expiry = self._expiry
        return [
            (PINNED_SHARED if t is not None and t.shared else PINNED)
            if k in protected
            else of_tag[t][k in expiry]
            for k, t in zip(keys, found, strict=True)
        ]

    def _distances(self, workflow_id: str) -> dict[str, int]:
        """The workflow's agents' steps-to-execution, kept until the tracker says it changed."""
        state = self.tracker.get(workflow_id)
        table = state.distances() if state is not None else {}
        if self._listening:
            self._dists[workflow_id] = table
        return table

    def _size(self, key: int) -> int:
        table = self._size_table
        if table is not None:
            return table.get(key, 1) if table else 1
        g = self._global
        return g.size_of(key) if isinstance(g, PolicyBase) else 1

    def _move(self, key: int) -> None:
        """Put a resident key in the class it belongs in now."""
        old = self._class_of.get(key, DEFAULT)
        new = self._rank(key)
        if new != old:
            self._shift(key, old, new)

    def _shift(self, key: int, old: int, new: int) -> None:
        """Move a resident key from class ``old`` to class ``new`` (its newest entry there)."""
        table = self._size_table
        size = self._size(key) if table is None else table.get(key, 1) if table else 1
        classes = self._classes
        classes[old].remove(key)
        c = classes.get(new)
        if c is None:
            c = self._cls(new)
        c.insert(key, key in self._pinned, size)
        self._relabel(key, new)

    def _relabel(self, key: int, rank: int) -> None:
        """Say that ``key`` is in class ``rank`` now."""
        if rank == DEFAULT:
            del self._class_of[key]
        else:
            self._class_of[key] = rank

    def _move_many(self, keys: list[int]) -> None:
        """:meth:`_move` of each of ``keys`` in turn, a key named twice moved the first time.

        For keys whose rank inputs were settled before any of them moves (each
        key's own, so its rank now is the one it had when its turn came).
        """
        if not keys:
            return
        if len(keys) > 1:
            keys = list(dict.fromkeys(keys))
        olds = map(self._class_of.get, keys, repeat(DEFAULT))
        news = self._ranks_of(keys)
        journal: Journal = {}
        relabel = self._relabel
        for key, old, new in zip(keys, olds, news, strict=True):
            if old != new:
                moved(journal, key, old, new)
                relabel(key, new)
        self._replay(journal)

    def _replay(self, journal: Journal) -> None:
        """Make the class calls ``journal`` names (``_class_of`` names each key's last
        class already).

        Classes are independent of one another, so each takes its own calls in
        one go, in their order; the hint-ranked classes of keys of size 1 settle
        them at once (a key re-sorted twice is pushed once, with the later turn).
        """
        classes = self._classes
        pinned = self._pinned
        table = self._size_table
        ones = table is not None and not table
        for rank, todo in journal.items():
            c = classes.get(rank)
            if c is None:
                c = self._cls(rank)
            if ones and isinstance(c, ByReturn | TailFirstLRU):
                c.replay(todo, pinned)
                continue
            for kind, key in todo:
                if kind == ACCESS:
                    c.access(key)
                elif kind == REMOVE:
                    c.remove(key)
                else:
                    size = self._size(key) if table is None else table.get(key, 1) if table else 1
                    c.insert(key, key in pinned, size)

    def _on_workflow(self, workflow_id: str) -> None:
        """The tracker says ``workflow_id`` changed: tag its prefixes, re-rank its blocks."""
        # The distances its blocks were ranked by (None: not known).
        previous = self._dists.pop(workflow_id, None)
        state = self.tracker.get(workflow_id)
        if state is None:
            self._tagged.pop(workflow_id, None)
        elif self._tagged.get(workflow_id) is not state.spec:
            # Registered or replaced: tag its prefixes once (progress does not change them).
            self._tagged[workflow_id] = state.spec
            for a in state.spec.agents:
                if a.prefix_keys:
                    self._tag_keys(a.prefix_keys, (workflow_id, a.agent_id), None, shared=True)
        self._rerank_workflow(workflow_id, previous)

    def _rerank_workflow(self, workflow_id: str, previous: dict[str, int] | None) -> None:
        """Move the workflow's resident blocks to the classes its distances now give them,
        each agent's tail first; ``previous``: the distances they were ranked by.

        An agent whose distance did not change keeps its blocks where they are,
        unless another agent owns one of them too. The keys of one agent are
        ranked once per distinct tag, and leave and join their classes together.
        """
        agents = self._by_workflow.get(workflow_id)
        if not agents:
            return
        dists = self._dists.get(workflow_id)
        if dists is None:
            dists = self._distances(workflow_id)
        rank = self._rank
        shift = self._shift
        classes = self._classes
        class_of = self._class_of
        by_agent = self._by_agent
        tags = self._tags
        protected = self._protected
        expiry = self._expiry
        table = self._size_table
        # Keys of size 1 bound for a hint-ranked LRU class join it together at the
        # end, each class's in the order visited (their order there either way).
        batch = table is not None and not table
        joining: dict[int, list[int]] = {}
        for aid in list(agents):
            owner = (workflow_id, aid)
            held = by_agent.get(owner)
            if not held:
                continue
            distance = dists.get(aid, FAR)
            # Tail first: the class then evicts the chain's tail first, as it would have.
            keys = list(reversed(held))
            found = list(map(tags.get, keys))
            distinct = set(found)
            alone = {t for t in distinct if t is not None and t.owners == [owner]}
            if (
                previous is not None
                and previous.get(aid, FAR) == distance
                and len(alone) == len(distinct)
            ):
                continue  # every key's rank reads this agent's distance alone: none moves
            # _rank for the keys of this agent alone, once per tag (its distance read once).
            of_tag = {t: _alone(t.shared, t.reuse, distance) for t in alone}
            news = [
                of_tag[t][k in expiry] if t in of_tag and k not in protected else rank(k)
                for k, t in zip(keys, found, strict=True)
            ]
            olds = list(map(class_of.get, keys, repeat(DEFAULT)))
            at = list(compress(range(len(keys)), map(ne, olds, news)))
            if not at:
                continue
            if not batch:
                for i in at:
                    shift(keys[i], olds[i], news[i])
                continue
            joins = []
            for i in at:
                new = news[i]
                if new == DEFAULT or new in TIMED:
                    shift(keys[i], olds[i], new)
                else:
                    joins.append(i)
            if not joins:
                continue
            keys = [keys[i] for i in joins]
            news = [news[i] for i in joins]
            for old, group in group_by(keys, [olds[i] for i in joins]):
                deque(map(classes[old].remove, group), maxlen=0)
            class_of.update(zip(keys, news, strict=True))
            for new, group in group_by(keys, news):
                waiting = joining.get(new)
                if waiting is None:
                    joining[new] = group
                else:
                    waiting.extend(group)
        pinned = self._pinned
        for new, group in joining.items():
            c = classes.get(new)
            if c is None:
                c = self._cls(new)
            if isinstance(c, TailFirstLRU):
                c.join(group, pinned)
            else:
                for key in group:
                    c.insert(key, key in pinned)

    def _lowest_evictable(self) -> int | None:
        classes = self._classes
        for rank in self._ranks:
            if classes[rank].num_evictable:
                return rank
        return None

    def _by_class(self, keys: Sequence[int]) -> list[tuple[EvictionPolicy, Sequence[int]]]:
        """``keys`` grouped by class (order kept within each), classes in order of first key."""
        classes = self._classes
        class_of = self._class_of
        if not class_of:
            return [(classes[DEFAULT], keys)]
        if not keys:
            return []
        groups = group_by(keys, list(map(class_of.get, keys, repeat(DEFAULT))))
        if len(groups) == 1:
            return [(classes[groups[0][0]], keys)]  # one class: the usual case
        return [(classes[rank], group) for rank, group in groups]

    def evictable_due_after(self, distance: int) -> int:
        """Evictable size units of blocks due later than ``distance`` steps (or never).

        What a prefetch for an agent ``distance`` steps away may evict without
        evicting anything due sooner. 0 while the guard has eviction in
        recency order (then no class order holds).
        """
        if self.guard is not None and self.guard.recency:
            return 0
        # Due later: dynamic suffixes and shared prefixes alike, never the pinned.
        dynamic = keep_rank(distance, False)
        shared_from, shared_to = keep_rank(FAR, True), keep_rank(distance, True)
        total = 0
        for rank, c in self._classes.items():
            later = rank < dynamic or shared_from <= rank < shared_to
            if later and c.num_evictable:
                total += c.used - c.pinned_used if isinstance(c, PolicyBase) else c.num_evictable
        return total

    def rank_of(self, key: int) -> int:
        """The class a resident key is in (:data:`DEFAULT` without hints)."""
        return self._rank_of(key)
