"""The tier chain: device blocks above host memory, disk and Redis, with promote and demote.

:class:`TierChain` joins a device (a :class:`~kvtier.KVCacheManager` and the
:class:`~kvtier.storage.KVBlockStorage` behind it) to an ordered list of
:class:`Tier` s, fastest first. Each tier is a storage medium, a codec and an
:class:`~kvtier.offload.OffloadingManager` driven by any kvtier policy.

* **Lookup and promote**: after the device's own prefix hit, :meth:`load`
  finds how many further keys some tier holds (the first tier that has a key
  serves it; lookup stops at the first key no tier has), reads them in one
  batch per tier (tiers in parallel on the transfer engine), verifies every
  header and checksum, and writes the payloads into the request's device
  blocks. A corrupt, vanished or unreachable block ends the prefix there: it
  is counted, dropped from its tier if it is bad, and the engine computes
  the rest. Nothing unverified reaches the device.
* **Demote**: each tier writes back or through. A write-back tier receives
  blocks when the level above evicts them: the device's evictions are copied
  to the first tier before the device writes the blocks again (at once, or,
  with ``defer_demotions``, queued and copied in one batch per step by
  :meth:`demote_pending`), and a block a tier
  evicts goes down to the next write-back tier. A write-through tier stores
  every block as soon as it is computed (:meth:`store_computed`). By default
  shared media (Redis) write through, so other engines can hit a prefix at
  once, and local ones (host, disk) write back; ``write_mode`` sets every
  tier alike. Copies to host memory finish before the call returns (one
  batch of asynchronous copies and one wait on CUDA, the checksums hashed
  on a pool meanwhile); writes to disk and Redis run on the transfer engine from a
  snapshot, overlapping with the forward pass, and become loadable when they
  complete (:meth:`poll`).
* **Retention pins**: when the device's policy pins blocks until a time
  (:class:`~kvtier.policy.base.PinSource`: the workflow policy's
  ``cache_ttl_s``), a demoted block carries its pin's end to every tier that
  holds it, and what a tier evicts goes down with the pin it had. Each
  tier evicts unpinned blocks first, then the pins that end latest; a pin
  lapses on the device's clock (the tiers read it too), and :meth:`release`
  drops it with the block. :meth:`pins` lists each tier's; :meth:`stats`
  counts them.
* **Swap**: :meth:`swap_out` stores a paused request's blocks, its partial
  last block included, on the first tier and frees them on the device;
  :meth:`swap_in` brings them back.
* **Compress**: a device tier (:class:`~kvtier.offload.device_tier.DeviceStore`,
  first in the chain) holds evicted blocks int8- or fp8-encoded in device
  memory; :meth:`compress` moves a request's cached blocks there at once.
* **Quantized pools**: when the device pool itself holds int8 or fp8 blocks
  (:class:`~kvtier.storage.QuantizedKVBlockStorage`), a tier of the same codec
  receives and returns them as they are, without a decode and re-encode;
  other codecs decode them to the model's dtype first.

Tier failures never reach the caller: an unreachable Redis is counted, its
tier is skipped, and it is used again once it answers. Each such condition
is logged once when it starts (with what to do) and once when it ends, not
per failure; corrupt blocks are logged as they come, summarised when they
come in bursts. A medium that lost blocks behind the chain's back (a Redis
restart, a server's own eviction, a deleted directory) is reconciled: the
tiers' bookkeeping is checked against their media every
``reconcile_interval_s`` (and after a tier comes back), and keys the medium
no longer holds are dropped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.errors import (
    ConfigError,
    KvTierError,
)
from kvtier.manager import KVCacheManager
from kvtier.obs.episodes import Episodes, Summary
from kvtier.offload import swap
from kvtier.offload.admission import TierAdmission, WriteAll, make_admission
from kvtier.offload.backward import BackwardLoad
from kvtier.offload.compress import CompressionResult, compress
from kvtier.offload.demote import Demoter
from kvtier.offload.device_tier import DeviceStore
from kvtier.offload.layerwise import fill_layerwise
from kvtier.offload.manager import OffloadingEvent, PinEvent
from kvtier.offload.media import ItemFormat
from kvtier.offload.promote import LoadBatch, PendingLoad, Reader, install, plan_batches
from kvtier.offload.swap import SwappedRequest
from kvtier.offload.tier import Tier, write_mode_of
from kvtier.offload.transfer import TransferEngine, TransferResult
from kvtier.policy.base import pin_ends_of
from kvtier.storage import KVBlockStorage

log = logging.getLogger("kvtier.offload")

#: No retention pins (shared, never written).
_NO_PINS: dict[int, float] = {}


class TierChain:
    """Device + tiers (see the module docstring)."""

    def __init__(
        self,
        storage: KVBlockStorage,
        device_manager: KVCacheManager,
        tiers: Sequence[Tier],
        *,
        write_mode: str | None = None,
        transfer: TransferEngine | None = None,
        namespace: str | None = None,
        reconcile_interval_s: float = 30.0,
        reconcile_batch: int = 4096,
        tier_admission: str | TierAdmission = "write-all",
        layer_loads: bool = False,
    ) -> None:
        if write_mode is not None:
            mode = write_mode_of(write_mode, "write_back")
            for tier in tiers:
                tier.write_mode = mode
        if not tiers:
            raise ConfigError("a tier chain needs at least one tier below the device")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be distinct, got {names}")
        self.storage = storage
        self.device_manager = device_manager
        self.tiers = list(tiers)
        self.transfer = transfer or TransferEngine(max(2, len(self.tiers)))
        self._own_transfer = transfer is None
        ns = namespace or f"{device_manager.namespace_root:032x}"[:16]
        self.namespace = ns
        #: Every write to the tiers (encoding, room, cascades, background stores).
        self._demoter = Demoter(storage, self.tiers, self.transfer)
        # Serializes the chain's bookkeeping between the engine thread and
        # callers that read stats or swap from elsewhere.
        self._lock = threading.RLock()
        self._closed = False
        #: Degraded conditions (a tier unreachable, failing stores), logged per episode.
        self.episodes = Episodes(log)
        self._bursts = Summary(log)
        self.reconcile_interval_s = reconcile_interval_s
        self.reconcile_batch = reconcile_batch
        self._last_reconcile = time.monotonic()
        self._reconcile_due: set[int] = set()
        # Background reads of loads in flight, and the results that came back.
        self._load_jobs: set[int] = set()
        self._load_results: dict[int, TransferResult] = {}
        #: Land loads from an in-process tier layer by layer, while the forward pass that
        #: needs them starts (:func:`~kvtier.offload.layerwise.fill_layerwise`).
        self.layer_loads = layer_loads
        #: Batches landing layer by layer: their tier items stay in use until the
        #: storage's fill has settled.
        self._landing: list[tuple[int, list[int]]] = []
        shape = tuple(storage.block_shape)
        for tier in self.tiers:
            # One log for the whole chain: an outage is told once, whichever tier it hit.
            tier.health.episodes = self.episodes
            fmt = ItemFormat(tier.codec, shape, storage.dtype)
            tier.fmt = fmt
            tier.medium.bind(ns, tier.capacity, fmt.payload_size)
            if tier.medium.caps.persistent:
                self._adopt_persistent(tier)
        #: Queue device evictions for :meth:`demote_pending` instead of copying them inside
        #: the pool's ``allocate`` (an engine that flushes them before each write sets it).
        self.defer_demotions = False
        #: Which device evictions the first tier writes (:mod:`kvtier.offload.admission`).
        self.admission = self._make_admission(tier_admission)
        #: Queued device evictions: keys, blocks and the pins they carry.
        self._demotions: list[tuple[list[int], list[int], dict[int, float]]] = []
        #: Told ``(tier name, blocks, bytes, seconds)`` after each whole batch a load read
        #: and installed (a cost model learns each tier's bandwidth and latency from it).
        self.on_load: Callable[[str, int, int, float], None] | None = None
        #: The device policy's retention pins (``None``: it keeps none), read as data when
        #: blocks leave the device.
        self._pin_ends = pin_ends_of(device_manager.policy)
        if self._pin_ends is not None:
            for tier in self.tiers:
                # One clock for the chain: the device's pins end on the device's clock.
                tier.offload_manager.clock = lambda: device_manager.clock()
        if self.tiers[0].writes_back or self._pin_ends is not None:
            device_manager.add_evict_listener(self._on_device_evict)

    # -- restart ---------------------------------------------------------------------
    def _adopt_persistent(self, tier: Tier) -> None:
        tier.counters.adopted_blocks += tier.adopt_scan()

    # -- lookup ------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int]) -> list[int]:
        """For each leading key some tier holds ready, the index of the first such tier."""
        with self._lock:
            self._poll_locked()
            return self._lookup(keys)

    def _lookup(self, keys: Sequence[int]) -> list[int]:
        plan: list[int] = []
        tiers = self.tiers
        probed: set[int] = set()
        i = 0
        n = len(keys)
        while i < n:
            key = keys[i]
            where = -1
            for t, tier in enumerate(tiers):
                if tier.offload_manager.is_ready(key):
                    where = t
                    break
            if where < 0:
                where = self._probe_shared(keys, i, probed)
                if where < 0:
                    break
            plan.append(where)
            i += 1
        for t, tier in enumerate(tiers):
            tier.counters.lookups += 1
            tier.counters.hit_blocks += plan.count(t)
        admission = self.admission
        if type(admission) is not WriteAll:
            admission.hit([keys[j] for j, where in enumerate(plan) if where == 0])
            if i < n:
                admission.missed(keys[i])
        return plan

    def _probe_shared(self, keys: Sequence[int], i: int, probed: set[int]) -> int:
        """Ask shared media (Redis) about ``keys[i:]``; adopt what they hold. Tier index or -1."""
        for t, tier in enumerate(self.tiers):
            if not tier.medium.caps.shared or t in probed:
                continue
            probed.add(t)
            rest = [k for k in keys[i:] if k not in tier.offload_manager]
            if not rest or rest[0] != keys[i]:
                continue
            adopted = tier.adopt_present(rest)
            if adopted is None:
                continue
            self._reachable(t)
            tier.counters.adopted_blocks += adopted
            if adopted and tier.offload_manager.is_ready(keys[i]):
                return t
        return -1

    # -- promote -----------------------------------------------------------------------
    def load(self, keys: Sequence[int], blocks: Sequence[int]) -> int:
        """Load the leading ``keys`` some tier holds into device ``blocks``; returns how many.

        ``blocks`` are the request's device blocks for ``keys`` (private to it
        until it is done with them). Only verified payloads are written; the
        count stops at the first block that could not be loaded.
        """
        pending = self.start_load(keys, blocks)
        return 0 if pending is None else self.finish_load(pending)

    def start_load(self, keys: Sequence[int], blocks: Sequence[int]) -> PendingLoad | None:
        """Begin loading the leading ``keys`` some tier holds; ``None`` when no tier has the first.

        Reads from slow media run in the background; :meth:`load_done` says
        when they are in and :meth:`finish_load` verifies them and writes
        them into ``blocks`` (on the caller's thread, between forward passes).
        ``PendingLoad.num_blocks`` is how many blocks the tiers promised.
        """
        if len(keys) != len(blocks):
            raise ConfigError(f"load got {len(keys)} keys but {len(blocks)} blocks")
        with self._lock:
            self._poll_locked()
            plan = self._lookup(keys)
            for t, tier in enumerate(self.tiers):
                # Each tier's policy hears of the request with what it holds of it.
                n = 0
                while n < len(plan) and plan[n] == t:
                    n += 1
                tier.offload_manager.on_request(keys, n)
            if not plan:
                return None
            batches = plan_batches(plan, keys, blocks)
            for b in batches:
                tier = self.tiers[b.tier]
                b.slots = tier.offload_manager.prepare_load(b.keys)
                items = list(zip(b.keys, b.slots, strict=True))
                if not tier.medium.caps.background:
                    started = time.perf_counter()
                    try:
                        b.stored = tier.medium.get(items)
                    except KvTierError as exc:
                        b.error = exc
                    b.read_s = time.perf_counter() - started
                else:
                    job = Reader(tier.medium, items, b)
                    b.job = self.transfer.submit("load", job, b.tier)
                    self._load_jobs.add(b.job)
            return PendingLoad(batches, len(plan))

    def load_done(self, pending: PendingLoad) -> bool:
        """Whether every read of ``pending`` has finished (never blocks)."""
        with self._lock:
            self._poll_locked()
            return all(b.job < 0 or b.job in self._load_results for b in pending.batches)

    def finish_load(self, pending: PendingLoad) -> int:
        """Wait for ``pending``'s reads, verify and install them; returns the blocks loaded."""
        self.demote_pending()  # the load writes device blocks some eviction may still need
        jobs = [b.job for b in pending.batches if b.job >= 0]
        waiting = [j for j in jobs if j not in self._load_results]
        done = self.transfer.wait(waiting) if waiting else []
        with self._lock:
            self._poll_locked(done)
            for b in pending.batches:
                if b.job >= 0:
                    r = self._load_results.pop(b.job)
                    self._load_jobs.discard(b.job)
                    if r.ok:
                        b.stored = r.value
                    else:
                        b.error = r.error
            loaded = 0
            try:
                for b in pending.batches:
                    started = time.perf_counter()
                    want = len(b.keys)
                    got = self._install(b)
                    loaded += got
                    if got:
                        name = self.tiers[b.tier].name
                        by_tier = pending.loaded_by_tier
                        by_tier[name] = by_tier.get(name, 0) + got
                    if got < want:
                        break
                    self._observe_load(b, b.read_s + time.perf_counter() - started)
            finally:
                for b in pending.batches:
                    if b.filled and self.storage.filling:
                        self._landing.append((b.tier, b.keys))
                    else:
                        self.tiers[b.tier].offload_manager.complete_load(b.keys)
            return loaded

    # -- backward loads (load and compute together) -------------------------------------
    def start_backward_load(self, keys: Sequence[int], group: int) -> BackwardLoad | None:
        """Start reading the leading ``keys`` some tier holds, last first, on a thread.

        ``None`` unless one tier serves them all (from the first on), on a
        medium whose reads are slow I/O (``caps.background``): a run of two
        tiers would meet the compute at either's boundary, which the plain
        load handles, and a memory copy gains nothing from a thread. The keys
        are pinned on their tier until :meth:`release_backward`. ``group``
        keys are read per medium call.
        """
        with self._lock:
            self._poll_locked()
            plan = self._lookup(keys)
            if not plan or any(t != plan[0] for t in plan):
                return None
            t = plan[0]
            tier = self.tiers[t]
            if not tier.medium.caps.background:
                return None
            tier.offload_manager.on_request(keys, len(plan))
            wanted = list(keys[: len(plan)])
            slots = tier.offload_manager.prepare_load(wanted)
            load = BackwardLoad(tier.medium, t, list(zip(wanted, slots, strict=True)), group)
        load.start()
        return load

    def install_backward(self, load: BackwardLoad, start: int, blocks: Sequence[int]) -> int:
        """Verify the read payloads ``start`` .. the end and write them into ``blocks``.

        ``start`` is at or after :attr:`BackwardLoad.lowest`; ``blocks`` are
        the request's device blocks for those keys. Stops at the first block
        that fails its checks (dropped from its tier, as any load drops it);
        returns how many were written, in order from ``start``.
        """
        stored = load.take(start)
        if not stored:
            return 0
        self.demote_pending()  # the install writes device blocks an eviction may still need
        with self._lock:
            keys = [k for k, _ in load.items[start:]]
            b = LoadBatch(load.tier, start, keys, list(blocks))
            b.slots = [s for _, s in load.items[start:]]
            b.stored = list(stored)
            got = self._install(b)
            load.dropped.update(set(keys) - set(b.keys))
            return got

    def release_backward(self, load: BackwardLoad) -> None:
        """Unpin a backward load's keys once its thread has ended, and tell :attr:`on_load`
        what its reads cost."""
        assert load.done or not load.thread.is_alive()
        with self._lock:
            tier = self.tiers[load.tier]
            keys = [k for k, _ in load.items if k not in load.dropped]
            if keys:
                tier.offload_manager.complete_load(keys)
            if isinstance(load.error, KvTierError):
                self._unreachable(tier, load.error)  # counted and logged as any failed read
            listener = self.on_load
            fmt = tier.fmt
            if listener is None or fmt is None:
                return
            for n, seconds in load.reads:
                try:
                    listener(tier.name, n, n * fmt.blob_size, seconds)
                except Exception:  # a listener's failure never fails a load
                    log.exception("the load listener failed")

    def _observe_load(self, b: LoadBatch, seconds: float) -> None:
        """Tell :attr:`on_load` what a whole batch cost (read and install)."""
        listener = self.on_load
        tier = self.tiers[b.tier]
        if listener is None or tier.fmt is None or not b.keys:
            return
        try:
            listener(tier.name, len(b.keys), len(b.keys) * tier.fmt.blob_size, seconds)
        except Exception:  # a listener's failure never fails a load
            log.exception("the load listener failed")

    def _install(self, b: LoadBatch) -> int:
        """Verify and write ``b``'s payloads into device blocks; returns the leading count."""
        tier = self.tiers[b.tier]
        if b.error is not None or b.stored is None:
            self._unreachable(tier, b.error)
            return 0
        self._reachable(b.tier)
        done = fill_layerwise(self.storage, tier, b) if self.layer_loads else None
        if done is None:
            done = install(self.storage, tier, b)
        b.filled = done.filled
        if done.error is not None:
            self._bursts.event(
                f"{tier.name}:corrupt",
                f"{tier.name} tier: {done.error}; the block was dropped and is recomputed "
                "(repeated corruption points at failing storage)",
                _counted(f"{tier.name} tier: {{}} more corrupt blocks dropped"),
            )
        if done.bad_key is not None:
            self._forget(tier, [done.bad_key], b)
        if done.loaded:
            tier.offload_manager.touch(b.keys[: done.loaded])
        return done.loaded

    def _forget(self, tier: Tier, keys: list[int], b: LoadBatch) -> None:
        """Drop bad or vanished ``keys`` from ``tier`` (and its medium) now.

        This load's pins on them are released here and the keys leave
        ``b.keys``, so the caller's ``complete_load(b.keys)`` still balances.
        """
        tier.offload_manager.complete_load(keys)
        # The medium may be shared (Redis): a bad value is purged for everyone.
        tier.drop(keys, bad=True)
        b.keys = [k for k in b.keys if k not in keys]

    # -- demote ------------------------------------------------------------------------
    def _make_admission(self, rule: str | TierAdmission) -> TierAdmission:
        if isinstance(rule, TierAdmission):
            admission = rule
        else:
            first = self.tiers[0]
            size = first.fmt.payload_size if first.fmt is not None else 1
            admission = make_admission(
                rule,
                self.device_manager.policy,
                capacity_bytes=first.capacity * size,
                typical_size=size,
            )
        if type(admission) is not WriteAll:
            # The rule learns from what the first tier serves, misses and evicts.
            self._demoter.on_evicted = self._tier_evicted
        return admission

    def _admit(self, keys: list[int], blocks: list[int]) -> tuple[list[int], list[int]]:
        """The evicted blocks the admission rule writes (decided while the pool still
        links each block to its parent)."""
        parents = self.device_manager.pool.parent_keys(blocks)
        fmt = self.tiers[0].fmt
        size = fmt.payload_size if fmt is not None else 1
        write = self.admission.decide(
            keys, parents, [size] * len(keys), self.device_manager.clock()
        )
        if all(write):
            return keys, blocks
        kept = [i for i, ok in enumerate(write) if ok]
        return [keys[i] for i in kept], [blocks[i] for i in kept]

    def _tier_evicted(self, t: int, keys: list[int]) -> None:
        if t == 0:
            self.admission.left(keys)

    def _on_device_evict(self, keys: list[int], blocks: list[int]) -> None:
        """Pool listener: demote evicted blocks to the first tier before they are rewritten.

        With :attr:`defer_demotions` the blocks are only queued here (the
        pool's ``allocate`` does no copy) and :meth:`demote_pending` copies a
        step's evictions in one batch before anything writes those blocks.
        """
        pins = self._pin_ends(keys) if self._pin_ends is not None else _NO_PINS
        if pins:
            # Tiers that hold these blocks already (write-through, or an earlier
            # demotion) keep them pinned as the device did.
            self._pin_held(pins)
        if not self.tiers[0].writes_back:
            return
        if type(self.admission) is not WriteAll:
            keys, blocks = self._admit(keys, blocks)
            if not keys:
                return
        if self.defer_demotions:
            self._demotions.append((list(keys), list(blocks), pins))
            return
        self._demote(list(keys), list(blocks), pins)

    def _pin_held(self, pins: dict[int, float]) -> None:
        """Pin the blocks of ``pins`` on every tier that holds them (key -> end)."""
        try:
            with self._lock:
                for tier in self.tiers:
                    tier.offload_manager.set_pins(pins)
        except Exception:  # bookkeeping of pins must never break the pool's eviction
            log.exception("pinning %d demoted blocks on the tiers failed", len(pins))

    def _demote(self, keys: list[int], blocks: list[int], pins: dict[int, float]) -> None:
        try:
            with self._lock:
                learning = type(self.admission) is not WriteAll
                if learning:
                    mgr = self.tiers[0].offload_manager
                    new = [k for k in keys if k not in mgr]
                self._demoter.store_blocks(0, keys, blocks, pins=pins or None)
                if learning:
                    stored = [k for k in new if k in mgr]
                    if stored:
                        self.admission.stored(stored, self.device_manager.clock())
        except Exception:  # a failed demotion must never break the pool's eviction
            log.exception("demoting %d evicted blocks failed; they are lost", len(keys))
            self.tiers[0].counters.store_failures += len(keys)

    @property
    def demotions_pending(self) -> int:
        """Evicted device blocks queued for :meth:`demote_pending`."""
        return sum(len(keys) for keys, _, _ in self._demotions)

    def demote_pending(self) -> int:
        """Copy the queued device evictions to the first tier; returns how many blocks.

        The owner calls this before anything writes device blocks again (a
        forward pass, a copy-on-write copy, an imported block); the chain's
        own loads call it first too.
        """
        if not self._demotions:
            return 0
        queued, self._demotions = self._demotions, []
        keys = [k for ks, _, _ in queued for k in ks]
        blocks = [b for _, bs, _ in queued for b in bs]
        pins: dict[int, float] = _NO_PINS
        for _, _, p in queued:
            if p:
                pins = p if not pins else {**pins, **p}
        self._demote(keys, blocks, pins)
        return len(keys)

    @property
    def write_mode(self) -> str:
        """The tiers' common write mode, or ``"mixed"``."""
        modes = {t.write_mode for t in self.tiers}
        return modes.pop() if len(modes) == 1 else "mixed"

    @property
    def writes_through(self) -> bool:
        """Whether some tier stores every block as soon as it is computed."""
        return any(not t.writes_back for t in self.tiers)

    def store_computed(self, keys: Sequence[int], blocks: Sequence[int]) -> None:
        """Store freshly computed device blocks on every write-through tier."""
        if not keys:
            return
        with self._lock:
            self._poll_locked()
            for t, tier in enumerate(self.tiers):
                if not tier.writes_back:
                    self._demoter.store_blocks(t, list(keys), list(blocks), cascade=False)

    # -- completion ------------------------------------------------------------------------
    @property
    def stores_pending(self) -> bool:
        """Whether background stores are still in flight (a :meth:`poll` will finish them)."""
        return bool(self._demoter.pending)

    def poll(self) -> int:
        """Finish background stores that completed; returns how many jobs ended."""
        with self._lock:
            return self._poll_locked()

    def _poll_locked(self, done: list[TransferResult] | None = None) -> int:
        if self._landing and not self.storage.filling:
            self._landed()
        if done is None:
            done = self.transfer.get_finished()
        handled = 0
        for r in done:
            if r.kind == "load" and r.job_id in self._load_jobs:
                self._load_results[r.job_id] = r  # its finish_load takes it
                continue
            if r.kind != "store" or r.job_id not in self._demoter.pending:
                continue
            handled += 1
            t = self._demoter.finish(r)
            if t is not None:
                self._reachable(t)
        self._maybe_reconcile()
        return handled

    def _landed(self) -> None:
        """Batches that landed layer by layer: their tier items are free again."""
        landing, self._landing = self._landing, []
        for t, keys in landing:
            self.tiers[t].offload_manager.complete_load(keys)

    # -- degraded conditions -----------------------------------------------------------------
    def _unreachable(self, tier: Tier, exc: BaseException | None) -> None:
        tier.health.failed(exc)

    def _reachable(self, t: int) -> None:
        if self.tiers[t].health.answered():
            # What it lost meanwhile (a restarted Redis) must leave the bookkeeping.
            self._reconcile_due.add(t)

    # -- reconciliation --------------------------------------------------------------------
    def _maybe_reconcile(self) -> None:
        now = time.monotonic()
        due = self._reconcile_due
        if now >= self._last_reconcile + self.reconcile_interval_s:
            self._last_reconcile = now
            due.update(range(len(self.tiers)))
        while due:
            self._reconcile(due.pop(), self.reconcile_batch)

    def release(self, keys: Sequence[int]) -> list[int]:
        """Free ``keys`` on every tier, from its bookkeeping and its medium (a shared
        medium's copy too): blocks nothing will read again, such as an ended session's
        own. Returns the keys a tier still holds because a load is reading them: release
        those again once it is done."""
        busy: dict[int, None] = {}
        if not keys:
            return []
        with self._lock:
            for tier in self.tiers:
                mgr = tier.offload_manager
                held = [k for k in keys if mgr.is_ready(k)]
                free = [k for k in held if not mgr.is_pinned(k)]
                busy.update(dict.fromkeys(k for k in held if mgr.is_pinned(k)))
                if free:
                    # Purged, not only deleted: a shared medium keeps evicted blocks for
                    # other engines, but a released block is nobody's.
                    tier.drop(free, bad=True)
                    tier.counters.released_blocks += len(free)
        return list(busy)

    def reconcile(self, limit: int | None = None) -> int:
        """Drop keys the tiers track but their media no longer hold; returns how many.

        Each call checks up to ``limit`` keys per tier (all when ``None``),
        resuming where the previous call stopped.
        """
        with self._lock:
            return sum(self._reconcile(t, limit) for t in range(len(self.tiers)))

    def _reconcile(self, t: int, limit: int | None) -> int:
        tier = self.tiers[t]
        gone = tier.reconcile(limit)
        if not gone:
            return 0
        tier.counters.reconciled_blocks += len(gone)
        self._bursts.event(
            f"{tier.name}:reconciled",
            f"the {tier.name} tier's medium no longer holds {len(gone)} blocks it tracked "
            "(a restart, the server's own eviction or deleted files); they were dropped "
            "from its bookkeeping",
            _counted(f"{tier.name} tier: {{}} more reconciliations dropped blocks"),
        )
        return len(gone)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every background store has completed (or failed)."""
        self.demote_pending()
        with self._lock:
            jobs = list(self._demoter.pending)
        if jobs:
            results = self.transfer.wait(jobs, timeout)
            with self._lock:
                self._poll_locked(results + self.transfer.get_finished())

    # -- single blocks, for swap and compression -------------------------------------
    def locked(self) -> contextlib.AbstractContextManager[object]:
        """The chain's lock (reentrant): hold it across several calls that must not
        interleave with the engine thread's."""
        return self._lock

    def store_blocks(self, t: int, keys: Sequence[int], blocks: Sequence[int]) -> None:
        """Store device ``blocks`` under ``keys`` on tier ``t`` now (cascading what it evicts),
        with the pins the device's policy has on them."""
        keys = list(keys)
        pins = self._pin_ends(keys) if self._pin_ends is not None else None
        with self._lock:
            self._poll_locked()
            self._demoter.store_blocks(t, keys, list(blocks), cascade=True, pins=pins or None)

    def load_block(self, t: int, key: int, block: int, *, consume: bool = False) -> bool:
        """Load the item under ``key`` on tier ``t`` (adopted from a shared medium if another
        engine stored it) into device ``block``, verified; ``consume`` then drops it from the
        tier. Whether it loaded."""
        self.demote_pending()
        with self._lock:
            tier = self.tiers[t]
            if not tier.offload_manager.is_ready(key) and not tier.adopt_present([key]):
                return False
            b = LoadBatch(t, 0, [key], [block])
            b.slots = tier.offload_manager.prepare_load(b.keys)
            try:
                b.stored = tier.medium.get(list(zip(b.keys, b.slots, strict=True)))
            except KvTierError as exc:
                b.error = exc
            try:
                ok = self._install(b) == 1
            finally:
                tier.offload_manager.complete_load(b.keys)
            if ok and consume:
                tier.drop([key], bad=True)
            return ok

    # -- whole requests (see :mod:`kvtier.offload.swap`) -----------------------------------
    def swap_out(
        self,
        request_id: object,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        *,
        extra_keys: Sequence[object] = (),
    ) -> SwappedRequest:
        """Store a paused request's computed blocks on the first tier and free them."""
        with self._lock:
            return swap.swap_out(
                self, request_id, token_ids, num_computed_tokens, extra_keys=extra_keys
            )

    def store_request(
        self,
        request_id: object,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        *,
        tier: int = 0,
        extra_keys: Sequence[object] = (),
    ) -> SwappedRequest:
        """Store a live request's computed blocks on tier ``tier``; it keeps its device blocks."""
        with self._lock:
            return swap.store_request(
                self, request_id, token_ids, num_computed_tokens, tier=tier, extra_keys=extra_keys
            )

    def load_tail(self, swapped: SwappedRequest, block: int) -> bool:
        """Load a swapped request's partial last block into device ``block``."""
        return swap.load_tail(self, swapped, block)

    def shared_tier(self) -> int | None:
        """Index of the first tier on a medium other engines share (Redis), if any."""
        for t, tier in enumerate(self.tiers):
            if tier.medium.caps.shared:
                return t
        return None

    # -- compression (see :mod:`kvtier.offload.compress`) -------------------------------------
    def device_tier(self) -> int | None:
        """The index of the compressed device tier, if the chain has one."""
        for t, tier in enumerate(self.tiers):
            if isinstance(tier.medium, DeviceStore):
                return t
        return None

    def compress(
        self, keys: Sequence[int], fraction: float = 1.0, *, tier: int | None = None
    ) -> CompressionResult:
        """Move the last ``fraction`` of a chain's cached device blocks to a tier now."""
        return compress(self, keys, fraction, tier=tier)

    # -- stats, events, shutdown -------------------------------------------------------------
    def take_events(self) -> list[OffloadingEvent]:
        with self._lock:
            out: list[OffloadingEvent] = []
            for tier in self.tiers:
                out.extend(tier.offload_manager.take_events())
            return out

    def take_all_events(self) -> list[OffloadingEvent | PinEvent]:
        """:meth:`take_events` with the tiers' pin events among them."""
        with self._lock:
            out: list[OffloadingEvent | PinEvent] = []
            for tier in self.tiers:
                out.extend(tier.offload_manager.take_all_events())
            return out

    def stats(self) -> dict[str, dict[str, float]]:
        """Per tier: occupancy and counters."""
        with self._lock:
            out: dict[str, dict[str, float]] = {}
            device_bytes = self.storage.bytes_per_block
            for tier in self.tiers:
                d: dict[str, float] = dict(vars(tier.counters))
                d["unavailable_errors"] = tier.health.unavailable
                d["capacity_blocks"] = tier.capacity
                d["used_blocks"] = len(tier.offload_manager)
                d["evictions"] = tier.offload_manager.evictions
                # Blocks a retention pin keeps (until it ends), and pins it had to evict.
                d["pinned_blocks"] = tier.offload_manager.num_pinned
                d["pinned_evictions"] = tier.offload_manager.pinned_evictions
                # Against the pool's own block size: what the codec saves.
                stored = tier.fmt.payload_size if tier.fmt is not None else device_bytes
                d["compression_ratio"] = device_bytes / stored
                d["bytes_saved"] = len(tier.offload_manager) * (device_bytes - stored)
                if tier is self.tiers[0] and type(self.admission) is not WriteAll:
                    d["admission_skipped_blocks"] = self.admission.skipped
                out[tier.name] = d
            return out

    def pins(self) -> dict[str, dict[int, float]]:
        """Per tier, its blocks' retention pins that have not ended (key -> end)."""
        with self._lock:
            return {tier.name: tier.offload_manager.pins() for tier in self.tiers}

    def check(self) -> None:
        with self._lock:
            for tier in self.tiers:
                tier.offload_manager.check()

    def close(self) -> None:
        """Finish background stores, detach from the device pool and close the media."""
        if self._closed:
            return
        self._closed = True
        self.storage.settle_fill()
        with self._lock:
            self._landed()
        self.flush()
        self.device_manager.remove_evict_listener(self._on_device_evict)
        if self._own_transfer:
            self.transfer.shutdown()
        for tier in self.tiers:
            tier.medium.close()


def _counted(template: str) -> Callable[[int], str]:
    """A summary line for a count of held-back events: ``template`` with ``{}`` for it."""
    return template.format
