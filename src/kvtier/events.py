"""KV events: which blocks became cached on a medium, which left, and "all left".

kvtier reports the blocks it holds as three kinds of event, whoever listens:

* :class:`BlocksStored`: blocks (a chain, parent first) became cached on a
  medium, with the key of the block before the first and, for the device,
  their token ids;
* :class:`BlocksRemoved`: blocks left a medium;
* :class:`AllCleared`: every cached block left;
* :class:`BlocksPinned`: a retention pin (a session's ``cache_ttl_s``)
  keeps blocks on a tier until a time. kvtier's own stream only: vLLM's wire
  format has no such event, so the ZeroMQ publisher leaves it out (what a
  router decodes is unchanged), and only a sink that implements
  :meth:`SinkBase.pinned` (:class:`MemorySink`) sees it.

They come from two journals: the device's (a :class:`~kvtier.KVCacheManager`
with ``record_events()`` on; :func:`device_events` reads it) and the tiers'
(the :class:`~kvtier.offload.OffloadingEvent` s of an offloading manager or a
tier chain, and their pin events; :func:`tier_events` reads them).

Publishers are sinks. An engine holds one :class:`EventSink`, drains both
journals into it after each step (``drain_device``, ``drain``), then
``flush`` es it. :class:`SinkBase` does the draining: a sink built on it
implements ``stored``, ``removed``, ``cleared``, ``flush`` and ``close``.

:func:`make_event_sink` makes a sink for an endpoint URL, chosen by its
scheme: ``memory://`` keeps the events in memory (:class:`MemorySink`);
``tcp://``, ``ipc://`` and ``inproc://`` publish them in vLLM's wire format
over ZeroMQ (:class:`kvtier.integrations.vllm.events.KvEventPublisher`). A
sink's module registers its schemes with :func:`register_event_sink` when it
is imported; :data:`SINK_MODULES` names the module of each shipped scheme, so
that a sink is found without its caller importing it first. The name is data,
not an import: this module imports nothing above it.
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.errors import ConfigError
from kvtier.pool import CLEARED, STORED

if TYPE_CHECKING:
    from kvtier.offload.manager import OffloadingEvent, PinEvent


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Blocks (a chain, parent first) that became cached on ``medium``."""

    keys: tuple[int, ...]
    medium: str = "device"
    #: The key of the block before the first (``None``: the chain starts at a root).
    parent: int | None = None
    #: The blocks' tokens, ``block_size`` per block; empty when not known.
    token_ids: tuple[int, ...] = ()
    block_size: int | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Blocks that left ``medium``."""

    keys: tuple[int, ...]
    medium: str = "device"


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Every cached block left."""


@dataclass(frozen=True, slots=True)
class BlocksPinned:
    """Blocks of ``medium`` a retention pin keeps until ``until`` (the engine's clock);
    they are evicted after every unpinned block there until then."""

    keys: tuple[int, ...]
    until: float
    medium: str = "device"


KvEvent = BlocksStored | BlocksRemoved | AllCleared | BlocksPinned


class DeviceJournal(Protocol):
    """The device's journal: a :class:`~kvtier.KVCacheManager` recording events."""

    @property
    def block_size(self) -> int: ...

    def take_events(self) -> list[tuple[int, list[int], int, list[int]]]: ...


class TierJournal(Protocol):
    """The tiers' journal: an offloading manager or a tier chain (whose
    ``take_all_events()``, when it has one, gives its pin events too)."""

    def take_events(self) -> Iterable[OffloadingEvent]: ...


def device_events(journal: DeviceJournal, *, lora_id: int | None = None) -> list[KvEvent]:
    """The device's events since the last call (``journal.take_events()``)."""
    block_size = journal.block_size
    out: list[KvEvent] = []
    for kind, keys, parent, tokens in journal.take_events():
        if kind == STORED:
            out.append(
                BlocksStored(
                    tuple(keys),
                    parent=None if parent < 0 else parent,
                    token_ids=tuple(tokens),
                    block_size=block_size,
                    lora_id=lora_id,
                )
            )
        elif kind == CLEARED:
            out.append(AllCleared())
        else:
            out.append(BlocksRemoved(tuple(keys)))
    return out


