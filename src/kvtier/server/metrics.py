"""What the stats endpoints report: engine snapshots, Prometheus families, JSON stats.

A snapshot is taken on the engine's thread, between steps, so the numbers
of one scrape are consistent with each other.

``/metrics`` is served by ``prometheus_client``: each app has a
:class:`~prometheus_client.CollectorRegistry` of its own (never the global
one, so several apps in one process, as in the tests, do not clash) holding
an :class:`EngineCollector`, which reads the engine when it is scraped and
yields the families below. One server process serves one engine and every
number lives in that process, so the registry needs no multiprocess mode.

Counters are ``CounterMetricFamily`` named with their ``_total`` suffix
(``prometheus_client`` exposes ``NAME_total`` for family ``NAME``); gauges
and the time-to-first-token histogram keep the names, labels and buckets
they always had.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvtier.engine.engine import Engine
from kvtier.engine.request import cached_by_source
from kvtier.engine.worker import EngineWorker
from kvtier.errors import KvTierError
from kvtier.manager import CacheStats
from kvtier.obs.metrics import Histogram
from kvtier.pressure.controller import PressureStats
from kvtier.pressure.ladder import Mode
from kvtier.storage.window_slab import WindowSlabStats
from kvtier.storage.windowed import WindowedKVStorage

#: Content type of the Prometheus text exposition format, what a scrape without
#: an ``Accept`` header for OpenMetrics gets.
PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_FINISH_REASONS = ("stop", "length", "abort", "rejected", "error")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's and its cache's numbers at one step boundary."""

    stats: CacheStats
    running: int
    waiting: int
    requests_added: int
    finished: dict[str, int]
    prompt_tokens: int
    cached_prompt_tokens: int
    computed_prompt_tokens: int
    generation_tokens: int
    preemptions: int
    forward_errors: int
    ttft: Histogram
    last: dict[str, float | int | None] | None
    loaded_prompt_tokens: int = 0
    #: Choices started by forking a computed prompt (``n > 1``).
    forked_sequences: int = 0
    #: Per tier below the device: occupancy and counters (empty without tiers).
    tiers: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    #: The pressure controller's state (``None`` without pressure handling).
    pressure: PressureStats | None = None
    #: The encoder-output cache's state (``None`` for a text model or with it off).
    encoder_cache: dict[str, Any] | None = None
    #: Tokens a KV block holds (0: unknown).
    block_size: int = 0
    #: Window slots of windowed storage (``None``: every layer in every block).
    window: WindowSlabStats | None = None
    #: Requests preempted to recompute because a window slot they read was reclaimed.
    window_recomputes: int = 0
    #: Cached prompt tokens by where they came from: ``device`` (the pool) and each tier.
    cached_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Prompt tokens a tier held that the load-or-recompute plan computed instead.
    recomputed_tier_tokens: int = 0
    #: The learned load and prefill costs (:meth:`kvtier.costs.CostModel.stats`).
    costs: dict[str, Any] | None = None


def snapshot_engine(engine: Engine) -> EngineSnapshot:
    """Read everything the stats endpoints report (call it on the engine's thread)."""
    c = engine.counters
    return EngineSnapshot(
        stats=engine.manager.stats(),
        running=engine.num_running,
        waiting=engine.num_waiting,
        requests_added=c.requests_added,
        finished=dict(c.finished),
        prompt_tokens=c.prompt_tokens,
        cached_prompt_tokens=c.cached_prompt_tokens,
        computed_prompt_tokens=c.computed_prompt_tokens,
        generation_tokens=c.generation_tokens,
        preemptions=c.preemptions,
        forward_errors=c.forward_errors,
        ttft=c.ttft.copy(),
        last=None if c.last is None else c.last.as_dict(),
        loaded_prompt_tokens=c.loaded_prompt_tokens,
        forked_sequences=c.forked_sequences,
        tiers={} if engine.tier_chain is None else engine.tier_chain.stats(),
        pressure=None if engine.pressure is None else engine.pressure.stats(),
        encoder_cache=(
            None if engine.encoder_cache is None else engine.encoder_cache.stats().as_dict()
        ),
        block_size=engine.layout.block_size,
        window=engine.storage.slab.stats()
        if isinstance(engine.storage, WindowedKVStorage)
        else None,
        window_recomputes=c.window_recomputes,
        cached_by_source=cached_by_source(c.cached_prompt_tokens, c.tier_hit_tokens),
        recomputed_tier_tokens=c.recomputed_tier_tokens,
        costs=engine.connector.costs.stats(),
    )


