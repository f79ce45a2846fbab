"""An OpenAI-compatible proxy that sends each request to the instance caching its prefix.

``kvtier route`` runs :func:`create_app` in front of several ``kvtier
serve`` instances that publish their KV events (``--kv-events``). A
background task per instance reads its events into a :class:`PrefixIndex`
(:mod:`kvtier.routing.index`); for each ``/v1/completions`` or
``/v1/chat/completions`` request the proxy tokenizes the prompt as the
instances do (:class:`PromptTokenizer`), asks the index how many leading
blocks each instance holds, and forwards the request, streaming or not, to:

* the instance holding the most leading blocks, among those whose in-flight
  requests exceed the least loaded one's by at most ``balance_threshold``
  (llm-d's guard: a cache hit is not worth a long queue);
* on a tie, or when no instance holds any block, the least loaded instance
  (in-flight requests, then requests routed so far).

An instance that refuses the connection is marked down, its index cleared,
and the request goes to the next choice; a background check of its
``/health`` brings it back. ``/stats`` reports the routing decisions (hits, blocks hit,
fallbacks), each instance's load and its event stream (batches, lost
batches, restarts, resyncs). ``/v1/models`` and ``/health`` answer from the instances.

When an instance's event batches are lost (a gap in its sequence numbers)
and the router was given the instances' admin key, it reads what the instance
holds (``GET /admin/cache/blocks``) and drops from the index what is gone
(:meth:`~kvtier.routing.index.InstanceIndex.retain`); without the key it
only counts the loss.

The routing is a guess that cannot make an answer wrong: a request whose
prompt does not tokenize here (an odd message, tools, images) is routed as
one with no cached prefix, and the instance answers it, or refuses it, as
it would without a router. The index does not know ``cache_salt``: a salted
request may be sent where the same tokens are cached under another salt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvtier.errors import ConfigError
from kvtier.routing.events import (
    EventFormatError,
    SequenceTracker,
    decode_message,
    subscriber_endpoint,
)
from kvtier.routing.index import PrefixIndex

log = logging.getLogger(__name__)
#: Block hashes read per medium from an instance when resyncing (a medium with more is
#: left as the events built it).
RESYNC_LIMIT = 1 << 20

#: Request headers not forwarded (hop-by-hop, or set again by the client).
_DROP_HEADERS = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"}
)
#: Response headers not copied back (the proxy sets its own framing).
_DROP_RESPONSE = frozenset({"content-length", "connection", "transfer-encoding", "keep-alive"})


# -- tokenizing as the instances do ---------------------------------------------------------


class PromptTokenizer:
    """A request's prompt token ids, computed as ``kvtier serve`` computes them.

    Chat: the messages as plain dicts (``developer`` as ``system``, text
    parts joined), the chat template applied with the generation prompt,
    then encoded without special tokens; completions: ``encode(prompt)``, or
    the token ids given. ``None`` when the prompt cannot be tokenized here.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # A fast tokenizer shared by threads can fail with "Already borrowed".
        self._lock = threading.Lock()

    def chat(self, body: dict[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or body.get("tools"):
            return None
        plain: list[dict[str, Any]] = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return None
            if m.get("tool_calls") or m["role"] == "tool":
                return None
            content = m.get("content")
            if content is None:
                content = ""
            elif isinstance(content, list):
                texts = [p.get("text") for p in content if isinstance(p, dict)]
                if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                    return None  # images or odd parts: the instance decides
                content = "".join(t for t in texts if t is not None)
            elif not isinstance(content, str):
                return None
            role = "system" if m["role"] == "developer" else m["role"]
            plain.append({"role": role, "content": content})
        tok = self.tokenizer
        if getattr(tok, "chat_template", None) is None:
            return None
        try:
            with self._lock:
                text = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
                return list(tok.encode(text, add_special_tokens=False))
        except Exception:  # a template refusing the input: the instance will say why
            return None

    def completion(self, body: dict[str, Any]) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            try:
                with self._lock:
                    return list(self.tokenizer.encode(prompt))
            except Exception:
                return None
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return list(prompt)
        return None


# -- instances and the routing decision -----------------------------------------------------


@dataclass
class Instance:
    """One ``kvtier serve`` behind the proxy."""

    name: str
    url: str
    events: str
    in_flight: int = 0
    routed: int = 0
    hit_routes: int = 0
    up: bool = True
    failures: int = 0
    tracker: SequenceTracker = field(default_factory=SequenceTracker)
    bad_messages: int = 0
    resync_failures: int = 0


@dataclass
class RouterStats:
    requests: int = 0
    #: Requests sent where the cache decided: to an instance holding more of the prompt
    #: than another one.
    prefix_hits: int = 0
    #: Leading blocks of the prompt the chosen instances held, summed over requests.
    hit_blocks: int = 0
    #: Requests sent to the least loaded instance: every instance held as much of the
    #: prompt (often nothing).
    least_loaded: int = 0
    #: Requests whose best-cached instance was skipped by the load-balance guard.
    balanced_away: int = 0
    #: Requests whose prompt was not tokenized here (routed as no hit).
    untokenized: int = 0
    #: Forwarding attempts that found an instance down and went to the next choice.
    retries: int = 0
    #: Requests that no instance could take.
    unavailable: int = 0


@dataclass(frozen=True)
class Choice:
    instance: Instance
    hit_blocks: int
    reason: str


class Router:
    """The routing decision over the instances' index and loads (see the module docstring)."""

    def __init__(self, instances: Sequence[Instance], *, balance_threshold: int = 4) -> None:
        if not instances:
            raise ConfigError("the router needs at least one instance: add --instance URL=EVENTS")
        names = [i.name for i in instances]
        if len(set(names)) != len(names):
            raise ConfigError(f"instance names must differ, got {names}")
        if balance_threshold < 0:
            raise ConfigError(f"the balance threshold must be >= 0, got {balance_threshold}")
        self.instances = list(instances)
        self.balance_threshold = balance_threshold
        self.index = PrefixIndex(names)
        self.stats = RouterStats()

    def ranked(self, tokens: Sequence[int] | None) -> list[Choice]:
        """The up instances, best first: the first is where the request goes."""
        up = [i for i in self.instances if i.up]
        if not up:
            return []
        hits = self.index.match(tokens) if tokens else {}
        least = min(i.in_flight for i in up)

        def load(i: Instance) -> tuple[int, int]:
            return (i.in_flight, i.routed)

        eligible = [i for i in up if i.in_flight - least <= self.balance_threshold]
        best_any = max((hits.get(i.name, 0) for i in up), default=0)
        order = sorted(eligible, key=lambda i: (-hits.get(i.name, 0), *load(i)))
        first = order[0]
        n = hits.get(first.name, 0)
        if best_any > n:
            reason = "balanced_away"
        elif n > min(hits.get(i.name, 0) for i in up):
            reason = "hit"  # the cache decided
        else:
            reason = "least_loaded"  # every instance holds as much of the prompt
        rest = sorted(
            (i for i in up if i is not first), key=lambda i: (-hits.get(i.name, 0), *load(i))
        )
        return [Choice(first, n, reason)] + [Choice(i, hits.get(i.name, 0), "retry") for i in rest]

    def record(self, choice: Choice, tokenized: bool) -> None:
        """Count a request's routing decision (its first choice)."""
        stats = self.stats
        stats.requests += 1
        if not tokenized:
            stats.untokenized += 1
        stats.hit_blocks += choice.hit_blocks
        if choice.reason == "hit":
            stats.prefix_hits += 1
        elif choice.reason == "balanced_away":
            stats.balanced_away += 1
        else:
            stats.least_loaded += 1

    def mark_down(self, instance: Instance) -> None:
        if instance.up:
            log.warning("instance %s at %s is down: routing around it", instance.name, instance.url)
        instance.up = False
        instance.failures += 1
        # Whatever it held is gone if it died; a restart starts from an empty cache.
        self.index.clear(instance.name)
        instance.tracker = SequenceTracker()

    def snapshot(self) -> dict[str, Any]:
        stats = self.stats
        out: dict[str, Any] = {
            "requests": stats.requests,
            "prefix_hits": stats.prefix_hits,
            "hit_blocks": stats.hit_blocks,
            "least_loaded": stats.least_loaded,
            "balanced_away": stats.balanced_away,
            "untokenized": stats.untokenized,
            "retries": stats.retries,
            "unavailable": stats.unavailable,
            "balance_threshold": self.balance_threshold,
            "instances": [],
        }
        for inst in self.instances:
            index = self.index.instance(inst.name)
            c = index.counters
            out["instances"].append(
                {
                    "name": inst.name,
                    "url": inst.url,
                    "events": inst.events,
                    "up": inst.up,
                    "in_flight": inst.in_flight,
                    "routed": inst.routed,
                    "hit_routes": inst.hit_routes,
                    "failures": inst.failures,
                    "indexed_blocks": len(index),
                    "block_size": index.block_size,
                    "event_batches": inst.tracker.batches,
                    "lost_batches": inst.tracker.lost,
                    "restarts": inst.tracker.restarts,
                    "bad_messages": inst.bad_messages,
                    "stored_blocks": c.stored_blocks,
                    "removed_blocks": c.removed_blocks,
                    "orphan_blocks": c.orphan_blocks,
                    "skipped_events": c.skipped_events,
                    "resyncs": c.resyncs,
                    "resync_removed_blocks": c.resync_removed,
                    "resync_failures": inst.resync_failures,
                }
            )
        return out


# -- the event feed -------------------------------------------------------------------------


async def _joined(sock: zmq.asyncio.Socket, monitor: Any, timeout_s: float) -> bool:
    """Whether a publisher's connection came up (a ZeroMQ handshake) within ``timeout_s``."""
    try:
        await asyncio.wait_for(monitor.recv_multipart(), timeout_s)
        return True
    except TimeoutError:
        return False
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


async def resync(
    router: Router, instance: Instance, client: httpx.AsyncClient, admin_key: str
) -> bool:
    """Apply ``instance``'s view of what it holds to its index; False if none came."""
    held: dict[str, list[int]] | None = None
    try:
        resp = await client.get(
            f"{instance.url}/admin/cache/blocks",
            params={"limit": RESYNC_LIMIT},
            headers={"Authorization": f"Bearer {admin_key}"},
        )
        if resp.status_code == 200:
            held = {
                medium: [int(h, 16) for h in view["blocks"]]
                for medium, view in resp.json()["media"].items()
                if not view["truncated"]  # a partial list would drop what it left out
            }
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        held = None
    if held is None:
        instance.resync_failures += 1
        log.warning("could not read what %s holds after lost KV events", instance.name)
        return False
    gone = router.index.instance(instance.name).retain(held)
    log.warning("resynced %s after lost KV events: %d blocks were gone", instance.name, gone)
    return True


async def follow_events(
    router: Router,
    instance: Instance,
    ctx: zmq.asyncio.Context,
    ready: asyncio.Event,
    join_timeout_s: float = 10.0,
    on_gap: Callable[[Instance], Coroutine[Any, Any, object]] | None = None,
) -> None:
    """Read one instance's KV events into the index until cancelled.

    ``ready`` is set once the instance's publisher is connected (or after
    ``join_timeout_s``): a PUB socket drops what it sends before it has heard
    the subscription, so a request served before then would be forgotten.
    ``on_gap`` is run (as a task) after a batch that follows lost ones is applied.
    """
    endpoint, bind = subscriber_endpoint(instance.events, instance.url)
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 0)  # never drop: a lost batch leaves the index stale
    try:
        # Watched from before the connection starts, so its handshake is not missed.
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            if bind:
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(linger=0)
            raise ConfigError(
                f"cannot {'bind' if bind else 'connect to'} {endpoint} for {instance.name}'s "
                f"KV events: {exc}"
            ) from exc
        if await _joined(sock, monitor, join_timeout_s):
            # The subscription travels to the publisher after the handshake.
            await asyncio.sleep(0.05)
        else:
            log.warning(
                "no KV event publisher joined %s in %gs (is %s up with --kv-events %s?): "
                "routing without its events until it does",
                endpoint,
                join_timeout_s,
                instance.name,
                instance.events,
            )
        ready.set()
        gaps: set[asyncio.Task[object]] = set()
        while True:
            frames = await sock.recv_multipart()
            try:
                seq, events = decode_message(frames)
            except EventFormatError as exc:
                instance.bad_messages += 1
                log.warning("bad KV event message from %s: %s", instance.name, exc)
                continue
            what = instance.tracker.see(seq)
            if what == "restart":
                router.index.clear(instance.name)
            elif what == "gap":
                log.warning("lost KV event batches from %s: its index may be stale", instance.name)
            router.index.apply(instance.name, events)
            if what == "gap" and on_gap is not None:
                # A task: events keep flowing while the view is read.
                gaps.add(asyncio.create_task(on_gap(instance)))
                gaps.difference_update({t for t in gaps if t.done()})
    finally:
        ready.set()
        sock.close(linger=0)


async def watch_health(router: Router, client: httpx.AsyncClient, interval_s: float) -> None:
    """Ask each down instance's ``/health`` every ``interval_s``; bring it back when it answers.

    An up instance is not asked: a request that finds it gone marks it down and goes on
    to the next choice, and an instance's access log stays free of health checks.
    """
    while True:
        for inst in router.instances:
            if inst.up:
                continue
            try:
                resp = await client.get(f"{inst.url}/health", timeout=max(1.0, interval_s))
                ok = resp.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                log.warning("instance %s at %s is back", inst.name, inst.url)
                inst.up = True
        await asyncio.sleep(interval_s)


# -- the app --------------------------------------------------------------------------------


def _error(status: int, message: str, kind: str = "service_unavailable") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}


