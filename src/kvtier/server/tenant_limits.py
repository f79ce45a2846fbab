"""Per-tenant admission limits of ``kvtier serve``: requests in flight and a share of the KV cache.

A tenant is what an API key maps to (``--api-key KEY:TENANT``,
:mod:`kvtier.server.auth`); requests whose key has no tenant, and every
request of a server without keys, are one shared *anonymous* tenant here.
Two limits, each optional, have a default for every tenant and may be
overridden per tenant (``--tenant-limit TENANT:max_requests=N,max_kv_fraction=F``):

* ``max_requests``: requests of the tenant in the server at once, waiting
  or running. One more is answered 429 (``Retry-After``) at admission;
* ``max_kv_fraction``: when the tenant's queued requests already hold at
  least this share of the device's KV blocks (distinct blocks: a prefix two
  of them share counts once), a new request of the tenant is answered 429.
  It is checked at admission only: a running request is never preempted
  for it, so a tenant's requests may grow past the share once admitted.

A request counts from its admission (before its prompt is tokenized) until
it leaves the engine: it finished, was cancelled (its client went away, or
``/admin/requests/{id}/cancel``), failed, or moved to another server
(``/admin/migrate``); a request refused after admission (a bad prompt, the
engine stopped) is released when its response is sent. A request with
``n`` choices counts once. A request that moved here from another server
(``/admin/migrate/accept``) is not counted: the admin moved it, no tenant
asked for it.

:class:`TenantCounter` is the thread-safe bookkeeping (released on the
engine's thread as well as the event loop's); :class:`TenantGate` applies
the limits to the server's requests; :class:`TicketGuard` is the ASGI
middleware that releases a ticket whose request never reached the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import types
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError, KvTierError
from kvtier.server.auth import TENANT_PATTERN, tenant_of

if TYPE_CHECKING:
    from kvtier.engine.worker import EngineWorker, RequestHandle

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Where a request's admission ticket waits in its ASGI scope until its handle takes it.
TICKET_SCOPE_KEY = "kvtier.tenant_ticket"

_SETTING = re.compile(r"\s*([a-z_]+)\s*=\s*(\S+)\s*")


@dataclass(frozen=True)
class TenantLimit:
    """One tenant's limits (``None``: unlimited)."""

    #: Requests in the server at once, waiting or running.
    max_requests: int | None = None
    #: Share of the device's KV blocks the tenant's requests may hold before new ones are
    #: refused, in (0, 1].
    max_kv_fraction: float | None = None

    def __post_init__(self) -> None:
        n = self.max_requests
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigError(
                f"a tenant's max_requests must be a positive number of requests, got {n!r} "
                "(leave it out for no limit)"
            )
        f = self.max_kv_fraction
        if f is not None and (
            isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 < f <= 1.0
        ):
            raise ConfigError(
                f"a tenant's max_kv_fraction must be a share of the KV cache in (0, 1], e.g. "
                f"0.5, got {f!r} (leave it out for no limit)"
            )

    @property
    def limited(self) -> bool:
        return self.max_requests is not None or self.max_kv_fraction is not None

    def as_dict(self) -> dict[str, Any]:
        return {"max_requests": self.max_requests, "max_kv_fraction": self.max_kv_fraction}


