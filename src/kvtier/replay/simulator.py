"""Replaying a trace through kvtier's own cache code, with payloads off.

Two models, both driving the registered policy objects (never a second
implementation of a policy):

* ``prefix`` (what serving sees): every request goes through a real
  :class:`~kvtier.manager.KVCacheManager` sized to the capacity: ``allocate``
  with the request's block keys, then ``free``. With ``window`` > 1 up to that
  many requests stay live (oldest freed first), so their blocks are pinned
  while later requests allocate, as in a batch. Hits are what the manager
  reports: the longest cached prefix. Only full prompt blocks are cached, as
  in serving; a request that cannot fit even in an empty cache is skipped
  (counted, its blocks counted as misses). With ``tier_blocks`` a lower tier
  (:mod:`kvtier.replay.tiers`) takes the device's evictions under a tier
  admission rule, and a request's hit continues on it after the device
  prefix.
* ``block`` (the block-level model of cache simulators such as libCacheSim):
  every block of every request, in order, is one ``get`` on a cache of
  ``capacity`` blocks: a resident key is a hit (``policy.access``); a missing
  key asks ``policy.admit`` and, when admitted into a full cache,
  ``policy.evict`` makes room before ``policy.insert``. No chains, no pins:
  any block can hit, even after a miss earlier in the request.

Hit ratios (each a total over the trace, not a mean of per-request ratios):

* block hit ratio: block accesses whose key was cached at access time;
* prefix hit ratio: blocks in each request's leading run of hits, over its
  blocks. For the manager this is ``num_cached_tokens // block_size`` over
  the prompt's full blocks;
* token hit ratio: prompt tokens served from cache over prompt tokens.

A request-aware policy (one that overrides ``on_request``) hears of each
request, with its agent hints when the trace has them, on the trace's clock:
the request's ``timestamp`` in seconds (Mooncake's milliseconds converted),
or its index when the trace has none, so a replay is deterministic. A
workflow-aware policy gets the trace's agent step graphs first.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.agents.policy import workflow_policy_of
from kvtier.errors import ConfigError, InternalInvariantError, OutOfBlocksError
from kvtier.manager import Allocation, KVCacheManager
from kvtier.policy.base import PolicyBase, request_hook
from kvtier.policy.registry import make_policy
from kvtier.replay.belady import belady_min
from kvtier.replay.tiers import ReplayTier, TierCounters
from kvtier.replay.timing import CostSpec, PrefillClock
from kvtier.replay.traces import Trace, TraceRequest

Model = Literal["prefix", "block"]
MODELS: tuple[Model, ...] = ("prefix", "block")
#: Called with the number of requests replayed since the last call.
Tick = Callable[[int], None]
_TICK_EVERY = 128


@dataclass(slots=True)
class RunResult:
    """Counters of one replay (one policy at one capacity)."""

    policy: str
    model: Model
    capacity_blocks: int
    requests: int = 0
    skipped_requests: int = 0
    #: Generated blocks the manager could not fit (prefix model, token traces).
    skipped_outputs: int = 0
    block_accesses: int = 0
    block_hits: int = 0
    prefix_blocks: int = 0
    prefix_hit_blocks: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    cascade_evictions: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    #: The lower tier's counters (prefix model with ``tier_blocks``), else ``None``.
    tier: TierCounters | None = None
    #: Prefill seconds under each load rule (prefix model with ``costs``), else ``None``.
    time: PrefillClock | None = None

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_accesses if self.block_accesses else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hit_blocks / self.prefix_blocks if self.prefix_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tier_hit_ratio(self) -> float:
        """Prompt tokens served from the lower tier over prompt tokens."""
        t = self.tier
        return t.hit_tokens / self.prompt_tokens if t is not None and self.prompt_tokens else 0.0

    @property
    def device_hit_ratio(self) -> float:
        """Prompt tokens served from the device over prompt tokens."""
        t = self.tier
        tier_tokens = t.hit_tokens if t is not None else 0
        return (
            (self.cached_tokens - tier_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0
        )

    @property
    def ops_per_s(self) -> float:
        """Block accesses replayed per second of the simulation loop."""
        return self.block_accesses / self.seconds if self.seconds > 0 else 0.0


class TraceClock:
    """The replay's clock: the time of the request being replayed, in seconds."""

    def __init__(self, trace: Trace) -> None:
        # Mooncake timestamps are milliseconds; token-level ones are taken as seconds.
        self.scale = 0.001 if trace.format == "mooncake" else 1.0
        self.now = 0.0

    def advance(self, index: int, req: TraceRequest) -> float:
        """Move to request number ``index``; never backwards."""
        ts = req.timestamp
        t = float(index) if ts is None else ts * self.scale
        if t > self.now:
            self.now = t
        return self.now

    def __call__(self) -> float:
        return self.now


