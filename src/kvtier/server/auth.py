"""Who is asking: API keys, their tenants, the admin key, and the guard that checks them.

:class:`ServerAuth` holds what ``kvtier serve`` was given (``--api-key``,
``--api-key-file``, ``KVTIER_API_KEY``, ``--admin-key``,
``--metrics-require-key``, ``--migrate-peer``); :class:`AuthGuard` is the
ASGI middleware that enforces it in front of the application:

* ``/health`` is always open;
* ``/metrics`` is open unless ``metrics_require_key`` (then an API key or the
  admin key opens it);
* ``/admin/...`` answers 404 unless an admin key is configured, then 401
  without a valid key and 403 for an API key that is not the admin key;
* everything else needs ``Authorization: Bearer KEY`` with one of the API
  keys once any is configured (401 otherwise, OpenAI's ``invalid_api_key``
  error); with none configured the server is open, as it always was.

Keys are compared in constant time: the presented key's SHA-256 digest is
compared with :func:`hmac.compare_digest` against every configured key's,
without stopping at a match, so neither the position of a match nor a
common prefix shows in the time an answer takes. Keys never appear in
logs, error messages or ``repr``.

An API key may belong to a tenant (``KEY:TENANT`` on the command line,
``KEY TENANT`` in a key file): the guard puts the tenant in the request's
scope (:func:`tenant_of`), and the server mixes it into the request's cache
salt (:mod:`kvtier.server.tenants`), so tenants never share cached prefixes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The environment variable that adds one API key (``KEY`` or ``KEY:TENANT``).
API_KEY_ENV = "KVTIER_API_KEY"
#: The environment variable that sets the admin key when ``--admin-key`` is not given.
ADMIN_KEY_ENV = "KVTIER_ADMIN_KEY"
#: Where the guard leaves the tenant of an authenticated request in its ASGI scope.
TENANT_SCOPE_KEY = "kvtier.tenant"

#: A tenant name: letters, digits, ``.``, ``_``, ``-``; at most 64 characters.
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KEY_PATTERN = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces
MAX_KEY_CHARS = 512


def _check_key(key: str, where: str) -> None:
    # Messages never echo the key itself.
    if not key:
        raise ConfigError(f"{where}: an API key must not be empty")
    if len(key) > MAX_KEY_CHARS or not _KEY_PATTERN.fullmatch(key):
        raise ConfigError(
            f"{where}: an API key must be 1 to {MAX_KEY_CHARS} printable ASCII characters "
            "without spaces"
        )


def _check_tenant(tenant: str, where: str) -> None:
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ConfigError(
            f"{where}: tenant {tenant!r:.80} must be 1 to 64 letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit)"
        )


@dataclass(frozen=True)
class ApiKey:
    """One API key and the tenant it belongs to (``None``: the shared default tenant)."""

    key: str = field(repr=False)
    tenant: str | None = None


def parse_api_key(text: str, where: str = "--api-key") -> ApiKey:
    """``KEY`` or ``KEY:TENANT`` (a key holding ``:`` must come from a key file)."""
    key, sep, tenant = text.strip().partition(":")
    _check_key(key, where)
    if sep:
        _check_tenant(tenant, where)
        return ApiKey(key, tenant)
    return ApiKey(key)


def read_api_key_file(path: str) -> tuple[list[ApiKey], list[str]]:
    """The keys of a key file, and warnings (a file others may read).

    One key a line, optionally followed by whitespace and its tenant (``KEY
    TENANT``); blank lines and lines starting with ``#`` are skipped.
    """
    expanded = os.path.expanduser(path)
    try:
        with open(expanded, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        mode = os.stat(expanded).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc}") from None
    warnings = []
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        warnings.append(f"the API key file {path} may be read by other users: chmod 600 it")
    keys: list[ApiKey] = []
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        fields = text.split()
        where = f"{path}, line {n}"
        if len(fields) > 2:
            raise ConfigError(f"{where}: write one key a line, optionally followed by its tenant")
        _check_key(fields[0], where)
        if len(fields) == 2:
            _check_tenant(fields[1], where)
            keys.append(ApiKey(fields[0], fields[1]))
        else:
            keys.append(ApiKey(fields[0]))
    if not keys:
        raise ConfigError(f"the API key file {path} holds no key")
    return keys, warnings


def normalize_peer(url: str, where: str = "--migrate-peer") -> str:
    """``url`` as ``scheme://host:port[/path]`` (lowercase, explicit port, no trailing slash)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: expected an http(s)://host:port URL, got {url!r:.200}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ConfigError(f"{where}: give the server's base URL only, got {url!r:.200}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ConfigError(f"{where}: bad port in {url!r:.200}") from None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}{parts.path.rstrip('/')}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ServerAuth:
    """Who may call what (see the module docstring). The default: open, admin endpoints off."""

    api_keys: tuple[ApiKey, ...] = ()
    #: The key of the ``/admin/...`` endpoints; ``None``: they answer 404.
    admin_key: str | None = field(default=None, repr=False)
    #: Whether ``/metrics`` needs a key too.
    metrics_require_key: bool = False
    #: Base URLs ``/admin/migrate`` may move requests to (normalized by :func:`normalize_peer`).
    migrate_peers: tuple[str, ...] = ()
    _digests: tuple[bytes, ...] = field(default=(), init=False, repr=False, compare=False)
    _admin_digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for k in self.api_keys:
            _check_key(k.key, "API keys")
            if k.tenant is not None:
                _check_tenant(k.tenant, "API keys")
            if k.key in seen:
                raise ConfigError(
                    "the same API key is given twice"
                    + (" (with different tenants)" if k.tenant is not None else "")
                    + ": give each key once"
                )
            seen.add(k.key)
        if self.admin_key is not None:
            _check_key(self.admin_key, "--admin-key")
            if self.admin_key in seen:
                raise ConfigError("the admin key must differ from every API key")
        if self.metrics_require_key and not self.api_keys and self.admin_key is None:
            raise ConfigError("--metrics-require-key needs an --api-key or --admin-key")
        peers = tuple(normalize_peer(p) for p in self.migrate_peers)
        object.__setattr__(self, "migrate_peers", peers)
        object.__setattr__(self, "_digests", tuple(_digest(k.key) for k in self.api_keys))
        if self.admin_key is not None:
            object.__setattr__(self, "_admin_digest", _digest(self.admin_key))

    @property
    def open(self) -> bool:
        """Whether the API takes requests without a key (no API key is configured)."""
        return not self.api_keys

    @property
    def admin_enabled(self) -> bool:
        return self.admin_key is not None

    def tenants(self) -> list[str]:
        return sorted({k.tenant for k in self.api_keys if k.tenant is not None})

    def identify(self, token: str) -> ApiKey | None:
        """The API key ``token`` is, compared in constant time against every key."""
        got = _digest(token)
        found: ApiKey | None = None
        for key, want in zip(self.api_keys, self._digests, strict=True):
            if hmac.compare_digest(got, want):
                found = key
        return found

    def is_admin(self, token: str) -> bool:
        """Whether ``token`` is the admin key (constant time)."""
        return self.admin_key is not None and hmac.compare_digest(
            _digest(token), self._admin_digest
        )

    def peer_allowed(self, url: str) -> bool:
        """Whether ``url`` (a server's base URL) is one of the migrate peers."""
        try:
            peer = normalize_peer(url, "target")
        except ConfigError:
            return False
        return peer in self.migrate_peers

    def describe(self) -> list[str]:
        """Startup banner lines; never a key."""
        lines: list[str] = []
        if self.open:
            lines.append(
                "API keys: none configured: the API is open to anyone who can reach the port "
                "(--api-key, --api-key-file or KVTIER_API_KEY close it)"
            )
        else:
            n = len(self.api_keys)
            tenants = self.tenants()
            shown = f"; tenants: {', '.join(tenants)}" if tenants else ""
            lines.append(f"API keys: {n} configured{shown}")
        metrics = "needs a key" if self.metrics_require_key else "open"
        lines.append(f"/health: open; /metrics: {metrics}")
        if self.admin_key is None:
            lines.append("admin endpoints (/admin/...): off (--admin-key turns them on)")
        else:
            peers = len(self.migrate_peers)
            lines.append(
                "admin endpoints (/admin/...): on, they need the admin key; migrations to "
                + (f"{peers} allowed peer{'s' if peers != 1 else ''}" if peers else "no peer "
                   "(--migrate-peer URL allows one)")
            )  # fmt: skip
        return lines


