"""One kvtier tier for engines that call their storage from their own I/O threads.

SGLang's hierarchical cache and llama.cpp's prompt cache ask their storage
synchronously (from a prefetch or backup thread, or between requests): does
it hold these keys, read them into my memory, write these. :class:`SyncTier`
answers with a kvtier medium and a kvtier policy bounding its size:

* :meth:`present`: how many leading keys the tier holds. A shared medium
  (Redis) is asked about the keys this process does not know, and what it
  holds is adopted; a persistent medium (disk) was scanned when the tier
  was built, so a restarted engine finds its pages again;
* :meth:`read`: pins the keys, reads them, and hands each stored item to
  the caller's ``fill``, which verifies it (header, key, shape, checksum)
  and copies it out. A damaged item (``fill`` raises
  :class:`~kvtier.CorruptBlockError`) or a vanished one is dropped from the
  bookkeeping (a damaged one from the medium too) and reads as absent;
* :meth:`write`: reserves room for the keys not held (the policy evicts; when
  not all fit, the longest leading run that does), deletes what was evicted
  and writes the rest.

A medium that cannot be reached (:class:`~kvtier.TierUnavailableError`)
makes the call report nothing held, read or written, and the tier is not
asked again for ``retry_interval_s``. The bookkeeping is under one lock;
medium I/O runs outside it, so several threads may read and write at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError, CorruptBlockError, TierUnavailableError
from kvtier.offload.config import TierSpec
from kvtier.offload.core import TierCore, drop_items
from kvtier.offload.manager import OffloadingManager, PrepareStoreOutput
from kvtier.offload.media import BlockStore, PutItem, Stored
from kvtier.offload.registry import make_medium

log = logging.getLogger("kvtier.integrations")


def reserve_leading(
    manager: OffloadingManager, keys: list[int]
) -> tuple[PrepareStoreOutput | None, int]:
    """``manager.prepare_store`` for the longest leading run of ``keys`` there is room for,
    and the run's length (a block is useless without the ones before it)."""
    out = manager.prepare_store(keys)
    if out is not None:
        return out, len(keys)
    # Room: free slots plus evictable keys, less the keys of the run already held
    # (they are protected while victims are chosen).
    room = manager.num_free + manager.policy.num_evictable
    new = held = n = 0
    seen: set[int] = set()
    for key in keys:
        if key not in seen:
            seen.add(key)
            if key not in manager:
                new += 1
            elif manager.is_ready(key) and not manager.is_pinned(key):
                held += 1
        if new > room - held:
            break
        n += 1
    out = manager.prepare_store(keys[:n]) if n else None
    return out, n if out is not None else 0


@dataclass
class SyncTierCounters:
    """What a :class:`SyncTier` did."""

    stored: int = 0
    loaded: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt: int = 0
    vanished: int = 0
    unavailable: int = 0
    adopted: int = 0
    #: Items a write could not make room for.
    refused: int = 0


