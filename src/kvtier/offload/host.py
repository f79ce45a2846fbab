"""Host-memory tier medium: one preallocated (pinned, when CUDA is present) byte array.

Slot ``i`` of the array holds one block's encoded payload; its header lives
beside it in a list. Storing copies the payload into the slot (from the
device, or from wherever the codec produced it) and checksums the copy that
now sits in host memory; loading checks that checksum before the payload is
handed back, so a slot overwritten by mistake is caught as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.offload.codec import make_header
from kvtier.offload.media import BlockFormat, MediumCaps, Stored


class HostStore:
    """Encoded blocks in one host tensor ``[capacity, payload_size]``."""

    name = "host"
    caps = MediumCaps(background=False)

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        #: Pin when CUDA is present, so device copies can run asynchronously.
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._fmt: BlockFormat | None = None
        self._rows = torch.empty((0, 0), dtype=torch.uint8)
        self._headers: list[bytes | None] = []

    def bind(self, fmt: BlockFormat, capacity: int) -> None:
        try:
            self._rows = torch.empty(
                (capacity, fmt.payload_size), dtype=torch.uint8, pin_memory=self.pin_memory
            )
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cannot allocate {capacity} host blocks of {fmt.payload_size:,} bytes: {exc}; "
                "configure a smaller host tier"
            ) from None
        self._fmt = fmt
        self._headers = [None] * capacity

    @property
    def nbytes(self) -> int:
        return int(self._rows.numel())

    def row(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s payload bytes (a view: valid until the slot is reused)."""
        return self._rows[slot]

    def put(self, items: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        fmt = self._fmt
        if fmt is None:
            raise InternalInvariantError("HostStore used before bind()")
        rows = self._rows
        headers = self._headers
        for key, slot, payload in items:
            row = rows[slot]
            row.copy_(payload.view(-1), non_blocking=payload.device.type != "cpu")
            if payload.device.type != "cpu":
                torch.cuda.current_stream(payload.device).synchronize()
            headers[slot] = make_header(fmt.codec, key, fmt.block_shape, fmt.dtype, row)

    def get(self, items: Sequence[tuple[int, int]]) -> list[Stored | None]:
        rows = self._rows
        headers = self._headers
        out: list[Stored | None] = []
        for _key, slot in items:
            header = headers[slot]
            out.append(None if header is None else (header, rows[slot]))
        return out

    def delete(self, items: Sequence[tuple[int, int]]) -> None:
        for _key, slot in items:
            self._headers[slot] = None

    def purge(self, items: Sequence[tuple[int, int]]) -> None:
        self.delete(items)  # nobody else reads this medium

    def contains(self, keys: Sequence[int]) -> list[bool]:
        return [False] * len(keys)

    def scan(self) -> list[int]:
        return []

    def close(self) -> None:
        self._rows = torch.empty((0, 0), dtype=torch.uint8)
        self._headers = []
