"""GreedyDual-Size-Frequency eviction: value per byte, inflated over time.

Cherkasova, "Improving WWW Proxies Performance with Greedy-Dual-Size-Frequency
Caching Policy" (HP Labs, 1998), after Cao and Irani's GreedyDual-Size. Each
key has priority ``H = L + freq * cost / size``; the victim is the lowest H,
and the inflation value ``L`` becomes the victim's H, so keys not touched for
a long time fall behind newly refreshed ones (aging without a timer).

``size`` is the protocol's (``insert(key, pinned, size)``), the same units
as the capacity; ``cost`` is GDSF's own keyword (the recompute time of a
prefix, say). The device pool has one size and cost for every block, so
both default to 1 there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvtier.errors import ConfigError
from kvtier.policy.heap import HeapPolicy


def _check_cost(cost: float) -> None:
    if not cost >= 0:
        raise ConfigError(f"an entry's cost must be non-negative, got {cost}")


class GDSFPolicy(HeapPolicy):
    """GDSF over unpinned resident keys (a min-heap of H, see :class:`HeapPolicy`).

    A release recomputes H with the current L: it is the key's last use, so
    it counts as recent.
    """

    name: ClassVar[str] = "gdsf"

    def __init__(self) -> None:
        super().__init__()
        #: The inflation value: H of the last victim.
        self.L = 0.0
        self._cost: dict[int, float] = {}

    def priority(self, key: int) -> float:
        """H for a resident key as it would be computed now."""
        return self.L + self._freq[key] * self._cost[key] / self._sizes.get(key, 1)

    _priority = priority

    def _forget(self, key: int) -> None:
        super()._forget(key)
        del self._cost[key]

    def _on_evict(self, key: int, priority: float) -> None:
        self.L = priority

    def snapshot(self) -> dict[str, Any]:
        return {**super().snapshot(), "L": self.L, "cost": sorted(self._cost.items())}

    # -- transitions -------------------------------------------------------------
    def insert(self, key: int, pinned: bool = False, size: int = 1, *, cost: float = 1.0) -> None:
        _check_cost(cost)
        if size != 1:
            self._record_size(key, size)
        self._freq[key] = 1
        self._cost[key] = cost
        self._admit_resident(key, pinned)

    def insert_many(
        self,
        keys: Sequence[int],
        pinned: bool = False,
        sizes: Sequence[int] | None = None,
        *,
        costs: Sequence[float] | None = None,
    ) -> None:
        n = len(keys)
        if (sizes is not None and len(sizes) != n) or (costs is not None and len(costs) != n):
            raise ConfigError("insert_many needs one size and one cost per key")
        # Check everything first so a bad entry leaves the policy unchanged.
        for i in range(n):
            self.check_size(1 if sizes is None else sizes[i])
            _check_cost(1.0 if costs is None else costs[i])
        for i, key in enumerate(keys):
            self.insert(
                key,
                pinned,
                1 if sizes is None else sizes[i],
                cost=1.0 if costs is None else costs[i],
            )

    def access(self, key: int) -> None:
        f = self._freq.get(key)
        if f is None:
            return
        self._freq[key] = f + 1
        if key in self._live:
            self._push(key)
