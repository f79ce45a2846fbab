"""The two-phase offloading manager: bookkeeping for one tier, in vLLM's protocol.

One :class:`OffloadingManager` per tier tracks which block keys the tier
holds, in which slot, and whether each is *ready* (stored and readable) or
*pending* (a store in flight). It never touches payloads; the tier chain and
the transfer engine move bytes between the slots it hands out. The protocol:

* ``lookup(keys)``: how many leading keys are ready; ``None`` when the first
  key that is not ready has a store in flight (ask again later);
* ``prepare_load(keys)``: pin ready keys (a load is about to read them) and
  return their slots; ``complete_load(keys)`` unpins;
* ``touch(keys)``: a use, for the policy; unknown or pending keys are ignored;
* ``prepare_store(keys)``: reserve slots for the keys not already held,
  evicting unpinned ready keys the policy picks (never one named in the same
  call, never one being loaded or stored). When room cannot be made it
  returns ``None`` and **nothing has changed** (not even the policy's order;
  an admission filter has still recorded the sighting of the keys);
* ``complete_store(keys, success)``: make stored keys ready, or release the
  slots of a store that failed;
* ``take_events()``: the stored / removed events since the last call;
* ``on_request(keys, num_hit)``: a request is about to use ``keys`` (the
  first ``num_hit`` of them ready here); passed to a request-aware policy
  with the manager's clock, ignored otherwise.

Any policy of :mod:`kvtier.policy` decides evictions: ready keys are its
resident keys; a key being loaded is pinned in it; pending keys are not in it
until their store completes, so they can never be chosen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.errors import BadRequestError, ConfigError, InternalInvariantError
from kvtier.policy.base import EvictionPolicy, admit_chain, request_hook
from kvtier.policy.registry import make_policy


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What :meth:`OffloadingManager.prepare_store` reserved."""

    #: Keys to write now (those of the call the tier did not hold), in call order.
    keys_to_store: list[int]
    #: Slot of each key to store.
    slots: list[int]
    #: Keys evicted to make room (their slots are reused by ``keys_to_store``).
    evicted_keys: list[int]
    #: The slots the evicted keys occupied, aligned with ``evicted_keys``.
    evicted_slots: list[int]


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    """Keys that became ready on (``removed=False``) or left (``True``) a medium."""

    keys: tuple[int, ...]
    medium: str
    removed: bool


class _Entry:
    __slots__ = ("ready", "ref", "slot")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.ref = 0
        self.ready = False


