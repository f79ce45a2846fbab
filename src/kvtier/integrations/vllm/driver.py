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


# -- the connector's scheduler side, built by vLLM's connector factory ---------------------------


class _ModelStandIn:
    """The few facts of a model vLLM's offloading config reads (vLLM's ``ModelConfig``
    would load the model's files from a hub)."""

    def __init__(self, name: str, dtype: str, max_model_len: int, kv_heads: int) -> None:
        self.model = name
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.use_mla = False
        self._kv_heads = kv_heads

    def get_total_num_kv_heads(self) -> int:
        return self._kv_heads


def connector_vllm_config(
    transfer: dict[str, Any],
    *,
    block_size: int = 16,
    model: str = "m",
    max_model_len: int = 1 << 20,
    kv_heads: int = 1,
    prefix_caching: bool = True,
) -> Any:
    """What a KV connector reads of a ``VllmConfig``: vLLM's real transfer, cache,
    parallel and scheduler configs, with the model's facts stood in for."""
    from types import SimpleNamespace

    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, SchedulerConfig

    kv = KVTransferConfig(**transfer)
    if kv.engine_id is None:
        kv.engine_id = "engine-0"
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    return SimpleNamespace(
        kv_transfer_config=kv,
        cache_config=cache,
        parallel_config=ParallelConfig(),
        scheduler_config=SchedulerConfig.default_factory(max_model_len=max_model_len)
        if hasattr(SchedulerConfig, "default_factory")
        else SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False),
        model_config=_ModelStandIn(model, "float16", max_model_len, kv_heads),
        kv_events_config=None,
        use_v2_model_runner=False,
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
    )


