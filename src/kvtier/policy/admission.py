"""Admission filters, and the wrapper that gives any eviction policy one.

:class:`TinyLFUAdmission` follows Einziger, Friedman and Manes, "TinyLFU: A
Highly Efficient Cache Admission Policy" (ACM ToS 2017): a doorkeeper Bloom
filter absorbs the first sighting of each key, a count-min sketch counts the
rest, and every ``window`` sightings the sketch is halved and the doorkeeper
cleared. A key is admitted on its second sighting within a window: one-off
blocks (a unique prompt's tail, a single generation) are never published, so
they cannot push reused prefixes out.

Admission is chosen per policy instance: every shipped policy is registered
through :func:`with_admission`, so ``make_policy("lru", admission="tinylfu")``
returns ``Admitted(LRUPolicy(), TinyLFUAdmission())``; without ``admission``
the bare policy comes back and the device pool keeps its admit-everything
fast path. Declining is per key: the pool stops publishing a request's chain
at the first declined block, so no child is ever published without its parent,
but it still shows the filter the chain's remaining new keys, so a chain seen
a second time is admitted whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from kvtier.errors import ConfigError
from kvtier.policy.base import EvictionPolicy, PolicyBase, request_hook

_M64 = (1 << 64) - 1
_HALVE = bytes(i >> 1 for i in range(256))
_UNBOUND_CAPACITY = 1024


@runtime_checkable
class AdmissionFilter(Protocol):
    """Decides whether a new key may become resident at a cache level."""

    name: ClassVar[str]

    def bind(self, capacity: int) -> None: ...

    def admit(self, key: int) -> bool: ...

    def record(self, key: int) -> None: ...

    def snapshot(self) -> dict[str, Any]: ...


def _mix(key: int) -> int:
    """64 well-mixed bits of a (up to 128-bit) key: murmur3's fmix64."""
    x = (key ^ (key >> 64)) & _M64
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & _M64
    x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TinyLFUAdmission:
    """Admit a key once it has been seen ``threshold`` times (default 2) in a window.

    ``window`` (sightings between halvings) defaults to 8x the capacity. The
    sketch has ``depth`` rows of 4-bit-style counters (capped at 15) and as
    many columns as the capacity rounded up to a power of two; the doorkeeper
    has 8 bits per window sighting and 3 probes. Indices come from one mixed
    hash by double hashing (Kirsch and Mitzenmacher).
    """

    name: ClassVar[str] = "tinylfu"

    def __init__(self, window: int | None = None, threshold: int = 2, depth: int = 4) -> None:
        if window is not None and window <= 0:
            raise ConfigError(f"window must be positive, got {window}")
        if not 1 <= threshold <= 16:
            raise ConfigError(f"threshold must be in [1, 16], got {threshold}")
        if depth < 1:
            raise ConfigError(f"depth must be at least 1, got {depth}")
        self._window_arg = window
        self.threshold = threshold
        self.depth = depth
        self._size(_UNBOUND_CAPACITY)

    def _size(self, capacity: int) -> None:
        self.window = self._window_arg or 8 * capacity
        self._width_mask = _pow2_at_least(capacity) - 1
        self._sketch = bytearray((self._width_mask + 1) * self.depth)
        self._door_mask = _pow2_at_least(8 * self.window) - 1
        self._door = bytearray((self._door_mask + 1) >> 3)
        self._samples = 0

    def bind(self, capacity: int) -> None:
        """Size the sketch for a level of ``capacity`` keys."""
        if capacity <= 0:
            raise ConfigError(f"an admission filter's capacity must be positive, got {capacity}")
        self._size(capacity)

    def snapshot(self) -> dict[str, Any]:
        """The whole filter state as plain data (sketch and doorkeeper bytes included)."""
        return {
            "window": self.window,
            "threshold": self.threshold,
            "depth": self.depth,
            "width_mask": self._width_mask,
            "door_mask": self._door_mask,
            "sketch": bytes(self._sketch),
            "door": bytes(self._door),
            "samples": self._samples,
        }

    # -- doorkeeper and sketch ------------------------------------------------------
    def _door_bits(self, x: int) -> list[int]:
        h1, h2 = x & 0xFFFFFFFF, (x >> 32) | 1
        mask = self._door_mask
        return [(h1 + i * h2) & mask for i in range(3)]

    def _cells(self, x: int) -> list[int]:
        h1, h2 = x >> 32, (x & 0xFFFFFFFF) | 1
        mask, width = self._width_mask, self._width_mask + 1
        return [r * width + ((h1 + r * h2) & mask) for r in range(self.depth)]

    def _in_door(self, x: int) -> bool:
        door = self._door
        return all(door[b >> 3] >> (b & 7) & 1 for b in self._door_bits(x))

    def estimate(self, key: int) -> int:
        """Estimated recent sightings of ``key``: at least those since the last reset (up to 16)."""
        x = _mix(key)
        sketch = self._sketch
        return min(sketch[i] for i in self._cells(x)) + self._in_door(x)

    def record(self, key: int) -> None:
        """Count one sighting of ``key``."""
        x = _mix(key)
        if self._in_door(x):
            sketch = self._sketch
            for i in self._cells(x):
                if sketch[i] < 15:
                    sketch[i] += 1
        else:
            door = self._door
            for b in self._door_bits(x):
                door[b >> 3] |= 1 << (b & 7)
        self._samples += 1
        if self._samples >= self.window:
            self._reset()

    def _reset(self) -> None:
        # Halving keeps the ranking while forgetting the distant past.
        self._sketch = bytearray(self._sketch.translate(_HALVE))
        self._door = bytearray(len(self._door))
        self._samples = 0

    def admit(self, key: int) -> bool:
        """Record this sighting; True once the key has been seen often enough."""
        self.record(key)
        return self.estimate(key) >= self.threshold


