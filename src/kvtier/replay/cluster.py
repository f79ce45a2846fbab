"""Replaying a trace over several engines: routing, local caches and a shared tier.

Each simulated engine has its own device cache, a real
:class:`~kvtier.manager.KVCacheManager` in the prefix model (see
:mod:`kvtier.replay.simulator`), and optionally a host tier of its own: an
:class:`~kvtier.offload.OffloadingManager` that receives the blocks the
device evicts (write-back), as the engine's tier chain does. An optional
shared tier, one more offloading manager seen by every engine, stands for
Redis Cluster (or Mooncake's global pool): every block an engine computes is
written through to it, and any engine can load from it. A request's hit is
its device prefix, continued block by block from its host tier or the
shared tier (the first that holds a key serves it; the first key none holds
ends the hit), as :class:`~kvtier.offload.TierChain` looks up.

Routing rules:

* ``round-robin``: engines in turn;
* ``least-loaded``: the engine with the least queued work;
* ``prefix``: the engine holding the longest prefix of the request in its own
  caches (device, then host), among engines whose queue is at most
  ``load_cap`` times what the shortest queue would be with this request on
  it (so an idle engine draws traffic away from a busy one holding the
  prefix); ties go to the less loaded engine.

Load is a queue of work per engine, in seconds: a request adds its prompt
tokens not served from cache plus its output tokens, divided by the engine's
``service_rate`` (tokens per second), and the queue drains at that rate on the
trace's clock. By default the rate is set so that the trace, with no cache at
all, keeps the engines 70% busy: caching only makes them less busy. Load
imbalance is the busiest engine's total work over the mean.

Hit ratios are totals over the trace, as in the one-engine replay: the token
hit ratio is prompt tokens served from any cache over prompt tokens (the last
prompt token is never served, as in serving); the prefix hit ratio counts
blocks of each request's leading run of hits over its full prompt blocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvtier.errors import ConfigError, OutOfBlocksError
from kvtier.manager import KVCacheManager
from kvtier.offload.manager import OffloadingManager
from kvtier.replay.simulator import Tick, TraceClock, check_capacity
from kvtier.replay.traces import Trace, TraceRequest

Route = Literal["round-robin", "least-loaded", "prefix"]
ROUTES: tuple[Route, ...] = ("round-robin", "least-loaded", "prefix")
#: Default for ``prefix`` routing: an engine whose queue is more than this many
#: times the shortest (with the request added) is passed over for its prefix.
DEFAULT_LOAD_CAP = 1.5
#: The busy share the default service rate gives a trace replayed without cache.
CALIBRATED_UTILIZATION = 0.7
#: KV bytes per token when none is given: a 70B GQA model in bf16 (80 layers, 8 KV
#: heads of 128, K and V), for turning blocks fetched into bytes.
DEFAULT_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2
_TICK_EVERY = 128


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """One multi-engine replay: engines, their caches, the shared tier and the routing rule."""

    engines: int
    #: Each engine's device cache, in blocks.
    device_blocks: int
    #: Each engine's own host tier, in blocks (0: none).
    host_blocks: int = 0
    #: The tier every engine shares, in blocks (0: none).
    shared_blocks: int = 0
    route: Route = "prefix"
    load_cap: float = DEFAULT_LOAD_CAP
    policy: str = "lru"
    #: Tokens per second one engine serves; ``None``: calibrated to the trace.
    service_rate: float | None = None
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN

    def check(self) -> None:
        if not isinstance(self.engines, int) or isinstance(self.engines, bool) or self.engines < 1:
            raise ConfigError(f"--engines must be a positive integer, got {self.engines!r}")
        check_capacity(self.device_blocks)
        for name, value in (("host", self.host_blocks), ("shared", self.shared_blocks)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"the {name} tier's capacity must be >= 0 blocks, got {value!r}")
        if self.route not in ROUTES:
            raise ConfigError(f"unknown route {self.route!r}; choose one of {', '.join(ROUTES)}")
        if not self.load_cap >= 1.0:
            raise ConfigError(f"--load-cap must be at least 1.0, got {self.load_cap!r}")
        if self.service_rate is not None and not self.service_rate > 0:
            raise ConfigError(f"--service-rate must be positive, got {self.service_rate!r}")
        if self.bytes_per_token <= 0:
            raise ConfigError(f"--bytes-per-token must be positive, got {self.bytes_per_token!r}")


@dataclass(slots=True)
class EngineResult:
    """What one engine of the cluster served."""

    requests: int = 0
    skipped_requests: int = 0
    prompt_blocks: int = 0
    prompt_tokens: int = 0
    device_hit_blocks: int = 0
    host_hit_blocks: int = 0
    shared_hit_blocks: int = 0
    cached_tokens: int = 0
    #: Work routed here (tokens computed: prompt misses and outputs).
    work_tokens: int = 0
    peak_load_s: float = 0.0

    @property
    def hit_blocks(self) -> int:
        return self.device_hit_blocks + self.host_hit_blocks + self.shared_hit_blocks

    @property
    def prefix_hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class ClusterResult:
    """Counters of one multi-engine replay, per engine and in total."""

    config: ClusterConfig
    block_size: int
    service_rate: float
    engines: list[EngineResult]
    shared_stored_blocks: int = 0
    seconds: float = 0.0

    def total(self) -> EngineResult:
        out = EngineResult()
        for e in self.engines:
            for name in EngineResult.__slots__:
                if name == "peak_load_s":
                    out.peak_load_s = max(out.peak_load_s, e.peak_load_s)
                else:
                    setattr(out, name, getattr(out, name) + getattr(e, name))
        return out

    @property
    def token_hit_ratio(self) -> float:
        return self.total().token_hit_ratio

    @property
    def prefix_hit_ratio(self) -> float:
        return self.total().prefix_hit_ratio

    @property
    def load_imbalance(self) -> float:
        """The busiest engine's work over the mean engine's (1.0: perfectly even)."""
        work = [e.work_tokens for e in self.engines]
        mean = sum(work) / len(work)
        return max(work) / mean if mean else 1.0

    @property
    def shared_bytes_fetched(self) -> int:
        blocks = self.total().shared_hit_blocks
        return blocks * self.block_size * self.config.bytes_per_token

    @property
    def shared_bytes_stored(self) -> int:
        return self.shared_stored_blocks * self.block_size * self.config.bytes_per_token


def _store(tier: OffloadingManager, keys: Sequence[int]) -> int:
    """Store ``keys`` on a tier (bookkeeping only); returns how many it newly holds."""
    if not keys:
        return 0
    out = tier.prepare_store(keys)
    if out is None:
        # More than the tier can make room for at once: the leading keys, as many as fit.
        n = min(len(keys), tier.capacity)
        while out is None and n > 0:
            out = tier.prepare_store(keys[:n])
            n //= 2
        if out is None:
            return 0
    tier.complete_store(out.keys_to_store)
    return len(out.keys_to_store)


class _Engine:
    """One simulated engine: its device manager, its host tier and its queue."""

    def __init__(self, config: ClusterConfig, block_size: int, clock: TraceClock) -> None:
        self.manager = KVCacheManager(
            config.device_blocks, block_size, policy=config.policy, clock=clock
        )
        self.host: OffloadingManager | None = None
        if config.host_blocks:
            host = OffloadingManager(
                config.host_blocks, config.policy, medium="host", enable_events=False, clock=clock
            )
            self.host = host
            self.manager.add_evict_listener(self._demote)
        self.result = EngineResult()
        self.load_s = 0.0
        self.last_routed = -1

    def _demote(self, keys: list[int], blocks: list[int]) -> None:
        """Device evictions go down to the host tier (write-back), as in the tier chain."""
        assert self.host is not None
        _store(self.host, keys)

    def local_match(self, keys: Sequence[int]) -> int:
        """Leading ``keys`` this engine holds on its device, then its host tier."""
        n = self.manager.device_hits(keys)
        host = self.host
        if host is not None and n < len(keys):
            n += host.lookup(keys[n:]) or 0
        return n


class ClusterReplay:
    """Replays one trace over :class:`ClusterConfig`'s engines (see the module docstring)."""

    def __init__(self, trace: Trace, config: ClusterConfig) -> None:
        config.check()
        self.trace = trace
        self.config = config
        self.block_size = trace.block_size
        self.clock = TraceClock(trace)
        self.engines = [_Engine(config, self.block_size, self.clock) for _ in range(config.engines)]
        self.shared: OffloadingManager | None = None
        if config.shared_blocks:
            self.shared = OffloadingManager(
                config.shared_blocks,
                config.policy,
                medium="shared",
                enable_events=False,
                clock=self.clock,
            )
        self.service_rate = config.service_rate or calibrated_rate(trace, config.engines)
        self._next = 0
        self._shared_stored = 0
        self._last_time: float | None = None

    # -- routing ------------------------------------------------------------------------
    def _drain(self, now: float) -> None:
        last = self._last_time
        self._last_time = now
        if last is None or now <= last:
            return
        done = now - last
        for e in self.engines:
            e.load_s = max(0.0, e.load_s - done)

    def route(self, req: TraceRequest) -> int:
        """The engine ``req`` goes to under the configured rule."""
        engines = self.engines
        rule = self.config.route
        if rule == "round-robin":
            i = self._next
            self._next = (i + 1) % len(engines)
            return i
        if rule == "least-loaded":
            return min(
                range(len(engines)), key=lambda j: (engines[j].load_s, engines[j].last_routed)
            )
        keys = req.full_keys(self.block_size)[: (req.input_length - 1) // self.block_size]
        loads = [e.load_s for e in engines]
        alone = (req.input_length + req.output_length) / self.service_rate
        cap = self.config.load_cap * (min(loads) + alone)
        best = -1
        best_key: tuple[int, float, int] | None = None
        for j, e in enumerate(engines):
            if loads[j] > cap:
                continue
            key = (-e.local_match(keys), loads[j], e.last_routed)
            if best_key is None or key < best_key:
                best, best_key = j, key
        return best

    # -- serving ------------------------------------------------------------------------
    def _serve(self, rid: int, req: TraceRequest, engine: _Engine) -> None:
        bs = self.block_size
        res = engine.result
        keys = req.full_keys(bs)
        n = req.input_length
        limit = (n - 1) // bs  # the last prompt token is always computed
        manager = engine.manager
        device = manager.device_hits(keys[:limit])
        host_hit = shared_hit = 0
        i = device
        host, shared = engine.host, self.shared
        # Block by block, the first tier holding a key serves it (as TierChain looks up).
        while i < limit:
            key = keys[i]
            if host is not None and host.is_ready(key):
                host_hit += 1
            elif shared is not None and shared.is_ready(key):
                shared_hit += 1
            else:
                break
            i += 1
        if host is not None and host_hit:
            host.touch(keys[device:i])
        if shared is not None and shared_hit:
            shared.touch(keys[device:i])
        res.requests += 1
        res.prompt_blocks += len(keys)
        res.prompt_tokens += n
        tokens: Sequence[int] = req.tokens if req.tokens is not None else range(n)
        try:
            manager.allocate(rid, tokens, block_keys=keys)
        except OutOfBlocksError:
            # Larger than the whole device cache: serving would reject it.
            res.skipped_requests += 1
            res.work_tokens += n + req.output_length
            return
        hit = device + host_hit + shared_hit
        res.device_hit_blocks += device
        res.host_hit_blocks += host_hit
        res.shared_hit_blocks += shared_hit
        res.cached_tokens += hit * bs
        work = n - hit * bs + req.output_length
        res.work_tokens += work
        engine.load_s += work / self.service_rate
        res.peak_load_s = max(res.peak_load_s, engine.load_s)
        written = keys[device:]
        if req.output_tokens is not None and len(req.output_tokens):
            # Generated blocks are cached too (looked up by later turns, never by this one).
            try:
                manager.extend(rid, req.output_tokens, block_keys=req.output_keys)
                written = [*written, *req.output_keys]
            except OutOfBlocksError:
                pass
        if shared is not None:
            # Write-through: what this engine computed is everyone's at once.
            self._shared_stored += _store(shared, written)
        manager.free(rid)

    def run(self, tick: Tick | None = None) -> ClusterResult:
        start = time.perf_counter()
        since_tick = 0
        for rid, req in enumerate(self.trace.requests):
            now = self.clock.advance(rid, req)
            self._drain(now)
            j = self.route(req)
            engine = self.engines[j]
            engine.last_routed = rid
            self._serve(rid, req, engine)
            if tick is not None:
                since_tick += 1
                if since_tick >= _TICK_EVERY:
                    tick(since_tick)
                    since_tick = 0
        if tick is not None and since_tick:
            tick(since_tick)
        return ClusterResult(
            self.config,
            self.block_size,
            self.service_rate,
            [e.result for e in self.engines],
            shared_stored_blocks=self._shared_stored,
            seconds=time.perf_counter() - start,
        )


def calibrated_rate(trace: Trace, engines: int) -> float:
    """Tokens per second per engine that keep ``engines`` 70% busy on ``trace`` without cache."""
    reqs = trace.requests
    work = sum(r.input_length + r.output_length for r in reqs)
    clock = TraceClock(trace)
    first = clock.advance(0, reqs[0])
    last = first
    for i, r in enumerate(reqs):
        last = clock.advance(i, r)
    span = max(last - first, 1.0)
    return work / span / engines / CALIBRATED_UTILIZATION


def simulate_cluster(
    trace: Trace, config: ClusterConfig, tick: Tick | None = None
) -> ClusterResult:
    """Replay ``trace`` over the engines ``config`` describes."""
    return ClusterReplay(trace, config).run(tick)