def stats_dict(stats: CacheStats) -> dict[str, Any]:
    """The fields of a :class:`~kvtier.manager.CacheStats` as plain JSON data."""
    return {
        f.name: dict(v) if isinstance(v := getattr(stats, f.name), dict) else v
        for f in dataclasses.fields(stats)
    }


# -- building families -----------------------------------------------------------------


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    """An unlabelled counter; ``name`` ends in ``_total``, which is what is exposed."""
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _labelled_counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
    """A counter with ``labels``, kept in sorted order (see :func:`_add`)."""
    return CounterMetricFamily(name, doc, labels=sorted(labels))


def _labelled_gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=sorted(labels))


def _add(family: CounterMetricFamily | GaugeMetricFamily, value: float, **labels: str) -> None:
    """One sample of a family made by ``_labelled_*`` (label values in name order)."""
    family.add_metric([v for _, v in sorted(labels.items())], value)


def histogram_family(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    """A :class:`~kvtier.obs.metrics.Histogram`'s cumulative buckets, sum and count."""
    buckets = [
        ("+Inf" if bound == math.inf else repr(float(bound)), float(total))
        for bound, total in h.cumulative()
    ]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h.sum)


def metric_families(snap: EngineSnapshot) -> list[Metric]:
    """The Prometheus metric families for one snapshot."""
    s = snap.stats
    finished = _labelled_counter(
        "kvtier_requests_finished_total", "Requests finished, by finish reason.", "reason"
    )
    for reason in sorted({*_FINISH_REASONS, *snap.finished}):
        _add(finished, snap.finished.get(reason, 0), reason=reason)
    families: list[Metric] = [
        _counter(
            "kvtier_prefix_cache_hit_tokens_total",
            "Prompt tokens found in the prefix cache.",
            s.hit_tokens,
        ),
        _counter(
            "kvtier_prefix_cache_queried_tokens_total",
            "Prompt tokens looked up in the prefix cache.",
            s.queried_tokens,
        ),
        _gauge(
            "kvtier_prefix_cache_hit_ratio",
            "Prefix-cache hit tokens / queried tokens since start.",
            s.hit_ratio,
        ),
        _gauge("kvtier_kv_blocks_used", "KV blocks held by requests.", s.used_blocks),
        _gauge(
            "kvtier_kv_blocks_free",
            "KV blocks free or evictable (cached, unreferenced).",
            s.free_blocks,
        ),
        _gauge("kvtier_kv_blocks_cached", "KV blocks holding a reusable prefix.", s.cached_blocks),
        _gauge("kvtier_kv_blocks_total", "KV blocks in the pool.", s.total_blocks),
        _gauge("kvtier_kv_cache_usage", "Share of KV blocks in use (0 to 1).", s.usage),
        _counter(
            "kvtier_kv_evictions_total", "Cached KV blocks evicted to make room.", s.evictions
        ),
        _counter(
            "kvtier_kv_cascade_evictions_total",
            "Cached KV blocks dropped because their prefix parent was evicted.",
            s.cascade_evictions,
        ),
        _gauge("kvtier_requests_running", "Requests being generated.", snap.running),
        _gauge("kvtier_requests_waiting", "Requests waiting to be scheduled.", snap.waiting),
        _counter("kvtier_requests_total", "Requests accepted by the engine.", snap.requests_added),
        finished,
        _counter(
            "kvtier_prompt_tokens_total", "Prompt tokens of all requests.", snap.prompt_tokens
        ),
        _counter(
            "kvtier_prompt_tokens_cached_total",
            "Prompt tokens served from the prefix cache at admission.",
            snap.cached_prompt_tokens,
        ),
        _counter(
            "kvtier_prompt_tokens_computed_total",
            "Prompt (and resumed) tokens run through the model.",
            snap.computed_prompt_tokens,
        ),
        _counter("kvtier_generation_tokens_total", "Tokens generated.", snap.generation_tokens),
        histogram_family(
            "kvtier_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            snap.ttft,
        ),
        _counter(
            "kvtier_preemptions_total",
            "Running requests preempted for lack of KV blocks.",
            snap.preemptions,
        ),
        _counter(
            "kvtier_forward_errors_total", "Requests that failed in the model.", snap.forward_errors
        ),
        _counter(
            "kvtier_loaded_prompt_tokens_total",
            "Prompt tokens whose KV was loaded from a tier below the device.",
            snap.loaded_prompt_tokens,
        ),
        _counter(
            "kvtier_forked_sequences_total",
            "Choices (n > 1) started from a shared, computed prompt instead of recomputing it.",
            snap.forked_sequences,
        ),
    ]
    if snap.block_size:
        families.append(
            _gauge("kvtier_kv_block_size_tokens", "Tokens a KV block holds.", snap.block_size)
        )
    by_source = _labelled_counter(
        "kvtier_prompt_tokens_cached_by_source_total",
        "Cached prompt tokens by where they came from: the device pool or a tier below it.",
        "source",
    )
    for source, n in sorted(snap.cached_by_source.items()):
        _add(by_source, n, source=source)
    families.append(by_source)
    families.append(
        _counter(
            "kvtier_prompt_tokens_recomputed_from_tier_total",
            "Prompt tokens a tier held that were computed, because computing them was cheaper.",
            snap.recomputed_tier_tokens,
        )
    )
    families += window_families(snap.window, snap.window_recomputes)
    families += tier_families(snap.tiers)
    families += cost_families(snap.costs)
    families += pressure_families(snap.pressure, snap.stats.pressure_evictions)
    families += encoder_cache_families(snap.encoder_cache)
    return families


