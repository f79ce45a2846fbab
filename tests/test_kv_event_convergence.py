"""A router's index built from KV events alone stays equal to the server's own truth.

Routers (vllm-router's ``kv_aware``, llm-d, Dynamo, ``kvtier route``) know
which blocks an instance holds only from its KV events. This test runs a
real ``kvtier serve`` (tiny model, a small device cache so blocks are
evicted, a disk tier and a Redis tier) publishing on a fixed ZeroMQ port,
and builds an independent index from the events: kvtier's own router index
(:class:`~kvtier.routing.index.PrefixIndex`) fed by a real SUB socket, with
the router's restart and gap handling (:class:`SequenceTracker`). A seeded
random run of steps (chat requests sharing prefixes, cache resets, restarts
of the server with its disk tier warm or wiped, Redis killed and started
again) ends each step by waiting for the event stream to go quiet and then
comparing the index, medium by medium, with what the server says it holds
(``GET /admin/cache/blocks``).

Two smaller tests pin the pieces the run relies on: the index keeps tier
blocks per medium and ``AllCleared`` empties them, and a publisher told to
hold its first batch delivers it to a subscriber that joins late (a
restarted instance's ``AllBlocksCleared`` used to be dropped by ZeroMQ
before the router's SUB socket had reconnected).

The Redis step checks the events against the server's bookkeeping, not
against Redis: after an outage nobody noticed, both keep the lost keys
until a load misses them or the tier chain reconciles.
"""

from __future__ import annotations

import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from needs import need_module

need_module("zmq")
need_module("msgspec")

import zmq  # noqa: E402

from kvtier.events import AllCleared, BlocksRemoved, BlocksStored  # noqa: E402
from kvtier.integrations.vllm.events import KvEventPublisher  # noqa: E402
from kvtier.routing.events import SequenceTracker, decode_message  # noqa: E402
from kvtier.routing.index import PrefixIndex  # noqa: E402

NAME = "one"
ADMIN = "convergence-admin-key"
SEED = 20261128
#: Seconds without an event that count as a quiet stream (the server flushes idle
#: events every 0.25 s).
QUIET_S = 0.6
#: How long a step may take to converge before the index and the truth are compared.
CONVERGE_S = 20.0
#: The servers' tier recheck interval (--tier-recheck-interval): short, so a run sees it.
RECHECK_S = 0.5

#: Shared prefixes: conversations branch off them, so blocks are shared and evicted.
PREFIXES = [
    "You are a lighthouse keeper. Answer in one word. ",
    "You are a ship's cook; be brief. ",
    "Answer as the harbour master would. ",
]


# -- the pieces the run relies on ------------------------------------------------------------


def test_the_index_keeps_tier_blocks_per_medium_and_a_clear_empties_them() -> None:
    index = PrefixIndex([NAME])
    index.apply(
        NAME,
        [
            BlocksStored((1, 2), "device", None, tuple(range(8)), 4),
            BlocksStored((1, 2, 3), "disk"),
            BlocksStored((9,), "redis"),
            BlocksRemoved((2,), "disk"),
            BlocksRemoved((1,), "device"),
        ],
    )
    inst = index.instance(NAME)
    assert (inst.held("device"), inst.held("disk"), inst.held("redis")) == ({2}, {1, 3}, {9})
    # Tier blocks have no tokens: matching counts the device's blocks only.
    assert index.match(list(range(9)))[NAME] == 0
    index.apply(NAME, [AllCleared(), BlocksStored((3,), "disk")])
    assert (inst.held("device"), inst.held("disk"), inst.held("redis")) == (set(), {3}, set())


def disk_block(key: int) -> BlocksStored:
    # As a tier's block travels: no tokens, the publisher's block size (0: not given).
    return BlocksStored((key,), "disk", None, (), 0)


def test_a_held_first_batch_reaches_a_subscriber_that_joins_late() -> None:
    with KvEventPublisher("tcp://127.0.0.1:0", structs="local") as pub:
        pub.hold_until_subscribed(max_events=3)
        pub.cleared()
        pub.stored([5], medium="disk")
        # Nobody listens yet: a PUB would drop this batch; it is kept.
        assert pub.flush() is None and pub.pending == 2
        for key in (6, 7, 8):
            pub.stored([key], medium="disk")
            assert pub.flush() is None
        # Past max_events the oldest go, and the batch says so with a leading clear.
        assert pub.pending == 3
        sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        try:
            sent = None
            while sent is None:  # the subscription reaches the publisher asynchronously
                assert sub.poll(50) == 0
                sent = pub.flush()
            assert sent == 0 and sub.poll(10_000)
            seq, events = decode_message(sub.recv_multipart())
            assert (seq, events) == (
                0,
                [AllCleared(), disk_block(7), disk_block(8)],
            )
            # Once joined, batches go out as they are flushed.
            pub.removed([7], medium="disk")
            assert pub.flush() == 1 and sub.poll(10_000)
            assert decode_message(sub.recv_multipart()) == (1, [BlocksRemoved((7,), "disk")])
        finally:
            sub.close(linger=0)


# -- the run ---------------------------------------------------------------------------------


