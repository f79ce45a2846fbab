"""The eviction/admission policy protocol every cache level uses.

A policy orders the *resident* keys of one cache level (the device pool, a
host/disk/Redis tier, the replay simulator) and picks victims. The owner of
the level keeps the payloads and reference counts and tells the policy about
transitions only:

* ``bind(capacity, typical_size=1)``: called once by the owner before
  anything else. ``capacity`` is the level's budget in *size units* (blocks
  for the device pool, bytes for a byte budget); ``typical_size`` says how
  big an item usually is, so ``key_capacity = capacity // typical_size`` is
  about how many keys the level holds. Policies size their own lists, ghosts
  and histories in keys from ``key_capacity`` (ARC's target, S3-FIFO's small
  queue, LFU's history, TinyLFU's sketch);
* ``admit(key)``: whether to cache a new key; an admission filter may record
  the sighting. After a decline the owner stops caching that chain but still
  asks about its remaining new keys (ignoring the answers), so a filter sees
  whole chains: :func:`admit_chain` does exactly that;
* ``insert(key, pinned, size=1)``: ``key`` became resident (after ``admit``
  said yes) and takes ``size`` units; ``used`` grows by ``size``. An item
  larger than the whole capacity is refused at once with
  :class:`~kvtier.errors.OversizeError`;
* ``access(key)``: a resident key was hit (pinned or not);
* ``pin(key)`` / ``unpin(key)``: the key stopped / started being evictable
  (its reference count went 0 -> 1 / 1 -> 0). A release is the last use, so
  recency-based policies treat ``unpin`` as a use;
* ``remove(key)``: the owner dropped a resident key itself (a cascade, an
  invalidation); not a policy decision. Keys the policy does not hold as
  resident (already evicted) are ignored;
* ``evict()``: choose an unpinned resident key, forget it as resident and
  return it, or ``None`` when every resident key is pinned; ``evict_many(n)``
  returns up to ``n`` victims in eviction order;
* ``evict_for(size)``: the victims that make room for an item of ``size``
  (evicted until ``used + size <= capacity``), or ``None``, evicting nothing,
  when pinned keys leave too little room.

``used`` (the sum of resident sizes) never exceeds ``capacity`` as long as the
owner makes room before it inserts: with ``evict_for`` for items of any size,
or, where every item has size 1 (the device pool, a tier of block slots), with
``evict_many`` counted in keys, which costs nothing extra. ``used`` is derived,
not counted: the number of resident keys plus what sizes above 1 add. Keys of
size 1 keep no size entry and touch no counter, so the block-budget hot path
pays one comparison per insert and one emptiness test per eviction.

* ``on_request(keys, num_hit, now, hints)`` (optional; :class:`PolicyBase`'s
  is a no-op): a request is about to use the chain ``keys``, of which the
  first ``num_hit`` are cached here; ``now`` is the owner's clock (injected,
  so a replay is deterministic) and ``hints`` what the caller knows about the
  request, or ``None``. Owners call it once per request, after every check
  that could refuse the request and before its hits are pinned and its new
  keys inserted; :func:`request_hook` returns ``None`` for policies that do
  not override it, so owners skip the call.

* ``pin_ends(keys)`` (optional, :class:`PinSource`): of ``keys``, those a
  retention pin keeps until a time later than now (the owner's clock), with
  that time: the workflow policy's ``cache_ttl_s`` pins. Read-only data for
  the levels below: the tier chain passes each demoted key's pin end down,
  and every tier keeps a pinned block ahead of unpinned ones until its pin
  ends. :func:`pin_ends_of` returns ``None`` for policies without pins, so
  owners skip the call (a policy has no pins by default).

Pinned keys are held outside the candidate order, so skipping them costs
nothing and ``evict`` never scans. Policies may keep history about keys that
are no longer resident (ARC's ghost lists, LFU counts) but must bound it.

``snapshot()`` returns the policy's whole state (resident order, pins, sizes,
ghosts, counts, an admission filter's sketch) as plain comparable data, so a
test can prove that a failed call changed nothing.

The owners call the batch forms (``insert_many``, ``pin_many``,
``unpin_many``, ``access_many``) once per request rather than once per block;
:class:`PolicyBase` implements them with the single-key methods, and a
policy overrides them when it can do better.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from kvtier.errors import ConfigError, InternalInvariantError, OversizeError


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the device pool, the tiers and the replay simulator call."""

    name: ClassVar[str]

    @property
    def capacity(self) -> int: ...

    @property
    def used(self) -> int: ...

    def bind(self, capacity: int, typical_size: int = 1) -> None: ...

    def admit(self, key: int) -> bool: ...

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None: ...

    def access(self, key: int) -> None: ...

    def pin(self, key: int) -> None: ...

    def unpin(self, key: int) -> None: ...

    def remove(self, key: int) -> None: ...

    def insert_many(
        self, keys: Sequence[int], pinned: bool = False, sizes: Sequence[int] | None = None
    ) -> None: ...

    def pin_many(self, keys: Sequence[int]) -> None: ...

    def unpin_many(self, keys: Sequence[int]) -> None: ...

    def access_many(self, keys: Sequence[int]) -> None: ...

    def evict(self) -> int | None: ...

    def evict_many(self, n: int) -> list[int]: ...

    def evict_for(self, size: int) -> list[int] | None: ...

    def snapshot(self) -> dict[str, Any]: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    @property
    def num_evictable(self) -> int: ...


