"""Eviction policies: kvtier against libCacheSim and vLLM's offloading policies.

What is measured: hit ratio and speed of eviction policies on one block access
stream, the block model of cache simulators. Every block id of every request
of a Mooncake trace, in file order, is one ``get`` on a cache of ``capacity``
equal-sized blocks: a resident key is a hit (the policy is told of the use); a
missing key is admitted, one victim is evicted if the cache is full, and the
key is inserted. Capacities are percentages of the trace's distinct block ids.

Systems and drivers:

* **kvtier, replay simulator**: ``kvtier.replay.simulate_block`` with the
  registered policy objects (``make_policy(name)`` + ``bind(capacity)``);
  ``MIN`` is ``kvtier.replay.simulate_min`` (Belady with bypass, offline).
  accesses/s is the simulator's own loop, which also keeps the prefix and
  token counters.
* **libCacheSim** (``import libcachesim``): ``LRU``, ``ARC``, ``S3FIFO``,
  ``Sieve``, ``LFU``, ``FIFO``, ``WTinyLFU`` and ``Belady`` with default
  parameters, ``cache_size`` = capacity, every request ``obj_size=1``,
  ``obj_id`` = the block id (Belady also gets ``next_access_vtime``, the
  index of the key's next access). Two drivers: ``per request`` calls
  ``cache.get(req)`` once per access from Python; ``C++ trace`` writes the
  stream to an oracleGeneral binary file and times ``cache.process_trace``,
  the library's own C++ loop.
* **minimal loop**, policy against policy: the same bare Python loop drives
  vLLM's ``vllm.v1.kv_offload.cpu.policies`` ``LRUCachePolicy`` /
  ``ARCCachePolicy`` objects (``get`` -> ``touch((key,), ctx)`` on a hit;
  ``on_store_miss((key,), ctx)``, ``evict(1, set())`` when full and
  ``insert(key, chunk, ctx)`` on a miss) and kvtier's ``lru`` / ``arc``
  policy objects (owner-side resident set; ``access`` on a hit; ``admit``,
  ``evict`` when full and ``insert`` on a miss). vLLM's chunks
  (``ChunkStatus``, ready, ``ref_cnt`` 0) and one fresh ``ReqContext`` per
  request are created before the clock starts, and a victim's chunk is reused
  for the next insert, so only policy calls are timed. Both get the same int
  keys. vLLM's ``CPUOffloadingManager`` adds its own per-request work on top,
  so these vLLM numbers are an upper bound on its speed.

* **vLLM's CPUOffloadingManager**, per request: the real manager of vLLM's
  CPU offload tier (``vllm.v1.kv_offload.cpu.manager``) with its own
  ``LRUCachePolicy`` / ``ARCCachePolicy`` ("vLLM manager + vLLM <policy>") and
  with kvtier's policies through ``kvtier.integrations.vllm.cache_policy``
  ("vLLM manager + kvtier <policy>"). Each request is one ``ReqContext`` (its
  offload keys' token positions recorded, as vLLM's scheduler does):
  ``on_new_request``; ``lookup`` of its blocks in order until the first one
  that is not a ``HIT``; ``prepare_load`` / ``complete_load`` of that prefix
  (its blocks are the hits); ``prepare_store`` / ``complete_store`` of the rest
  (vLLM stores the ones it does not hold, evicting for room); and
  ``on_request_finished``. Hits are therefore prefix hits: the blocks after a
  request's first miss are offered for storing, not loaded, even those the
  tier holds. Keys are the block ids as 16 big-endian bytes in KV cache
  group 0 (``make_offload_key``), built before the clock; accesses/s counts
  every block of every request.

Every timed run starts from a fresh cache or policy, with ``gc`` disabled and
``time.perf_counter`` around the access loop only. Hit ratios are checked to
be identical across repeats and between the two libCacheSim drivers, and the
minimal loop's kvtier hits against the replay simulator's. Speeds are the
median over ``--repeat`` runs; kvtier/vLLM ratios are medians of per-repeat
ratios, the two loops running back to back within each repeat.

Run ``python bench/policies.py --help`` for the options; ``--quick`` replays
the first 1,500 requests once (a smoke run of a few seconds).
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    CONVERSATION_TRACE,
    REPO,
    format_markdown_table,
    format_table,
    git_state,
    log,
    machine_info,
    median,
    package_version,
    write_json,
)

from kvtier.policy import make_policy
from kvtier.replay import Trace, load_trace, parse_capacity, simulate_block, simulate_min

DEFAULT_TRACE = CONVERSATION_TRACE
DEFAULT_JSON = REPO / "bench" / "results" / "policies.json"
DEFAULT_CAPACITIES = (1.0, 5.0, 10.0)
QUICK_LIMIT = 1500
INT64_MAX = 2**63 - 1

#: (label, kvtier policy, libCacheSim class, vLLM policy); ``None`` where absent.
FAMILIES: tuple[tuple[str, str | None, str | None, str | None], ...] = (
    ("LRU", "lru", "LRU", "lru"),
    ("ARC", "arc", "ARC", "arc"),
    ("S3-FIFO", "s3fifo", "S3FIFO", None),
    ("SIEVE", "sieve", "Sieve", None),
    ("LFU", "lfu", "LFU", None),
    ("FIFO", "fifo", "FIFO", None),
    ("W-TinyLFU", None, "WTinyLFU", None),
    ("MIN / Belady", "MIN", "Belady", None),
)
KVTIER_POLICIES = tuple(f[1] for f in FAMILIES if f[1] is not None)
LCS_POLICIES = tuple(f[2] for f in FAMILIES if f[2] is not None)
#: Policies both kvtier and vLLM have, driven by the minimal loop.
LOOP_POLICIES = ("lru", "arc")
#: Targets reported (not tuned to): hit-ratio gap in points, speed ratio.
TARGET_GAP_POINTS = 0.5
TARGET_SPEEDUP = 3.0

#: Policies of the CPUOffloadingManager rows: vLLM's own, and kvtier's through the adapter.
MANAGER_VLLM_POLICIES = ("lru", "arc")
MANAGER_KVTIER_POLICIES = ("lru", "arc", "s3fifo", "sieve", "lfu", "fifo")

SYS_KVTIER = "kvtier"
SYS_LCS = "libCacheSim"
SYS_VLLM = "vLLM"
DRV_SIM = "replay simulator"
DRV_PY = "per request (Python)"
DRV_CPP = "C++ trace"
DRV_LOOP = "minimal loop"
SYS_MGR_VLLM = "vLLM manager + vLLM"
SYS_MGR_KVTIER = "vLLM manager + kvtier"
DRV_MGR = "CPUOffloadingManager"



# -- the access stream ----------------------------------------------------------


@dataclass
class Stream:
    """The block access stream of a trace, in the forms each driver needs."""

    trace: Trace
    #: Each request's block ids, in order.
    requests: list[list[int]]
    #: All block ids, flattened.
    keys: list[int]
    #: Index of each access's next access to the same key, ``INT64_MAX`` if none.
    next_access: list[int]

    @property
    def accesses(self) -> int:
        return len(self.keys)

    @property
    def unique(self) -> int:
        return self.trace.unique_blocks


def make_stream(trace: Trace) -> Stream:
    requests = [list(req.keys) for req in trace.requests]
    if any(req.output_keys for req in trace.requests):
        raise SystemExit("the trace has generated blocks; this benchmark expects a Mooncake trace")
    keys = [key for req in requests for key in req]
    next_access = [INT64_MAX] * len(keys)
    seen: dict[int, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        key = keys[i]
        next_access[i] = seen.get(key, INT64_MAX)
        seen[key] = i
    return Stream(trace, requests, keys, next_access)


def write_oracle_general(stream: Stream, path: Path) -> None:
    """libCacheSim's oracleGeneral binary trace: (u32 time, u64 id, u32 size, i64 next)."""
    dtype = np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
    assert dtype.itemsize == 24
    rec = np.zeros(stream.accesses, dtype=dtype)
    rec["t"] = np.arange(stream.accesses, dtype=np.uint32)
    rec["id"] = np.asarray(stream.keys, dtype=np.uint64)
    rec["size"] = 1
    nxt = np.asarray(stream.next_access, dtype=np.int64)
    nxt[nxt == INT64_MAX] = -1  # the format's "never again"
    rec["next"] = nxt
    rec.tofile(path)


