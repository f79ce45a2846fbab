"""Promotion: what a tier load is made of, and verifying payloads into device blocks.

A load (:meth:`TierChain.start_load <kvtier.offload.chain.TierChain.start_load>`)
is one :class:`LoadBatch` per run of consecutive keys the same tier serves;
each batch's items are read in one medium call (in the background on slow
media). :func:`install` then checks every payload (header, key, shape,
dtype, checksum) and writes it into its device block, stopping at the first
block that is missing or damaged: nothing unverified reaches the device, and
the engine computes the rest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.errors import CorruptBlockError
from kvtier.offload.codec import RawCodec, decode_into, verify
from kvtier.offload.media import BlockStore, Stored
from kvtier.offload.tier import Tier
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
    native = storage.codec
    # Block-contiguous storage takes each verified block with one copy;
    # the block ids come from the manager, so import_blocks' checks are moot.
    direct = storage.tensor if storage.layout_kind == "block" and native is None else None
    n = 0
    for key, block, got in zip(batch.keys, batch.blocks, batch.stored, strict=True):
        if got is None:
            c.vanished_blocks += 1
            return Installed(n, key)
        header, payload = got
        try:
            codec = verify(header, payload, key, fmt.shape, fmt.dtype)
        except CorruptBlockError as exc:
            c.corrupt_blocks += 1
            return Installed(n, key, exc)
        started = time.perf_counter()
        if direct is not None:
            # Decoded straight into the device block: no intermediate block.
            decode_into(codec, payload, direct[block])
            recoded = codec.codec_id != RawCodec.codec_id
        else:
            # The pool's own format is imported as it is; anything else is
            # decoded (and, into a quantized pool, quantized again).
            as_is = native is not None and codec.codec_id == native.codec_id
            tensor = payload if as_is else codec.decode(payload, fmt.shape, fmt.dtype)
            recoded = not as_is and (codec.codec_id != RawCodec.codec_id or native is not None)
            storage.load_block(block, tensor)
        if recoded:
            c.decode_seconds += time.perf_counter() - started
        n += 1
        c.loaded_blocks += 1
        c.loaded_bytes += int(payload.numel())
    return Installed(n)


class Reader:
    """A load job for the transfer engine: read items from a medium."""

    def __init__(self, medium: BlockStore, items: list[tuple[int, int]]) -> None:
        self.medium = medium
        self.items = items

    def __call__(self) -> list[Stored | None]:
        return self.medium.get(self.items)
