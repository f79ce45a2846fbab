"""KvEventPublisher: kvtier's KV events in vLLM's schema and ZeroMQ framing."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from needs import need_module

zmq = need_module("zmq")
msgspec = need_module("msgspec")

from kvtier import ConfigError  # noqa: E402
from kvtier.integrations.vllm import events as ev  # noqa: E402
from kvtier.integrations.vllm.events import KvEventPublisher  # noqa: E402
from kvtier.offload import OffloadingEvent, OffloadingManager  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def b16(key: int) -> bytes:
    return key.to_bytes(16, "big")


def connect(pub: KvEventPublisher, topic: str) -> tuple[Any, int]:
    """A SUB socket that receives ``pub``'s batches; returns it and the last probe's sequence."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(pub.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    # PUB drops messages until the subscription arrives: probe until one lands,
    # then drain the probes still in flight.
    deadline = time.monotonic() + 10
    last = -1
    while last < 0:
        assert time.monotonic() < deadline, "subscriber never connected"
        pub.publish([pub.schema.cleared()])
        if sub.poll(50):
            last = int.from_bytes(sub.recv_multipart()[1], "big")
    while sub.poll(200):
        last = int.from_bytes(sub.recv_multipart()[1], "big")
    return sub, last


def test_vllm_subscriber_decodes_exact_events() -> None:
    kv_events = need_module("vllm.distributed.kv_events")
    port = free_port()
    with KvEventPublisher(
        f"tcp://127.0.0.1:{port}", bind=True, topic="kvtier", block_size=16
    ) as pub:
        assert pub.schema.source == "vllm"
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        sub, last = connect(pub, "kvtier")
        try:
            # A host tier of two blocks: store 1 2, then 3 evicts 1.
            host = OffloadingManager(2, "lru", medium="host")
            out = host.prepare_store([1, 2])
            assert out is not None
            host.complete_store(out.keys_to_store)
            out = host.prepare_store([3])
            assert out is not None and out.evicted_keys == [1]
            host.complete_store(out.keys_to_store)
            assert pub.drain(host) == 3
            # The device cached a two-block chain below block 9, then evicted one.
            pub.stored([10, 11], parent=9, token_ids=range(8), block_size=4, medium="device")
            pub.removed([10], medium="device")
            pub.removed([2 << 100], medium="redis")
            pub.cleared()
            assert pub.pending == 7
            seq = pub.flush(ts=1234.5)
            assert seq == last + 1 and pub.pending == 0 and pub.flush() is None

            topic, seq_bytes, payload = sub.recv_multipart()
        finally:
            sub.close(linger=0)
    assert topic == b"kvtier"
    assert len(seq_bytes) == 8 and int.from_bytes(seq_bytes, "big") == last + 1
    batch = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch).decode(payload)
    assert batch.ts == 1234.5 and batch.data_parallel_rank == 0
    stored = kv_events.BlockStored
    removed = kv_events.BlockRemoved
    assert batch.events == [
        stored(block_hashes=[b16(1), b16(2)], parent_block_hash=None, token_ids=[],
               block_size=16, lora_id=None, medium="CPU", lora_name=None),
        removed(block_hashes=[b16(1)], medium="CPU"),
        stored(block_hashes=[b16(3)], parent_block_hash=None, token_ids=[],
               block_size=16, lora_id=None, medium="CPU", lora_name=None),
        stored(block_hashes=[b16(10), b16(11)], parent_block_hash=b16(9),
               token_ids=list(range(8)), block_size=4, lora_id=None, medium="GPU",
               lora_name=None),
        removed(block_hashes=[b16(10)], medium="GPU"),
        removed(block_hashes=[b16(2 << 100)], medium="STORAGE", locality="REMOTE"),
        kv_events.AllBlocksCleared(),
    ]


def test_local_structs_encode_the_same_bytes_as_vllms() -> None:
    need_module("vllm.distributed.kv_events")

    def batch(pub: KvEventPublisher) -> bytes:
        pub.stored([1, 2], parent=7, token_ids=[5, 6, 7, 8], block_size=2, lora_id=3,
                   lora_name="ad", group_idx=0)
        pub.stored([4], medium="disk")
        pub.removed([1, 2], medium="host", group_idx=1)
        pub.cleared()
        with pub._lock:
            events, pub._pending = pub._pending, []
        return pub.encode(events, ts=99.0)

    with (
        KvEventPublisher("inproc://kvtier-a", structs="local") as a,
        KvEventPublisher("inproc://kvtier-b", structs="vllm") as b,
    ):
        assert (a.schema.source, b.schema.source) == ("local", "vllm")
        assert batch(a) == batch(b)
    for fmt in ("bytes", "int64"):
        with (
            KvEventPublisher(f"inproc://kvtier-c-{fmt}", structs="local", hash_format=fmt) as a,
            KvEventPublisher(f"inproc://kvtier-d-{fmt}", structs="vllm", hash_format=fmt) as b,
        ):
            assert batch(a) == batch(b)


def test_local_decoder_and_int64_hashes() -> None:
    with KvEventPublisher("inproc://kvtier-e", structs="local", hash_format="int64",
                          data_parallel_rank=3) as pub:
        assert pub.schema.source == "local"
        big = (1 << 127) | 5
        pub.extend([OffloadingEvent((big,), "disk", False), OffloadingEvent((), "host", True)])
        with pub._lock:
            events = list(pub._pending)
        payload = pub.encode(events, ts=1.0)
    batch = msgspec.msgpack.Decoder(type=ev.KVEventBatch).decode(payload)
    assert batch.data_parallel_rank == 3
    assert batch.events == [
        ev.BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[], block_size=0,
                       lora_id=None, medium="STORAGE", lora_name=None, locality="LOCAL"),
    ]
    # The wire form: an array batch, map events tagged with the class name.
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 1.0 and raw[2] == 3
    assert raw[1][0]["type"] == "BlockStored"


def test_media_and_errors() -> None:
    with KvEventPublisher("inproc://kvtier-f", structs="local",
                          medium_map={"nvme": ("STORAGE", "LOCAL")}) as pub:
        assert pub.removed([1], medium="nvme").locality == "LOCAL"
        assert pub.removed([1], medium="tape").medium == "TAPE"
        assert pub.block_hash(1) == b16(1)
        assert pub.block_hash(1 << 130) == (1 << 130).to_bytes(17, "big")
        assert pub.next_sequence == 0
        assert pub.publish([]) == 0 and pub.next_sequence == 1
    assert pub.closed
    with pytest.raises(ConfigError, match="closed"):
        pub.publish([])
    with pytest.raises(ConfigError):
        KvEventPublisher("inproc://kvtier-g", hash_format="hex")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        KvEventPublisher("inproc://kvtier-h", structs="other")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot bind"):
        KvEventPublisher("tcp://256.0.0.1:1", bind=True, structs="local")


def test_endpoint_rules_follow_vllm() -> None:
    with KvEventPublisher("tcp://127.0.0.1:0", structs="local") as pub:
        # Port 0 binds a free port and reports it.
        assert pub.bound and not pub.endpoint.endswith(":0")
    with KvEventPublisher(f"tcp://127.0.0.1:{free_port()}", structs="local") as pub:
        # A plain address is connected to, as vLLM does.
        assert not pub.bound