# -- timing ---------------------------------------------------------------------


def timed(run: Callable[[], tuple[int, float | None]]) -> tuple[int, float]:
    """Run with ``gc`` off; ``run`` returns (hits, seconds or None to time it whole)."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        hits, seconds = run()
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return hits, elapsed if seconds is None else seconds


# -- kvtier ---------------------------------------------------------------------


def run_kvtier_sim(stream: Stream, policy: str, capacity: int) -> tuple[int, float | None]:
    if policy == "MIN":
        res = simulate_min(stream.trace, capacity, "block")
    else:
        res = simulate_block(stream.trace, policy, capacity)
    assert res.block_accesses == stream.accesses
    return res.block_hits, res.seconds


def run_kvtier_loop(stream: Stream, policy_name: str, capacity: int) -> tuple[int, float | None]:
    """kvtier's policy object in the minimal loop (the owner keeps residency)."""
    policy = make_policy(policy_name)
    policy.bind(capacity)
    access, admit, insert, evict = policy.access, policy.admit, policy.insert, policy.evict
    resident: set[int] = set()
    remove, add = resident.remove, resident.add
    hits = 0
    start = time.perf_counter()
    for keys in stream.requests:
        for key in keys:
            if key in resident:
                hits += 1
                access(key)
            elif admit(key):
                if len(resident) >= capacity:
                    remove(evict())
                insert(key, False)
                add(key)
    return hits, time.perf_counter() - start