def admit_chain(admit: Callable[[int], bool], keys: Sequence[int]) -> int:
    """How many leading ``keys`` of a chain to cache: up to the first one ``admit`` declines.

    A block is useless below a missing parent, so a decline ends what is
    cached. Every key is still shown to ``admit``, so an admission filter
    records the whole chain and admits all of it the next time, not one key
    per repeat.
    """
    for i, key in enumerate(keys):
        if not admit(key):
            for later in keys[i + 1 :]:
                admit(later)
            return i
    return len(keys)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class PolicyBase:
    """Defaults shared by the shipped policies: admit everything; batch via singles; sizes.

    Size bookkeeping: ``_sizes`` holds the size of each resident key whose
    size is not 1 (absent: 1) and ``_size_extra`` what those sizes add above
    one unit per key, so ``used = len(self) + _size_extra``. A subclass calls
    :meth:`_record_size` on inserting a key whose size is not 1 and, while
    ``_sizes`` is not empty, :meth:`_forget_size` for each key that leaves
    (evicted or removed); it lists its pinned keys in :meth:`_pinned_keys`.
    """

    name: ClassVar[str] = "base"
    #: The level's budget in size units; set by :meth:`bind` (0 until then: no limit).
    capacity: int = 0
    #: About how many keys the level holds (``capacity // typical_size``).
    key_capacity: int = 0

    def __init__(self) -> None:
        self.capacity = 0
        self.key_capacity = 0
        self._sizes: dict[int, int] = {}
        self._size_extra = 0

    @property
    def used(self) -> int:
        """Sum of the sizes of the resident keys."""
        return len(self) + self._size_extra

    def bind(self, capacity: int, typical_size: int = 1) -> None:
        if not _is_count(capacity) or capacity <= 0:
            raise ConfigError(f"a policy's capacity must be a positive integer, got {capacity!r}")
        if not _is_count(typical_size) or not 0 < typical_size <= capacity:
            raise ConfigError(
                f"typical_size must be an integer in [1, capacity={capacity}], got {typical_size!r}"
            )
        self.capacity = capacity
        self.key_capacity = capacity // typical_size

    def admit(self, key: int) -> bool:
        return True

    # -- sizes ------------------------------------------------------------------------
    def check_size(self, size: int) -> None:
        """Raise unless an item of ``size`` could ever be held (at most the capacity)."""
        if not _is_count(size) or size <= 0:
            raise ConfigError(f"an entry's size must be a positive integer, got {size!r}")
        if size > self.capacity > 0:
            raise OversizeError(size, self.capacity)

    def size_of(self, key: int) -> int:
        """The size a resident key was inserted with."""
        return self._sizes.get(key, 1)

    def _record_size(self, key: int, size: int) -> None:
        """Account for a new resident key of any size (checked first; 1 needs nothing)."""
        if size != 1:
            self.check_size(size)
            self._sizes[key] = size
            self._size_extra += size - 1

    def _check_sizes(self, keys: Sequence[int], sizes: Sequence[int]) -> None:
        """Raise unless ``sizes`` has one acceptable size per key."""
        if len(sizes) != len(keys):
            raise ConfigError(
                f"insert_many needs one size per key: {len(keys)} keys, {len(sizes)} sizes"
            )
        for size in sizes:
            self.check_size(size)

    def _record_sizes(self, keys: Sequence[int], sizes: Sequence[int] | None) -> None:
        """:meth:`_record_size` for a batch; checks every size before recording any."""
        if sizes is None:
            return
        self._check_sizes(keys, sizes)
        record = self._sizes
        for key, size in zip(keys, sizes, strict=True):
            if size != 1:
                record[key] = size
                self._size_extra += size - 1

    def _forget_size(self, key: int) -> None:
        """Account for a resident key that left (evicted or removed)."""
        self._size_extra -= self._sizes.pop(key, 1) - 1

    def _pinned_keys(self) -> Iterable[int]:
        raise NotImplementedError

    @property
    def pinned_used(self) -> int:
        """Size units held by pinned keys: what no eviction can free.

        O(1) while every key has size 1; otherwise one pass over the pinned keys.
        """
        n_pinned = len(self) - self.num_evictable
        sizes = self._sizes
        if not sizes or not n_pinned:
            return n_pinned
        return n_pinned + sum(sizes.get(k, 1) - 1 for k in self._pinned_keys())

    def evict_for(self, size: int) -> list[int] | None:
        """Evict until an item of ``size`` fits: ``used + size <= capacity``.

        Returns the victims in eviction order (empty when it fits already), or
        ``None``, evicting nothing, when the pinned keys alone leave less than
        ``size`` free. Raises :class:`OversizeError` at once for an item larger
        than the capacity.
        """
        if self.capacity <= 0:
            raise ConfigError("evict_for needs a bound policy: call bind(capacity) first")
        self.check_size(size)
        over = self.used + size - self.capacity
        if over <= 0:
            return []
        if self.used - self.pinned_used < over:
            return None
        if not self._sizes:
            # Every resident key has size 1: ``over`` victims, in one batch.
            return self.evict_many(over)
        victims: list[int] = []
        while self.used + size > self.capacity:
            key = self.evict()
            if key is None:
                raise InternalInvariantError(
                    "policy found no victim although its unpinned keys can make room"
                )
            victims.append(key)
        return victims

    # -- state ---------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """The size bookkeeping every policy shares, for :meth:`snapshot`."""
        return {
            "capacity": self.capacity,
            "key_capacity": self.key_capacity,
            "used": self.used,
            "sizes": sorted(self._sizes.items()),
        }

    def snapshot(self) -> dict[str, Any]:
        """The policy's whole state as plain data: equal snapshots, equal behaviour."""
        raise NotImplementedError(f"{type(self).__name__} does not implement snapshot()")

    # -- transitions -------------------------------------------------------------------
    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        raise NotImplementedError

    def pin(self, key: int) -> None:
        raise NotImplementedError

    def unpin(self, key: int) -> None:
        raise NotImplementedError

    def insert_many(
        self, keys: Sequence[int], pinned: bool = False, sizes: Sequence[int] | None = None
    ) -> None:
        if sizes is None:
            for key in keys:
                self.insert(key, pinned)
            return
        self._check_sizes(keys, sizes)
        for key, size in zip(keys, sizes, strict=True):
            self.insert(key, pinned, size)

    def pin_many(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.pin(key)

    def unpin_many(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.unpin(key)

    def access(self, key: int) -> None:
        raise NotImplementedError

    def evict(self) -> int | None:
        raise NotImplementedError

    def evict_many(self, n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            key = self.evict()
            if key is None:
                break
            out.append(key)
        return out

    def access_many(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.access(key)

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError

    @property
    def num_evictable(self) -> int:
        raise NotImplementedError

    def on_request(
        self,
        keys: Sequence[int],
        num_hit: int,
        now: float,
        hints: Mapping[str, object] | None = None,
    ) -> None:
        """A request is about to use ``keys`` (see the module docs); ignored by default."""


#: ``on_request``'s signature: ``(keys, num_hit, now, hints)``.
RequestHook = Callable[[Sequence[int], int, float, Mapping[str, object] | None], None]


def request_hook(policy: object) -> RequestHook | None:
    """``policy.on_request`` when the policy does something with it, else ``None``."""
    hook = getattr(policy, "on_request", None)
    if not callable(hook) or getattr(type(policy), "on_request", None) is PolicyBase.on_request:
        return None
    return hook  # type: ignore[no-any-return]


#: ``pin_ends``'s signature: of some keys, the pinned ones, each with when its pin ends.
PinEnds = Callable[[Sequence[int]], dict[int, float]]


@runtime_checkable
class PinSource(Protocol):
    """A policy whose keys may be pinned until a time (see the module docs).

    ``pin_ends(keys)`` returns, of ``keys``, those pinned until later than
    now on the owner's clock, mapped to the pin's end; a key the level no
    longer holds keeps its pin (the levels below carry it). It changes
    nothing.
    """

    def pin_ends(self, keys: Sequence[int]) -> dict[int, float]: ...


def pin_ends_of(policy: object) -> PinEnds | None:
    """``policy.pin_ends`` (or that of the policy an admission wrapper holds as
    ``.policy``), or ``None`` when the policy keeps no pins."""
    for candidate in (policy, getattr(policy, "policy", None)):
        if isinstance(candidate, PinSource):
            return candidate.pin_ends
    return None
