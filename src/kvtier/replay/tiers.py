"""A lower tier under the replay's device cache, with tier admission, in bookkeeping only.

:class:`ReplayTier` hangs an :class:`~kvtier.offload.OffloadingManager` of
``capacity`` blocks (managed by its own policy, LRU by default) under a
:class:`~kvtier.manager.KVCacheManager`, as a write-back tier of the tier
chain is: the blocks the device evicts are offered to a
:class:`~kvtier.offload.admission.TierAdmission`, and those it accepts are
stored (a block the tier already holds costs no write). A request's hit is
its device prefix continued block by block on the tier (the first key the
tier lacks ends it); the tier's blocks are then promoted: the request's
allocation makes them device blocks again, and the tier keeps its copy.

Counters: blocks offered, written and skipped, bytes written (blocks times
``block_bytes``), and blocks served from the tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.manager import KVCacheManager
from kvtier.offload.admission import ADMISSIONS, TierAdmission, make_admission
from kvtier.offload.manager import OffloadingManager

#: KV bytes of one 512-token block when none is given: a 70B GQA model in bf16
#: (80 layers, 8 KV heads of 128, K and V), as the cluster replay assumes.
DEFAULT_BLOCK_BYTES = 512 * 2 * 80 * 8 * 128 * 2


@dataclass(slots=True)
class TierCounters:
    """What a replay's lower tier saw."""

    capacity_blocks: int = 0
    admission: str = "write-all"
    offered_blocks: int = 0
    written_blocks: int = 0
    skipped_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0
    block_bytes: int = DEFAULT_BLOCK_BYTES
    #: Distinct keys ever written, and how many of them were ever hit.
    distinct_written: int = 0
    distinct_hit: int = 0

    @property
    def bytes_written(self) -> int:
        return self.written_blocks * self.block_bytes

    @property
    def bytes_per_hit(self) -> float:
        """Bytes written per block served from the tier (inf with no hit)."""
        return self.bytes_written / self.hit_blocks if self.hit_blocks else float("inf")

    @property
    def writes_per_hit(self) -> float:
        return self.written_blocks / self.hit_blocks if self.hit_blocks else float("inf")


class ReplayTier:
    """A write-back tier of ``capacity`` blocks under ``manager`` (see the module docs)."""

    def __init__(
        self,
        manager: KVCacheManager,
        capacity: int,
        clock: Callable[[], float],
        *,
        admission: str = "write-all",
        policy: str = "lru",
        block_bytes: int | None = None,
        threshold: float | None = None,
    ) -> None:
        block_bytes = DEFAULT_BLOCK_BYTES if block_bytes is None else block_bytes
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ConfigError(f"--tier-blocks must be a positive number, got {capacity!r}")
        if admission not in ADMISSIONS:
            raise ConfigError(
                f"unknown tier admission {admission!r}; choose one of {', '.join(ADMISSIONS)}"
            )
        self.manager = manager
        self.clock = clock
        self.tier = OffloadingManager(
            capacity, policy, medium="tier", enable_events=False, clock=clock
        )
        self.admission: TierAdmission = make_admission(
            admission,
            manager.policy,
            capacity_bytes=capacity * block_bytes,
            typical_size=block_bytes,
            threshold=threshold,
        )
        self.counters = TierCounters(capacity, admission, block_bytes=block_bytes)
        self._ever_written: set[int] = set()
        self._ever_hit: set[int] = set()
        manager.add_evict_listener(self._on_evict)

    def _on_evict(self, keys: list[int], blocks: list[int]) -> None:
        parents = self.manager.pool.parent_keys(blocks)
        size = self.counters.block_bytes
        now = self.clock()
        write = self.admission.decide(keys, parents, [size] * len(keys), now)
        chosen = [k for k, ok in zip(keys, write, strict=True) if ok]
        c = self.counters
        c.offered_blocks += len(keys)
        c.skipped_blocks += len(keys) - len(chosen)
        if chosen:
            self._store(chosen, now)

    def _store(self, keys: list[int], now: float) -> None:
        tier = self.tier
        out = tier.prepare_store(keys)
        kept = len(keys)
        # More than the tier holds at once: the parents (last in the batch) first.
        while out is None and kept > 1:
            kept //= 2
            out = tier.prepare_store(keys[-kept:])
        if out is None:
            return
        c = self.counters
        if out.evicted_keys:
            c.evicted_blocks += len(out.evicted_keys)
            self.admission.left(out.evicted_keys)
        if out.keys_to_store:
            tier.complete_store(out.keys_to_store)
            c.written_blocks += len(out.keys_to_store)
            self.admission.stored(out.keys_to_store, now)
            self._ever_written.update(out.keys_to_store)
            c.distinct_written = len(self._ever_written)

    def serve(self, keys: Sequence[int], start: int, limit: int) -> int:
        """Blocks of ``keys[start:limit]`` the tier serves after a device prefix of ``start``.

        The caller counts them (:meth:`served`) once the request is admitted.
        """
        if start >= limit:
            return 0
        tier = self.tier
        n = 0
        i = start
        while i < limit and tier.is_ready(keys[i]):
            n += 1
            i += 1
        if i < limit:
            self.admission.missed(keys[i])
        if n:
            hit = keys[start:i]
            tier.touch(hit)
            self.admission.hit(hit)
            self._ever_hit.update(hit)
            self.counters.distinct_hit = len(self._ever_hit)
        return n

    def served(self, blocks: int, block_size: int) -> None:
        """Count ``blocks`` served from the tier to a request the device admitted."""
        c = self.counters
        c.hit_blocks += blocks
        c.hit_tokens += blocks * block_size