# -- vLLM -----------------------------------------------------------------------


@dataclass
class VllmApi:
    policies: dict[str, type[Any]]
    chunk_status: type[Any]
    req_context: type[Any]
    #: vLLM's CPUOffloadingManager and what driving it needs; None if they do not import.
    manager: type[Any] | None = None
    make_offload_key: Callable[[bytes, int], Any] | None = None
    hit: Any = None
    #: kvtier's CachePolicy adapter: (module path, name of a kvtier policy's class).
    kvtier_module: str | None = None
    kvtier_class_name: Callable[[str], str] | None = None
    manager_error: str | None = None


def load_vllm() -> tuple[VllmApi | None, str | None]:
    """Import vLLM's offloading cache policies; ``(None, reason)`` when they do not import."""
    try:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
        from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
        from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy
    except Exception as exc:  # any import-time failure means: run without vLLM
        return None, f"{type(exc).__name__}: {exc}"
    api = VllmApi({"lru": LRUCachePolicy, "arc": ARCCachePolicy}, ChunkStatus, ReqContext)
    try:
        from vllm.v1.kv_offload.base import LookupResult, make_offload_key
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        from kvtier.integrations.vllm import cache_policy
    except Exception as exc:
        api.manager_error = f"{type(exc).__name__}: {exc}"
        return api, None
    api.manager = CPUOffloadingManager
    api.make_offload_key = make_offload_key
    api.hit = LookupResult.HIT
    api.kvtier_module = cache_policy.MODULE_PATH
    api.kvtier_class_name = cache_policy.policy_class_name
    return api, None


def run_vllm_manager(
    stream: Stream, api: VllmApi, system: str, policy_name: str, capacity: int
) -> tuple[int, float | None]:
    """vLLM's CPUOffloadingManager, per request, with vLLM's or kvtier's policy."""
    assert api.manager is not None and api.make_offload_key is not None
    if system == SYS_MGR_KVTIER:
        assert api.kvtier_class_name is not None
        manager = api.manager(
            capacity,
            cache_policy=api.kvtier_class_name(policy_name),
            cache_policy_module_path=api.kvtier_module,
        )
    else:
        manager = api.manager(capacity, cache_policy=policy_name)
    make_key = api.make_offload_key
    block_size = stream.trace.block_size
    requests = [[make_key(k.to_bytes(16, "big"), 0) for k in keys] for keys in stream.requests]
    contexts = []
    for i, keys in enumerate(requests):
        ctx = api.req_context(req_id=f"r{i}")
        for j, key in enumerate(keys):
            ctx.set_offload_key_position(key, (j + 1) * block_size)
        contexts.append(ctx)
    on_new, finished = manager.on_new_request, manager.on_request_finished
    lookup, prepare_load, complete_load = (
        manager.lookup, manager.prepare_load, manager.complete_load
    )
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    hit = api.hit
    hits = 0
    start = time.perf_counter()
    for keys, ctx in zip(requests, contexts, strict=True):
        on_new(ctx)
        n = 0
        for key in keys:
            if lookup(key, ctx) is not hit:
                break
            n += 1
        if n:
            loaded = keys[:n]
            prepare_load(loaded, ctx)
            complete_load(loaded, ctx)
            hits += n
        if n < len(keys):
            out = prepare_store(keys[n:], ctx)
            if out is not None and out.keys_to_store:
                complete_store(out.keys_to_store, ctx)
        finished(ctx)
    return hits, time.perf_counter() - start


