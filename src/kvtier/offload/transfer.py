"""The transfer engine: tier reads and writes on background threads, batched per job.

A job is one batch (all the blocks one tier reads or writes for one call);
jobs of different tiers run in parallel. Medium I/O (file writes, Redis round
trips, host copies) releases the GIL, so threads overlap it with the model's
forward pass. On CUDA each worker thread issues its copies on its own stream
and synchronizes that stream before the job counts as done.

Completion is observable without blocking: :meth:`TransferEngine.get_finished`
returns the jobs that ended since the last call, successful or not; nothing
raised by a job escapes into the caller, it comes back as the job's error.

The batch helpers below serve the memory copies that run inline (host
tier stores, loads into device blocks): :func:`runs` finds the items of a
batch that lie back to back in memory, so a run of blocks moves with one
copy, and :func:`checksums` hashes a run's payloads, on the checksum pool
when the batch is large, while the other runs' copies are in flight.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.offload import codec as _codec
from kvtier.offload.codec import as_buffer, checksum_pool, payload_checksum

#: The most bytes one batched copy or checksum task covers: small enough that
#: a batch's copies and checksums overlap, large enough that per-call costs vanish.
CHUNK_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class TransferResult:
    """A finished job: its id, what it was, and its value or the error it raised."""

    job_id: int
    kind: str
    tag: Any
    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class TransferEngine:
    """A pool of ``max_workers`` threads running tier transfer jobs."""

    def __init__(
        self, max_workers: int = 4, *, cuda_streams: bool | None = None, prestart: bool = False
    ) -> None:
        if not isinstance(max_workers, int) or max_workers <= 0:
            raise ConfigError(f"max_workers must be a positive integer, got {max_workers!r}")
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvtier-transfer")
        if prestart:
            # The pool starts a thread inside submit() otherwise, and Thread.start()
            # waits for the new thread, which costs the caller milliseconds while
            # other threads hold the GIL: start them all now.
            gate = threading.Barrier(max_workers)
            for _ in range(max_workers):
                self._pool.submit(gate.wait, 10.0)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._futures: dict[int, Future[Any]] = {}
        self._done: dict[int, TransferResult] = {}
        self._meta: dict[int, tuple[str, Any]] = {}
        self._use_streams = torch.cuda.is_available() if cuda_streams is None else cuda_streams
        self._local = threading.local()
        self.submitted = 0
        self.failed = 0

    def _run(self, fn: Callable[[], Any]) -> Any:
        if not self._use_streams:
            return fn()
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            value = fn()
        stream.synchronize()
        return value

    def submit(self, kind: str, fn: Callable[[], Any], tag: Any = None) -> int:
        """Run ``fn`` in the background; returns the job id."""
        job = next(self._ids)
        with self._lock:
            self._meta[job] = (kind, tag)
            fut = self._pool.submit(self._run, fn)
            self._futures[job] = fut
            self.submitted += 1
        fut.add_done_callback(functools.partial(self._finish, job))
        return job

    def _finish(self, job: int, fut: Future[Any]) -> None:
        # Runs from the done callback and from wait(), whichever comes first:
        # a future's waiters wake before its callbacks run.
        with self._lock:
            meta = self._meta.pop(job, None)
            if meta is None:
                return
            kind, tag = meta
            self._futures.pop(job, None)
            exc = fut.exception()
            if exc is not None:
                self.failed += 1
                self._done[job] = TransferResult(job, kind, tag, error=exc)
            else:
                self._done[job] = TransferResult(job, kind, tag, value=fut.result())

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._futures)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call (each reported once), in id order."""
        with self._lock:
            out = [self._done.pop(j) for j in sorted(self._done)]
        return out

    def wait(self, job_ids: Sequence[int], timeout: float | None = None) -> list[TransferResult]:
        """Block until ``job_ids`` finish; returns (and consumes) their results.

        Jobs still running after ``timeout`` are left out of the result.
        """
        with self._lock:
            futs = [(j, self._futures[j]) for j in job_ids if j in self._futures]
        if futs:
            wait_futures([f for _, f in futs], timeout=timeout)
            for j, f in futs:
                if f.done():
                    self._finish(j, f)
        out: list[TransferResult] = []
        with self._lock:
            for j in job_ids:
                r = self._done.pop(j, None)
                if r is not None:
                    out.append(r)
        return out

    def drain(self, timeout: float | None = None) -> list[TransferResult]:
        """Wait for every job in flight; returns every unconsumed result."""
        with self._lock:
            futs = list(self._futures.items())
        if futs:
            wait_futures([f for _, f in futs], timeout=timeout)
            for j, f in futs:
                if f.done():
                    self._finish(j, f)
        return self.get_finished()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


