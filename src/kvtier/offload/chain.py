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
  to the first tier before the device reuses the blocks, and a block a tier
  evicts goes down to the next write-back tier. A write-through tier stores
  every block as soon as it is computed (:meth:`store_computed`). By default
  shared media (Redis) write through, so other engines can hit a prefix at
  once, and local ones (host, disk) write back; ``write_mode`` sets every
  tier alike. Copies to host memory are synchronous (one
  memcpy); writes to disk and Redis run on the transfer engine from a
  snapshot, overlapping with the forward pass, and become loadable when they
  complete (:meth:`poll`).
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
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import xxhash

from kvtier.errors import (
    BadRequestError,
    ConfigError,
    CorruptBlockError,
    KvTierError,
    TierUnavailableError,
)
from kvtier.manager import KVCacheManager
from kvtier.obs.episodes import Episodes, Summary
from kvtier.offload.codec import Codec, RawCodec, make_codec, verify
from kvtier.offload.device_tier import DeviceStore
from kvtier.offload.manager import OffloadingEvent, OffloadingManager
from kvtier.offload.media import BlockStore, ItemFormat, PutItem, Stored
from kvtier.offload.transfer import TransferEngine, TransferResult
from kvtier.policy.base import EvictionPolicy
from kvtier.storage import KVBlockStorage, QuantizedKVBlockStorage

log = logging.getLogger("kvtier.offload")

WriteMode = Literal["write_back", "write_through"]
WRITE_MODES: tuple[str, ...] = ("write_back", "write_through")


@dataclass
class TierCounters:
    """What one tier did; exported as metrics."""

    lookups: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    store_failures: int = 0
    #: Blocks the device evicted that this tier had no room for (lost).
    dropped_blocks: int = 0
    corrupt_blocks: int = 0
    #: Blocks the tier's bookkeeping had but the medium did not (a server evicted them).
    vanished_blocks: int = 0
    unavailable_errors: int = 0
    adopted_blocks: int = 0
    #: Keys the bookkeeping held that reconciliation found missing from the medium.
    reconciled_blocks: int = 0
    #: Seconds spent encoding blocks for this tier, and decoding them back (int8/fp8
    #: codecs; raw payloads are copies and count in neither).
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    #: Calls of :meth:`TierChain.compress` that moved blocks here.
    compressed_requests: int = 0


class Tier:
    """One storage level below the device: medium + codec + offloading manager."""

    def __init__(
        self,
        store: BlockStore,
        capacity_blocks: int,
        *,
        policy: str | EvictionPolicy = "lru",
        codec: str | Codec = "raw",
        name: str | None = None,
        write_mode: str | None = None,
    ) -> None:
        self.store = store
        self.name = name or store.name
        self.codec = make_codec(codec)
        self.offload_manager = OffloadingManager(capacity_blocks, policy, medium=self.name)
        self.counters = TierCounters()
        #: The format of this tier's blocks (set when the chain binds it).
        self.fmt: ItemFormat | None = None
        #: ``"write_back"`` or ``"write_through"`` (default: through for shared media).
        self.write_mode: WriteMode = _write_mode(
            write_mode, "write_through" if store.caps.shared else "write_back"
        )

    @property
    def writes_back(self) -> bool:
        return self.write_mode == "write_back"

    @property
    def capacity(self) -> int:
        return self.offload_manager.capacity

    def __repr__(self) -> str:
        return (
            f"Tier({self.name}, {len(self.offload_manager)}/{self.capacity} blocks, "
            f"codec={self.codec.name}, policy={self.offload_manager.policy.name}, "
            f"{self.write_mode})"
        )


def _write_mode(mode: str | None, default: WriteMode) -> WriteMode:
    if mode is None:
        return default
    if mode not in WRITE_MODES:
        raise ConfigError(f"write_mode must be one of {', '.join(WRITE_MODES)}, got {mode!r}")
    return "write_back" if mode == "write_back" else "write_through"


@dataclass
class PendingLoad:
    """A load :meth:`TierChain.start_load` began: per-tier batches, some read in the background."""

    batches: list[_Batch]
    #: Blocks the tiers held when the load began (the most it can bring in).
    num_blocks: int


