"""Tiered offload: KV blocks below the device, in host memory, on disk and in Redis.

* :mod:`~kvtier.offload.manager`: the two-phase offloading manager (one per
  tier, vLLM's protocol), driven by any kvtier policy;
* :mod:`~kvtier.offload.codec`: raw / int8 / fp8 codecs, headers and checksums;
* :mod:`~kvtier.offload.media`: the medium protocol (items of any shape,
  declared capabilities); :mod:`~kvtier.offload.registry`: media by name
  (``register_medium``); :mod:`~kvtier.offload.host`,
  :mod:`~kvtier.offload.disk`, :mod:`~kvtier.offload.redis_store`,
  :mod:`~kvtier.offload.device_tier` (compressed blocks in device memory, a
  tier above host memory): the built-in media;
* :mod:`~kvtier.offload.transfer`: background, batched transfers;
* :mod:`~kvtier.offload.chain`: the tier chain that promotes blocks on a hit
  and demotes them on eviction, and swaps whole requests out and in.

The manager alone needs no torch; everything else here does.
"""

from __future__ import annotations

from kvtier._lazy import lazy_exports
from kvtier.offload.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput

__all__ = [
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
]

#: Names that import torch, loaded when first used.
_LAZY = {
    "Tier": "kvtier.offload.tier",
    "TierChain": "kvtier.offload.chain",
    "SwappedRequest": "kvtier.offload.swap",
    "TierSpec": "kvtier.offload.config",
    "HostStore": "kvtier.offload.host",
    "DeviceStore": "kvtier.offload.device_tier",
    "CompressionResult": "kvtier.offload.compress",
    "DiskStore": "kvtier.offload.disk",
    "RedisStore": "kvtier.offload.redis_store",
    "TransferEngine": "kvtier.offload.transfer",
    "make_codec": "kvtier.offload.codec",
    "ItemFormat": "kvtier.offload.media",
    "MediumCaps": "kvtier.offload.media",
    "register_medium": "kvtier.offload.registry",
    "make_medium": "kvtier.offload.registry",
    "available_media": "kvtier.offload.registry",
}

__getattr__, __dir__ = lazy_exports("kvtier.offload", globals(), _LAZY)