def connector_kv_cache_config(
    num_gpu_blocks: int, block_size: int = 16, head_size: int = 64
) -> Any:
    """One full-attention layer's ``KVCacheConfig`` of ``num_gpu_blocks`` GPU blocks."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=torch.float16
    )
    # No tensors: the chunk size then comes from the group's page size.
    return KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )


class ConnectorDriver:
    """A KV connector's scheduler side built by vLLM's factory, called as vLLM's scheduler does.

    ``transfer`` is a ``--kv-transfer-config`` object (``OffloadingConnector``,
    ``KvTierConnector``, ...); the CPU tier holds ``cpu_chunks`` chunks of one
    ``block_size``-token GPU block each. :meth:`serve` runs one request the
    way vLLM's scheduler does with no GPU prefix cache between requests
    (every reuse comes from the CPU tier): it adds the request, asks the
    connector how many tokens it can load, allocates GPU blocks, builds the
    step's connector metadata, has every transfer reported done (the workers'
    part), appends the output tokens, finishes the request and runs the step
    that stores its last chunks. Every connector call is timed per step
    (:attr:`step_times`).
    """

    def __init__(
        self,
        transfer: dict[str, Any],
        cpu_chunks: int,
        *,
        block_size: int = 16,
        gpu_blocks: int = 1 << 16,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        kvc = connector_kv_cache_config(gpu_blocks, block_size)
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

        # vLLM's CPU tier pads each chunk to its alignment.
        align = int(getattr(CPUOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", 1))
        page = kvc.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        chunk_bytes = -(-page // align) * align
        transfer = dict(transfer)
        extra = dict(transfer.get("kv_connector_extra_config") or {})
        extra["cpu_bytes_to_use"] = cpu_chunks * chunk_bytes
        transfer["kv_connector_extra_config"] = extra
        self.config = connector_vllm_config(transfer, block_size=block_size)
        self.connector: Any = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.SCHEDULER, kvc
        )
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(block_size, sha256)
        self.block_size = block_size
        self.gpu_blocks = gpu_blocks
        self._next_block = 0
        self._block_ids: dict[str, list[int]] = {}
        #: Seconds spent in connector calls, per scheduler step.
        self.step_times: list[float] = []
        self._step_s = 0.0
        self._n = 0

    def _call(self, fn: Callable[..., _R], *args: Any) -> _R:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._step_s += time.perf_counter() - start

    def _end_step(self) -> None:
        self.step_times.append(self._step_s)
        self._step_s = 0.0

    def request(
        self,
        token_ids: Sequence[int],
        *,
        extra_args: dict[str, Any] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> Any:
        """A vLLM ``Request`` for ``token_ids`` (its block hashes computed by vLLM's hasher)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._n += 1
        args = dict(extra_args or {})
        if kv_transfer_params is not None:
            args["kv_transfer_params"] = kv_transfer_params
        params = SamplingParams(max_tokens=1 << 20, extra_args=args or None)
        return Request(
            request_id or f"r{self._n}", list(token_ids), params, None,
            block_hasher=self.block_hasher,
        )  # fmt: skip

    def _blocks(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            self._next_block = self._next_block % (self.gpu_blocks - 1) + 1  # 0 is vLLM's null
            out.append(self._next_block)
        return out

    def _complete(self, meta: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        jobs = {**meta.load_jobs, **meta.store_jobs}
        if not jobs:
            return
        done = OffloadingWorkerMetadata(completed_jobs={jid: 1 for jid in jobs})
        self._call(
            self.connector.update_connector_output,
            KVConnectorOutput(kv_connector_worker_meta=done),
        )

    def _output(
        self, new: list[Any], scheduled: dict[str, int], finished: set[str]
    ) -> Any:
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=[],
            finished_req_ids=finished,
            free_encoder_mm_hashes=[],
        ) if _OUTPUT_HAS_PREFIX_BLOCKS else SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=finished,
            free_encoder_mm_hashes=[],
        )  # fmt: skip

    def start(self, request: Any) -> int:
        """Add ``request``, look its prefix up, allocate and schedule its prompt (one step,
        its loads and stores reported done); returns the tokens loaded from the offload tier."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.core.sched.output import NewRequestData
        from vllm.v1.request import RequestStatus

        c = self.connector
        rid = request.request_id
        self._call(c.on_new_request, request)
        while True:
            loaded, is_async = self._call(c.get_num_new_matched_tokens, request, 0)
            if loaded is not None:
                break
            self.step()
        n_tokens = request.num_tokens
        ids = self._blocks(-(-n_tokens // self.block_size))
        self._block_ids[rid] = ids
        blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in ids],))
        self._call(c.update_state_after_alloc, request, blocks, loaded)
        if is_async:
            # As vLLM's scheduler: the request waits for its load, which the next
            # step hands to the workers, and is scheduled once it is reported done.
            self.step()
            request.num_computed_tokens = loaded
        request.status = RequestStatus.RUNNING
        new = NewRequestData.from_request(request, (ids,))
        self.step([new], {rid: n_tokens - loaded})
        request.num_computed_tokens = n_tokens
        return int(loaded)

    def step(
        self,
        new: list[Any] | None = None,
        scheduled: dict[str, int] | None = None,
        finished: set[str] | None = None,
    ) -> None:
        """One scheduler step: the connector's metadata, then every transfer reported done."""
        meta = self._call(
            self.connector.build_connector_meta,
            self._output(new or [], scheduled or {}, finished or set()),
        )
        self._complete(meta)
        self._end_step()

    def finish(
        self, request: Any, output_token_ids: Sequence[int] = ()
    ) -> dict[str, Any] | None:
        """Append the output tokens, finish ``request`` and run the step that stores its
        last chunks; returns the ``kv_transfer_params`` vLLM would return with its output."""
        from vllm.v1.request import RequestStatus

        if output_token_ids:
            request.append_output_token_ids(list(output_token_ids))
            request.num_computed_tokens = request.num_tokens - 1
        request.status = RequestStatus.FINISHED_STOPPED
        ids = self._block_ids.pop(request.request_id, [])
        _, params = self._call(self.connector.request_finished, request, ids)
        self.step(finished={request.request_id})
        return dict(params) if params is not None else None

    def serve(
        self, request: Any, output_token_ids: Sequence[int] = ()
    ) -> tuple[int, dict[str, Any] | None]:
        """Run ``request`` to the end; returns (tokens loaded from the offload tier,
        the ``kv_transfer_params`` vLLM would return with its output)."""
        loaded = self.start(request)
        return loaded, self.finish(request, output_token_ids)


def _has_prefix_blocks() -> bool:
    try:
        from vllm.v1.core.sched.output import SchedulerOutput
    except ImportError:  # pragma: no cover - vLLM is required by this module
        return False
    import dataclasses

    return any(f.name == "num_common_prefix_blocks" for f in dataclasses.fields(SchedulerOutput))


_OUTPUT_HAS_PREFIX_BLOCKS = _has_prefix_blocks()
