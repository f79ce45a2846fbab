"""Tier configuration by size: what ``kvtier serve`` flags and engine users write.

A :class:`TierSpec` names a medium, how many bytes it may use, its codec
and policy; :meth:`TierSpec.build` turns it into a :class:`~kvtier.offload.chain.Tier`
once the block geometry is known (the engine knows it after loading the
model), sizing the tier in blocks of that codec's stored size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError
from kvtier.offload.chain import Tier
from kvtier.offload.codec import HEADER_SIZE, make_codec
from kvtier.offload.media import BlockStore

MEDIA = ("host", "disk", "redis")


@dataclass(frozen=True)
class TierSpec:
    """One tier by size (see the module docstring)."""

    medium: str
    size_bytes: int
    codec: str = "raw"
    policy: str = "lru"
    #: Directory of the disk tier.
    path: str | None = None
    #: URL of the Redis tier (any node's URL for a cluster).
    url: str | None = None
    cluster: bool = False

    def __post_init__(self) -> None:
        if self.medium not in MEDIA:
            raise ConfigError(f"tier medium must be one of {', '.join(MEDIA)}, got {self.medium!r}")
        if not isinstance(self.size_bytes, int) or self.size_bytes <= 0:
            raise ConfigError(f"the {self.medium} tier's size must be positive bytes")
        make_codec(self.codec)  # validates the name
        if self.medium == "disk" and not self.path:
            raise ConfigError("the disk tier needs a directory (path)")
        if self.medium == "redis" and not self.url:
            raise ConfigError("the Redis tier needs a URL such as redis://127.0.0.1:6379/0")

    def capacity_blocks(self, block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        blob = HEADER_SIZE + make_codec(self.codec).payload_size(block_shape, dtype)
        n = self.size_bytes // blob
        if n < 1:
            raise ConfigError(
                f"the {self.medium} tier's {self.size_bytes:,} bytes hold no block of "
                f"{blob:,} bytes: give it more room"
            )
        return n

    def build(self, block_shape: tuple[int, ...], dtype: torch.dtype) -> Tier:
        store: BlockStore
        if self.medium == "host":
            from kvtier.offload.host import HostStore

            store = HostStore()
        elif self.medium == "disk":
            from kvtier.offload.disk import DiskStore

            assert self.path is not None
            store = DiskStore(self.path)
        else:
            from kvtier.offload.redis_store import RedisStore

            store = RedisStore(self.url, cluster=self.cluster)
        cap = self.capacity_blocks(block_shape, dtype)
        return Tier(store, cap, policy=self.policy, codec=self.codec)
