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

import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.offload.codec import (
    HEADER_SIZE,
    Codec,
    as_buffer,
    copy_checksum,
    header_for,
    make_header,
    pack_header,
    payload_checksum,
)

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
    #: Its bytes are this process's own memory (host or device tensors): nothing
    #: outside the process writes them, so its payloads may be stored unchecked
    #: (:data:`~kvtier.offload.codec.FLAG_UNCHECKED`) and are read back as such.
    in_process: bool = False


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
        """Store encoded payloads ``(key, slot, payload, format)``; all or raise.

        The payloads are the caller's: a medium copies what it keeps (staged
        snapshots are reused once the write that got them has returned).
        """
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


class ReadsInto(Protocol):
    """A medium that can read a block straight into memory the caller owns (a file).

    Where the device blocks are in host memory the tier chain uses this
    instead of :meth:`BlockStore.get`: a load's background step only calls
    :meth:`prefetch`, and verifying the load reads each block with
    :meth:`read_into` into its device block (the header into a small buffer),
    so the payload is copied once, and checked where it landed.
    """

    #: Whether loads defer their reads to :meth:`read_into` (the chain turns it off
    #: when its device blocks are not in host memory).
    defer_reads: bool

    def prefetch(self, items: Sequence[tuple[int, int]]) -> None:
        """Start fetching these items (returns at once; absent ones are skipped)."""
        ...

    def read_into(
        self,
        key: int,
        slot: int,
        bufs: Sequence[memoryview],
        *,
        chunk: int = 0,
        on_chunk: Callable[[memoryview], object] | None = None,
    ) -> int | None:
        """Read item ``key`` (header then payload) into ``bufs`` in order; bytes read,
        ``None`` when absent. With ``on_chunk``, each ``chunk`` bytes of ``bufs[1]``
        are handed to it as they come in."""
        ...


def pack_blob(fmt: ItemFormat, key: int, payload: torch.Tensor) -> bytes:
    """Header plus payload as one ``bytes`` value (for media that need ``bytes``)."""
    return bytes(blob_view(fmt, key, payload))


def stage(
    payload: torch.Tensor, key: int | None = None, fmt: ItemFormat | None = None
) -> torch.Tensor:
    """A snapshot of ``payload`` (on the CPU) with room for its header in front.

    The returned tensor is the copy of the payload; :func:`blob_view` later
    writes the header into the bytes before it and hands header and payload
    out as one buffer, so a medium that stores one value per block (a Redis
    string, a file) writes it without another copy. Given the block's
    ``key`` and ``fmt``, the header is written now, the payload hashed as it
    is copied (:func:`~kvtier.offload.codec.copy_checksum`): the background
    write then neither hashes nor copies.
    """
    flat = payload.reshape(-1)
    n = int(flat.numel())
    blob = _take_blob(HEADER_SIZE + n)
    view = blob[HEADER_SIZE:]
    headed: tuple[int, ItemFormat] | None = None
    if key is not None and fmt is not None:
        if flat.device.type == "cpu":
            checksum = copy_checksum(key, flat, view)
        else:
            view.copy_(flat)
            checksum = payload_checksum(key, as_buffer(view))
        header = header_for(fmt.codec, key, fmt.shape, fmt.dtype, n, checksum)
        as_buffer(blob)[:HEADER_SIZE] = header
        headed = (key, fmt)
    else:
        view.copy_(flat)
    vid = id(view)
    _staged[vid] = (weakref.ref(blob), headed)
    # Dropped with the view, before its id can be reused; the buffer is then reused.
    weakref.finalize(view, _release_blob, vid, blob)
    return view


#: Staged views (by id): their buffer, and the key and format whose header is in it.
_staged: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, ItemFormat] | None]] = {}

#: Bytes of staging buffers kept for reuse once their snapshot is written: a fresh
#: buffer faults its pages in as it is filled, which costs about as much as the copy.
STAGE_POOL_BYTES = 256 << 20
_free_blobs: dict[int, list[torch.Tensor]] = {}
_free_bytes = 0
_free_lock = threading.Lock()


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s memory (a large number where torch cannot tell)."""
    try:
        return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))
    except (AttributeError, RuntimeError):
        return 1 << 30


# What the count says of a buffer that only its own tensor uses.
_ALONE = _storage_users(torch.empty(1, dtype=torch.uint8))


def _take_blob(size: int) -> torch.Tensor:
    """A staging buffer of ``size`` bytes: a pooled one when there is one (not zeroed)."""
    global _free_bytes
    with _free_lock:
        free = _free_blobs.get(size)
        if free:
            _free_bytes -= size
            return free.pop()
    return torch.empty(size, dtype=torch.uint8)


def _release_blob(vid: int, blob: torch.Tensor) -> None:
    """The staged view ``vid`` of ``blob`` is gone: keep ``blob`` for the next snapshot."""
    global _free_bytes
    _staged.pop(vid, None)
    # The dying view still counts here. A buffer any other tensor still shares
    # (a medium that kept a view of its payload) is left to the allocator.
    if _storage_users(blob) > _ALONE + 1:
        return
    size = int(blob.numel())
    with _free_lock:
        if _free_bytes + size > STAGE_POOL_BYTES:
            return
        _free_blobs.setdefault(size, []).append(blob)
        _free_bytes += size


def drop_staging_pool() -> int:
    """Free the staging buffers kept for reuse; returns the bytes freed."""
    global _free_bytes
    with _free_lock:
        freed, _free_bytes = _free_bytes, 0
        _free_blobs.clear()
    return freed


def staged_blob(fmt: ItemFormat, key: int, payload: torch.Tensor) -> memoryview | None:
    """Header plus payload as one buffer when ``payload`` came from :func:`stage`
    (its header written in place if :func:`stage` did not already); else ``None``."""
    entry = _staged.get(id(payload))
    blob = entry[0]() if entry is not None else None
    if blob is None or payload._base is not blob:
        return None
    out = as_buffer(blob)
    assert entry is not None
    if entry[1] != (key, fmt):
        out[:HEADER_SIZE] = make_header(fmt.codec, key, fmt.shape, fmt.dtype, payload)
    return out


def blob_view(fmt: ItemFormat, key: int, payload: torch.Tensor) -> memoryview:
    """Header plus payload as one contiguous buffer.

    A payload from :func:`stage` comes with its header in place (no copy);
    any other is copied once into a new buffer after its header.
    """
    staged = staged_blob(fmt, key, payload)
    if staged is not None:
        return staged
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
