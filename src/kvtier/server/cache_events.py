"""Keeping a router's picture of this server's KV blocks true: announce, reset, a view.

A router (vllm-router's ``kv_aware``, llm-d, Dynamo, ``kvtier route``)
builds which blocks an instance holds from the instance's KV events alone
(``--kv-events``). The engine publishes after each step; this module covers
what happens outside steps, where a router would otherwise keep a stale
picture:

* **startup**: the first batch a server publishes is ``AllBlocksCleared``
  (whatever a router held for the previous process on this endpoint is gone)
  followed by a ``BlockStored`` per tier medium for the blocks a persistent
  tier (``--disk-tier``) still holds, so a warm tier is visible before the
  first request. A ZeroMQ publisher holds it (and what follows) until a
  subscriber has joined, so that a router reconnecting to a restarted
  instance gets it;
* **reset** (``POST /admin/reset_prefix_cache``, vLLM's ``/reset_prefix_cache``
  behind the admin key): drops every cached
  device block no request holds; when none is left the events say
  ``AllBlocksCleared`` and then re-announce what the tiers still hold (a
  router may clear the tiers' blocks with the device's);
* **idle**: tier stores that complete while no request runs are published
  within :data:`IDLE_FLUSH_S`, not at the next request's step;
* **a view** (``GET /admin/cache/blocks``): the block hashes held per medium,
  as 32 hex digits, the same 16 big-endian bytes the events carry (vLLM's
  ``bytes`` block hashes), at most ``limit`` per medium (default
  :data:`VIEW_LIMIT`, ``truncated`` says when more are held). Read-only: a
  test or an operator compares it with a router's index.

Both routes are ``/admin/...``: answered only with ``--admin-key`` set, and
only to that key (a block hash would tell a tenant whether another tenant's
prompt is cached; a reset costs every tenant its hits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from kvtier.server.api_errors import APIError

if TYPE_CHECKING:
    from kvtier.engine import Engine, EngineWorker

log = logging.getLogger(__name__)

#: Seconds between flushes of events that came up while the engine idled.
IDLE_FLUSH_S = 0.25
#: Block hashes listed per medium by ``GET /v1/cache/blocks`` unless ``limit`` says otherwise.
VIEW_LIMIT = 4096
#: The most ``limit`` may ask for.
VIEW_LIMIT_MAX = 1 << 20
#: Seconds a call on the engine thread may wait.
CALL_TIMEOUT_S = 30.0


def _device_keys(engine: Engine) -> list[int]:
    # The pool's key -> block map is the device's truth: every key in it was published
    # as stored and not yet as removed.
    return list(engine.manager.pool._cached)


def tier_keys(engine: Engine) -> dict[str, list[int]]:
    """Per tier medium, the keys it holds ready (loadable)."""
    chain = engine.tier_chain
    if chain is None:
        return {}
    out: dict[str, list[int]] = {}
    with chain.locked():
        for tier in chain.tiers:
            om = tier.offload_manager
            out.setdefault(om.medium, []).extend(om.ready_keys())
    return out


def publish_pending(engine: Engine) -> None:
    """Publish the device's and the tiers' events not yet sent (engine thread).

    The tiers are polled first, as a step would: stores that finished meanwhile
    are published, and the periodic check of what each tier's medium still holds
    runs while the server idles too, so blocks a restarted Redis lost leave the
    events within ``--tier-recheck-interval``, not at the next request.
    """
    sink = engine.events
    if sink is None:
        return
    engine.poll_background()
    sink.drain_device(engine.manager)
    if engine.tier_chain is not None:
        sink.drain(engine.tier_chain)
    sink.flush()


def _announce_tiers(engine: Engine) -> None:
    sink = engine.events
    for medium, keys in tier_keys(engine).items():
        if keys:
            sink.stored(keys, medium=medium)


def announce(engine: Engine) -> None:
    """``AllBlocksCleared``, then everything held, as one batch (engine thread).

    The device's blocks cannot be told again (their tokens are not kept), so
    this is for a fresh engine: nothing on the device yet, tiers maybe warm.
    """
    sink = engine.events
    if sink is None:
        return
    hold = getattr(sink, "hold_until_subscribed", None)
    if hold is not None:
        # A ZeroMQ PUB drops what it sends before a router's SUB has (re)connected: this
        # batch, the one that tells a router the previous process's blocks are gone, waits.
        hold()
    # What the journals hold is older than the clear: the re-announcement covers it.
    engine.manager.take_events()
    if engine.tier_chain is not None:
        engine.tier_chain.take_events()
    sink.cleared()
    _announce_tiers(engine)
    sink.flush()


def reset_prefix_cache(engine: Engine) -> dict[str, Any]:
    """Drop every device block no request holds, and say so in the events (engine thread)."""
    publish_pending(engine)
    freed = engine.manager.reset_prefix_cache()
    sink = engine.events
    cleared = not _device_keys(engine)
    if sink is not None:
        sink.drain_device(engine.manager)
        if cleared:
            # AllBlocksCleared clears a router's picture of every medium: tell it again
            # what the tiers hold (their journal's events are older than this).
            if engine.tier_chain is not None:
                engine.tier_chain.take_events()
            _announce_tiers(engine)
        sink.flush()
    return {"freed_blocks": freed, "cleared": cleared}


def held_blocks(engine: Engine, limit: int) -> dict[str, Any]:
    """The view ``GET /admin/cache/blocks`` answers (see the module docstring)."""
    media: dict[str, list[int]] = {"device": _device_keys(engine), **tier_keys(engine)}
    out: dict[str, Any] = {}
    for medium, keys in media.items():
        keys.sort()
        out[medium] = {
            "count": len(keys),
            "blocks": [format(k, "032x") for k in keys[:limit]],
            "truncated": len(keys) > limit,
        }
    sink = engine.events
    return {
        "hash_format": "hex of the 16 big-endian bytes KV events carry",
        "events": None if sink is None else sink.endpoint,
        "next_sequence": getattr(sink, "next_sequence", None),
        "media": out,
    }


def register_cache_events(app: FastAPI, worker: EngineWorker) -> None:
    """Add the view, the reset route and, with KV events on, the announce and idle flush."""
    engine = worker.engine

    async def on_engine(fn: Any) -> Any:
        return await asyncio.to_thread(worker.call, fn, CALL_TIMEOUT_S)

    @app.get("/admin/cache/blocks", include_in_schema=False)
    async def cache_blocks(request: Request) -> dict[str, Any]:
        raw = request.query_params.get("limit", str(VIEW_LIMIT))
        if not raw.isdigit() or not 0 <= int(raw) <= VIEW_LIMIT_MAX:
            raise APIError(400, f"limit must be an integer in 0..{VIEW_LIMIT_MAX}, got {raw!r}")
        limit = int(raw)
        result: dict[str, Any] = await on_engine(lambda e: held_blocks(e, limit))
        return result

    @app.post("/admin/reset_prefix_cache", include_in_schema=False)
    async def reset() -> dict[str, Any]:
        result: dict[str, Any] = await on_engine(reset_prefix_cache)
        return result

    if engine.events is None:
        return
    tasks: list[asyncio.Task[None]] = []

    async def idle_flush() -> None:
        while True:
            await asyncio.sleep(IDLE_FLUSH_S)
            if not worker.alive:
                continue
            try:
                await on_engine(publish_pending)
            except Exception:  # a stopping worker: the next round, or the shutdown, ends it
                log.debug("idle KV event flush failed", exc_info=True)

    async def start() -> None:
        try:
            await on_engine(announce)
        except Exception:
            log.exception("announcing the KV cache at startup failed")
        tasks.append(asyncio.create_task(idle_flush()))

    async def stop() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.router.on_startup.append(start)
    app.router.on_shutdown.append(stop)


__all__ = [
    "IDLE_FLUSH_S",
    "VIEW_LIMIT",
    "announce",
    "held_blocks",
    "publish_pending",
    "register_cache_events",
    "reset_prefix_cache",
    "tier_keys",
]