class EventIndex:
    """The router's view of one instance: its events off a real SUB socket, into the index."""

    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.index = PrefixIndex([NAME])
        self.tracker = SequenceTracker()
        self.batches = 0
        self.gaps = 0

    def pump(self, wait_s: float) -> int:
        """Apply what arrives within ``wait_s`` (then whatever is already queued)."""
        got = 0
        while self.sock.poll(int(wait_s * 1000)):
            seq, events = decode_message(self.sock.recv_multipart())
            what = self.tracker.see(seq)
            if what == "restart":
                self.index.clear(NAME)
            elif what == "gap":
                self.gaps += 1
            self.index.apply(NAME, events)
            got += 1
            wait_s = 0.0
        self.batches += got
        return got

    def quiet(self) -> None:
        while self.pump(QUIET_S):
            pass

    def view(self) -> dict[str, set[int]]:
        inst = self.index.instance(NAME)
        out = {"device": inst.held("device")}
        out.update({m: set(keys) for m, keys in inst.tiers.items() if keys})
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


def truth(server: Any) -> dict[str, set[int]]:
    status, body = server.request("GET", "/admin/cache/blocks?limit=1000000", key=ADMIN)
    assert status == 200, body
    out: dict[str, set[int]] = {}
    for medium, held in body["media"].items():
        assert not held["truncated"]
        keys = {int(h, 16) for h in held["blocks"]}
        if keys or medium == "device":
            out[medium] = keys
    return out


def differences(index: dict[str, set[int]], held: dict[str, set[int]]) -> dict[str, Any]:
    out = {}
    for medium in sorted(set(index) | set(held)):
        a, b = index.get(medium, set()), held.get(medium, set())
        if a != b:
            out[medium] = {"indexed_not_held": len(a - b), "held_not_indexed": len(b - a)}
    return out


def converge(events: EventIndex, server: Any, step: str) -> dict[str, set[int]]:
    """Wait for a quiet stream in which the index equals the truth; assert it, bounded."""
    deadline = time.monotonic() + CONVERGE_S
    while True:
        events.quiet()
        held = truth(server)
        diff = differences(events.view(), held)
        if not diff or time.monotonic() > deadline:
            break
    assert not diff, f"after {step}: the index built from KV events differs: {diff}"
    return held


@pytest.mark.process
def test_the_event_index_converges_through_restarts_resets_and_outages(
    model_dir: Path, tmp_path: Path
) -> None:
    need_module("torch")
    need_module("transformers")
    need_module("fastapi")
    from redis_servers import RedisServer, free_port, redis_server_available
    from serve_proc import ServeProcess

    if not redis_server_available():
        pytest.skip("redis-server is not installed (make redis-server)")
    port = free_port()
    disk = tmp_path / "disk-tier"
    redis = RedisServer().start()
    args = [
        "--model", str(model_dir), "--served-model-name", "tiny",
        "--block-size", "4", "--num-blocks", "24", "--max-num-seqs", "2",
        "--pressure", "off", "--admin-key", ADMIN,
        "--kv-events", f"tcp://*:{port}",
        "--tier", f"disk:{disk}?size=256KiB", "--tier", redis.url,
        # The check that each tier still holds its blocks, also while the server idles.
        "--tier-recheck-interval", str(RECHECK_S),
    ]  # fmt: skip
    events = EventIndex(f"tcp://127.0.0.1:{port}")
    server = ServeProcess(args)
    rng = random.Random(SEED)
    # Restarts cost a server start each (most of the run's time): one warm, one cold.
    steps = ["chat"] * 18 + ["reset"] * 3 + ["restart-warm", "restart-cold", "redis"]
    rng.shuffle(steps)
    steps.insert(0, "chat")
    seen: dict[str, int] = {}
    redis_before: set[int] = set()
    try:
        server.start()
        converge(events, server, "startup")
        for n, step in enumerate(steps):
            if step == "chat":
                prefix = rng.choice(PREFIXES)
                topic = rng.randrange(6)
                body = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"{prefix}Topic {topic}."}],
                    "max_tokens": 2,
                    "temperature": 0,
                }
                status, answer = server.request("POST", "/v1/chat/completions", body)
                assert status == 200, answer
            elif step == "reset":
                status, answer = server.request("POST", "/admin/reset_prefix_cache", {}, key=ADMIN)
                assert status == 200 and answer["cleared"], answer
            elif step.startswith("restart"):
                assert server.proc is not None
                # A crash, not a goodbye: nothing gets to publish on the way out.
                server.proc.send_signal(signal.SIGKILL)
                server.stop()
                if step == "restart-cold":
                    shutil.rmtree(disk, ignore_errors=True)
                server = ServeProcess(args)
                server.start()
            elif step == "redis":
                redis_before = truth(server).get("redis", set())
                redis.stop(kill=True)
                redis.start()  # empty: every block the server wrote there is gone
                # No request follows: the recheck alone must drop them, from the server's
                # bookkeeping and (the comparison below) from the events.
                deadline = time.monotonic() + 10 * RECHECK_S + CONVERGE_S
                while truth(server).get("redis") and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert not truth(server).get("redis"), "the restarted Redis's lost blocks stayed"
            held = converge(events, server, f"step {n} ({step})")
            for medium, keys in held.items():
                seen[medium] = max(seen.get(medium, 0), len(keys))
        # The run exercised what it claims: blocks on every medium, evictions, no lost batch.
        assert seen.get("device", 0) > 0 and seen.get("disk", 0) > 0, seen
        assert events.gaps == 0 and events.tracker.restarts >= 1
        assert redis_before, "Redis held no block when it was restarted: nothing was checked"
        counters = events.index.instance(NAME).counters
        assert counters.removed_blocks > 0 and counters.clears >= 1
    finally:
        events.close()
        server.stop()
        redis.stop()
        redis.cleanup()
