"""Workflow-aware eviction: blocks needed soonest are evicted last.

:class:`WorkflowPolicy` (registered as ``"workflow"``) ranks each resident
block by what the application's hints say about it and breaks ties with a
fallback policy (LRU by default, any registered policy by name):

* a block belongs to the agents whose requests used it (learned from the
  hints ``workflow_id``/``agent_id`` each request carries, and from the
  agents' registered prompt prefixes); its distance is the smallest
  steps-to-execution among them (:mod:`kvtier.agents.graph`), infinitely far
  for blocks of no known agent;
* dynamic suffixes (blocks one agent or session used) go before shared
  prefixes (an agent's registered prefix, or a block two agents or sessions
  used), and within each, the blocks of the agent due farthest go first;
  ``reuse="never"`` blocks go first of all and ``reuse="likely"`` ones just
  after the unknown ones;
* ``cache_ttl_s`` pins a request's blocks until the TTL runs out (counted from
  when the request finishes; expiry is by time, checked on every call that
  tells the policy the time, without waiting for memory pressure). Pinned
  blocks are evicted last, but never more than ``pin_fraction`` of the
  capacity is pinned: past the cap, the pins that end latest are dropped (a
  TTL says when the session is due back, and MIN keeps what is due soonest),
  so hints can never starve the cache. They stay evictable in the owner's
  sense (an owner that must have room still gets it);
* a block of an agent due later than every resident block is not admitted
  when the level is full (MIN's bypass: caching it would evict something
  needed sooner).

Each class keeps its own instance of the fallback, and one more instance
holds every key in the fallback's global order. While no resident block has
a hint-derived rank, every decision (victims, admission) is the global
instance's, so without hints this policy *is* its fallback, decision for
decision. An :class:`~kvtier.policy.guard.LRUGuard` watches a sampled LRU
shadow: when hints make the cache clearly worse than recency would (stale or
wrong hints), victims come from the fallback's global order until a later
probe shows the hints helping again.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, ClassVar

from kvtier.agents.graph import FAR
from kvtier.agents.ranks import (
    DEFAULT,
    DYNAMIC,
    MAX_OWNERS,
    NEVER,
    PINNED,
    SHARED,
    TIMED,
    WAITING,
    ByReturn,
    TailFirstLRU,
    keep_rank,
)
from kvtier.agents.sessions import Session, SessionBook
from kvtier.agents.tracker import WorkflowTracker
from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.hints import Hints, parse_hints
from kvtier.policy.admission import with_admission
from kvtier.policy.base import EvictionPolicy, PolicyBase, request_hook
from kvtier.policy.guard import LRUGuard
from kvtier.policy.registry import make_policy, register_policy


@dataclass(slots=True)
class _Tag:
    """What the hints said about one key."""

    owners: list[tuple[str, str]] = field(default_factory=list)
    session: str | None = None
    shared: bool = False
    reuse: str | None = None
    #: The key's position in its chain (fixed: keys are chained to their prefix).
    depth: int = 0


class WorkflowPolicy(PolicyBase):
    """Evict blocks of the agents due latest first (see the module docstring).

    ``fallback`` names the policy that orders ties (and everything, without
    hints); ``tracker`` is the :class:`WorkflowTracker` to rank by (a new,
    empty one by default; an engine shares its own). ``pin_fraction`` caps
    TTL-pinned size units as a share of the capacity; ``history`` is how many
    keys' hints are remembered, as a multiple of the key capacity;
    ``clock`` (seconds) lets evictions expire pins on time even between
    requests; ``guard`` turns the LRU guard off when False.
    """

    name: ClassVar[str] = "workflow"

    def __init__(
        self,
        fallback: str = "lru",
        *,
        tracker: WorkflowTracker | None = None,
        pin_fraction: float = 0.5,
        history: int = 4,
        clock: Callable[[], float] | None = None,
        guard: bool = True,
        fallback_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(fallback, str) or fallback.lower() == self.name:
            raise ConfigError(
                f"the workflow policy's fallback must be another policy, got {fallback!r}"
            )
        if not 0.0 <= pin_fraction <= 1.0:
            raise ConfigError(f"pin_fraction must be in [0, 1], got {pin_fraction}")
        if history < 1:
            raise ConfigError(f"history must be at least 1, got {history}")
        self.fallback = fallback
        self._fallback_kwargs = dict(fallback_kwargs or {})
        self.tracker = tracker if tracker is not None else WorkflowTracker()
        self.pin_fraction = pin_fraction
        self.clock = clock
        self._history_factor = history
        self._use_guard = guard
        self._global: EvictionPolicy = self._new_fallback()
        self._fallback_hook = request_hook(self._global)
        g = self._global
        #: The global instance's size table when sizes are read from it directly
        #: (the common case: a PolicyBase that does not redefine size_of).
        self._size_table: dict[int, int] | None = (
            g._sizes
            if isinstance(g, PolicyBase) and type(g).size_of is PolicyBase.size_of
            else None
        )
        # The global instance records every size; share its table (evict_for reads it).
        self._sizes = getattr(self._global, "_sizes", self._sizes)
        self._classes: dict[int, EvictionPolicy] = {}
        #: Resident keys outside the default class, and their class.
        self._class_of: dict[int, int] = {}
        self._pinned: set[int] = set()
        self._tags: OrderedDict[int, _Tag] = OrderedDict()
        self._history = 1024
        #: (workflow, agent) -> resident keys it owns, in chain order (moves keep it).
        self._by_agent: dict[tuple[str, str], dict[int, None]] = {}
        #: workflow -> its agents seen so far, in first-seen order (a dict, not a set: the
        #: order re-ranking visits them must not depend on string hashing).
        self._by_workflow: dict[str, dict[str, None]] = {}
        #: The spec whose agent prefixes were tagged, per workflow.
        self._tagged: dict[str, object] = {}
        #: TTL pins: key -> expiry, a heap of (expiry, key), the keys protected now.
        self._expiry: dict[int, float] = {}
        #: Keys whose pin ran out and that still wait, ranked by their expiry, until
        #: the deadline given (see :meth:`pin_for`); and each pin's deadline.
        self._overdue: dict[int, float] = {}
        self._late: dict[int, float] = {}
        self._heap: list[tuple[float, int, int]] = []
        self._protected: dict[int, tuple[float, int]] = {}
        #: (-expiry, key) of protected keys, latest first; entries whose expiry
        #: no longer matches the key's protection are stale and skipped.
        self._pheap: list[tuple[float, int, int]] = []
        self._protected_used = 0
        self._now = 0.0
        self.guard: LRUGuard | None = None
        self.requests = 0
        self.hinted_requests = 0
        self.bypassed = 0
        self.sessions = SessionBook()
        self.tracker.subscribe(self._on_workflow)

    def _new_fallback(self) -> EvictionPolicy:
        policy = make_policy(self.fallback, **self._fallback_kwargs)
        if self.capacity:
            policy.bind(self.capacity, max(1, self.capacity // max(self.key_capacity, 1)))
        return policy

    def bind(self, capacity: int, typical_size: int = 1) -> None:
        super().bind(capacity, typical_size)
        self._global.bind(capacity, typical_size)
        for c in self._classes.values():
            c.bind(capacity, typical_size)
        self._history = max(self._history_factor * self.key_capacity, 1024)
        self.guard = LRUGuard(self.key_capacity) if self._use_guard else None

    def close(self) -> None:
        """Stop listening to the tracker (a policy that is being dropped)."""
        self.tracker.unsubscribe(self._on_workflow)

    # -- classes ----------------------------------------------------------------------
    def _cls(self, rank: int) -> EvictionPolicy:
        c = self._classes.get(rank)
        if c is None:
            if rank == DEFAULT:
                c = self._new_fallback()
            else:
                # Hint-ranked classes order their keys themselves: by when a pin
                # ends, or by request recency with a chain's tail first.
                c = (
                    ByReturn(self._expiry, self._depth)
                    if rank >= WAITING and rank in TIMED
                    else TailFirstLRU()
                )
                if self.capacity:
                    c.bind(self.capacity, max(1, self.capacity // max(self.key_capacity, 1)))
            self._classes[rank] = c
        return c

    def _depth(self, key: int) -> int:
        tag = self._tags.get(key)
        return 0 if tag is None else tag.depth

    def _rank_of(self, key: int) -> int:
        return self._class_of.get(key, DEFAULT)

    def _rank(self, key: int, memo: dict[tuple[str, str], int] | None = None) -> int:
        """The class ``key`` belongs in now.

        ``memo`` caches agents' distances over a run of calls during which the
        tracker cannot change (re-ranking a workflow's blocks).
        """
        if key in self._protected:
            return PINNED
        tag = self._tags.get(key)
        if tag is None:
            return WAITING if key in self._expiry else DEFAULT
        reuse = tag.reuse
        if reuse == "never":
            return NEVER
        if key in self._expiry and not tag.shared:
            # A shared prefix's pin ends when its last user is due, but it is due
            # when its first one is: it ranks as a shared prefix, above every wait.
            return WAITING
        d = FAR
        owners = tag.owners
        if owners:
            distance = self.tracker.distance
            if memo is None:
                for wid, aid in owners:
                    x = distance(wid, aid)
                    if x < d:
                        d = x
            else:
                for owner in owners:
                    y = memo.get(owner)
                    if y is None:
                        y = memo[owner] = distance(owner[0], owner[1])
                    if y < d:
                        d = y
        if d >= FAR and reuse == "likely":
            d = FAR - 1
        # keep_rank, inline: this runs for every hinted block a request touches.
        if d < 0:
            d = 0
        elif d > FAR:
            d = FAR
        return (SHARED if tag.shared else DYNAMIC) + (FAR - d)

    def _size(self, key: int) -> int:
        table = self._size_table
        if table is not None:
            return table.get(key, 1) if table else 1
        g = self._global
        return g.size_of(key) if isinstance(g, PolicyBase) else 1

    def _move(self, key: int, memo: dict[tuple[str, str], int] | None = None) -> None:
        """Put a resident key in the class it belongs in now (``memo``: see :meth:`_rank`)."""
        class_of = self._class_of
        old = class_of.get(key, DEFAULT)
        new = self._rank(key, memo)
        if new == old:
            return
        table = self._size_table
        size = self._size(key) if table is None else table.get(key, 1) if table else 1
        classes = self._classes
        classes[old].remove(key)
        c = classes.get(new)
        if c is None:
            c = self._cls(new)
        c.insert(key, key in self._pinned, size)
        if new == DEFAULT:
            del class_of[key]
        else:
            class_of[key] = new

    def _index(self, key: int, tag: _Tag) -> None:
        for owner in tag.owners:
            self._by_agent.setdefault(owner, {})[key] = None
            self._by_workflow.setdefault(owner[0], {})[owner[1]] = None

    def _unindex(self, key: int) -> None:
        tag = self._tags.get(key)
        if tag is not None:
            for owner in tag.owners:
                keys = self._by_agent.get(owner)
                if keys is not None:
                    keys.pop(key, None)
                    if not keys:
                        del self._by_agent[owner]

    def _on_workflow(self, workflow_id: str) -> None:
        """The tracker says ``workflow_id`` changed: tag its prefixes, re-rank its blocks."""
        state = self.tracker.get(workflow_id)
        if state is None:
            self._tagged.pop(workflow_id, None)
        elif self._tagged.get(workflow_id) is not state.spec:
            # Registered or replaced: tag its prefixes once (progress does not change them).
            self._tagged[workflow_id] = state.spec
            for a in state.spec.agents:
                if a.prefix_keys:
                    self._tag_keys(a.prefix_keys, (workflow_id, a.agent_id), None, shared=True)
        agents = self._by_workflow.get(workflow_id, ())
        # Nothing below changes the tracker: each agent's distance is read once.
        memo: dict[tuple[str, str], int] = {}
        move = self._move
        for aid in list(agents):
            # Tail first: the class then evicts the chain's tail first, as it would have.
            for key in reversed(list(self._by_agent.get((workflow_id, aid), ()))):
                move(key, memo)

    # -- hints --------------------------------------------------------------------------
    def _tag_keys(
        self,
        keys: Sequence[int],
        owner: tuple[str, str] | None,
        session: str | None,
        *,
        shared: bool = False,
        reuse: str | None = None,
        depths: Iterable[int] | None = None,
    ) -> None:
        tags = self._tags
        resident = self._global
        moved: list[int] = []
        touch = tags.move_to_end
        # Hints that add nothing to a tag that has them (the usual case: a session's
        # or an agent's next request over its own chain) only refresh its recency.
        plain = not shared and reuse is None
        for key, depth in zip(keys, range(len(keys)) if depths is None else depths, strict=True):
            tag = tags.get(key)
            if (
                plain
                and tag is not None
                and (session is None or tag.session == session)
                and (owner is None or owner in tag.owners)
                and not (tag.shared and tag.reuse == "never")
            ):
                touch(key)
                continue
            held = key in resident
            if tag is None:
                tag = _Tag(session=session, shared=shared, reuse=reuse, depth=depth)
                tags[key] = tag
                before = None
            else:
                touch(key)
                # What the key's rank reads of its tag, to move it only when that changed:
                # a resident key is always in the class its rank names.
                before = (tag.shared, tag.reuse, len(tag.owners))
                if shared:
                    tag.shared = True
                if session is not None:
                    if tag.session is None:
                        tag.session = session
                    elif tag.session != session:
                        tag.shared = True
                if reuse is not None and not tag.shared:
                    tag.reuse = reuse
                if tag.shared:
                    tag.reuse = None if tag.reuse == "never" else tag.reuse
            if owner is not None and owner not in tag.owners:
                if tag.owners:
                    tag.shared = True
                    tag.reuse = None if tag.reuse == "never" else tag.reuse
                if len(tag.owners) < MAX_OWNERS:
                    tag.owners.append(owner)
                if held:
                    self._by_agent.setdefault(owner, {})[key] = None
                    self._by_workflow.setdefault(owner[0], {})[owner[1]] = None
            if held and before != (tag.shared, tag.reuse, len(tag.owners)):
                moved.append(key)
        # Tail first, so a class evicts the chain's tail first. Moving keys does
        # not change the tracker: each agent's distance is read once.
        memo: dict[tuple[str, str], int] = {}
        move = self._move
        for key in reversed(moved):
            move(key, memo)
        excess = len(tags) - self._history
        tries = 4 * excess + 8
        while excess > 0 and tries > 0:
            tries -= 1
            old, tag = tags.popitem(last=False)
            if old in resident:
                tags[old] = tag  # a resident key keeps its hints
            else:
                excess -= 1

    def _hints(self, hints: Mapping[str, object] | Hints | None) -> Hints | None:
        return parse_hints(hints, where="hints")

    def on_request(
        self,
        keys: Sequence[int],
        num_hit: int,
        now: float,
        hints: Mapping[str, object] | None = None,
    ) -> None:
        self.expire(now)
        self.requests += 1
        guard = self.guard
        if guard is not None:
            guard.observe(keys, self._global)
        # A request-aware fallback (learned-reuse) learns from every request, hinted or not.
        hook = self._fallback_hook
        if hook is not None:
            hook(keys, num_hit, now, hints)
            c = self._classes.get(DEFAULT)
            inner = request_hook(c) if c is not None else None
            if inner is not None:
                inner(keys, num_hit, now, hints)
        h = self._hints(hints)
        if h is None:
            return
        self.hinted_requests += 1
        self._apply(keys, num_hit, h, now)

    def on_finish(
        self, keys: Sequence[int], now: float, hints: Mapping[str, object] | Hints | None = None
    ) -> None:
        """A request that used ``keys`` (generated blocks included) finished at ``now``.

        Its blocks join its agent or session, and ``cache_ttl_s`` pins them
        from now on.
        """
        self.expire(now)
        h = self._hints(hints)
        if h is None:
            return
        self._apply(keys, len(keys), h, now, progress=False)

    def _apply(
        self, keys: Sequence[int], num_hit: int, h: Hints, now: float, *, progress: bool = True
    ) -> None:
        if progress:
            self.tracker.observe(h)
        owner = (h.workflow_id, h.agent_id) if h.workflow_id and h.agent_id else None
        prefix: frozenset[int] = frozenset()
        if owner is not None:
            state = self.tracker.get(owner[0])
            spec = state.agent(owner[1]) if state is not None else None
            if spec is not None and spec.prefix_keys:
                prefix = frozenset(spec.prefix_keys)
        session = h.session_id or h.parent_session_id
        if prefix:
            inside = [i for i, k in enumerate(keys) if k in prefix]
            self._tag_keys([keys[i] for i in inside], owner, session, shared=True, depths=inside)
            at = [i for i, k in enumerate(keys) if k not in prefix]
            rest = [keys[i] for i in at]
        else:
            at = list(range(len(keys)))
            rest = list(keys)
        # reuse speaks for the request's own new blocks, never for ones others use.
        self._tag_keys(rest[:num_hit], owner, session, depths=at[:num_hit])
        self._tag_keys(rest[num_hit:], owner, session, reuse=h.reuse, depths=at[num_hit:])
        if h.session_id is not None:
            self._session(h, keys, now, progress)
        elif h.cache_ttl_s:
            self.pin_for(keys, now + h.cache_ttl_s * self.sessions.stretch)

    # -- sessions ---------------------------------------------------------------------------
    def _session(self, h: Hints, keys: Sequence[int], now: float, progress: bool) -> None:
        """A session's request: its pins follow when the session is expected back."""
        step = self.sessions.observe(h, keys, now, progress)
        if step.ended is not None:
            self._end(step.ended)
            return
        if step.release is not None:
            self._release(*step.release)
        if step.pin is not None:
            keys, until, previous = step.pin
            self.pin_for(keys, until, replacing=previous)

    def _release(self, keys: Sequence[int], until: float) -> None:
        """End the pins a session set until ``until`` on its own ``keys`` (chain order)."""
        expiry = self._expiry
        tags = self._tags
        resident = self._global
        for key in reversed(keys):
            if expiry.get(key) != until:
                continue  # pinned later by someone else
            tag = tags.get(key)
            if tag is not None and tag.shared:
                continue
            del expiry[key]
            self._overdue.pop(key, None)
            self._late.pop(key, None)
            if key in self._protected:
                self._unprotect(key)
            elif key in resident:
                self._move(key)

    def end_session(self, session_id: str) -> bool:
        """The session ended: release its pins, its own blocks go first. False if unknown."""
        rec = self.sessions.end(session_id)
        if rec is None:
            return False
        self._end(rec)
        return True

    def _end(self, rec: Session) -> None:
        """Release an ended session's pins; its own blocks are never reused."""
        tags = self._tags
        resident = self._global
        for key in reversed(rec.keys):
            self._overdue.pop(key, None)
            self._late.pop(key, None)
            if self._expiry.pop(key, None) is not None and key in self._protected:
                self._unprotect(key)
            tag = tags.get(key)
            if tag is not None and not tag.shared:
                tag.reuse = "never"
            if key in resident:
                self._move(key)

    def session_stats(self) -> dict[str, int]:
        """Sessions now: tracked, live (pinned until later than now), expired, ended; blocks."""
        live = self.sessions.live(self._now)
        waiting = self._classes.get(WAITING)
        return {
            "tracked": len(self.sessions),
            "live": live,
            "expired": len(self.sessions) - live,
            "ended": self.sessions.ended,
            "pinned_blocks": self._protected_used,
            "waiting_blocks": 0 if waiting is None else len(waiting),
        }

    # -- TTL pins -------------------------------------------------------------------------
    @property
    def pin_cap(self) -> int:
        """Size units TTL pins may protect at most."""
        return int(self.pin_fraction * self.capacity)

    @property
    def protected_used(self) -> int:
        """Size units TTL pins protect now."""
        return self._protected_used

    def pin_for(self, keys: Iterable[int], until: float, replacing: float | None = None) -> None:
        """Protect ``keys`` until ``until`` (the owner's clock); past the cap, latest pins go.

        A pin only ever lengthens, except that ``replacing`` names an earlier
        pin of the same owner that this one supersedes: keys pinned until
        exactly then, and used by no one else, take the new end even if it is
        sooner (a session back early, due again soon).
        """
        tags = self._tags
        expiry = self._expiry
        heap = self._heap
        resident = self._global
        classes = self._classes
        class_of = self._class_of
        overdue = self._overdue
        # Past its end a pin still ranks its key by when it was due, for as long
        # again: a session seldom comes back exactly on time, and one that is late
        # is due any moment (one that never comes back is dropped after that).
        late = until + max(until - self._now, 0.0)
        late_of = self._late
        protected = self._protected
        push = heapq.heappush
        ahead = until > self._now
        table = self._size_table
        for key in keys:
            old = expiry.get(key, -1.0)
            if old >= until and (old != replacing or old == until):
                continue
            tag = tags.get(key)
            if old > until and (tag is None or tag.shared):
                continue
            expiry[key] = until
            overdue.pop(key, None)
            late_of[key] = late
            neg_depth = 0 if tag is None else -tag.depth
            push(heap, (until, neg_depth, key))
            if key in resident:
                if ahead and key in protected:
                    # _pin_state for a key protected already, inline (a session's
                    # every turn re-pins its whole chain): the pin only moves.
                    size = self._size(key) if table is None else table.get(key, 1) if table else 1
                    protected[key] = (until, size)
                    push(self._pheap, (-until, neg_depth, key))
                else:
                    self._protect(key, until)
                c = classes.get(class_of.get(key, DEFAULT))
                if isinstance(c, ByReturn):
                    c.access(key)  # its pin ends at another time now: re-sort it

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
        pheap = self._pheap
        tag = self._tags.get(key)
        neg_depth = 0 if tag is None else -tag.depth
        if key in protected:
            protected[key] = (until, size)
            heapq.heappush(pheap, (-until, neg_depth, key))
            return False
        cap = int(self.pin_fraction * self.capacity)  # pin_cap
        if size > cap:
            return True
        while self._protected_used + size > cap:
            # The pin that ends latest yields: a TTL is when the session is due back,
            # and MIN keeps what is needed soonest.
            neg, _, victim = pheap[0]
            entry = protected.get(victim)
            if entry is None or entry[0] != -neg:
                heapq.heappop(pheap)  # stale
                continue
            if -neg < until:
                # Every current pin ends sooner than this one: it waits past the cap.
                return True
            heapq.heappop(pheap)
            self._unprotect(victim)
        protected[key] = (until, size)
        heapq.heappush(pheap, (-until, neg_depth, key))
        self._protected_used += size
        if len(pheap) > 4 * len(protected) + 64:
            self._pheap = [(-u, -self._depth(k), k) for k, (u, _) in protected.items()]
            heapq.heapify(self._pheap)
        return True

    def _unprotect(self, key: int) -> None:
        entry = self._protected.pop(key, None)
        if entry is None:
            return
        self._protected_used -= entry[1]
        if key in self._global:
            self._move(key)

    def expire(self, now: float) -> int:
        """Drop the TTL pins that ran out by ``now``; returns how many keys lost theirs."""
        if now > self._now:
            self._now = now
        now = self._now
        heap = self._heap
        n = 0
        expiry = self._expiry
        overdue = self._overdue
        while heap and heap[0][0] <= now:
            until, _, key = heapq.heappop(heap)
            if overdue.get(key) == until:
                # Late for as long as it was pinned: not coming back.
                del overdue[key]
                del expiry[key]
                if key in self._global:
                    self._move(key)
                continue
            if expiry.get(key) != until or key in overdue:
                continue  # stale
            late = self._late.pop(key, until)
            if late > until:
                overdue[key] = late
                heapq.heappush(heap, (late, -self._depth(key), key))
            else:
                del expiry[key]
            if key in self._protected:
                self._unprotect(key)
                n += 1
            elif key in self._global:
                self._move(key)
        return n

    def _tick(self) -> None:
        if self.clock is not None and self._heap:
            self.expire(self.clock())

    # -- the policy protocol ----------------------------------------------------------------
    @property
    def used(self) -> int:
        return self._global.used

    @property
    def pinned_used(self) -> int:
        g = self._global
        return g.pinned_used if isinstance(g, PolicyBase) else len(g) - g.num_evictable

    def size_of(self, key: int) -> int:
        return self._size(key)

    def _pinned_keys(self) -> Iterable[int]:
        return self._pinned

    def admit(self, key: int) -> bool:
        tag = self._tags.get(key)
        if tag is None or not self._class_of or (self.guard is not None and self.guard.recency):
            return self._global.admit(key)
        if self._global.used < self.capacity:
            return self._global.admit(key)
        rank = self._rank(key)
        lowest = self._lowest_evictable()
        if lowest is not None and rank < lowest:
            self.bypassed += 1
            return False
        return self._global.admit(key)

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
        if pinned:
            self._pinned.add(key)
        self._place(key, pinned, size)

    def insert_many(
        self, keys: Sequence[int], pinned: bool = False, sizes: Sequence[int] | None = None
    ) -> None:
        self._global.insert_many(keys, pinned, sizes)
        if pinned:
            self._pinned.update(keys)
        tags = self._tags
        expiry = self._expiry
        size_of = self._size
        if not tags and expiry:
            for key in keys:
                self._place(key, pinned, 1 if sizes is None else size_of(key))
            return
        # A key neither hinted nor pinned by a TTL is in the fallback's class (never
        # protected: protection needs an expiry); it goes there at once, in chain
        # order, one insert each as _place would. The hint-ranked ones go tail first.
        later: list[int] = []
        default: EvictionPolicy | None = None
        for key in keys:
            if key in tags or key in expiry:
                later.append(key)
            else:
                if default is None:
                    default = self._cls(DEFAULT)
                default.insert(key, pinned, 1 if sizes is None else size_of(key))
        if not later:
            return
        for key in later:  # each agent's keys indexed in chain order
            tag = tags.get(key)
            if tag is not None:
                self._index(key, tag)
        place = self._place_indexed
        for key in reversed(later):
            place(key, pinned, 1 if sizes is None else size_of(key))

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
        for key in keys:
            c = classes.get(class_of.get(key, DEFAULT))
            if c is not None and key in c:
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

    def _by_class(self, keys: Sequence[int]) -> list[tuple[EvictionPolicy, Sequence[int]]]:
        """``keys`` grouped by class (order kept within each), classes in order of first key."""
        classes = self._classes
        class_of = self._class_of
        if not class_of:
            return [(classes[DEFAULT], keys)]
        ranks = list(map(class_of.get, keys, repeat(DEFAULT, len(keys))))
        if not ranks:
            return []
        first = ranks[0]
        if ranks.count(first) == len(ranks):
            return [(classes[first], keys)]  # one class: the usual case
        groups: dict[int, list[int]] = {}
        for key, rank in zip(keys, ranks, strict=True):
            group = groups.get(rank)
            if group is None:
                groups[rank] = [key]
            else:
                group.append(key)
        return [(classes[rank], group) for rank, group in groups.items()]

    def _forget(self, key: int) -> None:
        """``key`` left the level: drop its class membership and protection."""
        self._class_of.pop(key, None)
        self._pinned.discard(key)
        entry = self._protected.pop(key, None)
        if entry is not None:
            self._protected_used -= entry[1]
        self._unindex(key)

    def remove(self, key: int) -> None:
        if key not in self._global:
            return
        rank = self._class_of.get(key, DEFAULT)
        self._global.remove(key)
        self._classes[rank].remove(key)
        self._forget(key)

    def _lowest_evictable(self) -> int | None:
        best: int | None = None
        for rank, c in self._classes.items():
            if c.num_evictable and (best is None or rank < best):
                best = rank
        return best

    def _recency(self) -> bool:
        return not self._class_of or (self.guard is not None and self.guard.recency)

    def _take_global(self, victims: list[int]) -> list[int]:
        """Victims the global order chose: leave their classes too."""
        for key in victims:
            self._classes[self._rank_of(key)].remove(key)
            self._forget(key)
        return victims

    def _take_class(self, victims: list[int]) -> list[int]:
        remove = self._global.remove
        for key in victims:
            remove(key)
            self._forget(key)
        return victims

    def evict(self) -> int | None:
        self._tick()
        if self._recency():
            key = self._global.evict()
            if key is None:
                return None
            self._classes[self._rank_of(key)].remove(key)
            self._forget(key)
            return key
        rank = self._lowest_evictable()
        if rank is None:
            return None
        c = self._classes[rank]
        key = c.evict()
        if key is None:
            raise InternalInvariantError("a class with evictable keys found no victim")
        self._global.remove(key)
        self._forget(key)
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

    def evict_for(self, size: int) -> list[int] | None:
        if self._recency() and self.capacity > 0:
            self.check_size(size)
            chosen = self._global.evict_for(size)
            return None if chosen is None else self._take_global(chosen)
        # PolicyBase's loop over self.evict(); it reads the sizes the global instance keeps.
        return super().evict_for(size)

    def __len__(self) -> int:
        return len(self._global)

    def __contains__(self, key: object) -> bool:
        return key in self._global

    @property
    def num_evictable(self) -> int:
        return self._global.num_evictable

    # -- for the prefetcher and the tests ---------------------------------------------------------
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

    def snapshot(self) -> dict[str, Any]:
        return {
            **self._state(),
            "fallback": self.fallback,
            "global": self._global.snapshot(),
            "classes": [(r, c.snapshot()) for r, c in sorted(self._classes.items())],
            "class_of": sorted(self._class_of.items()),
            "pinned": sorted(self._pinned),
            "tags": [
                (k, list(t.owners), t.session, t.shared, t.reuse) for k, t in self._tags.items()
            ],
            "expiry": sorted(self._expiry.items()),
            "protected": sorted(self._protected.items()),
            "protected_used": self._protected_used,
            "now": self._now,
            "guard": None if self.guard is None else self.guard.snapshot(),
            "tracker": self.tracker.snapshot(),
            "counts": (self.requests, self.hinted_requests, self.bypassed),
        }


def workflow_policy_of(policy: object) -> WorkflowPolicy | None:
    """The :class:`WorkflowPolicy` inside ``policy`` (itself, or wrapped by admission)."""
    if isinstance(policy, WorkflowPolicy):
        return policy
    inner = getattr(policy, "policy", None)
    return inner if isinstance(inner, WorkflowPolicy) else None


register_policy(WorkflowPolicy.name, with_admission(WorkflowPolicy))