def register_workflows(trace: Trace, policy: object) -> None:
    """Register the trace's agent step graphs with a workflow-aware policy."""
    wp = workflow_policy_of(policy)
    if wp is not None:
        for spec in trace.workflows:
            wp.tracker.register(spec)


def check_capacity(capacity: int) -> None:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
        raise ConfigError(f"capacity must be a positive number of blocks, got {capacity!r}")


def access_sequence(trace: Trace, model: Model) -> tuple[list[int], bytearray, list[int]]:
    """The model's block accesses, flattened: keys, read flags, and each request's read count.

    Reads are the prompt's blocks (every id in the block model; full blocks in
    the prefix model, which caches nothing else); writes are the blocks a
    request's output fills, which are cached but never looked up by it.
    """
    bs = trace.block_size
    keys: list[int] = []
    reads = bytearray()
    per_request: list[int] = []
    for req in trace.requests:
        prompt = req.keys if model == "block" else req.full_keys(bs)
        keys.extend(prompt)
        reads.extend(b"\x01" * len(prompt))
        per_request.append(len(prompt))
        if req.output_keys:
            keys.extend(req.output_keys)
            reads.extend(bytes(len(req.output_keys)))
    return keys, reads, per_request


def _prefix_counters(
    trace: Trace, model: Model, result: RunResult, hits: bytearray, per_request: list[int]
) -> None:
    """Fill the prefix and token counters from per-access hit flags."""
    bs = trace.block_size
    pos = 0
    for req, n_reads in zip(trace.requests, per_request, strict=True):
        row = hits[pos : pos + n_reads]
        lead = row.find(0)
        if lead < 0:
            lead = n_reads
        n = req.input_length
        if model == "prefix":
            # The manager never reports the last prompt token cached (the
            # engine needs one token to compute logits from).
            lead = min(lead, (n - 1) // bs)
            tokens = lead * bs
        else:
            tokens = min(lead * bs, n)
        result.prefix_blocks += n_reads
        result.prefix_hit_blocks += lead
        result.prompt_tokens += n
        result.cached_tokens += tokens
        pos += n_reads + len(req.output_keys)


def simulate_min(trace: Trace, capacity: int, model: Model = "block") -> RunResult:
    """Belady's MIN with bypass over the model's block accesses (the upper bound)."""
    check_capacity(capacity)
    keys, reads, per_request = access_sequence(trace, model)
    start = time.perf_counter()
    found = belady_min(keys, capacity, reads)
    seconds = time.perf_counter() - start
    result = RunResult(
        "MIN",
        model,
        capacity,
        requests=len(trace.requests),
        block_accesses=found.num_reads,
        block_hits=found.num_hits,
        evictions=found.evictions,
        seconds=seconds,
        extra={"bypasses": float(found.bypasses)},
    )
    _prefix_counters(trace, model, result, found.hits, per_request)
    return result


def simulate_block(
    trace: Trace, policy_name: str, capacity: int, tick: Tick | None = None
) -> RunResult:
    """The block model: every block access is a cache ``get`` driving the policy directly."""
    check_capacity(capacity)
    policy = make_policy(policy_name)
    policy.bind(capacity)
    register_workflows(trace, policy)
    result = RunResult(getattr(policy, "name", policy_name), "block", capacity)
    # The simulator owns residency, as the pool does in serving; the policy
    # only orders keys and picks victims.
    resident: set[int] = set()
    access, admit, insert, evict = policy.access, policy.admit, policy.insert, policy.evict
    # PolicyBase.admit admits everything and records nothing: not calling it
    # decides the same.
    admits_all = getattr(type(policy), "admit", None) is PolicyBase.admit
    hook = request_hook(policy)
    clock = TraceClock(trace)
    bs = trace.block_size
    hits = accesses = prefix_hits = cached_tokens = evictions = 0
    since_tick = 0

    def no_victim() -> InternalInvariantError:
        return InternalInvariantError(
            f"policy {policy_name!r} found no victim in a full cache of unpinned keys"
        )

    def not_resident(victim: int) -> InternalInvariantError:
        return InternalInvariantError(
            f"policy {policy_name!r} evicted key {victim!r}, which is not resident"
        )

    def make_room() -> int:
        """Evict one key if the cache is full; returns how many were evicted."""
        if len(resident) < capacity:
            return 0
        victim = evict()
        if victim is None:
            raise no_victim()
        try:
            resident.remove(victim)
        except KeyError:
            raise not_resident(victim) from None
        return 1

    start = time.perf_counter()
    for rid, req in enumerate(trace.requests):
        keys = req.keys
        if hook is not None:
            n_hit = 0
            for key in keys:
                if key not in resident:
                    break
                n_hit += 1
            hook(keys, n_hit, clock.advance(rid, req), req.hints)
        lead = len(keys)
        for j, key in enumerate(keys):
            if key in resident:
                hits += 1
                access(key)
            else:
                if lead > j:
                    lead = j
                # Admission first, as libCacheSim does: a declined key evicts nothing.
                if admits_all or admit(key):
                    if len(resident) >= capacity:
                        # make_room(), inline: most misses of a full cache evict.
                        victim = evict()
                        if victim is None:
                            raise no_victim()
                        try:
                            resident.remove(victim)
                        except KeyError:
                            raise not_resident(victim) from None
                        evictions += 1
                    insert(key, False)
                    resident.add(key)
        for key in req.output_keys:
            # Generated blocks are written, not looked up: no hit or miss counted.
            if key in resident:
                access(key)
            elif admits_all or admit(key):
                evictions += make_room()
                insert(key, False)
                resident.add(key)
        accesses += len(keys)
        prefix_hits += lead
        cached_tokens += min(lead * bs, req.input_length)
        if tick is not None:
            since_tick += 1
            if since_tick >= _TICK_EVERY:
                tick(since_tick)
                since_tick = 0
    result.seconds = time.perf_counter() - start
    if tick is not None and since_tick:
        tick(since_tick)
    result.requests = len(trace.requests)
    result.block_accesses = result.prefix_blocks = accesses
    result.block_hits = hits
    result.prefix_hit_blocks = prefix_hits
    result.prompt_tokens = trace.prompt_tokens
    result.cached_tokens = cached_tokens
    result.evictions = evictions
    return result


def simulate_prefix(
    trace: Trace,
    policy_name: str,
    capacity: int,
    *,
    window: int = 1,
    tick: Tick | None = None,
    tier_blocks: int = 0,
    tier_admission: str = "write-all",
    tier_threshold: float | None = None,
    costs: CostSpec | None = None,
) -> RunResult:
    """The prefix model: each request is allocated and freed on a real KVCacheManager.

    With ``tier_blocks`` a lower tier of that many blocks takes the device's
    evictions under ``tier_admission`` (see :mod:`kvtier.replay.tiers`), and
    a request's hit continues on it after the device prefix. With ``costs``
    each admitted request's prefill is timed under each load rule
    (:mod:`kvtier.replay.timing`).
    """
    check_capacity(capacity)
    if not isinstance(tier_blocks, int) or isinstance(tier_blocks, bool) or tier_blocks < 0:
        raise ConfigError(f"--tier-blocks must be >= 0 blocks, got {tier_blocks!r}")
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"window must be a positive number of live requests, got {window!r}")
    bs = trace.block_size
    clock = TraceClock(trace)
    manager = KVCacheManager(capacity, bs, policy=policy_name, clock=clock)
    register_workflows(trace, manager.policy)
    # The pool's own lookup: one call per block instead of two through the manager.
    cached_block = manager.pool.cached_block
    result = RunResult(manager.stats().policy, "prefix", capacity)
    lower: ReplayTier | None = None
    if tier_blocks:
        lower = ReplayTier(
            manager,
            tier_blocks,
            clock,
            admission=tier_admission,
            threshold=tier_threshold,
            block_bytes=costs.block_bytes if costs is not None and costs.block_bytes else None,
        )
    timer = PrefillClock(costs) if costs is not None else None
    live: deque[int] = deque()
    since_tick = 0

    def make_room() -> bool:
        """Free the oldest live request after an OutOfBlocksError; False if none is live."""
        if not live:
            return False
        manager.free(live.popleft())
        return True

    start = time.perf_counter()
    for rid, req in enumerate(trace.requests):
        clock.advance(rid, req)
        n = req.input_length
        keys = req.full_keys(bs)
        n_keys = len(keys)
        # Blocks cached at access time, looked up before allocate changes anything:
        # the prefix hits plus blocks after the first miss that are still cached.
        resident = n_keys - list(map(cached_block, keys)).count(None)
        # Token ids matter only for the partial tail when keys are given, so a
        # Mooncake request (lengths and ids only) passes a range.
        tokens: Sequence[int] = req.tokens if req.tokens is not None else range(n)
        result.block_accesses += n_keys
        result.prefix_blocks += n_keys
        result.prompt_tokens += n
        from_tier = 0
        if lower is not None:
            # Looked up before allocate, whose evictions go down to the tier.
            limit = (n - 1) // bs  # the last prompt token is always computed
            from_tier = lower.serve(keys, manager.device_hits(keys[:limit]), limit)
        alloc: Allocation | None = None
        while alloc is None:
            try:
                alloc = manager.allocate(rid, tokens, block_keys=keys, hints=req.hints)
            except OutOfBlocksError:
                if not make_room():
                    break
        if alloc is None:
            # Larger than the whole cache: serving would reject it. Its blocks
            # count as misses so every policy and MIN share one denominator.
            result.skipped_requests += 1
        else:
            cached = alloc.num_cached_tokens
            if timer is not None:
                timer.add(n, cached, from_tier, bs)
            if from_tier and lower is not None:
                cached += from_tier * bs
                lower.served(from_tier, bs)
            result.block_hits += resident
            result.prefix_hit_blocks += cached // bs
            result.cached_tokens += cached
            if req.output_tokens is not None and len(req.output_tokens):
                while True:
                    try:
                        manager.extend(rid, req.output_tokens, block_keys=req.output_keys)
                        break
                    except OutOfBlocksError:
                        if not make_room():
                            result.skipped_outputs += 1
                            break
            live.append(rid)
            while len(live) >= window:
                manager.free(live.popleft())
        if tick is not None:
            since_tick += 1
            if since_tick >= _TICK_EVERY:
                tick(since_tick)
                since_tick = 0
    while live:
        manager.free(live.popleft())
    result.seconds = time.perf_counter() - start
    if tick is not None and since_tick:
        tick(since_tick)
    stats = manager.stats()
    result.requests = len(trace.requests)
    result.evictions = stats.evictions + stats.cascade_evictions
    result.cascade_evictions = stats.cascade_evictions
    result.extra = {
        "duplicate_blocks": float(stats.duplicate_blocks),
        "declined_blocks": float(stats.declined_blocks),
    }
    if lower is not None:
        result.tier = lower.counters
    result.time = timer
    return result


def simulate(
    trace: Trace,
    policy_name: str,
    capacity: int,
    model: Model = "prefix",
    *,
    window: int = 1,
    tick: Tick | None = None,
    tier_blocks: int = 0,
    tier_admission: str = "write-all",
    costs: CostSpec | None = None,
) -> RunResult:
    """Replay ``trace`` under one policy and capacity in the chosen model."""
    if model == "prefix":
        return simulate_prefix(
            trace,
            policy_name,
            capacity,
            window=window,
            tick=tick,
            tier_blocks=tier_blocks,
            tier_admission=tier_admission,
            costs=costs,
        )
    if model == "block":
        if window != 1:
            raise ConfigError("--window applies to the prefix model only")
        if tier_blocks:
            raise ConfigError("--tier-blocks applies to the prefix model only")
        if costs is not None:
            raise ConfigError("prefill timing (--prefill-rate) applies to the prefix model only")
        return simulate_block(trace, policy_name, capacity, tick=tick)
    raise ConfigError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