def run_vllm_loop(
    stream: Stream, api: VllmApi, policy_name: str, capacity: int
) -> tuple[int, float | None]:
    """vLLM's CachePolicy object in the minimal loop (the policy keeps residency)."""
    policy = api.policies[policy_name](capacity)
    chunks = [api.chunk_status(i) for i in range(capacity)]
    for chunk in chunks:
        chunk.ref_cnt = 0  # stored and ready: evictable, and a hit counts as reuse
    contexts = [api.req_context(req_id="r") for _ in stream.requests]
    get, touch, on_miss = policy.get, policy.touch, policy.on_store_miss
    insert, evict = policy.insert, policy.evict
    protected: set[Any] = set()
    size = hits = 0
    start = time.perf_counter()
    for keys, ctx in zip(stream.requests, contexts, strict=True):
        for key in keys:
            if get(key) is not None:
                hits += 1
                touch((key,), ctx)
            else:
                # ARC adapts to a ghost hit here, before the insert removes the ghost.
                on_miss((key,), ctx)
                if size >= capacity:
                    victims = evict(1, protected)
                    chunk = victims[0][1]
                else:
                    chunk = chunks[size]
                    size += 1
                insert(key, chunk, ctx)
    return hits, time.perf_counter() - start


# -- libCacheSim ----------------------------------------------------------------


def load_libcachesim() -> tuple[Any | None, str | None]:
    try:
        import libcachesim
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return libcachesim, None


def run_lcs_python(
    lcs: Any, stream: Stream, name: str, capacity: int, hashpower: int
) -> tuple[int, float | None]:
    cache = getattr(lcs, name)(cache_size=capacity, hashpower=hashpower)
    req = lcs.Request()
    req.obj_size = 1
    get = cache.get
    hits = 0
    if name == "Belady":
        start = time.perf_counter()
        for key, nxt in zip(stream.keys, stream.next_access, strict=True):
            req.obj_id = key
            req.next_access_vtime = nxt
            hits += get(req)
    else:
        start = time.perf_counter()
        for key in stream.keys:
            req.obj_id = key
            hits += get(req)
    return hits, time.perf_counter() - start


def run_lcs_trace(
    lcs: Any, stream: Stream, name: str, capacity: int, hashpower: int, path: Path
) -> tuple[int, float | None]:
    cache = getattr(lcs, name)(cache_size=capacity, hashpower=hashpower)
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    start = time.perf_counter()
    miss_ratio, _ = cache.process_trace(reader)
    seconds = time.perf_counter() - start
    return round((1.0 - miss_ratio) * stream.accesses), seconds


# -- results --------------------------------------------------------------------


@dataclass
class Cell:
    """One system/driver/policy at one capacity, over all repeats."""

    system: str
    driver: str
    policy: str
    capacity_pct: float
    capacity_blocks: int
    accesses: int
    hits: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def hit_ratio(self) -> float:
        return self.hits[0] / self.accesses if self.accesses else 0.0

    @property
    def ops_per_s(self) -> list[float]:
        return [self.accesses / s if s > 0 else 0.0 for s in self.seconds]

    @property
    def ops_median(self) -> float:
        return median(self.ops_per_s)

    def as_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "driver": self.driver,
            "policy": self.policy,
            "capacity_pct": self.capacity_pct,
            "capacity_blocks": self.capacity_blocks,
            "accesses": self.accesses,
            "hits": self.hits[0],
            "hit_ratio": self.hit_ratio,
            "hits_identical_across_repeats": len(set(self.hits)) == 1,
            "seconds": self.seconds,
            "ops_per_s_median": self.ops_median,
            "ops_per_s_max": max(self.ops_per_s),
        }


class Results:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.cells: dict[tuple[str, str, str, float], Cell] = {}
        #: (capacity_pct, numerator, denominator) -> per-repeat speed ratios.
        self.pair_ratios: dict[tuple[float, str, str], list[float]] = {}
        self.warnings: list[str] = []

    def record(
        self, system: str, driver: str, policy: str, pct: float, cap: int, hits: int, s: float
    ) -> Cell:
        key = (system, driver, policy, pct)
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = Cell(system, driver, policy, pct, cap, self.stream.accesses)
        cell.hits.append(hits)
        cell.seconds.append(s)
        return cell

    def get(self, system: str, driver: str, policy: str | None, pct: float) -> Cell | None:
        if policy is None:
            return None
        return self.cells.get((system, driver, policy, pct))


