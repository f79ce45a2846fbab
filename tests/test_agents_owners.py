"""The workflow policy's owners: each block's owners and the index of resident blocks by owner.

A block remembers at most :data:`~kvtier.agents.ranks.MAX_OWNERS` owners,
and a workflow's progress re-ranks the resident blocks its agents are
indexed under. Both must say the same: a block is indexed under exactly the
owners it records, only while it is resident. An agent left out of a widely
shared block's owners must not find that block in its index once it has left
the cache, or the workflow's next step would re-rank a block that is gone.
A state machine with more agents than the cap checks this after every step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.agents import WorkflowTracker, sequential
from kvtier.agents.policy import WorkflowPolicy
from kvtier.agents.ranks import DEFAULT, MAX_OWNERS

#: More agents than one block records, so a shared block outgrows its owners.
AGENTS = [f"a{i}" for i in range(MAX_OWNERS + 3)]


def assert_owners_consistent(p: WorkflowPolicy) -> None:
    """Every indexed block is resident and records its owner; every resident block is indexed."""
    for owner, keys in p._by_agent.items():
        assert keys, owner
        for key in keys:
            assert key in p, (owner, key)
            tag = p._tags.get(key)
            assert tag is not None and owner in tag.owners, (owner, key)
    for key, tag in p._tags.items():
        assert len(tag.owners) <= MAX_OWNERS
        if key in p:
            for owner in tag.owners:
                assert key in p._by_agent.get(owner, {}), (owner, key)
    # No class holds a block that left the cache.
    assert all(key in p for key in p._class_of)
    assert sum(len(c) for c in p._classes.values()) == len(p)


def _wide_block(unhinted: bool) -> tuple[WorkflowPolicy, WorkflowTracker]:
    """Block 1, resident, used by one agent more than it records."""
    t = WorkflowTracker()
    t.register(sequential("w", AGENTS, cyclic=True))
    p = WorkflowPolicy(tracker=t, guard=False)
    p.bind(100)
    if unhinted:
        p.insert_many([50])  # the fallback's class exists: a stale index re-inserts there
    for step, agent in enumerate(AGENTS[: MAX_OWNERS + 1]):
        hints = {"workflow_id": "w", "agent_id": agent, "step": step}
        p.on_request([1], 1 if step else 0, float(step), hints)
        if not step:
            p.insert_many([1])
    assert len(p._tags[1].owners) == MAX_OWNERS
    return p, t


@pytest.mark.parametrize("unhinted", [False, True])
@pytest.mark.parametrize("leaves", ["remove", "evict"])
def test_a_block_past_the_owner_cap_leaves_no_trace_when_it_leaves(
    leaves: str, unhinted: bool
) -> None:
    p, _ = _wide_block(unhinted)
    ninth = ("w", AGENTS[MAX_OWNERS])
    assert ninth not in p._tags[1].owners
    if leaves == "remove":
        p.remove(1)
        if unhinted:
            p.remove(50)
    else:
        assert sorted(p.evict_many(len(p))) == ([1, 50] if unhinted else [1])
    assert len(p) == 0
    # The ninth agent's next step: its workflow re-ranks the blocks indexed under it.
    step = MAX_OWNERS + 1
    p.on_request([2], 0, float(step), {"workflow_id": "w", "agent_id": ninth[1], "step": step})
    assert 1 not in p and p.rank_of(1) == DEFAULT
    assert_owners_consistent(p)
    assert p.evict_many(4) == [] and p.evict() is None


def test_an_agent_past_the_cap_still_moves_the_block_with_its_recorded_owners() -> None:
    p, t = _wide_block(unhinted=False)
    before = p.rank_of(1)
    for agent in AGENTS:
        t.complete("w", agent)
        assert p.rank_of(1) == p._rank(1)
        assert_owners_consistent(p)
    assert before != DEFAULT


class OwnersMachine(RuleBasedStateMachine):
    """Requests of more agents than a block records, evictions, removals and progress.

    After every step the owner index and the blocks' owners agree, and no
    block that left the cache is indexed or held by a class.
    """

    @initialize(capacity=st.integers(3, 12), prefixes=st.booleans())
    def setup(self, capacity: int, prefixes: bool) -> None:
        self.tracker = WorkflowTracker()
        spec = sequential("w", AGENTS, cyclic=True)
        if prefixes:
            # One registered prefix for every agent: a block with more owners than the cap.
            agents = tuple(replace(a, prefix_keys=(0,)) for a in spec.agents)
            spec = replace(spec, agents=agents)
        self.tracker.register(spec)
        self.tracker.register(sequential("v", ["x", "y"], cyclic=True))
        self.p = WorkflowPolicy(tracker=self.tracker, guard=False)
        self.p.bind(capacity)
        self.resident: set[int] = set()
        self.now = 0.0
        self.step = 0

    @rule(
        workflow=st.sampled_from(["w", "w", "v"]),
        agent=st.integers(0, len(AGENTS) - 1),
        length=st.integers(1, 4),
        base=st.integers(0, 2),
    )
    def request(self, workflow: str, agent: int, length: int, base: int) -> None:
        aid = AGENTS[agent] if workflow == "w" else ["x", "y"][agent % 2]
        # Few chains, all starting at block 0: many agents share the same blocks.
        keys = [0, *(base * 10 + i for i in range(1, length))]
        hit = 0
        while hit < len(keys) and keys[hit] in self.resident:
            hit += 1
        self.now += 1.0
        hints = {"workflow_id": workflow, "agent_id": aid, "step": self.step}
        self.step += 1
        self.p.on_request(keys, hit, self.now, hints)
        for k in keys:
            if k in self.resident or not self.p.admit(k):
                continue
            victims = self.p.evict_for(1)
            if victims is None:
                break
            for v in victims:
                assert v in self.resident
                self.resident.discard(v)
            self.p.insert(k)
            self.resident.add(k)

    @rule(n=st.integers(1, 3))
    def evict(self, n: int) -> None:
        for v in self.p.evict_many(n):
            assert v in self.resident
            self.resident.discard(v)

    @rule(key=st.sampled_from([0, 1, 2, 3, 11, 12, 21]))
    def remove(self, key: int) -> None:
        self.p.remove(key)
        self.resident.discard(key)

    @rule(agent=st.integers(0, len(AGENTS) - 1))
    def progress(self, agent: int) -> None:
        self.tracker.complete("w", AGENTS[agent])

    @invariant()
    def owners_and_index_agree(self) -> None:
        p = self.p
        assert len(p) == len(self.resident)
        assert all(k in p for k in self.resident)
        assert_owners_consistent(p)
        for k in self.resident:
            assert p.rank_of(k) == p._rank(k), k


TestOwnersMachine = OwnersMachine.TestCase
TestOwnersMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
