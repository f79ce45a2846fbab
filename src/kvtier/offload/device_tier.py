"""The compressed device tier's medium: encoded blocks in the device's own memory.

A tier of this medium sits first in the :class:`~kvtier.offload.TierChain`,
above host memory. Blocks the full-precision pool evicts are encoded (int8 or
fp8 with per-head scales: about 4x smaller than float32 blocks) into one
preallocated device tensor instead of being dropped or copied to the host; a
prefix hit there decodes them back into the pool without leaving the device.
Like every tier it is driven by an :class:`~kvtier.offload.OffloadingManager`
with any kvtier policy, and what it evicts moves down to the next tier.

It is the host medium on another device: slot ``i`` of the tensor holds one
payload, headers live beside it. Like the host tier's, its payloads are
this process's own memory and are stored unchecked by a tier of the chain
(the header, with the key and layout, is still checked on every load).
"""

from __future__ import annotations

import torch

from kvtier.errors import ConfigError
from kvtier.offload.host import HostStore
from kvtier.offload.media import MediumCaps


class DeviceStore(HostStore):
    """Encoded blocks in one tensor ``[capacity, payload_size]`` on ``device``."""

    name = "device"
    caps = MediumCaps(background=False, in_process=True)

    def __init__(self, device: str | torch.device = "cpu") -> None:
        super().__init__(pin_memory=False)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"invalid device {device!r} for the device tier: {exc}") from None

    def bind(self, namespace: str, capacity: int, item_bytes: int | None = None) -> None:
        if item_bytes is None:
            raise ConfigError("the device tier holds KV blocks of one size: give item_bytes")
        try:
            rows = torch.empty((capacity, item_bytes), dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cannot allocate {capacity} device-tier blocks of {item_bytes:,} bytes on "
                f"{self.device}: {exc}; configure a smaller device tier"
            ) from None
        self._bound = True
        self._rows = rows
        self._headers = [None] * capacity

