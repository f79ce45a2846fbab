"""The tier core: one medium under a bookkeeper, with one failure policy.

Every place kvtier keeps data below the device — the tier chain's tiers, the
integrations' synchronous tier (SGLang, llama.cpp), vLLM's secondary tier and
the encoder-output tier — is the same idea: a :class:`~kvtier.offload.media.BlockStore`
medium, bookkeeping of what it holds, a way to adopt what another process (or
an earlier run) left there, and verify-and-drop for what comes back damaged.
This module is that idea, written once:

* :class:`TierHealth` is the failure policy. A medium that cannot be reached
  is counted, logged once when the outage starts and once when it ends (not
  per failure), and skipped for ``retry_interval_s`` so a dead server does not
  cost a timeout per request. When it answers again the owner is told, so it
  can reconcile what the medium lost meanwhile.
* :class:`TierCore` is a medium with an
  :class:`~kvtier.offload.manager.OffloadingManager` over fixed-size slots:
  adopting a persistent medium's items at start, adopting the leading run of
  keys a shared medium holds, dropping bad items (from the medium too, for
  everyone when it is shared) and reconciling the bookkeeping with the medium.

The encoder-output tier keeps variable-size items under a byte-budget policy
rather than slots, so it uses :class:`TierHealth` and :func:`drop_items` and
not the slot bookkeeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvtier.errors import KvTierError, TierFullError, TierUnavailableError
from kvtier.obs.episodes import Episodes
from kvtier.offload.manager import OffloadingManager
from kvtier.offload.media import BlockStore
from kvtier.policy.base import EvictionPolicy

log = logging.getLogger("kvtier.offload")


class TierHealth:
    """Whether a medium answers; the one failure policy every tier shares.

    ``retry_interval_s`` is how long a medium that failed is skipped
    (:attr:`available` is false meanwhile); 0 asks it again at once, for
    media that fail fast on their own (the Redis medium has its own retry
    interval). ``episodes`` lets several tiers log through one
    :class:`~kvtier.obs.episodes.Episodes` (a chain's).
    """

    def __init__(
        self,
        name: str,
        *,
        retry_interval_s: float = 0.0,
        episodes: Episodes | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.name = name
        self.retry_interval_s = float(retry_interval_s)
        self.episodes = episodes if episodes is not None else Episodes(logger or log)
        #: Calls that found the medium unreachable (or failing).
        self.unavailable = 0
        self._down_until = 0.0

    @property
    def available(self) -> bool:
        """False while a failed medium is being skipped."""
        return self.retry_interval_s <= 0 or time.monotonic() >= self._down_until

    @property
    def down(self) -> bool:
        """Whether an outage is in progress (logged, not yet over)."""
        return self.episodes.active(self._key)

    @property
    def _key(self) -> str:
        return f"{self.name}:unreachable"

    def failed(self, exc: BaseException | None) -> None:
        """The medium could not be reached (or failed): count, skip it a while, log once.

        A full medium (:class:`~kvtier.errors.TierFullError`) is a store failure, not
        an outage: reads go on and it is not skipped.
        """
        if isinstance(exc, TierFullError):
            self.store_failed(exc)
            return
        self.unavailable += 1
        if self.retry_interval_s > 0:
            self._down_until = time.monotonic() + self.retry_interval_s
        what = "cannot be reached" if isinstance(exc, TierUnavailableError) else "failed"
        skip = (
            f"; it is skipped for {self.retry_interval_s:g} s at a time"
            if self.retry_interval_s > 0
            else ""
        )
        self.episodes.fail(
            self._key,
            f"the {self.name} tier {what} ({exc}); what it held is recomputed and nothing "
            f"is stored there until it is back{skip}",
        )

    def answered(self) -> bool:
        """The medium answered; True when that ends an outage (time to reconcile)."""
        return self.episodes.ok(self._key, f"the {self.name} tier answers again")

    def store_failed(self, exc: BaseException | None) -> None:
        """A write failed: an outage when unreachable, else a store-failure episode."""
        if isinstance(exc, TierFullError):
            self.episodes.fail(
                f"{self.name}:store",
                f"the {self.name} tier is full ({exc}); what is demoted there is lost until "
                "it has room again",
            )
            return
        if isinstance(exc, TierUnavailableError):
            self.failed(exc)
            return
        self.episodes.fail(
            f"{self.name}:store",
            f"storing on the {self.name} tier fails ({type(exc).__name__}: {exc}); what is "
            "demoted there is lost until it works again: check its space and permissions",
        )

    def store_ok(self) -> None:
        self.episodes.ok(f"{self.name}:store", f"storing on the {self.name} tier works again")


def drop_items(
    medium: BlockStore, items: Sequence[tuple[int, int]], health: TierHealth, *, everywhere: bool
) -> None:
    """Delete ``(key, slot)`` items from ``medium``; ``everywhere`` purges a shared
    medium's copy for every process (a bad value must not be served to anyone)."""
    if not items:
        return
    try:
        if everywhere and medium.caps.purge:
            medium.purge(list(items))
        else:
            medium.delete(list(items))
    except KvTierError as exc:
        health.failed(exc)


class TierCore:
    """A medium with ``capacity`` slots, an offloading manager and a :class:`TierHealth`."""

    def __init__(
        self,
        medium: BlockStore,
        capacity: int,
        policy: str | EvictionPolicy = "lru",
        *,
        name: str | None = None,
        enable_events: bool = True,
        retry_interval_s: float = 0.0,
        episodes: Episodes | None = None,
    ) -> None:
        self.medium = medium
        self.name: str = name or medium.name
        self.offload_manager = OffloadingManager(
            capacity, policy, medium=self.name, enable_events=enable_events
        )
        self.health = TierHealth(self.name, retry_interval_s=retry_interval_s, episodes=episodes)
        self._reconcile_cursor = 0

    @property
    def capacity(self) -> int:
        return self.offload_manager.capacity

    @property
    def available(self) -> bool:
        return self.health.available

    @property
    def retry_interval_s(self) -> float:
        """How long the medium is skipped after it failed (see :class:`TierHealth`)."""
        return self.health.retry_interval_s

    @retry_interval_s.setter
    def retry_interval_s(self, seconds: float) -> None:
        self.health.retry_interval_s = float(seconds)

    # -- adoption -----------------------------------------------------------------------
    def adopt_scan(self) -> int:
        """Serve what an earlier process left on a persistent medium: the newest that fit.

        Older items beyond the capacity are deleted. Returns how many were adopted.
        """
        try:
            found = self.medium.scan()
        except TierUnavailableError as exc:
            self.health.failed(exc)
            return 0
        keep = found[-self.capacity :]
        stale = found[: len(found) - len(keep)]
        adopted = self.offload_manager.adopt(keep)
        if stale:
            drop_items(self.medium, [(k, 0) for k in stale], self.health, everywhere=False)
        if adopted:
            log.info("the %s tier serves %d items of an earlier run", self.name, len(adopted))
        return len(adopted)

    def adopt_present(self, keys: Sequence[int]) -> int | None:
        """Adopt the leading run of ``keys`` a shared medium holds; how many were adopted
        (0 for media no one else writes), or ``None`` when the medium could not be asked.

        The caller tells :attr:`health` that the medium answered: it may
        have to reconcile when that ends an outage."""
        if not keys or not self.medium.caps.shared or not self.available:
            return 0
        try:
            found = self.medium.contains(list(keys))
        except TierUnavailableError as exc:
            self.health.failed(exc)
            return None
        run = next((i for i, hit in enumerate(found) if not hit), len(found))
        return len(self.offload_manager.adopt(list(keys[:run]))) if run else 0

    # -- verify-and-drop ----------------------------------------------------------------
    def drop(self, keys: Sequence[int], *, bad: bool) -> None:
        """Drop ``keys`` (ready, not pinned by a load in progress) from the bookkeeping and
        the medium; ``bad`` ones (damaged) are purged for every process sharing it."""
        mgr = self.offload_manager
        items = [(k, mgr.slot_of(k)) for k in keys if mgr.is_ready(k)]
        mgr.remove([k for k, _ in items])
        drop_items(self.medium, items, self.health, everywhere=bad)

    def reconcile(self, limit: int | None = None) -> list[int]:
        """Drop keys the bookkeeping has but the medium lost (a restart, its own eviction).

        Checks up to ``limit`` keys (all when ``None``), resuming where the
        previous call stopped; returns the keys dropped. Memory media lose
        nothing behind the bookkeeping's back and are not checked.
        """
        caps = self.medium.caps
        if not (caps.persistent or caps.shared):
            return []
        mgr = self.offload_manager
        keys = mgr.ready_keys()
        if not keys:
            return []
        start = self._reconcile_cursor % len(keys)
        batch = keys[start:] + keys[:start]
        if limit is not None:
            batch = batch[:limit]
        self._reconcile_cursor = start + len(batch)
        try:
            present = self.medium.contains(batch)
        except TierUnavailableError as exc:
            self.health.failed(exc)
            return []
        gone = [
            k
            for k, here in zip(batch, present, strict=True)
            if not here and mgr.is_ready(k) and not mgr.is_pinned(k)
        ]
        if gone:
            mgr.remove(gone)
        return gone

    def close(self) -> None:
        self.medium.close()