@dataclass(frozen=True, slots=True)
class SwappedRequest:
    """What :meth:`TierChain.swap_out` kept of a request, for :meth:`TierChain.swap_in`."""

    request_id: object
    token_ids: tuple[int, ...]
    extra_keys: tuple[object, ...]
    num_computed_tokens: int
    #: Key the partial last block was stored under (``None``: no partial block).
    tail_key: int | None
    #: The tier the tail went to (index into the chain's tiers).
    tail_tier: int = 0


@dataclass(frozen=True, slots=True)
class CompressionResult:
    """What :meth:`TierChain.compress` moved off the device pool."""

    #: Blocks moved to the tier (and freed on the device).
    blocks: int
    #: Bytes they held in the device pool, and bytes they take on the tier.
    device_bytes: int
    stored_bytes: int
    #: Wall time of the move (encoding included).
    seconds: float

    @property
    def ratio(self) -> float:
        """Device bytes per stored byte (0 when nothing moved)."""
        return self.device_bytes / self.stored_bytes if self.stored_bytes else 0.0

    def __add__(self, other: CompressionResult) -> CompressionResult:
        return CompressionResult(
            self.blocks + other.blocks,
            self.device_bytes + other.device_bytes,
            self.stored_bytes + other.stored_bytes,
            self.seconds + other.seconds,
        )


