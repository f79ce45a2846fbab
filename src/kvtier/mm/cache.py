"""The encoder-output cache: images and audio encoded once, keyed by content, under a byte budget.

:class:`EncoderCache` maps an item's content key (:mod:`kvtier.mm.keys`) to
the tensor its encoder produced. On a miss it looks in its lower tiers
(:class:`~kvtier.mm.tiers.EncoderTier`: host memory, disk, Redis), and only
then runs the encoder.

* **Budget.** ``capacity_bytes`` bounds the sum of ``nbytes`` of the cached
  tensors (whatever shape comes back, 1-D included); ``max_entries``
  optionally bounds their number. Any registered kvtier policy (a real LFU,
  ARC, S3-FIFO, ...) picks victims through the size-aware protocol
  (``evict_for``), so the budget holds after every insert. A tensor that is
  a view into a larger buffer is stored as a compact copy, so what the
  budget counts is what the cache holds.
* **Pins.** :meth:`EncoderCache.acquire` returns a :class:`Lease`; while a
  request holds it the entry cannot be evicted. When pinned entries leave
  too little room, a new output is returned but not cached (counted in
  ``not_cached``), never a loop.
* **Oversize.** An output larger than the whole budget is returned and not
  cached (counted in ``oversize``).
* **Single flight.** Concurrent misses on one key (threads, or coroutines via
  :meth:`EncoderCache.aget_or_encode`) run the encoder once; the others wait
  for that result. An encoder failure reaches every waiter and caches nothing;
  the next request tries again.
* **Tiers.** Outputs are written through to every lower tier, and a hit on a
  lower tier is promoted to memory and to the tiers above it. A second
  process pointed at the same disk directory or Redis hits on what this one
  encoded.
* **Reset.** ``reset(model=...)`` frees one model's entries here and on the
  tiers (a new revision needs no reset to be correct: its keys differ).

The cache is thread-safe: one lock guards the bookkeeping, and encoders and
tier I/O run outside it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvtier.errors import ConfigError
from kvtier.mm.keys import EncoderSpec, ItemKeyer, MediaItem
from kvtier.mm.tiers import EncoderTier, Expected
from kvtier.offload.config import TierSpec
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.registry import make_policy

#: Where a returned output came from.
MEMORY, ENCODER, SHARED = "memory", "encoder", "shared"


class ItemEncoder(Protocol):
    """What the cache runs on a miss: a spec naming the encoder, and ``encode``."""

    @property
    def spec(self) -> EncoderSpec: ...

    def encode(self, item: MediaItem) -> torch.Tensor: ...


@dataclass(frozen=True)
class FunctionEncoder:
    """An :class:`ItemEncoder` from a spec and a function."""

    spec: EncoderSpec
    fn: Callable[[MediaItem], torch.Tensor]

    def encode(self, item: MediaItem) -> torch.Tensor:
        return self.fn(item)


class _Entry:
    __slots__ = ("encode_s", "modality", "model_id", "nbytes", "pins", "tensor")

    def __init__(
        self, tensor: torch.Tensor, nbytes: int, spec: EncoderSpec, encode_s: float
    ) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.model_id = spec.model_id
        self.modality = spec.modality
        self.encode_s = encode_s
        self.pins = 0


class _Flight:
    """One encode in progress; waiters block on ``future``."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[tuple[torch.Tensor, _Entry | None]] = (
            concurrent.futures.Future()
        )
        # Running, so a waiter that gives up (a cancelled coroutine) cannot cancel it
        # for the others.
        self.future.set_running_or_notify_cancel()


