"""Least-recently-used eviction: the victim is the key released longest ago."""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from kvtier.errors import InternalInvariantError
from kvtier.policy.base import PolicyBase


class LRUPolicy(PolicyBase):
    """LRU over unpinned resident keys; a release (``unpin``) counts as a use.

    ``_order`` holds the evictable keys oldest first; pinned keys sit in
    ``_pinned`` and rejoin the order at the most-recent end when unpinned.
    """

    name: ClassVar[str] = "lru"

    __slots__ = ("_order", "_pinned")

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self._pinned: set[int] = set()

    def insert(self, key: int, pinned: bool = False) -> None:
        if key in self._order or key in self._pinned:
            raise InternalInvariantError(f"key {key:#x} inserted twice into the LRU policy")
        if pinned:
            self._pinned.add(key)
        else:
            self._order[key] = None

    def access(self, key: int) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def pin(self, key: int) -> None:
        try:
            del self._order[key]
        except KeyError:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable") from None
        self._pinned.add(key)

    def unpin(self, key: int) -> None:
        try:
            self._pinned.remove(key)
        except KeyError:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned") from None
        self._order[key] = None

    def remove(self, key: int) -> None:
        if self._order.pop(key, 0) is None:
            return
        self._pinned.discard(key)

    def evict(self) -> int | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pinned

    @property
    def num_evictable(self) -> int:
        return len(self._order)