#: Where a 1-D contiguous uint8 tensor's bytes are: device, storage address, offset, length.
Place = tuple[torch.device, int, int, int]


def place(t: torch.Tensor) -> Place | None:
    """Where ``t``'s bytes lie, if it is 1-D contiguous uint8 (else ``None``: it runs alone).

    Read once per tensor: finding runs in a batch of hundreds of blocks then
    costs a few integer comparisons per block, not a dozen tensor queries.
    """
    if t.dtype != torch.uint8 or t.dim() != 1 or t.stride(0) != 1:
        return None
    return (t.device, t.untyped_storage().data_ptr(), int(t.storage_offset()), t.numel())


def follows(a: Place | None, b: Place | None) -> bool:
    """Whether ``b``'s bytes start where ``a``'s end, in the same storage."""
    return a is not None and b is not None and b[2] == a[2] + a[3] and a[1] == b[1] and a[0] == b[0]


def runs(
    first: Sequence[torch.Tensor],
    second: Sequence[torch.Tensor] | None = None,
    *,
    limit: int = 1 << 62,
) -> list[tuple[int, int]]:
    """Split a batch into ``(start, count)`` runs that one copy can move.

    In a run, each 1-D uint8 tensor of ``first`` (and the one beside it in
    ``second``) starts where the one before ends, in the same storage; a
    run stops before it would pass ``limit`` bytes of ``first``.
    """
    a = [place(t) for t in first]
    b = None if second is None else [place(t) for t in second]
    out: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, t in enumerate(first):
        here = a[i]
        n = here[3] if here is not None else int(t.numel())
        if (
            i > start
            and size + n <= limit
            and follows(a[i - 1], here)
            and (b is None or follows(b[i - 1], b[i]))
        ):
            size += n
            continue
        if i > start:
            out.append((start, i - start))
        start, size = i, n
    if len(first) > start:
        out.append((start, len(first) - start))
    return out


def span(tensors: Sequence[torch.Tensor], start: int, count: int) -> torch.Tensor:
    """One 1-D uint8 view over the run ``tensors[start : start + count]`` (see :func:`runs`)."""
    head = tensors[start]
    if count == 1:
        return head
    total = sum(int(t.numel()) for t in tensors[start : start + count])
    view = torch.empty(0, dtype=torch.uint8, device=head.device)
    view.set_(head.untyped_storage(), head.storage_offset(), (total,), (1,))
    return view


def chunks(sizes: Sequence[int], limit: int | None = None) -> list[tuple[int, int]]:
    """Split a batch of items of ``sizes`` bytes into ``(start, count)`` groups of consecutive
    items, each of at most ``limit`` bytes (default :data:`CHUNK_BYTES`; one item when that
    alone is larger)."""
    if limit is None:
        limit = CHUNK_BYTES
    out: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, n in enumerate(sizes):
        if i > start and size + n > limit:
            out.append((start, i - start))
            start, size = i, 0
        size += n
    if len(sizes) > start:
        out.append((start, len(sizes) - start))
    return out


#: What one checksum task hashes: runs of payloads, each ``(bytes of the run, keys, lengths)``.
Part = tuple[torch.Tensor, Sequence[int], Sequence[int]]


class Done:
    """A result already at hand, with a future's ``result``."""

    def __init__(self, value: list[int]) -> None:
        self.value = value

    def result(self) -> list[int]:
        return self.value

    def cancel(self) -> bool:
        return False


def _digest(parts: Sequence[Part], ready: Sequence[Any]) -> list[int]:
    for event in ready:
        event.synchronize()  # the copies that fill the parts (the GIL is released meanwhile)
    out: list[int] = []
    for data, keys, lengths in parts:
        buf = as_buffer(data)
        at = 0
        for key, n in zip(keys, lengths, strict=True):
            out.append(payload_checksum(key, buf[at : at + n]))
            at += n
    return out


def checksums(
    parts: Sequence[Part], *, parallel: bool, ready: Sequence[Any] = ()
) -> Future[list[int]] | Done:
    """The payload checksums of ``parts`` (CPU bytes), in order.

    With ``parallel`` they are taken on the checksum pool and this returns at
    once; ``ready`` (CUDA events) are waited for before the bytes are read.
    """
    pool = checksum_pool() if parallel else None
    if pool is None:
        return Done(_digest(parts, ready))
    return pool.submit(_digest, parts, ready)


def parallel_worth(nbytes: int) -> bool:
    """Whether a batch of ``nbytes`` is worth hashing on the checksum pool."""
    return nbytes >= _codec.PARALLEL_MIN_BYTES
