"""S3-FIFO eviction: a small probationary FIFO, a main FIFO and a ghost FIFO.

Yang, Zhang, Qiu, Yue and Vinayak, "FIFO queues are all you need for cache
eviction" (SOSP 2023). New keys enter the small queue S (about 10% of the
capacity); most are one-hit wonders and leave from there quickly, into the
ghost queue G. A key hit often enough while in S moves to the main queue M,
which evicts with second chance (a 2-bit frequency, decremented on each pass).
A key inserted while remembered in G skips S and goes straight to M.

Pinned keys are out of both queues; a release puts the key back at the head
(newest end) of its queue, so a block just used is the last one its queue
looks at.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, ClassVar

from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.policy.base import PolicyBase

_MAX_FREQ = 3


class S3FIFOPolicy(PolicyBase):
    """S3-FIFO over unpinned resident keys.

    ``small_ratio`` sizes S as a share of the capacity. A key leaves S for M
    when its hit count exceeds ``promote_above``: by default 1 ("freq > 1",
    hit at least twice while in S); 0 promotes after a single hit. The ghost
    queue holds at most ``capacity`` keys.
    """

    name: ClassVar[str] = "s3fifo"

    def __init__(self, small_ratio: float = 0.1, promote_above: int = 1) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ConfigError(f"small_ratio must be in (0, 1), got {small_ratio}")
        if not 0 <= promote_above < _MAX_FREQ:
            raise ConfigError(f"promote_above must be in [0, {_MAX_FREQ}), got {promote_above}")
        super().__init__()
        self.small_ratio = small_ratio
        self.promote_above = promote_above
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._freq: dict[int, int] = {}
        self._pinned: dict[int, bool] = {}  # key -> belongs to M
        self._small_pinned = 0

    @property
    def sizes(self) -> tuple[int, int, int]:
        """``(|S|, |M|, |G|)``, pinned keys included in S and M."""
        s = len(self._small) + self._small_pinned
        m = len(self._main) + len(self._pinned) - self._small_pinned
        return s, m, len(self._ghost)

    # -- transitions -------------------------------------------------------------
    def _pinned_keys(self) -> Iterable[int]:
        return self._pinned

    def snapshot(self) -> dict[str, Any]:
        return {
            **self._state(),
            "small": list(self._small),
            "main": list(self._main),
            "ghost": list(self._ghost),
            "freq": sorted(self._freq.items()),
            "pinned": sorted(self._pinned.items()),
            "small_pinned": self._small_pinned,
        }

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        in_main = key in self._ghost
        if in_main:
            del self._ghost[key]
        self._freq[key] = 0
        if pinned:
            self._pinned[key] = in_main
            self._small_pinned += not in_main
        else:
            (self._main if in_main else self._small)[key] = None

    def access(self, key: int) -> None:
        f = self._freq.get(key)
        if f is not None and f < _MAX_FREQ:
            self._freq[key] = f + 1

    def pin(self, key: int) -> None:
        if key in self._small:
            del self._small[key]
            self._pinned[key] = False
            self._small_pinned += 1
        elif key in self._main:
            del self._main[key]
            self._pinned[key] = True
        else:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")

    def unpin(self, key: int) -> None:
        try:
            in_main = self._pinned.pop(key)
        except KeyError:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned") from None
        if in_main:
            self._main[key] = None
        else:
            self._small_pinned -= 1
            self._small[key] = None

    def remove(self, key: int) -> None:
        if self._freq.pop(key, None) is None:
            return
        if self._sizes:
            self._forget_size(key)
        if key in self._small:
            del self._small[key]
        elif key in self._main:
            del self._main[key]
        else:
            self._small_pinned -= not self._pinned.pop(key)

    def evict(self) -> int | None:
        small_target = max(1, int(self.small_ratio * (self.key_capacity or len(self))))
        if self._small and (
            len(self._small) + self._small_pinned >= small_target or not self._main
        ):
            key = self._evict_small()
            if key is not None:
                return key
        return self._evict_main()

    def _evict_small(self) -> int | None:
        small, main, freq = self._small, self._main, self._freq
        while small:
            key = small.popitem(last=False)[0]
            if freq[key] > self.promote_above:
                # The move clears the bits: M's second chances count hits made there.
                freq[key] = 0
                main[key] = None
                continue
            del freq[key]
            if self._sizes:
                self._forget_size(key)
            ghost = self._ghost
            ghost[key] = None
            if len(ghost) > (self.key_capacity or len(self) + 1):
                ghost.popitem(last=False)
            return key
        return None

    def _evict_main(self) -> int | None:
        main, freq = self._main, self._freq
        # Terminates: every pass over a key lowers its frequency.
        while main:
            key = main.popitem(last=False)[0]
            f = freq[key]
            if f > 0:
                freq[key] = f - 1
                main[key] = None
                continue
            del freq[key]
            if self._sizes:
                self._forget_size(key)
            return key
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    @property
    def num_evictable(self) -> int:
        return len(self._small) + len(self._main)
