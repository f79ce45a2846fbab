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
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtier.errors import (
    ConfigError,
    InternalInvariantError,
    TierFullError,
    TierUnavailableError,
)
from kvtier.offload.codec import HEADER_SIZE, as_buffer, pack_header
from kvtier.offload.media import MediumCaps, PutItem, Stored

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


class DiskStore:
    """Encoded blocks as files under ``root``."""

    name = "disk"
    caps = MediumCaps(background=True, persistent=True)

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.root = Path(root)
        #: fsync each file before renaming it: survives power loss, at a large cost.
        self.fsync = fsync
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
