"""A medium behind a slow link: items in this process, every call paced like a remote store.

``throttled:NAME?latency_ms=20&mb_s=3`` is a tier whose reads and writes
each wait ``latency_ms`` plus their bytes at ``mb_s`` megabytes a second,
as a store across a busy network does, without one. It answers "what if my
tier were this slow" (the load-or-recompute plan, ``bench/load_or_recompute.py``)
on one machine. Items live in a process-wide dict under ``NAME``, so two
tiers of one name see each other's items, like two engines on one store.

It counts as a medium outside the process (``background=True``, no
``in_process``): its work runs on the transfer engine and its payloads
carry checksums, as a real remote store's must.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

from kvtier.errors import ConfigError
from kvtier.offload.media import MediumCaps, PutItem, Stored, blob_view, split_blob

#: Every ThrottledStore's items, by name: two stores of one name share them.
_SHELVES: dict[str, dict[tuple[str, int], bytes]] = {}
_LOCK = threading.Lock()


class ThrottledStore:
    """Items in a process-wide dict, each call paced by ``latency_s`` and ``bytes_per_s``."""

    name = "throttled"
    caps = MediumCaps(background=True, purge=True)

    def __init__(
        self,
        location: str = "default",
        *,
        latency_s: float = 0.0,
        bytes_per_s: float = 0.0,
        pace_writes: bool = True,
    ) -> None:
        if latency_s < 0 or bytes_per_s < 0:
            raise ConfigError(
                f"a throttled medium needs latency >= 0 and bandwidth >= 0 (0: unlimited), "
                f"got {latency_s} s and {bytes_per_s} B/s"
            )
        self.location = location or "default"
        #: Seconds every call waits, and the bytes per second it moves (0: no limit).
        self.latency_s = latency_s
        self.bytes_per_s = bytes_per_s
        #: Whether writes wait too (off: only reads are slow, which is what a load feels).
        self.pace_writes = pace_writes
        self._ns = ""
        #: Calls made and bytes moved (reads and writes), for the curious.
        self.calls = 0
        self.bytes_moved = 0

    def _pace(self, nbytes: int) -> None:
        wait = self.latency_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)
        self.calls += 1
        self.bytes_moved += nbytes
        if wait > 0:
            time.sleep(wait)

    def bind(self, namespace: str, capacity: int, item_bytes: int | None = None) -> None:
        self._ns = namespace
        with _LOCK:
            _SHELVES.setdefault(self.location, {})

    def put(self, items: Sequence[PutItem]) -> None:
        blobs = [(key, bytes(blob_view(fmt, key, payload))) for key, _, payload, fmt in items]
        if self.pace_writes:
            self._pace(sum(len(b) for _, b in blobs))
        with _LOCK:
            shelf = _SHELVES[self.location]
            for key, blob in blobs:
                shelf[(self._ns, key)] = blob

    def get(self, items: Sequence[tuple[int, int]]) -> list[Stored | None]:
        with _LOCK:
            shelf = _SHELVES[self.location]
            blobs = [shelf.get((self._ns, key)) for key, _ in items]
        self._pace(sum(len(b) for b in blobs if b is not None))
        return [None if b is None else split_blob(b) for b in blobs]

    def delete(self, items: Sequence[tuple[int, int]]) -> None:
        self.purge(items)

    def purge(self, items: Sequence[tuple[int, int]]) -> None:
        with _LOCK:
            shelf = _SHELVES.get(self.location, {})
            for key, _ in items:
                shelf.pop((self._ns, key), None)

    def contains(self, keys: Sequence[int]) -> list[bool]:
        with _LOCK:
            shelf = _SHELVES.get(self.location, {})
            return [(self._ns, k) in shelf for k in keys]

    def scan(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


def _number(options: Mapping[str, str], name: str) -> float:
    value = options.get(name, "0")
    try:
        out = float(value)
    except ValueError:
        raise ConfigError(
            f"the throttled medium's {name} must be a number, got {value!r}"
        ) from None
    if not out >= 0:
        raise ConfigError(f"the throttled medium's {name} must be >= 0, got {value!r}")
    return out


def make_throttled_store(location: str, options: Mapping[str, str]) -> ThrottledStore:
    """``throttled:NAME?latency_ms=..&mb_s=..`` (both optional; 0 or absent: no limit)."""
    unknown = sorted(set(options) - {"latency_ms", "mb_s"})
    if unknown:
        raise ConfigError(
            f"the throttled medium has no option {', '.join(unknown)}; it takes latency_ms, mb_s"
        )
    return ThrottledStore(
        location,
        latency_s=_number(options, "latency_ms") / 1e3,
        bytes_per_s=_number(options, "mb_s") * 1e6,
    )