@dataclass
class _Batch:
    """One tier's part of a load: keys, their device blocks, and what came back."""

    tier: int
    start: int
    keys: list[int]
    blocks: list[int]
    slots: list[int] = field(default_factory=list)
    job: int = -1
    stored: list[Stored | None] | None = None
    error: BaseException | None = None


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
    ) -> None:
        if write_mode is not None:
            mode = _write_mode(write_mode, "write_back")
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
        self._pending: dict[int, tuple[int, list[int], int]] = {}  # job -> (tier, keys, bytes)
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
        self._reconcile_cursor: dict[int, int] = {}
        shape = tuple(storage.block_shape)
        for tier in self.tiers:
            fmt = ItemFormat(tier.codec, shape, storage.dtype)
            tier.fmt = fmt
            tier.store.bind(ns, tier.capacity, fmt.payload_size)
            if tier.store.caps.persistent:
                self._adopt_persistent(tier)
        if self.tiers[0].writes_back:
            device_manager.add_evict_listener(self._on_device_evict)

    # -- restart ---------------------------------------------------------------------
    def _adopt_persistent(self, tier: Tier) -> None:
        try:
            keys = tier.store.scan()
        except TierUnavailableError as exc:
            self._unreachable(tier, exc)
            return
        if len(keys) > tier.capacity:
            keys = keys[-tier.capacity :]  # the newest ones
        adopted = tier.offload_manager.adopt(keys)
        tier.counters.adopted_blocks += len(adopted)
        if adopted:
            log.info("%s tier: found %d blocks from an earlier run", tier.name, len(adopted))

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
        return plan

    def _probe_shared(self, keys: Sequence[int], i: int, probed: set[int]) -> int:
        """Ask shared media (Redis) about ``keys[i:]``; adopt what they hold. Tier index or -1."""
        for t, tier in enumerate(self.tiers):
            if not tier.store.caps.shared or t in probed:
                continue
            probed.add(t)
            rest = [k for k in keys[i:] if k not in tier.offload_manager]
            if not rest or rest[0] != keys[i]:
                continue
            try:
                present = tier.store.contains(rest)
            except TierUnavailableError as exc:
                self._unreachable(tier, exc)
                continue
            self._reachable(t)
            n = 0
            while n < len(present) and present[n]:
                n += 1
            if n:
                tier.counters.adopted_blocks += len(tier.offload_manager.adopt(rest[:n]))
                if tier.offload_manager.is_ready(keys[i]):
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
            batches = self._plan_batches(plan, keys, blocks)
            for b in batches:
                tier = self.tiers[b.tier]
                b.slots = tier.offload_manager.prepare_load(b.keys)
                items = list(zip(b.keys, b.slots, strict=True))
                if not tier.store.caps.background:
                    try:
                        b.stored = tier.store.get(items)
                    except KvTierError as exc:
                        b.error = exc
                else:
                    b.job = self.transfer.submit("load", _Reader(tier.store, items), b.tier)
                    self._load_jobs.add(b.job)
            return PendingLoad(batches, len(plan))

    def load_done(self, pending: PendingLoad) -> bool:
        """Whether every read of ``pending`` has finished (never blocks)."""
        with self._lock:
            self._poll_locked()
            return all(b.job < 0 or b.job in self._load_results for b in pending.batches)

    def finish_load(self, pending: PendingLoad) -> int:
        """Wait for ``pending``'s reads, verify and install them; returns the blocks loaded."""
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
                    got = self._install(b)
                    loaded += got
                    if got < len(b.keys):
                        break
            finally:
                for b in pending.batches:
                    self.tiers[b.tier].offload_manager.complete_load(b.keys)
            return loaded

    @staticmethod
    def _plan_batches(plan: list[int], keys: Sequence[int], blocks: Sequence[int]) -> list[_Batch]:
        batches: list[_Batch] = []
        for i, t in enumerate(plan):
            if batches and batches[-1].tier == t:
                batches[-1].keys.append(keys[i])
                batches[-1].blocks.append(blocks[i])
            else:
                batches.append(_Batch(t, i, [keys[i]], [blocks[i]]))
        return batches

    def _install(self, b: _Batch) -> int:
        """Verify and write ``b``'s payloads into device blocks; returns the leading count."""
        tier = self.tiers[b.tier]
        c = tier.counters
        if b.error is not None or b.stored is None:
            self._unreachable(tier, b.error)
            return 0
        self._reachable(b.tier)
        fmt = tier.fmt
        assert fmt is not None
        storage = self.storage
        native = storage.codec
        # Block-contiguous storage takes each verified block with one copy;
        # the block ids come from the manager, so import_blocks' checks are moot.
        direct = storage.tensor if storage.layout_kind == "block" and native is None else None
        n = 0
        bad: list[int] = []
        for key, block, got in zip(b.keys, b.blocks, b.stored, strict=True):
            if got is None:
                c.vanished_blocks += 1
                bad.append(key)
                break
            header, payload = got
            try:
                codec = verify(header, payload, key, fmt.shape, fmt.dtype)
                started = time.perf_counter()
                # The pool's own format is imported as it is; anything else is
                # decoded (and, into a quantized pool, quantized again).
                as_is = native is not None and codec.codec_id == native.codec_id
                tensor = payload if as_is else codec.decode(payload, fmt.shape, fmt.dtype)
                recoded = not as_is and (codec.codec_id != RawCodec.codec_id or native is not None)
            except CorruptBlockError as exc:
                c.corrupt_blocks += 1
                self._bursts.event(
                    f"{tier.name}:corrupt",
                    f"{tier.name} tier: {exc}; the block was dropped and is recomputed "
                    "(repeated corruption points at failing storage)",
                    _counted(f"{tier.name} tier: {{}} more corrupt blocks dropped"),
                )
                bad.append(key)
                break
            if direct is not None:
                direct[block].copy_(tensor)
            else:
                storage.load_block(block, tensor)
            if recoded:
                c.decode_seconds += time.perf_counter() - started
            n += 1
            c.loaded_blocks += 1
            c.loaded_bytes += int(payload.numel())
        if bad:
            self._forget(tier, bad, b)
        if n:
            tier.offload_manager.touch(b.keys[:n])
        return n

    def _forget(self, tier: Tier, keys: list[int], b: _Batch) -> None:
        """Drop bad or vanished ``keys`` from ``tier`` (and its medium) now.

        This load's pins on them are released here and the keys leave
        ``b.keys``, so the caller's ``complete_load(b.keys)`` still balances.
        """
        mgr = tier.offload_manager
        items = [(k, mgr.slot_of(k)) for k in keys]
        mgr.complete_load(keys)
        mgr.remove(keys)
        # The medium may be shared (Redis): a bad value is purged for everyone.
        try:
            if tier.store.caps.purge:
                tier.store.purge(items)
            else:
                tier.store.delete(items)
        except KvTierError as exc:
            self._unreachable(tier, exc)
        b.keys = [k for k in b.keys if k not in keys]

    # -- demote ------------------------------------------------------------------------
    def _on_device_evict(self, keys: list[int], blocks: list[int]) -> None:
        """Pool listener: copy evicted blocks to the first tier before they are reused."""
        try:
            with self._lock:
                self._store_blocks(0, keys, blocks)
        except Exception:  # a listener must never break the pool's eviction
            log.exception("demoting %d evicted blocks failed; they are lost", len(keys))
            self.tiers[0].counters.store_failures += len(keys)

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
                    self._store_blocks(t, list(keys), list(blocks), cascade=False)

    def _store_blocks(
        self, t: int, keys: list[int], blocks: list[int], *, cascade: bool = True
    ) -> None:
        """Store device ``blocks`` under ``keys`` on tier ``t``."""
        payloads = self._encode_device(t, blocks)
        self._store_payloads(t, keys, payloads, cascade=cascade)

    def _encode_device(self, t: int, blocks: list[int]) -> list[torch.Tensor]:
        tier = self.tiers[t]
        codec = tier.codec
        storage = self.storage
        started = time.perf_counter()
        if isinstance(storage, QuantizedKVBlockStorage):
            if codec.codec_id == storage.codec.codec_id:
                # The pool already holds this codec's payloads: no decode, no re-encode.
                return list(storage.export_payloads(blocks))
            exported = storage.export_blocks(blocks)
            out = [codec.encode(exported[i]) for i in range(len(blocks))]
        elif storage.layout_kind == "block":
            # Views of the device blocks: the host tier copies straight from them.
            data = storage.tensor
            out = [codec.encode(data[b]) for b in blocks]
        else:
            exported = storage.export_blocks(blocks)
            out = [codec.encode(exported[i]) for i in range(len(blocks))]
        if codec.codec_id != RawCodec.codec_id or storage.codec is not None:
            tier.counters.encode_seconds += time.perf_counter() - started
        return out

    def _store_payloads(
        self, t: int, keys: list[int], payloads: list[torch.Tensor], *, cascade: bool = True
    ) -> None:
        tier = self.tiers[t]
        mgr = tier.offload_manager
        out = mgr.prepare_store(keys)
        # More than the tier can make room for: keep the last keys (a demoted
        # batch lists children before parents, and parents serve more prefixes).
        kept = len(keys)
        while out is None and kept > 1:
            kept //= 2
            out = mgr.prepare_store(keys[-kept:])
        if out is None:
            tier.counters.dropped_blocks += len(keys)
            return
        tier.counters.dropped_blocks += len(keys) - kept
        if not out.keys_to_store and not out.evicted_keys:
            return
        # Evicted blocks go down a tier; read them before their slots are reused.
        if out.evicted_keys and cascade and self._next_writes_back(t):
            self._cascade(t, out.evicted_keys, out.evicted_slots)
        elif out.evicted_keys and tier.store.caps.background:
            try:
                tier.store.delete(list(zip(out.evicted_keys, out.evicted_slots, strict=True)))
            except KvTierError:
                tier.counters.unavailable_errors += 1
        index = {k: i for i, k in enumerate(keys)}
        fmt = tier.fmt
        assert fmt is not None
        items: list[PutItem] = [
            (k, s, payloads[index[k]], fmt)
            for k, s in zip(out.keys_to_store, out.slots, strict=True)
        ]
        nbytes = sum(int(p.numel()) for _, _, p, _ in items)
        if not tier.store.caps.background:
            try:
                tier.store.put(items)
            except Exception as exc:
                mgr.complete_store(out.keys_to_store, success=False)
                tier.counters.store_failures += len(items)
                self._store_failed(tier, exc)
                return
            self._store_ok(tier)
            mgr.complete_store(out.keys_to_store, success=True)
            tier.counters.stored_blocks += len(items)
            tier.counters.stored_bytes += nbytes
            return
        # A snapshot: the device blocks (or host slots) may be reused before the write runs.
        # Raw payloads are views of device blocks (or host slots) that may be
        # reused before the write runs; int8/fp8 encodes are already fresh memory.
        if tier.codec.codec_id == RawCodec.codec_id:
            items = [(k, s, p.clone(), f) for k, s, p, f in items]
        snap = items
        job = self.transfer.submit("store", _Writer(tier.store, snap), t)
        self._pending[job] = (t, out.keys_to_store, nbytes)

    def _next_writes_back(self, t: int) -> bool:
        """Whether tier ``t + 1`` exists and takes what tier ``t`` evicts (write-back)."""
        return t + 1 < len(self.tiers) and self.tiers[t + 1].writes_back

    def _cascade(self, t: int, keys: list[int], slots: list[int]) -> None:
        """Move blocks tier ``t`` evicted (still in their slots) to tier ``t + 1``."""
        tier = self.tiers[t]
        if not self._next_writes_back(t):
            if tier.store.caps.background:
                try:
                    tier.store.delete(list(zip(keys, slots, strict=True)))
                except KvTierError:
                    tier.counters.unavailable_errors += 1
            return
        if tier.store.caps.background:
            # Payloads on disk or in Redis would need a read to move down;
            # the lower tier keeps what write-through or earlier demotions put there.
            return
        try:
            got = tier.store.get(list(zip(keys, slots, strict=True)))
        except KvTierError:
            return
        fmt = tier.fmt
        assert fmt is not None
        below = self.tiers[t + 1]
        down_keys: list[int] = []
        down: list[torch.Tensor] = []
        for key, stored in zip(keys, got, strict=True):
            if stored is None:
                continue
            payload = stored[1]
            if below.codec.codec_id == tier.codec.codec_id:
                down.append(payload.clone())
            else:
                started = time.perf_counter()
                block = tier.codec.decode(payload, fmt.shape, fmt.dtype)
                down.append(below.codec.encode(block).clone())
                below.counters.encode_seconds += time.perf_counter() - started
            down_keys.append(key)
        if down_keys:
            self._store_payloads(t + 1, down_keys, down)

    # -- completion ------------------------------------------------------------------------
    @property
    def stores_pending(self) -> bool:
        """Whether background stores are still in flight (a :meth:`poll` will finish them)."""
        return bool(self._pending)

    def poll(self) -> int:
        """Finish background stores that completed; returns how many jobs ended."""
        with self._lock:
            return self._poll_locked()

    def _poll_locked(self, done: list[TransferResult] | None = None) -> int:
        if done is None:
            done = self.transfer.get_finished()
        handled = 0
        for r in done:
            if r.kind == "load" and r.job_id in self._load_jobs:
                self._load_results[r.job_id] = r  # its finish_load takes it
                continue
            if r.kind != "store":
                continue
            meta = self._pending.pop(r.job_id, None)
            if meta is None:
                continue
            handled += 1
            t, keys, nbytes = meta
            tier = self.tiers[t]
            if r.ok:
                tier.offload_manager.complete_store(keys, success=True)
                tier.counters.stored_blocks += len(keys)
                tier.counters.stored_bytes += nbytes
                self._store_ok(tier)
                self._reachable(t)
            else:
                tier.offload_manager.complete_store(keys, success=False)
                tier.counters.store_failures += len(keys)
                self._store_failed(tier, r.error)
        self._maybe_reconcile()
        return handled

    # -- degraded conditions -----------------------------------------------------------------
    def _unreachable(self, tier: Tier, exc: BaseException | None) -> None:
        tier.counters.unavailable_errors += 1
        what = "cannot be reached" if isinstance(exc, TierUnavailableError) else "failed"
        self.episodes.fail(
            f"{tier.name}:unreachable",
            f"the {tier.name} tier {what} ({exc}); blocks it held are recomputed and "
            "nothing is stored there until it is back",
        )

    def _reachable(self, t: int) -> None:
        tier = self.tiers[t]
        if self.episodes.ok(f"{tier.name}:unreachable", f"the {tier.name} tier answers again"):
            # What it lost meanwhile (a restarted Redis) must leave the bookkeeping.
            self._reconcile_due.add(t)

    def _store_failed(self, tier: Tier, exc: BaseException | None) -> None:
        if isinstance(exc, TierUnavailableError):
            self._unreachable(tier, exc)
            return
        self.episodes.fail(
            f"{tier.name}:store",
            f"storing on the {tier.name} tier fails ({type(exc).__name__}: {exc}); blocks "
            "evicted from above are lost until it works again: check its space and "
            "permissions",
        )

    def _store_ok(self, tier: Tier) -> None:
        self.episodes.ok(f"{tier.name}:store", f"storing on the {tier.name} tier works again")

    # -- reconciliation --------------------------------------------------------------------
    def _maybe_reconcile(self) -> None:
        now = time.monotonic()
        due = self._reconcile_due
        if now >= self._last_reconcile + self.reconcile_interval_s:
            self._last_reconcile = now
            due.update(range(len(self.tiers)))
        while due:
            self._reconcile(due.pop(), self.reconcile_batch)

    def reconcile(self, limit: int | None = None) -> int:
        """Drop keys the tiers track but their media no longer hold; returns how many.

        Each call checks up to ``limit`` keys per tier (all when ``None``),
        resuming where the previous call stopped.
        """
        with self._lock:
            return sum(self._reconcile(t, limit) for t in range(len(self.tiers)))

    def _reconcile(self, t: int, limit: int | None) -> int:
        tier = self.tiers[t]
        if not (tier.store.caps.persistent or tier.store.caps.shared):
            return 0  # host memory loses nothing behind the chain's back
        mgr = tier.offload_manager
        keys = mgr.ready_keys()
        if not keys:
            return 0
        start = self._reconcile_cursor.get(t, 0) % len(keys)
        batch = keys[start:] + keys[:start]
        if limit is not None:
            batch = batch[:limit]
        self._reconcile_cursor[t] = start + len(batch)
        try:
            present = tier.store.contains(batch)
        except TierUnavailableError as exc:
            self._unreachable(tier, exc)
            return 0
        gone = [k for k, here in zip(batch, present, strict=True) if not here]
        gone = [k for k in gone if mgr.is_ready(k) and not mgr.is_pinned(k)]
        if not gone:
            return 0
        mgr.remove(gone)
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
        with self._lock:
            jobs = list(self._pending)
        if jobs:
            results = self.transfer.wait(jobs, timeout)
            with self._lock:
                self._poll_locked(results + self.transfer.get_finished())

    # -- swap ------------------------------------------------------------------------------
    def swap_out(
        self,
        request_id: object,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        *,
        extra_keys: Sequence[object] = (),
    ) -> SwappedRequest:
        """Store a paused request's computed blocks on the first tier and free them.

        Full blocks go under their prefix keys (so other requests can hit
        them too); the partial last block under a key private to this
        request. The request's device blocks are released and, where no
        other request holds them, given back to the free list.
        """
        mgr = self.device_manager
        with self._lock:
            swapped = self.store_request(
                request_id, token_ids, num_computed_tokens, extra_keys=extra_keys
            )
            # Blocks nobody else holds leave the device now: that is the point of a swap.
            mgr.free_and_drop(request_id)
            return swapped

    def store_request(
        self,
        request_id: object,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        *,
        tier: int = 0,
        extra_keys: Sequence[object] = (),
    ) -> SwappedRequest:
        """Store a live request's computed blocks on tier ``tier``; it keeps its device blocks.

        Full blocks go under their prefix keys, the partial last block under a
        key private to this request, as :meth:`swap_out` stores them; a
        request moving to another engine that shares the tier resumes from it.
        """
        if not 0 <= tier < len(self.tiers):
            raise ConfigError(f"tier {tier} is not one of this chain's {len(self.tiers)} tiers")
        mgr = self.device_manager
        with self._lock:
            self._poll_locked()
            blocks = mgr.block_table(request_id).blocks
            bs = mgr.block_size
            keys = mgr.block_keys(request_id)
            n_full = min(len(keys), num_computed_tokens // bs)
            self._store_blocks(tier, keys[:n_full], blocks[:n_full], cascade=True)
            tail_key: int | None = None
            rest = num_computed_tokens - n_full * bs
            if rest > 0 and n_full < len(blocks):
                computed = token_ids[:num_computed_tokens]
                tail_key = _tail_key(mgr.namespace_root, request_id, computed)
                self._store_blocks(tier, [tail_key], [blocks[n_full]], cascade=True)
            return SwappedRequest(
                request_id,
                tuple(token_ids),
                tuple(extra_keys),
                num_computed_tokens,
                tail_key,
                tier,
            )

    def shared_tier(self) -> int | None:
        """Index of the first tier on a medium other engines share (Redis), if any."""
        for t, tier in enumerate(self.tiers):
            if tier.store.caps.shared:
                return t
        return None

    def load_tail(self, swapped: SwappedRequest, block: int) -> bool:
        """Load a swapped request's partial last block into device ``block``."""
        if swapped.tail_key is None:
            return False
        with self._lock:
            tier = self.tiers[swapped.tail_tier]
            if not tier.offload_manager.is_ready(swapped.tail_key) and not self._adopt_tail(
                swapped.tail_tier, swapped.tail_key
            ):
                return False
            b = _Batch(swapped.tail_tier, 0, [swapped.tail_key], [block])
            b.slots = tier.offload_manager.prepare_load(b.keys)
            try:
                b.stored = tier.store.get(list(zip(b.keys, b.slots, strict=True)))
            except KvTierError as exc:
                b.error = exc
            try:
                ok = self._install(b) == 1
            finally:
                tier.offload_manager.complete_load(b.keys)
            if ok:
                if tier.store.caps.shared and tier.store.caps.purge:
                    # The tail is this request's alone: free the shared medium of it too.
                    with contextlib.suppress(KvTierError):
                        slot = tier.offload_manager.slot_of(swapped.tail_key)
                        tier.store.purge([(swapped.tail_key, slot)])
                tier.offload_manager.remove([swapped.tail_key])
            return ok

    def _adopt_tail(self, t: int, key: int) -> bool:
        """Adopt a tail block another engine put on shared tier ``t`` (a moved request's)."""
        tier = self.tiers[t]
        if not tier.store.caps.shared:
            return False
        try:
            present = tier.store.contains([key])
        except TierUnavailableError as exc:
            self._unreachable(tier, exc)
            return False
        return bool(present and present[0]) and bool(tier.offload_manager.adopt([key]))

    # -- compress ----------------------------------------------------------------------------
    def device_tier(self) -> int | None:
        """The index of the compressed device tier, if the chain has one."""
        for t, tier in enumerate(self.tiers):
            if isinstance(tier.store, DeviceStore):
                return t
        return None

    def compress(
        self, keys: Sequence[int], fraction: float = 1.0, *, tier: int | None = None
    ) -> CompressionResult:
        """Move the device-cached blocks of a prefix chain to a tier now, freeing them.

        ``keys`` are a request's block keys in order (``block_keys``, or the
        keys of a finished request's tokens). Of its blocks cached on the
        device, the last ``fraction`` (rounded up) move, leaves first, with
        every cached block descending from them; blocks a running request
        holds stay. They go to the device tier (``tier``: another index), and
        a later hit decodes them back. Blocks the tier cannot take stay on
        the device. Returns what moved.
        """
        if not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise BadRequestError(f"fraction must be in (0, 1], got {fraction!r}")
        t = self.device_tier() if tier is None else tier
        if t is None:
            raise ConfigError(
                "compress needs a compressed device tier: add one with --tier device:SIZE "
                "(TierSpec('device', size, codec='int8')), or name a tier"
            )
        if not 0 <= t < len(self.tiers):
            raise BadRequestError(f"tier {t} does not exist: the chain has {len(self.tiers)}")
        started = time.perf_counter()
        with self._lock:
            self._poll_locked()
            pool = self.device_manager.pool
            chain = pool.lookup(keys)
            # Held blocks are a prefix of the chain (a request holds all of its
            # blocks' parents), so the free ones are its tail.
            first = len(chain)
            while first > 0 and not pool.ref[chain[first - 1]]:
                first -= 1
            want = len(chain) - math.ceil(len(chain) * fraction - 1e-9)
            first = max(first, want)
            if first >= len(chain):
                return CompressionResult(0, 0, 0, time.perf_counter() - started)
            # The moved blocks and every cached descendant, parents first.
            order: list[int] = []
            stack = [chain[first]]
            while stack:
                b = stack.pop()
                order.append(b)
                stack.extend(pool.children_of(b))
            order.reverse()  # children first, as demotions are ordered
            move_keys: list[int] = []
            for b in order:
                key = pool.block_key[b]
                assert key is not None
                move_keys.append(key)
            self._store_blocks(t, move_keys, order, cascade=True)
            held = self.tiers[t].offload_manager
            # Withdraw only whole subtrees the tier took: a block leaves with its descendants.
            gone: set[int] = set()
            for b, key in zip(order, move_keys, strict=True):
                if key in held and all(c in gone for c in pool.children_of(b)):
                    gone.add(b)
            leaving = [b for b in reversed(order) if b in gone]  # parents first
            pool.withdraw(leaving)  # a withdrawal is never announced to evict listeners
            target = self.tiers[t]
            assert target.fmt is not None
            if leaving:
                target.counters.compressed_requests += 1
            n = len(leaving)
            return CompressionResult(
                n,
                n * self.storage.bytes_per_block,
                n * target.fmt.payload_size,
                time.perf_counter() - started,
            )

    # -- stats, events, shutdown -------------------------------------------------------------
    def take_events(self) -> list[OffloadingEvent]:
        with self._lock:
            out: list[OffloadingEvent] = []
            for tier in self.tiers:
                out.extend(tier.offload_manager.take_events())
            return out

    def stats(self) -> dict[str, dict[str, float]]:
        """Per tier: occupancy and counters."""
        with self._lock:
            out: dict[str, dict[str, float]] = {}
            device_bytes = self.storage.bytes_per_block
            for tier in self.tiers:
                d: dict[str, float] = dict(vars(tier.counters))
                d["capacity_blocks"] = tier.capacity
                d["used_blocks"] = len(tier.offload_manager)
                d["evictions"] = tier.offload_manager.evictions
                # Against the pool's own block size: what the codec saves.
                stored = tier.fmt.payload_size if tier.fmt is not None else device_bytes
                d["compression_ratio"] = device_bytes / stored
                d["bytes_saved"] = len(tier.offload_manager) * (device_bytes - stored)
                out[tier.name] = d
            return out

    def check(self) -> None:
        with self._lock:
            for tier in self.tiers:
                tier.offload_manager.check()

    def close(self) -> None:
        """Finish background stores, detach from the device pool and close the media."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        self.device_manager.remove_evict_listener(self._on_device_evict)
        if self._own_transfer:
            self.transfer.shutdown()
        for tier in self.tiers:
            tier.store.close()


def _counted(template: str) -> Callable[[int], str]:
    """A summary line for a count of held-back events: ``template`` with ``{}`` for it."""
    return template.format


def _tail_key(root: int, request_id: object, tokens: Sequence[int]) -> int:
    h = xxhash.xxh3_128()
    h.update(root.to_bytes(16, "little"))
    h.update(repr(request_id).encode())
    h.update(b"\x00swap-tail\x00")
    h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return int(h.intdigest())


class _Reader:
    """A load job: read items from a medium."""

    def __init__(self, store: BlockStore, items: list[tuple[int, int]]) -> None:
        self.store = store
        self.items = items

    def __call__(self) -> list[Stored | None]:
        return self.store.get(self.items)


class _Writer:
    """A store job: write payload snapshots to a medium."""

    def __init__(self, store: BlockStore, items: list[PutItem]) -> None:
        self.store = store
        self.items = items

    def __call__(self) -> None:
        self.store.put(self.items)
