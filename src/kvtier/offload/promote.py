"""Promotion: what a tier load is made of, and verifying payloads into device blocks.

A load (:meth:`TierChain.start_load <kvtier.offload.chain.TierChain.start_load>`)
is one :class:`LoadBatch` per run of consecutive keys the same tier serves;
each batch's items are read in one medium call (in the background on slow
media). :func:`install` then checks every payload (header, key, shape,
dtype, checksum) and writes it into its device block, stopping at the first
block that is missing or damaged: nothing unverified reaches the device, and
the engine computes the rest.

A large batch's checksums are taken on the checksum pool, a run of payloads
per task, while the runs already verified are copied in: raw payloads that
lie back to back and go to consecutive device blocks move with one copy,
asynchronously from pinned memory, and the batch waits for its copies once,
at the end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.errors import CorruptBlockError
from kvtier.offload.codec import Codec, RawCodec, check_header, decode_into
from kvtier.offload.media import BlockStore, Stored
from kvtier.offload.tier import Tier
from kvtier.offload.transfer import Part, checksums, chunks, parallel_worth, runs, span
from kvtier.storage import KVBlockStorage


@dataclass
class LoadBatch:
    """One tier's part of a load: keys, their device blocks, and what came back."""

    tier: int
    start: int
    keys: list[int]
    blocks: list[int]
    slots: list[int] = field(default_factory=list)
    job: int = -1
    stored: list[Stored | None] | None = None
    error: BaseException | None = None


@dataclass
class PendingLoad:
    """A load :meth:`TierChain.start_load` began: per-tier batches, some read in the background."""

    batches: list[LoadBatch]
    #: Blocks the tiers held when the load began (the most it can bring in).
    num_blocks: int


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


def install(storage: KVBlockStorage, tier: Tier, batch: LoadBatch) -> Installed:
    """Verify ``batch``'s payloads and write them into its device blocks, in order.

    Stops at the first missing or damaged item. Counts on ``tier.counters``;
    the caller drops the bad key from the tier and touches the loaded ones.
    """
    assert batch.stored is not None
    c = tier.counters
    fmt = tier.fmt
    assert fmt is not None
    keys = batch.keys
    # Headers first, in order, up to the first item missing or with a bad header.
    stop: Installed | None = None
    expected: list[tuple[Codec, int]] = []
    payloads: list[torch.Tensor] = []
    for key, got in zip(keys, batch.stored, strict=True):
        if got is None:
            stop = Installed(0, key)
            break
        header, payload = got
        try:
            expected.append(check_header(header, key, fmt.shape, fmt.dtype, int(payload.numel())))
        except CorruptBlockError as exc:
            stop = Installed(0, key, exc)
            break
        payloads.append(payload)
    lengths = [int(p.numel()) for p in payloads]
    parallel = parallel_worth(sum(lengths))
    pending = []
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
                if got_sum != expected[i][1]:
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
        if stop.error is None:
            c.vanished_blocks += 1
        else:
            c.corrupt_blocks += 1
        return Installed(len(payloads), stop.bad_key, stop.error)
    return Installed(len(payloads))


class _Writer:
    """Writes verified payloads into device blocks, a run of raw blocks per copy."""

    def __init__(self, storage: KVBlockStorage, tier: Tier) -> None:
        self.storage = storage
        self.counters = tier.counters
        assert tier.fmt is not None
        self.fmt = tier.fmt
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
    """A load job for the transfer engine: read items from a medium."""

    def __init__(self, medium: BlockStore, items: list[tuple[int, int]]) -> None:
        self.medium = medium
        self.items = items

    def __call__(self) -> list[Stored | None]:
        return self.medium.get(self.items)
