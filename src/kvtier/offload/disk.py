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
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from kvtier.errors import ConfigError, InternalInvariantError, TierUnavailableError
from kvtier.offload.codec import as_buffer, make_header
from kvtier.offload.media import MediumCaps, PutItem, Stored, split_blob

_SUFFIX = ".kvb"

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
        name = f"{key:032x}"
        return self._dir / name[:2] / (name + _SUFFIX)

    def put(self, items: Sequence[PutItem]) -> None:
        if not self._bound:
            raise InternalInvariantError("DiskStore used before bind()")
        for key, _slot, payload, fmt in items:
            cpu = payload.cpu() if payload.device.type != "cpu" else payload
            header = make_header(fmt.codec, key, fmt.shape, fmt.dtype, cpu)
            final = self.path(key)
            tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
            try:
                if not final.parent.is_dir():
                    self._make_dir(final.parent)
                with open(tmp, "wb") as f:
                    f.write(header)
                    f.write(as_buffer(cpu))
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, final)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    tmp.unlink()
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
            try:
                with open(self.path(key), "rb", buffering=0) as f:
                    # Read straight into the buffer kept (f.read() and a bytearray of
                    # it would copy every block twice).
                    blob = bytearray(os.fstat(f.fileno()).st_size)
                    got = f.readinto(blob)
                    if got is not None and got < len(blob):
                        del blob[got:]  # shrank while read: the checksum will tell
            except FileNotFoundError:
                out.append(None)
                continue
            except OSError as exc:
                raise TierUnavailableError(
                    f"cannot read block file {self.path(key)}: {exc}"
                ) from None
            out.append(split_blob(blob))
        return out

    def delete(self, items: Sequence[tuple[int, int]]) -> None:
        for key, _slot in items:
            with contextlib.suppress(FileNotFoundError):
                self.path(key).unlink()

    def purge(self, items: Sequence[tuple[int, int]]) -> None:
        self.delete(items)  # nobody else reads this medium

    def contains(self, keys: Sequence[int]) -> list[bool]:
        return [self.path(k).is_file() for k in keys]

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
