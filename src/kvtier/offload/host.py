"""Host-memory tier medium: preallocated (pinned, when CUDA is present) slots, or items of any size.

For KV blocks (one size), slot ``i`` of one preallocated byte array holds
one block's encoded payload; its header lives beside it in a list. For
items of any size (encoder outputs), each item gets a tensor of its own.

What a checksum here would guard against decides whether there is one. The
slots are this process's own memory: no other process, disk or network
writes them, so a payload checksum would catch only what the device's own
blocks are just as exposed to (a stray write in this process, a memory
fault), at the price of hashing every byte on store and on load (about as
much as the copy). So a tier of the chain stores KV blocks *unchecked*
(``checksums=False``, what :class:`~kvtier.offload.tier.Tier` asks of an
in-process medium): a store is one copy per run of blocks and a header, a
load one copy. The header is still written and checked (key, layout,
codec, length), so a slot handed out twice or read under another key is
caught. Media that leave the process (disk, Redis, Mooncake) keep their
checksums; so do this medium's items of any size and its other users
(``checksums=True``, the default).

A batch is stored with as few copies as its layout allows (blocks that lie
back to back on the device and land in consecutive slots move together),
all issued at once on the current CUDA stream. With checksums, each chunk's
checksums are taken once its event fires, on the checksum pool for large
batches, so hashing one chunk overlaps the copies of the next; payloads
already in host memory are copied and hashed in one pass per item, a
cache-sized chunk at a time (:func:`~kvtier.offload.codec.copy_checksum`),
as nothing would overlap.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.offload.codec import PAYLOAD_LENGTH_OFFSET as _LENGTH_AT
from kvtier.offload.codec import (
    as_buffer,
    copy_checksum,
    header_for,
    pack_header,
    unchecked_header,
)
from kvtier.offload.media import MediumCaps, PutItem, Stored
from kvtier.offload.transfer import (
    Part,
    checksums,
    chunks,
    follows,
    parallel_worth,
    place,
    runs,
    span,
)


class HostStore:
    """Encoded items in host memory (see the module docstring).

    Bound with a fixed ``item_bytes`` it preallocates one tensor
    ``[capacity, item_bytes]`` and stores item ``key`` at its ``slot``;
    bound without one it holds items of any size, each in a tensor of its
    own (pinned likewise), found by key.
    """

    name = "host"
    caps = MediumCaps(background=False, in_process=True)

    def __init__(self, *, pin_memory: bool | None = None, checksums: bool = True) -> None:
        #: Pin when CUDA is present, so device copies can run asynchronously.
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        #: Whether fixed-size items (KV blocks) get a payload checksum (see the module
        #: docstring); a tier of the chain turns it off.
        self.checksums = checksums
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
        if self._items is not None:
            self._put_items(items)
        else:
            self._put_rows(items)

    def _put_rows(self, items: Sequence[PutItem]) -> None:
        rows = self._rows
        width = rows.shape[1]
        headers = self._headers
        srcs: list[torch.Tensor] = []
        for _key, slot, payload, _fmt in items:
            flat = payload if payload.dim() == 1 else payload.view(-1)
            n = flat.numel()
            if n > width:
                raise ConfigError(
                    f"an item of {n:,} bytes does not fit this host tier's {width:,}-byte slots"
                )
            # A slot being rewritten holds nothing until its new header is in.
            headers[slot] = None
            srcs.append(flat)
        lengths = [int(t.numel()) for t in srcs]
        if not self.checksums:
            self._copy_rows(items, srcs, lengths)
            return
        dsts = [rows[slot, :n] for (_, slot, _, _), n in zip(items, lengths, strict=True)]
        keys = [k for k, _, _, _ in items]
        if all(t.device.type == "cpu" for t in srcs):
            # From host memory the copies are synchronous and nothing overlaps them:
            # each item is copied and hashed in one pass, a cache-sized chunk at a
            # time (handing the hashes to the pool measured slower).
            for (key, slot, _, fmt), src, dst, n in zip(items, srcs, dsts, lengths, strict=True):
                checksum = copy_checksum(key, src, dst)
                headers[slot] = header_for(fmt.codec, key, fmt.shape, fmt.dtype, n, checksum)
            return
        parallel = parallel_worth(sum(lengths))
        pending = []
        for first, count in chunks(lengths):
            parts: list[Part] = []
            devices: set[torch.device] = set()
            for start, n in runs(srcs[first : first + count], dsts[first : first + count]):
                at = first + start
                src = span(srcs, at, n)
                dst = span(dsts, at, n)
                on_device = src.device.type != "cpu"
                dst.copy_(src, non_blocking=on_device)
                if on_device:
                    devices.add(src.device)
                parts.append((dst, keys[at : at + n], lengths[at : at + n]))
            ready = []
            for device in devices:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(device))
                ready.append(event)
            # Checksummed where it now sits, so a copy gone wrong is caught on load;
            # the pool hashes this chunk while the next one's copies run.
            pending.append((first, count, checksums(parts, parallel=parallel, ready=ready)))
        for first, count, sums in pending:
            got = sums.result()
            if len(got) != count:
                raise InternalInvariantError(f"{len(got)} checksums for {count} host items")
            for i, checksum in enumerate(got, first):
                _, slot, _, fmt = items[i]
                headers[slot] = header_for(
                    fmt.codec, keys[i], fmt.shape, fmt.dtype, lengths[i], checksum
                )

    def _copy_rows(
        self, items: Sequence[PutItem], srcs: list[torch.Tensor], lengths: list[int]
    ) -> None:
        """Store unchecked: one copy per run of blocks (back to back on both sides). The
        slots' side of a run comes from the slot numbers (no view of a slot is made): the
        next slot continues it when this item fills its own."""
        rows = self._rows
        width = rows.shape[1]
        where = [place(t) for t in srcs]
        slots = [slot for _, slot, _, _ in items]
        devices: set[torch.device] = set()
        start = 0
        for i in range(1, len(srcs) + 1):
            if (
                i < len(srcs)
                and lengths[i - 1] == width
                and slots[i] == slots[i - 1] + 1
                and follows(where[i - 1], where[i])
            ):
                continue
            src = span(srcs, start, i - start)
            on_device = src.device.type != "cpu"
            dst = rows[slots[start] : slots[start] + i - start].view(-1)
            if lengths[i - 1] != width:  # only a run's last item may stop short of its slot
                dst = dst[: src.numel()]
            dst.copy_(src, non_blocking=on_device)
            if on_device:
                devices.add(src.device)
            start = i
        for device in devices:  # the slots are readable once the header says so
            torch.cuda.current_stream(device).synchronize()
        headers = self._headers
        for (key, slot, _, fmt), n in zip(items, lengths, strict=True):
            headers[slot] = unchecked_header(fmt.codec, key, fmt.shape, fmt.dtype, n)

    def _put_items(self, items: Sequence[PutItem]) -> None:
        store = self._items
        assert store is not None
        copied: list[tuple[int, torch.Tensor, PutItem]] = []
        devices = set()
        for item in items:
            key, _slot, payload, _fmt = item
            flat = payload.view(-1)
            dest = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=self.pin_memory)
            on_device = payload.device.type != "cpu"
            dest.copy_(flat, non_blocking=on_device)
            if on_device:
                devices.add(payload.device)
            copied.append((key, dest, item))
        for device in devices:  # one wait per batch, not per item
            torch.cuda.current_stream(device).synchronize()
        for key, dest, (_, _, _, fmt) in copied:
            store[key] = (pack_header(fmt.codec, key, fmt.shape, fmt.dtype, as_buffer(dest)), dest)

    def get(self, items: Sequence[tuple[int, int]]) -> list[Stored | None]:
        store = self._items
        if store is not None:
            return [store.get(key) for key, _ in items]
        rows = self._rows
        width = rows.shape[1]
        headers = self._headers
        out: list[Stored | None] = []
        for _key, slot in items:
            header = headers[slot]
            if header is None:
                out.append(None)
                continue
            # The header says how long the payload is; a stale length fails its checksum.
            length = int.from_bytes(header[_LENGTH_AT : _LENGTH_AT + 8], "little")
            out.append(
                (header, rows[slot] if length == width else rows[slot, : min(length, width)])
            )
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