# -- the run --------------------------------------------------------------------


def measure(
    stream: Stream,
    capacities: Sequence[float],
    repeat: int,
    lcs: Any | None,
    vllm: VllmApi | None,
    trace_file: Path | None,
    hashpower: int,
    manager_policies: Sequence[tuple[str, str]] = (),
) -> Results:
    results = Results(stream)
    caps = {
        pct: parse_capacity(f"{pct:g}%").blocks(stream.trace.block_size, stream.unique)
        for pct in capacities
    }
    for rep in range(repeat):
        log(f"repeat {rep + 1}/{repeat}")
        for pct, cap in caps.items():
            for policy in KVTIER_POLICIES:
                hits, s = timed(lambda p=policy, c=cap: run_kvtier_sim(stream, p, c))
                results.record(SYS_KVTIER, DRV_SIM, policy, pct, cap, hits, s)
            if lcs is not None:
                for name in LCS_POLICIES:
                    hits, s = timed(
                        lambda n=name, c=cap: run_lcs_python(lcs, stream, n, c, hashpower)
                    )
                    results.record(SYS_LCS, DRV_PY, name, pct, cap, hits, s)
                    if trace_file is not None:
                        hits, s = timed(
                            lambda n=name, c=cap, f=trace_file: run_lcs_trace(
                                lcs, stream, n, c, hashpower, f
                            )
                        )
                        results.record(SYS_LCS, DRV_CPP, name, pct, cap, hits, s)
            for policy in LOOP_POLICIES:
                # The two loops run back to back, in alternating order between repeats.
                runs: list[tuple[str, Callable[[], tuple[int, float | None]]]] = [
                    (SYS_KVTIER, lambda p=policy, c=cap: run_kvtier_loop(stream, p, c))
                ]
                if vllm is not None:
                    api = vllm
                    runs.append(
                        (SYS_VLLM, lambda p=policy, c=cap, a=api: run_vllm_loop(stream, a, p, c))
                    )
                if rep % 2:
                    runs.reverse()
                for system, run in runs:
                    hits, s = timed(run)
                    results.record(system, DRV_LOOP, policy, pct, cap, hits, s)
            if vllm is not None and vllm.manager is not None and manager_policies:
                # Alternate the order between repeats, as for the minimal loops.
                order = list(manager_policies)
                if rep % 2:
                    order.reverse()
                for system, policy in order:
                    hits, s = timed(
                        lambda sy=system, p=policy, c=cap, a=vllm: run_vllm_manager(
                            stream, a, sy, p, c
                        )
                    )
                    results.record(system, DRV_MGR, policy, pct, cap, hits, s)
            if vllm is not None:
                for num in LOOP_POLICIES:
                    for den in LOOP_POLICIES:
                        a = results.get(SYS_KVTIER, DRV_LOOP, num, pct)
                        b = results.get(SYS_VLLM, DRV_LOOP, den, pct)
                        assert a is not None and b is not None
                        results.pair_ratios.setdefault((pct, num, den), []).append(
                            a.ops_per_s[-1] / b.ops_per_s[-1]
                        )
    check(results)
    return results


def check(results: Results) -> None:
    """Deterministic hit counts must agree across repeats and across drivers."""
    for cell in results.cells.values():
        if len(set(cell.hits)) != 1:
            results.warnings.append(
                f"{cell.system} {cell.driver} {cell.policy} at {cell.capacity_pct:g}%: "
                f"hits differ across repeats: {cell.hits}"
            )
    pcts = sorted({c.capacity_pct for c in results.cells.values()})
    for pct in pcts:
        for name in LCS_POLICIES:
            py = results.get(SYS_LCS, DRV_PY, name, pct)
            cpp = results.get(SYS_LCS, DRV_CPP, name, pct)
            if py is not None and cpp is not None and py.hits[0] != cpp.hits[0]:
                results.warnings.append(
                    f"libCacheSim {name} at {pct:g}%: per-request hits {py.hits[0]} != "
                    f"C++ trace hits {cpp.hits[0]}"
                )
        for policy in LOOP_POLICIES:
            sim = results.get(SYS_KVTIER, DRV_SIM, policy, pct)
            loop = results.get(SYS_KVTIER, DRV_LOOP, policy, pct)
            if sim is not None and loop is not None and sim.hits[0] != loop.hits[0]:
                results.warnings.append(
                    f"kvtier {policy} at {pct:g}%: simulator hits {sim.hits[0]} != "
                    f"minimal-loop hits {loop.hits[0]}"
                )


