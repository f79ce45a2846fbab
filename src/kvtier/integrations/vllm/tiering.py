"""kvtier's media as vLLM 0.33 secondary tiers, behind its CPU offloading tier.

vLLM 0.33's ``TieringOffloadingSpec`` keeps offloaded KV chunks in a CPU
tier and cascades every chunk stored there to its *secondary tiers*, which it
loads by class name and module path. :class:`KvTierSecondaryTier` is such a
tier over any kvtier medium: a directory (restart-warm), a Redis server or
Redis Cluster (shared by every engine using it), host memory, or a medium
registered by a plug-in. In ``kv_connector_extra_config``::

    "spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": 8589934592,
    "secondary_tiers": [{
        "type": "KvTierSecondaryTier",
        "module_path": "kvtier.integrations.vllm.tiering",
        "url": "disk:/var/cache/kvtier?size=200GiB&policy=s3fifo"
    }]

``url`` is a kvtier tier URL (:meth:`kvtier.offload.TierSpec.from_url`):
the medium and where it is, ``size`` (the bytes the tier may hold, headers
included), ``codec`` (``raw`` keeps every byte; ``int8`` / ``fp8`` store a
16-bit KV cache in about half the space, lossy) and ``policy`` (any kvtier
policy: it chooses what the tier evicts when ``size`` is full). Other keys:
``workers`` (I/O threads, default 4), ``enable_kv_events`` (publish the tier's
stored and removed chunks when vLLM's KV events are on), ``locality``
(``LOCAL`` / ``REMOTE``, default ``REMOTE`` for a shared medium),
``retry_interval_s`` (how long a medium that failed is skipped, default 1),
``copy_inline_bytes`` (store jobs up to this size are copied on the
scheduler thread, default 1 MiB) and ``write_backlog_bytes`` (copies not yet
written, at most; default 256 MiB).

What happens where:

* every call from vLLM's scheduler does bookkeeping only (a kvtier
  :class:`~kvtier.offload.OffloadingManager` per tier, driven by the policy):
  reads, writes, checksums and deletions run on a :class:`TransferEngine`
  thread pool. Loads write vLLM's CPU chunks in place. A store's chunks are
  copied first (a small job on the scheduler thread, holding the GIL; a
  large one on a copy thread) and the job is reported finished at the next
  poll, so vLLM's pins on its CPU tier last a memory copy, not a disk or
  network write (until the write ends the keys look up as RETRY, and a
  write that fails leaves them out: MISS); copies not yet written are
  bounded, past which vLLM's chunks stay pinned. ``call_stats`` records the
  longest call of each kind;
* chunks are named by vLLM's offload keys (block hash and KV group), hashed
  to kvtier's 128-bit keys, in a namespace made of the fields vLLM's own file
  tier uses (model, dtype, block size, KV groups, parallelism, rank);
* every stored chunk carries kvtier's header and checksums; a chunk that comes
  back damaged, truncated, of another key or format, or not at all (deleted,
  evicted by Redis) fails its load, is dropped from the tier (and purged
  from the medium when damaged), and looks up as a MISS from then on: the
  engine recomputes it, never reads it;
* a medium that cannot be reached (Redis down) fails the jobs in flight;
  for ``retry_interval_s`` the tier answers every lookup MISS and drops its
  stores at once, then tries again, so it comes back by itself;
* keys another engine stored on a shared medium are asked of the medium in
  the background (vLLM's ``AsyncLookupManager``, one batch per step): RETRY
  until the answer is in, then HIT (the key is adopted) or MISS;
* a persistent medium (disk) is scanned in the background at start; the
  newest chunks found, as many as ``size`` holds, are served again.

Importing this module needs vLLM 0.33 (see :mod:`.version`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import wraps
from typing import Any, ClassVar, ParamSpec, TypeVar

import numpy as np
import torch

from kvtier.errors import ConfigError, CorruptBlockError, TierUnavailableError
from kvtier.integrations.flat import FlatPages, key_id
from kvtier.integrations.sync_tier import reserve_leading
from kvtier.integrations.vllm.version import CACHE_POLICY_API, require_vllm
from kvtier.offload.config import TierSpec
from kvtier.offload.core import TierHealth
from kvtier.offload.manager import OffloadingManager
from kvtier.offload.media import BlockStore, PutItem
from kvtier.offload.registry import make_medium
from kvtier.offload.transfer import TransferEngine, TransferResult

VLLM = require_vllm(CACHE_POLICY_API)

from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: E402
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager  # noqa: E402
from vllm.v1.kv_offload.tiering.base import (  # noqa: E402
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

log = logging.getLogger("kvtier.vllm")

#: The module path to give vLLM as a secondary tier's ``module_path``.
MODULE_PATH = __name__
#: Tier config keys this tier reads (besides vLLM's ``type``, ``module_path``, ``backpressure``).
TIER_KEYS = (
    "url", "workers", "enable_kv_events", "locality", "retry_interval_s",
    "copy_inline_bytes", "write_backlog_bytes",
)

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass
class CallStat:
    """How often a scheduler-side method ran, and its total and longest time."""

    calls: int = 0
    total_s: float = 0.0
    max_s: float = 0.0


def _timed(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Record the method's wall time in its tier's ``call_stats``."""
    name = method.__name__

    @wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent = time.perf_counter() - start
            stat = args[0].call_stats[name]  # type: ignore[attr-defined]
            stat.calls += 1
            stat.total_s += spent
            if spent > stat.max_s:
                stat.max_s = spent

    return wrapper