def cost_families(costs: dict[str, Any] | None) -> list[Metric]:
    """The learned costs: per tier load latency and bandwidth, prefill per token, plans made."""
    if costs is None:
        return []
    latency = _labelled_gauge(
        "kvtier_tier_load_latency_seconds", "Learned seconds every load from a tier pays.", "tier"
    )
    bandwidth = _labelled_gauge(
        "kvtier_tier_load_bandwidth_bytes_per_second",
        "Learned bytes per second a load from a tier moves (absent: too fast to measure).",
        "tier",
    )
    loads = _labelled_counter(
        "kvtier_tier_load_observations_total", "Loads the cost model learned from.", "tier"
    )
    for name, t in sorted(costs["tiers"].items()):
        _add(latency, t["latency_s"], tier=name)
        if t["bandwidth_bytes_per_s"] is not None:
            _add(bandwidth, t["bandwidth_bytes_per_s"], tier=name)
        _add(loads, t["loads"], tier=name)
    plans = _labelled_counter(
        "kvtier_load_plans_total",
        "Requests with a tier hit, by plan: load it all, load part and compute the rest, "
        "or recompute it.",
        "plan",
    )
    for plan, n in sorted(costs["plans"].items()):
        _add(plans, n, plan=plan)
    families: list[Metric] = [latency, bandwidth, loads, plans]
    prefill = costs["prefill"]
    if prefill is not None:
        per_token = _labelled_gauge(
            "kvtier_prefill_seconds_per_token",
            "Learned seconds one more prompt token costs at a context length.",
            "context",
        )
        for context, v in prefill["per_token_s_at_context"].items():
            _add(per_token, v, context=context)
        families += [
            per_token,
            _gauge(
                "kvtier_prefill_pass_overhead_seconds",
                "Learned seconds a forward pass costs whatever it computes.",
                prefill["overhead_s"],
            ),
        ]
    return families


def window_families(window: WindowSlabStats | None, recomputes: int) -> list[Metric]:
    """Windowed storage's slots: how many, in use, held by running requests, reclaimed."""
    if window is None:
        return []
    return [
        _gauge(
            "kvtier_window_slots",
            "Window slots for the layers kept only where requests read or resume.",
            window.num_slots,
        ),
        _gauge("kvtier_window_slots_used", "Window slots holding a block's data.", window.used),
        _gauge(
            "kvtier_window_slots_held",
            "Window slots running requests read or write this step.",
            window.held,
        ),
        _counter(
            "kvtier_window_slots_reclaimed_total",
            "Window slots taken from one block for another.",
            window.reclaimed,
        ),
        _counter(
            "kvtier_window_recomputes_total",
            "Requests preempted to recompute because a window slot they read was reclaimed.",
            recomputes,
        ),
    ]


#: Per-modality encoder-cache counters: (stats key, metric suffix, help).
_ENCODER_LOOKUPS = (
    ("hits", "hits", "Encoder outputs found in memory"),
    ("tier_hits", "tier_hits", "Encoder outputs found on a lower tier"),
    ("coalesced", "coalesced", "Lookups that waited for another request's encode of the item"),
    ("misses", "misses", "Items the encoder ran for"),
)