# -- tables ---------------------------------------------------------------------


def pct_text(ratio: float) -> str:
    return f"{100 * ratio:.3f}%"


def cap_text(pct: float, blocks: int) -> str:
    return f"{pct:g}% ({blocks:,})"


def hit_table(results: Results) -> tuple[list[str], list[list[object]]]:
    headers = [
        "capacity", "policy", "kvtier", "libCacheSim", "vLLM", "kvtier - libCacheSim (pts)"
    ]
    rows: list[list[object]] = []
    caps = sorted({(c.capacity_pct, c.capacity_blocks) for c in results.cells.values()})
    for pct, blocks in caps:
        for n, (label, kv, lc, vl) in enumerate(FAMILIES):
            a = results.get(SYS_KVTIER, DRV_SIM, kv, pct)
            b = results.get(SYS_LCS, DRV_PY, lc, pct)
            c = results.get(SYS_VLLM, DRV_LOOP, vl, pct)
            gap = f"{100 * (a.hit_ratio - b.hit_ratio):+.3f}" if a and b else "-"
            rows.append([
                cap_text(pct, blocks) if n == 0 else "",
                label,
                pct_text(a.hit_ratio) if a else "-",
                pct_text(b.hit_ratio) if b else "-",
                pct_text(c.hit_ratio) if c else "-",
                gap,
            ])
    return headers, rows


def speed_table(results: Results) -> tuple[list[str], list[list[object]]]:
    pcts = sorted({c.capacity_pct for c in results.cells.values()})
    headers = ["system", "driver", "policy", *[f"{p:g}% ops/s" for p in pcts]]
    order = [
        (SYS_KVTIER, DRV_SIM, KVTIER_POLICIES),
        (SYS_LCS, DRV_PY, LCS_POLICIES),
        (SYS_LCS, DRV_CPP, LCS_POLICIES),
        (SYS_KVTIER, DRV_LOOP, LOOP_POLICIES),
        (SYS_VLLM, DRV_LOOP, LOOP_POLICIES),
    ]
    rows: list[list[object]] = []
    for system, driver, policies in order:
        for policy in policies:
            cells = [results.get(system, driver, policy, p) for p in pcts]
            if all(c is None for c in cells):
                continue
            rows.append([
                system, driver, policy,
                *[f"{c.ops_median:,.0f}" if c else "-" for c in cells],
            ])
    return headers, rows


def manager_label(system: str, policy: str) -> str:
    return f"{system} {policy.upper() if system == SYS_MGR_VLLM else policy}"


def manager_rows(results: Results) -> list[dict[str, Any]]:
    """The CPUOffloadingManager cells, with each kvtier policy's speed against vLLM's own."""
    out = []
    cells = [c for c in results.cells.values() if c.driver == DRV_MGR]
    for cell in sorted(cells, key=lambda c: c.capacity_pct):
        ratio = None
        if cell.system == SYS_MGR_KVTIER:
            own = results.get(SYS_MGR_VLLM, DRV_MGR, cell.policy, cell.capacity_pct)
            if own is not None:
                ratio = median([
                    a / b for a, b in zip(cell.ops_per_s, own.ops_per_s, strict=False) if b
                ])
        out.append({
            "label": manager_label(cell.system, cell.policy),
            "capacity_pct": cell.capacity_pct,
            "capacity_blocks": cell.capacity_blocks,
            "hit_ratio": cell.hit_ratio,
            "hits": cell.hits[0],
            "ops_per_s_median": cell.ops_median,
            "speed_vs_vllm_same_policy": ratio,
        })
    return out


def manager_table(results: Results) -> tuple[list[str], list[list[object]]]:
    headers = [
        "capacity", "system", "prefix hit ratio", "accesses/s", "speed vs vLLM's own policy"
    ]
    rows: list[list[object]] = []
    last = None
    for r in manager_rows(results):
        cap = cap_text(r["capacity_pct"], r["capacity_blocks"])
        ratio = r["speed_vs_vllm_same_policy"]
        rows.append([
            cap if cap != last else "",
            r["label"],
            pct_text(r["hit_ratio"]),
            f"{r['ops_per_s_median']:,.0f}",
            f"{ratio:.2f}x" if ratio is not None else "",
        ])
        last = cap
    return headers, rows


