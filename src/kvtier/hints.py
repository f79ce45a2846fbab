"""Request hints: what an application tells kvtier about a request, validated once.

A core type: the manager, the policies that look at whole requests, the
engine, the server and the trace reader all take a :class:`Hints` (or
``None``), parsed once where a request enters kvtier (an HTTP body, a trace
line, a Python call) by :func:`parse_hints`. The agent features
(:mod:`kvtier.agents`) are the main reader of the workflow fields, but the
type itself depends on nothing above :mod:`kvtier.errors`.

Hints are optional. A request may carry any of:

* ``session_id``: the conversation (or tool-calling session) the request
  continues; ``parent_session_id`` the session it was forked from;
* ``workflow_id``, ``agent_id``, ``step``: the registered workflow, the
  agent of that workflow making the request, and the step's number (a
  request's ``step`` reports that the agent is executing; an older step than
  one already seen is a retry and reports nothing);
* ``cache_ttl_s``: keep the request's blocks for this many seconds after it
  finishes (a tool call is about to pause the session); capped at
  :data:`MAX_TTL_S`, and the bytes all pins hold are capped by the policy;
* ``reuse``: ``"likely"``, ``"unlikely"`` or ``"never"``, the application's
  guess whether the blocks will be used again;
* ``session_end``: ``true`` when this is the session's last request: its
  TTL pins are released and its own blocks are evicted first.

:func:`parse_hints` turns a mapping (an OpenAI request's ``kvtier`` object,
a trace line's fields, a Python caller's dict) into :class:`Hints`, refusing
unknown names and malformed values with :class:`~kvtier.errors.BadRequestError`
that names the field. Absent hints are ``None`` everywhere and change nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.errors import BadRequestError

Reuse = Literal["likely", "unlikely", "never"]
REUSE_VALUES: tuple[str, ...] = ("likely", "unlikely", "never")
#: The longest TTL pin a request may ask for, in seconds; longer values are capped.
MAX_TTL_S = 600.0
#: Longest id a hint may carry (ids are names, not payloads).
MAX_ID_CHARS = 256
#: Every hint name, in the order the docs list them.
HINT_NAMES: tuple[str, ...] = (
    "session_id",
    "parent_session_id",
    "workflow_id",
    "agent_id",
    "step",
    "cache_ttl_s",
    "reuse",
    "session_end",
)
_IDS = ("session_id", "parent_session_id", "workflow_id", "agent_id")


@dataclass(frozen=True, slots=True)
class Hints:
    """A request's validated hints; every field is optional."""

    session_id: str | None = None
    parent_session_id: str | None = None
    workflow_id: str | None = None
    agent_id: str | None = None
    step: int | None = None
    cache_ttl_s: float | None = None
    reuse: Reuse | None = None
    session_end: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        """The hints that are set, as plain data (what policies receive)."""
        return {name: getattr(self, name) for name in HINT_NAMES if getattr(self, name) is not None}

    def __bool__(self) -> bool:
        return any(getattr(self, name) is not None for name in HINT_NAMES)


def _where(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _ident(value: object, param: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise BadRequestError(
            f"{param} must be a non-empty string of at most {MAX_ID_CHARS} characters, "
            f"got {value!r:.80}",
            param=param,
        )
    return value


def parse_hints(value: object, *, where: str = "kvtier") -> Hints | None:
    """Validate ``value`` (a mapping of hint names, ``Hints`` or ``None``) into :class:`Hints`.

    ``where`` prefixes the field names in error messages (``kvtier.step``).
    ``None`` and an empty mapping give ``None``: no hints.
    """
    if value is None:
        return None
    if isinstance(value, Hints):
        return value if value else None
    if not isinstance(value, Mapping):
        raise BadRequestError(
            f"{where} must be an object of hints ({', '.join(HINT_NAMES)}), "
            f"got {type(value).__name__}",
            param=where,
        )
    unknown = sorted(str(k) for k in value if k not in HINT_NAMES)
    if unknown:
        raise BadRequestError(
            f"unknown hint {unknown[0]!r} in {where}: the hints are {', '.join(HINT_NAMES)}",
            param=_where(where, unknown[0]),
        )
    fields: dict[str, Any] = {}
    for name in _IDS:
        if value.get(name) is not None:
            fields[name] = _ident(value[name], _where(where, name))
    step = value.get("step")
    if step is not None:
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63:
            raise BadRequestError(
                f"{_where(where, 'step')} must be a non-negative integer, got {step!r:.80}",
                param=_where(where, "step"),
            )
        fields["step"] = step
    ttl = value.get("cache_ttl_s")
    if ttl is not None:
        if (
            not isinstance(ttl, int | float)
            or isinstance(ttl, bool)
            or not math.isfinite(ttl)
            or ttl < 0
        ):
            raise BadRequestError(
                f"{_where(where, 'cache_ttl_s')} must be a finite number of seconds >= 0, "
                f"got {ttl!r:.80}",
                param=_where(where, "cache_ttl_s"),
            )
        fields["cache_ttl_s"] = min(float(ttl), MAX_TTL_S)
    reuse = value.get("reuse")
    if reuse is not None:
        if reuse not in REUSE_VALUES:
            raise BadRequestError(
                f"{_where(where, 'reuse')} must be one of {', '.join(REUSE_VALUES)}, "
                f"got {reuse!r:.80}",
                param=_where(where, "reuse"),
            )
        fields["reuse"] = reuse
    end = value.get("session_end")
    if end is not None:
        if not isinstance(end, bool):
            raise BadRequestError(
                f"{_where(where, 'session_end')} must be true or false, got {end!r:.80}",
                param=_where(where, "session_end"),
            )
        if end and "session_id" not in fields:
            raise BadRequestError(
                f"{where}: session_end ends a session; give its session_id with it",
                param=_where(where, "session_end"),
            )
        fields["session_end"] = end or None
    if ("workflow_id" in fields) != ("agent_id" in fields) and "step" in fields:
        raise BadRequestError(
            f"{where}: step reports a workflow agent's progress; give workflow_id and agent_id "
            "with it",
            param=_where(where, "step"),
        )
    hints = Hints(**fields)
    return hints if hints else None
