"""A pressure-aware hybrid of recency, frequency and size on one scale.

Scoring several signals into one priority follows LRFU (Lee et al., "LRFU: A
Spectrum of Policies that Subsumes the Least Recently Used and Least
Frequently Used Policies", IEEE Trans. Computers 2001) and the size-aware
GreedyDual-Size family (Cao and Irani, 1997); here each signal is normalised
to [0, 1] and weighted, and the owner can shift weight to size under memory
pressure. Every key's score says how much it is worth keeping; the lowest
score is evicted::

    score = w_r * (1 - age / horizon)
          + w_f * log2(1 + min(freq, max_freq)) / log2(1 + max_freq)
          + w_s * (1 - size / size_scale)
    w_s   = size_weight + pressure * pressure_size_weight

* ``age``: uses (inserts, hits, releases) since the key's last use; the
  recency term is in [0, 1] for keys used within ``horizon`` uses (default:
  the policy's ``key_capacity``) and keeps falling below 0 after that, so a
  key left idle long enough loses to anything, however hot or small it was;
* ``freq``: hits plus one, capped at ``max_freq``;
* ``size``: the protocol's (``insert(key, pinned, size)``);
* ``size_scale``: the smallest power of two at least the largest size seen;
  big entries score low, so higher ``pressure`` prefers evicting them.

Because ``1 - age / horizon`` is ``t_k / horizon`` plus a term shared by every
key, the heap can order keys by ``w_r * t_k / horizon + ...`` computed once per
touch: the ordering stays exact as time passes, and eviction is O(log n).
Changing ``pressure`` or seeing a size past ``size_scale`` rescales every key,
an O(n) rebuild; set ``pressure`` when it changes meaningfully, not per call.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from kvtier.errors import ConfigError
from kvtier.policy.heap import HeapPolicy

_UNBOUND_CAPACITY = 1024


class HybridPolicy(HeapPolicy):
    """Evicts the unpinned resident key with the lowest hybrid score (see the module doc)."""

    name: ClassVar[str] = "hybrid"

    def __init__(
        self,
        *,
        recency_weight: float = 1.0,
        frequency_weight: float = 0.5,
        size_weight: float = 0.1,
        pressure_size_weight: float = 1.0,
        max_freq: int = 64,
        horizon: int | None = None,
        pressure: float = 0.0,
    ) -> None:
        weights = (recency_weight, frequency_weight, size_weight, pressure_size_weight)
        if min(weights) < 0:
            raise ConfigError(f"hybrid weights must be non-negative, got {weights}")
        if max_freq < 1:
            raise ConfigError(f"max_freq must be at least 1, got {max_freq}")
        if horizon is not None and horizon <= 0:
            raise ConfigError(f"horizon must be positive, got {horizon}")
        _check_pressure(pressure)
        super().__init__()
        self.recency_weight = recency_weight
        self.frequency_weight = frequency_weight
        self.size_weight = size_weight
        self.pressure_size_weight = pressure_size_weight
        self.max_freq = max_freq
        self._horizon = horizon
        self._pressure = pressure
        self._log_max = math.log2(1 + max_freq)
        self._size_scale = 1
        self._clock = 0
        self._last: dict[int, int] = {}

    # -- scoring ------------------------------------------------------------------
    @property
    def horizon(self) -> int:
        return self._horizon or self.key_capacity or _UNBOUND_CAPACITY

    @property
    def pressure(self) -> float:
        """Memory pressure in [0, 1], set by the owner; higher weighs size more."""
        return self._pressure

    @pressure.setter
    def pressure(self, value: float) -> None:
        _check_pressure(value)
        if value != self._pressure:
            self._pressure = value
            self._rebuild()

    def score(self, key: int) -> float:
        """The key's score now (the formula in the module doc)."""
        age = self._clock - self._last[key]
        return self.recency_weight * (1.0 - age / self.horizon) + self._static(key)

    def _static(self, key: int) -> float:
        """The frequency and size terms: they change only when the key is touched."""
        freq = min(self._freq[key], self.max_freq)
        w_s = self.size_weight + self._pressure * self.pressure_size_weight
        f_term = math.log2(1 + freq) / self._log_max
        s_term = 1.0 - self._sizes.get(key, 1) / self._size_scale
        return self.frequency_weight * f_term + w_s * s_term

    def _priority(self, key: int) -> float:
        return self.recency_weight * self._last[key] / self.horizon + self._static(key)

    def _forget(self, key: int) -> None:
        super()._forget(key)
        del self._last[key]

    def snapshot(self) -> dict[str, Any]:
        return {
            **super().snapshot(),
            "pressure": self._pressure,
            "size_scale": self._size_scale,
            "clock": self._clock,
            "last": sorted(self._last.items()),
        }

    def _on_unpin(self, key: int) -> None:
        self._touch(key)  # a release is the last use

    def _touch(self, key: int) -> None:
        self._clock += 1
        self._last[key] = self._clock

    # -- transitions -------------------------------------------------------------
    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        self._freq[key] = 1
        self._touch(key)
        if size > self._size_scale:
            self._size_scale = 1 << (size - 1).bit_length()
            self._rebuild()
        self._admit_resident(key, pinned)

    def access(self, key: int) -> None:
        f = self._freq.get(key)
        if f is None:
            return
        self._freq[key] = f + 1
        self._touch(key)
        if key in self._live:
            self._push(key)


def _check_pressure(value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"pressure must be in [0, 1], got {value}")
