"""The workflow policy's batched bookkeeping decides exactly what one key at a time would.

* :class:`~kvtier.agents.tags.HintTags` (one tag object per distinct set of
  hints, new keys' tags added in bulk, a call's keys looked at once per
  distinct tag) against tags kept per key and updated one key after another:
  the same hints and depth on every key, the same least-recently-used order of
  tags, the same owner indexes and the same keys moved, in the same order.
* ``replay`` of :class:`~kvtier.agents.ranks.TailFirstLRU` and
  :class:`~kvtier.agents.ranks.ByReturn` against one call per key.
* The policy against a copy of itself that does every pin, protection,
  expiry, release, class move and re-sort one key at a time, as the plain
  algorithm does: the same victims, admissions and state after every step of
  random hinted requests, owner pins, time passing and workflow progress.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from helpers import agent_hints
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_policy_speed_structures import _InsertThenMove, _state

from kvtier.agents import WorkflowTracker
from kvtier.agents.graph import AgentSpec, WorkflowSpec
from kvtier.agents.policy import DEFAULT, WorkflowPolicy
from kvtier.agents.ranks import ACCESS, INSERT, MAX_OWNERS, REMOVE, ByReturn, TailFirstLRU
from kvtier.agents.sessions import Session
from kvtier.agents.tags import HintTags, Owner, Said, Tag

KEYS = st.integers(0, 15)
#: Enough keys that a history trim walks part of the tags only, or all of them.
TAG_KEYS = st.integers(0, 63)
OWNERS = st.none() | st.sampled_from([("w", "a"), ("w", "b"), ("v", "a")])
SESSIONS = st.none() | st.sampled_from(["s0", "s1", "s2"])
REUSES = st.none() | st.sampled_from(["likely", "unlikely", "never"])

# -- tags -----------------------------------------------------------------------------------


class _Tagged(HintTags):
    """The tags alone, writing down the keys they move."""

    def __init__(self, history: int) -> None:
        self._tags: OrderedDict[int, Tag] = OrderedDict()
        self._depth_of: dict[int, int] = {}
        self._history = history
        self._resident: set[int] = set()
        self._redepth: set[int] = set()
        self._by_agent: dict[Owner, dict[int, None]] = {}
        self._by_workflow: dict[str, dict[str, None]] = {}
        self.moved: list[int] = []

    def _move(self, key: int) -> None:
        self.moved.append(key)


class _PlainTags:
    """Reference: a list ``[owners, session, shared, reuse, depth]`` per key, one key at a time."""

    def __init__(self, history: int) -> None:
        self.tags: OrderedDict[int, list[Any]] = OrderedDict()
        self.history = history
        self.resident: set[int] = set()
        self.by_agent: dict[Owner, dict[int, None]] = {}
        self.by_workflow: dict[str, dict[str, None]] = {}
        self.moved: list[int] = []

    def tag(
        self,
        keys: Sequence[int],
        owner: Owner | None,
        session: str | None,
        shared: bool,
        reuse: str | None,
        depths: Iterable[int],
    ) -> None:
        moved: list[int] = []
        for key, depth in zip(keys, depths, strict=True):
            tag = self.tags.get(key)
            if tag is None:
                self.tags[key] = [[] if owner is None else [owner], session, shared, reuse, depth]
                if key in self.resident:
                    if owner is not None:
                        self.by_agent.setdefault(owner, {})[key] = None
                        self.by_workflow.setdefault(owner[0], {})[owner[1]] = None
                    moved.append(key)
                continue
            self.tags.move_to_end(key)
            owners, was_session, was_shared, was_reuse, _ = tag
            if (
                (was_shared or not shared)
                and (session is None or was_session == session or (was_shared and was_session))
                and (reuse is None or was_shared or was_reuse == reuse)
                and not (was_shared and was_reuse == "never")
                and (owner is None or owner in owners)
            ):
                continue
            n_owners = len(owners)
            is_shared = was_shared or shared
            if session is not None:
                if was_session is None:
                    tag[1] = session
                elif was_session != session:
                    is_shared = True
            new_reuse = reuse if reuse is not None and not is_shared else was_reuse
            if owner is not None and owner not in owners:
                if owners:
                    is_shared = True
                recorded = n_owners < MAX_OWNERS
                if recorded:
                    owners.append(owner)
                if key in self.resident:
                    if recorded:
                        self.by_agent.setdefault(owner, {})[key] = None
                    self.by_workflow.setdefault(owner[0], {})[owner[1]] = None
            if is_shared and new_reuse == "never":
                new_reuse = None
            tag[2], tag[3] = is_shared, new_reuse
            changed = is_shared != was_shared or new_reuse != was_reuse
            if (changed or len(owners) != n_owners) and key in self.resident:
                moved.append(key)
        self.moved.extend(reversed(moved))
        excess = len(self.tags) - self.history
        tries = 4 * excess + 8
        while excess > 0 and tries > 0:
            tries -= 1
            old, tag = self.tags.popitem(last=False)
            if old in self.resident:
                self.tags[old] = tag
            else:
                excess -= 1

    def leave(self, key: int) -> None:
        self.resident.discard(key)
        tag = self.tags.get(key)
        for owner in [] if tag is None else tag[0]:
            keys = self.by_agent.get(owner)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self.by_agent[owner]


class TagsMachine(RuleBasedStateMachine):
    """Calls with keys named twice, keys entering and leaving, ended sessions, a small history."""

    @initialize(history=st.integers(3, 48))
    def setup(self, history: int) -> None:
        self.tags = _Tagged(history)
        self.ref = _PlainTags(history)

    @rule(
        keys=st.lists(TAG_KEYS, max_size=12),
        owner=OWNERS,
        session=SESSIONS,
        shared=st.booleans(),
        reuse=REUSES,
        explicit=st.booleans(),
    )
    def tag(
        self,
        keys: list[int],
        owner: Owner | None,
        session: str | None,
        shared: bool,
        reuse: str | None,
        explicit: bool,
    ) -> None:
        depths = [2 * i + 1 for i in range(len(keys))] if explicit else None
        self.tags._tag_keys(keys, owner, session, shared=shared, reuse=reuse, depths=depths)
        at = depths if depths is not None else range(len(keys))
        self.ref.tag(keys, owner, session, shared, reuse, at)

    @rule(keys=st.lists(TAG_KEYS, max_size=12))
    def enter_many(self, keys: list[int]) -> None:
        for key in keys:
            self.enter(key)

    @rule(key=TAG_KEYS)
    def enter(self, key: int) -> None:
        self.tags._resident.add(key)
        self.ref.resident.add(key)
        tag = self.tags._tags.get(key)
        if tag is not None:
            self.tags._index(key, tag)
            for owner in self.ref.tags[key][0]:
                self.ref.by_agent.setdefault(owner, {})[key] = None
                self.ref.by_workflow.setdefault(owner[0], {})[owner[1]] = None

    @rule(key=TAG_KEYS)
    def leave(self, key: int) -> None:
        if key not in self.tags._resident:
            return
        self.tags._resident.discard(key)
        tag = self.tags._tags.get(key)
        if tag is not None and tag.owners:
            self.tags._unindex_owners(key, tag.owners)
        self.ref.leave(key)

    @rule(keys=st.lists(TAG_KEYS, max_size=6))
    def end(self, keys: list[int]) -> None:
        memo: dict[Tag, Tag] = {}
        for key in keys:
            tag = self.tags._tags.get(key)
            if tag is not None and not tag.shared and tag.reuse != "never":
                self.tags._never_reused(key, tag, memo)
            plain = self.ref.tags.get(key)
            if plain is not None and not plain[2]:
                plain[3] = "never"

    @invariant()
    def same_as_one_key_at_a_time(self) -> None:
        tags, ref = self.tags, self.ref
        assert list(tags._tags) == list(ref.tags)
        assert tags._depth_of.keys() == ref.tags.keys()
        for key, tag in tags._tags.items():
            owners, session, shared, reuse, depth = ref.tags[key]
            assert (tag.owners, tag.session, tag.shared, tag.reuse) == (
                owners,
                session,
                shared,
                reuse,
            ), key
            assert tags._depth_of[key] == depth, key
        assert [(o, list(k)) for o, k in tags._by_agent.items()] == [
            (o, list(k)) for o, k in ref.by_agent.items()
        ]
        assert [(w, list(a)) for w, a in tags._by_workflow.items()] == [
            (w, list(a)) for w, a in ref.by_workflow.items()
        ]
        assert tags.moved == ref.moved


TestTags = TagsMachine.TestCase
TestTags.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)

# -- replays ----------------------------------------------------------------------------------

KINDS = st.sampled_from([REMOVE, INSERT, ACCESS])
CALLS = st.lists(st.tuples(KINDS, st.integers(0, 11)), max_size=24)


def _legal(calls: list[tuple[int, int]], inside: set[int]) -> list[tuple[int, int]]:
    """Drop the calls an owner would not make: inserting a key held, removing one that is not."""
    out = []
    for kind, key in calls:
        if kind == INSERT:
            if key in inside:
                continue
            inside.add(key)
        elif kind == REMOVE:
            if key not in inside:
                continue
            inside.discard(key)
        out.append((kind, key))
    return out


def _one_by_one(c: Any, calls: list[tuple[int, int]], pinned: set[int]) -> None:
    for kind, key in calls:
        if kind == ACCESS:
            c.access(key)
        elif kind == INSERT:
            c.insert(key, key in pinned)
        else:
            c.remove(key)


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(st.integers(0, 11), unique=True, max_size=8),
    held=st.sets(st.integers(0, 11)),
    calls=CALLS,
    expiry=st.dictionaries(st.integers(0, 11), st.sampled_from([1.0, 2.0, 5.0])),
    depth=st.dictionaries(st.integers(0, 11), st.integers(0, 3)),
    evict=st.integers(0, 6),
)
def test_replay_is_one_call_per_key(
    before: list[int],
    held: set[int],
    calls: list[tuple[int, int]],
    expiry: dict[int, float],
    depth: dict[int, int],
    evict: int,
) -> None:
    calls = _legal(calls, set(before))
    for make in (TailFirstLRU, lambda: ByReturn(dict(expiry), dict(depth))):
        a, b = make(), make()
        for c in (a, b):
            c.bind(64)
            for k in before:
                c.insert(k, k in held)
        a.replay(calls, held)
        _one_by_one(b, calls, held)
        assert a.snapshot() == b.snapshot()
        assert a.evict_many(evict) == b.evict_many(evict)
        assert a.snapshot() == b.snapshot()


# -- the policy against the plain algorithm -------------------------------------------------


class _OneByOne(_InsertThenMove):
    """The workflow policy doing everything one key at a time (the plain algorithm); each
    insert joins the class the key ranks in, then protects it and moves it."""

    def _tag_distinct(
        self, keys: Sequence[int], found: list[Tag | None], said: Said, depths: Any
    ) -> list[int]:
        return self._tag_each(keys, said, depths)

    def _move_many(self, keys: list[int]) -> None:
        for key in dict.fromkeys(keys):
            self._move(key)

    def _rerank_workflow(self, workflow_id: str, previous: dict[str, int] | None) -> None:
        # Every block of every agent of the workflow, each agent's tail first.
        for aid in list(self._by_workflow.get(workflow_id, {})):
            for key in reversed(list(self._by_agent.get((workflow_id, aid), {}))):
                self._move(key)

    def pin_for(self, keys: Iterable[int], until: float, replacing: float | None = None) -> None:
        late = until + max(until - self._now, 0.0)
        ahead = until > self._now
        ends: list[tuple[int, int]] = []
        moved: list[tuple[int, int]] = []
        for key in keys:
            old = self._expiry.get(key, -1.0)
            if old >= until and (old != replacing or old == until):
                continue
            tag = self._tags.get(key)
            if old > until and (tag is None or tag.shared):
                continue
            self._expiry[key] = until
            self._overdue.pop(key, None)
            self._late[key] = late
            neg_depth = -self._depth_of.get(key, 0)
            ends.append((neg_depth, key))
            if key not in self._resident:
                continue
            if ahead and key in self._protected:
                self._protected[key] = (until, self._size(key))
                moved.append((neg_depth, key))
            else:
                if moved:
                    self._latest.push_many(until, moved)
                    moved = []
                if self._pin_state(key, until):
                    self._move(key)
            c = self._classes.get(self._class_of.get(key, DEFAULT))
            if isinstance(c, ByReturn):
                c.access(key)
        if moved:
            self._latest.push_many(until, moved)
        if ends:
            self._ends.push(until, ends)

    def expire(self, now: float) -> int:
        self._now = max(self._now, now)
        n = 0
        while (due := self._ends.due(self._now)) is not None:
            until, pairs = due
            for _, key in pairs:
                if self._overdue.get(key) == until:
                    del self._overdue[key]
                    del self._expiry[key]
                    if key in self._resident:
                        self._move(key)
                    continue
                if self._expiry.get(key) != until or key in self._overdue:
                    continue
                late = self._late.pop(key, until)
                if late > until:
                    self._overdue[key] = late
                    self._ends.push(late, [(-self._depth_of.get(key, 0), key)])
                else:
                    del self._expiry[key]
                if key in self._protected:
                    self._unprotect(key)
                    n += 1
                elif key in self._resident:
                    self._move(key)
        return n

    def _release(self, keys: Sequence[int], until: float) -> None:
        for key in reversed(keys):
            tag = self._tags.get(key)
            if self._expiry.get(key) != until or (tag is not None and tag.shared):
                continue
            del self._expiry[key]
            self._overdue.pop(key, None)
            self._late.pop(key, None)
            if key in self._protected:
                self._unprotect(key)
            elif key in self._resident:
                self._move(key)

    def _end(self, rec: Session) -> None:
        for key in reversed(rec.keys):
            self._overdue.pop(key, None)
            self._late.pop(key, None)
            if self._expiry.pop(key, None) is not None and key in self._protected:
                self._unprotect(key)
            tag = self._tags.get(key)
            if tag is not None and not tag.shared:
                self._never_reused(key, tag, {})
            if key in self._resident:
                self._move(key)


#: Two chains of agents in one workflow: a step of one leaves the other's distances as
#: they were, and requests of different agents share blocks.
WORKFLOW = WorkflowSpec(
    "w", (AgentSpec("a"), AgentSpec("b", ("a",)), AgentSpec("c"), AgentSpec("d", ("c",)))
)
AGENTS = st.sampled_from(["a", "b", "c", "d"])


class PolicyMachine(RuleBasedStateMachine):
    """The policy and its one-key-at-a-time copy, driven alike by an owner."""

    @initialize(
        capacity=st.integers(4, 20),
        fraction=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
        history=st.integers(1, 3),
    )
    def setup(self, capacity: int, fraction: float, history: int) -> None:
        self.policies: list[WorkflowPolicy] = []
        self.trackers: list[WorkflowTracker] = []
        for cls in (WorkflowPolicy, _OneByOne):
            tracker = WorkflowTracker()
            tracker.register(WORKFLOW)
            p = cls(tracker=tracker, pin_fraction=fraction, history=history, guard=False)
            p.bind(capacity)
            self.policies.append(p)
            self.trackers.append(tracker)
        self.capacity = capacity
        self.pinned: set[int] = set()
        self.now = 0.0
        self.step = 0

    def _each(self, call: Any) -> Any:
        outcomes = [call(p) for p in self.policies]
        assert outcomes[0] == outcomes[1]
        return outcomes[0]

    @rule(
        base=st.integers(0, 3),
        length=st.integers(1, 7),
        agent=st.none() | AGENTS,
        session=SESSIONS,
        ttl=st.none() | st.floats(0.5, 20.0),
        reuse=REUSES,
        end=st.booleans(),
        hold=st.booleans(),
    )
    def request(
        self,
        base: int,
        length: int,
        agent: str | None,
        session: str | None,
        ttl: float | None,
        reuse: str | None,
        end: bool,
        hold: bool,
    ) -> None:
        # Chains from a few roots, so requests share prefixes as conversations do.
        keys = [base * 100 + i for i in range(length)]
        hints = agent_hints(agent, self.step, session, ttl, reuse, end)
        self.step += agent is not None
        self._each(lambda p: self._request(p, keys, hints, hold))
        if hold:
            self.pinned.update(k for k in keys if k in self.policies[0])

    def _request(
        self, p: WorkflowPolicy, keys: list[int], hints: dict[str, object], hold: bool
    ) -> tuple[list[object], list[int]]:
        hit = 0
        while hit < len(keys) and keys[hit] in p:
            hit += 1
        p.on_request(keys, hit, self.now, hints or None)
        hits = [k for k in keys if k in p and k not in self.pinned]
        if hits:
            p.pin_many(hits)
            p.access_many(hits)
        decisions: list[object] = []
        new = []
        for k in keys:
            if k in p or k in new or not p.admit(k):
                continue
            victims = p.evict_for(1)
            decisions.append(victims)
            if victims is None:
                break
            new.append(k)
        if new:
            p.insert_many(new, True)
        if not hold:
            mine = [k for k in reversed(keys) if k in p and k not in self.pinned]
            if mine:
                p.unpin_many(mine)
        return decisions, new

    @rule()
    def release(self) -> None:
        if self.pinned:
            keys = sorted(self.pinned)
            self._each(lambda p: p.unpin_many(keys))
            self.pinned.clear()

    @rule(dt=st.floats(0.1, 15.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self._each(lambda p: p.expire(self.now))

    @rule(agent=AGENTS, start=st.booleans())
    def progress(self, agent: str, start: bool) -> None:
        for tracker in self.trackers:
            if start:
                tracker.start("w", agent)
            else:
                tracker.complete("w", agent)

    @rule(session=st.sampled_from(["s0", "s1", "s2"]))
    def end_session(self, session: str) -> None:
        self._each(lambda p: p.end_session(session))

    @rule(n=st.integers(1, 3))
    def evict(self, n: int) -> None:
        self._each(lambda p: p.evict_many(n))

    @invariant()
    def same_state(self) -> None:
        if hasattr(self, "policies"):
            assert _state(self.policies[0]) == _state(self.policies[1])


TestPolicy = PolicyMachine.TestCase
TestPolicy.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_a_block_two_agents_own_moves_when_the_first_is_visited() -> None:
    """Progress of ``b`` re-ranks block 1, which ``a`` (distance unchanged) owns too: it
    moves when ``a``'s blocks are visited, before ``b``'s, as one key at a time does."""
    m = PolicyMachine()
    m.setup(capacity=4, fraction=0.0, history=1)
    plain = {"end": False, "hold": False, "reuse": None, "session": None, "ttl": None}
    m.request(agent="a", base=0, length=2, **plain)
    m.evict(n=1)
    m.request(agent=None, base=0, length=1, **plain)
    m.request(agent="b", base=0, length=2, **plain)
    m.progress(agent="b", start=True)
    m.same_state()