@dataclass(frozen=True)
class TenantLimits:
    """Every tenant's limits: a default and per-tenant overrides (see the module docstring).

    An override replaces the default's settings it names and keeps the others.
    """

    default: TenantLimit = TenantLimit()
    overrides: Mapping[str, TenantLimit] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.overrides:
            if not isinstance(name, str) or not TENANT_PATTERN.fullmatch(name):
                raise ConfigError(
                    f"tenant {name!r:.80} must be 1 to 64 letters, digits, '.', '_' or '-' "
                    "(starting with a letter or digit)"
                )
        object.__setattr__(self, "overrides", types.MappingProxyType(dict(self.overrides)))

    def __hash__(self) -> int:  # a mapping proxy is unhashable; the limits are not
        return hash((self.default, tuple(sorted(self.overrides.items()))))

    @property
    def enabled(self) -> bool:
        """Whether any tenant has a limit."""
        return self.default.limited or any(o.limited for o in self.overrides.values())

    def for_tenant(self, tenant: str | None) -> TenantLimit:
        """The limits of ``tenant`` (``None``: the anonymous tenant, which has the default)."""
        if tenant is None:
            return self.default
        return self.overrides.get(tenant, self.default)

    def check_tenants(self, known: Iterable[str]) -> None:
        """Refuse overrides for tenants no API key belongs to (a misspelt name would leave
        the tenant it meant unlimited)."""
        names = set(known)
        unknown = sorted(set(self.overrides) - names)
        if unknown:
            declared = ", ".join(sorted(names)) or "none"
            raise ConfigError(
                f"--tenant-limit names tenant {unknown[0]!r}, which no API key belongs to "
                f"(tenants of the keys: {declared}); declare it with --api-key KEY:TENANT or "
                "a 'KEY TENANT' line of --api-key-file"
            )

    def describe(self) -> str:
        """One banner line."""
        if not self.enabled:
            return "per-tenant limits: none (--tenant-max-requests, --tenant-max-kv-fraction)"
        d = self.default
        parts = [
            f"{d.max_requests} requests" if d.max_requests else "no request limit",
            f"{d.max_kv_fraction:g} of the KV cache" if d.max_kv_fraction else "no KV limit",
        ]
        more = f"; {len(self.overrides)} tenant override(s)" if self.overrides else ""
        return f"per-tenant limits: {', '.join(parts)} per tenant{more}"


