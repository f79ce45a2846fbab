"""Admin endpoints: see the engine's requests and move one to another kvtier server.

* ``GET /admin/requests``: every request on this engine (id, running or
  waiting, prompt and generated tokens, tokens with KV) and how many moved
  in and out;
* ``POST /admin/migrate`` ``{"request_id": "req-3", "target": "http://B:8000"}``:
  move a request to the kvtier server at ``target`` (its base URL), through the
  Redis tier both servers share (:mod:`kvtier.engine.migrate`). The client
  streaming the request from this server keeps streaming: the target's
  outputs are relayed here. A move that fails (the target is down, full,
  serves another model, has no shared tier) answers 409 or 502 and the
  request keeps running here;
* ``POST /admin/migrate/accept``: what a server calls on its target: the
  request's state in, newline-delimited JSON out: ``{"accepted": true,
  "request_id": ...}``, then each of the request's outputs;
* ``POST /admin/requests/{id}/cancel``: cancel a request (the source calls it
  when its client goes away after a move).

They are left out of the OpenAPI schema: they serve operators and other
kvtier servers, not OpenAI clients. They are off (404) unless the server has
an admin key (``kvtier serve --admin-key``), and then need it
(:class:`~kvtier.server.auth.AuthGuard`); servers that move requests to each
other share it. A move goes only to a server in the ``--migrate-peer``
allow-list: any other target is refused with 403 before any connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import logging
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvtier.engine.engine import Engine
from kvtier.engine.migrate import Departure, attach_state, detach, release, restore
from kvtier.engine.request import RequestMetrics, RequestOutput
from kvtier.engine.sampling import TokenLogprob
from kvtier.engine.worker import EngineWorker
from kvtier.errors import KvTierError, MigrationError
from kvtier.server.auth import ServerAuth
from kvtier.server.streaming import json_bytes

log = logging.getLogger("kvtier.server.admin")

#: Seconds a move may wait for either engine, and for the target to answer.
MIGRATE_TIMEOUT_S = 30.0
#: Seconds the relay of a moved request waits for the next output before giving up.
STREAM_IDLE_TIMEOUT_S = 600.0
NDJSON = "application/x-ndjson"


def _requests(engine: Engine) -> dict[str, Any]:
    rows = [dataclasses.asdict(row) for row in engine.queues.snapshot()]
    c = engine.counters
    return {"requests": rows, "migrated_in": c.migrated_in, "migrated_out": c.migrated_out}


def output_json(out: RequestOutput) -> dict[str, Any]:
    """One output as a line of the accept stream."""
    m = out.metrics
    return {
        "text": out.text,
        "token_ids": out.token_ids,
        "finished": out.finished,
        "finish_reason": out.finish_reason,
        "error": out.error,
        "index": out.index,
        "logprobs": [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in out.logprobs],
        "metrics": {
            "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens,
            "completion_tokens": m.completion_tokens,
            "preemptions": m.preemptions,
        },
    }


def output_from_json(data: dict[str, Any], request_id: str, m: RequestMetrics) -> RequestOutput:
    """A relayed output under the source's id, its counts folded into the source's metrics."""
    got = data["metrics"]
    m.completion_tokens = int(got["completion_tokens"])
    m.cached_tokens = int(got["cached_tokens"])
    m.preemptions = int(got["preemptions"])
    now = time.perf_counter()
    if data["token_ids"] and m.first_token_time is None:
        m.first_token_time = now
    if data["finished"]:
        m.finish_time = now
    logprobs = tuple(
        TokenLogprob(int(t), float(lp), tuple((int(a), float(b)) for a, b in top))
        for t, lp, top in data["logprobs"]
    )
    return RequestOutput(
        request_id,
        str(data["text"]),
        [int(t) for t in data["token_ids"]],
        bool(data["finished"]),
        data["finish_reason"],
        m,
        data["error"],
        index=int(data["index"]),
        logprobs=logprobs,
    )


class _Relay(threading.Thread):
    """Reads a moved request's outputs from its new server and hands them to the old handle."""

    def __init__(
        self,
        worker: EngineWorker,
        request_id: str,
        response: Any,
        metrics: RequestMetrics,
        cancel_url: str,
        key: str | None = None,
    ) -> None:
        super().__init__(name=f"kvtier-relay-{request_id}", daemon=True)
        self.worker = worker
        self.request_id = request_id
        self.response = response
        self.metrics = metrics
        self.cancel_url = cancel_url
        self.key = key

    def run(self) -> None:
        rid = self.request_id
        try:
            with self.response:
                for line in self.response:
                    if not line.strip():
                        continue
                    out = output_from_json(json.loads(line), rid, self.metrics)
                    self.worker.deliver([out])
                    if out.finished:
                        return
            why = "the stream ended early"
        except (OSError, ValueError, KeyError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        log.warning("request %s: the server it moved to stopped answering (%s)", rid, why)
        self.worker.deliver(
            [
                RequestOutput(
                    rid, "", [], True, "error", self.metrics,
                    f"the server this request moved to stopped answering ({why})",
                )
            ]
        )  # fmt: skip

    def cancel(self) -> None:
        """Cancel the request where it runs now (from any thread; never blocks the caller)."""

        def post() -> None:
            try:
                _post(self.cancel_url, {}, MIGRATE_TIMEOUT_S, self.key).close()
            except OSError as exc:
                log.warning("cancelling moved request %s failed: %s", self.request_id, exc)

        threading.Thread(target=post, daemon=True).start()


def _headers(key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _post(url: str, body: dict[str, Any], timeout: float, key: str | None = None) -> Any:
    req = urllib.request.Request(url, data=json_bytes(body), headers=_headers(key), method="POST")
    return urllib.request.urlopen(req, timeout=timeout)


def _open_stream(
    url: str, body: dict[str, Any], timeout: float, key: str | None = None
) -> tuple[http.client.HTTPResponse, dict[str, Any]]:
    """POST ``body``; the streaming response (its socket then waits longer) and its first line."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MigrationError(f"the target must be an http(s)://host:port URL, got {url!r}")
    conn_type = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    conn = conn_type(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path, body=json_bytes(body), headers=_headers(key))
        response = conn.getresponse()
        if response.status != 200:
            raise MigrationError(f"the target refused the request: {_error_text(response)}")
        first = json.loads(response.readline() or b"{}")
        if not first.get("accepted"):
            raise MigrationError(f"the target did not accept the request: {first}")
    except BaseException:
        conn.close()
        raise
    # Outputs may be far apart (a long queue there): only a silent peer ends the relay.
    if conn.sock is not None:
        conn.sock.settimeout(STREAM_IDLE_TIMEOUT_S)
    return response, first


def migrate_to(
    worker: EngineWorker,
    request_id: str,
    target: str,
    *,
    timeout: float = MIGRATE_TIMEOUT_S,
    key: str | None = None,
) -> dict[str, Any]:
    """Move ``request_id`` to the kvtier server at ``target``; see the module docstring.

    ``key`` is the admin key sent to the target (servers that move requests share it).

    Raises :class:`MigrationError` (the request keeps running here) when the
    target refuses or cannot be reached.
    """
    base = target.rstrip("/")
    dep: Departure = worker.call(lambda e: detach(e, request_id, via="tier"), timeout)
    try:
        response, first = _open_stream(
            f"{base}/admin/migrate/accept", dep.state(), timeout, key
        )
    except BaseException as exc:
        worker.call(lambda e: restore(e, dep), timeout)
        if isinstance(exc, MigrationError):
            raise
        raise MigrationError(f"cannot reach the target {base}: {exc}") from exc
    remote = str(first["request_id"])
    relay = _Relay(
        worker,
        request_id,
        response,
        dep.seq.metrics,
        f"{base}/admin/requests/{remote}/cancel",
        key,
    )
    worker.forward(request_id, relay.cancel)
    worker.call(lambda e: release(e, dep), timeout)
    relay.start()
    if dep.seq.cancelled:
        relay.cancel()
    return {"moved": True, "request_id": request_id, "target": base, "target_request_id": remote}


def _error_text(response: Any) -> str:
    """The message of an error answer (OpenAI's error body), or its status."""
    try:
        body = json.loads(response.read() or b"{}")
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status}"


def _error(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        status_code=status,
    )


def register_admin(app: FastAPI, worker: EngineWorker, auth: ServerAuth | None = None) -> None:
    """Add the admin endpoints (see the module docstring) to ``app``.

    ``auth`` gives the admin key (sent to migration targets) and the allowed
    migration peers; :class:`~kvtier.server.auth.AuthGuard` checks callers.
    """
    auth = auth or ServerAuth()

    @app.get("/admin/requests", include_in_schema=False)
    async def requests() -> JSONResponse:
        try:
            data = await asyncio.to_thread(worker.call, _requests, MIGRATE_TIMEOUT_S)
        except KvTierError as exc:
            return _error(503, f"the engine did not answer: {exc}", "server_error")
        return JSONResponse(data)

    @app.post("/admin/migrate", include_in_schema=False)
    async def migrate(request: Request) -> JSONResponse:
        body = await _json_body(request)
        rid, target = body.get("request_id"), body.get("target")
        if not isinstance(rid, str) or not isinstance(target, str) or not target.strip():
            return _error(400, 'give {"request_id": "...", "target": "http://host:port"}')
        if not auth.peer_allowed(target):
            peers = ", ".join(auth.migrate_peers) or "none (kvtier serve --migrate-peer URL)"
            return _error(
                403,
                f"the target {target.strip()[:200]!r} is not an allowed migration peer; "
                f"allowed: {peers}",
                "permission_error",
                "migration_peer_not_allowed",
                "target",
            )
        try:
            done = await asyncio.to_thread(
                lambda: migrate_to(worker, rid, target, key=auth.admin_key)
            )
        except MigrationError as exc:
            unreachable = "cannot reach" in str(exc)
            return _error(502 if unreachable else 409, str(exc), "migration_error")
        except KvTierError as exc:
            return _error(503, f"the engine did not answer: {exc}", "server_error")
        return JSONResponse(done)

    @app.post("/admin/migrate/accept", response_model=None, include_in_schema=False)
    async def accept(request: Request) -> JSONResponse | StreamingResponse:
        state = await _json_body(request)
        handle = worker.open_handle(loop=asyncio.get_running_loop())
        try:
            rid = await asyncio.to_thread(
                worker.call, lambda e: attach_state(e, state, handle.request_id), MIGRATE_TIMEOUT_S
            )
        except KvTierError as exc:
            worker.close_handle(handle)
            return _error(409, str(exc), "migration_error")

        async def lines() -> AsyncIterator[bytes]:
            yield json_bytes({"accepted": True, "request_id": rid}) + b"\n"
            async for out in handle.stream():
                yield json_bytes(output_json(out)) + b"\n"

        return StreamingResponse(lines(), media_type=NDJSON)

    @app.post("/admin/requests/{request_id}/cancel", include_in_schema=False)
    async def cancel(request_id: str) -> JSONResponse:
        worker.cancel(request_id)
        return JSONResponse({"cancelled": request_id})


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        body = None
    return body if isinstance(body, dict) else {}