def tier_event(event: OffloadingEvent | PinEvent) -> KvEvent:
    """The KV event of one offloading event (or pin event)."""
    if not hasattr(event, "removed"):
        return BlocksPinned(tuple(event.keys), event.until, event.medium)
    if event.removed:
        return BlocksRemoved(tuple(event.keys), event.medium)
    return BlocksStored(tuple(event.keys), event.medium)


def tier_events(events: Iterable[OffloadingEvent | PinEvent]) -> list[KvEvent]:
    """The KV events of offloading events (those with no keys are dropped)."""
    return [tier_event(ev) for ev in events if ev.keys]


class EventSink(Protocol):
    """What an engine holds to publish its KV events."""

    @property
    def endpoint(self) -> str: ...

    def drain_device(self, manager: DeviceJournal, *, lora_id: int | None = None) -> int: ...

    def drain(self, source: TierJournal) -> int: ...

    def flush(self) -> int | None: ...

    def close(self) -> None: ...


class SinkBase(ABC):
    """A sink that queues events one kind at a time; draining the journals is done here."""

    @abstractmethod
    def stored(
        self,
        keys: Sequence[int],
        *,
        medium: str = "device",
        parent: int | None = None,
        token_ids: Sequence[int] = (),
        block_size: int | None = None,
        lora_id: int | None = None,
    ) -> Any:
        """Queue a :class:`BlocksStored`."""

    @abstractmethod
    def removed(self, keys: Sequence[int], *, medium: str = "device") -> Any:
        """Queue a :class:`BlocksRemoved`."""

    @abstractmethod
    def cleared(self) -> Any:
        """Queue an :class:`AllCleared`."""

    @abstractmethod
    def flush(self) -> int | None:
        """Send what is queued; the batch's sequence number, or ``None`` if nothing was."""

    @abstractmethod
    def close(self) -> None:
        """Release the sink (events queued and not flushed are dropped)."""

    def emit(self, event: KvEvent) -> Any:
        """Queue ``event``, whatever its kind."""
        if isinstance(event, BlocksStored):
            return self.stored(
                event.keys,
                medium=event.medium,
                parent=event.parent,
                token_ids=event.token_ids,
                block_size=event.block_size,
                lora_id=event.lora_id,
            )
        if isinstance(event, BlocksRemoved):
            return self.removed(event.keys, medium=event.medium)
        if isinstance(event, BlocksPinned):
            return self.pinned(event.keys, event.until, medium=event.medium)
        return self.cleared()

    def pinned(self, keys: Sequence[int], until: float, *, medium: str = "device") -> Any:
        """Queue a :class:`BlocksPinned`; a sink that cannot carry it leaves it out (the
        default: vLLM's wire format has no such event)."""
        return None

    def drain_device(self, manager: DeviceJournal, *, lora_id: int | None = None) -> int:
        """Queue the device's events since the last call; returns how many.

        ``manager`` is a :class:`~kvtier.KVCacheManager` with ``record_events()`` on.
        """
        events = device_events(manager, lora_id=lora_id)
        for event in events:
            self.emit(event)
        return len(events)

    def add(self, event: OffloadingEvent | PinEvent) -> Any:
        """Queue the KV event of one :class:`~kvtier.offload.OffloadingEvent`."""
        return self.emit(tier_event(event))

    def extend(self, events: Iterable[OffloadingEvent | PinEvent]) -> int:
        """Queue many offloading events (those with keys); returns how many."""
        queued = tier_events(events)
        for event in queued:
            self.emit(event)
        return len(queued)

    def drain(self, source: TierJournal) -> int:
        """Queue ``source``'s events (an offloading manager, a tier chain): its
        ``take_all_events()`` (pin events among them) if it has one, else ``take_events()``."""
        take_all = getattr(source, "take_all_events", None)
        return self.extend(take_all() if take_all is not None else source.take_events())


