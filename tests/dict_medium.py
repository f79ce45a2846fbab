"""A storage medium defined outside kvtier: items in a dict, written in the background.

It shows what adding a medium takes: one module with the class and the
registration line at the bottom. A tier URL ``dict:NAME?module=dict_medium``
imports this module, which registers it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from kvtier.offload.codec import make_header
from kvtier.offload.media import MediumCaps, PutItem, Stored
from kvtier.offload.registry import register_medium

#: Every DictStore's items, by location: two stores at one location share them.
SHELVES: dict[str, dict[tuple[str, int], Stored]] = {}
_LOCK = threading.Lock()


class DictStore:
    """Encoded items in a process-wide dict; a stand-in for a remote key-value store."""

    name = "dict"
    caps = MediumCaps(background=True, shared=True, purge=True)

    def __init__(self, location: str) -> None:
        self.location = location
        self._ns = ""
        self.puts = 0

    def bind(self, namespace: str, capacity: int, item_bytes: int | None = None) -> None:
        self._ns = namespace
        with _LOCK:
            SHELVES.setdefault(self.location, {})

    def put(self, items: Sequence[PutItem]) -> None:
        with _LOCK:
            shelf = SHELVES[self.location]
            for key, _slot, payload, fmt in items:
                data = payload.cpu().clone()
                shelf[(self._ns, key)] = (
                    make_header(fmt.codec, key, fmt.shape, fmt.dtype, data),
                    data,
                )
            self.puts += len(items)

    def get(self, items: Sequence[tuple[int, int]]) -> list[Stored | None]:
        with _LOCK:
            shelf = SHELVES[self.location]
            return [shelf.get((self._ns, key)) for key, _ in items]

    def delete(self, items: Sequence[tuple[int, int]]) -> None:
        pass  # shared: other engines may still want it

    def purge(self, items: Sequence[tuple[int, int]]) -> None:
        with _LOCK:
            for key, _ in items:
                SHELVES[self.location].pop((self._ns, key), None)

    def contains(self, keys: Sequence[int]) -> list[bool]:
        with _LOCK:
            shelf = SHELVES[self.location]
            return [(self._ns, k) in shelf for k in keys]

    def scan(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


def _make(location: str, options: Mapping[str, str]) -> DictStore:
    return DictStore(location or "default")


register_medium("dict", _make)
