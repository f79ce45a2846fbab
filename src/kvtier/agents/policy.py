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

The bookkeeping lives in four parts the policy is made of: the keys' hints
(:mod:`kvtier.agents.tags`), the rank classes (:mod:`kvtier.agents.classes`),
the TTL pins (:mod:`kvtier.agents.pins`, over the queues of
:mod:`kvtier.agents.queues`) and the owner's calls on resident keys
(:mod:`kvtier.agents.resident`). A block moves between classes only when
something its rank reads changes; a workflow's progress re-ranks only the
blocks of its agents whose distance changed. A request's work is mostly
passes at C speed over its keys: the keys of one call share one tag object
per distinct set of hints, and the keys that change class or protection in
one call are moved together, each class taking its own moves in one go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from kvtier.agents.classes import RankClasses
from kvtier.agents.pins import TtlPins
from kvtier.agents.queues import EndQueue, LatestPins
from kvtier.agents.ranks import DEFAULT, WAITING
from kvtier.agents.resident import ResidentKeys
from kvtier.agents.sessions import SessionBook
from kvtier.agents.tags import HintTags, Tag
from kvtier.agents.tracker import WorkflowTracker
from kvtier.errors import ConfigError
from kvtier.hints import Hints, parse_hints
from kvtier.policy.admission import with_admission
from kvtier.policy.base import EvictionPolicy, PolicyBase, request_hook
from kvtier.policy.guard import LRUGuard
from kvtier.policy.registry import make_policy, register_policy

__all__ = ["DEFAULT", "WorkflowPolicy", "workflow_policy_of"]


class WorkflowPolicy(ResidentKeys, RankClasses, HintTags, TtlPins, PolicyBase):
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
        #: Whether the global instance admits everything and records nothing (then
        #: asking it decides nothing).
        self._admits_all = getattr(type(self._global), "admit", None) is PolicyBase.admit
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
        # The rank classes (kvtier.agents.classes).
        self._classes: dict[int, EvictionPolicy] = {}
        self._ranks: list[int] = []
        self._class_of: dict[int, int] = {}
        self._pinned: set[int] = set()
        #: Every resident key (what the global instance holds), for membership at C speed.
        self._resident: set[int] = set()
        self._tagged: dict[str, object] = {}
        self._dists: dict[str, dict[str, int]] = {}
        self._listening = True
        # The keys' hints (kvtier.agents.tags).
        self._tags: OrderedDict[int, Tag] = OrderedDict()
        self._depth_of: dict[int, int] = {}
        self._redepth: set[int] = set()
        self._history = 1024
        self._by_agent: dict[tuple[str, str], dict[int, None]] = {}
        self._by_workflow: dict[str, dict[str, None]] = {}
        # The TTL pins (kvtier.agents.pins).
        self._expiry: dict[int, float] = {}
        self._overdue: dict[int, float] = {}
        self._late: dict[int, float] = {}
        self._ends = EndQueue()
        self._protected: dict[int, tuple[float, int]] = {}
        self._latest = LatestPins()
        self._protected_used = 0
        self._now = 0.0
        self.guard: LRUGuard | None = None
        self.requests = 0
        self.hinted_requests = 0
        self.bypassed = 0
        self.sessions = SessionBook()
        #: Whether ended sessions' own keys are kept for :meth:`take_released` (set by an
        #: owner that frees them below the device: the engine with tiers).
        self.collect_released = False
        self._released: list[int] = []
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
        # Deaf to the tracker from now on: distances are read afresh each time.
        self._listening = False
        self._dists.clear()

    # -- hints --------------------------------------------------------------------------

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
            guard.observe(keys, self._resident)
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
            at: Sequence[int] = [i for i, k in enumerate(keys) if k not in prefix]
            rest = [keys[i] for i in at]
        else:
            at = range(len(keys))
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

    def on_arrival(self, hints: Mapping[str, object] | Hints | None, now: float) -> None:
        """A hinted request arrived at ``now`` and waits to be served: a session that
        is back keeps its blocks until then (:meth:`SessionBook.arrive`)."""
        self.expire(now)
        h = self._hints(hints)
        if h is None or h.session_id is None:
            return
        step = self.sessions.arrive(h, now)
        if step.pin is not None:
            keys, until, previous = step.pin
            self.pin_for(keys, until, replacing=previous)

    def end_session(self, session_id: str) -> bool:
        """The session ended: release its pins, its own blocks go first. False if unknown."""
        rec = self.sessions.end(session_id)
        if rec is None:
            return False
        self._end(rec)
        return True

    def take_released(self) -> list[int]:
        """The keys of ended sessions' own blocks (not shared with anything else) since the
        last call, for the levels below to free (with :attr:`collect_released` on)."""
        out, self._released = self._released, []
        return out

    def session_stats(self) -> dict[str, int]:
        """Sessions now: tracked, live (pinned until later than now), expired, ended; blocks;
        whether TTL hints are followed (see :class:`~kvtier.agents.sessions.SessionBook`)."""
        live = self.sessions.live(self._now)
        waiting = self._classes.get(WAITING)
        return {
            "tracked": len(self.sessions),
            "live": live,
            "expired": len(self.sessions) - live,
            "ended": self.sessions.ended,
            "pinned_blocks": self._protected_used,
            "waiting_blocks": 0 if waiting is None else len(waiting),
            "ttls_followed": self.sessions.hints_trusted,
        }

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
        g = self._global
        if self._admits_all and g.used < self.capacity:
            return True  # room for it: nothing to weigh (the pool asks once per new key)
        if key in self._tags and self._class_of:
            guard = self.guard
            if (guard is None or not guard.recency) and g.used >= self.capacity:
                rank = self._rank(key)
                lowest = self._lowest_evictable()
                if lowest is not None and rank < lowest:
                    self.bypassed += 1
                    return False
        return True if self._admits_all else g.admit(key)

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
        return key in self._resident

    @property
    def num_evictable(self) -> int:
        return self._global.num_evictable

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