class Lease:
    """An output handed to a caller; while it is held (pinned) the entry stays cached.

    ``source`` says where the output came from: ``"memory"``, ``"encoder"``,
    ``"shared"`` (another caller's encode in flight) or ``"tier:NAME"``.
    ``pinned`` is false when the output is not cached (oversize, or no room
    beside pinned entries): the tensor is still the caller's to use.
    Release it once (more calls do nothing); it is a context manager.
    """

    __slots__ = ("_cache", "_entry", "key", "source", "tensor")

    def __init__(
        self,
        cache: EncoderCache,
        key: int,
        tensor: torch.Tensor,
        source: str,
        entry: _Entry | None,
    ) -> None:
        self._cache = cache
        self.key = key
        self.tensor = tensor
        self.source = source
        self._entry = entry

    @property
    def pinned(self) -> bool:
        return self._entry is not None

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            self._cache._unpin(self.key, entry)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class EncoderCacheStats:
    """The cache's state and counters (per item looked up, not per token)."""

    capacity_bytes: int
    max_entries: int | None
    policy: str
    entries: int
    bytes_held: int
    #: The most ``bytes_held`` has ever been (never above ``capacity_bytes``).
    peak_bytes: int
    pinned_entries: int
    pinned_bytes: int
    lookups: int
    #: Found in memory.
    hits: int
    #: Found on a lower tier (and promoted).
    tier_hits: int
    #: Waited for another caller's encode of the same item.
    coalesced: int
    #: Ran the encoder.
    misses: int
    encoder_failures: int
    encode_seconds: float
    #: Encoder time memory hits did not spend (each hit counts its item's encode time).
    encode_seconds_saved: float
    evictions: int
    evicted_bytes: int
    #: Outputs larger than the whole budget: returned, not cached.
    oversize: int
    #: Outputs returned but not cached: no room beside pinned entries, or admission declined.
    not_cached: int
    #: Per modality: ``{"hits", "tier_hits", "coalesced", "misses"}``.
    by_modality: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Per lower tier: its counters (:meth:`EncoderTier.stats`).
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        """Lookups served without running the encoder, over all lookups."""
        served = self.hits + self.tier_hits + self.coalesced
        return served / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["hit_ratio"] = self.hit_ratio
        return out


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, and copied when it is a view into a larger buffer."""
    t = tensor.detach()
    if t.untyped_storage().nbytes() > t.nbytes:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class EncoderCache:
    """Encoder outputs by content key under a byte budget (see the module docstring).

    Args:
        capacity_bytes: The budget: the most ``nbytes`` the cached tensors sum to.
        max_entries: Optionally, the most entries.
        policy: A registered policy name, an import path, or a policy instance.
        typical_bytes: About how large one output is (sizes a policy's lists
            and histories); default a 64th of the budget.
        tiers: Lower tiers, fastest first: :class:`EncoderTier` objects or
            :class:`~kvtier.offload.config.TierSpec` (``--tier``-style URLs).
        tenant_salt, algorithm, secret: See :class:`~kvtier.mm.keys.ItemKeyer`.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        max_entries: int | None = None,
        policy: str | EvictionPolicy = "lru",
        typical_bytes: int | None = None,
        tiers: Sequence[EncoderTier | TierSpec | str] = (),
        tenant_salt: str = "",
        algorithm: str = "sha256",
        secret: bytes | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or (
            capacity_bytes <= 0
        ):
            raise ConfigError(
                f"the encoder cache's capacity must be positive bytes, got {capacity_bytes!r}"
            )
        if max_entries is not None and (
            not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries <= 0
        ):
            raise ConfigError(f"max_entries must be a positive integer, got {max_entries!r}")
        if typical_bytes is not None and (not isinstance(typical_bytes, int) or typical_bytes <= 0):
            raise ConfigError(f"typical_bytes must be positive bytes, got {typical_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.max_entries = max_entries
        self.keyer = ItemKeyer(tenant_salt, algorithm, secret)
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        typical = min(typical_bytes or max(capacity_bytes // 64, 1), capacity_bytes)
        self.policy.bind(capacity_bytes, typical)
        self.tiers: list[EncoderTier] = [
            t if isinstance(t, EncoderTier) else EncoderTier.from_spec(
                TierSpec.from_url(t) if isinstance(t, str) else t, typical_bytes=typical
            )
            for t in tiers
        ]
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"each encoder-cache tier needs its own medium; got {names}")
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._flights: dict[int, _Flight] = {}
        self._bytes = 0
        self._peak = 0
        self._pinned_entries = 0
        self._pinned_bytes = 0
        self._c: dict[str, float] = dict.fromkeys(
            (
                "lookups", "hits", "tier_hits", "coalesced", "misses", "encoder_failures",
                "encode_seconds", "encode_seconds_saved", "evictions", "evicted_bytes",
                "oversize", "not_cached",
            ),
            0,
        )
        self._by_modality: dict[str, dict[str, int]] = {}

    # -- keys --------------------------------------------------------------------------
    def key(self, item: MediaItem, spec: EncoderSpec) -> int:
        """The content key of ``spec``'s output for ``item``."""
        return self.keyer.key(item, spec)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def bytes_held(self) -> int:
        return self._bytes

    # -- the request path --------------------------------------------------------------
    def get_or_encode(
        self, item: MediaItem, encoder: ItemEncoder, *, expected: Expected | None = None
    ) -> torch.Tensor:
        """The encoder's output for ``item``: from the cache, a lower tier, or the encoder."""
        return self.acquire(item, encoder, pin=False, expected=expected).tensor

    def acquire(
        self,
        item: MediaItem,
        encoder: ItemEncoder,
        *,
        pin: bool = True,
        expected: Expected | None = None,
        key: int | None = None,
    ) -> Lease:
        """Like :meth:`get_or_encode`, returning a :class:`Lease` that pins the entry.

        ``key`` replaces :meth:`key` (an item keyed under a request's own salt).
        """
        spec = encoder.spec
        key = self.key(item, spec) if key is None else key
        lease, flight, leader = self._begin(key, spec, pin)
        if lease is not None:
            return lease
        assert flight is not None
        if not leader:
            tensor, entry = flight.future.result()
            return self._after_wait(key, tensor, entry, pin)
        return self._lead(key, spec, lambda: encoder.encode(item), flight, pin, expected)

    async def aget_or_encode(
        self, item: MediaItem, encoder: ItemEncoder, *, expected: Expected | None = None
    ) -> torch.Tensor:
        """:meth:`get_or_encode` for asyncio: the encoder runs on a worker thread."""
        lease = await self.aacquire(item, encoder, pin=False, expected=expected)
        return lease.tensor

    async def aacquire(
        self,
        item: MediaItem,
        encoder: ItemEncoder,
        *,
        pin: bool = True,
        expected: Expected | None = None,
    ) -> Lease:
        """:meth:`acquire` for asyncio; waiting never blocks the event loop."""
        spec = encoder.spec
        key = self.key(item, spec)
        lease, flight, leader = self._begin(key, spec, pin)
        if lease is not None:
            return lease
        assert flight is not None
        if not leader:
            tensor, entry = await asyncio.wrap_future(flight.future)
            return self._after_wait(key, tensor, entry, pin)
        return await asyncio.to_thread(
            self._lead, key, spec, lambda: encoder.encode(item), flight, pin, expected
        )

    def _begin(
        self, key: int, spec: EncoderSpec, pin: bool
    ) -> tuple[Lease | None, _Flight | None, bool]:
        """A hit's lease; else the flight to wait on and whether this caller leads it."""
        with self._lock:
            self._count(spec.modality, "lookups")
            entry = self._entries.get(key)
            if entry is not None:
                self._count(spec.modality, "hits")
                self._c["encode_seconds_saved"] += entry.encode_s
                self.policy.access(key)
                if pin:
                    self._pin(key, entry)
                return Lease(self, key, entry.tensor, MEMORY, entry if pin else None), None, False
            flight = self._flights.get(key)
            if flight is not None:
                self._count(spec.modality, "coalesced")
                return None, flight, False
            flight = self._flights[key] = _Flight()
            return None, flight, True

    def _after_wait(
        self, key: int, tensor: torch.Tensor, entry: _Entry | None, pin: bool
    ) -> Lease:
        """The lease of a caller that waited for another's encode."""
        if pin and entry is not None:
            with self._lock:
                if self._entries.get(key) is entry:
                    self._pin(key, entry)
                else:
                    entry = None  # evicted (or reset) in the meantime
        return Lease(self, key, tensor, SHARED, entry if pin else None)

    def _lead(
        self,
        key: int,
        spec: EncoderSpec,
        produce: Callable[[], torch.Tensor],
        flight: _Flight,
        pin: bool,
        expected: Expected | None,
    ) -> Lease:
        """Fetch from a tier or run the encoder, cache the result, wake the waiters."""
        found_on: int | None = None
        try:
            tensor: torch.Tensor | None = None
            for i, tier in enumerate(self.tiers):
                tensor = tier.load(key, spec.model_id, expected)
                if tensor is not None:
                    found_on = i
                    break
            seconds = 0.0
            if tensor is None:
                started = self.clock()
                out = produce()
                seconds = self.clock() - started
                if not isinstance(out, torch.Tensor):
                    raise ConfigError(
                        f"encoder {spec.encoder_id!r} returned a {type(out).__name__}, not a "
                        "torch.Tensor"
                    )
                tensor = _compact(out)
        except BaseException as exc:
            with self._lock:
                del self._flights[key]
                self._c["encoder_failures"] += 1
            flight.future.set_exception(exc)
            raise
        with self._lock:
            if found_on is None:
                self._count(spec.modality, "misses")
                self._c["encode_seconds"] += seconds
            else:
                self._count(spec.modality, "tier_hits")
            entry = self._insert(key, tensor, spec, seconds)
            if entry is not None:
                tensor = entry.tensor
                if pin:
                    self._pin(key, entry)
            del self._flights[key]
        flight.future.set_result((tensor, entry))
        below = self.tiers if found_on is None else self.tiers[:found_on]
        for tier in below:
            tier.store(key, tensor, spec.model_id)
        source = ENCODER if found_on is None else f"tier:{self.tiers[found_on].name}"
        return Lease(self, key, tensor, source, entry if pin else None)

    # -- bookkeeping (under the lock) ----------------------------------------------------
    def _count(self, modality: str, what: str, n: int = 1) -> None:
        self._c[what] += n
        per = self._by_modality.get(modality)
        if per is None:
            per = self._by_modality[modality] = dict.fromkeys(
                ("lookups", "hits", "tier_hits", "coalesced", "misses"), 0
            )
        per[what] += n

    def _insert(
        self, key: int, tensor: torch.Tensor, spec: EncoderSpec, encode_s: float
    ) -> _Entry | None:
        """Cache ``tensor`` if the budget allows; the new entry, or ``None`` (counted)."""
        existing = self._entries.get(key)
        if existing is not None:  # put() by another path in the meantime
            self.policy.access(key)
            return existing
        nbytes = int(tensor.nbytes)
        # The policy needs a positive size; an empty output counts one byte.
        size = max(nbytes, 1)
        if size > self.capacity_bytes:
            self._c["oversize"] += 1
            return None
        limit = self.max_entries
        if (limit is not None and self._pinned_entries >= limit) or not self.policy.admit(key):
            self._c["not_cached"] += 1
            return None
        victims = self.policy.evict_for(size)
        if victims is None:
            self._c["not_cached"] += 1
            return None
        for victim in victims:
            self._drop(victim)
        while limit is not None and len(self._entries) >= limit:
            extra = self.policy.evict()
            if extra is None:  # pragma: no cover - excluded by the pinned count above
                break
            self._drop(extra)
        self.policy.insert(key, False, size)
        entry = self._entries[key] = _Entry(tensor, nbytes, spec, encode_s)
        self._bytes += nbytes
        self._peak = max(self._peak, self._bytes)
        return entry

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        self._c["evictions"] += 1
        self._c["evicted_bytes"] += entry.nbytes

    def _pin(self, key: int, entry: _Entry) -> None:
        if entry.pins == 0:
            self.policy.pin(key)
            self._pinned_entries += 1
            self._pinned_bytes += entry.nbytes
        entry.pins += 1

    def _unpin(self, key: int, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(key) is not entry or entry.pins == 0:
                return  # reset() dropped it while it was held
            entry.pins -= 1
            if entry.pins == 0:
                self.policy.unpin(key)
                self._pinned_entries -= 1
                self._pinned_bytes -= entry.nbytes

    # -- by key (connectors) -----------------------------------------------------------
    def get(
        self, key: int, spec: EncoderSpec, *, expected: Expected | None = None
    ) -> torch.Tensor | None:
        """The output stored under ``key`` (memory, then the tiers), or ``None``; counted."""
        with self._lock:
            self._count(spec.modality, "lookups")
            entry = self._entries.get(key)
            if entry is not None:
                self._count(spec.modality, "hits")
                self._c["encode_seconds_saved"] += entry.encode_s
                self.policy.access(key)
                return entry.tensor
        for i, tier in enumerate(self.tiers):
            tensor = tier.load(key, spec.model_id, expected)
            if tensor is not None:
                with self._lock:
                    self._count(spec.modality, "tier_hits")
                    entry = self._insert(key, tensor, spec, 0.0)
                for upper in self.tiers[:i]:
                    upper.store(key, tensor, spec.model_id)
                return tensor if entry is None else entry.tensor
        with self._lock:
            self._count(spec.modality, "misses")
        return None

    def contains(self, key: int, *, deep: bool = True) -> bool:
        """Whether ``key`` is cached here (or, with ``deep``, on a lower tier or shared medium)."""
        with self._lock:
            if key in self._entries:
                return True
        if not deep:
            return False
        for tier in self.tiers:
            if key in tier:
                return True
            caps = tier.medium.caps
            if caps.shared or caps.persistent:
                try:
                    if tier.medium.contains([key])[0]:
                        return True
                except Exception:  # an unreachable medium answers "no"
                    continue
        return False

    def put(self, key: int, tensor: torch.Tensor, spec: EncoderSpec) -> bool:
        """Cache an output computed elsewhere under ``key``; whether memory holds it."""
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"put() takes a torch.Tensor, got {type(tensor).__name__}")
        tensor = _compact(tensor)
        with self._lock:
            entry = self._insert(key, tensor, spec, 0.0)
        for tier in self.tiers:
            tier.store(key, tensor, spec.model_id)
        return entry is not None

    # -- maintenance -------------------------------------------------------------------
    def reset(self, model: str | None = None) -> int:
        """Drop ``model``'s entries (every entry when ``None``) here and on the tiers.

        Entries in use stay with the callers holding them; their leases then
        release nothing. Returns how many entries left memory.
        """
        with self._lock:
            keys = [k for k, e in self._entries.items() if model is None or e.model_id == model]
            for key in keys:
                entry = self._entries.pop(key)
                self.policy.remove(key)
                self._bytes -= entry.nbytes
                if entry.pins:
                    self._pinned_entries -= 1
                    self._pinned_bytes -= entry.nbytes
                    entry.pins = 0
        for tier in self.tiers:
            tier.remove_model(model)
        return len(keys)

    def stats(self) -> EncoderCacheStats:
        with self._lock:
            c = self._c
            return EncoderCacheStats(
                capacity_bytes=self.capacity_bytes,
                max_entries=self.max_entries,
                policy=self.policy.name,
                entries=len(self._entries),
                bytes_held=self._bytes,
                peak_bytes=self._peak,
                pinned_entries=self._pinned_entries,
                pinned_bytes=self._pinned_bytes,
                lookups=int(c["lookups"]),
                hits=int(c["hits"]),
                tier_hits=int(c["tier_hits"]),
                coalesced=int(c["coalesced"]),
                misses=int(c["misses"]),
                encoder_failures=int(c["encoder_failures"]),
                encode_seconds=c["encode_seconds"],
                encode_seconds_saved=c["encode_seconds_saved"],
                evictions=int(c["evictions"]),
                evicted_bytes=int(c["evicted_bytes"]),
                oversize=int(c["oversize"]),
                not_cached=int(c["not_cached"]),
                by_modality={m: dict(v) for m, v in self._by_modality.items()},
                tiers={t.name: t.stats() for t in self.tiers},
            )

    def check(self) -> None:
        """Raise :class:`~kvtier.errors.InternalInvariantError` if the bookkeeping disagrees."""
        from kvtier.errors import InternalInvariantError

        with self._lock:
            problems: list[str] = []
            total = sum(e.nbytes for e in self._entries.values())
            if total != self._bytes:
                problems.append(f"bytes_held {self._bytes} but entries sum to {total}")
            if self._bytes > self.capacity_bytes:
                problems.append(f"{self._bytes} bytes held over the budget {self.capacity_bytes}")
            if self.max_entries is not None and len(self._entries) > self.max_entries:
                problems.append(f"{len(self._entries)} entries over the limit {self.max_entries}")
            if set(self._entries) != {k for k in self._entries if k in self.policy}:
                problems.append("an entry is not resident in the policy")
            if len(self.policy) != len(self._entries):
                problems.append(f"policy holds {len(self.policy)} keys, cache {len(self._entries)}")
            pinned = [e for e in self._entries.values() if e.pins]
            if len(pinned) != self._pinned_entries:
                problems.append(f"{len(pinned)} pinned entries, counted {self._pinned_entries}")
            if sum(e.nbytes for e in pinned) != self._pinned_bytes:
                problems.append("pinned bytes disagree")
            evictable = len(self._entries) - len(pinned)
            if self.policy.num_evictable != evictable:
                problems.append(
                    f"policy has {self.policy.num_evictable} evictable keys, cache {evictable}"
                )
            if problems:
                raise InternalInvariantError("encoder cache: " + "; ".join(problems))

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
