"""Reading the KV events an instance publishes (``kvtier serve --kv-events``) off ZeroMQ.

The wire format is vLLM's, as :mod:`kvtier.integrations.vllm.events` sends
it: a multipart message ``(topic, sequence, payload)``, the sequence number
as 8 big-endian bytes counting from 0 and the payload a msgpack
``KVEventBatch``: an array ``[ts, events, data_parallel_rank]`` whose events
are maps tagged by ``type`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``). Block hashes are bytes (kvtier's 128-bit keys, big
endian) or ints. :func:`decode_batch` turns a payload into
:mod:`kvtier.events` events, the media named as kvtier names them.

:class:`SequenceTracker` follows one instance's sequence numbers: a number
lower than the last one means the instance restarted (its cache is empty),
a jump means batches were lost (the index of that instance may be stale).

:func:`subscriber_endpoint` works out how the router reaches an instance's
publisher from the endpoint the instance was given: vLLM's rule binds a
wildcard (``tcp://*:5557``), ``ipc://`` or ``inproc://`` endpoint and connects
to any other, so the router connects to the first kind and binds the second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvtier.errors import ConfigError
from kvtier.events import AllCleared, BlocksRemoved, BlocksStored, KvEvent

#: vLLM's medium names -> kvtier's (``None``: vLLM's engines leave it out for the GPU).
_MEDIA = {"GPU": "device", None: "device", "CPU": "host"}


class EventFormatError(ValueError):
    """A payload that is not a KV event batch."""


def _key(value: object) -> int:
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise EventFormatError(f"a block hash must be bytes or an int, got {type(value).__name__}")


def _keys(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise EventFormatError("block_hashes must be a list")
    return tuple(_key(v) for v in value)


def _medium(value: object, locality: object) -> str:
    if value == "STORAGE":
        return "redis" if locality == "REMOTE" else "disk"
    found = _MEDIA.get(value if isinstance(value, str) else None)
    return found if found is not None else str(value).lower()


def _event(raw: object) -> KvEvent | None:
    if not isinstance(raw, dict):
        raise EventFormatError("an event must be a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        tokens = raw.get("token_ids") or []
        size = raw.get("block_size")
        parent = raw.get("parent_block_hash")
        lora = raw.get("lora_id")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise EventFormatError("token_ids must be a list of ints")
        return BlocksStored(
            _keys(raw.get("block_hashes")),
            medium=_medium(raw.get("medium"), raw.get("locality")),
            parent=None if parent is None else _key(parent),
            token_ids=tuple(tokens),
            block_size=size if isinstance(size, int) and not isinstance(size, bool) else None,
            lora_id=lora if isinstance(lora, int) else None,
        )
    if kind == "BlockRemoved":
        return BlocksRemoved(
            _keys(raw.get("block_hashes")), _medium(raw.get("medium"), raw.get("locality"))
        )
    if kind == "AllBlocksCleared":
        return AllCleared()
    return None  # a kind this router does not know: nothing it can use


def decode_batch(payload: bytes) -> list[KvEvent]:
    """The events of one ``KVEventBatch`` payload; :class:`EventFormatError` if it is not one."""
    try:
        batch: Any = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventFormatError("a KV event batch is an array [ts, events, ...]")
    return [e for e in map(_event, batch[1]) if e is not None]


def decode_message(frames: Sequence[bytes]) -> tuple[int, list[KvEvent]]:
    """``(sequence, events)`` of a ``(topic, sequence, payload)`` message."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise EventFormatError(
            f"a KV event message has 3 frames, the second 8 bytes; got {len(frames)} frames"
        )
    return int.from_bytes(frames[1], "big"), decode_batch(frames[2])


@dataclass
class SequenceTracker:
    """One publisher's sequence numbers: restarts and lost batches (see the module docstring)."""

    last: int | None = None
    batches: int = 0
    lost: int = 0
    restarts: int = 0

    def see(self, sequence: int) -> str:
        """``"ok"``, ``"restart"`` (below the last: clear the index) or ``"gap"`` (lost some)."""
        last, self.last = self.last, sequence
        self.batches += 1
        if last is None:
            # Joining a running publisher: whatever came before is unknown, not lost.
            return "ok"
        if sequence <= last:
            self.restarts += 1
            return "restart"
        if sequence > last + 1:
            self.lost += sequence - last - 1
            return "gap"
        return "ok"


def subscriber_endpoint(events: str, instance_url: str) -> tuple[str, bool]:
    """``(endpoint, bind)``: how the router's SUB socket meets the instance's ``--kv-events``."""
    scheme, sep, rest = events.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        raise ConfigError(
            f"a KV event endpoint is tcp://HOST:PORT, ipc://PATH or inproc://NAME, got "
            f"{events!r}: give the endpoint the instance got with --kv-events"
        )
    if scheme != "tcp":
        return events, False
    host, _, port_text = rest.rpartition(":")
    if not port_text.isdigit() or not host:
        raise ConfigError(f"the KV event endpoint {events!r} has no host:port")
    if port_text == "0":
        raise ConfigError(
            f"{events!r}: with port 0 the instance binds a port the router cannot know; "
            "give the instance a fixed port (--kv-events tcp://*:5557)"
        )
    if "*" in host or "::" in host:  # the publisher's own test for binding
        # The instance binds every address: reach it where its HTTP server is.
        where = urlsplit(instance_url).hostname or "127.0.0.1"
        if ":" in where:
            where = f"[{where}]"
        return f"tcp://{where}:{port_text}", False
    # The instance connects to this address: the router listens there.
    return events, True


__all__ = [
    "EventFormatError",
    "SequenceTracker",
    "decode_batch",
    "decode_message",
    "subscriber_endpoint",
]