def ratio_rows(results: Results) -> list[dict[str, Any]]:
    out = []
    for (pct, num, den), values in sorted(results.pair_ratios.items()):
        out.append({
            "capacity_pct": pct,
            "kvtier_policy": num,
            "vllm_policy": den,
            "ratio_median": median(values),
            "ratios": values,
        })
    return out


def ratio_table(results: Results) -> tuple[list[str], list[list[object]]]:
    pcts = sorted({c.capacity_pct for c in results.cells.values()})
    headers = ["kvtier policy / vLLM policy (minimal loop)", *[f"{p:g}%" for p in pcts]]
    rows: list[list[object]] = []
    for num in LOOP_POLICIES:
        for den in LOOP_POLICIES:
            vals = [results.pair_ratios.get((p, num, den)) for p in pcts]
            if all(v is None for v in vals):
                continue
            rows.append([
                f"kvtier {num} / vLLM {den}",
                *[f"{median(v):.2f}x" if v else "-" for v in vals],
            ])
    return headers, rows


def targets(results: Results) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pcts = sorted({c.capacity_pct for c in results.cells.values()})
    for pct in pcts:
        for kv, lc in (("lru", "LRU"), ("arc", "ARC")):
            a = results.get(SYS_KVTIER, DRV_SIM, kv, pct)
            b = results.get(SYS_LCS, DRV_PY, lc, pct)
            if a is None or b is None:
                continue
            gap = 100 * abs(a.hit_ratio - b.hit_ratio)
            out.append({
                "target": f"kvtier {kv} hit ratio within {TARGET_GAP_POINTS} points "
                f"of libCacheSim {lc}",
                "capacity_pct": pct,
                "value": gap,
                "met": gap <= TARGET_GAP_POINTS,
            })
        for num in LOOP_POLICIES:
            ratios = results.pair_ratios.get((pct, num, "arc"))
            if not ratios:
                continue
            value = median(ratios)
            out.append({
                "target": f"kvtier {num} ops/s at least {TARGET_SPEEDUP:g}x vLLM arc "
                "(minimal loop)",
                "capacity_pct": pct,
                "value": value,
                "met": value >= TARGET_SPEEDUP,
            })
    return out


def render(results: Results, markdown: bool) -> str:
    stream = results.stream
    fmt = format_markdown_table if markdown else format_table
    parts = [
        f"trace {stream.trace.name}: {len(stream.requests):,} requests, "
        f"{stream.accesses:,} block accesses, {stream.unique:,} unique blocks",
        "",
        "Block hit ratio (deterministic; vLLM = its policy objects in the minimal loop)",
        "",
        fmt(*hit_table(results)),
        "",
        "Speed, accesses per second (median of repeats)",
        "",
        fmt(*speed_table(results)),
    ]
    if results.pair_ratios:
        parts += ["", "Speed ratio, same loop (median of per-repeat ratios)", ""]
        parts.append(fmt(*ratio_table(results)))
    if any(c.driver == DRV_MGR for c in results.cells.values()):
        parts += [
            "",
            "vLLM's CPUOffloadingManager per request, with vLLM's policies and kvtier's "
            "(prefix hits; median accesses/s)",
            "",
            fmt(*manager_table(results)),
        ]
    tg = targets(results)
    if tg:
        parts += ["", "Targets"]
        for t in tg:
            unit = "x" if "ops/s" in t["target"] else " pts"
            parts.append(
                f"  {'met ' if t['met'] else 'MISS'}  {t['capacity_pct']:>4g}%  {t['target']}: "
                f"{t['value']:.3f}{unit}"
            )
    for w in results.warnings:
        parts.append(f"WARNING: {w}")
    return "\n".join(parts)


