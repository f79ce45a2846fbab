"""The OpenAI-compatible HTTP API over an :class:`~kvtier.engine.EngineWorker`.

:func:`create_app` builds a FastAPI application with

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's
  response shapes, streamed as server-sent events when ``stream`` is set;
* ``GET /v1/models``: the one served model;
* ``GET /health``: 200 while the engine thread runs, 503 otherwise;
* ``GET /metrics``: Prometheus text (prefix-cache hits, KV blocks, requests,
  tokens, time to first token, preemptions);
* ``GET /v1/cache/stats``: the cache manager's statistics, the engine's
  counters and the KV block layout, as JSON;
* ``/admin/...``: list the engine's requests and move one to another server
  (:mod:`kvtier.server.admin`); list the KV blocks held per medium and reset the
  prefix cache (:mod:`kvtier.server.cache_events`, which also keeps the KV
  events true across startup, resets and idle spells);
* ``/v1/workflows``: register agent step graphs and report their progress
  (:mod:`kvtier.server.workflows`); completions take agent hints in a
  ``kvtier`` object (:mod:`kvtier.hints`);
* prefill/decode disaggregation: completions carrying vLLM's
  ``kv_transfer_params`` are prefilled here for another server, or decoded
  here after another server prefilled them (:mod:`kvtier.server.disagg`).

Every bad input is answered with HTTP 400 and OpenAI's error body
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``;
limits (:class:`~kvtier.server.limits.ServerLimits`) answer 413 (body too
large), 408 (body too slow) and 429 with ``Retry-After`` (too many requests
waiting, or a tenant over its own limits: :mod:`kvtier.server.tenant_limits`); a
generation that fails inside the engine is a 500 ``server_error``
with its traceback logged (or, when streaming, an error event before
``[DONE]``), and memory pressure refusing a request is a 503. A client that
disconnects cancels its request, and the blocks it computed stay cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.engine.sampling import SamplingParams
from kvtier.hints import Hints

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine
from kvtier.engine.worker import EngineWorker, RequestHandle
from kvtier.errors import BadRequestError, KvTierError
from kvtier.mm.images import ImageLimits, check_count, load_image
from kvtier.server import api_errors
from kvtier.server.api_errors import APIError, SafeJSONResponse, install_error_handlers
from kvtier.server.auth import AuthGuard, ServerAuth, tenant_of
from kvtier.server.disagg import Disaggregation, Transfer
from kvtier.server.grammar import ToolGrammars
from kvtier.server.limits import BodyGuard, Rejections, ServerLimits
from kvtier.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from kvtier.server.metrics import (
    EngineSnapshot,
    exposition,
    metrics_registry,
    snapshot_engine,
    stats_dict,
    worker_reader,
)
from kvtier.server.protocol import ChatCompletionRequest, CompletionRequest
from kvtier.server.streaming import (
    SSE_HEADERS,
    ChoiceAccumulator,
    chat_stream,
    completion_stream,
    failure_message,
    usage_body,
)
from kvtier.server.tenant_limits import TenantGate, TenantLimitExceeded, TicketGuard
from kvtier.server.tenants import encode_images_for, for_tenant
from kvtier.server.tools import encode_tool_chat, parse_tool_calls

log = logging.getLogger("kvtier.server")

#: Seconds a stats read waits for the engine thread to reach a step boundary.
SNAPSHOT_TIMEOUT_S = 30.0

#: How often a non-streaming request checks whether its client went away.
DISCONNECT_POLL_S = 0.5


# -- the application -----------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def create_app(
    worker: EngineWorker,
    *,
    served_model_name: str,
    limits: ServerLimits | None = None,
    image_limits: ImageLimits | None = None,
    auth: ServerAuth | None = None,
    role: str = "both",
) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving ``worker``'s engine as ``served_model_name``.

    The caller owns the worker: start it before serving and stop it after.
    ``image_limits`` bound the images a chat request may send to a
    vision-language model. ``auth`` (:mod:`kvtier.server.auth`) names the API keys, their
    tenants and the admin key; without it the API is open and ``/admin/...`` is off.
    ``role`` is the server's side of prefill/decode disaggregation (``both``,
    ``prefill`` or ``decode``; :mod:`kvtier.server.disagg`).
    """
    engine = worker.engine
    limits = limits or ServerLimits()
    images = image_limits or ImageLimits()
    created = int(time.time())
    tokens = TokenText(engine.tokenizer)
    max_chars = limits.max_prompt_chars or engine.max_model_len * tokens.longest_token_chars()
    app = FastAPI(
        title="kvtier",
        summary="OpenAI-compatible completions over kvtier's KV-cache manager",
        version=_version(),
        default_response_class=SafeJSONResponse,
    )
    tenant_gate = TenantGate(limits.tenants, worker)
    rejections = Rejections()
    # Innermost: it sees the response end, and releases a ticket no request took.
    app.add_middleware(TicketGuard, gate=tenant_gate)
    app.add_middleware(BodyGuard, limits=limits)
    auth = auth or ServerAuth()
    limits.tenants.check_tenants(auth.tenants())
    app.add_middleware(AuthGuard, auth=auth)  # outermost: refuses before a body is read
    app.state.auth = auth
    app.state.worker = worker
    app.state.served_model_name = served_model_name
    app.state.limits = limits
    app.state.max_prompt_chars = max_chars
    app.state.tenant_gate = tenant_gate
    app.state.rejections = rejections
    # Prefill/decode disaggregation (kvtier.server.disagg): the role is checked here
    # against the engine's tiers, ConfigError if it cannot work.
    pd = Disaggregation(worker, role)
    app.state.disaggregation = pd

    @functools.cache
    def tool_grammars() -> ToolGrammars:
        """Tool-call grammars for the served tokenizer, built at the first request needing one."""
        return ToolGrammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)

    install_error_handlers(app)

    # -- helpers ----------------------------------------------------------------------
    def check_model(name: str) -> None:
        api_errors.check_model(name, served_model_name)

    def check_chars(count: int, param: str) -> None:
        api_errors.check_chars(count, max_chars, engine.max_model_len, param)

    def retry_after() -> str:
        c = engine.counters
        mean = c.e2e_seconds / c.e2e_count if c.e2e_count else 1.0
        waiting = max(worker.in_flight - engine.max_num_seqs, 1)
        return str(min(max(math.ceil(waiting * mean / engine.max_num_seqs), 1), 60))

    def admit() -> None:
        if not worker.alive:
            raise APIError(503, "the engine is not running", type="server_error")
        cap = engine.max_num_seqs + limits.max_queued
        if worker.in_flight >= cap:
            rejections.add("queue_full")
            raise APIError(
                429,
                f"too many requests: {cap} are already queued or running (the server's "
                "--max-queued-requests); retry after the Retry-After header's seconds",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry_after()},
            )

    async def admit_request(scope: Any) -> None:
        """:func:`admit`, then the limits of the request's tenant (counted once per request)."""
        admit()
        try:
            await tenant_gate.admit(scope)
        except TenantLimitExceeded as exc:
            rejections.add(exc.reason)
            c = engine.counters
            # One of the tenant's requests ending frees its place: about one request's time.
            mean = c.e2e_seconds / c.e2e_count if c.e2e_count else 1.0
            raise APIError(
                429,
                str(exc),
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(min(max(math.ceil(mean), 1), 60))},
            ) from None
        except KvTierError as exc:
            raise APIError(503, f"the engine did not answer: {exc}", type="server_error") from None

    async def submit(
        ids: list[int],
        params: SamplingParams,
        *,
        prompt_param: str,
        mm: Any = None,
        hints: Hints | None = None,
        cache_salt: str | None = None,
        scope: Any = None,
    ) -> RequestHandle:
        """Queue the request; ``scope`` (its ASGI scope) ties its tenant's count to it."""
        if scope is None:
            admit()
        else:
            await admit_request(scope)
        try:
            handle = worker.submit(
                ids,
                params,
                loop=asyncio.get_running_loop(),
                mm=mm,
                hints=hints,
                cache_salt=cache_salt,
            )
        except BadRequestError as exc:
            param = exc.param
            if param in ("messages", "prompt"):
                param = prompt_param
            code = None
            if ids and len(ids) + params.max_tokens > engine.max_model_len:
                code = "context_length_exceeded"
            raise APIError(400, str(exc), param=param, code=code) from None
        except KvTierError as exc:
            raise APIError(503, f"the engine is not running: {exc}", type="server_error") from None
        if scope is not None:
            tenant_gate.bind(scope, handle)
        return handle

    async def snapshot() -> EngineSnapshot:
        if not worker.alive:  # no thread owns the engine any more: read it here
            return snapshot_engine(engine)
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(worker.call, snapshot_engine), SNAPSHOT_TIMEOUT_S
            )
        except TimeoutError:
            raise APIError(503, "the engine did not answer in time", type="server_error") from None

    async def collect(handle: RequestHandle, request: Request) -> ChoiceAccumulator:
        """Every choice of a request; cancels it if the client leaves."""
        acc = ChoiceAccumulator(handle.n)

        async def consume() -> None:
            async with contextlib.aclosing(handle.stream()) as outs:
                async for out in outs:
                    acc.add(out)

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    raise APIError(499, "the client disconnected", type="server_error")
            task.result()
        finally:
            if not task.done():
                task.cancel()
                handle.cancel()
        return acc

    async def respond(
        handle: RequestHandle,
        request: Request,
        rid: str,
        kind: str,
        streaming: bool,
        include_usage: bool,
        stream: Callable[..., AsyncIterator[bytes]],
        choice: Callable[[str, list[Any], str | None], dict[str, Any]],
        extra: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    ) -> JSONResponse | StreamingResponse:
        """A completion's response: SSE when streaming, else one OpenAI-shaped JSON body."""
        now = int(time.time())
        if streaming:
            return StreamingResponse(
                stream(handle, rid, now, served_model_name, include_usage, tokens),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        acc = await collect(handle, request)
        failed = acc.failure()
        if failed is not None:
            if failed.finish_reason == "rejected":
                raise APIError(503, failure_message(failed), type="server_error")
            raise APIError(500, failure_message(failed), type="server_error")
        choices = []
        for i, c in enumerate(acc.choices):
            assert c.last is not None
            choices.append(
                {"index": i, **choice("".join(c.text), c.logprobs, c.last.finish_reason)}
            )
        return SafeJSONResponse(
            {
                "id": rid,
                "object": kind,
                "created": now,
                "model": served_model_name,
                "choices": choices,
                "usage": usage_body(acc.finals()),
                "system_fingerprint": None,
                **({} if extra is None else await extra()),
            }
        )

    def handoff(
        transfer: Transfer | None,
        ids: list[int],
        salt: str | None,
        request: Request,
        handle: RequestHandle,
    ) -> Callable[[], Awaitable[dict[str, Any]]] | None:
        """For a prefill request, what adds the decode side's ``kv_transfer_params``."""
        return pd.answer(
            transfer,
            ids,
            salt,
            request_id=request.headers.get("x-request-id") or handle.request_id,
            host=request.url.hostname,
            port=request.url.port,
        )

    # -- endpoints ------------------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        check_model(body.model)
        if len(body.messages) > limits.max_messages:
            raise APIError(
                400,
                f"a chat request may have at most {limits.max_messages} messages, got "
                f"{len(body.messages)} (the server's --max-messages)",
                param="messages",
            )
        tool_req = body.tool_request()
        with_tools = body.uses_tools() or tool_req is not None
        mm: Any = None
        if with_tools and body.has_images():
            raise APIError(
                400, "tools cannot be combined with images: send one or the other", param="tools"
            )
        if body.has_images() and engine.vlm is not None:
            messages, urls = body.to_multimodal_messages()
            check_count(len(urls), images)
            check_chars(sum(len(t) for t in _texts(messages)), "messages")
        else:
            messages, urls = body.to_messages(), []
            check_chars(sum(len(m["content"]) for m in messages), "messages")
        requested = body.requested_max_tokens()
        # Parameters are checked before the prompt is tokenized: a bad one costs nothing.
        params = body.sampling_params(requested or 1, engine.sampling_defaults)
        salt, hints = for_tenant(request.scope, body.cache_salt, body.agent_hints())
        transfer = pd.transfer(body.kv_transfer_params, streaming=body.streaming)
        await admit_request(request.scope)
        if urls:
            ids, mm = await asyncio.to_thread(
                _encode_with_images, engine, messages, urls, images, salt
            )
        elif with_tools:
            ids = await asyncio.to_thread(encode_tool_chat, engine.tokenizer, messages, tool_req)
        else:
            ids = await asyncio.to_thread(engine.encode_chat, messages)
        if requested is None:  # up to the context, capped by --default-max-tokens
            params = dataclasses.replace(
                params,
                max_tokens=limits.default_completion_tokens(engine.max_model_len - len(ids)),
            )
        if tool_req is not None and tool_req.constrained:
            factory = await asyncio.to_thread(tool_grammars().constraint_for, tool_req)
            params = dataclasses.replace(params, constraint=factory)
        params = pd.sampling(transfer, params)
        handle = await submit(
            ids,
            params,
            prompt_param="messages",
            mm=mm,
            hints=hints,
            cache_salt=salt,
            scope=request.scope,
        )
        handle = pd.observe(handle, transfer, ids, salt)
        parse = tool_req is not None and tool_req.parses

        def choice(text: str, lps: list[Any], finish: str | None) -> dict[str, Any]:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if parse:
                assert tool_req is not None
                content, calls = parse_tool_calls(text, tool_req.max_calls)
                if calls:
                    message["content"] = content
                    message["tool_calls"] = [c.as_openai() for c in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            return {
                "message": message,
                "logprobs": chat_logprobs(tokens, lps) if params.logprobs is not None else None,
                "finish_reason": finish,
            }

        stream = chat_stream
        if parse:
            assert tool_req is not None
            stream = functools.partial(chat_stream, tool_calls=True, max_calls=tool_req.max_calls)
        return await respond(
            handle,
            request,
            _new_id("chatcmpl"),
            "chat.completion",
            body.streaming,
            body.include_usage,
            stream,
            choice,
            handoff(transfer, ids, salt, request, handle),
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        check_model(body.model)
        body.check_supported()
        prompt = body.single_prompt()
        max_tokens = body.requested_max_tokens()
        if body.max_tokens is None or "max_tokens" not in body.model_fields_set:
            # OpenAI's default of 16, or --default-max-tokens when that is fewer.
            max_tokens = min(max_tokens, limits.default_max_tokens or max_tokens)
        params = body.sampling_params(max_tokens, engine.sampling_defaults)
        salt, hints = for_tenant(request.scope, body.cache_salt, body.agent_hints())
        transfer = pd.transfer(body.kv_transfer_params, streaming=body.streaming)
        params = pd.sampling(transfer, params)
        if isinstance(prompt, str):
            check_chars(len(prompt), "prompt")
            await admit_request(request.scope)
            ids = await asyncio.to_thread(engine.encode_prompt, prompt)
        else:
            ids = prompt
        handle = await submit(
            ids, params, prompt_param="prompt", hints=hints, cache_salt=salt, scope=request.scope
        )
        handle = pd.observe(handle, transfer, ids, salt)

        def choice(text: str, lps: list[Any], finish: str | None) -> dict[str, Any]:
            lp = completion_logprobs(tokens, lps) if params.logprobs is not None else None
            return {"text": text, "logprobs": lp, "finish_reason": finish}

        return await respond(
            handle,
            request,
            _new_id("cmpl"),
            "text_completion",
            body.streaming,
            body.include_usage,
            completion_stream,
            choice,
            handoff(transfer, ids, salt, request, handle),
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "kvtier",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.get("/health", response_model=None)
    async def health() -> JSONResponse:
        if worker.alive:
            return SafeJSONResponse({"status": "ok"})
        reason = "stopped" if worker.fatal is None else f"failed: {worker.fatal!r}"
        return SafeJSONResponse({"status": "unavailable", "engine": reason}, status_code=503)

    # A registry per app (not prometheus_client's global one); its collector
    # reads the engine on the worker's thread at each scrape.
    registry = metrics_registry(worker_reader(worker, SNAPSHOT_TIMEOUT_S))
    registry.register(rejections)
    registry.register(pd)
    app.state.metrics_registry = registry

    @app.get("/metrics", response_model=None)
    async def metrics(request: Request) -> Response:
        try:
            body, content_type = await asyncio.to_thread(
                exposition, registry, request.headers.get("accept")
            )
        except KvTierError as exc:
            raise APIError(503, f"the engine did not answer: {exc}", type="server_error") from None
        return Response(body, media_type=content_type)

    @app.get("/v1/cache/stats")
    async def cache_stats(request: Request) -> dict[str, Any]:
        from kvtier.server.workflows import pin_stats, session_stats

        snap = await snapshot()
        tenant = tenant_of(request.scope)

        def on_engine(e: Engine) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
            return session_stats(e), pin_stats(e, tenant)

        sessions, pins = (
            await asyncio.to_thread(worker.call, on_engine) if worker.alive else on_engine(engine)
        )
        layout = engine.layout
        ttft = snap.ttft
        return {
            **stats_dict(snap.stats),
            "engine": {
                "model": served_model_name,
                "running": snap.running,
                "waiting": snap.waiting,
                "requests_added": snap.requests_added,
                "finished": snap.finished,
                "prompt_tokens": snap.prompt_tokens,
                "cached_prompt_tokens": snap.cached_prompt_tokens,
                "loaded_prompt_tokens": snap.loaded_prompt_tokens,
                "cached_prompt_tokens_by_source": snap.cached_by_source,
                "recomputed_tier_tokens": snap.recomputed_tier_tokens,
                "computed_prompt_tokens": snap.computed_prompt_tokens,
                "generation_tokens": snap.generation_tokens,
                "preemptions": snap.preemptions,
                "forked_sequences": snap.forked_sequences,
                "forward_errors": snap.forward_errors,
                "ttft_count": ttft.count,
                "ttft_mean_s": ttft.sum / ttft.count if ttft.count else None,
                "last_request": snap.last,
                "max_model_len": engine.max_model_len,
                "max_num_seqs": engine.max_num_seqs,
                "prefix_caching": engine.prefix_caching,
            },
            "window_slots": None
            if snap.window is None
            else {**dataclasses.asdict(snap.window), "recomputes": snap.window_recomputes},
            "tiers": snap.tiers,
            "costs": snap.costs,
            "sessions": sessions,
            "pins": pins,
            "pressure": None if snap.pressure is None else snap.pressure.as_dict(),
            "encoder_cache": snap.encoder_cache,
            "layout": {
                "num_layers": layout.num_layers,
                "num_kv_heads": layout.num_kv_heads,
                "head_dim": layout.head_dim,
                "block_size": layout.block_size,
                "dtype": layout.dtype,
                "scaled": layout.scaled,
                "kv_cache_dtype": engine.kv_cache_dtype,
                "canonical": layout.canonical(),
                "bytes_per_token": layout.bytes_per_token,
                "bytes_per_block": layout.bytes_per_block,
            },
            "block_size": layout.block_size,
            "bytes_per_block": layout.bytes_per_block,
            "kv_cache_bytes": layout.bytes_per_block * snap.stats.total_blocks,
            # The caller's own tenant only: other tenants are /admin/tenants' to show.
            "tenant": tenant_gate.caller_view(tenant),
            "disaggregation": pd.stats(),
        }

    @app.get("/admin/tenants", include_in_schema=False)
    async def admin_tenants() -> dict[str, Any]:
        """Every tenant's requests in flight and limits (names only; AuthGuard asks for the
        admin key)."""
        return tenant_gate.admin_view(auth.tenants())

    from kvtier.server.admin import register_admin

    register_admin(app, worker, auth)
    from kvtier.server.cache_events import register_cache_events

    register_cache_events(app, worker)
    from kvtier.server.workflows import register_workflows

    register_workflows(app, worker)
    from kvtier.server.tokenization import register_tokenization

    register_tokenization(app)
    return app


def _texts(messages: list[dict[str, Any]]) -> list[str]:
    """Every text of chat messages, string content and text parts alike."""
    out: list[str] = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            out.append(content)
        else:
            out.extend(p["text"] for p in content if p.get("type") == "text")
    return out


def _encode_with_images(
    engine: Engine,
    messages: list[dict[str, Any]],
    urls: list[tuple[str, str]],
    limits: ImageLimits,
    salt: str | None = None,
) -> tuple[list[int], Any]:
    """Load the request's images (refusing bad ones with a 400) and tokenize around them;
    their encoder-cache keys carry the request's cache ``salt``."""
    items = [load_image(url, limits, param=param) for url, param in urls]
    return encode_images_for(engine, messages, items, salt)


def _version() -> str:
    from kvtier._version import __version__

    return str(__version__)
