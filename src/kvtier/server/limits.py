"""What one client may ask of the server, and the ASGI guard that enforces the byte limits.

:class:`ServerLimits` bounds a request before it costs anything: its body's
size and how long the client may take to send it (:class:`BodyGuard`, in
front of the application: 413 and 408), how many characters a prompt may
have before it is tokenized and how many messages a chat may have (400),
and how many requests may wait for the engine (429 with ``Retry-After``).
It also caps the completion of a request that sends no ``max_tokens``
(:attr:`ServerLimits.default_max_tokens`), so a model that never emits its
end-of-sequence token cannot run on to the end of the context unasked.
Per-tenant limits (requests in flight, a share of the KV cache) are in
:attr:`ServerLimits.tenants` (:mod:`kvtier.server.tenant_limits`).

:class:`Rejections` counts the requests refused with 429, by reason, for
``/metrics`` (``kvtier_rejected_requests_total{reason=...}``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.server.protocol import error_body
from kvtier.server.streaming import json_bytes
from kvtier.server.tenant_limits import TenantLimits

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Tokens a request that sends no ``max_tokens`` gets at most (``--default-max-tokens``).
DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits (see the module docstring); every one has a ``kvtier serve`` flag."""

    #: Largest request body, in bytes (``--max-request-bytes``).
    max_body_bytes: int = 8 * 2**20
    #: Longest prompt in characters, checked before tokenizing (``--max-prompt-chars``);
    #: ``None``: the context length times the longest token of the vocabulary, so a prompt
    #: over it could never fit.
    max_prompt_chars: int | None = None
    #: Most messages in one chat request (``--max-messages``).
    max_messages: int = 1024
    #: Requests that may wait beyond those running (``--max-queued-requests``); more get 429.
    max_queued: int = 256
    #: Seconds a client may take to send its request body (``--request-timeout``); then 408.
    body_timeout_s: float = 30.0
    #: Tokens a request that sends no ``max_tokens`` (nor ``max_completion_tokens``) gets at
    #: most (``--default-max-tokens``); 0: OpenAI's behaviour, a chat completion runs up to
    #: the context. ``/v1/completions`` keeps OpenAI's 16 when that is fewer.
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    #: Per-tenant limits: requests in flight and a share of the KV cache
    #: (``--tenant-max-requests``, ``--tenant-max-kv-fraction``, ``--tenant-limit``).
    tenants: TenantLimits = field(default_factory=TenantLimits)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ConfigError(f"max_prompt_chars must be positive, got {self.max_prompt_chars}")
        if not isinstance(self.max_queued, int) or self.max_queued < 0:
            raise ConfigError(f"max_queued must be a non-negative integer, got {self.max_queued}")
        if not self.body_timeout_s > 0:
            raise ConfigError(f"body_timeout_s must be positive, got {self.body_timeout_s}")
        value = self.default_max_tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(
                f"default_max_tokens must be 0 (up to the context) or a positive token count, "
                f"got {value!r}"
            )

    def default_completion_tokens(self, room: int) -> int:
        """The ``max_tokens`` of a chat request that sends none: ``room`` (the context left
        after the prompt, at least 1) capped by :attr:`default_max_tokens` when that is set."""
        room = max(room, 1)
        return min(room, self.default_max_tokens) if self.default_max_tokens else room


#: The reasons a request is refused with 429 (``kvtier_rejected_requests_total``'s label):
#: the server's queue is full (``--max-queued-requests``), its tenant has its most requests
#: in flight, or its tenant holds its share of the KV cache.
REJECT_REASONS = ("queue_full", "tenant_max_requests", "tenant_kv_share")


class Rejections:
    """Requests refused with 429, by reason; a ``prometheus_client`` collector of
    ``kvtier_rejected_requests_total``. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REJECT_REASONS, 0)

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def collect(self) -> Iterable[Any]:
        from prometheus_client.metrics_core import CounterMetricFamily

        family = CounterMetricFamily(
            "kvtier_rejected_requests",
            "Requests refused with HTTP 429 before reaching the engine, by reason",
            labels=["reason"],
        )
        for reason, n in sorted(self.counts().items()):
            family.add_metric([reason], n)
        return [family]


async def _reply(send: Send, status: int, message: str, code: str) -> None:
    body = json_bytes(error_body(message, code=code))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyGuard:
    """ASGI middleware: reads a request body within the size and time limits, then replays it.

    A body over ``max_body_bytes`` is refused with 413 (from ``Content-Length``
    before reading anything, else as soon as the count passes it); one not
    received within ``body_timeout_s`` with 408. The application then reads
    the buffered body as usual, and later ``receive`` calls (disconnect
    checks) go to the client.
    """

    def __init__(self, app: ASGIApp, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.isdigit():
                    await _reply(send, 400, "invalid Content-Length header", "bad_request")
                    return
                if int(value) > limit:
                    await _reply(send, 413, _too_large(limit), "request_too_large")
                    return
        body = bytearray()
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    if len(body) > limit:
                        await _reply(send, 413, _too_large(limit), "request_too_large")
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await _reply(
                send,
                408,
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                "request_timeout",
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _too_large(limit: int) -> str:
    return (
        f"the request body exceeds {limit:,} bytes (the server's --max-request-bytes): "
        "send a shorter prompt"
    )
