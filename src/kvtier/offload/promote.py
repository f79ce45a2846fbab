"""Promotion: what a tier load is made of, and verifying payloads into device blocks.

A load (:meth:`TierChain.start_load <kvtier.offload.chain.TierChain.start_load>`)
is one :class:`LoadBatch` per run of consecutive keys the same tier serves;
each batch's items are read in one medium call (in the background on slow
media). :func:`install` then checks every payload (header, key, shape,
dtype, checksum) and writes it into its device block, stopping at the first
block that is missing or damaged: nothing unverified reaches the device, and
the engine computes the rest.

Where the device blocks are in host memory, a batch is installed one block
at a time, each copied once: a raw payload from host memory is copied into
its device block and hashed in the same pass, a chunk at a time
(:func:`~kvtier.offload.codec.copy_checksum`), and a file is read straight
into its device block (the header into a small buffer) and hashed there,
while its bytes are still in cache. The load's background step then only
asked the kernel to fetch the files (:class:`~kvtier.offload.media.ReadsInto`).
A raw block that fails its checks after landing is zero-filled at once (as
is any block a parallel read got to past it), and the load stops there:
none of its bytes stay in the device, and they never count as loaded.
Payloads an in-process medium (the host tier) stored unchecked have only
their headers checked and are copied without hashing (see
:mod:`kvtier.offload.host` for why).

Otherwise (device blocks on a GPU) a large batch's checksums are taken on the
checksum pool, a run of payloads per task, while the runs already verified
are copied in: raw payloads that lie back to back and go to consecutive
device blocks move with one copy, asynchronously from pinned memory, and the
batch waits for its copies once, at the end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import cast

import torch

from kvtier.errors import CorruptBlockError, KvTierError
from kvtier.offload import codec as _codec
from kvtier.offload.codec import (
    HEADER_SIZE,
    Codec,
    RawCodec,
    as_buffer,
    check_header,
    checksum_pool,
    checksum_workers,
    copy_checksum,
    decode_into,
    payload_checksum,
    payload_hasher,
)
from kvtier.offload.media import BlockStore, ItemFormat, ReadsInto, Stored
from kvtier.offload.tier import Tier, TierCounters
from kvtier.offload.transfer import (
    Done,
    Part,
    checksums,
    chunks,
    follows,
    parallel_worth,
    place,
    runs,
    span,
)
from kvtier.storage import KVBlockStorage


@dataclass(frozen=True, slots=True)
class DeferredRead:
    """A load's background step on a :class:`ReadsInto` medium: only prefetched.

    :func:`install` reads ``items`` (``(key, slot)``, in the batch's order)
    straight into their device blocks.
    """

    medium: ReadsInto
    items: list[tuple[int, int]]


#: What a batch's read gave: each item (``None``: absent), or reads left to install.
Fetched = list[Stored | None] | DeferredRead


@dataclass
class LoadBatch:
    """One tier's part of a load: keys, their device blocks, and what came back."""

    tier: int
    start: int
    keys: list[int]
    blocks: list[int]
    slots: list[int] = field(default_factory=list)
    job: int = -1
    stored: Fetched | None = None
    error: BaseException | None = None
    #: Seconds the medium took to read the batch (on whichever thread read it).
    read_s: float = 0.0
    #: Whether its blocks are landing layer by layer (its items stay in use until then).
    filled: bool = False


@dataclass
class PendingLoad:
    """A load :meth:`TierChain.start_load` began: per-tier batches, some read in the background."""

    batches: list[LoadBatch]
    #: Blocks the tiers held when the load began (the most it can bring in).
    num_blocks: int
    #: Once finished: the blocks each tier gave (by tier name).
    loaded_by_tier: dict[str, int] = field(default_factory=dict)


def plan_batches(plan: list[int], keys: Sequence[int], blocks: Sequence[int]) -> list[LoadBatch]:
    """Split a lookup's plan (the serving tier per key) into one batch per run of a tier."""
    batches: list[LoadBatch] = []
    for i, t in enumerate(plan):
        if batches and batches[-1].tier == t:
            batches[-1].keys.append(keys[i])
            batches[-1].blocks.append(blocks[i])
        else:
            batches.append(LoadBatch(t, i, [keys[i]], [blocks[i]]))
    return batches


@dataclass
class Installed:
    """What :func:`install` did with a batch: blocks written, and the first bad key."""

    loaded: int
    #: The key that stopped the batch (missing or damaged), if any.
    bad_key: int | None = None
    #: Why it was bad: a damaged payload's error (``None``: it had vanished).
    error: CorruptBlockError | None = None
    #: Whether the blocks are still landing, layer by layer
    #: (:func:`~kvtier.offload.layerwise.fill_layerwise`): the medium's items stay in use
    #: until the storage's fill has settled.
    filled: bool = False


def install(storage: KVBlockStorage, tier: Tier, batch: LoadBatch) -> Installed:
    """Verify ``batch``'s payloads and write them into its device blocks, in order.

    Stops at the first missing or damaged item. Counts on ``tier.counters``;
    the caller drops the bad key from the tier and touches the loaded ones.
    A medium that fails mid-batch is reported to ``tier.health``; the blocks
    before it count.
    """
    stored = batch.stored
    assert stored is not None
    in_host = storage.device.type == "cpu"
    if isinstance(stored, DeferredRead):
        if in_host:
            return _install_inline(storage, tier, batch, stored)
        # No read fills a GPU block directly: read this batch whole now, and
        # let later loads read in the background again.
        stored.medium.defer_reads = False
        try:
            stored = batch.stored = cast(BlockStore, stored.medium).get(stored.items)
        except KvTierError as exc:
            tier.health.failed(exc)
            return Installed(0)
    if in_host and all(got is None or got[1].device.type == "cpu" for got in stored):
        return _install_inline(storage, tier, batch, stored)
    return _install_batched(storage, tier, batch, stored)


def _install_inline(
    storage: KVBlockStorage, tier: Tier, batch: LoadBatch, source: Fetched
) -> Installed:
    """:func:`install` into device blocks in host memory: each payload copied once and
    hashed while it is in cache (see the module docstring)."""
    c = tier.counters
    fmt = tier.fmt
    assert fmt is not None
    keys, blocks = batch.keys, batch.blocks
    direct = storage.tensor if storage.layout_kind == "block" and storage.codec is None else None
    writer = _Writer(storage, tier)
    if not isinstance(source, DeferredRead):
        first = 0
        if direct is not None and writer.in_process:
            first = _copy_unchecked(c, direct, keys, blocks, source, fmt)
        for i, item in enumerate(source[first:], first):
            if item is None:
                c.vanished_blocks += 1
                return Installed(i, keys[i])
            stop = _install_one(c, writer, direct, keys[i], blocks[i], item, fmt.shape, fmt.dtype)
            if stop is not None:
                c.corrupt_blocks += 1
                return Installed(i, keys[i], stop)
        return Installed(len(keys))
    medium = source.medium
    slots = [slot for _, slot in source.items]
    start = 0
    if (
        direct is not None
        and fmt.codec.codec_id == RawCodec.codec_id
        and direct.is_contiguous()
        and direct[0].numel() * direct.element_size() == fmt.payload_size
    ):
        start, failure = _read_blocks(medium, keys, slots, direct, blocks, fmt)
        c.loaded_blocks += start
        c.loaded_bytes += start * fmt.payload_size
        if failure is not None:
            tier.health.failed(failure)
            return Installed(start)
    # The rest (another codec, or from the first raw block that did not check out):
    # each read into one buffer reused for the batch, then verified and written.
    # One byte more than a payload: a file longer than its block reads long.
    scratch = torch.empty(fmt.payload_size + 1, dtype=torch.uint8)
    header = memoryview(bytearray(HEADER_SIZE))
    for i in range(start, len(keys)):
        key, block, slot = keys[i], blocks[i], slots[i]
        try:
            n = medium.read_into(key, slot, [header, as_buffer(scratch)])
            got: Stored | None = None
            if n is not None:
                got = (header[: min(n, HEADER_SIZE)], scratch[: max(0, n - HEADER_SIZE)])
                if _install_one(c, writer, direct, key, block, got, fmt.shape, fmt.dtype) is None:
                    continue
                # Damaged, or cut short, or another codec's larger payload: the
                # whole file, read the usual way, decides.
                got = cast(BlockStore, medium).get([(key, slot)])[0]
        except KvTierError as exc:
            tier.health.failed(exc)
            return Installed(i)
        if got is None:
            c.vanished_blocks += 1
            return Installed(i, key)
        stop = _install_one(c, writer, direct, key, block, got, fmt.shape, fmt.dtype)
        if stop is not None:
            c.corrupt_blocks += 1
            return Installed(i, key, stop)
    return Installed(len(keys))


@dataclass
class Unchecked:
    """A batch's leading raw payloads an in-process medium stored unchecked, their headers
    checked (:func:`leading_unchecked`), and what ended them."""

    payloads: list[torch.Tensor]
    #: The missing or damaged item that ended them, as :func:`install` reports it (``None``:
    #: the batch's end, or an item checked or encoded).
    stop: Installed | None = None
    #: Whether an item with a checksum or another codec ended them.
    other: bool = False


def leading_unchecked(keys: list[int], source: list[Stored | None], fmt: ItemFormat) -> Unchecked:
    """The leading items of ``source`` that are raw payloads stored unchecked (see
    :class:`Unchecked`): nothing but their headers can be checked, so all are checked first."""
    out = Unchecked([])
    for key, item in zip(keys, source, strict=True):
        if item is None:
            out.stop = Installed(len(out.payloads), key)
            break
        header, payload = item
        try:
            codec, checksum = check_header(
                header, key, fmt.shape, fmt.dtype, int(payload.numel()), in_process=True
            )
        except CorruptBlockError as exc:
            out.stop = Installed(len(out.payloads), key, exc)
            break
        if checksum is not None or codec.codec_id != RawCodec.codec_id:
            out.other = True
            break
        out.payloads.append(payload)
    return out


def count_stop(c: TierCounters, stop: Installed) -> None:
    """Count the item that stopped a batch: vanished (no error) or corrupt."""
    if stop.error is None:
        c.vanished_blocks += 1
    else:
        c.corrupt_blocks += 1


def _copy_unchecked(
    c: TierCounters,
    direct: torch.Tensor,
    keys: list[int],
    blocks: list[int],
    source: list[Stored | None],
    fmt: ItemFormat,
) -> int:
    """The leading raw payloads an in-process medium stored unchecked, into their device
    blocks: every header checked first, then one copy per run of blocks (back to back on
    both sides). Returns how many; the caller takes it from the first other item."""
    size = fmt.payload_size
    if not direct.is_contiguous() or direct[0].numel() * direct.element_size() != size:
        return 0
    srcs = leading_unchecked(keys, source, fmt).payloads
    memory = direct.view(-1).view(torch.uint8)
    where = [place(p) for p in srcs]
    start = 0
    for i in range(1, len(srcs) + 1):
        if i < len(srcs) and blocks[i] == blocks[i - 1] + 1 and follows(where[i - 1], where[i]):
            continue
        first = blocks[start]
        memory[first * size : (first + i - start) * size].copy_(span(srcs, start, i - start))
        start = i
    c.loaded_blocks += len(srcs)
    c.loaded_bytes += len(srcs) * size
    return len(srcs)


def _read_blocks(
    medium: ReadsInto,
    keys: list[int],
    slots: list[int],
    direct: torch.Tensor,
    blocks: list[int],
    fmt: ItemFormat,
) -> tuple[int, KvTierError | None]:
    """Read raw files straight into device ``blocks`` of ``direct`` and verify them there.

    Returns how many leading blocks are good, and the error of a medium that
    failed. A large batch is read by several threads, a run of blocks each;
    past the first block that is not good, nothing read stays in the device
    blocks.
    """
    n = len(keys)
    memory = as_buffer(direct.view(-1).view(torch.uint8))
    pool = checksum_pool() if n > 1 and parallel_worth(n * fmt.blob_size) else None
    if pool is None:
        return _read_run(medium, keys, slots, direct, memory, blocks, fmt)
    step = -(-n // min(n, checksum_workers()))
    starts = list(range(0, n, step))

    def run(at: int) -> tuple[int, KvTierError | None]:
        end = at + step
        return _read_run(medium, keys[at:end], slots[at:end], direct, memory, blocks[at:end], fmt)

    futures = [pool.submit(run, at) for at in starts[1:]]
    try:
        results = [run(0)]
    finally:
        # The other runs write into device blocks: wait for every one of them.
        wait_futures(futures)
    results += [f.result() for f in futures]
    for k, (good, error) in enumerate(results):
        if good < min(step, n - starts[k]):
            # Later runs may have read good blocks past this one: they do not count.
            for at, (later, _) in zip(starts[k + 1 :], results[k + 1 :], strict=True):
                for block in blocks[at : at + later]:
                    direct[block].zero_()
            return starts[k] + good, error
    return n, None


def _read_run(
    medium: ReadsInto,
    keys: list[int],
    slots: list[int],
    direct: torch.Tensor,
    memory: memoryview,
    blocks: list[int],
    fmt: ItemFormat,
) -> tuple[int, KvTierError | None]:
    """:func:`_read_blocks` on one thread: stops at the first block that is not good
    (and zero-fills it). ``memory`` is ``direct``'s bytes."""
    header = memoryview(bytearray(HEADER_SIZE))
    # One byte past the block: a file longer than it reads long.
    tail = memoryview(bytearray(1))
    size = fmt.payload_size
    for i, (key, slot, block) in enumerate(zip(keys, slots, blocks, strict=True)):
        dst = memory[block * size : (block + 1) * size]
        # Hashed a chunk at a time as the chunks come in, while they are in cache.
        hasher = payload_hasher(key)
        try:
            n = medium.read_into(
                key, slot, [header, dst, tail], chunk=_codec.COPY_CHUNK, on_chunk=hasher.update
            )
        except KvTierError as exc:
            direct[block].zero_()  # what a failed read left there
            return i, exc
        if n is None:
            return i, None
        if not _verified_in_place(header, hasher.intdigest(), n, key, fmt):
            direct[block].zero_()
            return i, None
    return len(keys), None


def _verified_in_place(header: memoryview, digest: int, n: int, key: int, fmt: ItemFormat) -> bool:
    """Whether a raw block read in place (``n`` bytes with its header, its payload's
    checksum ``digest``) is good."""
    if n != fmt.blob_size:
        return False
    try:
        codec, checksum = check_header(header, key, fmt.shape, fmt.dtype, n - HEADER_SIZE)
    except CorruptBlockError:
        return False
    return codec.codec_id == RawCodec.codec_id and digest == checksum


def _install_one(
    c: TierCounters,
    writer: _Writer,
    direct: torch.Tensor | None,
    key: int,
    block: int,
    got: Stored,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> CorruptBlockError | None:
    """Verify one payload in host memory and write it into device ``block``; the error
    that stopped it, if any (the device block then holds nothing of it)."""
    header, payload = got
    try:
        codec, checksum = check_header(
            header, key, shape, dtype, int(payload.numel()), in_process=writer.in_process
        )
    except CorruptBlockError as exc:
        return exc
    if direct is not None and codec.codec_id == RawCodec.codec_id:
        dst = direct[block]
        if checksum is None:  # in-process memory, stored unchecked: a plain copy
            dst.view(-1).view(torch.uint8).copy_(payload)
        elif copy_checksum(key, payload, dst.view(-1).view(torch.uint8)) != checksum:
            dst.zero_()
            return CorruptBlockError(f"stored block {key:#x} fails its payload checksum")
        c.loaded_blocks += 1
        c.loaded_bytes += int(payload.numel())
        return None
    # Hashed first, then decoded from cache: nothing unverified is decoded.
    if checksum is not None and payload_checksum(key, as_buffer(payload)) != checksum:
        return CorruptBlockError(f"stored block {key:#x} fails its payload checksum")
    writer.add(codec, block, payload)
    writer.flush()
    return None


def _install_batched(
    storage: KVBlockStorage, tier: Tier, batch: LoadBatch, stored: list[Stored | None]
) -> Installed:
    """:func:`install` into device blocks on a GPU (see the module docstring)."""
    c = tier.counters
    fmt = tier.fmt
    assert fmt is not None
    keys = batch.keys
    # Headers first, in order, up to the first item missing or with a bad header.
    stop: Installed | None = None
    expected: list[tuple[Codec, int | None]] = []
    payloads: list[torch.Tensor] = []
    in_process = tier.medium.caps.in_process
    for key, got in zip(keys, stored, strict=True):
        if got is None:
            stop = Installed(0, key)
            break
        header, payload = got
        try:
            expected.append(
                check_header(
                    header, key, fmt.shape, fmt.dtype, int(payload.numel()), in_process=in_process
                )
            )
        except CorruptBlockError as exc:
            stop = Installed(0, key, exc)
            break
        payloads.append(payload)
    lengths = [int(p.numel()) for p in payloads]
    pending: list[tuple[int, Future[list[int]] | Done]] = []
    if all(sum_ is None for _, sum_ in expected):
        # Unchecked payloads of an in-process medium: nothing to hash, only to copy.
        if payloads:
            pending.append((0, Done([0] * len(payloads))))
    else:
        parallel = parallel_worth(sum(lengths))
        for first, count in chunks(lengths):
            parts: list[Part] = []
            for start, n in runs(payloads[first : first + count]):
                at = first + start
                parts.append((span(payloads, at, n), keys[at : at + n], lengths[at : at + n]))
            pending.append((first, checksums(parts, parallel=parallel)))
    writer = _Writer(storage, tier)
    try:
        for n, (first, sums) in enumerate(pending):
            for i, got_sum in enumerate(sums.result(), first):
                want = expected[i][1]
                if want is not None and got_sum != want:
                    for _, later in pending[n + 1 :]:
                        later.cancel()
                    writer.flush()
                    c.corrupt_blocks += 1
                    err = CorruptBlockError(f"stored block {keys[i]:#x} fails its payload checksum")
                    return Installed(i, keys[i], err)
                writer.add(expected[i][0], batch.blocks[i], payloads[i])
            # This run's copies go out while the pool still hashes the next ones.
            writer.flush()
    finally:
        writer.wait()
    if stop is not None:
        count_stop(c, stop)
        return Installed(len(payloads), stop.bad_key, stop.error)
    return Installed(len(payloads))


class _Writer:
    """Writes verified payloads into device blocks, a run of raw blocks per copy."""

    def __init__(self, storage: KVBlockStorage, tier: Tier) -> None:
        self.storage = storage
        self.counters = tier.counters
        assert tier.fmt is not None
        self.fmt = tier.fmt
        #: The medium is this process's memory: its unchecked payloads are accepted.
        self.in_process = tier.medium.caps.in_process
        self.native = storage.codec
        # Block-contiguous storage takes verified blocks with plain copies; the
        # block ids come from the manager, so import_blocks' checks are moot.
        self.direct = (
            storage.tensor if storage.layout_kind == "block" and self.native is None else None
        )
        self.blocks: list[int] = []
        self.payloads: list[torch.Tensor] = []
        self.streams: set[torch.device] = set()

    def add(self, codec: Codec, block: int, payload: torch.Tensor) -> None:
        c = self.counters
        c.loaded_blocks += 1
        c.loaded_bytes += int(payload.numel())
        if self.direct is not None and codec.codec_id == RawCodec.codec_id:
            if self.blocks and block != self.blocks[-1] + 1:
                self.flush()
            self.blocks.append(block)
            self.payloads.append(payload)
            return
        self.flush()
        started = time.perf_counter()
        if self.direct is not None:
            # Decoded straight into the device block: no intermediate block.
            decode_into(codec, payload, self.direct[block])
            c.decode_seconds += time.perf_counter() - started
            return
        # The pool's own format is imported as it is; anything else is
        # decoded (and, into a quantized pool, quantized again).
        native = self.native
        as_is = native is not None and codec.codec_id == native.codec_id
        tensor = payload if as_is else codec.decode(payload, self.fmt.shape, self.fmt.dtype)
        self.storage.load_block(block, tensor)
        if not as_is and (codec.codec_id != RawCodec.codec_id or native is not None):
            c.decode_seconds += time.perf_counter() - started

    def flush(self) -> None:
        """Copy the raw payloads gathered so far into their (consecutive) blocks."""
        direct = self.direct
        if not self.blocks or direct is None:
            return
        blocks, payloads = self.blocks, self.payloads
        self.blocks, self.payloads = [], []
        for start, count in runs(payloads):
            src = span(payloads, start, count)
            dst = direct[blocks[start] : blocks[start] + count]
            # From pinned memory the copy runs on the stream, the batch waits once;
            # from pageable memory it is synchronous anyway.
            later = dst.device.type == "cuda" and src.device.type == "cpu" and src.is_pinned()
            dst.copy_(src.view(dst.dtype).view(dst.shape), non_blocking=later)
            if later:
                self.streams.add(dst.device)

    def wait(self) -> None:
        """Wait for the asynchronous copies: the payloads' memory may be reused after."""
        for device in self.streams:
            torch.cuda.current_stream(device).synchronize()
        self.streams.clear()


class Reader:
    """A load job for the transfer engine: read items from a medium (timed into ``batch``)."""

    def __init__(
        self, medium: BlockStore, items: list[tuple[int, int]], batch: LoadBatch | None = None
    ) -> None:
        self.medium = medium
        self.items = items
        self.batch = batch

    def __call__(self) -> Fetched:
        medium = self.medium
        started = time.perf_counter()
        try:
            if getattr(medium, "defer_reads", False):
                # Read at install, straight into the device blocks; until then the
                # kernel fetches the files (a no-op for those in the page cache).
                reads = cast(ReadsInto, medium)
                reads.prefetch(self.items)
                return DeferredRead(reads, self.items)
            return medium.get(self.items)
        finally:
            if self.batch is not None:
                self.batch.read_s = time.perf_counter() - started
