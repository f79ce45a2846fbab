"""What a tenant changes in a request: its cache salt, its hint ids, its images' keys.

A request's effective cache salt (what the engine mixes into every block
key, :meth:`~kvtier.engine.Engine.add_request`) is built from the tenant of
its API key and the ``cache_salt`` it sends:

==================  ==================  ==============================
tenant              ``cache_salt``      effective salt
==================  ==================  ==============================
none                none                none (shared with every such request)
none                ``s``               ``s`` (vLLM's behaviour)
``t``               none                ``t<US>``
``t``               ``s``               ``t<US>s``
==================  ==================  ==============================

``<US>`` is the unit separator ``\\x1f``, which a request's salt may not
hold (control characters are refused), so no request can name another
tenant's salt. A composed salt over the engine's limit keeps the tenant and
a SHA-256 digest of the request's salt.

Workflow, session and parent-session ids of a tenant's requests (the
``kvtier`` hints, ``/v1/workflows``) are scoped the same way, so a tenant
neither sees nor drives another's workflows; images' encoder-cache keys
carry the effective salt as well.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.engine.processor import MAX_CACHE_SALT_CHARS, check_cache_salt
from kvtier.errors import BadRequestError
from kvtier.hints import Hints
from kvtier.server.auth import tenant_of

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine

#: Separates a tenant from what it scopes (a salt, a workflow id); never in a request's salt.
SEPARATOR = "\x1f"
#: The longest cache salt the engine takes, and so the longest a request may send.
MAX_SALT_CHARS = MAX_CACHE_SALT_CHARS


def check_request_salt(salt: object) -> str | None:
    """A request's ``cache_salt``, validated (400 naming ``cache_salt`` otherwise)."""
    check_cache_salt(salt)
    if salt is None:
        return None
    assert isinstance(salt, str)
    # Over HTTP control characters are refused too: SEPARATOR is one, so no
    # request can name another tenant's namespace.
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in salt):
        raise BadRequestError("cache_salt must not hold control characters", param="cache_salt")
    return salt


def effective_salt(tenant: str | None, salt: str | None) -> str | None:
    """The salt the engine gets for a request of ``tenant`` sending ``salt`` (see above)."""
    salt = check_request_salt(salt)
    if tenant is None:
        return salt
    out = f"{tenant}{SEPARATOR}{salt or ''}"
    if len(out) > MAX_SALT_CHARS:
        assert salt is not None
        out = f"{tenant}{SEPARATOR}#{hashlib.sha256(salt.encode()).hexdigest()}"
    return out


def scoped_id(tenant: str | None, ident: str, param: str = "workflow_id") -> str:
    """``ident`` (a workflow or session id) in ``tenant``'s namespace.

    An id holding the separator is refused (400), so no id names another namespace.
    """
    if SEPARATOR in ident:
        raise BadRequestError(f"{param} must not hold control characters", param=param)
    return ident if tenant is None else f"{tenant}{SEPARATOR}{ident}"


def shown_id(tenant: str | None, ident: str) -> str:
    """The id a client of ``tenant`` knows for the scoped ``ident``."""
    if tenant is None:
        return ident
    prefix = f"{tenant}{SEPARATOR}"
    return ident[len(prefix) :] if ident.startswith(prefix) else ident


def scope_hints(hints: Hints | None, tenant: str | None) -> Hints | None:
    """``hints`` with their workflow and session ids in ``tenant``'s namespace."""
    if hints is None:
        return hints

    def scoped(value: str | None, name: str) -> str | None:
        return None if value is None else scoped_id(tenant, value, f"kvtier.{name}")

    out = dataclasses.replace(
        hints,
        workflow_id=scoped(hints.workflow_id, "workflow_id"),
        session_id=scoped(hints.session_id, "session_id"),
        parent_session_id=scoped(hints.parent_session_id, "parent_session_id"),
    )
    return hints if tenant is None else out


def for_tenant(
    scope: MutableMapping[str, Any], cache_salt: str | None, hints: Hints | None
) -> tuple[str | None, Hints | None]:
    """A request's effective cache salt and scoped hints, from its ASGI scope's tenant."""
    tenant = tenant_of(scope)
    return effective_salt(tenant, cache_salt), scope_hints(hints, tenant)


def encode_images_for(
    engine: Engine,
    messages: list[dict[str, Any]],
    items: Sequence[Any],
    salt: str | None,
) -> tuple[list[int], Any]:
    """Token ids and multimodal prompt of a chat with images, its encoder keys under ``salt``.

    Without a salt this is :meth:`Engine.encode_multimodal_chat`.
    """
    cache = engine.encoder_cache
    if salt is None or engine.vlm is None:
        return engine.encode_multimodal_chat(messages, items)
    from kvtier.mm.keys import ItemKeyer
    from kvtier.mm.prompt import build_chat_prompt

    if not messages:
        raise BadRequestError("messages must be a non-empty list", param="messages")
    keyer = cache.keyer.salted(salt) if cache is not None else ItemKeyer(f"{SEPARATOR}{salt}")
    return build_chat_prompt(engine.vlm, list(messages), items, cache=cache, keyer=keyer)


__all__ = [
    "SEPARATOR",
    "check_request_salt",
    "effective_salt",
    "encode_images_for",
    "for_tenant",
    "scope_hints",
    "scoped_id",
    "shown_id",
]