def _response_headers(resp: httpx.Response, instance: Instance) -> dict[str, str]:
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE}
    headers["x-kvtier-instance"] = instance.name
    return headers


def create_app(
    instances: Sequence[Instance],
    tokenizer: Any,
    *,
    balance_threshold: int = 4,
    health_interval_s: float = 2.0,
    timeout_s: float = 600.0,
    admin_key: str | None = None,
) -> Starlette:
    """The proxy (see the module docstring); ``app.state.router`` is its :class:`Router`.

    ``admin_key``: the instances' ``--admin-key``, to read what an instance holds after
    its event batches were lost (without it, a loss is only counted).
    """
    router = Router(instances, balance_threshold=balance_threshold)
    for inst in instances:  # refuse a bad endpoint before anything starts
        subscriber_endpoint(inst.events, inst.url)
    prompts = PromptTokenizer(tokenizer)
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ctx = zmq.asyncio.Context()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), limits=limits)
        state["client"] = client
        tasks: list[asyncio.Task[None]] = []
        readies: list[asyncio.Event] = []
        on_gap = None
        if admin_key is not None:
            key = admin_key

            async def on_gap(inst: Instance) -> bool:
                return await resync(router, inst, client, key)

        for inst in router.instances:
            ready = asyncio.Event()
            readies.append(ready)
            tasks.append(
                asyncio.create_task(follow_events(router, inst, ctx, ready, on_gap=on_gap))
            )
        await asyncio.gather(*(r.wait() for r in readies))
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        tasks.append(asyncio.create_task(watch_health(router, client, health_interval_s)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.aclose()
            ctx.term()

    async def forward(request: Request, chat: bool) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        # Tokenizing takes milliseconds of CPU: off the event loop.
        tokens = await asyncio.to_thread(prompts.chat if chat else prompts.completion, body)
        ranked = router.ranked(tokens)
        if not ranked:
            router.stats.unavailable += 1
            return _error(503, "no instance is up: check the kvtier serve processes")
        router.record(ranked[0], tokens is not None)
        client: httpx.AsyncClient = state["client"]
        path = request.url.path
        headers = _forward_headers(request)
        stream = bool(body.get("stream"))
        for n, choice in enumerate(ranked):
            inst = choice.instance
            if n:
                router.stats.retries += 1
            inst.in_flight += 1
            try:
                req = client.build_request(
                    "POST", f"{inst.url}{path}", content=raw, headers=headers
                )
                resp = await client.send(req, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError):
                inst.in_flight -= 1
                router.mark_down(inst)
                continue
            except httpx.HTTPError as exc:
                inst.in_flight -= 1
                return _error(502, f"instance {inst.name} failed: {exc}", "bad_gateway")
            inst.routed += 1
            if choice.reason == "hit":
                inst.hit_routes += 1
            if not stream:
                inst.in_flight -= 1
                return Response(
                    resp.content, resp.status_code, headers=_response_headers(resp, inst)
                )

            relay = _Relay(resp, inst)
            return StreamingResponse(
                relay.chunks(),
                resp.status_code,
                headers=_response_headers(resp, inst),
                background=BackgroundTask(relay.release),
            )
        router.stats.unavailable += 1
        return _error(
            503, "every instance refused the connection: check the kvtier serve processes"
        )

    async def chat_completions(request: Request) -> Response:
        return await forward(request, chat=True)

    async def completions(request: Request) -> Response:
        return await forward(request, chat=False)

    async def models(request: Request) -> Response:
        client: httpx.AsyncClient = state["client"]
        for inst in router.instances:
            if not inst.up:
                continue
            try:
                resp = await client.get(f"{inst.url}/v1/models", headers=_forward_headers(request))
            except httpx.HTTPError:
                router.mark_down(inst)
                continue
            return Response(resp.content, resp.status_code, headers=_response_headers(resp, inst))
        return _error(503, "no instance is up: check the kvtier serve processes")

    async def health(request: Request) -> Response:
        up = sum(1 for i in router.instances if i.up)
        return JSONResponse(
            {"status": "ok" if up else "unavailable", "instances_up": up},
            status_code=200 if up else 503,
        )

    async def stats(request: Request) -> Response:
        return JSONResponse({"time": time.time(), **router.snapshot()})

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.router = router
    return app


class _Relay:
    """A streamed answer passed through; the instance's load released once, however it ends.

    The stream's end releases it, and so does the response's background task, which
    runs even when the client went away before the stream was read to its end.
    """

    def __init__(self, resp: httpx.Response, instance: Instance) -> None:
        self.resp = resp
        self.instance = instance
        self.released = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.resp.aiter_raw():
                yield chunk
        finally:
            await self.release()

    async def release(self) -> None:
        if not self.released:
            self.released = True
            self.instance.in_flight -= 1
            await self.resp.aclose()


__all__ = ["Choice", "Instance", "PromptTokenizer", "Router", "RouterStats", "create_app"]