def build_auth(
    api_keys: Iterable[str] = (),
    key_files: Iterable[str] = (),
    *,
    env: MutableMapping[str, str] | None = None,
    admin_key: str | None = None,
    metrics_require_key: bool = False,
    migrate_peers: Iterable[str] = (),
) -> tuple[ServerAuth, list[str]]:
    """A :class:`ServerAuth` from ``kvtier serve``'s flags and environment, and warnings."""
    env = os.environ if env is None else env
    keys = [parse_api_key(text) for text in api_keys]
    warnings: list[str] = []
    for path in key_files:
        more, warned = read_api_key_file(path)
        keys.extend(more)
        warnings.extend(warned)
    from_env = env.get(API_KEY_ENV)
    if from_env:
        keys.append(parse_api_key(from_env, API_KEY_ENV))
    if admin_key is None:
        admin_key = env.get(ADMIN_KEY_ENV) or None
    auth = ServerAuth(
        tuple(keys),
        admin_key=admin_key,
        metrics_require_key=metrics_require_key,
        migrate_peers=tuple(migrate_peers),
    )
    if auth.migrate_peers and not auth.admin_enabled:
        warnings.append("--migrate-peer has no effect without --admin-key")
    return auth, warnings


def tenant_of(scope: Scope) -> str | None:
    """The tenant of the API key that authenticated this request (``None``: no tenant)."""
    tenant = scope.get(TENANT_SCOPE_KEY)
    return str(tenant) if isinstance(tenant, str) else None