class OffloadingManager:
    """Bookkeeping of one tier of ``capacity`` blocks (see the module docstring)."""

    def __init__(
        self,
        capacity: int,
        policy: str | EvictionPolicy = "lru",
        *,
        medium: str = "host",
        enable_events: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ConfigError(f"a tier's capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self.medium = medium
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy.bind(capacity)
        self._request_hook = request_hook(self.policy)
        self.clock: Callable[[], float] = clock if clock is not None else time.monotonic
        self._entries: dict[int, _Entry] = {}
        # Popping from the end hands out low slots first.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self.stores = 0
        self.failed_stores = 0
        self.evictions = 0
        self.declined = 0
        self.store_rejections = 0

    # -- introspection -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def is_ready(self, key: int) -> bool:
        e = self._entries.get(key)
        return e is not None and e.ready

    def is_pinned(self, key: int) -> bool:
        """Whether ``key`` is being loaded or stored (and so cannot be evicted)."""
        e = self._entries.get(key)
        return e is not None and (e.ref > 0 or not e.ready)

    def slot_of(self, key: int) -> int:
        e = self._entries.get(key)
        if e is None:
            raise BadRequestError(f"block {key:#x} is not on the {self.medium} tier")
        return e.slot

    def ready_keys(self) -> list[int]:
        return [k for k, e in self._entries.items() if e.ready]

    @property
    def num_free(self) -> int:
        """Slots no key holds."""
        return len(self._free)

    def on_request(
        self,
        keys: Sequence[int],
        num_hit: int,
        hints: Mapping[str, object] | None = None,
    ) -> None:
        """Tell a request-aware policy that a request is about to use ``keys`` here."""
        hook = self._request_hook
        if hook is not None:
            hook(keys, num_hit, self.clock(), hints)

    # -- lookups and loads ---------------------------------------------------------------
    def lookup(self, keys: Sequence[int]) -> int | None:
        """Leading ready keys; ``None`` if the first one that is not ready is being stored."""
        entries = self._entries
        n = 0
        for key in keys:
            e = entries.get(key)
            if e is None:
                return n
            if not e.ready:
                return None
            n += 1
        return n

    def prepare_load(self, keys: Sequence[int]) -> list[int]:
        """Pin ``keys`` (all ready, or nothing changes) and return their slots."""
        entries = self._entries
        found: list[_Entry] = []
        for key in keys:
            e = entries.get(key)
            if e is None or not e.ready:
                raise BadRequestError(
                    f"block {key:#x} is not ready on the {self.medium} tier: "
                    "load only keys that lookup() reported"
                )
            found.append(e)
        policy = self.policy
        for key, e in zip(keys, found, strict=True):
            e.ref += 1
            if e.ref == 1:
                policy.pin(key)
        return [e.slot for e in found]

    def touch(self, keys: Sequence[int]) -> None:
        """Record a use of the ready ``keys``; the first key ends up the most recent."""
        entries = self._entries
        policy = self.policy
        # Reversed, so a chain's parents rank as more recent than its children
        # and recency policies evict leaves first.
        for key in reversed(keys):
            e = entries.get(key)
            if e is not None and e.ready:
                policy.access(key)

    def complete_load(self, keys: Sequence[int]) -> None:
        """Unpin keys :meth:`prepare_load` pinned (all of them, or nothing changes)."""
        entries = self._entries
        for key in keys:
            e = entries.get(key)
            if e is None or e.ref <= 0:
                raise BadRequestError(
                    f"complete_load of block {key:#x}, which no load pinned on the "
                    f"{self.medium} tier"
                )
        if len(set(keys)) != len(keys):
            counts: dict[int, int] = {}
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
            for key, c in counts.items():
                if entries[key].ref < c:
                    raise BadRequestError(f"complete_load unpins block {key:#x} more than pinned")
        policy = self.policy
        for key in keys:
            e = entries[key]
            e.ref -= 1
            if e.ref == 0:
                policy.unpin(key)

    # -- stores --------------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[int]) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not held yet; ``None``, changing nothing, if no room.

        A declined key (admission) ends what is stored: see :func:`admit_chain`.
        """
        entries = self._entries
        policy = self.policy
        new: list[int] = []
        held: list[int] = []
        seen: set[int] = set()
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            e = entries.get(key)
            if e is None:
                new.append(key)
            elif e.ready and e.ref == 0:
                held.append(key)
        if new:
            cut = admit_chain(policy.admit, new)
            if cut < len(new):
                self.declined += len(new) - cut
                new = new[:cut]
        need = len(new) - len(self._free)
        victims: list[int] = []
        if need > 0:
            # Checked before the policy is touched, so a refusal changes nothing.
            if policy.num_evictable - len(held) < need:
                self.store_rejections += 1
                return None
            # Keys of this call that are already held must survive it: pinned
            # while victims are chosen (unpinning counts as a use for them).
            policy.pin_many(held)
            try:
                victims = policy.evict_many(need)
                if len(victims) != need:
                    raise InternalInvariantError(
                        f"policy gave {len(victims)} victims of {need} on the {self.medium} tier"
                    )
            finally:
                policy.unpin_many(held)
        free = self._free
        evicted_slots: list[int] = []
        for key in victims:
            e = entries.pop(key, None)
            if e is None or e.ref or not e.ready:
                raise InternalInvariantError(
                    f"policy evicted block {key:#x}, which is not an unpinned ready key"
                )
            evicted_slots.append(e.slot)
            free.append(e.slot)
        slots: list[int] = []
        for key in new:
            slot = free.pop()
            entries[key] = _Entry(slot)
            slots.append(slot)
        if victims:
            self.evictions += len(victims)
            self._emit(victims, removed=True)
        return PrepareStoreOutput(new, slots, victims, evicted_slots)

    def complete_store(self, keys: Sequence[int], success: bool = True) -> None:
        """Finish stores :meth:`prepare_store` reserved; keys already ready are ignored."""
        entries = self._entries
        done: list[int] = []
        for key in keys:
            e = entries.get(key)
            if e is None or e.ready:
                continue
            if success:
                e.ready = True
                done.append(key)
            else:
                del entries[key]
                self._free.append(e.slot)
                self.failed_stores += 1
        if done:
            self.policy.insert_many(done)
            self.stores += len(done)
            self._emit(done, removed=False)

    def adopt(self, keys: Sequence[int]) -> list[int]:
        """Register keys the medium already holds (a restart, another engine); returns them.

        Adopts as many leading keys as room can be made for.
        """
        out = self.prepare_store(keys)
        n = len(keys)
        while out is None and n > 1:
            n //= 2
            out = self.prepare_store(keys[:n])
        if out is None:
            return []
        self.complete_store(out.keys_to_store, success=True)
        return out.keys_to_store

    def remove(self, keys: Sequence[int]) -> list[int]:
        """Drop ready, unpinned ``keys`` (corrupt or vanished payloads); returns those dropped."""
        entries = self._entries
        dropped: list[int] = []
        for key in keys:
            e = entries.get(key)
            if e is None or not e.ready or e.ref:
                continue
            self.policy.remove(key)
            del entries[key]
            self._free.append(e.slot)
            dropped.append(key)
        if dropped:
            self._emit(dropped, removed=True)
        return dropped

    def clear(self) -> list[int]:
        """Drop every unpinned ready key; returns them."""
        return self.remove(self.ready_keys())

    # -- events --------------------------------------------------------------------------
    def _emit(self, keys: list[int], *, removed: bool) -> None:
        if self._events is not None:
            self._events.append(OffloadingEvent(tuple(keys), self.medium, removed))

    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call, oldest first."""
        if self._events is None:
            return []
        out = self._events
        self._events = []
        return out

    # -- checks --------------------------------------------------------------------------
    def check(self) -> None:
        """Verify the bookkeeping; raises :class:`InternalInvariantError`."""
        entries = self._entries
        slots = [e.slot for e in entries.values()]
        if len(entries) + len(self._free) != self.capacity:
            raise InternalInvariantError(
                f"{len(entries)} keys + {len(self._free)} free slots != capacity {self.capacity}"
            )
        if len(set(slots) | set(self._free)) != self.capacity:
            raise InternalInvariantError("a slot is both free and held, or held twice")
        policy = self.policy
        ready = [k for k, e in entries.items() if e.ready]
        if len(policy) != len(ready):
            raise InternalInvariantError(
                f"policy holds {len(policy)} keys but the tier has {len(ready)} ready ones"
            )
        if policy.used != len(ready):
            raise InternalInvariantError(
                f"policy counts {policy.used} used but the tier has {len(ready)} ready blocks"
            )
        evictable = 0
        for key, e in entries.items():
            if e.ref < 0 or (e.ref and not e.ready):
                raise InternalInvariantError(f"block {key:#x} has a bad pin count {e.ref}")
            if e.ready:
                if key not in policy:
                    raise InternalInvariantError(f"ready block {key:#x} is not in the policy")
                evictable += e.ref == 0
        if policy.num_evictable != evictable:
            raise InternalInvariantError(
                f"policy counts {policy.num_evictable} evictable keys, tier has {evictable}"
            )