class SyncTier(TierCore):
    """A medium bound to ``namespace`` with ``capacity`` items, evicted by ``spec.policy``."""

    def __init__(
        self,
        spec: TierSpec,
        namespace: str,
        capacity: int,
        item_bytes: int | None = None,
        *,
        retry_interval_s: float = 1.0,
    ) -> None:
        if capacity < 1:
            raise ConfigError(
                f"the {spec.medium} tier's {spec.size_bytes:,} bytes hold no item: give it a "
                "larger size="
            )
        medium: BlockStore = make_medium(spec.medium, spec.location, dict(spec.options))
        super().__init__(
            medium,
            capacity,
            spec.policy,
            name=spec.medium,
            enable_events=False,
            retry_interval_s=retry_interval_s,
        )
        self.spec = spec
        self.namespace = namespace
        medium.bind(namespace, capacity, item_bytes)
        self.counters = SyncTierCounters()
        self._lock = threading.Lock()
        if medium.caps.persistent:
            with self._lock:
                self.counters.adopted += self.adopt_scan()

    def _failed(self, exc: TierUnavailableError) -> None:
        with self._lock:
            self.counters.unavailable += 1
            self.health.failed(exc)

    # -- the three calls ----------------------------------------------------------------------
    def present(self, ids: Sequence[int]) -> int:
        """How many leading ``ids`` the tier holds (asking a shared medium about the rest)."""
        if not ids or not self.available:
            return 0
        with self._lock:
            n = self.offload_manager.lookup(ids) or 0
        if n == len(ids) or not self.medium.caps.shared:
            return n
        with self._lock:
            adopted = self.adopt_present(ids[n:])
            if adopted is None:
                self.counters.unavailable += 1
                return n
            self.health.answered()
            self.counters.adopted += adopted
        return n + adopted

    def read(self, ids: Sequence[int], fill: Callable[[int, Stored], None]) -> list[bool]:
        """Read the held ``ids``; ``fill(i, stored)`` checks and copies item ``i`` out.

        Returns which were read. ``fill`` raises :class:`CorruptBlockError` for
        an item that fails its checks.
        """
        ok = [False] * len(ids)
        if not ids or not self.available:
            return ok
        manager = self.offload_manager
        pinned: list[tuple[int, int, int]] = []  # (index, key, slot)
        with self._lock:
            for i, kid in enumerate(ids):
                if manager.is_ready(kid):
                    manager.prepare_load((kid,))
                    pinned.append((i, kid, manager.slot_of(kid)))
            manager.touch([kid for _, kid, _ in pinned])
        if not pinned:
            return ok
        bad: list[tuple[int, int]] = []
        corrupt: list[tuple[int, int]] = []
        try:
            stored = self.medium.get([(kid, slot) for _, kid, slot in pinned])
            for (i, kid, slot), item in zip(pinned, stored, strict=True):
                if item is None:
                    self.counters.vanished += 1
                    bad.append((kid, slot))
                    continue
                try:
                    fill(i, item)
                except CorruptBlockError as exc:
                    log.warning("the %s tier: %s; dropping it", self.spec.medium, str(exc))
                    self.counters.corrupt += 1
                    corrupt.append((kid, slot))
                    continue
                ok[i] = True
                self.counters.loaded += 1
                self.counters.bytes_read += int(item[1].numel())
        except TierUnavailableError as exc:
            self._failed(exc)
        finally:
            with self._lock:
                manager.complete_load([kid for _, kid, _ in pinned])
                manager.remove([kid for kid, _ in bad + corrupt])
        # A damaged item is purged for every process sharing the medium.
        drop_items(self.medium, corrupt, self.health, everywhere=True)
        return ok

    def write(self, ids: Sequence[int], item: Callable[[int], PutItem]) -> list[bool]:
        """Store the ``ids`` not held; ``item(i)`` builds ``(key, slot, payload, format)``
        for index ``i`` (its slot is replaced by the one reserved). Returns which are held
        afterwards."""
        held = [False] * len(ids)
        if not ids or not self.available:
            return held
        manager = self.offload_manager
        keys = list(ids)
        with self._lock:
            out, n = reserve_leading(manager, keys)
            if out is None:
                self.counters.refused += len(keys)
                return held
            self.counters.refused += len(keys) - n
            writing = dict(zip(out.keys_to_store, out.slots, strict=True))
            for i, kid in enumerate(keys[:n]):
                held[i] = kid not in writing and manager.is_ready(kid)
        index: dict[int, int] = {}
        for i, kid in enumerate(keys):
            index.setdefault(kid, i)
        success = False
        try:
            if out.evicted_keys:
                self.medium.delete(list(zip(out.evicted_keys, out.evicted_slots, strict=True)))
            items: list[PutItem] = []
            for kid, slot in writing.items():
                key, _, payload, fmt = item(index[kid])
                items.append((key, slot, payload, fmt))
            if items:
                self.medium.put(items)
            success = True
        except TierUnavailableError as exc:
            self._failed(exc)
        finally:
            with self._lock:
                manager.complete_store(list(writing), success=success)
        if success:
            for i, kid in enumerate(keys[:n]):
                if kid in writing:
                    held[i] = True  # every place the key is asked at
            self.counters.stored += len(writing)
            self.counters.bytes_written += sum(int(p.numel()) for _, _, p, _ in items)
        return held

    def forget(self, ids: Sequence[int]) -> None:
        """Drop ``ids`` (not being read or written), from the medium too."""
        self._drop(list(ids))

    def clear(self) -> None:
        """Drop every item not being read or written, from the medium too."""
        with self._lock:
            ready = self.offload_manager.ready_keys()
        self._drop(ready)

    def _drop(self, ids: list[int]) -> None:
        with self._lock:
            self.drop(ids, bad=True)
