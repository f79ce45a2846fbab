"""One level of the tier chain: a tier core with a codec, a write mode and counters.

A :class:`Tier` is a :class:`~kvtier.offload.core.TierCore` (medium, offloading
manager, health) plus what the chain needs to move device blocks: the codec
its blocks are stored in, the item format the chain binds it to, whether it
takes blocks as they are computed (write-through) or as the level above
evicts them (write-back), whether its payloads carry checksums, and the
counters exported as metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.errors import ConfigError
from kvtier.offload.codec import Codec, make_codec
from kvtier.offload.core import TierCore
from kvtier.offload.media import BlockStore, ItemFormat
from kvtier.policy.base import EvictionPolicy

WriteMode = Literal["write_back", "write_through"]
WRITE_MODES: tuple[str, ...] = ("write_back", "write_through")


@dataclass
class TierCounters:
    """What one tier did; exported as metrics."""

    lookups: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    store_failures: int = 0
    #: Blocks the device evicted that this tier had no room for (lost).
    dropped_blocks: int = 0
    corrupt_blocks: int = 0
    #: Blocks the tier's bookkeeping had but the medium did not (a server evicted them).
    vanished_blocks: int = 0
    adopted_blocks: int = 0
    #: Keys the bookkeeping held that reconciliation found missing from the medium.
    reconciled_blocks: int = 0
    #: Blocks freed because nothing will read them again (an ended session's own).
    released_blocks: int = 0
    #: Seconds spent encoding blocks for this tier, and decoding them back (int8/fp8
    #: codecs; raw payloads are copies and count in neither).
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    #: Calls of :meth:`TierChain.compress` that moved blocks here.
    compressed_requests: int = 0


class Tier(TierCore):
    """One storage level below the device: medium + codec + offloading manager."""

    def __init__(
        self,
        store: BlockStore,
        capacity_blocks: int,
        *,
        policy: str | EvictionPolicy = "lru",
        codec: str | Codec = "raw",
        name: str | None = None,
        write_mode: str | None = None,
        checksums: bool | None = None,
    ) -> None:
        super().__init__(store, capacity_blocks, policy, name=name)
        in_process = store.caps.in_process
        if checksums is None:
            # A checksum guards what another process, a disk or a network may damage;
            # the process's own memory is as safe as the device's blocks are.
            checksums = not in_process
        if not checksums and not in_process:
            raise ConfigError(
                f"the {store.name} medium leaves this process: its payloads keep their checksums"
            )
        #: Whether this tier's payloads carry checksums (off: an in-process medium, unchecked).
        self.checksums = checksums
        if hasattr(store, "checksums"):
            store.checksums = checksums
        self.codec = make_codec(codec)
        self.counters = TierCounters()
        #: The format of this tier's blocks (set when the chain binds it).
        self.fmt: ItemFormat | None = None
        #: ``"write_back"`` or ``"write_through"`` (default: through for shared media).
        self.write_mode: WriteMode = write_mode_of(
            write_mode, "write_through" if store.caps.shared else "write_back"
        )

    @property
    def writes_back(self) -> bool:
        return self.write_mode == "write_back"

    def __repr__(self) -> str:
        return (
            f"Tier({self.name}, {len(self.offload_manager)}/{self.capacity} blocks, "
            f"codec={self.codec.name}, policy={self.offload_manager.policy.name}, "
            f"{self.write_mode})"
        )


def write_mode_of(mode: str | None, default: WriteMode) -> WriteMode:
    """``mode`` checked (``None``: ``default``); ConfigError for an unknown one."""
    if mode is None:
        return default
    if mode not in WRITE_MODES:
        raise ConfigError(f"write_mode must be one of {', '.join(WRITE_MODES)}, got {mode!r}")
    return "write_back" if mode == "write_back" else "write_through"
