"""Workflow endpoints: register agent step graphs and report their progress.

* ``POST /v1/workflows``: register (or replace) a workflow: ``{"workflow_id":
  "w", "agents": [{"agent_id": "planner", "after": ["critic"], "join": "and",
  "entry": true, "prefix": "You are..."}, ...]}`` (see
  :func:`kvtier.agents.parse_workflow`); an agent's fixed prompt may be given
  as text (``prefix``), token ids (``prefix_tokens``) or chat messages
  (``prefix_messages``, rendered with the model's chat template). Answers the
  agents' steps-to-execution;
* ``GET /v1/workflows/{id}``: its progress and every agent's steps-to-execution;
* ``POST /v1/workflows/{id}/progress`` ``{"agent_id": "a", "event": "step" |
  "start" | "complete", "step": 3}``: report progress explicitly (requests
  whose ``kvtier`` hints carry ``workflow_id``/``agent_id`` report it too);
* ``DELETE /v1/workflows/{id}``: forget it;
* ``DELETE /v1/sessions/{session_id}``: end a session (as a request hinted
  ``session_end: true`` does): its TTL pins are released, its own blocks
  (those no other session or agent shares) are evicted first on the device
  and freed on every tier, a shared Redis's copies included. 404 when the
  device policy knows no such session.

Bad bodies are 400 with OpenAI's error body; an unknown workflow is 404.
Everything runs on the engine thread (:meth:`EngineWorker.call`), between steps.

Workflows belong to the tenant of the API key that registered them
(:mod:`kvtier.server.tenants`): another tenant's requests and calls see an
unknown workflow (404) even under the same ``workflow_id``, and a tenant's
agent prefixes are keyed under its cache salt, as its requests' blocks are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvtier.agents.graph import WorkflowState, parse_workflow
from kvtier.agents.policy import workflow_policy_of
from kvtier.engine.engine import Engine
from kvtier.engine.worker import EngineWorker
from kvtier.errors import BadRequestError
from kvtier.server.auth import tenant_of
from kvtier.server.protocol import error_body
from kvtier.server.tenants import SEPARATOR, effective_salt, scoped_id, shown_id

_EVENTS = ("step", "start", "complete")


def _state_body(state: WorkflowState, tenant: str | None = None) -> dict[str, Any]:
    dist = state.distances()
    return {
        "object": "workflow",
        "workflow_id": shown_id(tenant, state.spec.workflow_id),
        "agents": [
            {
                "agent_id": a.agent_id,
                "after": list(a.after),
                "join": a.join,
                "prefix_blocks": len(a.prefix_keys),
                "steps_to_execution": None if dist[a.agent_id] >= 1 << 30 else dist[a.agent_id],
                "running": a.agent_id in state.running,
            }
            for a in state.spec.agents
        ],
        "executions": state.executions,
    }


def _not_found(workflow_id: str) -> JSONResponse:
    return JSONResponse(
        error_body(f"workflow {workflow_id!r} is not registered", code="workflow_not_found"),
        status_code=404,
    )


def _prefix_messages(engine: Engine, body: dict[str, Any]) -> None:
    """Render each agent's ``prefix_messages`` into ``prefix_tokens`` (in place)."""
    agents = body.get("agents")
    if not isinstance(agents, list):
        return
    for i, a in enumerate(agents):
        if not isinstance(a, dict) or "prefix_messages" not in a:
            continue
        msgs = a.pop("prefix_messages")
        param = f"agents[{i}].prefix_messages"
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict)
                and set(m) == {"role", "content"}
                and m["role"] in ("system", "user", "assistant")
                and isinstance(m["content"], str)
                for m in msgs
            )
        ):
            raise BadRequestError(
                f"{param} must be a non-empty list of {{role, content}} messages "
                "(roles system, user, assistant; text content)",
                param=param,
            )
        if "prefix_tokens" in a or "prefix" in a:
            raise BadRequestError(
                f"agents[{i}]: give one of prefix, prefix_tokens or prefix_messages", param=param
            )
        a["prefix_tokens"] = list(engine.agents.prefix_from_messages(msgs))


def session_stats(engine: Engine) -> dict[str, Any] | None:
    """The ``sessions`` section of ``/v1/cache/stats`` (``None`` without the workflow policy).

    Call it on the engine thread. Block counts are also given in bytes.
    """
    policy = workflow_policy_of(engine.manager.policy)
    if policy is None:
        return None
    stats: dict[str, Any] = dict(policy.session_stats())
    per_block = engine.layout.bytes_per_block
    stats["pinned_bytes"] = stats["pinned_blocks"] * per_block
    stats["waiting_bytes"] = stats["waiting_blocks"] * per_block
    return stats


