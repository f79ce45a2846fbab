"""The storage-medium protocol behind every offload tier, and the blob helpers they share.

A medium stores encoded items (KV blocks, encoder outputs: any shape and
dtype, each put with its :class:`ItemFormat`) and nothing else: which keys
are cached, which are pinned and which to evict is the tier's
:class:`~kvtier.offload.OffloadingManager`'s business. The manager hands out
integer *slots*; a medium that is an array (host memory with a fixed item
size) stores item ``key`` at ``slot``, one that is a namespace (a directory,
a Redis keyspace, host memory holding items of any size) names it by the key
and ignores the slot. Every stored item carries a header with its key,
codec, shape, dtype and checksums (:mod:`kvtier.offload.codec`), so whoever
reads it back checks it against what they expect.

Media are registered by name (:mod:`kvtier.offload.registry`) and declare
what they can do (:class:`MediumCaps`); the tier chain decides from those
alone, so a new medium is one module and one registration.

Media raise :class:`~kvtier.TierUnavailableError` when they cannot be
reached (Redis down, disk gone); a block that is absent (a Redis server
evicted it on its own, a file was deleted) reads back as ``None``. What comes
back is checked by the tier (:func:`~kvtier.offload.codec.verify`) before
anything is decoded.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.offload.codec import HEADER_SIZE, Codec, as_buffer, make_header, pack_header

# torch.frombuffer on immutable bytes warns that the tensor is read-only;
# stored payloads are only ever read.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

#: A stored block as read back: its header bytes and its payload (CPU uint8).
Stored = tuple[bytes | memoryview, torch.Tensor]


@dataclass(frozen=True, slots=True)
class ItemFormat:
    """What one stored item is: the codec it was encoded with, its shape and dtype."""

    codec: Codec
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def payload_size(self) -> int:
        return self.codec.payload_size(self.shape, self.dtype)

    @property
    def blob_size(self) -> int:
        """Bytes of one stored item: header plus payload."""
        return HEADER_SIZE + self.payload_size


#: An item to store: ``(key, slot, encoded payload, its format)``.
PutItem = tuple[int, int, torch.Tensor, ItemFormat]


@dataclass(frozen=True, slots=True)
class MediumCaps:
    """What a medium can do; the tier chain decides how to use it from these alone."""

    #: Reads and writes are slow I/O (files, network): they run on the transfer
    #: engine, from snapshots. ``False``: a memory copy, done inline.
    background: bool
    #: Blocks survive a restart of this process (:meth:`BlockStore.scan` finds them).
    persistent: bool = False
    #: Other processes may add blocks (:meth:`BlockStore.contains` asks the medium itself).
    shared: bool = False
    #: :meth:`BlockStore.purge` deletes a block for every user of the medium
    #: (``delete`` may leave a shared copy in place).
    purge: bool = False


class BlockStore(Protocol):
    """A storage medium for encoded blocks (host memory, a directory, Redis)."""

    #: Short name used in metrics and events: ``"host"``, ``"disk"``, ``"redis"``.
    name: str
    #: What the medium can do.
    caps: MediumCaps

    def bind(self, namespace: str, capacity: int, item_bytes: int | None = None) -> None:
        """Called once by the tier before any other call.

        ``namespace`` names this tier's keys where the medium is shared
        (model, layout, tenant); ``capacity`` is the number of slots;
        ``item_bytes`` the largest payload when every item has one size
        (a medium may preallocate), ``None`` for items of any size.
        """
        ...

    def put(self, items: Sequence[PutItem]) -> None:
        """Store encoded payloads ``(key, slot, payload, format)``; all or raise."""
        ...

    def get(self, items: Sequence[tuple[int, int]]) -> list[Stored | None]:
        """Read ``(key, slot)`` blocks back; ``None`` for one that is absent."""
        ...

    def delete(self, items: Sequence[tuple[int, int]]) -> None: ...

    def purge(self, items: Sequence[tuple[int, int]]) -> None:
        """Delete for every user of a shared medium (only called when ``caps.purge``)."""
        ...

    def contains(self, keys: Sequence[int]) -> list[bool]:
        """Whether the medium holds each key (shared media; others may answer False)."""
        ...

    def scan(self) -> list[int]:
        """Keys the medium holds now (persistent media; others return [])."""
        ...

    def close(self) -> None: ...


def pack_blob(fmt: ItemFormat, key: int, payload: torch.Tensor) -> bytes:
    """Header plus payload as one ``bytes`` value (for media that need ``bytes``)."""
    return bytes(blob_view(fmt, key, payload))


def stage(payload: torch.Tensor) -> torch.Tensor:
    """A snapshot of ``payload`` (on the CPU) with room for its header in front.

    The returned tensor is the copy of the payload; :func:`blob_view` later
    writes the header into the bytes before it and hands header and payload
    out as one buffer, so a medium that stores one value per block (a Redis
    string) sends it without another copy.
    """
    flat = payload.reshape(-1)
    blob = torch.empty(HEADER_SIZE + int(flat.numel()), dtype=torch.uint8)
    view = blob[HEADER_SIZE:]
    view.copy_(flat)
    vid = id(view)
    _staged[vid] = weakref.ref(blob)
    # Dropped with the view, before its id can be reused.
    weakref.finalize(view, _staged.pop, vid, None)
    return view


_staged: dict[int, weakref.ref[torch.Tensor]] = {}


def blob_view(fmt: ItemFormat, key: int, payload: torch.Tensor) -> memoryview:
    """Header plus payload as one contiguous buffer.

    A payload from :func:`stage` gets its header written in place (no copy);
    any other is copied once into a new buffer after its header.
    """
    ref = _staged.get(id(payload))
    blob = ref() if ref is not None else None
    if blob is not None and payload._base is blob:
        out = as_buffer(blob)
        out[:HEADER_SIZE] = make_header(fmt.codec, key, fmt.shape, fmt.dtype, payload)
        return out
    cpu = payload.cpu() if payload.device.type != "cpu" else payload
    data = as_buffer(cpu.reshape(-1))
    # torch.empty: no zero fill of bytes that are overwritten at once.
    out = as_buffer(torch.empty(HEADER_SIZE + len(data), dtype=torch.uint8))
    out[HEADER_SIZE:] = data
    out[:HEADER_SIZE] = pack_header(fmt.codec, key, fmt.shape, fmt.dtype, data)
    return out


def split_blob(blob: bytes | bytearray | memoryview) -> Stored:
    """The header and payload of a stored blob, without copying the payload."""
    view = memoryview(blob)
    if len(view) <= HEADER_SIZE:
        return view[:HEADER_SIZE], torch.empty(0, dtype=torch.uint8)
    return view[:HEADER_SIZE], torch.frombuffer(view, dtype=torch.uint8, offset=HEADER_SIZE)
