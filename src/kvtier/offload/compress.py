"""Compressing the device cache: a prefix chain's cached blocks moved to a compressed tier now.

The device tier (:class:`~kvtier.offload.device_tier.DeviceStore`, first in
the chain) holds blocks int8- or fp8-encoded in device memory.
:func:`compress` moves the last part of a chain's cached device blocks there,
leaves first, with every cached block descending from them, and frees them on
the device; a later hit decodes them back. Blocks a running request holds
stay. The device cache says which blocks may go
(:meth:`~kvtier.manager.KVCacheManager.compression_plan`) and frees the ones
the tier took (:meth:`~kvtier.manager.KVCacheManager.withdraw_stored`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.errors import BadRequestError, ConfigError

if TYPE_CHECKING:
    from kvtier.offload.chain import TierChain


@dataclass(frozen=True, slots=True)
class CompressionResult:
    """What :func:`compress` moved off the device pool."""

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


def compress(
    chain: TierChain, keys: Sequence[int], fraction: float = 1.0, *, tier: int | None = None
) -> CompressionResult:
    """Move the last ``fraction`` of a chain's cached device blocks to a tier, freeing them.

    ``keys`` are a request's block keys in order. They go to the device tier
    (``tier``: another index). Blocks the tier cannot take stay on the device.
    """
    if not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise BadRequestError(f"fraction must be in (0, 1], got {fraction!r}")
    t = chain.device_tier() if tier is None else tier
    if t is None:
        raise ConfigError(
            "compress needs a compressed device tier: add one with --tier device:SIZE "
            "(TierSpec('device', size, codec='int8')), or name a tier"
        )
    if not 0 <= t < len(chain.tiers):
        raise BadRequestError(f"tier {t} does not exist: the chain has {len(chain.tiers)}")
    started = time.perf_counter()
    target = chain.tiers[t]
    mgr = chain.device_manager
    with chain.locked():
        blocks, move_keys = mgr.compression_plan(keys, fraction)
        if not blocks:
            return CompressionResult(0, 0, 0, time.perf_counter() - started)
        chain.store_blocks(t, move_keys, blocks)
        leaving = mgr.withdraw_stored(blocks, move_keys, target.offload_manager.__contains__)
        assert target.fmt is not None
        if leaving:
            target.counters.compressed_requests += 1
        n = len(leaving)
        return CompressionResult(
            n,
            n * chain.storage.bytes_per_block,
            n * target.fmt.payload_size,
            time.perf_counter() - started,
        )
