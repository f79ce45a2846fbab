"""kvtier's KV events, published in vLLM's wire format over ZeroMQ.

A router that already follows a vLLM fleet's KV events (which blocks each
engine holds, on which medium) can follow kvtier the same way.
:class:`KvEventPublisher` is the sink (:mod:`kvtier.events`) of ``tcp://``,
``ipc://`` and ``inproc://`` endpoints; it turns kvtier's events into vLLM's
event structs:

* ``stored(keys, ...)`` / ``removed(keys, ...)`` / ``cleared()``: blocks that
  became cached, left, or all left;
* :meth:`KvEventPublisher.drain_device`: the device's events, from a
  :class:`~kvtier.KVCacheManager` recording them (``record_events()``), with
  the token ids of every stored block;
* :meth:`KvEventPublisher.add` / :meth:`KvEventPublisher.drain`: the
  :class:`kvtier.offload.OffloadingEvent` s of an offloading manager or a tier
  chain (``take_events()``);

and :meth:`KvEventPublisher.flush` sends everything pending as one
``KVEventBatch``, framed as vLLM's ``ZmqEventPublisher`` frames it: a PUB
multipart message ``(topic, sequence, payload)`` with the sequence number as 8
big-endian bytes, counting from 0, and the payload the msgpack encoding of the
batch (``msgspec``). A subscriber decodes it with
``msgspec.msgpack.Decoder(type=vllm.distributed.kv_events.KVEventBatch)``.

The structs are vLLM's own classes when ``vllm.distributed.kv_events``
imports (``structs="auto"`` or ``"vllm"``), otherwise local classes of the
same names, fields, field order, tags and encoding options
(``structs="local"``, or ``auto`` without vLLM); both encode to the same
bytes. Only ``pyzmq`` and ``msgspec`` are needed.

Block keys: kvtier's keys are 128-bit ints, wider than a msgpack int, so by
default a key is sent as 16 big-endian bytes (vLLM's default ``bytes`` block
hashes); ``hash_format="int64"`` sends its low 64 bits instead, which is what
vLLM sends with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``. Media: kvtier's
``device`` is vLLM's ``GPU``, ``host`` is ``CPU``, ``disk`` is ``STORAGE``
(``LOCAL``) and ``redis`` is ``STORAGE`` (``REMOTE``); ``medium_map``
overrides or extends this.

Not implemented: vLLM's optional replay (ROUTER) socket and its background
publishing thread; :meth:`KvEventPublisher.flush` sends synchronously (a PUB
socket never blocks: past the high-water mark it drops).

The socket is an XPUB (a PUB that also hears subscriptions; subscribers see
no difference), so that :meth:`KvEventPublisher.hold_until_subscribed` can
keep a process's first batches until a subscriber has joined. Without it a
restarted instance's first batch (``kvtier serve`` opens with
``AllBlocksCleared`` and its warm tiers' blocks) goes out before the routers'
SUB sockets have reconnected, and ZeroMQ drops it: the routers keep the dead
process's blocks.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from kvtier.errors import ConfigError
from kvtier.events import SinkBase, register_event_sink
from kvtier.integrations.errors import MissingDependencyError

try:
    import msgspec
    import zmq
except ImportError as _exc:  # pragma: no cover - exercised only without the packages
    raise MissingDependencyError(
        f"kvtier's KV event publisher needs pyzmq and msgspec ({_exc}): "
        "pip install pyzmq msgspec, or pip install 'kvtier[vllm]'"
    ) from _exc

ExternalBlockHash = bytes | int
HashFormat = Literal["bytes", "int64"]
Structs = Literal["auto", "vllm", "local"]

_M64 = (1 << 64) - 1

#: kvtier medium -> (vLLM medium, locality).
DEFAULT_MEDIA: dict[str, tuple[str, str | None]] = {
    "device": ("GPU", None),
    "gpu": ("GPU", None),
    "host": ("CPU", None),
    "cpu": ("CPU", None),
    "disk": ("STORAGE", "LOCAL"),
    "redis": ("STORAGE", "REMOTE"),
}


# -- vLLM's event schema, locally ------------------------------------------------------------
# Same class names (the msgpack tags), fields, order and options as
# vllm/distributed/kv_events.py in vLLM 0.33.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class _Schema:
    """The four classes events are built from, and where they come from."""

    def __init__(self, source: str, module: Any) -> None:
        self.source = source
        self.batch: Any = module.KVEventBatch
        self.stored: Any = module.BlockStored
        self.removed: Any = module.BlockRemoved
        self.cleared: Any = module.AllBlocksCleared


class _LocalModule:
    KVEventBatch = KVEventBatch
    BlockStored = BlockStored
    BlockRemoved = BlockRemoved
    AllBlocksCleared = AllBlocksCleared


def load_schema(structs: Structs = "auto") -> _Schema:
    """vLLM's event classes (``"vllm"``; ``"auto"`` when they import) or the local ones."""
    if structs not in ("auto", "vllm", "local"):
        raise ConfigError(f"structs must be 'auto', 'vllm' or 'local', got {structs!r}")
    if structs == "local" or (structs == "auto" and importlib.util.find_spec("vllm") is None):
        return _Schema("local", _LocalModule)
    try:
        module = importlib.import_module("vllm.distributed.kv_events")
    except Exception as exc:
        if structs == "vllm":
            from kvtier.integrations.errors import UnsupportedVllmError

            raise UnsupportedVllmError(
                f"vllm.distributed.kv_events does not import ({type(exc).__name__}: {exc}); "
                "use structs='local' (the same wire format)"
            ) from exc
        return _Schema("local", _LocalModule)
    return _Schema("vllm", module)


