"""Agent step graphs: which agent runs when, as steps-to-execution.

A workflow is a set of agents, each with the agents it waits for (its
predecessors) and how it joins them: an **AND-join** runs once every
predecessor has completed since it last ran, an **OR-join** once any has.
Agents with no predecessors (or those marked ``entry``) are ready when the
workflow starts; a graph may have cycles (an agent loop).

Progress is a token game on the edges: when an agent completes, each of its
outgoing edges is marked satisfied; when it starts, its incoming edges are
cleared. An agent's **steps-to-execution** (KVFlow's measure) is 0 while it
runs or is ready, and otherwise, over its predecessors ``p`` (a satisfied
edge counting 0, an unsatisfied one ``d(p) + 1``), the maximum for an
AND-join and the minimum for an OR-join. Cycles are solved as a fixpoint
iterated down from "infinitely far", so an agent that can never run again
(its loop is broken, its entry already ran, it waits on itself) stays
:data:`FAR`; so does an agent the workflow does not know.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.errors import BadRequestError

Join = Literal["and", "or"]
#: Steps-to-execution of an agent that will not run (or is unknown): infinitely far.
FAR = 1 << 30
#: Agents one workflow may have (the fixpoint costs agents x edges per update).
MAX_AGENTS = 1024


@dataclass(frozen=True)
class AgentSpec:
    """One agent of a workflow: its predecessors, its join and its fixed prompt prefix.

    ``prefix_tokens`` (token ids) or ``prefix_keys`` (block keys, as a trace
    names them) identify the agent's fixed prompt; ``prefix`` is text a
    server tokenizes into ``prefix_tokens``. All are optional: without them
    the agent's blocks are learned from the requests it makes.
    """

    agent_id: str
    after: tuple[str, ...] = ()
    join: Join = "and"
    entry: bool = False
    prefix: str | None = None
    prefix_tokens: tuple[int, ...] = ()
    prefix_keys: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkflowSpec:
    """A workflow to register: its id and agents (see the module docstring)."""

    workflow_id: str
    agents: tuple[AgentSpec, ...]

    def __post_init__(self) -> None:
        check_spec(self)


def _fail(msg: str, param: str) -> BadRequestError:
    return BadRequestError(msg, param=param)


def check_spec(spec: WorkflowSpec) -> None:
    """Raise :class:`BadRequestError` unless ``spec`` is a well-formed workflow."""
    if not isinstance(spec.workflow_id, str) or not spec.workflow_id:
        raise _fail("workflow_id must be a non-empty string", "workflow_id")
    if not spec.agents:
        raise _fail("a workflow needs at least one agent", "agents")
    if len(spec.agents) > MAX_AGENTS:
        raise _fail(f"a workflow may have at most {MAX_AGENTS} agents", "agents")
    ids = [a.agent_id for a in spec.agents]
    seen: set[str] = set()
    for i, a in enumerate(spec.agents):
        where = f"agents[{i}]"
        if not isinstance(a.agent_id, str) or not a.agent_id:
            raise _fail(f"{where}.agent_id must be a non-empty string", f"{where}.agent_id")
        if a.agent_id in seen:
            raise _fail(f"agent {a.agent_id!r} is listed twice", f"{where}.agent_id")
        seen.add(a.agent_id)
        if a.join not in ("and", "or"):
            raise _fail(f"{where}.join must be 'and' or 'or', got {a.join!r}", f"{where}.join")
    known = set(ids)
    for i, a in enumerate(spec.agents):
        for p in a.after:
            if p not in known:
                raise _fail(
                    f"agent {a.agent_id!r} waits for {p!r}, which is not an agent of this "
                    f"workflow (agents: {', '.join(ids)})",
                    f"agents[{i}].after",
                )
        if len(set(a.after)) != len(a.after):
            raise _fail(f"agent {a.agent_id!r} lists a predecessor twice", f"agents[{i}].after")


def _str_list(value: object, param: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(f"{param} must be a list of agent ids", param)
    return tuple(value)


def _int_list(value: object, param: str, bound: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < bound for v in value
    ):
        raise _fail(f"{param} must be a list of integers in [0, {bound})", param)
    return tuple(value)


_AGENT_FIELDS = ("agent_id", "after", "join", "entry", "prefix", "prefix_tokens", "prefix_keys")


def parse_workflow(obj: object) -> WorkflowSpec:
    """A :class:`WorkflowSpec` from plain data (a ``POST /v1/workflows`` body, a trace line).

    ``{"workflow_id": "w", "agents": [{"agent_id": "a", "after": ["b"], "join": "or",
    "entry": false, "prefix": "You are...", "prefix_tokens": [...], "prefix_keys": [...]}]}``;
    unknown fields are refused by name.
    """
    if not isinstance(obj, Mapping):
        raise _fail("a workflow must be a JSON object with workflow_id and agents", "workflow")
    unknown = sorted(str(k) for k in obj if k not in ("workflow_id", "agents"))
    if unknown:
        raise _fail(
            f"unknown workflow field {unknown[0]!r} (fields: workflow_id, agents)", unknown[0]
        )
    wid = obj.get("workflow_id")
    if not isinstance(wid, str) or not wid or len(wid) > 256:
        raise _fail(
            "workflow_id must be a non-empty string of at most 256 characters", "workflow_id"
        )
    raw = obj.get("agents")
    if not isinstance(raw, list):
        raise _fail("agents must be a list of agent objects", "agents")
    agents: list[AgentSpec] = []
    for i, a in enumerate(raw):
        where = f"agents[{i}]"
        if not isinstance(a, Mapping):
            raise _fail(f"{where} must be an object", where)
        bad = sorted(str(k) for k in a if k not in _AGENT_FIELDS)
        if bad:
            raise _fail(
                f"unknown agent field {bad[0]!r} in {where} (fields: {', '.join(_AGENT_FIELDS)})",
                f"{where}.{bad[0]}",
            )
        aid = a.get("agent_id")
        if not isinstance(aid, str) or not aid or len(aid) > 256:
            raise _fail(f"{where}.agent_id must be a non-empty string", f"{where}.agent_id")
        join = a.get("join", "and")
        if join not in ("and", "or"):
            raise _fail(f"{where}.join must be 'and' or 'or', got {join!r:.40}", f"{where}.join")
        entry = a.get("entry", False)
        if not isinstance(entry, bool):
            raise _fail(f"{where}.entry must be true or false", f"{where}.entry")
        prefix = a.get("prefix")
        if prefix is not None and not isinstance(prefix, str):
            raise _fail(f"{where}.prefix must be a string", f"{where}.prefix")
        agents.append(
            AgentSpec(
                aid,
                _str_list(a.get("after", []), f"{where}.after"),
                "or" if join == "or" else "and",
                entry,
                prefix,
                _int_list(a.get("prefix_tokens", []), f"{where}.prefix_tokens", 2**32),
                _int_list(a.get("prefix_keys", []), f"{where}.prefix_keys", 2**128),
            )
        )
    return WorkflowSpec(wid, tuple(agents))


@dataclass
class WorkflowState:
    """A registered workflow and its progress: which edges are satisfied, what runs."""

    spec: WorkflowSpec
    #: agent -> its predecessors (in spec order)
    preds: dict[str, tuple[str, ...]] = field(init=False)
    succs: dict[str, list[str]] = field(init=False)
    join: dict[str, Join] = field(init=False)
    #: Satisfied edges (predecessor, agent).
    satisfied: set[tuple[str, str]] = field(default_factory=set)
    running: set[str] = field(default_factory=set)
    #: Entry agents that have run (they are ready only once).
    started: set[str] = field(default_factory=set)
    #: The highest step number each agent reported (for dropping retries).
    last_step: dict[str, int] = field(default_factory=dict)
    #: Agent executions seen (starts).
    executions: int = 0
    _dist: dict[str, int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.preds = {a.agent_id: a.after for a in self.spec.agents}
        self.join = {a.agent_id: a.join for a in self.spec.agents}
        self.succs = {a.agent_id: [] for a in self.spec.agents}
        for a in self.spec.agents:
            for p in a.after:
                self.succs[p].append(a.agent_id)
        entries = {a.agent_id for a in self.spec.agents if a.entry or not a.after}
        # A pure cycle has no agent without predecessors: it starts at its first agent.
        self.entries = entries or {self.spec.agents[0].agent_id}

    @property
    def agents(self) -> list[str]:
        return [a.agent_id for a in self.spec.agents]

    def agent(self, agent_id: str) -> AgentSpec | None:
        for a in self.spec.agents:
            if a.agent_id == agent_id:
                return a
        return None

    # -- progress ---------------------------------------------------------------------
    def start(self, agent_id: str) -> None:
        """``agent_id`` began a step: its incoming edges are consumed."""
        self._known(agent_id)
        self.running.add(agent_id)
        self.started.add(agent_id)
        for p in self.preds[agent_id]:
            self.satisfied.discard((p, agent_id))
        self.executions += 1
        self._dist = None

    def complete(self, agent_id: str) -> None:
        """``agent_id`` finished a step: its outgoing edges are satisfied."""
        self._known(agent_id)
        self.running.discard(agent_id)
        self.started.add(agent_id)
        for s in self.succs[agent_id]:
            self.satisfied.add((agent_id, s))
        self._dist = None

    def advance(self, agent_id: str, step: int | None = None) -> bool:
        """One whole step of ``agent_id`` (a request reporting it); False for a retry.

        A request's ``step`` no newer than one already reported by the agent
        is a retry and changes nothing.
        """
        self._known(agent_id)
        if step is not None:
            last = self.last_step.get(agent_id)
            if last is not None and step <= last:
                return False
            self.last_step[agent_id] = step
        self.start(agent_id)
        self.complete(agent_id)
        return True

    def _known(self, agent_id: str) -> None:
        if agent_id not in self.preds:
            raise BadRequestError(
                f"agent {agent_id!r} is not an agent of workflow {self.spec.workflow_id!r} "
                f"(agents: {', '.join(self.agents)})",
                param="agent_id",
            )

    # -- steps-to-execution -------------------------------------------------------------
    def ready(self, agent_id: str) -> bool:
        """Whether ``agent_id`` could start now."""
        if agent_id in self.entries and agent_id not in self.started:
            return True
        preds = self.preds[agent_id]
        if not preds:
            return False
        sat = self.satisfied
        if self.join[agent_id] == "or":
            return any((p, agent_id) in sat for p in preds)
        return all((p, agent_id) in sat for p in preds)

    def distances(self) -> dict[str, int]:
        """Steps-to-execution of every agent (:data:`FAR` for those that will not run)."""
        if self._dist is not None:
            return self._dist
        agents = self.agents
        dist = {a: (0 if a in self.running or self.ready(a) else FAR) for a in agents}
        pending = [a for a in agents if dist[a] and self.preds[a]]
        sat = self.satisfied
        # Bellman-Ford from above: every finite value rests on a path of at most
        # len(agents) edges, so len(agents) rounds reach the fixpoint.
        for _ in range(len(agents)):
            changed = False
            for a in pending:
                terms = [0 if (p, a) in sat else min(dist[p] + 1, FAR) for p in self.preds[a]]
                d = max(terms) if self.join[a] == "and" else min(terms)
                if d != dist[a]:
                    dist[a] = d
                    changed = True
            if not changed:
                break
        self._dist = dist
        return dist

    def distance(self, agent_id: str) -> int:
        return self.distances().get(agent_id, FAR)

    def snapshot(self) -> dict[str, Any]:
        return {
            "workflow_id": self.spec.workflow_id,
            "satisfied": sorted(self.satisfied),
            "running": sorted(self.running),
            "started": sorted(self.started),
            "last_step": sorted(self.last_step.items()),
            "distances": dict(sorted(self.distances().items())),
        }


def sequential(workflow_id: str, agents: Sequence[str], *, cyclic: bool = False) -> WorkflowSpec:
    """A chain ``agents[0] -> agents[1] -> ...`` (closed into a loop with ``cyclic``)."""
    specs = [
        AgentSpec(a, (agents[i - 1],) if i else ((agents[-1],) if cyclic else ()), entry=i == 0)
        for i, a in enumerate(agents)
    ]
    return WorkflowSpec(workflow_id, tuple(specs))


def fan_out_in(
    workflow_id: str, head: str, workers: Iterable[str], tail: str, *, join: Join = "and"
) -> WorkflowSpec:
    """``head`` fans out to ``workers``, which ``tail`` joins (AND by default)."""
    ws = tuple(workers)
    specs = [AgentSpec(head)]
    specs += [AgentSpec(w, (head,)) for w in ws]
    specs.append(AgentSpec(tail, ws, join))
    return WorkflowSpec(workflow_id, tuple(specs))