#: The encoder cache's other numbers: (stats key, metric suffix, counter?, help).
_ENCODER_PLAIN = (
    ("bytes_held", "bytes", False, "Bytes of encoder outputs held in memory."),
    ("capacity_bytes", "capacity_bytes", False, "The encoder cache's byte budget."),
    ("entries", "entries", False, "Encoder outputs held in memory."),
    ("pinned_entries", "pinned_entries", False, "Encoder outputs in use by requests."),
    ("evictions", "evictions_total", True, "Encoder outputs evicted from memory."),
    ("oversize", "oversize_total", True, "Outputs larger than the whole budget."),
    ("not_cached", "not_cached_total", True, "Outputs returned but not cached."),
    ("encoder_failures", "failures_total", True, "Encoder runs that raised."),
    ("encode_seconds", "encode_seconds_total", True, "Seconds spent encoding."),
    (
        "encode_seconds_saved",
        "encode_seconds_saved_total",
        True,
        "Encoding seconds memory hits did not spend.",
    ),
)


def encoder_cache_families(e: dict[str, Any] | None) -> list[Metric]:
    """The encoder-output cache's gauges and counters (per modality); none when it is off."""
    if e is None:
        return []
    families: list[Metric] = []
    for key, suffix, what in _ENCODER_LOOKUPS:
        fam = _labelled_counter(f"kvtier_encoder_cache_{suffix}_total", what + ".", "modality")
        for modality, counts in sorted(e["by_modality"].items()):
            _add(fam, counts[key], modality=modality)
        families.append(fam)
    for key, suffix, is_counter, what in _ENCODER_PLAIN:
        make = _counter if is_counter else _gauge
        families.append(make(f"kvtier_encoder_cache_{suffix}", what, e[key]))
    return families


def pressure_families(p: PressureStats | None, evictions: int) -> list[Metric]:
    """The pressure mode (one gauge per mode, 1 for the current one) and its counters."""
    if p is None:
        return []
    mode = _labelled_gauge(
        "kvtier_pressure_mode", "Memory pressure mode: 1 for the current one.", "mode"
    )
    for m in Mode:
        _add(mode, 1 if m is p.mode else 0, mode=m.name)
    ratio = _labelled_gauge(
        "kvtier_memory_usage_ratio", "Share of memory in use, as the monitor read it.", "source"
    )
    _add(ratio, p.fraction, source=p.source)
    return [
        mode,
        _gauge(
            "kvtier_pressure_level", "Memory pressure mode as a number (0 to 4).", int(p.mode)
        ),
        ratio,
        _counter("kvtier_pressure_mode_changes_total", "Pressure mode changes.", p.mode_changes),
        _counter(
            "kvtier_pressure_rejections_total",
            "New requests memory pressure held back or refused.",
            p.rejected,
        ),
        _counter(
            "kvtier_pressure_evictions_total",
            "Cached blocks evicted to reach a pressure mode's free-block target.",
            evictions,
        ),
        _counter(
            "kvtier_pressure_monitor_errors_total",
            "Memory monitor readings that failed.",
            p.monitor_errors,
        ),
    ]


_TIER_ERRORS = {
    "corrupt": "corrupt_blocks",
    "vanished": "vanished_blocks",
    "unavailable": "unavailable_errors",
    "store_failed": "store_failures",
    "dropped": "dropped_blocks",
    "reconciled": "reconciled_blocks",
}


