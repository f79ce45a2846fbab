"""The device's event port: evict listeners, the journal of stored / removed blocks, KV events.

The manager's journal must say exactly which blocks became cached (with
their parent and token ids) and which left, in order; any number of evict
listeners hear of evictions (one that raises is isolated); a live server
started with ``kv_events`` publishes them in vLLM's schema and framing, and
vLLM's own ``KVEventBatch`` decodes what a subscriber receives.
"""

from __future__ import annotations

from typing import Any

import pytest
from needs import need_module

from kvtier import KVCacheManager
from kvtier.pool import CLEARED, REMOVED, STORED

BS = 4


def tokens(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


def test_the_journal_records_stored_blocks_with_parents_and_tokens() -> None:
    m = KVCacheManager(16, BS)
    m.record_events()
    a = tokens(100, 3 * BS + 1)
    m.allocate("a", a)
    keys = m.block_keys("a")
    assert m.take_events() == [(STORED, keys, -1, a[: 3 * BS])]
    m.extend("a", tokens(500, BS - 1))  # completes block 4
    keys4 = m.block_keys("a")
    assert m.take_events() == [(STORED, [keys4[3]], keys[2], [a[12], 500, 501, 502])]
    m.free("a")
    # The same prompt again: every full block a hit, nothing new is stored.
    m.allocate("b", a)
    assert m.take_events() == []
    m.free("b")
    assert m.take_events() == []


def test_duplicates_are_not_stored_again_and_runs_keep_their_parent() -> None:
    m = KVCacheManager(32, BS)
    m.record_events()
    shared = tokens(7, 2 * BS)
    m.allocate("a", [*shared, 1])
    m.allocate("b", [*shared, *tokens(300, BS), 2])  # shares a's two blocks
    events = m.take_events()
    b_keys = m.block_keys("b")
    assert events[-1] == (STORED, [b_keys[2]], b_keys[1], tokens(300, BS))


def test_evictions_withdrawals_and_a_reset_are_removed_and_cleared() -> None:
    m = KVCacheManager(6, BS)
    m.record_events()
    m.allocate("a", tokens(0, 5 * BS + 1))
    a_keys = m.block_keys("a")
    m.free("a")
    m.take_events()
    m.allocate("b", tokens(1000, 3 * BS + 1))  # needs 4 blocks: a's tail blocks go
    events = m.take_events()
    removed = [k for kind, ks, _, _ in events if kind == REMOVED for k in ks]
    assert removed == a_keys[::-1][: len(removed)] and len(removed) >= 3
    assert events[-1][0] == STORED
    m.abort("b", 0)  # nothing computed: b's published blocks are withdrawn
    events = m.take_events()
    assert [kind for kind, *_ in events] == [REMOVED]
    m.reset_prefix_cache()
    assert m.take_events()[-1][0] == CLEARED
    m.check()


def test_many_evict_listeners_and_one_that_raises() -> None:
    m = KVCacheManager(4, BS)
    heard: list[list[int]] = []

    def broken(keys: list[int], blocks: list[int]) -> None:
        raise RuntimeError("listener bug")

    m.add_evict_listener(broken)
    m.add_evict_listener(lambda keys, blocks: heard.append(list(keys)))
    m.allocate("a", tokens(0, 3 * BS + 1))
    a_keys = m.block_keys("a")
    m.free("a")
    m.allocate("b", tokens(900, 3 * BS + 1))  # evicts a's blocks
    assert heard and set(heard[0]) <= set(a_keys)
    assert m.pool.listener_errors == 1
    m.remove_evict_listener(broken)
    m.check()


def test_free_and_drop_leaves_the_device_at_once() -> None:
    m = KVCacheManager(8, BS)
    m.allocate("a", tokens(0, 2 * BS + 2))
    m.allocate("b", tokens(0, 2 * BS + 2))  # holds a's two full blocks too
    assert m.free_and_drop("a") == 0  # b still holds the cached blocks
    assert m.stats().cached_blocks == 2
    assert m.free_and_drop("b") == 2  # now nobody does: they leave at once
    assert m.stats().cached_blocks == 0 and m.stats().empty_blocks == 8
    m.check()


def test_a_live_server_publishes_kv_events_vllm_decodes() -> None:
    kv_events = need_module("vllm.distributed.kv_events", "run `make venv` (installs vLLM)")
    msgspec = need_module("msgspec")
    zmq = need_module("zmq")
    need_module("torch")
    from serving import MODEL, serving
    from tiny_model import tiny_engine

    engine = tiny_engine(num_blocks=64, block_size=4, kv_events="tcp://127.0.0.1:0")
    endpoint = engine.events.endpoint
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 30_000)
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    stored: list[Any] = []
    try:
        with serving(engine) as server:
            client = server.client()
            # A subscriber joins asynchronously: ask until events reach it.
            for _ in range(50):
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "events please " * 3}],
                    max_tokens=2,
                    temperature=0,
                )
                try:
                    while True:
                        topic, seq, payload = sub.recv_multipart(flags=zmq.NOBLOCK)
                        # vLLM's default topic, the one vllm-router's static sources match.
                        assert topic == b"" and len(seq) == 8
                        batch = decoder.decode(payload)
                        stored += [
                            e for e in batch.events if isinstance(e, kv_events.BlockStored)
                        ]
                except zmq.Again:
                    pass
                if stored:
                    break
    finally:
        sub.close(linger=0)
    assert stored, "no BlockStored reached the subscriber"
    prompt = engine.encode_chat([{"role": "user", "content": "events please " * 3}])
    keys = engine.manager.hasher.chain(prompt)
    first = stored[0]
    assert first.block_size == 4 and first.medium == "GPU"
    assert first.block_hashes == [k.to_bytes(16, "big") for k in keys[: len(first.block_hashes)]]
    assert first.token_ids == prompt[: 4 * len(first.block_hashes)]


@pytest.mark.parametrize("on", [True, False])
def test_no_journal_without_recording(on: bool) -> None:
    m = KVCacheManager(8, BS)
    m.record_events(on)
    m.allocate("a", tokens(0, BS + 1))
    assert bool(m.take_events()) is on
    assert m.pool.journal is None or m.pool.journal == []