# -- command line ---------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Eviction policy hit ratio and speed: kvtier against libCacheSim and "
        "vLLM's offloading cache policies, on one block access stream.",
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--capacity", type=float, nargs="+", default=list(DEFAULT_CAPACITIES),
        metavar="PCT", help="cache sizes in percent of unique blocks (default 1 5 10)",
    )
    p.add_argument("--repeat", type=int, default=3, help="timed runs per cell (default 3)")
    p.add_argument(
        "--quick", action="store_true",
        help=f"smoke run: first {QUICK_LIMIT} requests, one repeat",
    )
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's policies")
    p.add_argument(
        "--manager-policies", nargs="*", default=list(MANAGER_KVTIER_POLICIES),
        metavar="POLICY",
        help="kvtier policies to run inside vLLM's CPUOffloadingManager, next to vLLM's own "
        f"{' and '.join(MANAGER_VLLM_POLICIES)} (default: {' '.join(MANAGER_KVTIER_POLICIES)})",
    )
    p.add_argument(
        "--no-manager", action="store_true",
        help="skip the vLLM CPUOffloadingManager rows",
    )
    p.add_argument("--no-libcachesim", action="store_true", help="skip libCacheSim")
    p.add_argument(
        "--no-cpp-trace", action="store_true",
        help="skip libCacheSim's C++ trace driver (no temporary trace file)",
    )
    p.add_argument(
        "--lcs-hashpower", type=int, default=16, metavar="N",
        help="libCacheSim hash table of 2**N buckets (default 16; the library's default 24 "
        "allocates 128 MiB per cache, whose first touches land in the timed loop)",
    )
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--json-out", type=Path, default=DEFAULT_JSON, help="where to write JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.repeat = 1
        if args.limit is None:
            args.limit = QUICK_LIMIT
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if any(c <= 0 or c > 100 for c in args.capacity):
        p.error("--capacity takes percentages in (0, 100]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    trace = load_trace(args.trace, limit=args.limit)
    stream = make_stream(trace)
    log(f"loaded {trace.name}: {stream.accesses:,} accesses in {time.perf_counter() - t0:.2f}s")

    lcs, lcs_error = (None, "skipped (--no-libcachesim)")
    if not args.no_libcachesim:
        lcs, lcs_error = load_libcachesim()
    vllm, vllm_error = (None, "skipped (--no-vllm)")
    if not args.no_vllm:
        t1 = time.perf_counter()
        vllm, vllm_error = load_vllm()
        status = "imported" if vllm else vllm_error
        log(f"vLLM policies: {status} ({time.perf_counter() - t1:.2f}s)")
    if lcs is None:
        log(f"libCacheSim not used: {lcs_error}")

    # Long-lived objects (vLLM's import pulls in torch) move out of the collector's
    # reach, so the collection before each timed run stays cheap.
    gc.collect()
    gc.freeze()
    with tempfile.TemporaryDirectory(prefix="kvtier-policies-") as tmp:
        trace_file: Path | None = None
        if lcs is not None and not args.no_cpp_trace:
            trace_file = Path(tmp) / "stream.oracleGeneral.bin"
            write_oracle_general(stream, trace_file)
        manager_policies: list[tuple[str, str]] = []
        if vllm is not None and vllm.manager is not None and not args.no_manager:
            manager_policies = [(SYS_MGR_VLLM, p) for p in MANAGER_VLLM_POLICIES] + [
                (SYS_MGR_KVTIER, p) for p in args.manager_policies
            ]
        elif vllm is not None and vllm.manager_error:
            log(f"vLLM's CPUOffloadingManager not used: {vllm.manager_error}")
        results = measure(
            stream, args.capacity, args.repeat, lcs, vllm, trace_file, args.lcs_hashpower,
            manager_policies,
        )

    print(render(results, args.markdown))
    payload: dict[str, Any] = {
        "benchmark": "policies",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "machine": machine_info(),
        "git": git_state(REPO),
        "versions": {
            "kvtier": package_version("kvtier"),
            "libcachesim": package_version("libcachesim"),
            "vllm": package_version("vllm"),
            "numpy": package_version("numpy"),
        },
        "trace": {
            "path": str(args.trace),
            "name": trace.name,
            "requests": len(stream.requests),
            "block_accesses": stream.accesses,
            "unique_blocks": stream.unique,
            "block_size": trace.block_size,
        },
        "config": {
            "capacities_pct": args.capacity,
            "repeat": args.repeat,
            "limit": args.limit,
            "vllm": vllm_error or "imported",
            "libcachesim": lcs_error or "imported",
            "cpp_trace_driver": trace_file is not None,
            "libcachesim_hashpower": args.lcs_hashpower,
            "manager_policies": [f"{sy} {p}" for sy, p in manager_policies],
        },
        "cells": [c.as_json() for c in results.cells.values()],
        "speed_ratios": ratio_rows(results),
        "vllm_manager": manager_rows(results),
        "targets": targets(results),
        "warnings": results.warnings,
        "wall_seconds": time.perf_counter() - t0,
    }
    write_json(args.json_out, payload)
    log(f"wrote {args.json_out} ({payload['wall_seconds']:.1f}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
