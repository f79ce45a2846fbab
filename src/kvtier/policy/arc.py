"""Adaptive Replacement Cache eviction.

Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache"
(FAST 2003). Resident keys live in T1 (seen once) or T2 (seen again); the
ghost lists B1 and B2 remember keys recently evicted from each. A re-insert
of a ghost key is a sign that its list was cut too short, so ARC moves the
target size ``p`` of T1 toward that list and the key goes to T2.

The owner evicts before it inserts, so REPLACE runs in ``evict`` and the
ghost-hit adaptation in ``insert``; the B2 tie-break of REPLACE uses the most
recent ghost hit.

With items of different sizes the lists, the ghosts and ``p`` are still
counted in keys, bounded by the policy's ``key_capacity``; the owner takes
victims in ARC's order until the new item fits (``evict_for``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from kvtier.errors import InternalInvariantError
from kvtier.policy.base import PolicyBase


@mypyc_attr(allow_interpreted_subclasses=True)
class ARCPolicy(PolicyBase):
    """ARC over unpinned resident keys.

    ``_t1``/``_t2`` hold evictable keys, LRU first. Pinned keys are kept in
    ``_pinned`` with the list they belong to (``True`` for T2) and still count
    toward that list's size; on unpin they return to its MRU end.
    Ghosts are bounded so that ``|T1| + |B1| <= c`` and ``|B1| + |B2| <= c``.
    """

    name: ClassVar[str] = "arc"

    def __init__(self) -> None:
        # Assigned here, not by PolicyBase.__init__: mypyc compiles this class
        # and needs every attribute it touches declared in it.
        self.capacity = 0
        self.key_capacity = 0
        self._sizes: dict[int, int] = {}
        self._size_extra = 0
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._pinned: dict[int, bool] = {}
        self._t1_pinned = 0
        #: Target size of T1, in [0, c].
        self.p = 0.0
        self._last_ghost_hit_b2 = False

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """``(|T1|, |T2|, |B1|, |B2|)``, pinned keys included in T1/T2."""
        t1 = len(self._t1) + self._t1_pinned
        t2 = len(self._t2) + len(self._pinned) - self._t1_pinned
        return t1, t2, len(self._b1), len(self._b2)

    def _c(self) -> int:
        # Unbound (a bare policy in a test): size ghosts by what is resident.
        return self.key_capacity or max(1, len(self))

    def _pinned_keys(self) -> Iterable[int]:
        return self._pinned

    def snapshot(self) -> dict[str, Any]:
        return {
            **self._state(),
            "t1": list(self._t1),
            "t2": list(self._t2),
            "b1": list(self._b1),
            "b2": list(self._b2),
            "pinned": sorted(self._pinned.items()),
            "t1_pinned": self._t1_pinned,
            "p": self.p,
            "last_ghost_hit_b2": self._last_ghost_hit_b2,
        }

    def _trim_ghosts(self) -> None:
        b1, b2 = self._b1, self._b2
        n_b1 = len(b1)
        c = self.key_capacity or max(1, len(self))
        if n_b1 + len(b2) <= c and len(self._t1) + self._t1_pinned + n_b1 <= c:
            return  # the common case: both bounds hold
        t1 = len(self._t1) + self._t1_pinned
        while b1 and t1 + len(b1) > c:
            b1.popitem(last=False)
        while len(b1) + len(b2) > c:
            (b2 if b2 else b1).popitem(last=False)

    # -- transitions -------------------------------------------------------------
    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        c = self._c()
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.p = min(float(c), self.p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            in_t2 = True
            self._last_ghost_hit_b2 = False
        elif key in b2:
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            in_t2 = True
            self._last_ghost_hit_b2 = True
        else:
            in_t2 = False
        if pinned:
            self._pinned[key] = in_t2
            self._t1_pinned += not in_t2
        else:
            (self._t2 if in_t2 else self._t1)[key] = None
        self._trim_ghosts()

    def access(self, key: int) -> None:
        t1, t2 = self._t1, self._t2
        if key in t2:
            t2.move_to_end(key)
        elif key in t1:
            del t1[key]
            t2[key] = None
        elif self._pinned.get(key) is False:
            self._pinned[key] = True
            self._t1_pinned -= 1

    def pin(self, key: int) -> None:
        if key in self._t1:
            del self._t1[key]
            self._pinned[key] = False
            self._t1_pinned += 1
        elif key in self._t2:
            del self._t2[key]
            self._pinned[key] = True
        else:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")

    def unpin(self, key: int) -> None:
        try:
            in_t2 = self._pinned.pop(key)
        except KeyError:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned") from None
        if in_t2:
            self._t2[key] = None
        else:
            self._t1_pinned -= 1
            self._t1[key] = None

    def remove(self, key: int) -> None:
        if key in self._t1:
            del self._t1[key]
        elif key in self._t2:
            del self._t2[key]
        elif key in self._pinned:
            self._t1_pinned -= not self._pinned.pop(key)
        else:
            return
        if self._sizes:
            self._forget_size(key)
        # T1 shrank, which never breaks a ghost bound; nothing to trim.

    def evict(self) -> int | None:
        t1, t2 = self._t1, self._t2
        if not t1 and not t2:
            return None
        t1_size = len(t1) + self._t1_pinned
        # ARC's REPLACE; the other list when the chosen one is all pinned.
        from_t1 = t1_size > self.p or (self._last_ghost_hit_b2 and t1_size == self.p)
        if (from_t1 and not t1) or (not from_t1 and not t2):
            from_t1 = not from_t1
        if from_t1:
            key = t1.popitem(last=False)[0]
            self._b1[key] = None
        else:
            key = t2.popitem(last=False)[0]
            self._b2[key] = None
        if self._sizes:
            self._forget_size(key)
        self._trim_ghosts()
        return key

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2 or key in self._pinned

    @property
    def num_evictable(self) -> int:
        return len(self._t1) + len(self._t2)
