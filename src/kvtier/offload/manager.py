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
  evicting ready keys the policy picks (never one named in the same call,
  never one being loaded or stored; keys with a retention pin last, see
  below). When room cannot be made it returns ``None`` and **nothing has
  changed** (not even the policy's order; an admission filter has still
  recorded the sighting of the keys);
* ``complete_store(keys, success)``: make stored keys ready, or release the
  slots of a store that failed;
* ``take_events()``: the stored / removed events since the last call
  (``take_all_events()``: with the pin events among them, see below);
* ``on_request(keys, num_hit)``: a request is about to use ``keys`` (the
  first ``num_hit`` of them ready here); passed to a request-aware policy
  with the manager's clock, ignored otherwise.

Retention pins (a session's ``cache_ttl_s`` on the device, carried down as
the blocks are demoted) come as data: ``prepare_store(keys, pins)`` and
``set_pins(pins)`` map keys to when their pin ends on the manager's clock.
The manager keeps ``key -> end`` for the keys it holds. When it must evict,
unpinned keys go first, in the policy's order; only when they are not
enough do pinned ones go, the pin that ends latest first (a TTL says when
the session is back, and MIN keeps what is due soonest). A pin lapses when
the clock reaches its end (the key rejoins the policy's order as a release
does); ``remove`` drops the pin with the key. A ready key with a pin (and
no load) is pinned in the policy, so its victims are never pinned keys and
nothing is scanned; without pins nothing of this costs anything. A ready key
that gets a pin (or a new end), or becomes ready with one, is journaled as a
:class:`PinEvent` among the stored / removed events: ``take_all_events()``
returns them in order, ``take_events()`` leaves them out (its callers map
every event to a store or a removal).

Any policy of :mod:`kvtier.policy` decides evictions: ready keys are its
resident keys; a key being loaded is pinned in it; pending keys are not in it
until their store completes, so they can never be chosen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

from kvtier.errors import BadRequestError, ConfigError, InternalInvariantError
from kvtier.offload.pin_orders import PinOrders
from kvtier.policy.base import EvictionPolicy, admit_chain, request_hook
from kvtier.policy.registry import make_policy

#: No pins (the ``evicted_pins`` of a store that evicted no pinned key).
_NO_PINS: Mapping[int, float] = MappingProxyType({})


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
    #: The retention pins the evicted keys had (key -> end), for the tier below.
    evicted_pins: Mapping[int, float]


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    """Keys that became ready on (``removed=False``) or left (``True``) a medium."""

    keys: tuple[int, ...]
    medium: str
    removed: bool