def parse_tenant_limit(
    text: str, default: TenantLimit = TenantLimit(), where: str = "--tenant-limit"
) -> tuple[str, TenantLimit]:
    """``TENANT:max_requests=N,max_kv_fraction=F`` (either setting may be left out, and then
    keeps ``default``'s): the tenant and its limits."""
    tenant, sep, rest = str(text).strip().partition(":")
    usage = (
        f"{where}: expected TENANT:max_requests=N,max_kv_fraction=F (either setting may be "
        f"left out), got {str(text)!r:.120}"
    )
    if not sep or not rest.strip():
        raise ConfigError(usage)
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ConfigError(
            f"{where}: tenant {tenant!r:.80} must be 1 to 64 letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit)"
        )
    settings: dict[str, Any] = {}
    for part in rest.split(","):
        m = _SETTING.fullmatch(part)
        if m is None:
            raise ConfigError(usage)
        name, value = m.groups()
        if name in settings:
            raise ConfigError(f"{where}: {name} is given twice for tenant {tenant!r}")
        kinds: dict[str, Callable[[str], Any]] = {"max_requests": int, "max_kv_fraction": float}
        kind = kinds.get(name)
        if kind is None:
            raise ConfigError(
                f"{where}: unknown setting {name!r} for tenant {tenant!r}; the settings are "
                "max_requests and max_kv_fraction"
            )
        try:
            settings[name] = kind(value)
        except ValueError:
            raise ConfigError(
                f"{where}: {name} of tenant {tenant!r}: not a number: {value!r}"
            ) from None
    try:
        limit = TenantLimit(
            max_requests=settings.get("max_requests", default.max_requests),
            max_kv_fraction=settings.get("max_kv_fraction", default.max_kv_fraction),
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: tenant {tenant!r}: {exc}") from None
    return tenant, limit


def build_tenant_limits(
    max_requests: int | None = None,
    max_kv_fraction: float | None = None,
    overrides: Iterable[str] = (),
) -> TenantLimits:
    """The limits ``--tenant-max-requests``, ``--tenant-max-kv-fraction`` and the
    ``--tenant-limit`` specs describe (ConfigError naming the flag otherwise)."""
    try:
        default = TenantLimit(max_requests, max_kv_fraction)
    except ConfigError as exc:
        flag = "--tenant-max-requests" if "max_requests" in str(exc) else "--tenant-max-kv-fraction"
        raise ConfigError(f"{flag}: {exc}") from None
    per: dict[str, TenantLimit] = {}
    for spec in overrides:
        tenant, limit = parse_tenant_limit(spec, default)
        if tenant in per:
            raise ConfigError(
                f"--tenant-limit: tenant {tenant!r} is given twice: give each tenant once"
            )
        per[tenant] = limit
    return TenantLimits(default, per)


# -- bookkeeping --------------------------------------------------------------------------


@dataclass(frozen=True)
class Ticket:
    """One admitted request's place in its tenant's count."""

    id: int
    tenant: str | None


class TenantCounter:
    """Requests in flight per tenant: admission takes a :class:`Ticket`, leaving returns it.

    Thread-safe. :meth:`acquire` checks and counts at once, so concurrent
    admissions never pass a limit together. :meth:`release` of a ticket not
    held (never issued here, or already released) is a no-op that returns
    ``False``: several paths may end a request (its handle leaving the
    engine, its response being sent) and whichever comes first releases it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._held: dict[int, Ticket] = {}
        self._counts: dict[str | None, int] = {}
        #: Tickets whose request reached the engine: the engine's request id.
        self._bound: dict[int, str] = {}

    def acquire(self, tenant: str | None, limit: int | None) -> Ticket | None:
        """A ticket for one more request of ``tenant``, or ``None`` when it already has
        ``limit`` in flight (``None``: no limit)."""
        with self._lock:
            n = self._counts.get(tenant, 0)
            if limit is not None and n >= limit:
                return None
            ticket = Ticket(next(self._ids), tenant)
            self._held[ticket.id] = ticket
            self._counts[tenant] = n + 1
            return ticket

    def release(self, ticket: Ticket) -> bool:
        """Return ``ticket``; ``False`` (and nothing changes) when it is not held."""
        with self._lock:
            held = self._held.pop(ticket.id, None)
            if held is None:
                return False
            self._bound.pop(ticket.id, None)
            n = self._counts[held.tenant] - 1
            if n:
                self._counts[held.tenant] = n
            else:
                del self._counts[held.tenant]
            return True

    def bind(self, ticket: Ticket, request_id: str) -> bool:
        """Note the engine's id of ``ticket``'s request; ``False`` when the ticket is not held."""
        with self._lock:
            if ticket.id not in self._held:
                return False
            self._bound[ticket.id] = request_id
            return True

    def holds(self, ticket: Ticket) -> bool:
        with self._lock:
            return ticket.id in self._held

    def count(self, tenant: str | None) -> int:
        with self._lock:
            return self._counts.get(tenant, 0)

    def counts(self) -> dict[str | None, int]:
        """Requests in flight per tenant with any (``None``: the anonymous tenant)."""
        with self._lock:
            return dict(self._counts)

    def request_ids(self, tenant: str | None) -> list[str]:
        """The engine's ids of ``tenant``'s requests that reached it."""
        with self._lock:
            return [rid for tid, rid in self._bound.items() if self._held[tid].tenant == tenant]


# -- applying the limits to the server's requests ----------------------------------------


class TenantLimitExceeded(KvTierError):
    """A tenant is at one of its limits; ``reason`` is ``tenant_max_requests`` or
    ``tenant_kv_share`` (the label of ``kvtier_rejected_requests_total``)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class TenantGate:
    """The server's side of the limits: admits a request (once per request, however often
    the endpoint asks), hands its ticket to the engine's handle, releases what is left."""

    def __init__(self, limits: TenantLimits, worker: EngineWorker) -> None:
        self.limits = limits
        self.worker = worker
        self.counter = TenantCounter()

    async def admit(self, scope: Scope) -> None:
        """Count the scope's request against its tenant, or raise
        :class:`TenantLimitExceeded`. A request admitted before passes again."""
        if scope.get(TICKET_SCOPE_KEY) is not None:
            return
        tenant = tenant_of(scope)
        limit = self.limits.for_tenant(tenant)
        ticket = self.counter.acquire(tenant, limit.max_requests)
        if ticket is None:
            raise TenantLimitExceeded(
                f"too many requests of {_who(tenant)}: {limit.max_requests} are already queued "
                "or running (the server's per-tenant limit, --tenant-max-requests or "
                "--tenant-limit); retry after the Retry-After header's seconds",
                "tenant_max_requests",
            )
        try:
            if limit.max_kv_fraction is not None:
                await self._check_kv(tenant, limit.max_kv_fraction)
        except BaseException:
            self.counter.release(ticket)
            raise
        scope[TICKET_SCOPE_KEY] = ticket

    async def _check_kv(self, tenant: str | None, fraction: float) -> None:
        rids = self.counter.request_ids(tenant)
        if not rids:  # nothing of the tenant's in the engine: it holds no block
            return
        held, total = await asyncio.to_thread(self.worker.blocks_held, rids)
        if total and held >= fraction * total:
            raise TenantLimitExceeded(
                f"{_who(tenant)} already holds {held} of the {total} KV cache blocks, at least "
                f"its share of {fraction:g} (the server's --tenant-max-kv-fraction or "
                "--tenant-limit); retry after the Retry-After header's seconds, when some of "
                "its requests have finished",
                "tenant_kv_share",
            )

    def bind(self, scope: Scope, handle: RequestHandle) -> None:
        """The scope's request reached the engine as ``handle``: its ticket is released
        once the request leaves the engine (:meth:`EngineWorker.on_leave`)."""
        ticket = scope.pop(TICKET_SCOPE_KEY, None)
        if not isinstance(ticket, Ticket):
            return
        counter = self.counter

        def release() -> None:
            counter.release(ticket)

        if counter.bind(ticket, handle.request_id):
            self.worker.on_leave(handle.request_id, release)

    def release_unbound(self, scope: Scope) -> None:
        """Release the ticket of a request that was admitted but never reached the engine."""
        ticket = scope.pop(TICKET_SCOPE_KEY, None)
        if isinstance(ticket, Ticket):
            self.counter.release(ticket)

    def caller_view(self, tenant: str | None) -> dict[str, Any]:
        """What ``/v1/cache/stats`` shows a caller: its own tenant's count and limits."""
        return {
            "name": tenant,
            "in_flight": self.counter.count(tenant),
            **self.limits.for_tenant(tenant).as_dict(),
        }

    def admin_view(self, declared: Iterable[str]) -> dict[str, Any]:
        """Every tenant's count and limits (names only, never keys), for ``/admin/tenants``."""
        counts = self.counter.counts()
        names = sorted({*declared, *self.limits.overrides, *(t for t in counts if t is not None)})
        return {
            "default": self.limits.default.as_dict(),
            "anonymous": {"in_flight": counts.get(None, 0), **self.limits.default.as_dict()},
            "tenants": {
                name: {"in_flight": counts.get(name, 0), **self.limits.for_tenant(name).as_dict()}
                for name in names
            },
        }


def _who(tenant: str | None) -> str:
    return "the anonymous tenant" if tenant is None else f"tenant {tenant!r}"


class TicketGuard:
    """ASGI middleware: once a request's response is over, release its ticket if the
    request never reached the engine (refused after admission, or failed before it)."""

    def __init__(self, app: ASGIApp, gate: TenantGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.release_unbound(scope)


__all__ = [
    "TICKET_SCOPE_KEY",
    "TenantCounter",
    "TenantGate",
    "TenantLimit",
    "TenantLimitExceeded",
    "TenantLimits",
    "Ticket",
    "TicketGuard",
    "build_tenant_limits",
    "parse_tenant_limit",
]
