"""The workflow policy's TTL pins: set, capped, released and expired.

:class:`TtlPins` is the part of :class:`~kvtier.agents.policy.WorkflowPolicy`
that pins a request's blocks until its session is due back
(``cache_ttl_s``), protects the pins within the cap (the latest pins yield
past it), and expires them on time; the two orders it keeps over its pins
are in :mod:`kvtier.agents.queues`.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import compress, islice, repeat
from operator import lt, neg
from typing import TYPE_CHECKING

from kvtier.agents.classes import Journal, moved, resorted
from kvtier.agents.queues import AFTER, EndQueue, LatestPins, Pair, successive
from kvtier.agents.ranks import DEFAULT, TIMED
from kvtier.agents.sessions import Session
from kvtier.agents.tags import Tag
from kvtier.policy.base import EvictionPolicy


class TtlPins:
    """The workflow policy's TTL pins: set, capped, released and expired.

    ``cache_ttl_s`` pins a request's blocks until the owner's clock reaches
    the pin's end (expiry is by time). Pinned blocks are evicted last, but
    never more than ``pin_fraction`` of the capacity is protected: past the
    cap the pins that end latest yield and their keys wait, ranked by when
    they are due. A pin that runs out keeps ranking its key by its end for as
    long again (the key is overdue), then lets it go.
    """

    _tags: OrderedDict[int, Tag]
    #: Each tagged key's position in its chain.
    _depth_of: dict[int, int]
    #: Every resident key.
    _resident: set[int]
    _classes: dict[int, EvictionPolicy]
    _class_of: dict[int, int]
    _size_table: dict[int, int] | None
    #: TTL pins: key -> when its pin ends.
    _expiry: dict[int, float]
    #: Keys whose pin ran out and that still wait, ranked by their end, until the
    #: deadline given (see :meth:`pin_for`); and each pin's deadline.
    _overdue: dict[int, float]
    _late: dict[int, float]
    _ends: EndQueue
    #: Keys protected now: key -> (end, size).
    _protected: dict[int, tuple[float, int]]
    #: Protected keys, latest end first; entries whose end no longer matches
    #: the key's protection are stale and skipped.
    _latest: LatestPins
    _protected_used: int
    #: Resident keys whose depth changed since they joined (first tagged while
    #: resident): their entry in the order of protections may carry the old one
    #: until a rebuild, so when a rebuild happens matters while there are any.
    _redepth: set[int]
    #: Ended sessions' own keys, for the tiers to free (when ``collect_released``).
    _released: list[int]
    collect_released: bool
    _now: float
    pin_fraction: float
    capacity: int
    clock: Callable[[], float] | None

    if TYPE_CHECKING:

        def _move(self, key: int) -> None: ...

        def _shift(self, key: int, old: int, new: int) -> None: ...

        def _rank(self, key: int) -> int: ...

        def _size(self, key: int) -> int: ...

        def _depth(self, key: int) -> int: ...

        def _never_reused(self, key: int, tag: Tag, memo: dict[Tag, Tag]) -> None: ...

        def _ranks_of(self, keys: Sequence[int]) -> list[int]: ...

        def _move_many(self, keys: list[int]) -> None: ...

        def _replay(self, journal: Journal) -> None: ...

        def _relabel(self, key: int, rank: int) -> None: ...

    @property
    def pin_cap(self) -> int:
        """Size units TTL pins may protect at most."""
        return int(self.pin_fraction * self.capacity)

    @property
    def protected_used(self) -> int:
        """Size units TTL pins protect now."""
        return self._protected_used

    def pin_ends(self, keys: Sequence[int]) -> dict[int, float]:
        """Of ``keys``, those pinned until later than now, with when their pin ends.

        Resident or not: a pinned block the device evicted keeps its pin, and
        the tiers below carry it (:class:`~kvtier.policy.base.PinSource`).
        Protected or waiting past the cap alike. Changes nothing.
        """
        expiry = self._expiry
        if not expiry:
            return {}
        now = self._now if self.clock is None else max(self.clock(), self._now)
        get = expiry.get
        return {k: u for k in keys if (u := get(k, now)) > now}

    def resident_pins(self) -> dict[int, float]:
        """The pins of resident keys that end later than now (key -> end), protected or
        waiting past the cap alike."""
        expiry = self._expiry
        if not expiry:
            return {}
        now = self._now if self.clock is None else max(self.clock(), self._now)
        resident = self._resident
        return {k: u for k, u in expiry.items() if u > now and k in resident}

    def pin_for(self, keys: Iterable[int], until: float, replacing: float | None = None) -> None:
        """Protect ``keys`` until ``until`` (the owner's clock); past the cap, latest pins go.

        A pin only ever lengthens, except that ``replacing`` names an earlier
        pin of the same owner that this one supersedes: keys pinned until
        exactly then, and used by no one else, take the new end even if it is
        sooner (a session back early, due again soon).
        """
        expiry = self._expiry
        get = expiry.get
        # The keys whose pin changes: any pinned until sooner (or not at all), and
        # with ``replacing`` later than ``until``, the owner's own keys pinned until
        # exactly then (a shared key's pin only ever lengthens).
        if replacing is None or replacing <= until:
            changed = [k for k in keys if get(k, -1.0) < until]
        else:
            tag_of = self._tags.get
            changed = [
                k
                for k in keys
                if (old := get(k, -1.0)) < until
                or (old == replacing and (t := tag_of(k)) is not None and not t.shared)
            ]
        if not changed:
            return
        # Past its end a pin still ranks its key by when it was due, for as long
        # again: a session seldom comes back exactly on time, and one that is late
        # is due any moment (one that never comes back is dropped after that).
        late = until + max(until - self._now, 0.0)
        expiry.update(zip(changed, repeat(until)))
        overdue = self._overdue
        if overdue:
            for key in overdue.keys() & changed:
                del overdue[key]
        self._late.update(zip(changed, repeat(late)))
        neg_depths = list(map(neg, map(self._depth_of.get, changed, repeat(0))))
        resident = self._resident
        held = list(compress(range(len(changed)), map(resident.__contains__, changed)))
        if held:
            self._repin(changed, neg_depths, held, until)
        self._ends.push(until, list(zip(neg_depths, changed, strict=True)))

    def _repin(self, keys: list[int], neg_depths: list[int], at: list[int], until: float) -> None:
        """The resident ``keys[i]`` for ``i`` in ``at``, pinned until ``until`` now: protect
        them (or move their protection), and re-sort those their class orders by pin end.

        Protections are settled key after key as :meth:`_pin_state` would; the
        class calls that go with them (a key that changes class, a key re-sorted)
        are written down in turn and carried out together at the end, since
        nothing here reads the classes' orders (``_class_of`` is kept current).
        """
        class_of = self._class_of
        protected = self._protected
        latest = self._latest
        now = self._now
        ahead = until > now
        table = self._size_table
        cap = int(self.pin_fraction * self.capacity)  # pin_cap
        used = self._protected_used
        journal: Journal = {}
        # Protected keys whose pin only moves, pushed as one batch before anything
        # else reads the order of protections.
        moved: list[Pair] = []
        for i in at:
            key = keys[i]
            size = self._size(key) if table is None else table.get(key, 1) if table else 1
            if key in protected:
                if ahead:
                    # A key protected already (a session's every turn re-pins its
                    # whole chain): the pin only moves.
                    protected[key] = (until, size)
                    moved.append((neg_depths[i], key))
                    rank = class_of.get(key, DEFAULT)
                    if rank in TIMED:
                        resorted(journal, key, rank)  # its pin ends at another time now
                    continue
                # Pinned until the past: its protection stays as it was.
                rank = class_of.get(key, DEFAULT)
            elif ahead:
                if moved:
                    latest.push_many(until, moved)
                    moved = []
                # _pin_state, inline: past the cap the pin that ends latest yields.
                if size <= cap:
                    while used + size > cap:
                        end, victim = self._latest_pin()
                        if end < until:
                            break  # every current pin ends sooner than this one: it waits
                        latest.pop()
                        used -= protected.pop(victim)[1]
                        self._rerank(victim, journal)
                    else:
                        protected[key] = (until, size)
                        latest.push(until, neg_depths[i], key)
                        used += size
                        if latest.size > 4 * len(protected) + 64:
                            self._rebuild_latest()
                rank = self._rerank(key, journal)
            else:
                rank = class_of.get(key, DEFAULT)
            if rank in TIMED:
                resorted(journal, key, rank)  # its pin ends at another time now: re-sort it
        if moved:
            latest.push_many(until, moved)
        self._protected_used = used
        self._replay(journal)

    def _rerank(self, key: int, journal: Journal) -> int:
        """Write down ``key``'s move to the class it ranks in now, if another; that class."""
        was = self._class_of.get(key, DEFAULT)
        rank = self._rank(key)
        if rank != was:
            moved(journal, key, was, rank)
            self._relabel(key, rank)
        return rank

    def _protect(self, key: int, until: float) -> None:
        if self._pin_state(key, until):
            self._move(key)

    def _pin_state(self, key: int, until: float) -> bool:
        """Protect a resident ``key`` until ``until`` if the cap allows (latest pins yield).

        Every other key whose protection changes is moved to its class here;
        ``key`` itself is not: returns whether its class may have changed.
        """
        if until <= self._now:
            return False
        protected = self._protected
        table = self._size_table
        size = self._size(key) if table is None else table.get(key, 1) if table else 1
        latest = self._latest
        neg_depth = -self._depth_of.get(key, 0)
        if key in protected:
            protected[key] = (until, size)
            latest.push(until, neg_depth, key)
            return False
        cap = int(self.pin_fraction * self.capacity)  # pin_cap
        if size > cap:
            return True
        class_of = self._class_of
        rank_of = self._rank
        while self._protected_used + size > cap:
            # The pin that ends latest yields: a TTL is when the session is due back,
            # and MIN keeps what is needed soonest.
            end, victim = self._latest_pin()
            if end < until:
                # Every current pin ends sooner than this one: it waits past the cap.
                return True
            latest.pop()
            # _unprotect, inline (the victim is protected, so resident).
            self._protected_used -= protected.pop(victim)[1]
            was = class_of.get(victim, DEFAULT)
            rank = rank_of(victim)
            if rank != was:
                self._shift(victim, was, rank)
        protected[key] = (until, size)
        latest.push(until, neg_depth, key)
        self._protected_used += size
        if latest.size > 4 * len(protected) + 64:
            self._rebuild_latest()
        return True

    def _latest_pin(self) -> tuple[float, int]:
        """``(end, key)`` of the protection that ends latest, its entry first in the order
        (stale entries before it go); there must be one."""
        latest = self._latest
        protected = self._protected
        while True:
            end, key = latest.top()
            entry = protected.get(key)
            if entry is not None and entry[0] == end:
                return end, key
            latest.pop()  # stale

    def _rebuild_latest(self) -> None:
        """The order of protections without its stale entries, each key at its depth now."""
        depth = self._depth_of.get
        self._latest.rebuild((u, -depth(k, 0), k) for k, (u, _) in self._protected.items())
        # Every entry has the depth its key has now.
        self._redepth.clear()

    def _protect_new(self, keys: list[int]) -> None:
        """:meth:`_pin_state` for each of ``keys`` that is pinned until later than now, in
        turn: keys of size 1 just inserted, in no class yet (the caller places them).

        Keys of other requests that yield move to their classes once every key
        had its turn: nothing reads the classes before, and each yields once.
        """
        now = self._now
        cap = int(self.pin_fraction * self.capacity)  # pin_cap
        if cap < 1:
            return
        untils = list(map(self._expiry.get, keys, repeat(now)))
        mask = list(map(partial(lt, now), untils))
        run = list(compress(keys, mask))
        if not run:
            return
        ends = set(compress(untils, mask))
        nds = list(map(neg, map(self._depth_of.get, run, repeat(0))))
        if len(ends) == 1 and (
            all(map(int.__lt__, nds, islice(nds, 1, None)))
            or all(map(tuple.__lt__, *successive(list(zip(nds, run, strict=True)))))
        ):
            yielded = self._protect_run(run, nds, ends.pop())
        else:
            yielded = self._protect_each(run)
        if yielded:
            self._move_many(yielded)
        if self._latest.size > 4 * len(self._protected) + 64:
            self._rebuild_latest()

    def _protect_run(self, run: list[int], nds: list[int], until: float) -> list[int]:
        """:meth:`_protect_each` for keys pinned until the same ``until``, in ascending
        ``(-depth, key)`` order (a chain, tail first: the usual batch).

        The batch's protected keys then leave in the order they came (each the
        first of them in the order of protections), so they are a queue:
        ``run[lo:i]`` are protected. A key's turn is a comparison with the first
        other protection, which is looked up again only once it yielded; while
        there is room, or while every other protection ends sooner (each key then
        takes the place of the batch's first), the keys take their turns at once.
        """
        cap = int(self.pin_fraction * self.capacity)
        protected = self._protected
        latest = self._latest
        order = latest._heap
        used = self._protected_used
        yielded: list[int] = []
        lo = 0
        # The first valid protection of another request, (-end, -depth, key, ...).
        head: tuple[float, int, int, int, list[Pair]] | None = None
        n = len(run)
        i = 0
        while i < n:
            if used < cap:
                take = min(cap - used, n - i)
                used += take
                i += take
                continue
            if head is None:
                while order:
                    top = order[0]
                    entry = protected.get(top[2])
                    # A key of the batch has no protection yet: any entry of its
                    # is stale (or the same as the one it has in the queue).
                    if entry is not None and entry[0] == -top[0]:
                        head = top
                        break
                    latest.pop()  # stale
            if lo < i:
                if head is None or -head[0] < until:
                    lo += n - i  # each key in turn takes the batch's first one's place
                    i = n
                    break
                if -head[0] == until and (nds[lo], run[lo]) < head[1:3]:
                    lo += 1  # the batch's first protected key yields to this one
                    i += 1
                    continue
            if head is None or -head[0] < until:
                break  # every current pin ends sooner: this key and the rest wait
            latest.pop()
            victim = head[2]
            head = None
            used -= protected.pop(victim)[1]
            yielded.append(victim)
        self._protected_used = used
        if lo < i:
            stay = run[lo:i]
            protected.update(zip(stay, repeat((until, 1))))
            latest.push_many(until, list(zip(nds[lo:i], stay, strict=True)))
        return yielded

    def _protect_each(self, keys: list[int]) -> list[int]:
        """:meth:`_protect_new` one key after another; returns the keys of other
        requests that yielded, in turn.

        Those protected wait in a heap of their own, ``(-until, -depth, key)``, and
        join the order of protections at the end: the pin that yields is always
        the first of both orders, as with one order. A key of the batch that
        yields needs no move (it has no class yet).
        """
        now = self._now
        cap = int(self.pin_fraction * self.capacity)  # pin_cap
        expiry_get = self._expiry.get
        depth_get = self._depth_of.get
        protected = self._protected
        latest = self._latest
        order = latest._heap
        pending = set(keys)
        # Keys of other requests that yielded, in turn: they move once the batch is
        # done (nothing reads the classes before, and each yields once).
        yielded: list[int] = []
        # (-until, -depth, key, AFTER): the entry's key sorts after the same one in
        # the order of protections, as it would had it been pushed there.
        fresh: list[tuple[float, int, int, int]] = []
        used = self._protected_used
        pop = heapq.heappop
        # Keys pinned until this or later wait: one did, and nothing changed since.
        waits = math.inf
        for key in keys:
            until = expiry_get(key)
            if until is None or until <= now or cap < 1 or until >= waits:
                continue
            while used >= cap:
                # The pin that ends latest yields (see _pin_state), from either order.
                while order:
                    head = order[0]
                    entry = protected.get(head[2])
                    if entry is not None and entry[0] == -head[0]:
                        break
                    latest.pop()  # stale
                while fresh:
                    first = fresh[0]
                    entry = protected.get(first[2])
                    if entry is not None and entry[0] == -first[0]:
                        break
                    pop(fresh)  # stale
                if fresh and (not order or fresh[0] < order[0][:4]):
                    end, victim = -fresh[0][0], fresh[0][2]
                    if end < until:
                        waits = until  # every current pin ends sooner than this one
                        break
                    pop(fresh)
                elif order:
                    end, victim = -order[0][0], order[0][2]
                    if end < until:
                        waits = until
                        break
                    latest.pop()
                else:
                    waits = until
                    break
                used -= protected.pop(victim)[1]
                if victim not in pending:
                    yielded.append(victim)
            else:
                protected[key] = (until, 1)
                used += 1
                heapq.heappush(fresh, (-until, -depth_get(key, 0), key, AFTER))
                waits = math.inf
        self._protected_used = used
        # The batch's protections that stand join the order, one batch per end.
        ends: dict[float, list[Pair]] = {}
        for neg_until, neg_depth, key, _ in fresh:
            entry = protected.get(key)
            if entry is not None and entry[0] == -neg_until:
                ends.setdefault(-neg_until, []).append((neg_depth, key))
        for until, pairs in ends.items():
            latest.push_many(until, pairs)
        return yielded

    def _unprotect(self, key: int) -> None:
        entry = self._protected.pop(key, None)
        if entry is None:
            return
        self._protected_used -= entry[1]
        if key in self._resident:
            self._move(key)

    def expire(self, now: float) -> int:
        """Drop the TTL pins that ran out by ``now``; returns how many keys lost theirs."""
        if now > self._now:
            self._now = now
        now = self._now
        ends = self._ends
        n = 0
        expiry = self._expiry
        overdue = self._overdue
        late_of = self._late
        protected = self._protected
        resident = self._resident
        ex_get = expiry.get
        od_get = overdue.get
        depth_of = self._depth_of
        while True:
            due = ends.pop_due(now)
            if due is None:
                break
            until, pairs = due
            # Most pairs are stale (a session's next turn re-pinned its chain): only a
            # key whose pin or overdue deadline ends now is looked at further, in the
            # (-depth, key) order of the end's pairs.
            live = [p for p in pairs if ex_get(p[1]) == until or od_get(p[1]) == until]
            live.sort()
            # Keys going overdue, by deadline: one queue entry per deadline (the
            # queue merges the entries of one end and sorts their keys anyway).
            late_ends: dict[float, list[Pair]] = {}
            moves: list[int] = []
            for _, key in live:
                if od_get(key) == until:
                    # Late for as long as it was pinned: not coming back.
                    del overdue[key]
                    del expiry[key]
                    if key in resident:
                        moves.append(key)
                    continue
                if ex_get(key) != until or key in overdue:
                    continue  # stale
                late = late_of.pop(key, until)
                if late > until:
                    overdue[key] = late
                    pair = (-depth_of.get(key, 0), key)
                    group = late_ends.get(late)
                    if group is None:
                        late_ends[late] = [pair]
                    else:
                        group.append(pair)
                else:
                    del expiry[key]
                entry = protected.pop(key, None)
                if entry is not None:
                    # _unprotect, inline (a protected key is resident).
                    self._protected_used -= entry[1]
                    n += 1
                    moves.append(key)
                elif key in resident:
                    moves.append(key)
            # Nothing above reads the classes: the keys move together, in turn.
            self._move_many(moves)
            for late, group in late_ends.items():
                ends.push(late, group)
        return n

    def _tick(self) -> None:
        if self.clock is not None and self._ends:
            self.expire(self.clock())

    def _release(self, keys: Sequence[int], until: float) -> None:
        """End the pins a session set until ``until`` on its own ``keys`` (chain order)."""
        expiry = self._expiry
        tags = self._tags
        resident = self._resident
        protected = self._protected
        moves: list[int] = []
        for key in reversed(keys):
            if expiry.get(key) != until:
                continue  # pinned later by someone else
            tag = tags.get(key)
            if tag is not None and tag.shared:
                continue
            del expiry[key]
            self._overdue.pop(key, None)
            self._late.pop(key, None)
            entry = protected.pop(key, None)
            if entry is not None:
                self._protected_used -= entry[1]
                moves.append(key)
            elif key in resident:
                moves.append(key)
        self._move_many(moves)

    def _end(self, rec: Session) -> None:
        """Release an ended session's pins; its own blocks are never reused."""
        tags = self._tags
        resident = self._resident
        protected = self._protected
        memo: dict[Tag, Tag] = {}
        moves: list[int] = []
        for key in reversed(rec.keys):
            self._overdue.pop(key, None)
            self._late.pop(key, None)
            if self._expiry.pop(key, None) is not None:
                entry = protected.pop(key, None)
                if entry is not None:
                    self._protected_used -= entry[1]
            tag = tags.get(key)
            if tag is not None and not tag.shared:
                if tag.reuse != "never":
                    self._never_reused(key, tag, memo)
                if self.collect_released:
                    self._released.append(key)
            if key in resident:
                moves.append(key)
        self._move_many(moves)
