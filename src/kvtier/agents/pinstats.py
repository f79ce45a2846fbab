"""What retention pins keep, per level and per session: the ``pins`` section of the stats.

A ``cache_ttl_s`` pin keeps a block on the device and, once the device evicts
it, on every tier that holds it (see :mod:`kvtier.offload.manager`).
:func:`pin_report` counts, for the device and each tier, the blocks a pin
keeps there now, and for the sessions that pinned the most blocks, how many
each keeps on each level. A block counts under the session that first used
it (a prefix two sessions share counts under the first one); blocks of no
session (a ``cache_ttl_s`` without ``session_id``, or keys whose hints the
policy no longer remembers) count in the levels' totals only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

#: Sessions listed at most (those with the most pinned blocks, on every level together).
TOP_SESSIONS = 20


class PinBook(Protocol):
    """What the report reads of the device's policy (the workflow policy)."""

    def resident_pins(self) -> dict[int, float]: ...

    def sessions_of(self, keys: Iterable[int]) -> dict[int, str]: ...


def pin_report(
    policy: PinBook,
    tiers: Mapping[str, Mapping[int, float]],
    now: float,
    *,
    top: int = TOP_SESSIONS,
    keep: Callable[[str], bool] | None = None,
    shown: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """The pins on the device and on ``tiers`` (name -> key -> end), ``now`` on their clock.

    ``keep`` limits the sessions listed (a tenant sees its own), ``shown``
    maps a session id to the one its client knows; ``top`` bounds the list.
    """
    levels: dict[str, Mapping[int, float]] = {"device": policy.resident_pins(), **tiers}
    blocks = {name: len(pins) for name, pins in levels.items()}
    keys: set[int] = set()
    for pins in levels.values():
        keys.update(pins)
    owner = policy.sessions_of(keys)
    per: dict[str, dict[str, int]] = {}
    ends: dict[str, float] = {}
    for name, pins in levels.items():
        for key, until in pins.items():
            sid = owner.get(key)
            if sid is None:
                continue
            counts = per.get(sid)
            if counts is None:
                if keep is not None and not keep(sid):
                    continue
                counts = per[sid] = {}
            counts[name] = counts.get(name, 0) + 1
            if until > ends.get(sid, now):
                ends[sid] = until
    ranked = sorted(per.items(), key=lambda item: (-sum(item[1].values()), item[0]))[:top]
    return {
        "blocks": blocks,
        "sessions_pinned": len(per),
        "sessions_shown": len(ranked),
        "sessions": [
            {
                "session_id": sid if shown is None else shown(sid),
                "blocks": {name: counts.get(name, 0) for name in levels},
                # When its last pin ends, from now.
                "ends_in_s": ends[sid] - now,
            }
            for sid, counts in ranked
        ],
    }
