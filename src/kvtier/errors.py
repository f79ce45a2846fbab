"""The typed errors kvtier raises.

Every error a caller can provoke is a :class:`KvTierError`; each message says
what went wrong and what to do about it. Subclasses also inherit the builtin
exception a Python caller would expect (``ValueError`` for bad arguments,
``LookupError`` for unknown ids) so generic handlers keep working.
"""

from __future__ import annotations


class KvTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvTierError, ValueError):
    """A configuration value is invalid (for example a block size of 0)."""


class BadRequestError(KvTierError, ValueError):
    """A request's input is invalid: empty or negative token ids, bad keys.

    ``param`` names the offending request field, when there is one (the
    server reports it in OpenAI-style error bodies).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownRequestError(KvTierError, LookupError):
    """An operation named a request id the manager does not hold."""

    def __init__(self, request_id: object) -> None:
        super().__init__(
            f"unknown request id {request_id!r}: allocate() it first "
            "(or it was already freed)"
        )
        self.request_id = request_id


class DuplicateRequestError(KvTierError):
    """``allocate`` or ``fork`` named a request id that is already live."""

    def __init__(self, request_id: object) -> None:
        super().__init__(
            f"request id {request_id!r} is already allocated: free() it first or use a new id"
        )
        self.request_id = request_id


class OutOfBlocksError(KvTierError):
    """Not enough free or evictable blocks; nothing was changed."""

    def __init__(self, needed: int, available: int, total: int) -> None:
        super().__init__(
            f"out of KV blocks: need {needed}, only {available} of {total} are free or "
            "evictable; free or preempt a request, or configure more blocks"
        )
        self.needed = needed
        self.available = available
        self.total = total


class OversizeError(KvTierError, ValueError):
    """An item is larger than the whole capacity of the cache level asked to hold it.

    Raised at once, before anything changes: no amount of eviction could make
    room for it.
    """

    def __init__(self, size: int, capacity: int) -> None:
        super().__init__(
            f"an item of size {size} cannot fit a cache level of capacity {capacity}: "
            "split the item, or give the level more capacity"
        )
        self.size = size
        self.capacity = capacity


class AdmissionRejectedError(KvTierError):
    """Admission control declined a new request (memory pressure).

    ``mode`` names the pressure mode that declined it; ``retry`` is true when
    that mode only delays admissions, so the same request may pass soon.
    """

    def __init__(self, message: str, *, mode: str | None = None, retry: bool = False) -> None:
        super().__init__(message)
        self.mode = mode
        self.retry = retry


class MonitorUnavailableError(KvTierError):
    """A memory monitor's library or device is absent; pick another source."""


class TierUnavailableError(KvTierError):
    """A storage tier (disk, Redis, ...) cannot be reached."""


class TierFullError(TierUnavailableError):
    """A storage tier has no room for a write (disk full, quota, file-size limit).

    A subclass of :class:`TierUnavailableError`, so every caller that fails soft on an
    unreachable tier fails soft on a full one too; the tier's health tells them apart
    (reads still work, and the outage is not one of reachability).
    """


class CorruptBlockError(KvTierError):
    """A stored block failed its checksum or header check; it is never served."""


class MigrationError(KvTierError):
    """A request could not move to another engine or device; it stays where it was."""


class InternalInvariantError(KvTierError, AssertionError):
    """kvtier's own bookkeeping is inconsistent: a bug; please report it."""
