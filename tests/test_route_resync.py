"""After lost KV event batches, ``kvtier route`` reads what the instance holds and drops
from its index what is gone.

The view is the real one: a ``kvtier serve`` (tiny model, a disk tier, an admin key)
answers ``GET /admin/cache/blocks``. The events come from a ZeroMQ publisher the
test drives, so that one batch can go missing on purpose; the router's own listener
(:func:`~kvtier.routing.proxy.follow_events`) reads them over a real socket.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from needs import need_module

from kvtier.events import BlocksRemoved, BlocksStored
from kvtier.routing.index import DEVICE, InstanceIndex, block_hashes

ADMIN = "resync-admin-key"
BS = 4


# -- the index's side: retain ----------------------------------------------------------------

_ops = st.lists(
    st.tuples(st.sampled_from(["store", "remove"]), st.integers(1, 12), st.integers(0, 3)),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, kept=st.sets(st.integers(1, 12)), disk=st.sets(st.integers(100, 110)))
def test_retain_keeps_only_what_the_view_shows_and_stays_consistent(
    ops: list[tuple[str, int, int]], kept: set[int], disk: set[int]
) -> None:
    index = InstanceIndex()
    for op, key, tok in ops:
        if op == "store":
            index.apply(BlocksStored((key,), token_ids=(tok,) * BS, block_size=BS))
        else:
            index.apply(BlocksRemoved((key,)))
    index.apply(BlocksStored((999,), medium="disk"))
    before = index.held()
    dropped = index.retain({DEVICE: kept, "disk": disk})
    assert index.held() == before & kept
    assert dropped == len(before - kept)
    assert index.held("disk") == disk
    # Every chain hash counted once per key that names it, and nothing else.
    counts: dict[int, int] = {}
    for chain_hash in index.keys.values():
        counts[chain_hash] = counts.get(chain_hash, 0) + 1
    assert counts == index.counts
    # A medium the view leaves out (listed partly, or not at all) keeps what events said.
    index.retain({"redis": {5}})
    assert index.held() == before & kept and index.held("disk") == disk
    assert index.counters.resyncs == 2


# -- the router's side: a lost batch, then the instance's real view --------------------------


def _frames(seq: int, events: list[dict[str, Any]]) -> list[bytes]:
    import msgspec

    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), events])]


@pytest.mark.process
def test_a_lost_batch_makes_the_router_resync_from_the_instance(
    model_dir: Path, tmp_path: Path
) -> None:
    need_module("fastapi")
    need_module("zmq")
    import httpx
    import zmq.asyncio
    from redis_servers import free_port
    from serve_proc import ServeProcess

    from kvtier.routing.proxy import Instance, Router, follow_events, resync

    args = [
        "--model", str(model_dir), "--served-model-name", "tiny", "--block-size", str(BS),
        "--num-blocks", "64", "--pressure", "off", "--admin-key", ADMIN,
        "--tier", f"disk:{tmp_path / 'disk'}?size=256KiB",
    ]  # fmt: skip
    with ServeProcess(args) as server:
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello there, a few words."}]}  # fmt: skip
        status, answer = server.request("POST", "/v1/chat/completions", body)
        assert status == 200, answer
        status, view = server.request("GET", "/admin/cache/blocks?limit=100000", key=ADMIN)
        assert status == 200, view
        real = [int(h, 16) for h in view["media"]["device"]["blocks"]]
        assert real and "disk" in view["media"]
        stale, stale_disk = 1 << 100, 1 << 101  # blocks the instance does not hold
        port = free_port()

        async def run() -> tuple[InstanceIndex, int, int]:
            ctx = zmq.asyncio.Context()
            pub = ctx.socket(zmq.PUB)
            instance = Instance("i1", server.base, f"tcp://127.0.0.1:{port}")
            router = Router([instance])
            resyncs: list[bool] = []
            async with httpx.AsyncClient(timeout=30) as client:

                async def on_gap(inst: Instance) -> bool:
                    done = await resync(router, inst, client, ADMIN)
                    resyncs.append(done)
                    return done

                ready = asyncio.Event()
                task = asyncio.create_task(follow_events(router, instance, ctx, ready, 10, on_gap))
                await asyncio.sleep(0.2)  # the router binds a plain address; the publisher joins
                pub.connect(f"tcp://127.0.0.1:{port}")
                await ready.wait()
                await asyncio.sleep(0.2)
                # The router learns a real block, a stale one and a stale disk block ...
                stored = [
                    {"type": "BlockStored", "block_hashes": [real[0].to_bytes(16, "big")],
                     "parent_block_hash": None, "token_ids": [1, 2, 3, 4], "block_size": BS},
                    {"type": "BlockStored", "block_hashes": [stale.to_bytes(16, "big")],
                     "parent_block_hash": None, "token_ids": [5, 6, 7, 8], "block_size": BS},
                    {"type": "BlockStored", "block_hashes": [stale_disk.to_bytes(16, "big")],
                     "medium": "STORAGE", "locality": "LOCAL"},
                ]  # fmt: skip
                await pub.send_multipart(_frames(0, stored))
                # ... and batch 1, which said they were removed, never arrives.
                await pub.send_multipart(_frames(2, []))
                deadline = time.monotonic() + 30
                while not resyncs and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            pub.close(linger=0)
            ctx.term()
            index = router.index.instance("i1")
            assert resyncs == [True]
            return index, instance.tracker.lost, len(resyncs)

        index, lost, _ = asyncio.run(run())
    assert lost == 1
    assert index.held() == {real[0]}  # the stale block left; the real one stayed
    assert stale_disk not in index.held("disk")
    assert index.counters.resync_removed == 1
    assert index.leading(block_hashes([1, 2, 3, 4], BS)) == 1
    assert index.leading(block_hashes([5, 6, 7, 8], BS)) == 0


def test_without_the_admin_key_a_resync_fails_and_is_counted() -> None:
    import httpx

    from kvtier.routing.proxy import Instance, Router, resync

    instance = Instance("i1", "http://127.0.0.1:9", "tcp://127.0.0.1:9")
    router = Router([instance])

    async def run() -> bool:
        async with httpx.AsyncClient(timeout=2) as client:
            return await resync(router, instance, client, "nope")

    assert asyncio.run(run()) is False
    assert instance.resync_failures == 1 and router.index.instance("i1").counters.resyncs == 0
