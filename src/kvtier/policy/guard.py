"""A sampled shadow LRU that tells a policy when plain recency would do better.

A learned policy can be wrong about a workload it was not designed for. This
guard keeps it honest online: it replays a spatial sample of the block keys
(keys ``k`` with ``k % period == 0``, as in SHARDS, Waldspurger et al.,
FAST'15) through an LRU cache of ``capacity // period`` keys and counts, on
the same sampled accesses, how many LRU would have found cached and how many
the policy actually had. Every ``window`` sampled accesses it compares the
two:

* while the policy follows its own order, a smoothed shortfall of more than
  ``margin`` (a fraction of accesses) switches it to recency order;
* in recency order the guard measures the shadow's bias (LRU against LRU)
  and, after ``probe`` windows, lets the policy try its own order again;
  each probe that fails at once doubles the next wait (up to 16 windows).

The sample is small (about ``target`` keys in the shadow), so the guard costs
a few dictionary operations per request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Any

from kvtier.errors import ConfigError

_MAX_PROBE = 16


class LRUGuard:
    """Compares the owner's cache with a sampled LRU; :attr:`recency` says which order to use."""

    def __init__(
        self,
        capacity: int,
        *,
        target: int = 512,
        window: int = 1024,
        margin: float = 0.015,
        probe: int = 2,
    ) -> None:
        if capacity <= 0 or target <= 0 or window <= 0 or probe <= 0:
            raise ConfigError("the LRU guard needs a positive capacity, target, window and probe")
        if not 0.0 <= margin < 1.0:
            raise ConfigError(f"the LRU guard's margin must be in [0, 1), got {margin}")
        #: Keys ``k`` with ``k % period == 0`` are sampled.
        self.period = max(1, capacity // target)
        self.size = max(1, capacity // self.period)
        self.window = window
        self.margin = margin
        self._base_probe = probe
        self._probe = probe
        self._lru: OrderedDict[int, None] = OrderedDict()
        #: True while the owner should evict in recency order.
        self.recency = False
        self._wait = 0  # windows left in recency order
        self._fresh = False  # the current learned-order stretch began with a probe
        self._n = 0
        self._diff = 0
        self.shortfall = 0.0  # smoothed LRU hits minus the owner's, per sampled access
        self.bias = 0.0  # smoothed shadow error measured in recency order
        self.switches = 0

    def snapshot(self) -> dict[str, Any]:
        """The guard's whole state as plain data."""
        return {
            "lru": list(self._lru),
            "recency": self.recency,
            "wait": self._wait,
            "probe": self._probe,
            "fresh": self._fresh,
            "n": self._n,
            "diff": self._diff,
            "shortfall": self.shortfall,
            "bias": self.bias,
            "switches": self.switches,
        }

    def observe(self, keys: Sequence[int], resident: Container[int]) -> None:
        """One request's chain, before the owner changes anything for it."""
        p = self.period
        sampled = keys if p == 1 else [k for k in keys if k % p == 0]
        if not sampled:
            return
        lru = self._lru
        diff = 0
        for k in sampled:
            if k in lru:
                diff += 1
            else:
                lru[k] = None
            if k in resident:
                diff -= 1
        # The chain's root is made the most recent: with its children it outlives them.
        for i in range(len(sampled) - 1, -1, -1):
            lru.move_to_end(sampled[i])
        while len(lru) > self.size:
            lru.popitem(last=False)
        self._diff += diff
        self._n += len(sampled)
        if self._n >= self.window:
            self._decide(self._diff / self._n)
            self._n = 0
            self._diff = 0

    def _decide(self, diff: float) -> None:
        if self.recency:
            self.bias = 0.75 * self.bias + 0.25 * diff
            self._wait -= 1
            if self._wait <= 0:
                self.recency = False
                self._fresh = True
                self.shortfall = 0.0
            return
        self.shortfall = 0.5 * self.shortfall + 0.5 * diff
        if self.shortfall - self.bias > self.margin:
            # A probe that fails straight away waits twice as long next time.
            self._probe = min(2 * self._probe, _MAX_PROBE) if self._fresh else self._base_probe
            self._wait = self._probe
            self.recency = True
            self.switches += 1
        self._fresh = False