_ADMISSIONS: dict[str, Callable[[], AdmissionFilter]] = {"tinylfu": TinyLFUAdmission}


def make_admission(spec: str | AdmissionFilter) -> AdmissionFilter:
    """An admission filter by name (``"tinylfu"``) or the instance itself."""
    if not isinstance(spec, str):
        if not isinstance(spec, AdmissionFilter):
            raise ConfigError(f"{spec!r} is not an admission filter")
        return spec
    factory = _ADMISSIONS.get(spec.lower())
    if factory is None:
        raise ConfigError(f"unknown admission {spec!r}: use one of {sorted(_ADMISSIONS)}")
    return factory()


class Admitted(PolicyBase):
    """``policy`` behind ``admission``: new keys must pass both ``admit`` calls.

    Every other call goes to ``policy``; hits are also recorded by the
    filter, so a block that was reused, evicted and then recomputed is
    admitted again at once. Owner-specific attributes (a hybrid's
    ``pressure``) are set on ``.policy``; ``used`` is the wrapped policy's.
    The filter is bound to the level's ``key_capacity`` (its sketch counts
    keys, whatever unit the capacity is in).
    """

    name: ClassVar[str] = "admitted"

    def __init__(
        self, policy: EvictionPolicy, admission: str | AdmissionFilter = "tinylfu"
    ) -> None:
        # No PolicyBase.__init__: the sizes live in the wrapped policy.
        self.capacity = 0
        self.key_capacity = 0
        self.policy = policy
        self.admission = make_admission(admission)
        # The protocol's name is a class attribute, but a wrapper's name
        # depends on what it wraps (stats report it): shadow it per instance.
        self.__dict__["name"] = f"{policy.name}+{self.admission.name}"

    @property
    def used(self) -> int:
        return self.policy.used

    @property
    def pinned_used(self) -> int:
        inner = self.policy
        if isinstance(inner, PolicyBase):
            return inner.pinned_used
        return len(inner) - inner.num_evictable

    def size_of(self, key: int) -> int:
        inner = self.policy
        return inner.size_of(key) if isinstance(inner, PolicyBase) else 1

    def bind(self, capacity: int, typical_size: int = 1) -> None:
        super().bind(capacity, typical_size)
        self.policy.bind(capacity, typical_size)
        self.admission.bind(self.key_capacity)

    def snapshot(self) -> dict[str, Any]:
        return {"policy": self.policy.snapshot(), "admission": self.admission.snapshot()}

    def on_request(
        self,
        keys: Sequence[int],
        num_hit: int,
        now: float,
        hints: Mapping[str, object] | None = None,
    ) -> None:
        hook = request_hook(self.policy)
        if hook is not None:
            hook(keys, num_hit, now, hints)

    def admit(self, key: int) -> bool:
        # The filter sees every candidate, even one the policy itself declines.
        allowed = self.admission.admit(key)
        return self.policy.admit(key) and allowed

    def insert(self, key: int, pinned: bool = False, size: int = 1, **kwargs: Any) -> None:
        self.policy.insert(key, pinned, size, **kwargs)

    def insert_many(
        self,
        keys: Sequence[int],
        pinned: bool = False,
        sizes: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        self.policy.insert_many(keys, pinned, sizes, **kwargs)

    def access(self, key: int) -> None:
        self.admission.record(key)
        self.policy.access(key)

    def access_many(self, keys: Sequence[int]) -> None:
        record = self.admission.record
        for key in keys:
            record(key)
        self.policy.access_many(keys)

    def pin(self, key: int) -> None:
        self.policy.pin(key)

    def unpin(self, key: int) -> None:
        self.policy.unpin(key)

    def pin_many(self, keys: Sequence[int]) -> None:
        self.policy.pin_many(keys)

    def unpin_many(self, keys: Sequence[int]) -> None:
        self.policy.unpin_many(keys)

    def remove(self, key: int) -> None:
        self.policy.remove(key)

    def evict(self) -> int | None:
        return self.policy.evict()

    def evict_many(self, n: int) -> list[int]:
        return self.policy.evict_many(n)

    def evict_for(self, size: int) -> list[int] | None:
        return self.policy.evict_for(size)

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    @property
    def num_evictable(self) -> int:
        return self.policy.num_evictable


def with_admission(factory: Callable[..., EvictionPolicy]) -> Callable[..., EvictionPolicy]:
    """A registry factory that also takes ``admission=`` (a name, a filter, or None)."""

    def make(admission: str | AdmissionFilter | None = None, **kwargs: Any) -> EvictionPolicy:
        policy = factory(**kwargs)
        if admission is None or admission == "none":
            return policy
        return Admitted(policy, admission)

    make.__name__ = make.__qualname__ = getattr(factory, "__name__", "policy")
    make.__doc__ = factory.__doc__
    return make
