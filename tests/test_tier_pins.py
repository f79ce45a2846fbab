"""A session's ``cache_ttl_s`` pin follows its blocks below the device: a pinned block
the device evicts keeps its pin on the host or disk tier, which evicts unpinned blocks
first and the pinned one normally once the pin has ended; ending the session frees it
on every tier, Redis included; the stats count pinned blocks per tier and per session.
Real tiny model, real host, disk and Redis tiers (a redis-server on loopback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serving import serving
from test_session_release import GREEDY, _run
from test_session_release import _held as _on_media
from tiny_model import tiny_model_and_tokenizer

from kvtier.engine import Engine
from kvtier.offload.chain import Tier
from kvtier.offload.disk import DiskStore
from kvtier.offload.host import HostStore
from kvtier.offload.redis_store import RedisStore

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
TTL = 100.0


class Clock:
    """The device manager's clock, moved by hand (the policy and the tiers read it)."""

    def __init__(self) -> None:
        self.now = 1.0

    def __call__(self) -> float:
        return self.now


def _engine(tiers: list[Tier], clock: Clock | None = None) -> Engine:
    model, tok = tiny_model_and_tokenizer()
    engine = Engine(
        model, tok, model_id="tiny", block_size=4, num_blocks=24, policy="workflow", tiers=tiers
    )
    if clock is not None:
        engine.manager.clock = clock
    return engine


def _traffic(seed: int) -> list[int]:
    """An unhinted 40-token prompt (10 blocks) that shares nothing with the others."""
    return torch.randint(5, 90, (40,), generator=torch.Generator().manual_seed(seed)).tolist()


def _session(engine: Engine, seed: int, sid: str) -> list[int]:
    """A session's turn, pinned for :data:`TTL`; returns its block keys."""
    prompt = _traffic(seed)
    _run(engine, prompt, {"session_id": sid, "cache_ttl_s": TTL})
    return list(engine.manager.hasher.chain(prompt))


def _push_off_device(engine: Engine, seed: int) -> list[int]:
    """A request that needs nearly every device block: all the others leave the device,
    pinned or not (the device gives its owner room). Returns its block keys."""
    prompt = torch.randint(5, 90, (92,), generator=torch.Generator().manual_seed(seed)).tolist()
    _run(engine, prompt)
    return list(engine.manager.hasher.chain(prompt))


def _held(engine: Engine, keys: list[int]) -> dict[str, set[int]]:
    """Per tier, which of ``keys`` it holds: in its bookkeeping and, for a medium outside
    the process, on the medium too (host memory is the bookkeeping's own)."""
    assert engine.tier_chain is not None
    out = _on_media(engine, keys)
    for tier in engine.tier_chain.tiers:
        if tier.medium.caps.in_process:
            out[tier.name] = {k for k in keys if tier.offload_manager.is_ready(k)}
    return out


def _on_device(engine: Engine, keys: list[int]) -> set[int]:
    return {k for k in keys if k in engine.manager.pool._cached}


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_pin_survives_demotion_and_orders_the_tiers_evictions(kind: str, tmp_path: Path) -> None:
    clock = Clock()
    store = HostStore() if kind == "host" else DiskStore(tmp_path)
    engine = _engine([Tier(store, 24)], clock)
    chain = engine.tier_chain
    assert chain is not None
    mgr = chain.tiers[0].offload_manager
    a = _session(engine, 1, "a")
    big = _push_off_device(engine, 2)
    engine.connector.demote_pending()
    chain.flush()
    engine.poll_background()
    assert not _on_device(engine, a)
    # A's blocks went down with their pin.
    assert _held(engine, a)[kind] == set(a)
    assert {mgr.pin_end(k) for k in a} == {clock.now + TTL}
    assert chain.stats()[kind]["pinned_blocks"] == len(a)

    # Unpinned traffic fills the tier: it evicts the unpinned blocks, those stored after
    # A's included, and keeps A's (plain LRU would have evicted A's first).
    for seed in range(10, 14):
        _run(engine, _traffic(seed))
    assert mgr.evictions > 0 and mgr.pinned_evictions == 0
    assert _held(engine, a)[kind] == set(a)
    gone_big = set(big) - _held(engine, big)[kind] - _on_device(engine, big)
    assert gone_big, "blocks stored after the pinned ones were evicted first"
    mgr.check()

    # The pin ends: A's blocks are evicted as any others now.
    clock.now += TTL + 1
    assert mgr.num_pinned == 0 and chain.stats()[kind]["pinned_blocks"] == 0
    last: list[int] = []
    for seed in range(20, 24):
        prompt = _traffic(seed)
        _run(engine, prompt)
        last = list(engine.manager.hasher.chain(prompt))
    assert not _held(engine, a)[kind], "an ended pin keeps nothing"
    assert mgr.pinned_evictions == 0
    # What was stored last is still there, on the device or the tier.
    assert set(last) == _held(engine, last)[kind] | _on_device(engine, last)
    mgr.check()
    engine.close()