def tier_families(tiers: dict[str, dict[str, float]]) -> list[Metric]:
    """Per-tier metrics (labelled ``tier``); none without tiers."""
    if not tiers:
        return []
    used = _labelled_gauge("kvtier_tier_blocks", "Blocks held by a tier below the device.", "tier")
    cap = _labelled_gauge("kvtier_tier_capacity_blocks", "Blocks a tier can hold.", "tier")
    loaded = _labelled_counter(
        "kvtier_tier_loaded_blocks_total", "Blocks loaded from a tier to the device.", "tier"
    )
    stored = _labelled_counter(
        "kvtier_tier_stored_blocks_total", "Blocks stored on a tier.", "tier"
    )
    nbytes = _labelled_counter(
        "kvtier_tier_transferred_bytes_total",
        "Payload bytes moved to or from a tier.",
        "tier",
        "direction",
    )
    evicted = _labelled_counter("kvtier_tier_evictions_total", "Blocks a tier evicted.", "tier")
    errors = _labelled_counter(
        "kvtier_tier_errors_total",
        "Tier problems: corrupt or vanished blocks (served as misses), unreachable media, "
        "failed stores, demotions dropped for lack of room, blocks the medium lost "
        "(found by reconciliation).",
        "tier",
        "kind",
    )
    codec_time = _labelled_counter(
        "kvtier_tier_codec_seconds_total",
        "Seconds spent encoding blocks for a tier (compressing) and decoding them back.",
        "tier",
        "direction",
    )
    ratio = _labelled_gauge(
        "kvtier_tier_compression_ratio",
        "Bytes of a device pool block per byte a tier stores for it.",
        "tier",
    )
    saved = _labelled_gauge(
        "kvtier_tier_bytes_saved",
        "Bytes a tier's blocks would take more at the device pool's block size.",
        "tier",
    )
    released = _labelled_counter(
        "kvtier_tier_released_blocks_total",
        "Blocks freed on a tier because nothing will read them again (ended sessions' own).",
        "tier",
    )
    compressed = _labelled_counter(
        "kvtier_tier_compressed_requests_total",
        "Requests whose cached blocks were moved to a tier by compress_request.",
        "tier",
    )
    for name, d in tiers.items():
        _add(codec_time, d["encode_seconds"], tier=name, direction="encode")
        _add(codec_time, d["decode_seconds"], tier=name, direction="decode")
        _add(ratio, d["compression_ratio"], tier=name)
        _add(saved, d["bytes_saved"], tier=name)
        _add(compressed, d["compressed_requests"], tier=name)
        _add(released, d["released_blocks"], tier=name)
        _add(used, d["used_blocks"], tier=name)
        _add(cap, d["capacity_blocks"], tier=name)
        _add(loaded, d["loaded_blocks"], tier=name)
        _add(stored, d["stored_blocks"], tier=name)
        _add(nbytes, d["loaded_bytes"], tier=name, direction="load")
        _add(nbytes, d["stored_bytes"], tier=name, direction="store")
        _add(evicted, d["evictions"], tier=name)
        for kind, field_name in _TIER_ERRORS.items():
            _add(errors, d[field_name], tier=name, kind=kind)
    return [
        used, cap, loaded, stored, nbytes, evicted, errors, codec_time, ratio, saved,
        compressed, released,
    ]


# -- registries and exposition -----------------------------------------------------------


class EngineCollector:
    """A ``prometheus_client`` collector that reads the engine each time it is scraped.

    ``read`` returns a fresh :class:`EngineSnapshot`; it is called once per
    scrape, on the scraping thread.
    """

    def __init__(self, read: Callable[[], EngineSnapshot]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        return metric_families(self._read())


class _Families:
    """A collector over families built beforehand (for :func:`render`)."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


#: Seconds a scrape waits for a fresh snapshot before it is given the last one.
FRESH_WAIT_S = 0.5


def worker_reader(
    worker: EngineWorker, timeout: float | None = 30.0, fresh_wait: float = FRESH_WAIT_S
) -> Callable[[], EngineSnapshot]:
    """A snapshot read of ``worker``'s engine, taken between steps on its thread.

    A step can outlast a scraper's timeout (a long prefill on a CPU), so a
    read waits ``fresh_wait`` seconds for a fresh snapshot and otherwise
    returns the last one taken, while the snapshot it asked for is still
    taken after the step and kept for the next read; no more than one is
    queued at a time. The first read, with nothing to fall back on, waits up
    to ``timeout`` and raises :class:`~kvtier.errors.KvTierError` past it.
    Once no thread owns the engine any more the engine is read directly.
    """
    lock = threading.Lock()
    last: list[EngineSnapshot] = []
    queued = threading.Event()

    def take(engine: Engine) -> EngineSnapshot:
        try:
            snap = snapshot_engine(engine)
            with lock:
                last[:] = [snap]
            return snap
        finally:
            queued.clear()

    def read() -> EngineSnapshot:
        if not worker.alive:
            return snapshot_engine(worker.engine)
        with lock:
            previous = last[0] if last else None
        if previous is not None and queued.is_set():  # one is on its way already
            return previous
        queued.set()
        try:
            return worker.call(take, timeout if previous is None else fresh_wait)
        except KvTierError:
            if previous is None or not worker.alive:
                raise
            return previous

    return read


def metrics_registry(
    read: Callable[[], EngineSnapshot], *, process: bool = True
) -> CollectorRegistry:
    """A registry of its own with an :class:`EngineCollector` over ``read``.

    ``process`` adds ``prometheus_client``'s ``process_*`` metrics (the
    server's memory, CPU time and open files, where the platform has them).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(read))
    if process:
        ProcessCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """The scrape body and its content type, in the format the ``Accept`` header asks for.

    Prometheus' text format 0.0.4 unless the scraper asks for OpenMetrics.
    """
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def render(families: Iterable[Metric]) -> str:
    """The Prometheus text exposition (format 0.0.4) of ``families``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families)))
    return generate_latest(registry).decode()