def tier_namespace(offloading_spec: Any) -> str:
    """The medium namespace of this engine's chunks: vLLM's file-tier fields, hashed.

    Two engines share chunks exactly when vLLM's own file tier would let
    them share files (same model, KV dtype, block size, KV groups and,
    unless the layout is parallelism-agnostic, the same parallelism and rank).
    """
    mapper = FileMapper.from_offloading_spec(
        root_dir="",
        offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk,
        parallel_agnostic=True,
    )
    return f"vllm-{mapper.base_path.rsplit('/', 1)[-1]}_r{mapper.rank}"


class _Backlog:
    """Bytes copied out of vLLM's CPU tier and not yet written, bounded by ``limit``.

    One job larger than the limit is let through when nothing else waits,
    so no job waits for ever.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cv = threading.Condition()

    def _fits(self, nbytes: int) -> bool:
        return self.used == 0 or self.used + nbytes <= self.limit

    def try_take(self, nbytes: int) -> bool:
        with self._cv:
            if not self._fits(nbytes):
                return False
            self.used += nbytes
            return True

    def take(self, nbytes: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._fits(nbytes))
            self.used += nbytes

    def give(self, nbytes: int) -> None:
        with self._cv:
            self.used -= nbytes
            self._cv.notify_all()


class _MediumLookups(AsyncLookupManager):  # type: ignore[misc]
    """vLLM's background existence checks, asking a shared kvtier medium."""

    def __init__(self, tier: KvTierSecondaryTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        tier = self._tier
        try:
            return tier._medium.contains([key_id(k) for k in keys])
        except TierUnavailableError as exc:
            tier._mark_down(exc)
            return [False] * len(keys)


class KvTierSecondaryTier(SecondaryTierManager):  # type: ignore[misc]
    """A kvtier medium as a vLLM secondary tier (see the module docstring)."""

    medium: ClassVar[Any] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str | None = None,
        workers: int = 4,
        enable_kv_events: bool = False,
        locality: str | None = None,
        retry_interval_s: float = 1.0,
        copy_inline_bytes: int = 1 << 20,
        write_backlog_bytes: int = 256 << 20,
        backpressure_detector: Any = None,
        **unknown: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if unknown:
            raise ConfigError(
                f"secondary tier {tier_type!r} has no setting {', '.join(sorted(unknown))}; "
                f"it takes {', '.join(TIER_KEYS)}"
            )
        if not url or not isinstance(url, str):
            raise ConfigError(
                f"secondary tier {tier_type!r} needs a kvtier tier URL as 'url', e.g. "
                '"disk:/var/cache/kvtier?size=100GiB" or "redis://host:6379/0?size=50GiB"'
            )
        if not isinstance(workers, int) or isinstance(workers, bool) or workers <= 0:
            raise ConfigError(f"workers must be a positive integer, got {workers!r}")
        if not isinstance(retry_interval_s, int | float) or retry_interval_s < 0:
            raise ConfigError(f"retry_interval_s must be >= 0 seconds, got {retry_interval_s!r}")
        for name, value in (("copy_inline_bytes", copy_inline_bytes),
                            ("write_backlog_bytes", write_backlog_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a number of bytes >= 0, got {value!r}")
        spec = TierSpec.from_url(url)
        if spec.write_mode is not None:
            raise ConfigError(
                f"tier {url!r}: vLLM stores every chunk on every secondary tier; drop write="
            )
        self.spec = spec
        self.call_stats: dict[str, CallStat] = {
            name: CallStat()
            for name in (
                "lookup", "submit_store", "submit_load", "get_finished_jobs", "touch",
                "on_new_request", "on_request_finished", "on_schedule_end", "take_events",
            )
        }
        row_bytes = int((primary_kv_view.strides or (primary_kv_view.nbytes,))[0])
        self.pages = FlatPages.make(row_bytes, spec.codec, offloading_spec.config.model.dtype)
        self.capacity = spec.size_bytes // self.pages.blob_size
        if self.capacity < 1:
            raise ConfigError(
                f"tier {url!r}: {spec.size_bytes:,} bytes hold no chunk of "
                f"{self.pages.blob_size:,} bytes; give it a larger size="
            )
        self.namespace = tier_namespace(offloading_spec)
        self._medium: BlockStore = make_medium(spec.medium, spec.location, dict(spec.options))
        self._caps = self._medium.caps
        if locality is None and self._caps.shared:
            locality = "REMOTE"
        self.locality = Locality(locality) if locality is not None else None
        self._medium.bind(self.namespace, self.capacity, self.pages.format.payload_size)
        self._events_on = bool(
            enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        )
        self.offload_manager = OffloadingManager(
            self.capacity, spec.policy, medium=self._medium.name, enable_events=self._events_on
        )
        self.health = TierHealth(
            f"{self.tier_type} ({spec.medium})", retry_interval_s=retry_interval_s, logger=log
        )
        self._engine = TransferEngine(workers, cuda_streams=False, prestart=True)
        # Copies of store jobs too large to make on the scheduler thread, in order; a
        # thread of their own so a copy never waits behind a disk or network write.
        self._copier = TransferEngine(1, cuda_streams=False, prestart=True)
        self.copy_inline_bytes = copy_inline_bytes
        self._backlog = _Backlog(write_backlog_bytes)
        # vLLM store job id -> the keys it writes.
        self._stores: dict[int, list[int]] = {}
        self._loads: dict[int, tuple[int, list[OffloadKey], list[tuple[int, int]]]] = {}
        self._finished: list[JobResult] = []
        # vLLM job ids (and bytes) whose chunks have been copied out of the CPU tier:
        # reported finished at the next poll, so vLLM's pins do not wait for the medium.
        self._copied: deque[tuple[int, int]] = deque()
        # Store jobs seen once (copied or ended) and reported; a job that fails before
        # its copy is seen only once and stays here (a few ids, never reused).
        self._reported: set[int] = set()
        self._drained: list[TransferResult] = []
        # Keys a HIT pinned until vLLM's promotion of them is submitted (end of step).
        self._lookup_pins: Counter[int] = Counter()
        # kvtier key -> vLLM key, for the keys this process has seen (events).
        self._names: dict[int, OffloadKey] = {}
        self._down_lock = threading.Lock()
        self.corrupt = 0
        self.vanished = 0
        self.unavailable = 0
        self.dropped_stores = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.adopted = 0
        rows = np.asarray(primary_kv_view)
        #: vLLM's CPU chunks, one uint8 row each, shared with vLLM (no copy).
        self._rows = torch.from_numpy(rows).view(torch.uint8).reshape(rows.shape[0], -1)
        self._flat = primary_kv_view.cast("B")
        self._lookups = _MediumLookups(self) if self._caps.shared else None
        self._scan_job: int | None = None
        if self._caps.persistent:
            self._scan_job = self._engine.submit("scan", self._medium.scan)

    # -- health ---------------------------------------------------------------------------------
    def _mark_down(self, exc: BaseException) -> None:
        """The medium failed: skip it for ``retry_interval_s`` (any thread may call this)."""
        with self._down_lock:
            self.unavailable += 1
            self.health.failed(exc)

    def _answered(self) -> None:
        with self._down_lock:
            self.health.answered()

    @property
    def available(self) -> bool:
        """Whether the medium is being used (False for a while after a failure)."""
        return self.health.available

    @property
    def retry_interval_s(self) -> float:
        return self.health.retry_interval_s

    @retry_interval_s.setter
    def retry_interval_s(self, seconds: float) -> None:
        self.health.retry_interval_s = float(seconds)

    # -- lookups --------------------------------------------------------------------------------
    def _id(self, key: OffloadKey) -> int:
        kid = key_id(key)
        if self._events_on:
            self._names[kid] = key
        return kid

    @_timed
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.available:
            return LookupResult.MISS
        kid = self._id(key)
        n = self.offload_manager.lookup((kid,))
        if n is None:
            return LookupResult.RETRY
        if n == 0 and self._lookups is not None:
            found = self._lookups.lookup(key, req_context)
            if found is None:
                return LookupResult.RETRY
            if found and self._adopt([kid]):
                n = 1
        if n == 0:
            return LookupResult.MISS
        # Pinned until the promotion vLLM is about to submit (or the step ends).
        self.offload_manager.prepare_load((kid,))
        self._lookup_pins[kid] += 1
        return LookupResult.HIT

    def _adopt(self, keys: Sequence[int]) -> bool:
        """Take keys the medium holds into the bookkeeping; evicted keys are deleted."""
        out = self.offload_manager.prepare_store(keys)
        if out is None:
            return False
        self.offload_manager.complete_store(out.keys_to_store, success=True)
        self.adopted += len(out.keys_to_store)
        self._delete_evicted(out.evicted_keys, out.evicted_slots)
        return True

    def _delete_evicted(self, keys: list[int], slots: list[int]) -> None:
        if keys:
            items = list(zip(keys, slots, strict=True))
            self._engine.submit("delete", lambda: self._medium.delete(items))
            for kid in keys:
                self._names.pop(kid, None)

    @_timed
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.offload_manager.touch([key_id(k) for k in keys])

    # -- stores ---------------------------------------------------------------------------------
    @_timed
    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        if not self.available:
            self.dropped_stores += 1
            self._finished.append(JobResult(job_id=job_id, success=False, transfer_bytes=0))
            return
        keys = list(job_metadata.keys)
        chunk_of = {
            self._id(k): int(c) for k, c in zip(keys, job_metadata.chunk_ids, strict=True)
        }
        out, _ = reserve_leading(self.offload_manager, list(chunk_of))
        if out is None or not out.keys_to_store:
            # Held already, or no room at all (every chunk here is being read).
            if out is None:
                self.dropped_stores += 1
            self._finished.append(JobResult(job_id=job_id, success=True, transfer_bytes=0))
            return
        for kid in out.evicted_keys:
            self._names.pop(kid, None)
        writes = list(zip(out.keys_to_store, out.slots, strict=True))
        chunks = [chunk_of[kid] for kid in out.keys_to_store]
        evicted = list(zip(out.evicted_keys, out.evicted_slots, strict=True))
        nbytes = len(writes) * self.pages.nbytes
        self._stores[job_id] = list(out.keys_to_store)
        if nbytes <= self.copy_inline_bytes and self._backlog.try_take(nbytes):
            # A small job is copied here, in microseconds, so vLLM may reuse its chunks
            # from the next poll on whatever the medium's pace. A memoryview copy keeps
            # the GIL: a call that released it (any torch op) could wait milliseconds to
            # get it back from the I/O threads.
            self._start_write(job_id, writes, evicted, self._copy_rows(chunks), nbytes)
        else:
            self._copier.submit(
                "copy", lambda: self._copy_then_write(job_id, writes, evicted, chunks, nbytes),
                tag=job_id,
            )

    def _copy_then_write(
        self,
        job_id: int,
        writes: list[tuple[int, int]],
        evicted: list[tuple[int, int]],
        chunks: list[int],
        nbytes: int,
    ) -> None:
        """On the copy thread: wait for room in the write backlog, copy, queue the write.

        While the backlog is full vLLM's chunks stay pinned, which is the back-pressure
        a medium slower than the engine's stores must put on it.
        """
        self._backlog.take(nbytes)
        try:
            snapshot = self._rows.index_select(0, torch.tensor(chunks, dtype=torch.long))
        except BaseException:
            self._backlog.give(nbytes)
            raise
        self._start_write(job_id, writes, evicted, snapshot, nbytes)

    def _copy_rows(self, chunks: list[int]) -> bytearray:
        """The CPU tier's ``chunks``, back to back (a copy made holding the GIL)."""
        n = self.pages.nbytes
        flat = self._flat
        out = bytearray(n * len(chunks))
        view = memoryview(out)
        for i, chunk in enumerate(chunks):
            view[i * n:(i + 1) * n] = flat[chunk * n:(chunk + 1) * n]
        return out

    def _start_write(
        self,
        job_id: int,
        writes: list[tuple[int, int]],
        evicted: list[tuple[int, int]],
        snapshot: torch.Tensor | bytearray,
        nbytes: int,
    ) -> None:
        """The chunks are copied (``snapshot``, one row each): report the job, write them."""
        self._copied.append((job_id, nbytes))
        pages = self.pages
        fmt = pages.format
        medium = self._medium
        backlog = self._backlog

        def write() -> int:
            try:
                rows = (
                    torch.frombuffer(snapshot, dtype=torch.uint8).view(len(writes), pages.nbytes)
                    if isinstance(snapshot, bytearray) else snapshot
                )
                items: list[PutItem] = [
                    (kid, slot, pages.encode(rows[i]), fmt) for i, (kid, slot) in enumerate(writes)
                ]
                if evicted:
                    medium.delete(evicted)
                medium.put(items)
            finally:
                backlog.give(nbytes)
            return len(items) * pages.blob_size

        self._engine.submit("store", write, tag=job_id)

    def _store_done(self, result: TransferResult) -> None:
        job_id: int = result.tag
        keys = self._stores.pop(job_id)
        # A write that fails after vLLM was told the job finished leaves the keys
        # out of the bookkeeping: they look up as MISS, as if never stored.
        self.offload_manager.complete_store(keys, success=result.ok)
        if result.ok:
            self.bytes_written += int(result.value)
            self._answered()
        elif isinstance(result.error, TierUnavailableError):
            self._mark_down(result.error)
        else:
            log.error("secondary tier %s: a store failed: %r", self.tier_type, result.error)
        self._report(JobResult(
            job_id=job_id, success=result.ok,
            transfer_bytes=int(result.value) if result.ok else None,
        ))

    def _report(self, job: JobResult) -> None:
        """Tell vLLM a store job finished, once: at its copy or its end, whichever is seen first."""
        if job.job_id in self._reported:
            self._reported.discard(job.job_id)  # the second sighting
            return
        self._reported.add(job.job_id)
        self._finished.append(job)

    # -- loads ----------------------------------------------------------------------------------
    @_timed
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        items: list[tuple[int, int]] = []  # (kvtier key, its slot); key -1: nothing to read
        for key in keys:
            kid = key_id(key)
            if self._lookup_pins[kid] > 0:
                self._lookup_pins[kid] -= 1  # the pin moves to the job
            elif self.offload_manager.is_ready(kid):
                self.offload_manager.prepare_load((kid,))
            else:
                items.append((-1, -1))  # gone since its lookup: fails, nothing to unpin
                continue
            items.append((kid, self.offload_manager.slot_of(kid)))
        self._loads[self._engine.submit(
            "load", lambda: self._read(items, chunks), tag=job_id)] = (job_id, keys, items)

    def _read(
        self, items: list[tuple[int, int]], chunks: list[int]
    ) -> tuple[list[bool], list[tuple[int, int]], list[tuple[int, int]]]:
        """Read, verify and copy into vLLM's chunks; returns (ok, vanished, corrupt)."""
        want = [item for item in items if item[0] >= 0]
        stored = iter(self._medium.get(want)) if want else iter(())
        ok: list[bool] = []
        vanished: list[tuple[int, int]] = []
        corrupt: list[tuple[int, int]] = []
        for item, chunk in zip(items, chunks, strict=True):
            if item[0] < 0:
                ok.append(False)
                continue
            blob = next(stored)
            if blob is None:
                vanished.append(item)
                ok.append(False)
                continue
            try:
                self.pages.decode_into(blob, item[0], self._rows[chunk])
            except CorruptBlockError as exc:
                # The text only: a kept record must not keep this frame (a view of
                # vLLM's memory) alive.
                log.warning("secondary tier %s: %s; recomputing it", self.tier_type, str(exc))
                corrupt.append(item)
                ok.append(False)
                continue
            ok.append(True)
        return ok, vanished, corrupt

    def _load_done(self, result: TransferResult) -> None:
        job_id, keys, items = self._loads.pop(result.job_id)
        pinned = [kid for kid, _ in items if kid >= 0]
        if pinned:
            self.offload_manager.complete_load(pinned)
        if not result.ok:
            if isinstance(result.error, TierUnavailableError):
                self._mark_down(result.error)
            else:
                log.error("secondary tier %s: a load failed: %r", self.tier_type, result.error)
            self._finished.append(JobResult(job_id=job_id, success=False))
            return
        self._answered()
        ok, vanished, corrupt = result.value
        self.vanished += len(vanished)
        self.corrupt += len(corrupt)
        bad = [kid for kid, _ in vanished + corrupt]
        if bad:
            # Never offered again: a MISS from now on, recomputed by the engine.
            self.offload_manager.remove(bad)
        if corrupt:
            self._engine.submit("purge", lambda: self._medium.purge(corrupt))
        n_ok = sum(ok)
        self.bytes_read += n_ok * self.pages.blob_size
        if n_ok == len(keys):
            self._finished.append(JobResult(
                job_id=job_id, success=True, transfer_bytes=n_ok * self.pages.nbytes))
            return
        good = tuple(k for k, fine in zip(keys, ok, strict=True) if fine)
        self._finished.append(JobResult(
            job_id=job_id, success=False, successful_keys=good or None,
            transfer_bytes=n_ok * self.pages.nbytes,
        ))

    # -- completion -----------------------------------------------------------------------------
    @_timed
    def get_finished_jobs(self) -> Iterable[JobResult]:
        copied = self._copied
        while copied:
            job_id, nbytes = copied.popleft()
            self._report(JobResult(job_id=job_id, success=True, transfer_bytes=nbytes))
        done = self._drained + self._copier.get_finished() + self._engine.get_finished()
        self._drained = []
        for result in done:
            if result.kind == "copy":
                if not result.ok:  # never copied, never written: the store failed
                    self._store_done(result)
            elif result.kind == "store":
                self._store_done(result)
            elif result.job_id in self._loads:
                self._load_done(result)
            elif result.job_id == self._scan_job:
                self._scan_done(result)
            elif not result.ok:  # a deletion or purge
                if isinstance(result.error, TierUnavailableError):
                    self._mark_down(result.error)
                else:
                    log.warning("secondary tier %s: %r", self.tier_type, result.error)
        out = self._finished
        self._finished = []
        return out

    def _scan_done(self, result: TransferResult) -> None:
        self._scan_job = None
        if not result.ok:
            log.warning("secondary tier %s: cannot list the chunks of an earlier run: %r",
                        self.tier_type, result.error)
            return
        found: list[int] = [k for k in result.value if k not in self.offload_manager]
        # The newest that fit, oldest first so the policy ranks them by age.
        keep = found[-self.offload_manager.num_free:] if self.offload_manager.num_free else []
        if keep:
            adopted = self.offload_manager.adopt(keep)
            self.adopted += len(adopted)
            log.info("secondary tier %s: serving %d chunks of an earlier run",
                     self.tier_type, len(adopted))
        stale = found[: len(found) - len(keep)]
        if stale:
            items = [(kid, 0) for kid in stale]
            self._engine.submit("delete", lambda: self._medium.delete(items))

    def has_pending_work(self) -> bool:
        return (
            self._copier.num_pending > 0 or self._engine.num_pending > 0 or bool(self._drained)
        )

    @_timed
    def take_events(self) -> Iterable[OffloadingEvent]:
        out: list[OffloadingEvent] = []
        for ev in self.offload_manager.take_events():
            keys = [self._names[k] for k in ev.keys if k in self._names]
            if ev.removed:
                for k in ev.keys:
                    self._names.pop(k, None)
            if keys:
                out.append(OffloadingEvent(
                    keys=keys, medium=self.medium, removed=ev.removed, locality=self.locality))
        return out

    # -- requests and steps ---------------------------------------------------------------------
    @_timed
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @_timed
    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._lookups is not None:
            self._lookups.cleanup(req_context.req_id)

    @_timed
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # Promotions were submitted just before this call; a HIT vLLM did not
        # promote (its CPU tier was full) releases its pin here.
        pins = self._lookup_pins
        if pins:
            left = [kid for kid, n in pins.items() for _ in range(n)]
            pins.clear()
            if left:
                self.offload_manager.complete_load(left)
        if self._lookups is not None:
            self._lookups.flush()

    def drain_jobs(self) -> None:
        # Copies first: each queues its write on the I/O threads.
        self._drained.extend(self._copier.drain())
        self._drained.extend(self._engine.drain())

    def shutdown(self) -> None:
        self.drain_jobs()
        self._copier.shutdown()
        self._engine.shutdown()
        if self._lookups is not None:
            self._lookups.shutdown()
        self._medium.close()
        # vLLM unmaps its CPU tier after this; no view of it may stay exported.
        self._rows = torch.empty((0, 0), dtype=torch.uint8)
        self._flat.release()

    def stats(self) -> dict[str, Any]:
        """What the tier did: chunks held, bytes moved, failures, the longest calls."""
        return {
            "medium": self.spec.medium,
            "capacity_chunks": self.capacity,
            "chunks": len(self.offload_manager),
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "corrupt": self.corrupt,
            "vanished": self.vanished,
            "unavailable": self.unavailable,
            "dropped_stores": self.dropped_stores,
            "adopted": self.adopted,
            "max_call_s": {k: v.max_s for k, v in self.call_stats.items() if v.calls},
        }
