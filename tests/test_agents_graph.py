"""Agent step graphs: steps-to-execution under AND/OR joins, cycles and progress.

A state machine registers a random workflow (any shape, cycles included),
then starts, completes and advances agents at random; after each step the
distances must be the greatest solution of the join equations, found here by
a separate synchronous (Jacobi) iteration, and must satisfy them.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier import BadRequestError
from kvtier.agents import (
    FAR,
    AgentSpec,
    WorkflowSpec,
    WorkflowTracker,
    fan_out_in,
    parse_workflow,
    sequential,
)


def test_a_cyclic_chain_counts_down_to_each_agent() -> None:
    t = WorkflowTracker()
    names = [f"a{i}" for i in range(10)]
    t.register(sequential("w", names, cyclic=True))
    assert t.distance("w", "a0") == 0 and t.distance("w", "a1") == 1
    assert t.distance("w", "a9") == 9
    t.advance("w", "a0")
    # a0 just ran: it is needed again only after the whole loop.
    assert [t.distance("w", a) for a in names] == [9, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    for a in names[1:]:
        t.advance("w", a)
    assert [t.distance("w", a) for a in names] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_an_open_chain_ends_infinitely_far() -> None:
    t = WorkflowTracker()
    t.register(sequential("w", ["a", "b", "c"]))
    t.advance("w", "a")
    t.advance("w", "b")
    t.advance("w", "c")
    assert {a: t.distance("w", a) for a in "abc"} == {"a": FAR, "b": FAR, "c": FAR}


def test_and_join_waits_for_the_slowest_or_join_for_the_fastest() -> None:
    t = WorkflowTracker()
    spec = WorkflowSpec(
        "w",
        (
            AgentSpec("s"),
            AgentSpec("x", ("s",)),
            AgentSpec("y1", ("s",)),
            AgentSpec("y2", ("y1",)),
            AgentSpec("all", ("x", "y2"), "and"),
            AgentSpec("any", ("x", "y2"), "or"),
        ),
    )
    t.register(spec)
    d = {a.agent_id: t.distance("w", a.agent_id) for a in spec.agents}
    assert d == {"s": 0, "x": 1, "y1": 1, "y2": 2, "all": 3, "any": 2}
    t.advance("w", "s")
    t.advance("w", "x")
    # x is done: the OR-join is ready, the AND-join still waits for y2.
    assert t.distance("w", "any") == 0 and t.distance("w", "all") == 2
    t.advance("w", "y1")
    t.advance("w", "y2")
    assert t.distance("w", "all") == 0


def test_fan_out_workers_are_all_one_step_away() -> None:
    t = WorkflowTracker()
    t.register(fan_out_in("w", "plan", ["r1", "r2", "r3"], "merge"))
    assert [t.distance("w", a) for a in ("plan", "r1", "r2", "r3", "merge")] == [0, 1, 1, 1, 2]


def test_unknown_agents_and_workflows_are_infinitely_far() -> None:
    t = WorkflowTracker()
    t.register(sequential("w", ["a", "b"]))
    assert t.distance("w", "nobody") == FAR and t.distance("nope", "a") == FAR
    with pytest.raises(BadRequestError, match="not an agent"):
        t.advance("w", "nobody")
    with pytest.raises(BadRequestError, match="not registered"):
        t.advance("nope", "a")


def test_a_retried_step_reports_nothing() -> None:
    t = WorkflowTracker()
    t.register(sequential("w", ["a", "b", "c"], cyclic=True))
    assert t.advance("w", "a", step=3)
    assert not t.advance("w", "a", step=3) and not t.advance("w", "a", step=2)
    assert t.distance("w", "b") == 0


def test_a_deadlocked_and_cycle_is_infinitely_far() -> None:
    # x waits for y and y for x, both with AND: neither can ever run.
    t = WorkflowTracker()
    t.register(
        WorkflowSpec(
            "w", (AgentSpec("s"), AgentSpec("x", ("s", "y")), AgentSpec("y", ("x",)))
        )
    )
    assert t.distance("w", "x") == FAR and t.distance("w", "y") == FAR


def test_parse_workflow_refuses_bad_specs_by_name() -> None:
    ok = parse_workflow(
        {"workflow_id": "w", "agents": [{"agent_id": "a"}, {"agent_id": "b", "after": ["a"]}]}
    )
    assert ok.agents[1].after == ("a",)
    bad: list[tuple[object, str]] = [
        ([], "JSON object"),
        ({"workflow_id": "w", "agents": [], "x": 1}, "unknown workflow field 'x'"),
        ({"workflow_id": "", "agents": [{"agent_id": "a"}]}, "workflow_id"),
        ({"workflow_id": "w", "agents": []}, "at least one agent"),
        ({"workflow_id": "w", "agents": [{"agent_id": "a", "color": 1}]}, "'color'"),
        ({"workflow_id": "w", "agents": [{"agent_id": "a", "after": ["zz"]}]}, "'zz'"),
        ({"workflow_id": "w", "agents": [{"agent_id": "a"}, {"agent_id": "a"}]}, "twice"),
        ({"workflow_id": "w", "agents": [{"agent_id": "a", "join": "xor"}]}, "join"),
        ({"workflow_id": "w", "agents": [{"agent_id": "a", "prefix_tokens": [-1]}]}, "prefix"),
    ]
    for obj, match in bad:
        with pytest.raises(BadRequestError, match=match):
            parse_workflow(obj)


def _reference(state: object) -> dict[str, int]:
    """Steps-to-execution by synchronous iteration from FAR (independent of the tracker's)."""
    from kvtier.agents.graph import WorkflowState

    assert isinstance(state, WorkflowState)
    agents = state.agents
    base = {a: 0 if a in state.running or state.ready(a) else FAR for a in agents}
    d = dict(base)
    for _ in range(len(agents) + 2):
        new = dict(base)
        for a in agents:
            if base[a] == 0 or not state.preds[a]:
                continue
            terms = [
                0 if (p, a) in state.satisfied else min(d[p] + 1, FAR) for p in state.preds[a]
            ]
            new[a] = max(terms) if state.join[a] == "and" else min(terms)
        if new == d:
            break
        d = new
    return d


agent_names = st.sampled_from([f"g{i}" for i in range(7)])


@st.composite
def workflows(draw: st.DrawFn) -> WorkflowSpec:
    n = draw(st.integers(1, 7))
    names = [f"g{i}" for i in range(n)]
    agents = []
    for a in names:
        preds = draw(st.lists(st.sampled_from(names), max_size=3, unique=True))
        agents.append(
            AgentSpec(a, tuple(preds), draw(st.sampled_from(["and", "or"])), draw(st.booleans()))
        )
    return WorkflowSpec("w", tuple(agents))


class GraphMachine(RuleBasedStateMachine):
    @initialize(spec=workflows())
    def register(self, spec: WorkflowSpec) -> None:
        self.t = WorkflowTracker()
        self.state = self.t.register(spec)
        self.names = self.state.agents

    @rule(i=st.integers(0, 6))
    def start(self, i: int) -> None:
        self.t.start("w", self.names[i % len(self.names)])

    @rule(i=st.integers(0, 6))
    def complete(self, i: int) -> None:
        self.t.complete("w", self.names[i % len(self.names)])

    @rule(i=st.integers(0, 6), step=st.none() | st.integers(0, 5))
    def advance(self, i: int, step: int | None) -> None:
        self.t.advance("w", self.names[i % len(self.names)], step)

    @rule()
    def run_a_ready_agent(self) -> None:
        d = self.state.distances()
        ready = [a for a in self.names if d[a] == 0 and a not in self.state.running]
        if ready:
            self.t.advance("w", ready[0])

    @invariant()
    def distances_solve_the_join_equations(self) -> None:
        d = self.state.distances()
        assert d == _reference(self.state)
        for a in self.names:
            if a in self.state.running or self.state.ready(a):
                assert d[a] == 0
                continue
            assert d[a] > 0
            if d[a] < FAR:
                # A finite distance rests on a predecessor one step closer.
                terms = [
                    0 if (p, a) in self.state.satisfied else min(d[p] + 1, FAR)
                    for p in self.state.preds[a]
                ]
                assert d[a] == (max(terms) if self.state.join[a] == "and" else min(terms))

    @invariant()
    def due_lists_agents_soonest_first(self) -> None:
        due = self.t.due(3)
        assert [x[0] for x in due] == sorted(x[0] for x in due)
        assert {x[2] for x in due} == {a for a, v in self.state.distances().items() if v <= 3}


TestGraphMachine = GraphMachine.TestCase
TestGraphMachine.settings = settings(max_examples=120, stateful_step_count=25, deadline=None)


@given(st.integers(2, 30))
def test_a_cycle_of_any_length_counts_down(n: int) -> None:
    t = WorkflowTracker()
    names = [f"a{i}" for i in range(n)]
    t.register(sequential("w", names, cyclic=True))
    for k in range(2 * n):
        t.advance("w", names[k % n])
        ran = k % n
        for j in range(n):
            assert t.distance("w", names[j]) == (j - ran - 1) % n