class KvEventPublisher(SinkBase):
    """Publishes kvtier's KV events as vLLM ``KVEventBatch`` es on a ZeroMQ PUB socket.

    ``endpoint`` follows vLLM's rule: a wildcard (``tcp://*:5557``), ``ipc://``
    or ``inproc://`` endpoint is bound, any other is connected to; ``bind``
    overrides it (``tcp://127.0.0.1:5557`` with ``bind=True``). A tcp port of
    0 binds a free port; :attr:`endpoint` reports the one bound.
    ``data_parallel_rank`` is stamped on every batch (vLLM stamps its rank, 0
    by default). ``block_size`` is reported in the stored events made from
    offloading events (tokens per block; vLLM reports 0 when it does not know).
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        topic: str = "",
        bind: bool | None = None,
        data_parallel_rank: int | None = 0,
        block_size: int = 0,
        hash_format: HashFormat = "bytes",
        medium_map: Mapping[str, tuple[str, str | None]] | None = None,
        structs: Structs = "auto",
        hwm: int = 100_000,
        linger_ms: int = 1000,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if hash_format not in ("bytes", "int64"):
            raise ConfigError(f"hash_format must be 'bytes' or 'int64', got {hash_format!r}")
        if block_size < 0:
            raise ConfigError(f"block_size must be >= 0, got {block_size}")
        self.schema = load_schema(structs)
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank
        self.block_size = block_size
        self.hash_format: HashFormat = hash_format
        self.media = {**DEFAULT_MEDIA, **(medium_map or {})}
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()
        self._pending: list[Any] = []
        self._seq = 0
        self._linger = linger_ms
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = self._ctx.socket(zmq.XPUB)
        self._sock.set_hwm(hwm)
        #: Whether a subscription has been heard since the socket opened.
        self.subscribed = False
        # hold_until_subscribed: events kept (at most this many) until a subscriber joins.
        self._hold: list[Any] | None = None
        self._hold_max = 0
        port0 = endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] == "0"
        if bind is None:
            bind = port0 or "*" in endpoint or "::" in endpoint or endpoint.startswith(
                ("ipc://", "inproc://")
            )
        try:
            if bind:
                self._sock.bind(endpoint)
                endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
            else:
                self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            self._sock = None
            verb = "bind" if bind else "connect"
            raise ConfigError(f"cannot {verb} {endpoint!r}: {exc}") from exc
        #: The endpoint bound or connected to.
        self.endpoint = endpoint
        self.bound = bind

    # -- building events ---------------------------------------------------------------------
    def block_hash(self, key: int) -> ExternalBlockHash:
        """A kvtier key as vLLM's ``ExternalBlockHash`` in this publisher's format."""
        if self.hash_format == "int64":
            return key & _M64
        return key.to_bytes(max(16, (key.bit_length() + 7) >> 3), "big")

    def _medium(self, medium: str) -> tuple[str, str | None]:
        found = self.media.get(medium) or self.media.get(medium.lower())
        return found if found is not None else (medium.upper(), None)

    def _push(self, event: Any) -> Any:
        with self._lock:
            self._pending.append(event)
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
        lora_name: str | None = None,
        group_idx: int | None = None,
    ) -> Any:
        """Queue a ``BlockStored`` for ``keys`` (a chain, parent first) on ``medium``.

        ``token_ids`` are the blocks' tokens (``block_size`` per block), empty
        when not known; ``parent`` is the key of the block before the first.
        """
        vllm_medium, locality = self._medium(medium)
        h = self.block_hash
        return self._push(
            self.schema.stored(
                block_hashes=[h(k) for k in keys],
                parent_block_hash=None if parent is None else h(parent),
                token_ids=list(token_ids),
                block_size=self.block_size if block_size is None else block_size,
                lora_id=lora_id,
                medium=vllm_medium,
                lora_name=lora_name,
                group_idx=group_idx,
                locality=locality,
            )
        )

    def removed(
        self, keys: Sequence[int], *, medium: str = "device", group_idx: int | None = None
    ) -> Any:
        """Queue a ``BlockRemoved`` for ``keys`` on ``medium``."""
        vllm_medium, locality = self._medium(medium)
        h = self.block_hash
        return self._push(
            self.schema.removed(
                block_hashes=[h(k) for k in keys],
                medium=vllm_medium,
                group_idx=group_idx,
                locality=locality,
            )
        )

    def cleared(self) -> Any:
        """Queue an ``AllBlocksCleared``."""
        return self._push(self.schema.cleared())

    # -- sending -----------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Events queued and not sent (held ones included)."""
        with self._lock:
            return len(self._pending) + len(self._hold or ())

    @property
    def next_sequence(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def encode(self, events: Sequence[Any], ts: float | None = None) -> bytes:
        """The msgpack payload of a batch of ``events``."""
        batch = self.schema.batch(
            ts=time.time() if ts is None else ts,
            events=list(events),
            data_parallel_rank=self.data_parallel_rank,
        )
        return self._encoder.encode(batch)

    def hold_until_subscribed(self, max_events: int = 100_000) -> None:
        """Keep what is flushed until a subscriber has joined, then send it as one batch.

        A PUB socket drops what it sends while nobody is subscribed; a
        restarted process's first events (its ``AllBlocksCleared``) would be
        lost to the routers whose SUB sockets have not reconnected yet. Past
        ``max_events`` held, the oldest are dropped and the batch starts with an
        ``AllBlocksCleared`` (a subscriber then under-reports what is held,
        never over-reports it). Once a subscriber has joined, later ones join
        a running stream, as with any PUB socket.
        """
        with self._lock:
            if max_events < 1:
                raise ConfigError(f"max_events must be >= 1, got {max_events}")
            if not self._heard():
                self._hold = []
                self._hold_max = max_events

    def _heard(self) -> bool:
        """Whether a subscriber has joined (reads the subscriptions the XPUB queued)."""
        sock = self._sock
        while sock is not None:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frame[:1] == b"\x01":
                self.subscribed = True
        return self.subscribed

    def flush(self, ts: float | None = None) -> int | None:
        """Send the queued events as one batch; its sequence number, or None if none was sent.

        Held events (:meth:`hold_until_subscribed`) go first, once a subscriber joined.
        """
        with self._lock:
            held = self._hold
            if held is not None:
                held += self._pending
                self._pending = []
                if not self._heard():
                    if len(held) > self._hold_max:
                        del held[: len(held) - self._hold_max + 1]
                        held.insert(0, self.schema.cleared())
                    return None
                self._hold = None
                events = held
            else:
                events, self._pending = self._pending, []
            if not events:
                return None
            return self._send(events, ts)

    def publish(self, events: Sequence[Any], ts: float | None = None) -> int:
        """Send ``events`` (vLLM event structs) as one batch now; returns its sequence number."""
        with self._lock:
            return self._send(list(events), ts)

    def _send(self, events: list[Any], ts: float | None) -> int:
        sock = self._sock
        if sock is None:
            raise ConfigError("the KV event publisher is closed")
        payload = self.encode(events, ts)
        seq = self._seq
        sock.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._seq = seq + 1
        return seq

    def close(self) -> None:
        """Close the socket (queued events that were not flushed are dropped)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=self._linger)
                self._sock = None
            self._pending.clear()
            self._hold = None

    @property
    def closed(self) -> bool:
        return self._sock is None

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"KvEventPublisher({self.endpoint!r}, topic={self.topic!r}, "
            f"structs={self.schema.source}, next_sequence={self._seq})"
        )


for _scheme in ("tcp", "ipc", "inproc"):
    register_event_sink(_scheme, KvEventPublisher)
