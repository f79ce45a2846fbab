"""Least-recently-used eviction: the victim is the key released longest ago."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from kvtier.errors import InternalInvariantError
from kvtier.policy.base import PolicyBase


@mypyc_attr(allow_interpreted_subclasses=True)
class LRUPolicy(PolicyBase):
    """LRU over unpinned resident keys; a release (``unpin``) counts as a use.

    ``_order`` holds the evictable keys oldest first; pinned keys sit in
    ``_pinned`` and rejoin the order at the most-recent end when unpinned.
    """

    name: ClassVar[str] = "lru"

    __slots__ = ("_order", "_pinned", "_size_extra", "_sizes", "capacity", "key_capacity")

    def __init__(self) -> None:
        # Assigned here, not by PolicyBase.__init__: mypyc compiles this class
        # and needs every attribute it touches declared in it.
        self.capacity = 0
        self.key_capacity = 0
        self._sizes: dict[int, int] = {}
        self._size_extra = 0
        self._order: OrderedDict[int, None] = OrderedDict()
        self._pinned: set[int] = set()

    def _pinned_keys(self) -> Iterable[int]:
        return self._pinned

    def snapshot(self) -> dict[str, Any]:
        return {**self._state(), "order": list(self._order), "pinned": sorted(self._pinned)}

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        # The owner guarantees a key is inserted once (its index deduplicates);
        # check() verifies it, the hot path does not.
        if size != 1:
            self._record_size(key, size)
        if pinned:
            self._pinned.add(key)
        else:
            self._order[key] = None

    def access(self, key: int) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def access_many(self, keys: Sequence[int]) -> None:
        order = self._order
        # Hits are usually pinned already (outside the order): nothing to move.
        for key in order.keys() & keys:
            order.move_to_end(key)

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

    def insert_many(
        self, keys: Sequence[int], pinned: bool = False, sizes: Sequence[int] | None = None
    ) -> None:
        if sizes is not None:
            self._record_sizes(keys, sizes)
        if pinned:
            self._pinned.update(keys)
        else:
            self._order.update(dict.fromkeys(keys))

    def pin_many(self, keys: Sequence[int]) -> None:
        try:
            # A C-level loop: deque(maxlen=0) consumes the map without a Python frame.
            deque(map(self._order.__delitem__, keys), maxlen=0)
        except KeyError as exc:
            raise InternalInvariantError(f"pin of key {exc} that is not evictable") from None
        self._pinned.update(keys)

    def unpin_many(self, keys: Sequence[int]) -> None:
        pinned = self._pinned
        before = len(pinned)
        pinned.difference_update(keys)
        if before - len(pinned) != len(keys):
            raise InternalInvariantError("unpin of a key that is not pinned")
        order = self._order
        # A plain loop: cheaper than building a dict of the keys to update from.
        for key in keys:
            order[key] = None

    def remove(self, key: int) -> None:
        if key in self._order:
            del self._order[key]
        elif key in self._pinned:
            self._pinned.remove(key)
        else:
            return
        if self._sizes:
            self._forget_size(key)

    def evict(self) -> int | None:
        if not self._order:
            return None
        key = self._order.popitem(last=False)[0]
        if self._sizes:
            self._forget_size(key)
        return key

    def evict_many(self, n: int) -> list[int]:
        popitem = self._order.popitem
        victims = [popitem(False)[0] for _ in range(min(n, len(self._order)))]
        if self._sizes:
            for key in victims:
                self._forget_size(key)
        return victims

    @property
    def used(self) -> int:
        # PolicyBase.used without the call to __len__ (workflow admission asks per key).
        return len(self._order) + len(self._pinned) + self._size_extra

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pinned

    @property
    def num_evictable(self) -> int:
        return len(self._order)
