"""The eviction/admission policy protocol every cache level uses.

A policy orders the *resident* keys of one cache level (the device pool, a
host/disk/Redis tier, the replay simulator) and picks victims. The owner of
the level keeps the payloads and reference counts and tells the policy about
transitions only:

* ``insert(key, pinned)``: ``key`` became resident (after ``admit`` said yes);
* ``access(key)``: a resident key was hit (pinned or not);
* ``pin(key)`` / ``unpin(key)``: the key stopped / started being evictable
  (its reference count went 0 -> 1 / 1 -> 0). A release is the last use, so
  recency-based policies treat ``unpin`` as a use;
* ``remove(key)``: the owner dropped a resident key itself (a cascade, an
  invalidation); not a policy decision;
* ``evict()``: choose an unpinned resident key, forget it as resident and
  return it, or ``None`` when every resident key is pinned.

Pinned keys are held outside the candidate order, so skipping them costs
nothing and ``evict`` never scans. Policies may keep history about keys that
are no longer resident (ARC's ghost lists, LFU counts) but must bound it.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the device pool, the tiers and the replay simulator call."""

    name: ClassVar[str]

    def admit(self, key: int) -> bool: ...

    def insert(self, key: int, pinned: bool = False) -> None: ...

    def access(self, key: int) -> None: ...

    def pin(self, key: int) -> None: ...

    def unpin(self, key: int) -> None: ...

    def remove(self, key: int) -> None: ...

    def evict(self) -> int | None: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    @property
    def num_evictable(self) -> int: ...


class PolicyBase:
    """Defaults shared by the shipped policies: admit everything."""

    name: ClassVar[str] = "base"

    def admit(self, key: int) -> bool:
        return True
