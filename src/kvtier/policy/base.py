"""The eviction/admission policy protocol every cache level uses.

A policy orders the *resident* keys of one cache level (the device pool, a
host/disk/Redis tier, the replay simulator) and picks victims. The owner of
the level keeps the payloads and reference counts and tells the policy about
transitions only:

* ``admit(key)``: whether to cache a new key; an admission filter may record
  the sighting. After a decline the owner stops caching that chain but still
  asks about its remaining new keys (ignoring the answers), so a filter sees
  whole chains;
* ``bind(capacity)``: called once by the owner before anything else, with
  the number of keys the level can hold (ARC and S3-FIFO size their lists
  and ghosts from it);
* ``insert(key, pinned)``: ``key`` became resident (after ``admit`` said yes);
* ``access(key)``: a resident key was hit (pinned or not);
* ``pin(key)`` / ``unpin(key)``: the key stopped / started being evictable
  (its reference count went 0 -> 1 / 1 -> 0). A release is the last use, so
  recency-based policies treat ``unpin`` as a use;
* ``remove(key)``: the owner dropped a resident key itself (a cascade, an
  invalidation); not a policy decision. Keys the policy does not hold as
  resident (already evicted) are ignored;
* ``evict()``: choose an unpinned resident key, forget it as resident and
  return it, or ``None`` when every resident key is pinned; ``evict_many(n)``
  returns up to ``n`` victims in eviction order.

* ``on_request(keys, num_hit, now, hints)`` (optional; :class:`PolicyBase`'s
  is a no-op): a request is about to use the chain ``keys``, of which the
  first ``num_hit`` are cached here; ``now`` is the owner's clock (injected,
  so a replay is deterministic) and ``hints`` what the caller knows about the
  request, or ``None``. Owners call it once per request, after every check
  that could refuse the request and before its hits are pinned and its new
  keys inserted; :func:`request_hook` returns ``None`` for policies that do
  not override it, so owners skip the call.

Pinned keys are held outside the candidate order, so skipping them costs
nothing and ``evict`` never scans. Policies may keep history about keys that
are no longer resident (ARC's ghost lists, LFU counts) but must bound it.

The owners call the batch forms (``insert_many``, ``pin_many``,
``unpin_many``, ``access_many``) once per request rather than once per block; :class:`PolicyBase`
implements them with the single-key methods, and a policy overrides them when
it can do better.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Protocol, runtime_checkable

from kvtier.errors import ConfigError


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the device pool, the tiers and the replay simulator call."""

    name: ClassVar[str]

    def bind(self, capacity: int) -> None: ...

    def admit(self, key: int) -> bool: ...

    def insert(self, key: int, pinned: bool = False) -> None: ...

    def access(self, key: int) -> None: ...

    def pin(self, key: int) -> None: ...

    def unpin(self, key: int) -> None: ...

    def remove(self, key: int) -> None: ...

    def insert_many(self, keys: Sequence[int], pinned: bool = False) -> None: ...

    def pin_many(self, keys: Sequence[int]) -> None: ...

    def unpin_many(self, keys: Sequence[int]) -> None: ...

    def access_many(self, keys: Sequence[int]) -> None: ...

    def evict(self) -> int | None: ...

    def evict_many(self, n: int) -> list[int]: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    @property
    def num_evictable(self) -> int: ...


class PolicyBase:
    """Defaults shared by the shipped policies: admit everything; batch via singles."""

    name: ClassVar[str] = "base"
    #: Keys the owning level can hold; set by :meth:`bind` (0 until then).
    capacity: int = 0

    def bind(self, capacity: int) -> None:
        if capacity <= 0:
            raise ConfigError(f"a policy's capacity must be positive, got {capacity}")
        self.capacity = capacity

    def admit(self, key: int) -> bool:
        return True

    def insert(self, key: int, pinned: bool = False) -> None:
        raise NotImplementedError

    def pin(self, key: int) -> None:
        raise NotImplementedError

    def unpin(self, key: int) -> None:
        raise NotImplementedError

    def insert_many(self, keys: Sequence[int], pinned: bool = False) -> None:
        for key in keys:
            self.insert(key, pinned)

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
