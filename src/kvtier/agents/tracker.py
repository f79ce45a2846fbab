"""The registered workflows of one engine (or replay) and their progress.

:class:`WorkflowTracker` holds every registered :class:`~kvtier.agents.graph.WorkflowState`,
applies progress (reported explicitly, or inferred from requests whose hints
carry ``workflow_id``/``agent_id``/``step``) and answers how far each agent
is from its next step. The workflow-aware policy, the prefetcher and the
server's ``/v1/workflows`` endpoints share one tracker; listeners hear which
workflow changed, so the policy re-ranks only that workflow's blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvtier.agents.graph import FAR, WorkflowSpec, WorkflowState
from kvtier.errors import BadRequestError, ConfigError
from kvtier.hints import Hints

#: Workflows one tracker holds at most (a registration past it is refused).
MAX_WORKFLOWS = 100_000

Listener = Callable[[str], None]


class WorkflowTracker:
    """Registered workflows, their progress and the agents' steps-to-execution."""

    def __init__(self, max_workflows: int = MAX_WORKFLOWS) -> None:
        if max_workflows <= 0:
            raise ConfigError(f"max_workflows must be positive, got {max_workflows}")
        self.max_workflows = max_workflows
        self._workflows: dict[str, WorkflowState] = {}
        self._listeners: list[Listener] = []
        #: Requests whose hints named a workflow the tracker does not hold.
        self.unknown_reports = 0

    # -- registration -------------------------------------------------------------------
    def register(self, spec: WorkflowSpec) -> WorkflowState:
        """Register (or replace, with fresh progress) ``spec``'s workflow."""
        wid = spec.workflow_id
        if wid not in self._workflows and len(self._workflows) >= self.max_workflows:
            raise BadRequestError(
                f"{len(self._workflows)} workflows are registered, the most this server holds: "
                "delete finished ones first (DELETE /v1/workflows/{id})",
                param="workflow_id",
            )
        state = WorkflowState(spec)
        self._workflows[wid] = state
        self._changed(wid)
        return state

    def remove(self, workflow_id: str) -> bool:
        """Forget a workflow; its agents become infinitely far. False if it was unknown."""
        if self._workflows.pop(workflow_id, None) is None:
            return False
        self._changed(workflow_id)
        return True

    def get(self, workflow_id: str) -> WorkflowState | None:
        return self._workflows.get(workflow_id)

    def __contains__(self, workflow_id: object) -> bool:
        return workflow_id in self._workflows

    def __iter__(self) -> Iterator[WorkflowState]:
        return iter(list(self._workflows.values()))

    def __len__(self) -> int:
        return len(self._workflows)

    # -- progress ---------------------------------------------------------------------------
    def _state(self, workflow_id: str) -> WorkflowState:
        state = self._workflows.get(workflow_id)
        if state is None:
            raise BadRequestError(
                f"workflow {workflow_id!r} is not registered: POST it to /v1/workflows "
                "(or WorkflowTracker.register) first",
                param="workflow_id",
            )
        return state

    def start(self, workflow_id: str, agent_id: str) -> None:
        self._state(workflow_id).start(agent_id)
        self._changed(workflow_id)

    def complete(self, workflow_id: str, agent_id: str) -> None:
        self._state(workflow_id).complete(agent_id)
        self._changed(workflow_id)

    def advance(self, workflow_id: str, agent_id: str, step: int | None = None) -> bool:
        """One step of ``agent_id`` (start and completion); False for a retried step."""
        if self._state(workflow_id).advance(agent_id, step):
            self._changed(workflow_id)
            return True
        return False

    def observe(self, hints: Hints) -> bool:
        """Infer progress from a request's hints; True when a workflow moved.

        Hints naming an unregistered workflow or an agent it does not have are
        counted and otherwise ignored: stale hints cannot break serving.
        """
        wid, aid = hints.workflow_id, hints.agent_id
        if wid is None or aid is None:
            return False
        state = self._workflows.get(wid)
        if state is None or aid not in state.preds:
            self.unknown_reports += 1
            return False
        if state.advance(aid, hints.step):
            self._changed(wid)
            return True
        return False

    # -- distances -------------------------------------------------------------------------
    def distance(self, workflow_id: str, agent_id: str) -> int:
        """Steps until ``agent_id`` of ``workflow_id`` runs; :data:`FAR` if unknown."""
        state = self._workflows.get(workflow_id)
        if state is None:
            return FAR
        return state.distances().get(agent_id, FAR)

    def due(self, within: int) -> list[tuple[int, str, str]]:
        """``(steps, workflow, agent)`` of agents due within ``within`` steps, soonest first."""
        out: list[tuple[int, str, str]] = []
        for state in self._workflows.values():
            wid = state.spec.workflow_id
            for aid, d in state.distances().items():
                if d <= within:
                    out.append((d, wid, aid))
        out.sort()
        return out

    # -- listeners ----------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(workflow_id)`` whenever that workflow's distances may have changed."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _changed(self, workflow_id: str) -> None:
        for listener in list(self._listeners):
            listener(workflow_id)

    def snapshot(self) -> dict[str, Any]:
        return {
            "workflows": [s.snapshot() for s in self._workflows.values()],
            "unknown_reports": self.unknown_reports,
        }
