"""Bookkeeping throughput: kvtier's KVCacheManager against vLLM's prefix-caching BlockPool.

What is measured: the CPU cost of the block bookkeeping an engine's scheduler
does per request (find the longest cached prefix, take references on the hits,
allocate the remaining blocks, publish the full blocks to the prefix cache,
append generated tokens, release everything at the end, evicting cached blocks
under LRU when the pool runs out). No KV data moves; nothing runs on a GPU.

Both systems replay the *same* pre-generated request stream in the same
process, one after the other, with a fresh manager / pool for every timed run:

* **kvtier**: ``KVCacheManager.allocate`` (prompt) -> ``extend`` (all generated
  tokens in one call) -> ``free``.
* **vLLM**: ``vllm.v1.core.block_pool.BlockPool`` driven the way vLLM's
  ``FullAttentionManager`` drives it: longest cached prefix through
  ``get_cached_block`` (capped so the last prompt token is recomputed),
  ``touch`` on the hits, ``get_new_blocks`` for the rest, ``cache_full_blocks``
  for the full blocks (prompt, then the blocks the generated tokens fill), and
  ``free_blocks`` tail first when the request ends. The driver is a minimal
  loop around those calls, so it is an upper bound on vLLM's speed: the real
  manager adds its own per-request bookkeeping on top.

Requests are live in a FIFO window of ``--window`` requests (default 8): before
request ``i`` is admitted, request ``i - window`` is freed, so hits land on both
pinned (live) and evictable (released) blocks.

Two timing modes:

* ``bookkeeping``: block hashes are computed before the clock starts, for both
  systems (kvtier: ``hasher.chain`` keys passed as ``block_keys=`` to ``allocate``
  and, for the blocks the generated tokens fill, to ``extend``; vLLM: the
  request's block hashes with its own hash function). A kvtier whose ``extend``
  takes no ``block_keys`` hashes those blocks inside the timed region; the JSON
  records which (``kvtier_extend_block_keys``).
* ``with hashing``: hashing is inside the timed region for both (kvtier:
  ``allocate`` without ``block_keys``; vLLM: its request block hasher
  ``get_request_block_hasher`` on the prompt and again after the generated
  tokens are appended).

blocks/s = (hit blocks + newly allocated blocks over all requests) / seconds of
the manager calls alone. That count is the same for both systems (every
request holds ceil(tokens / block_size) blocks once done) and is checked.

An untimed validation pass first replays the stream once per system and
compares the hit length of every request, the hit ratio (hit prompt tokens /
prompt tokens) and the eviction count.

Run ``python bench/bookkeeping.py --help`` for the options; ``--quick`` is a
smoke run of a few seconds plus vLLM's import time, and ``--profile MODE``
prints a cProfile of one extra kvtier replay per cell.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import inspect
import io
import math
import os
import pstats
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, ClassVar

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

from kvtier import KVCacheManager
from kvtier.replay import load_trace

DEFAULT_TRACE = CONVERSATION_TRACE
DEFAULT_JSON = REPO / "bench" / "results" / "bookkeeping.json"
#: SmolLM2's vocabulary size; token ids are drawn below it.
VOCAB = 49152
#: Block size of the Mooncake trace's ``hash_ids``.
TRACE_HASH_BLOCK = 512
MODES = ("bookkeeping", "with hashing")
#: Whether this kvtier's ``extend`` accepts precomputed keys.
EXTEND_TAKES_KEYS = "block_keys" in inspect.signature(KVCacheManager.extend).parameters
SYSTEMS = ("kvtier", "vllm")



# -- the request stream -------------------------------------------------------


@dataclass(slots=True)
class Request:
    """One request of the stream: its prompt and the tokens it generates."""

    prompt: list[int]
    output: list[int]


@dataclass
class Workload:
    name: str
    block_size: int
    window: int
    requests: list[Request]
    description: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output) for r in self.requests)

    @property
    def blocks_handled(self) -> int:
        bs = self.block_size
        return sum(-(-(len(r.prompt) + len(r.output)) // bs) for r in self.requests)

    @property
    def max_request_blocks(self) -> int:
        bs = self.block_size
        return max(-(-(len(r.prompt) + len(r.output)) // bs) for r in self.requests)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A stateless 64-bit mixer: deterministic pseudo-random values per input."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class TokenSource:
    """Deterministic token ids as Python ints that share one object per id.

    Sharing the int objects keeps a stream of tens of millions of tokens at
    8 bytes a token (a list slot), instead of ~36.
    """

    _BLOCK_SALT = 0x1000_0000_0000
    _UNIQUE_SALT = 0x2000_0000_0000_0000

    def __init__(self, vocab: int = VOCAB) -> None:
        self.vocab = vocab
        self._ints = np.array(list(range(vocab)), dtype=object)
        self._blocks: dict[int, list[int]] = {}
        self._arange = np.arange(TRACE_HASH_BLOCK, dtype=np.uint64)

    def _tokens(self, seeds: np.ndarray) -> list[int]:
        ids = _splitmix64(seeds) % np.uint64(self.vocab)
        out: list[int] = self._ints[ids.astype(np.int64)].tolist()
        return out

    def trace_block(self, hash_id: int) -> list[int]:
        """The 512 tokens of a trace block: the same for every request that names it."""
        block = self._blocks.get(hash_id)
        if block is None:
            base = np.uint64(self._BLOCK_SALT + hash_id * TRACE_HASH_BLOCK)
            block = self._tokens(base + self._arange)
            self._blocks[hash_id] = block
        return block

    def unique(self, stream: int, n: int) -> list[int]:
        """``n`` tokens no other stream shares (generated tokens, unique tails)."""
        if n <= 0:
            return []
        base = np.uint64(self._UNIQUE_SALT + (stream << 24))
        return self._tokens(base + np.arange(n, dtype=np.uint64))

    def random(self, rng: np.random.Generator, n: int) -> list[int]:
        out: list[int] = self._ints[rng.integers(0, self.vocab, n)].tolist()
        return out

    def forget_blocks(self) -> None:
        self._blocks.clear()


def trace_workload(
    path: Path, limit: int | None, block_size: int, window: int, src: TokenSource
) -> Workload:
    """The Mooncake trace expanded to token ids.

    Block ``j`` of a request holds the 512 tokens derived from ``hash_ids[j]``,
    so requests that share leading hash ids share those tokens; the prompt is
    cut to ``input_length`` (the last hash id covers a partial block), and the
    ``output_length`` generated tokens are unique to the request.
    """
    trace = load_trace(path, block_size=TRACE_HASH_BLOCK, limit=limit)
    requests: list[Request] = []
    for i, rec in enumerate(trace.requests):
        prompt: list[int] = []
        for hash_id in rec.keys:  # a Mooncake trace's keys are its hash_ids
            prompt += src.trace_block(hash_id)
        n = rec.input_length
        if n <= len(prompt):
            del prompt[n:]
        else:  # not in the published traces; kept for other files of the format
            prompt += src.unique(2 * i + 1, n - len(prompt))
        output = src.unique(2 * i, rec.output_length)
        requests.append(Request(prompt, output))
    src.forget_blocks()
    return Workload(
        name=f"mooncake-conv bs={block_size}",
        block_size=block_size,
        window=window,
        requests=requests,
        description=(
            f"{path.name}: {len(requests)} requests in trace order; 512-token blocks "
            "from hash_ids, output_length generated tokens appended in one extend"
        ),
        params={"trace": str(path), "requests": len(requests)},
    )


def synthetic_workload(
    n_requests: int,
    block_size: int,
    window: int,
    src: TokenSource,
    *,
    n_docs: int = 64,
    doc_tokens: int = 2048,
    question: tuple[int, int] = (64, 256),
    output: tuple[int, int] = (16, 128),
    zipf_s: float = 1.1,
    seed: int = 0,
) -> Workload:
    """Shared document / system-prompt prefixes with Zipf popularity.

    Each request is one of ``n_docs`` documents of ``doc_tokens`` tokens
    (document ``k`` drawn with probability proportional to ``1 / (k+1)**zipf_s``)
    followed by a unique question; it then generates a unique answer.
    """
    rng = np.random.default_rng(seed)
    docs = [src.random(rng, doc_tokens) for _ in range(n_docs)]
    weights = 1.0 / np.arange(1, n_docs + 1, dtype=np.float64) ** zipf_s
    doc_ids = rng.choice(n_docs, size=n_requests, p=weights / weights.sum())
    q_lens = rng.integers(question[0], question[1] + 1, size=n_requests)
    o_lens = rng.integers(output[0], output[1] + 1, size=n_requests)
    requests = [
        Request(docs[int(d)] + src.random(rng, int(q)), src.random(rng, int(o)))
        for d, q, o in zip(doc_ids, q_lens, o_lens, strict=True)
    ]
    params = {
        "requests": n_requests,
        "documents": n_docs,
        "doc_tokens": doc_tokens,
        "question_tokens": list(question),
        "output_tokens": list(output),
        "zipf_s": zipf_s,
        "seed": seed,
    }
    return Workload(
        name=f"shared-prefix bs={block_size}",
        block_size=block_size,
        window=window,
        requests=requests,
        description=(
            f"{n_requests} requests: one of {n_docs} {doc_tokens}-token documents "
            f"(Zipf s={zipf_s}) + a unique {question[0]}-{question[1]}-token question; "
            f"{output[0]}-{output[1]} generated tokens"
        ),
        params=params,
    )


# -- vLLM ---------------------------------------------------------------------


@dataclass
class VllmApi:
    """The pieces of vLLM the benchmark drives, imported lazily."""

    block_pool_cls: Any
    counting_block_pool_cls: Any
    request_block_hasher: Callable[[int, Callable[[Any], bytes]], Callable[[Any], list[bytes]]]
    hash_fn: Callable[[Any], bytes]
    hash_name: str
    version: str | None


def load_vllm(hash_name: str) -> tuple[VllmApi | None, str | None]:
    """Import vLLM's block pool; ``(None, reason)`` when it cannot be imported."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.block_pool import BlockPool
    except Exception as exc:  # any import-time failure means: run kvtier alone
        return None, f"{type(exc).__name__}: {exc}"

    class CountingBlockPool(BlockPool):  # type: ignore[misc, valid-type]
        """BlockPool that counts evictions (validation pass only, never timed)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.evictions = 0

        def _maybe_evict_cached_block(self, block: Any) -> bool:
            evicted: bool = super()._maybe_evict_cached_block(block)
            self.evictions += evicted
            return evicted

    hash_fn = get_hash_fn_by_name(hash_name)
    kv_cache_utils.init_none_hash(hash_fn)
    return (
        VllmApi(
            block_pool_cls=BlockPool,
            counting_block_pool_cls=CountingBlockPool,
            request_block_hasher=kv_cache_utils.get_request_block_hasher,
            hash_fn=hash_fn,
            hash_name=hash_name,
            version=package_version("vllm"),
        ),
        None,
    )


class _HashedRequest:
    """What ``BlockPool.cache_full_blocks`` reads of a request: its block hashes."""

    __slots__ = ("block_hashes",)

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes


class _HashingRequest:
    """What vLLM's request block hasher reads of a ``vllm.v1.request.Request``.

    A plain-text request: no multimodal features, LoRA, cache salt or prompt
    embeddings, so every block's extra keys are ``None``.
    """

    __slots__ = ("all_token_ids", "block_hashes")
    mm_features: ClassVar[tuple[()]] = ()
    lora_request: ClassVar[None] = None
    cache_salt: ClassVar[None] = None
    prompt_embeds: ClassVar[None] = None

    def __init__(self, prompt: list[int]) -> None:
        # vLLM's Request copies the prompt into its token list, as kvtier does.
        self.all_token_ids = list(prompt)
        self.block_hashes: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


# -- runs ---------------------------------------------------------------------


@dataclass
class Prepared:
    """Block hashes computed once per workload, before any clock starts."""

    kvtier_keys: list[list[int]]
    kvtier_output_keys: list[list[int]]
    vllm_prompt_hashes: list[list[bytes]] | None
    vllm_output_hashes: list[list[bytes]] | None
    unique_prompt_blocks: int


@dataclass
class RunResult:
    seconds: float
    hit_tokens: int
    prompt_tokens: int
    evictions: int | None = None
    cascade_evictions: int | None = None
    hit_blocks: list[int] | None = None
    blocks_handled: int | None = None


def prepare(wl: Workload, api: VllmApi | None) -> Prepared:
    bs = wl.block_size
    hasher = KVCacheManager(1, bs).hasher
    t0 = time.perf_counter()
    keys: list[list[int]] = []
    output_keys: list[list[int]] = []
    for r in wl.requests:
        chain = hasher.chain(r.prompt + r.output)
        n_prompt = len(r.prompt) // bs
        keys.append(chain[:n_prompt])
        output_keys.append(chain[n_prompt:])
    log(f"  kvtier keys: {time.perf_counter() - t0:.1f} s")
    unique = len({k for ks in keys for k in ks})
    prompt_hashes: list[list[bytes]] | None = None
    output_hashes: list[list[bytes]] | None = None
    if api is not None:
        t0 = time.perf_counter()
        block_hasher = api.request_block_hasher(bs, api.hash_fn)
        prompt_hashes, output_hashes = [], []
        for r in wl.requests:
            req = _HashingRequest(r.prompt)
            prompt_hashes.append(block_hasher(req))
            req.block_hashes = list(prompt_hashes[-1])
            req.all_token_ids.extend(r.output)
            output_hashes.append(block_hasher(req))
        log(f"  vLLM {api.hash_name} hashes: {time.perf_counter() - t0:.1f} s")
    return Prepared(keys, output_keys, prompt_hashes, output_hashes, unique)


def run_kvtier(
    wl: Workload, prep: Prepared, num_blocks: int, hashing: bool, validate: bool = False
) -> RunResult:
    """Replay ``wl`` through a fresh ``KVCacheManager``; time the manager calls."""
    m = KVCacheManager(num_blocks, wl.block_size)
    requests = wl.requests
    keys = prep.kvtier_keys
    output_keys = prep.kvtier_output_keys
    keyed_extend = EXTEND_TAKES_KEYS and not hashing
    window = wl.window
    allocate, extend, free = m.allocate, m.extend, m.free
    live: deque[int] = deque()
    hit_blocks: list[int] | None = [] if validate else None
    handled = 0
    bs = wl.block_size
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            if len(live) == window:
                free(live.popleft())
            a = allocate(i, r.prompt) if hashing else allocate(i, r.prompt, block_keys=keys[i])
            if r.output:
                if keyed_extend:
                    ext = extend(i, r.output, block_keys=output_keys[i])
                else:
                    ext = extend(i, r.output)
                if hit_blocks is not None:
                    handled += len(ext.new_blocks)
            live.append(i)
            if hit_blocks is not None:
                hit_blocks.append(a.num_cached_tokens // bs)
                handled += len(a.block_table.blocks)
        while live:
            free(live.popleft())
        seconds = time.perf_counter() - t0
    finally:
        gc.enable()
    if validate:
        m.check()
    stats = m.stats()
    return RunResult(
        seconds=seconds,
        hit_tokens=stats.hit_tokens,
        prompt_tokens=stats.queried_tokens,
        evictions=stats.evictions,
        cascade_evictions=stats.cascade_evictions,
        hit_blocks=hit_blocks,
        blocks_handled=handled if validate else None,
    )


def run_vllm(
    api: VllmApi,
    wl: Workload,
    prep: Prepared,
    num_blocks: int,
    hashing: bool,
    validate: bool = False,
) -> RunResult:
    """Replay ``wl`` through a fresh vLLM ``BlockPool``; time the pool calls.

    The pool gets ``num_blocks + 1`` blocks: vLLM keeps block 0 as its null
    block, so both systems have ``num_blocks`` usable blocks.
    """
    bs = wl.block_size
    pool_cls = api.counting_block_pool_cls if validate else api.block_pool_cls
    pool = pool_cls(num_blocks + 1, enable_caching=True, hash_block_size=bs)
    get_cached_block = pool.get_cached_block
    touch = pool.touch
    get_new_blocks = pool.get_new_blocks
    cache_full_blocks = pool.cache_full_blocks
    free_blocks = pool.free_blocks
    num_free = pool.get_num_free_blocks
    block_hasher = api.request_block_hasher(bs, api.hash_fn)
    assert prep.vllm_prompt_hashes is not None and prep.vllm_output_hashes is not None
    prompt_hashes = prep.vllm_prompt_hashes
    output_hashes = prep.vllm_output_hashes
    requests = wl.requests
    window = wl.window
    group_ids = [0]
    live: deque[list[Any]] = deque()
    hit_blocks: list[int] | None = [] if validate else None
    hit_tokens = prompt_tokens = handled = 0
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            if len(live) == window:
                free_blocks(reversed(live.popleft()))
            n = len(r.prompt)
            req: _HashingRequest | _HashedRequest
            if hashing:
                req = _HashingRequest(r.prompt)
                req.block_hashes.extend(block_hasher(req))
            else:
                req = _HashedRequest(list(prompt_hashes[i]))
            # FullAttentionManager.find_longest_cache_hit, max_length = n - 1.
            computed: list[Any] = []
            for block_hash in islice(req.block_hashes, (n - 1) // bs):
                cached = get_cached_block(block_hash, group_ids)
                if not cached:
                    break
                computed.append(cached[0])
            n_hit = len(computed)
            # get_num_blocks_to_allocate + the free-space check of allocate_slots.
            n_new = -(-n // bs) - n_hit
            if n_new + sum(b.ref_cnt == 0 for b in computed) > num_free():
                raise RuntimeError(f"request {i}: vLLM pool out of blocks")
            touch(computed)
            blocks = computed + get_new_blocks(n_new)
            n_full = n // bs
            cache_full_blocks(req, blocks, n_hit, n_full, bs, 0)
            hit_tokens += n_hit * bs
            prompt_tokens += n
            if r.output:
                total = n + len(r.output)
                grow = -(-total // bs) - len(blocks)
                if grow > num_free():
                    raise RuntimeError(f"request {i}: vLLM pool out of blocks")
                if grow > 0:
                    blocks.extend(get_new_blocks(grow))
                if isinstance(req, _HashingRequest):
                    req.all_token_ids.extend(r.output)
                    req.block_hashes.extend(block_hasher(req))
                else:
                    req.block_hashes.extend(output_hashes[i])
                cache_full_blocks(req, blocks, n_full, total // bs, bs, 0)
            live.append(blocks)
            if hit_blocks is not None:
                hit_blocks.append(n_hit)
                handled += len(blocks)
        while live:
            free_blocks(reversed(live.popleft()))
        seconds = time.perf_counter() - t0
    finally:
        gc.enable()
    return RunResult(
        seconds=seconds,
        hit_tokens=hit_tokens,
        prompt_tokens=prompt_tokens,
        evictions=pool.evictions if validate else None,
        hit_blocks=hit_blocks,
        blocks_handled=handled if validate else None,
    )


def run_system(
    system: str,
    api: VllmApi | None,
    wl: Workload,
    prep: Prepared,
    num_blocks: int,
    hashing: bool,
    validate: bool = False,
) -> RunResult:
    if system == "kvtier":
        return run_kvtier(wl, prep, num_blocks, hashing, validate)
    assert api is not None
    return run_vllm(api, wl, prep, num_blocks, hashing, validate)


# -- the benchmark ------------------------------------------------------------


def compare_hits(a: Sequence[int], b: Sequence[int]) -> dict[str, Any]:
    mismatched = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    out: dict[str, Any] = {"mismatched_requests": len(mismatched)}
    if mismatched:
        first = mismatched[0]
        out["first_mismatch"] = {"request": first, "kvtier": a[first], "vllm": b[first]}
    return out


def profile_kvtier(wl: Workload, prep: Prepared, num_blocks: int, mode: str, top: int) -> str:
    """cProfile of one extra kvtier replay in ``mode`` (not part of the timings)."""
    profiler = cProfile.Profile()
    profiler.enable()
    run = run_kvtier(wl, prep, num_blocks, mode != "bookkeeping")
    profiler.disable()
    out = io.StringIO()
    out.write(
        f"cProfile: kvtier, {wl.name}, {num_blocks:,} blocks, {mode} "
        f"({run.seconds:.3f} s under the profiler)\n"
    )
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def bench_workload(
    wl: Workload,
    api: VllmApi | None,
    fractions: Sequence[float],
    repeat: int,
    profile: str | None = None,
) -> dict[str, Any]:
    log(f"{wl.name}: {len(wl.requests)} requests, {wl.prompt_tokens:,} prompt tokens")
    prep = prepare(wl, api)
    systems = [s for s in SYSTEMS if s == "kvtier" or api is not None]
    reserve = wl.window * wl.max_request_blocks
    result: dict[str, Any] = {
        "name": wl.name,
        "description": wl.description,
        "params": wl.params,
        "block_size": wl.block_size,
        "window": wl.window,
        "requests": len(wl.requests),
        "prompt_tokens": wl.prompt_tokens,
        "output_tokens": wl.output_tokens,
        "blocks_handled": wl.blocks_handled,
        "unique_prompt_blocks": prep.unique_prompt_blocks,
        "window_reserve_blocks": reserve,
        "capacities": [],
    }
    for frac in fractions:
        num_blocks = math.ceil(frac * prep.unique_prompt_blocks) + reserve
        label = f"{frac:.0%} ({num_blocks:,})"
        log(f"  capacity {label}: validation pass")
        validation = {s: run_system(s, api, wl, prep, num_blocks, False, True) for s in systems}
        for s, v in validation.items():
            if v.blocks_handled != wl.blocks_handled:
                raise RuntimeError(
                    f"{s} handled {v.blocks_handled} blocks, expected {wl.blocks_handled}"
                )
        cap: dict[str, Any] = {
            "fraction": frac,
            "num_blocks": num_blocks,
            "label": label,
            "validation": {
                s: {
                    "hit_tokens": v.hit_tokens,
                    "prompt_tokens": v.prompt_tokens,
                    "hit_ratio": v.hit_tokens / v.prompt_tokens,
                    "evictions": v.evictions,
                    **({"cascade_evictions": v.cascade_evictions} if s == "kvtier" else {}),
                }
                for s, v in validation.items()
            },
            "runs": {},
        }
        if "vllm" in validation:
            kv_hits = validation["kvtier"].hit_blocks
            vl_hits = validation["vllm"].hit_blocks
            assert kv_hits is not None and vl_hits is not None
            cap["hit_agreement"] = compare_hits(kv_hits, vl_hits)
        times: dict[str, dict[str, list[float]]] = {m: {s: [] for s in systems} for m in MODES}
        for rep in range(repeat):
            for mode in MODES:
                for s in systems:
                    run = run_system(s, api, wl, prep, num_blocks, mode != "bookkeeping")
                    expected = validation[s].hit_tokens
                    if run.hit_tokens != expected:
                        raise RuntimeError(
                            f"{s} ({mode}) hit {run.hit_tokens} tokens, validation {expected}"
                        )
                    times[mode][s].append(run.seconds)
                    log(
                        f"  capacity {label} rep {rep + 1}/{repeat} {mode:12s} {s:6s} "
                        f"{run.seconds:8.3f} s  {wl.blocks_handled / run.seconds:12,.0f} blocks/s"
                    )
        for mode in MODES:
            cap["runs"][mode] = {
                s: {
                    "seconds": times[mode][s],
                    "median_s": median(times[mode][s]),
                    "min_s": min(times[mode][s]),
                    "blocks_per_s": wl.blocks_handled / median(times[mode][s]),
                }
                for s in systems
            }
            if "vllm" in systems:
                cap["runs"][mode]["kvtier_over_vllm"] = (
                    cap["runs"][mode]["vllm"]["median_s"] / cap["runs"][mode]["kvtier"]["median_s"]
                )
        result["capacities"].append(cap)
        if profile is not None:
            print(profile_kvtier(wl, prep, num_blocks, profile, top=25))
    return result


HEADERS = (
    "workload",
    "capacity (blocks)",
    "mode",
    "system",
    "median s",
    "blocks/s",
    "kvtier/vLLM",
    "hit ratio",
    "evictions",
)


def table_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows: list[list[str]] = []
    for wl in results:
        for cap in wl["capacities"]:
            for mode in MODES:
                runs = cap["runs"][mode]
                for s in SYSTEMS:
                    if s not in runs:
                        continue
                    v = cap["validation"][s]
                    speedup = runs.get("kvtier_over_vllm")
                    rows.append(
                        [
                            wl["name"],
                            cap["label"],
                            mode,
                            "vLLM BlockPool" if s == "vllm" else "kvtier",
                            f"{runs[s]['median_s']:.3f}",
                            f"{runs[s]['blocks_per_s']:,.0f}",
                            f"{speedup:.2f}x" if s == "kvtier" and speedup else "",
                            f"{v['hit_ratio']:.4%}",
                            f"{v['evictions']:,}",
                        ]
                    )
    return rows


def agreement_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for wl in results:
        for cap in wl["capacities"]:
            val = cap["validation"]
            if "vllm" not in val:
                continue
            diff = val["kvtier"]["hit_ratio"] - val["vllm"]["hit_ratio"]
            agree = cap["hit_agreement"]
            line = (
                f"{wl['name']} @ {cap['label']}: hit ratio kvtier - vLLM = {diff:+.6%}, "
                f"{agree['mismatched_requests']} of {wl['requests']} requests hit a different "
                f"number of blocks; evictions kvtier {val['kvtier']['evictions']:,} "
                f"(cascade {val['kvtier']['cascade_evictions']:,}) vs vLLM "
                f"{val['vllm']['evictions']:,}"
            )
            if agree["mismatched_requests"]:
                first = agree["first_mismatch"]
                line += (
                    f"; first at request {first['request']} "
                    f"(kvtier {first['kvtier']} blocks, vLLM {first['vllm']})"
                )
            lines.append(line)
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Block-bookkeeping throughput of kvtier's KVCacheManager against vLLM's "
            "BlockPool on the same request streams (Mooncake trace, synthetic shared prefixes)."
        )
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument(
        "--requests", type=int, default=None, help="replay only the first N trace requests"
    )
    p.add_argument(
        "--synthetic-requests",
        type=int,
        default=4000,
        help="requests of the synthetic shared-prefix workload (default 4000)",
    )
    p.add_argument(
        "--workload",
        choices=("all", "trace", "synthetic"),
        default="all",
        help="which workloads to run (default: all)",
    )
    p.add_argument(
        "--trace-block-size",
        type=int,
        default=TRACE_HASH_BLOCK,
        help="block size for the trace replay (default 512, the trace's own block)",
    )
    p.add_argument("--synthetic-block-size", type=int, default=16, help="block size (default 16)")
    p.add_argument(
        "--capacities",
        default="0.05,0.25",
        help=(
            "pool sizes as fractions of the stream's unique full prompt blocks, comma "
            "separated; each pool also gets window x the largest request (default 0.05,0.25)"
        ),
    )
    p.add_argument("--window", type=int, default=8, help="live requests at once, FIFO (default 8)")
    p.add_argument(
        "--repeat", type=int, default=None, help="timed runs per cell, median kept (default 3)"
    )
    p.add_argument(
        "--vllm-hash",
        choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
        default="sha256",
        help="vLLM's prefix-caching hash function (default sha256, vLLM's default)",
    )
    p.add_argument("--no-vllm", action="store_true", help="run kvtier alone")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 200 trace and 300 synthetic requests, one repeat",
    )
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument(
        "--profile",
        choices=MODES,
        default=None,
        help="after each cell, print a cProfile of one extra kvtier run in this mode",
    )
    p.add_argument("--json-out", type=Path, default=DEFAULT_JSON, help="where to write JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests or 200, 200)
        args.synthetic_requests = min(args.synthetic_requests, 300)
        if args.repeat is None:
            args.repeat = 1
    if args.repeat is None:
        args.repeat = 3
    if args.repeat < 1 or args.window < 1:
        p.error("--repeat and --window must be at least 1")
    try:
        args.fractions = [float(x) for x in args.capacities.split(",") if x.strip()]
    except ValueError:
        p.error(f"--capacities must be comma-separated numbers, got {args.capacities!r}")
    if not args.fractions or any(not 0 < f <= 10 for f in args.fractions):
        p.error("--capacities must be fractions in (0, 10]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # kvtier is imported already: this is the source the numbers are for.
    git_before = git_state(REPO)
    api: VllmApi | None = None
    vllm_note: str | None = None
    if args.no_vllm:
        vllm_note = "vLLM skipped (--no-vllm)"
    else:
        t0 = time.perf_counter()
        api, vllm_note = load_vllm(args.vllm_hash)
        if api is None:
            vllm_note = (
                f"vLLM BlockPool could not be imported ({vllm_note}); kvtier rows only. "
                "vLLM is installed with --no-deps; see docs/benchmarks.md for the packages "
                "its import needs"
            )
        else:
            log(f"vLLM {api.version} imported in {time.perf_counter() - t0:.1f} s")
    if vllm_note:
        print(f"NOTE: {vllm_note}")

    src = TokenSource()
    workloads: list[Callable[[], Workload]] = []
    if args.workload in ("all", "trace"):
        workloads.append(
            lambda: trace_workload(
                args.trace, args.requests, args.trace_block_size, args.window, src
            )
        )
    if args.workload in ("all", "synthetic"):
        workloads.append(
            lambda: synthetic_workload(
                args.synthetic_requests, args.synthetic_block_size, args.window, src
            )
        )
    results = []
    for make in workloads:
        t0 = time.perf_counter()
        wl = make()
        log(f"built {wl.name} in {time.perf_counter() - t0:.1f} s")
        results.append(bench_workload(wl, api, args.fractions, args.repeat, args.profile))
        del wl
        gc.collect()

    print()
    print(
        f"Bookkeeping throughput, median of {args.repeat} run(s); window {args.window} "
        f"live requests; vLLM hash {args.vllm_hash}"
    )
    rows = table_rows(results)
    print(format_table(HEADERS, rows))
    lines = agreement_lines(results)
    if lines:
        print()
        print("Hit-ratio agreement (validation pass):")
        for line in lines:
            print(f"  {line}")
    if args.markdown:
        print()
        print(format_markdown_table(HEADERS, rows))

    payload = {
        "benchmark": "bookkeeping",
        "machine": machine_info(),
        "git": git_before,
        "versions": {
            "kvtier": package_version("kvtier"),
            "vllm": api.version if api else None,
            "numpy": np.__version__,
        },
        "config": {
            "trace": str(args.trace),
            "requests": args.requests,
            "synthetic_requests": args.synthetic_requests,
            "trace_block_size": args.trace_block_size,
            "synthetic_block_size": args.synthetic_block_size,
            "capacities": args.fractions,
            "window": args.window,
            "repeat": args.repeat,
            "vllm_hash": args.vllm_hash,
            "quick": args.quick,
        },
        "kvtier_extend_block_keys": EXTEND_TAKES_KEYS,
        "vllm_available": api is not None,
        "note": vllm_note,
        "workloads": results,
    }
    write_json(args.json_out, payload)
    print(f"\nwrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
