"""Host-memory tier medium: preallocated (pinned, when CUDA is present) slots, or items of any size.

For KV blocks (one size), slot ``i`` of one preallocated byte array holds
one block's encoded payload; its header lives beside it in a list. For
items of any size (encoder outputs), each item gets a tensor of its own.
Storing copies the payload into host memory (from the device, or from
wherever the codec produced it) and checksums the copy that now sits there;
loading checks that checksum before the payload is handed back, so a slot
overwritten by mistake is caught as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.offload.codec import PAYLOAD_LENGTH_OFFSET as _LENGTH_AT
from kvtier.offload.codec import as_buffer, pack_header
from kvtier.offload.media import MediumCaps, PutItem, Stored


class HostStore:
    """Encoded items in host memory (see the module docstring).

    Bound with a fixed ``item_bytes`` it preallocates one tensor
    ``[capacity, item_bytes]`` and stores item ``key`` at its ``slot``;
    bound without one it holds items of any size, each in a tensor of its
    own (pinned likewise), found by key.
    """

    name = "host"
    caps = MediumCaps(background=False)

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        #: Pin when CUDA is present, so device copies can run asynchronously.
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._bound = False
        self._rows = torch.empty((0, 0), dtype=torch.uint8)
        self._headers: list[bytes | None] = []
        # Items of any size (no item_bytes at bind): key -> (header, payload).
        self._items: dict[int, Stored] | None = None

    def bind(self, namespace: str, capacity: int, item_bytes: int | None = None) -> None:
        self._bound = True
        if item_bytes is None:
            self._items = {}
            return
        try:
            self._rows = torch.empty(
                (capacity, item_bytes), dtype=torch.uint8, pin_memory=self.pin_memory
            )
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cannot allocate {capacity} host blocks of {item_bytes:,} bytes: {exc}; "
                "configure a smaller host tier"
            ) from None
        self._headers = [None] * capacity

    @property
    def nbytes(self) -> int:
        if self._items is not None:
            return sum(int(p.numel()) for _, p in self._items.values())
        return int(self._rows.numel())

    def row(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s payload bytes (a view: valid until the slot is reused)."""
        return self._rows[slot]

    def put(self, items: Sequence[PutItem]) -> None:
        if not self._bound:
            raise InternalInvariantError("HostStore used before bind()")
        store = self._items
        rows = self._rows
        headers = self._headers
        for key, slot, payload, fmt in items:
            flat = payload.view(-1)
            if store is not None:
                dest = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=self.pin_memory)
            else:
                if flat.numel() > rows.shape[1]:
                    raise ConfigError(
                        f"an item of {flat.numel():,} bytes does not fit this host tier's "
                        f"{rows.shape[1]:,}-byte slots"
                    )
                dest = rows[slot, : flat.numel()]
            dest.copy_(flat, non_blocking=payload.device.type != "cpu")
            if payload.device.type != "cpu":
                torch.cuda.current_stream(payload.device).synchronize()
            # Checksummed where it now sits (still in cache from the copy), so a
            # copy gone wrong is caught on load.
            header = pack_header(fmt.codec, key, fmt.shape, fmt.dtype, as_buffer(dest))
            if store is not None:
                store[key] = (header, dest)
            else:
                headers[slot] = header

    def get(self, items: Sequence[tuple[int, int]]) -> list[Stored | None]:
        store = self._items
        if store is not None:
            return [store.get(key) for key, _ in items]
        rows = self._rows
        headers = self._headers
        out: list[Stored | None] = []
        for _key, slot in items:
            header = headers[slot]
            if header is None:
                out.append(None)
                continue
            # The header says how long the payload is; a stale length fails its checksum.
            length = int.from_bytes(bytes(header[_LENGTH_AT : _LENGTH_AT + 8]), "little")
            out.append((header, rows[slot, : min(length, rows.shape[1])]))
        return out

    def delete(self, items: Sequence[tuple[int, int]]) -> None:
        store = self._items
        for key, slot in items:
            if store is not None:
                store.pop(key, None)
            else:
                self._headers[slot] = None

    def purge(self, items: Sequence[tuple[int, int]]) -> None:
        self.delete(items)  # nobody else reads this medium

    def contains(self, keys: Sequence[int]) -> list[bool]:
        store = self._items
        if store is not None:
            return [k in store for k in keys]
        return [False] * len(keys)

    def scan(self) -> list[int]:
        return []

    def close(self) -> None:
        self._rows = torch.empty((0, 0), dtype=torch.uint8)
        self._headers = []
        self._items = None if self._items is None else {}