def pin_stats(engine: Engine, tenant: str | None) -> dict[str, Any] | None:
    """The ``pins`` section of ``/v1/cache/stats`` (``None`` without the workflow policy):
    pinned blocks per level, and per session for the caller's own sessions (the
    :data:`~kvtier.agents.pinstats.TOP_SESSIONS` that pinned the most). Call it on the
    engine thread."""
    if tenant is None:
        # A caller of no tenant sees the sessions of no tenant.
        def keep(sid: str) -> bool:
            return SEPARATOR not in sid
    else:
        prefix = f"{tenant}{SEPARATOR}"

        def keep(sid: str) -> bool:
            return sid.startswith(prefix)

    return engine.agents.pin_stats(keep=keep, shown=lambda sid: shown_id(tenant, sid))


def register_workflows(app: FastAPI, worker: EngineWorker) -> None:
    """Add the ``/v1/workflows`` endpoints to ``app``."""

    async def on_engine(fn: Callable[[Engine], Any]) -> Any:
        return await asyncio.to_thread(worker.call, fn)

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequestError(f"the request body is not valid JSON ({exc})") from None

    @app.post("/v1/workflows", response_model=None)
    async def create(request: Request) -> JSONResponse:
        body = await body_of(request)
        tenant = tenant_of(request.scope)

        def run(engine: Engine) -> dict[str, Any]:
            if isinstance(body, dict):
                _prefix_messages(engine, body)
            spec = parse_workflow(body)
            # In a tenant's namespace: its id scoped, its prefixes keyed under the tenant's salt
            # (without a tenant, scoped_id refuses an id that names a tenant's namespace).
            spec = dataclasses.replace(spec, workflow_id=scoped_id(tenant, spec.workflow_id))
            salt = None if tenant is None else effective_salt(tenant, None)
            return _state_body(engine.agents.register(spec, cache_salt=salt), tenant)

        return JSONResponse(await on_engine(run))

    @app.get("/v1/workflows/{workflow_id}", response_model=None)
    async def show(workflow_id: str, request: Request) -> JSONResponse:
        tenant = tenant_of(request.scope)
        wid = scoped_id(tenant, workflow_id)

        def run(engine: Engine) -> dict[str, Any] | None:
            state = engine.agents.tracker.get(wid)
            return None if state is None else _state_body(state, tenant)

        out = await on_engine(run)
        return _not_found(workflow_id) if out is None else JSONResponse(out)

    @app.post("/v1/workflows/{workflow_id}/progress", response_model=None)
    async def progress(workflow_id: str, request: Request) -> JSONResponse:
        body = await body_of(request)
        if not isinstance(body, dict) or set(body) - {"agent_id", "event", "step"}:
            raise BadRequestError(
                'progress is {"agent_id": ..., "event": "step" | "start" | "complete", '
                '"step": n}; no other fields'
            )
        agent = body.get("agent_id")
        event = body.get("event", "step")
        step = body.get("step")
        if not isinstance(agent, str) or not agent:
            raise BadRequestError("agent_id must be a non-empty string", param="agent_id")
        if event not in _EVENTS:
            raise BadRequestError(f"event must be one of {', '.join(_EVENTS)}", param="event")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise BadRequestError("step must be a non-negative integer", param="step")

        tenant = tenant_of(request.scope)
        wid = scoped_id(tenant, workflow_id)

        def run(engine: Engine) -> dict[str, Any] | None:
            tracker = engine.agents.tracker
            state = tracker.get(wid)
            if state is None:
                return None
            if event == "start":
                tracker.start(wid, agent)
            elif event == "complete":
                tracker.complete(wid, agent)
            else:
                tracker.advance(wid, agent, step)
            return _state_body(state, tenant)

        out = await on_engine(run)
        return _not_found(workflow_id) if out is None else JSONResponse(out)

    @app.delete("/v1/workflows/{workflow_id}", response_model=None)
    async def delete(workflow_id: str, request: Request) -> JSONResponse:
        wid = scoped_id(tenant_of(request.scope), workflow_id)
        gone = await on_engine(lambda engine: engine.agents.tracker.remove(wid))
        if not gone:
            return _not_found(workflow_id)
        return JSONResponse({"object": "workflow.deleted", "workflow_id": workflow_id})

    @app.delete("/v1/sessions/{session_id}", response_model=None)
    async def end_session(session_id: str, request: Request) -> JSONResponse:
        # Sessions are scoped per tenant as workflows are (the id a tenant's hints carry).
        sid = scoped_id(tenant_of(request.scope), session_id)

        def run(engine: Engine) -> bool:
            return engine.agents.end_session(sid)

        if not await on_engine(run):
            return JSONResponse(
                error_body(f"session {session_id!r} is not known", code="session_not_found"),
                status_code=404,
            )
        return JSONResponse({"object": "session.ended", "session_id": session_id})
