"""What the stats endpoints report: engine snapshots, Prometheus families, JSON stats.

A snapshot is taken on the engine's thread, between steps, so the numbers
of one scrape are consistent with each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvtier.engine.engine import Engine
from kvtier.manager import CacheStats
from kvtier.obs.metrics import Histogram, MetricFamily
from kvtier.pressure.controller import PressureStats
from kvtier.pressure.ladder import Mode

#: Content type of the Prometheus text exposition format.
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4"

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
        tiers={} if engine.tiers is None else engine.tiers.stats(),
        pressure=None if engine.pressure is None else engine.pressure.stats(),
    )


def stats_dict(stats: CacheStats) -> dict[str, Any]:
    """The fields of a :class:`~kvtier.manager.CacheStats` as plain JSON data."""
    return {
        f.name: dict(v) if isinstance(v := getattr(stats, f.name), dict) else v
        for f in dataclasses.fields(stats)
    }


def metric_families(snap: EngineSnapshot) -> list[MetricFamily]:
    """The Prometheus metric families for one snapshot."""
    s = snap.stats
    finished = MetricFamily(
        "kvtier_requests_finished_total", "counter", "Requests finished, by finish reason."
    )
    for reason in sorted({*_FINISH_REASONS, *snap.finished}):
        finished.add(snap.finished.get(reason, 0), reason=reason)
    return [
        MetricFamily(
            "kvtier_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
        ).add(s.hit_tokens),
        MetricFamily(
            "kvtier_prefix_cache_queried_tokens_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
        ).add(s.queried_tokens),
        MetricFamily(
            "kvtier_prefix_cache_hit_ratio",
            "gauge",
            "Prefix-cache hit tokens / queried tokens since start.",
        ).add(s.hit_ratio),
        MetricFamily("kvtier_kv_blocks_used", "gauge", "KV blocks held by requests.").add(
            s.used_blocks
        ),
        MetricFamily(
            "kvtier_kv_blocks_free", "gauge", "KV blocks free or evictable (cached, unreferenced)."
        ).add(s.free_blocks),
        MetricFamily(
            "kvtier_kv_blocks_cached", "gauge", "KV blocks holding a reusable prefix."
        ).add(s.cached_blocks),
        MetricFamily("kvtier_kv_blocks_total", "gauge", "KV blocks in the pool.").add(
            s.total_blocks
        ),
        MetricFamily("kvtier_kv_cache_usage", "gauge", "Share of KV blocks in use (0 to 1).").add(
            s.usage
        ),
        MetricFamily(
            "kvtier_kv_evictions_total", "counter", "Cached KV blocks evicted to make room."
        ).add(s.evictions),
        MetricFamily(
            "kvtier_kv_cascade_evictions_total",
            "counter",
            "Cached KV blocks dropped because their prefix parent was evicted.",
        ).add(s.cascade_evictions),
        MetricFamily("kvtier_requests_running", "gauge", "Requests being generated.").add(
            snap.running
        ),
        MetricFamily("kvtier_requests_waiting", "gauge", "Requests waiting to be scheduled.").add(
            snap.waiting
        ),
        MetricFamily("kvtier_requests_total", "counter", "Requests accepted by the engine.").add(
            snap.requests_added
        ),
        finished,
        MetricFamily("kvtier_prompt_tokens_total", "counter", "Prompt tokens of all requests.").add(
            snap.prompt_tokens
        ),
        MetricFamily(
            "kvtier_prompt_tokens_cached_total",
            "counter",
            "Prompt tokens served from the prefix cache at admission.",
        ).add(snap.cached_prompt_tokens),
        MetricFamily(
            "kvtier_prompt_tokens_computed_total",
            "counter",
            "Prompt (and resumed) tokens run through the model.",
        ).add(snap.computed_prompt_tokens),
        MetricFamily("kvtier_generation_tokens_total", "counter", "Tokens generated.").add(
            snap.generation_tokens
        ),
        MetricFamily(
            "kvtier_time_to_first_token_seconds",
            "histogram",
            "Time from a request's arrival to its first generated token.",
        ).add(snap.ttft),
        MetricFamily(
            "kvtier_preemptions_total",
            "counter",
            "Running requests preempted for lack of KV blocks.",
        ).add(snap.preemptions),
        MetricFamily(
            "kvtier_forward_errors_total", "counter", "Requests that failed in the model."
        ).add(snap.forward_errors),
        MetricFamily(
            "kvtier_loaded_prompt_tokens_total",
            "counter",
            "Prompt tokens whose KV was loaded from a tier below the device.",
        ).add(snap.loaded_prompt_tokens),
        MetricFamily(
            "kvtier_forked_sequences_total",
            "counter",
            "Choices (n > 1) started from a shared, computed prompt instead of recomputing it.",
        ).add(snap.forked_sequences),
        *tier_families(snap.tiers),
        *pressure_families(snap.pressure, snap.stats.pressure_evictions),
    ]


def pressure_families(p: PressureStats | None, evictions: int) -> list[MetricFamily]:
    """The pressure mode (one gauge per mode, 1 for the current one) and its counters."""
    if p is None:
        return []
    mode = MetricFamily(
        "kvtier_pressure_mode", "gauge", "Memory pressure mode: 1 for the current one."
    )
    for m in Mode:
        mode.add(1 if m is p.mode else 0, mode=m.name)
    return [
        mode,
        MetricFamily(
            "kvtier_pressure_level", "gauge", "Memory pressure mode as a number (0 to 4)."
        ).add(int(p.mode)),
        MetricFamily(
            "kvtier_memory_usage_ratio", "gauge", "Share of memory in use, as the monitor read it."
        ).add(p.fraction, source=p.source),
        MetricFamily(
            "kvtier_pressure_mode_changes_total", "counter", "Pressure mode changes."
        ).add(p.mode_changes),
        MetricFamily(
            "kvtier_pressure_rejections_total",
            "counter",
            "New requests memory pressure held back or refused.",
        ).add(p.rejected),
        MetricFamily(
            "kvtier_pressure_evictions_total",
            "counter",
            "Cached blocks evicted to reach a pressure mode's free-block target.",
        ).add(evictions),
        MetricFamily(
            "kvtier_pressure_monitor_errors_total",
            "counter",
            "Memory monitor readings that failed.",
        ).add(p.monitor_errors),
    ]


_TIER_ERRORS = {
    "corrupt": "corrupt_blocks",
    "vanished": "vanished_blocks",
    "unavailable": "unavailable_errors",
    "store_failed": "store_failures",
    "dropped": "dropped_blocks",
    "reconciled": "reconciled_blocks",
}


def tier_families(tiers: dict[str, dict[str, float]]) -> list[MetricFamily]:
    """Per-tier metrics (labelled ``tier``); none without tiers."""
    if not tiers:
        return []
    used = MetricFamily("kvtier_tier_blocks", "gauge", "Blocks held by a tier below the device.")
    cap = MetricFamily("kvtier_tier_capacity_blocks", "gauge", "Blocks a tier can hold.")
    loaded = MetricFamily(
        "kvtier_tier_loaded_blocks_total", "counter", "Blocks loaded from a tier to the device."
    )
    stored = MetricFamily("kvtier_tier_stored_blocks_total", "counter", "Blocks stored on a tier.")
    nbytes = MetricFamily(
        "kvtier_tier_transferred_bytes_total", "counter", "Payload bytes moved to or from a tier."
    )
    evicted = MetricFamily("kvtier_tier_evictions_total", "counter", "Blocks a tier evicted.")
    errors = MetricFamily(
        "kvtier_tier_errors_total",
        "counter",
        "Tier problems: corrupt or vanished blocks (served as misses), unreachable media, "
        "failed stores, demotions dropped for lack of room, blocks the medium lost "
        "(found by reconciliation).",
    )
    codec_time = MetricFamily(
        "kvtier_tier_codec_seconds_total",
        "counter",
        "Seconds spent encoding blocks for a tier (compressing) and decoding them back.",
    )
    ratio = MetricFamily(
        "kvtier_tier_compression_ratio",
        "gauge",
        "Bytes of a device pool block per byte a tier stores for it.",
    )
    saved = MetricFamily(
        "kvtier_tier_bytes_saved",
        "gauge",
        "Bytes a tier's blocks would take more at the device pool's block size.",
    )
    compressed = MetricFamily(
        "kvtier_tier_compressed_requests_total",
        "counter",
        "Requests whose cached blocks were moved to a tier by compress_request.",
    )
    for name, d in tiers.items():
        codec_time.add(d["encode_seconds"], tier=name, direction="encode")
        codec_time.add(d["decode_seconds"], tier=name, direction="decode")
        ratio.add(d["compression_ratio"], tier=name)
        saved.add(d["bytes_saved"], tier=name)
        compressed.add(d["compressed_requests"], tier=name)
        used.add(d["used_blocks"], tier=name)
        cap.add(d["capacity_blocks"], tier=name)
        loaded.add(d["loaded_blocks"], tier=name)
        stored.add(d["stored_blocks"], tier=name)
        nbytes.add(d["loaded_bytes"], tier=name, direction="load")
        nbytes.add(d["stored_bytes"], tier=name, direction="store")
        evicted.add(d["evictions"], tier=name)
        for kind, field_name in _TIER_ERRORS.items():
            errors.add(d[field_name], tier=name, kind=kind)
    return [
        used, cap, loaded, stored, nbytes, evicted, errors, codec_time, ratio, saved, compressed
    ]