class MemorySink(SinkBase):
    """Keeps the events: :attr:`pending` until a flush moves them to :attr:`batches`.

    For tests and for a process that reads its own events; ``memory://`` (the
    rest of the URL is a name, reported as :attr:`endpoint`).
    """

    def __init__(self, endpoint: str = "memory://", *, topic: str = "", block_size: int = 0):
        if block_size < 0:
            raise ConfigError(f"block_size must be >= 0, got {block_size}")
        self.endpoint = endpoint
        self.topic = topic
        self.block_size = block_size
        self.pending: list[KvEvent] = []
        self.batches: list[list[KvEvent]] = []
        self.closed = False
        self._lock = threading.Lock()

    def _push(self, event: KvEvent) -> KvEvent:
        with self._lock:
            self.pending.append(event)
        return event

    def stored(
        self,
        keys: Sequence[int],
        *,
        medium: str = "device",
        parent: int | None = None,
        token_ids: Sequence[int] = (),
        block_size: int | None = None,
        lora_id: int | None = None,
    ) -> KvEvent:
        size = self.block_size if block_size is None else block_size
        return self._push(
            BlocksStored(tuple(keys), medium, parent, tuple(token_ids), size, lora_id)
        )

    def removed(self, keys: Sequence[int], *, medium: str = "device") -> KvEvent:
        return self._push(BlocksRemoved(tuple(keys), medium))

    def cleared(self) -> KvEvent:
        return self._push(AllCleared())

    def pinned(self, keys: Sequence[int], until: float, *, medium: str = "device") -> KvEvent:
        return self._push(BlocksPinned(tuple(keys), until, medium))

    def flush(self) -> int | None:
        with self._lock:
            if self.closed:
                raise ConfigError("the KV event sink is closed")
            if not self.pending:
                return None
            self.batches.append(self.pending)
            self.pending = []
            return len(self.batches) - 1

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.pending = []

    def __repr__(self) -> str:
        return f"MemorySink({self.endpoint!r}, batches={len(self.batches)})"


SinkFactory = Callable[..., EventSink]

_SINKS: dict[str, SinkFactory] = {"memory": MemorySink}
#: Shipped sinks registered by their own modules: URL scheme -> the module to import.
SINK_MODULES: dict[str, str] = {
    "tcp": "kvtier.integrations.vllm.events",
    "ipc": "kvtier.integrations.vllm.events",
    "inproc": "kvtier.integrations.vllm.events",
}


def register_event_sink(scheme: str, factory: SinkFactory) -> None:
    """Make ``factory(url, **options)`` the sink of ``scheme://`` URLs."""
    key = scheme.lower()
    if key in _SINKS and _SINKS[key] is not factory:
        raise ConfigError(f"a KV event sink for {scheme}:// is already registered")
    _SINKS[key] = factory


def event_sink_schemes() -> list[str]:
    """The URL schemes a sink can be made for."""
    return sorted({*_SINKS, *SINK_MODULES})


def make_event_sink(url: str, **options: Any) -> EventSink:
    """A new sink for ``url`` (``tcp://*:5557``, ``memory://``); ``options`` go to its factory."""
    scheme, sep, _ = url.partition("://")
    key = scheme.lower()
    if not sep or not key:
        raise ConfigError(
            f"a KV event endpoint is a URL ({', '.join(s + '://' for s in event_sink_schemes())}),"
            f" got {url!r}"
        )
    factory = _SINKS.get(key)
    if factory is None and key in SINK_MODULES:
        importlib.import_module(SINK_MODULES[key])
        factory = _SINKS.get(key)
    if factory is None:
        raise ConfigError(
            f"no KV event sink for {scheme}:// URLs: use one of "
            f"{', '.join(s + '://' for s in event_sink_schemes())}"
        )
    return factory(url, **options)


__all__ = [
    "SINK_MODULES",
    "AllCleared",
    "BlocksRemoved",
    "BlocksStored",
    "DeviceJournal",
    "EventSink",
    "KvEvent",
    "MemorySink",
    "SinkBase",
    "SinkFactory",
    "TierJournal",
    "device_events",
    "event_sink_schemes",
    "make_event_sink",
    "register_event_sink",
    "tier_event",
    "tier_events",
]