def test_a_release_frees_demoted_pinned_blocks_on_every_tier(redis: Any, tmp_path: Path) -> None:
    redis_store = RedisStore(redis.url)
    # A small host tier: pinned blocks it must evict go down to disk with their pins.
    engine = _engine([Tier(HostStore(), 12), Tier(DiskStore(tmp_path), 64), Tier(redis_store, 256)])
    chain = engine.tier_chain
    assert chain is not None
    a = _session(engine, 1, "a")
    _push_off_device(engine, 2)  # A's blocks to the host, pinned
    _run(engine, _traffic(10))  # more than the host has unpinned room for
    b = _session(engine, 3, "b")
    held = _held(engine, a)
    # Redis wrote A's blocks through and took their pins when the device evicted them;
    # the host kept what it could, the rest went down to disk with their pins.
    assert held["redis"] == set(a)
    assert held["host"] | held["disk"] == set(a) and held["disk"]
    pins = chain.pins()
    for name in ("host", "disk", "redis"):
        assert {k for k in a if k in pins[name]} == held[name], name
    assert chain.stats()["disk"]["pinned_blocks"] == len(held["disk"])

    assert engine.agents.end_session("a")
    assert _held(engine, a) == {"host": set(), "disk": set(), "redis": set()}
    assert not any(redis_store.contains(a)), "gone from Redis itself"
    pins = chain.pins()
    assert not any(k in pins[name] for name in pins for k in a), "the pins went with them"
    # The other session's blocks stay.
    assert _held(engine, b)["redis"] == set(b)
    chain.check()
    engine.close()


def test_stats_count_pinned_blocks_per_tier_and_per_session(tmp_path: Path) -> None:
    engine = _engine([Tier(HostStore(), 64)])
    a = _session(engine, 1, "a")
    b = _session(engine, 3, "b")
    _push_off_device(engine, 2)
    engine.connector.demote_pending()
    _run(engine, _traffic(10), {"session_id": "c", "cache_ttl_s": TTL})
    on_device = _on_device(engine, _traffic_keys(engine, 10))
    stats = engine.agents.pin_stats()
    assert stats is not None
    assert stats["blocks"]["host"] == len(a) + len(b)
    assert stats["blocks"]["device"] == len(on_device) > 0
    rows = {row["session_id"]: row for row in stats["sessions"]}
    assert rows["a"]["blocks"] == {"device": 0, "host": len(a)}
    assert rows["b"]["blocks"] == {"device": 0, "host": len(b)}
    assert rows["c"]["blocks"] == {"device": len(on_device), "host": 0}
    assert stats["sessions_pinned"] == stats["sessions_shown"] == 3
    assert 0 < rows["a"]["ends_in_s"] <= TTL
    # Bounded: the sessions with the most pinned blocks first.
    top = engine.agents.pin_stats(top=1)
    assert top is not None and top["sessions_shown"] == 1 and top["sessions_pinned"] == 3
    assert engine.tier_chain is not None
    assert engine.tier_chain.stats()["host"]["pinned_blocks"] == len(a) + len(b)

    # The same over HTTP, in /v1/cache/stats.
    with serving(engine) as srv:
        body = httpx.get(f"{srv.base}/v1/cache/stats").json()
        assert body["pins"]["blocks"] == stats["blocks"]
        assert body["tiers"]["host"]["pinned_blocks"] == len(a) + len(b)
        assert {row["session_id"] for row in body["pins"]["sessions"]} == {"a", "b", "c"}
        # Ending a session over HTTP frees its blocks and its pins with them.
        assert httpx.delete(f"{srv.base}/v1/sessions/a").status_code == 200
        body = httpx.get(f"{srv.base}/v1/cache/stats").json()
        assert body["pins"]["blocks"]["host"] == len(b)
        assert {row["session_id"] for row in body["pins"]["sessions"]} == {"b", "c"}


def _traffic_keys(engine: Engine, seed: int) -> list[int]:
    return list(engine.manager.hasher.chain(_traffic(seed)))


def test_without_the_workflow_policy_there_are_no_pins(tmp_path: Path) -> None:
    model, tok = tiny_model_and_tokenizer()
    engine = Engine(model, tok, model_id="tiny", block_size=4, num_blocks=24,
                    tiers=[Tier(HostStore(), 32)])  # fmt: skip
    engine.add_request(_traffic(1), GREEDY, hints={"session_id": "a", "cache_ttl_s": TTL})
    while engine.has_unfinished():
        engine.step()
    _push_off_device(engine, 2)
    assert engine.agents.pin_stats() is None
    assert engine.tier_chain is not None
    assert engine.tier_chain.stats()["host"]["pinned_blocks"] == 0
    engine.close()


def test_pins_reach_kvtiers_own_event_stream_and_not_the_wire(tmp_path: Path) -> None:
    from kvtier.events import BlocksPinned, BlocksStored, MemorySink
    from kvtier.integrations.vllm.events import KvEventPublisher
    from kvtier.routing.events import decode_batch

    clock = Clock()
    engine = _engine([Tier(HostStore(), 32)], clock)
    sink = MemorySink()
    engine.events = sink
    engine.manager.record_events()
    a = _session(engine, 1, "a")
    _push_off_device(engine, 2)
    engine.connector.demote_pending()
    engine._publish_events()
    # Every step published its events: all of them, in order.
    host = [e for b in sink.batches for e in b if getattr(e, "medium", None) == "host"]
    pinned = [e for e in host if isinstance(e, BlocksPinned)]
    assert {k for e in pinned for k in e.keys} == set(a)
    assert {e.until for e in pinned} == {clock.now + TTL}
    # Each pin is announced after its blocks were stored there.
    for event in pinned:
        before = host[: host.index(event)]
        assert set(event.keys) <= {k for e in before if isinstance(e, BlocksStored) for k in e.keys}

    # A publisher in vLLM's wire format leaves pins out: the batch is what it was.
    with KvEventPublisher("inproc://kvtier-pins", structs="local") as pub:
        pub.emit(BlocksStored((1, 2), "host"))
        pub.emit(BlocksPinned((1, 2), 5.0, "host"))
        with pub._lock:
            events, pub._pending = pub._pending, []
        decoded = decode_batch(pub.encode(events, ts=1.0))
    assert [type(e) for e in decoded] == [BlocksStored]
    engine.close()
