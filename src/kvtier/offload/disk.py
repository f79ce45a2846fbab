"""Local-disk tier medium: one file per block in a directory that outlives the process.

A block is written to a temporary file in the same directory and renamed
into place, so a crash mid-write leaves at most a stray temporary file
(removed on the next start), never a partial block under a real name; the
header's checksum catches whatever else goes wrong on the disk. A new process
pointed at the same directory finds the blocks again (:meth:`DiskStore.scan`).
A directory removed while the process runs is created again on the next
write (the blocks in it are gone; the tier chain's reconciliation drops
them from its bookkeeping).
Files live under ``<root>/<namespace>/<2 hex digits>/<key>.kvb`` so one
directory can serve several models and no directory grows huge.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvtier.errors import (
    ConfigError,
    InternalInvariantError,
    TierFullError,
    TierUnavailableError,
)
from kvtier.offload.codec import HEADER_SIZE, as_buffer, pack_header
from kvtier.offload.media import MediumCaps, PutItem, Stored, staged_blob

_SUFFIX = ".kvb"
#: Write errors that mean "no room" (a full disk, a quota, a file-size limit), not "gone".
_NO_ROOM = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC


def _write_all(fd: int, header: bytes, data: memoryview) -> None:
    """Write ``header`` then ``data`` to ``fd``, resuming after short writes."""
    size = len(header) + len(data)
    done = os.writev(fd, [header, data])
    while done < size:
        if done < len(header):
            done += os.writev(fd, [header[done:], data])
        else:
            done += os.write(fd, data[done - len(header) :])


def _read_streamed(
    fd: int, bufs: Sequence[memoryview], chunk: int, on_chunk: Callable[[memoryview], object]
) -> int:
    """:meth:`DiskStore.read_into` a chunk of ``bufs[1]`` at a time; stops at a short read."""
    head, body, rest = bufs[0], bufs[1], list(bufs[2:])
    piece = body[:chunk]
    got = os.readv(fd, [head, piece])
    if got < len(head) + len(piece):
        if got > len(head):
            on_chunk(piece[: got - len(head)])
        return got
    on_chunk(piece)
    for at in range(len(piece), len(body), chunk):
        piece = body[at : at + chunk]
        n = os.readv(fd, [piece])
        got += n
        if n < len(piece):
            if n:
                on_chunk(piece[:n])
            return got
        on_chunk(piece)
    return got + (os.readv(fd, rest) if rest else 0)


def _read_all(fd: int, buf: memoryview) -> int:
    """Fill ``buf`` from ``fd`` (fewer bytes only at the end of the file); bytes read."""
    got = 0
    while got < len(buf):
        n = os.readv(fd, [buf[got:]])
        if n == 0:
            break
        got += n
    return got


log = logging.getLogger("kvtier.offload")

_advisor_pool: ThreadPoolExecutor | None = None
_advisor_lock = threading.Lock()


def _advisor() -> ThreadPoolExecutor:
    """The thread that asks the kernel to read files ahead (:meth:`DiskStore.prefetch`)."""
    global _advisor_pool
    with _advisor_lock:
        if _advisor_pool is None:
            _advisor_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-readahead")
        return _advisor_pool


def _forget_advisor() -> None:
    # A forked child has none of the parent's threads: it starts its own.
    global _advisor_pool
    _advisor_pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_advisor)


class DiskStore:
    """Encoded blocks as files under ``root``."""

    name = "disk"
    caps = MediumCaps(background=True, persistent=True)

    def __init__(
        self, root: str | os.PathLike[str], *, fsync: bool = False, direct_reads: bool = False
    ) -> None:
        self.root = Path(root)
        #: fsync each file before renaming it: survives power loss, at a large cost.
        self.fsync = fsync
        #: With ``direct_reads``, a load's background step only asks the kernel to
        #: read the files ahead (:meth:`prefetch`) and the load reads each one
        #: straight into its device block (:meth:`read_into`): one copy, 2-3x the
        #: throughput when the files are in the page cache, but the read runs on
        #: the thread that installs the load (the engine's), so a slow disk holds
        #: up every other request's step. Off by default: the background step
        #: reads the files whole (:meth:`get`) and the engine only copies. The
        #: tier chain also turns it off for device blocks outside host memory,
        #: which a read cannot fill directly.
        self.defer_reads = direct_reads
        self._dir = self.root
        self._bound = False
        self._lost_logged = False

    def bind(self, namespace: str, capacity: int, item_bytes: int | None = None) -> None:
        self._bound = True
        self._dir = self.root / namespace
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the disk tier directory {self._dir}: {exc}") from None
        # Temporary files of writes a crash interrupted.
        for tmp in self._dir.glob("*/*.tmp*"):
            with contextlib.suppress(OSError):
                tmp.unlink()

    def path(self, key: int) -> Path:
        return Path(self._file(key))

    def _file(self, key: int) -> str:
        name = f"{key:032x}"
        return f"{self._dir}/{name[:2]}/{name}{_SUFFIX}"

    def put(self, items: Sequence[PutItem]) -> None:
        if not self._bound:
            raise InternalInvariantError("DiskStore used before bind()")
        pid = os.getpid()
        for key, _slot, payload, fmt in items:
            # A staged snapshot has its header in front of it already: one buffer.
            blob = staged_blob(fmt, key, payload)
            if blob is not None:
                header, data = b"", blob
            else:
                cpu = payload.cpu() if payload.device.type != "cpu" else payload
                data = as_buffer(cpu.reshape(-1))
                header = pack_header(fmt.codec, key, fmt.shape, fmt.dtype, data)
            final = self._file(key)
            tmp = f"{final}.tmp{pid}"
            try:
                try:
                    fd = os.open(tmp, _WRITE_FLAGS, 0o666)
                except FileNotFoundError:
                    self._make_dir(Path(final).parent)
                    fd = os.open(tmp, _WRITE_FLAGS, 0o666)
                try:
                    # Header and payload in one system call, neither copied into the other.
                    _write_all(fd, header, data)
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, final)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                if exc.errno in _NO_ROOM:
                    raise TierFullError(
                        f"cannot write block file {final}: {exc}; free space on that disk, "
                        "raise its quota or file-size limit, or give the tier a smaller size="
                    ) from None
                raise TierUnavailableError(
                    f"cannot write block file {final}: {exc}; check the disk tier's space "
                    "and permissions"
                ) from None

    def _make_dir(self, subdir: Path) -> None:
        if not self._dir.is_dir() and not self._lost_logged:
            self._lost_logged = True  # once, however many writes fail to recreate it
            log.warning(
                "the disk tier directory %s disappeared; creating it again (the blocks it "
                "held are lost and will be recomputed)",
                self._dir,
            )
        subdir.mkdir(parents=True, exist_ok=True)
        self._lost_logged = False

    def get(self, items: Sequence[tuple[int, int]]) -> list[Stored | None]:
        out: list[Stored | None] = []
        for key, _slot in items:
            path = self._file(key)
            try:
                fd = os.open(path, _READ_FLAGS)
            except FileNotFoundError:
                out.append(None)
                continue
            except OSError as exc:
                raise TierUnavailableError(f"cannot read block file {path}: {exc}") from None
            try:
                # Straight into the buffer kept (torch.empty: no zero fill first).
                buf = torch.empty(os.fstat(fd).st_size, dtype=torch.uint8)
                got = _read_all(fd, as_buffer(buf))
            except OSError as exc:
                raise TierUnavailableError(f"cannot read block file {path}: {exc}") from None
            finally:
                os.close(fd)
            # A file that shrank while read comes back short: the checksum will tell.
            out.append((bytes(as_buffer(buf[: min(got, HEADER_SIZE)])), buf[HEADER_SIZE:got]))
        return out

    def prefetch(self, items: Sequence[tuple[int, int]]) -> None:
        """Ask the kernel to start reading these blocks' files into the page cache.

        Returns at once: a thread of this module asks for each file in turn
        (``posix_fadvise`` WILLNEED), running ahead of the reads that follow;
        files that are absent or unreadable are skipped, :meth:`read_into`
        reports them.
        """
        if getattr(os, "posix_fadvise", None) is None:
            return  # not on Linux: the read itself fetches the file
        _advisor().submit(self._advise, [self._file(key) for key, _ in items])

    @staticmethod
    def _advise(paths: list[str]) -> None:
        for path in paths:
            try:
                fd = os.open(path, _READ_FLAGS)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def read_into(
        self,
        key: int,
        slot: int,
        bufs: Sequence[memoryview],
        *,
        chunk: int = 0,
        on_chunk: Callable[[memoryview], object] | None = None,
    ) -> int | None:
        """Read block ``key``'s file into ``bufs`` in order (no other copy).

        Returns the bytes read, or ``None`` when the file is absent. Fewer bytes
        than the buffers hold mean a shorter file (or, rarely, a read the kernel
        cut short); a file longer than the buffers is left unread past them. The
        caller checks what it got (:func:`~kvtier.offload.codec.check_header`,
        the checksum) and reads the file whole (:meth:`get`) when that fails.

        With ``on_chunk``, ``bufs[1]`` (the payload) is read ``chunk`` bytes at
        a time and each piece is handed to ``on_chunk`` as soon as it is in,
        while it is still in cache (to hash it); otherwise one ``readv`` reads
        everything.
        """
        path = self._file(key)
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TierUnavailableError(f"cannot read block file {path}: {exc}") from None
        try:
            if on_chunk is None or chunk <= 0 or len(bufs) < 2:
                return os.readv(fd, bufs)
            return _read_streamed(fd, bufs, chunk, on_chunk)
        except OSError as exc:
            raise TierUnavailableError(f"cannot read block file {path}: {exc}") from None
        finally:
            os.close(fd)

    def delete(self, items: Sequence[tuple[int, int]]) -> None:
        for key, _slot in items:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file(key))

    def purge(self, items: Sequence[tuple[int, int]]) -> None:
        self.delete(items)  # nobody else reads this medium

    def contains(self, keys: Sequence[int]) -> list[bool]:
        return [os.path.isfile(self._file(k)) for k in keys]

    def scan(self) -> list[int]:
        """Keys of the block files present, oldest modification first."""
        found: list[tuple[float, int]] = []
        for p in self._dir.glob(f"*/*{_SUFFIX}"):
            try:
                found.append((p.stat().st_mtime, int(p.stem, 16)))
            except (OSError, ValueError):
                continue
        found.sort()
        return [k for _, k in found]

    def close(self) -> None:
        pass