@dataclass(frozen=True, slots=True)
class PinEvent:
    """Ready keys of a medium that a retention pin keeps until ``until`` (the clock of
    the manager that journaled it), from now on."""

    keys: tuple[int, ...]
    medium: str
    until: float


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
        self._events: list[OffloadingEvent | PinEvent] | None = [] if enable_events else None
        # Whether the journal holds a PinEvent (take_events leaves them out).
        self._pin_journaled = False
        self.stores = 0
        self.failed_stores = 0
        self.evictions = 0
        self.declined = 0
        self.store_rejections = 0
        #: Evictions of keys whose retention pin had not ended (no unpinned key was left).
        self.pinned_evictions = 0
        # Retention pins of held keys: when each ends (the manager's clock), in order.
        self._pin_orders = PinOrders()
        self._pins: dict[int, float] = self._pin_orders.ends
        # Ready keys with a pin and no load: pinned in the policy for their pin.
        self._pin_evictable = 0

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

    # -- retention pins ------------------------------------------------------------------
    def pin_end(self, key: int) -> float | None:
        """When ``key``'s retention pin ends, or ``None`` (no pin, or it ended)."""
        if self._pins:
            self.expire()
        return self._pins.get(key)

    def pins(self) -> dict[int, float]:
        """The retention pins of the keys held here (key -> end) that have not ended."""
        if not self._pins:
            return {}
        self.expire()
        return dict(self._pins)

    @property
    def num_pinned(self) -> int:
        """Keys held here whose retention pin has not ended."""
        if not self._pins:
            return 0
        self.expire()
        return len(self._pins)

    def set_pins(self, pins: Mapping[int, float]) -> None:
        """Pin the keys of ``pins`` this tier holds until their ends (replacing a pin
        they had); keys it does not hold and ends not later than now are ignored."""
        if not pins:
            return
        now = self.clock()
        self._expire(now)
        entries = self._entries
        orders = self._pin_orders
        own = orders.ends
        policy = self.policy
        journal = self._events is not None
        changed: list[int] = []
        for key, until in pins.items():
            if until <= now:
                continue
            e = entries.get(key)
            if e is None:
                continue
            old = own.get(key)
            if old == until:
                continue
            orders.set(key, until)
            if e.ready:
                if old is None and e.ref == 0:
                    policy.pin(key)
                    self._pin_evictable += 1
                if journal:
                    changed.append(key)
        if changed:
            self._emit_pins(changed)
        orders.compact()

    def expire(self) -> int:
        """Drop the retention pins that ended by the manager's clock; returns how many."""
        return self._expire(self.clock()) if self._pins else 0

    def _expire(self, now: float) -> int:
        ended = self._pin_orders.pop_ended(now)
        entries = self._entries
        for key in ended:
            e = entries[key]
            if e.ready and e.ref == 0:
                self.policy.unpin(key)  # rejoins the order, as a release does
                self._pin_evictable -= 1
        return len(ended)

    def _drop_pin(self, key: int, e: _Entry) -> None:
        """Forget ``key``'s pin (it leaves the tier); the policy is the caller's."""
        self._pin_orders.drop(key)
        if e.ready and e.ref == 0:
            self._pin_evictable -= 1

    def _latest_pinned(self, n: int, keep: set[int]) -> list[int]:
        """``n`` pinned ready keys no load holds and not in ``keep``, the pin that ends
        latest first (ties: pinned first); there must be that many. Changes no pin."""
        entries = self._entries

        def eligible(key: int) -> bool:
            e = entries[key]
            return key not in keep and e.ready and not e.ref

        return self._pin_orders.latest(n, eligible, self.medium)

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
        own = self._pins
        for key, e in zip(keys, found, strict=True):
            e.ref += 1
            if e.ref == 1:
                if own and key in own:
                    self._pin_evictable -= 1  # pinned in the policy already, for its pin
                else:
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
        own = self._pins
        for key in keys:
            e = entries[key]
            e.ref -= 1
            if e.ref == 0:
                if own and key in own:
                    self._pin_evictable += 1  # stays pinned in the policy for its pin
                else:
                    policy.unpin(key)

    # -- stores --------------------------------------------------------------------------
    def prepare_store(
        self, keys: Sequence[int], pins: Mapping[int, float] | None = None
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not held yet; ``None``, changing nothing, if no room.

        A declined key (admission) ends what is stored: see :func:`admit_chain`.
        ``pins`` maps keys of the call to when their retention pin ends; once
        room is made they carry it here (see :meth:`set_pins`). Pins that ended
        are dropped first (the clock's doing, not the call's).
        """
        entries = self._entries
        policy = self.policy
        own = self._pins
        if own:
            self._expire(self.clock())
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
        pinned_victims: list[int] = []
        if need > 0:
            # Held keys of this call with a pin are pinned in the policy already.
            unpinned_held = [k for k in held if k not in own] if own else held
            take = need
            if own:
                # Unpinned keys first; then the pins that end latest.
                take = min(need, policy.num_evictable - len(unpinned_held))
                spare = self._pin_evictable - (len(held) - len(unpinned_held))
                # Checked before anything is touched, so a refusal changes nothing.
                if take + spare < need:
                    self.store_rejections += 1
                    return None
                if take < need:
                    pinned_victims = self._latest_pinned(need - take, set(held))
            elif policy.num_evictable - len(held) < need:
                self.store_rejections += 1
                return None
            if take > 0:
                # Keys of this call that are already held must survive it: pinned
                # while victims are chosen (unpinning counts as a use for them).
                policy.pin_many(unpinned_held)
                try:
                    victims = policy.evict_many(take)
                    if len(victims) != take:
                        raise InternalInvariantError(
                            f"policy gave {len(victims)} victims of {take} on the "
                            f"{self.medium} tier"
                        )
                finally:
                    policy.unpin_many(unpinned_held)
        free = self._free
        evicted_slots: list[int] = []
        for key in victims:
            e = entries.pop(key, None)
            if e is None or e.ref or not e.ready or (own and key in own):
                raise InternalInvariantError(
                    f"policy evicted block {key:#x}, which is not an unpinned ready key"
                )
            evicted_slots.append(e.slot)
            free.append(e.slot)
        evicted_pins: Mapping[int, float] = _NO_PINS
        if pinned_victims:
            evicted_pins = {k: own[k] for k in pinned_victims}
            for key in pinned_victims:
                e = entries.pop(key)
                policy.remove(key)
                self._drop_pin(key, e)
                evicted_slots.append(e.slot)
                free.append(e.slot)
            victims.extend(pinned_victims)
            self.pinned_evictions += len(pinned_victims)
        slots: list[int] = []
        for key in new:
            slot = free.pop()
            entries[key] = _Entry(slot)
            slots.append(slot)
        if victims:
            self.evictions += len(victims)
            self._emit(victims, removed=True)
        if pins:
            self.set_pins({k: u for k, u in pins.items() if k in seen})
        return PrepareStoreOutput(new, slots, victims, evicted_slots, evicted_pins)

    def complete_store(self, keys: Sequence[int], success: bool = True) -> None:
        """Finish stores :meth:`prepare_store` reserved; keys already ready are ignored."""
        entries = self._entries
        own = self._pins
        if own:
            self._expire(self.clock())
        done: list[int] = []
        for key in keys:
            e = entries.get(key)
            if e is None or e.ready:
                continue
            if success:
                e.ready = True
                done.append(key)
            else:
                if own and key in own:
                    self._drop_pin(key, e)
                del entries[key]
                self._free.append(e.slot)
                self.failed_stores += 1
        if done:
            pinned = [k for k in done if k in own] if own else None
            if pinned:
                # Keys stored with a pin join the policy pinned for it.
                self.policy.insert_many([k for k in done if k not in own])
                self.policy.insert_many(pinned, pinned=True)
                self._pin_evictable += len(pinned)
            else:
                self.policy.insert_many(done)
            self.stores += len(done)
            self._emit(done, removed=False)
            if pinned and self._events is not None:
                self._emit_pins(pinned)

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
        own = self._pins
        dropped: list[int] = []
        for key in keys:
            e = entries.get(key)
            if e is None or not e.ready or e.ref:
                continue
            self.policy.remove(key)
            if own and key in own:
                self._drop_pin(key, e)  # a released block takes its pin with it
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

    def _emit_pins(self, keys: list[int]) -> None:
        """Journal the pins of ready ``keys``: one event per end, in the order of the keys."""
        events = self._events
        if events is None:
            return
        own = self._pins
        by_end: dict[float, list[int]] = {}
        for key in keys:
            by_end.setdefault(own[key], []).append(key)
        medium = self.medium
        events.extend(PinEvent(tuple(ks), medium, until) for until, ks in by_end.items())
        self._pin_journaled = True

    def take_events(self) -> list[OffloadingEvent]:
        """Stored and removed events since the last call, oldest first (pin events since
        then are dropped: :meth:`take_all_events` returns them too)."""
        pins = self._pin_journaled
        out = self.take_all_events()
        if not pins:
            return cast("list[OffloadingEvent]", out)  # no PinEvent among them
        return [e for e in out if isinstance(e, OffloadingEvent)]

    def take_all_events(self) -> list[OffloadingEvent | PinEvent]:
        """Every event since the last call, pin events included, oldest first."""
        self._pin_journaled = False
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
        pin_evictable = 0
        own = self._pins
        for key, e in entries.items():
            if e.ref < 0 or (e.ref and not e.ready):
                raise InternalInvariantError(f"block {key:#x} has a bad pin count {e.ref}")
            if e.ready:
                if key not in policy:
                    raise InternalInvariantError(f"ready block {key:#x} is not in the policy")
                if e.ref == 0:
                    if key in own:
                        pin_evictable += 1
                    else:
                        evictable += 1
        if policy.num_evictable != evictable:
            raise InternalInvariantError(
                f"policy counts {policy.num_evictable} evictable keys, tier has {evictable}"
            )
        if self._pin_evictable != pin_evictable:
            raise InternalInvariantError(
                f"{self._pin_evictable} pinned keys counted evictable, tier has {pin_evictable}"
            )
        for key in own:
            if key not in entries:
                raise InternalInvariantError(f"block {key:#x} has a pin but is not held")
        self._pin_orders.check()