def bearer_token(scope: Scope) -> str | None:
    """The key of the request's ``Authorization: Bearer KEY`` header, if any."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            text: str = bytes(value).decode("latin-1")
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


async def _reply(
    send: Send,
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    code: str | None = None,
    challenge: bool = False,
) -> None:
    from kvtier.server.protocol import error_body
    from kvtier.server.streaming import json_bytes

    body = json_bytes(error_body(message, type=type_, code=code))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if challenge:
        headers.append((b"www-authenticate", b'Bearer realm="kvtier"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_INVALID = "Incorrect API key provided."


class AuthGuard:
    """ASGI middleware enforcing a :class:`ServerAuth` (see the module docstring)."""

    def __init__(self, app: ASGIApp, auth: ServerAuth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        auth = self.auth
        path = str(scope.get("path", ""))
        scope.pop(TENANT_SCOPE_KEY, None)
        if path == "/health":
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        if path == "/admin" or path.startswith("/admin/"):
            if not auth.admin_enabled:
                method = scope.get("method", "GET")
                await _reply(send, 404, f"Invalid URL ({method} {path})")
                return
            if token is None:
                await _reply(send, 401, _MISSING, code="invalid_api_key", challenge=True)
                return
            if not auth.is_admin(token):
                if auth.identify(token) is not None:
                    await _reply(
                        send,
                        403,
                        "the admin endpoints need the admin key, not an API key",
                        type_="permission_error",
                        code="insufficient_permissions",
                    )
                else:
                    await _reply(send, 401, _INVALID, code="invalid_api_key", challenge=True)
                return
            await self.app(scope, receive, send)
            return
        if path == "/metrics":
            if not auth.metrics_require_key or (token is not None and auth.is_admin(token)):
                await self.app(scope, receive, send)
                return
        elif auth.open:
            await self.app(scope, receive, send)
            return
        key = None if token is None else auth.identify(token)
        if key is None:
            message = _MISSING if token is None else _INVALID
            await _reply(send, 401, message, code="invalid_api_key", challenge=True)
            return
        scope[TENANT_SCOPE_KEY] = key.tenant
        await self.app(scope, receive, send)


__all__ = [
    "ADMIN_KEY_ENV",
    "API_KEY_ENV",
    "ApiKey",
    "AuthGuard",
    "ServerAuth",
    "bearer_token",
    "build_auth",
    "normalize_peer",
    "parse_api_key",
    "read_api_key_file",
    "tenant_of",
]
