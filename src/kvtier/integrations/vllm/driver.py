"""vLLM 0.33's tiered offloading manager, built from a config and driven as its scheduler does.

No engine and no GPU: :func:`offloading_config` is the ``OffloadingConfig``
vLLM's offloading connector would build for a model whose KV cache takes
``chunk_bytes`` per block on one worker, and :class:`SchedulerDriver` makes a
real ``TieringOffloadingManager`` through vLLM's own spec factory (CPU tier
plus the ``secondary_tiers`` given) and makes the calls the connector's
scheduler side makes: lookups (which promote chunks from a secondary tier),
loads, stores (the bytes a GPU worker would copy are written into the CPU
tier's memory), touches and the end of every step. Every manager call is
timed (:attr:`SchedulerDriver.step_times`, :attr:`SchedulerDriver.longest_call`).

The integration tests and the tier benchmark (``bench/vllm_tiers.py``) use
it; it is also a quick way to try a secondary tier's configuration.
Importing this module needs vLLM 0.33.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvtier.integrations.vllm.version import CACHE_POLICY_API, require_vllm

VLLM = require_vllm(CACHE_POLICY_API)

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

HIT: Any = LookupResult.HIT
MISS: Any = LookupResult.MISS
PENDING: Any = LookupResult.HIT_PENDING
RETRY: Any = LookupResult.RETRY
TIER_MODULE = "kvtier.integrations.vllm.tiering"

_R = TypeVar("_R")


def offloading_config(
    extra: dict[str, Any],
    chunk_bytes: int = 4096,
    *,
    engine_id: str = "engine-0",
    model: str = "m",
    dtype: str = "float16",
    events: bool = True,
) -> Any:
    """What vLLM's offloading connector builds for a one-layer model on one worker."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=engine_id,
        model=OffloadingModelConfig(model, dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def offload_key(name: str | int) -> Any:
    """The offload key of block ``name`` (a 32-byte block hash) in KV cache group 0."""
    return make_offload_key(str(name).encode().rjust(32, b"\0"), 0)


def kvtier_tier(url: str, **settings: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry for kvtier's tier over the tier URL ``url``."""
    return {"type": "KvTierSecondaryTier", "module_path": TIER_MODULE, "url": url, **settings}


class SchedulerDriver:
    """A real TieringOffloadingManager, called as vLLM's connector scheduler calls it."""

    def __init__(
        self,
        tiers: Sequence[dict[str, Any]],
        cpu_chunks: int = 8,
        chunk_bytes: int = 4096,
        **config: Any,
    ) -> None:
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_chunks * chunk_bytes,
            "secondary_tiers": [dict(t) for t in tiers],
        }
        self.spec: Any = OffloadingSpecFactory.create_spec(
            offloading_config(extra, chunk_bytes, **config)
        )
        self.m: Any = self.spec.get_manager()
        self.tiers: list[Any] = list(self.m.secondary_tiers)
        #: The CPU tier's chunks, one uint8 row each (what vLLM's GPU workers copy).
        self.rows: np.ndarray[Any, np.dtype[np.uint8]] = np.asarray(
            self.m.primary_tier.get_kv_memoryview()
        )
        #: Seconds spent in manager calls in each step so far, and the step now running.
        self.step_times: list[float] = []
        self._step_s = 0.0
        #: The longest single manager call, in seconds, and which it was.
        self.longest_call = (0.0, "")
        self._n = 0

    def _call(self, name: str, fn: Callable[..., _R], *args: Any) -> _R:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent = time.perf_counter() - start
            self._step_s += spent
            if spent > self.longest_call[0]:
                self.longest_call = (spent, name)

    def request(self) -> Any:
        """A new request (``ReqContext``), announced to the manager."""
        self._n += 1
        ctx = ReqContext(req_id=f"r{self._n}")
        self._call("on_new_request", self.m.on_new_request, ctx)
        return ctx

    def finish(self, ctx: Any) -> None:
        self._call("on_request_finished", self.m.on_request_finished, ctx)

    def step(self) -> None:
        """End the scheduler step (flushes promotions, polls the tiers)."""
        self._call(
            "on_schedule_end",
            self.m.on_schedule_end,
            ScheduleEndContext(new_req_ids=(), preempted_req_ids=()),
        )
        self.step_times.append(self._step_s)
        self._step_s = 0.0

    def store(self, ctx: Any, data: dict[Any, bytes | None]) -> list[Any]:
        """GPU -> CPU for ``data`` (key -> chunk bytes, or ``None`` to leave the memory as
        it is); returns the keys written, ``[]`` when none needs writing (all held, or
        no room)."""
        out = self._call("prepare_store", self.m.prepare_store, list(data), ctx)
        if out is None or not out.keys_to_store:
            return []  # as vLLM's connector: nothing to copy, no complete_store
        for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            value = data[key]
            if value is not None:
                self.rows[int(chunk)] = np.frombuffer(value, dtype=np.uint8)
        self._call("complete_store", self.m.complete_store, out.keys_to_store, ctx)
        return list(out.keys_to_store)

    def settle(self, timeout_s: float = 60.0) -> None:
        """Step until no transfer is in flight."""
        deadline = time.monotonic() + timeout_s
        self.step()
        while self.m.has_pending_work():
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfers still running after {timeout_s:g}s")
            time.sleep(0.001)
            self.step()

    def lookup(self, ctx: Any, keys: Sequence[OffloadKey]) -> list[Any]:
        return [self._call("lookup", self.m.lookup, k, ctx) for k in keys]

    def resolve(
        self, ctx: Any, keys: Sequence[OffloadKey], first: dict[Any, Any] | None = None
    ) -> int | None:
        """How many leading keys are HITs now; ``None`` while one must wait (pending, retry).

        ``first`` records each key's first lookup result (a HIT there came from
        the CPU tier; a later one was promoted from a secondary tier).
        """
        for i, key in enumerate(keys):
            result = self._call("lookup", self.m.lookup, key, ctx)
            if first is not None:
                first.setdefault(key, result)
            if result is HIT:
                continue
            if result is MISS:
                return i
            return None
        return len(keys)

    def load(self, ctx: Any, keys: Sequence[OffloadKey]) -> list[bytes]:
        """CPU -> GPU of ``keys`` (all HITs): their chunks' bytes."""
        if not keys:
            return []
        spec = self._call("prepare_load", self.m.prepare_load, list(keys), ctx)
        out = [self.rows[int(c)].tobytes() for c in spec.chunk_ids]
        self._call("touch", self.m.touch, list(keys), ctx)
        self._call("complete_load", self.m.complete_load, list(keys), ctx)
        return out

    def fetch(self, ctx: Any, keys: Sequence[OffloadKey], timeout_s: float = 60.0) -> list[bytes]:
        """The leading keys' bytes as a GPU would load them, stepping while promotions run.

        Stops at the first MISS, as the scheduler does.
        """
        deadline = time.monotonic() + timeout_s
        n = self.resolve(ctx, keys)
        while n is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"lookups still pending after {timeout_s:g}s")
            self.step()
            time.sleep(0.001)
            n = self.resolve(ctx, keys)
        return self.load(ctx, keys[:n])

    def wipe_cpu_tier(self) -> None:
        """Empty the CPU tier and zero its memory (secondary tiers keep their chunks)."""
        self.m.reset_cache()
        self.m.on_reset_flushed()
        self.rows[:] = 0

    def shutdown(self) -> None:
        self.rows = np.empty((0, 0), dtype=np.uint8)  # vLLM unmaps the CPU tier
        self.m.shutdown()
