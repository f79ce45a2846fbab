"""Running a replay grid (policies x capacities) and reporting it as a table or JSON.

Every capacity gets one Belady MIN run on the same block access sequence, so
each policy's row carries the optimum next to it and its gap in points:
how much of the reachable hit ratio the policy leaves on the table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvtier._version import __version__
from kvtier.errors import ConfigError
from kvtier.replay.capacity import Capacity
from kvtier.replay.progress import ProgressBar
from kvtier.replay.simulator import Model, RunResult, access_sequence, simulate, simulate_min
from kvtier.replay.timing import CostSpec
from kvtier.replay.traces import Trace


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    """One resolved capacity: as typed, in blocks, and as a share of unique blocks."""

    text: str
    blocks: int
    percent: float


@dataclass(slots=True)
class ReplayReport:
    """Everything one ``kvtier replay`` measured."""

    trace: Trace
    model: Model
    window: int
    capacities: list[CapacityPoint]
    policies: list[str]
    results: list[RunResult] = field(default_factory=list)
    #: MIN per capacity in blocks.
    mins: dict[int, RunResult] = field(default_factory=dict)
    #: (policy as given, capacity in blocks) -> its result.
    cells: dict[tuple[str, int], RunResult] = field(default_factory=dict)
    load_seconds: float = 0.0
    elapsed_seconds: float = 0.0
    block_accesses: int = 0
    #: The lower tier under the device (prefix model), in blocks; 0: none.
    tier_blocks: int = 0
    tier_admission: str = "write-all"
    #: The costs prefills are timed with (``--prefill-rate``), else ``None``.
    costs: CostSpec | None = None

    def gap_points(self, result: RunResult) -> float:
        """MIN's block hit ratio minus the policy's, in percentage points."""
        best = self.mins[result.capacity_blocks]
        return 100.0 * (best.block_hit_ratio - result.block_hit_ratio)


def resolve_capacities(trace: Trace, capacities: list[Capacity]) -> list[CapacityPoint]:
    """Blocks for each capacity on this trace, in the order given, without repeats."""
    out: list[CapacityPoint] = []
    seen: set[int] = set()
    unique = trace.unique_blocks
    for cap in capacities:
        blocks = cap.blocks(trace.block_size, unique)
        if blocks in seen:
            continue
        seen.add(blocks)
        out.append(CapacityPoint(cap.text, blocks, 100.0 * blocks / unique if unique else 0.0))
    if not out:
        raise ConfigError("give at least one capacity")
    return out


def run_replay(
    trace: Trace,
    policies: list[str],
    capacities: list[Capacity],
    *,
    model: Model = "prefix",
    window: int = 1,
    progress: ProgressBar | None = None,
    tier_blocks: int = 0,
    tier_admission: str = "write-all",
    costs: CostSpec | None = None,
) -> ReplayReport:
    """Replay ``trace`` for every policy at every capacity, plus MIN at each capacity."""
    if not policies:
        raise ConfigError("give at least one policy")
    points = resolve_capacities(trace, capacities)
    report = ReplayReport(trace, model, window, points, list(policies))
    report.tier_blocks = tier_blocks
    report.tier_admission = tier_admission
    report.costs = costs
    report.block_accesses = int(sum(access_sequence(trace, model)[1]))
    start = time.perf_counter()
    tick = progress.advance if progress is not None else None
    for point in points:
        report.mins[point.blocks] = simulate_min(trace, point.blocks, model)
        for name in policies:
            if progress is not None:
                progress.set_label(f"{name} @ {point.blocks} blocks")
            result = simulate(
                trace,
                name,
                point.blocks,
                model,
                window=window,
                tick=tick,
                tier_blocks=tier_blocks,
                tier_admission=tier_admission,
                costs=costs,
            )
            report.results.append(result)
            report.cells[(name, point.blocks)] = result
    report.elapsed_seconds = time.perf_counter() - start
    return report


def _row(report: ReplayReport, r: RunResult, point: CapacityPoint) -> dict[str, Any]:
    row: dict[str, Any] = {
        "policy": r.policy,
        "capacity": point.text,
        "capacity_blocks": r.capacity_blocks,
        "capacity_tokens": r.capacity_blocks * report.trace.block_size,
        "capacity_pct_unique": round(point.percent, 4),
        "block_hit_ratio": round(r.block_hit_ratio, 6),
        "prefix_hit_ratio": round(r.prefix_hit_ratio, 6),
        "token_hit_ratio": round(r.token_hit_ratio, 6),
        "block_hits": r.block_hits,
        "block_accesses": r.block_accesses,
        "cached_tokens": r.cached_tokens,
        "prompt_tokens": r.prompt_tokens,
        "evictions": r.evictions,
        "cascade_evictions": r.cascade_evictions,
        "requests": r.requests,
        "skipped_requests": r.skipped_requests,
        "skipped_outputs": r.skipped_outputs,
        "seconds": round(r.seconds, 4),
        "ops_per_s": round(r.ops_per_s, 1),
    }
    for key, value in r.extra.items():
        row[key] = value
    t = r.tier
    if t is not None:
        row["tier"] = {
            "capacity_blocks": t.capacity_blocks,
            "admission": t.admission,
            "device_hit_ratio": round(r.device_hit_ratio, 6),
            "tier_hit_ratio": round(r.tier_hit_ratio, 6),
            "offered_blocks": t.offered_blocks,
            "written_blocks": t.written_blocks,
            "skipped_blocks": t.skipped_blocks,
            "hit_blocks": t.hit_blocks,
            "bytes_written": t.bytes_written,
            "block_bytes": t.block_bytes,
            "bytes_per_hit": t.bytes_per_hit if t.hit_blocks else None,
        }
    if r.time is not None:
        row["time"] = r.time.to_json()
    return row


def trace_json(trace: Trace) -> dict[str, Any]:
    """What a replay's JSON says about its trace."""
    return {
        "name": trace.name,
        "format": trace.format,
        "block_size": trace.block_size,
        "requests": len(trace.requests),
        "unique_blocks": trace.unique_blocks,
        "prompt_tokens": trace.prompt_tokens,
    }


def to_json(report: ReplayReport) -> dict[str, Any]:
    """The report as plain JSON-serialisable data."""
    trace = report.trace
    by_blocks = {p.blocks: p for p in report.capacities}
    results = []
    for r in report.results:
        row = _row(report, r, by_blocks[r.capacity_blocks])
        best = report.mins[r.capacity_blocks]
        row["min_block_hit_ratio"] = round(best.block_hit_ratio, 6)
        row["gap_to_min_points"] = round(report.gap_points(r), 4)
        results.append(row)
    return {
        "kvtier": __version__,
        "trace": trace_json(trace),
        "model": report.model,
        "window": report.window,
        "block_accesses": report.block_accesses,
        "policies": report.policies,
        "capacities": [
            {"capacity": p.text, "blocks": p.blocks, "pct_unique": round(p.percent, 4)}
            for p in report.capacities
        ],
        "results": results,
        "costs": _costs_json(report.costs),
        "min": [_row(report, report.mins[p.blocks], p) for p in report.capacities],
        "load_seconds": round(report.load_seconds, 4),
        "elapsed_seconds": round(report.elapsed_seconds, 4),
    }


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def format_table(report: ReplayReport) -> str:
    """A fixed-width table: one group per capacity, MIN first, then each policy."""
    trace = report.trace
    head = (
        f"trace {trace.name}: {trace.format} format, {len(trace.requests)} requests, "
        f"{report.block_accesses} block accesses, {trace.unique_blocks} unique blocks "
        f"of {trace.block_size} tokens"
    )
    model = f"model {report.model}"
    if report.model == "prefix":
        model += f" (KVCacheManager, window {report.window})"
    else:
        model += " (every block access is a cache get)"
    name_width = max([10, *(len(r.policy) for r in report.results)])
    cols = (
        ("policy", "<", name_width), ("capacity", ">", 10), ("% uniq", ">", 7),
        ("block hit", ">", 9), ("prefix hit", ">", 10), ("token hit", ">", 9),
        ("MIN", ">", 7), ("gap", ">", 7), ("evictions", ">", 10), ("ops/s", ">", 8),
    )
    header = "  ".join(f"{name:{align}{width}}" for name, align, width in cols)
    lines = [head, model, "", header, "-" * len(header)]

    def fmt(values: tuple[str, ...]) -> str:
        return "  ".join(
            f"{v:{align}{width}}" for v, (_, align, width) in zip(values, cols, strict=True)
        )

    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    for point in report.capacities:
        best = report.mins[point.blocks]
        cap = (str(point.blocks), f"{point.percent:.2f}%")
        lines.append(fmt((
            "MIN*", *cap, pct(best.block_hit_ratio), pct(best.prefix_hit_ratio),
            pct(best.token_hit_ratio), pct(best.block_hit_ratio), "-", str(best.evictions),
            _si(best.ops_per_s),
        )))
        for r in report.results:
            if r.capacity_blocks != point.blocks:
                continue
            lines.append(fmt((
                r.policy, *cap, pct(r.block_hit_ratio), pct(r.prefix_hit_ratio),
                pct(r.token_hit_ratio), pct(best.block_hit_ratio),
                f"{report.gap_points(r):.2f}", str(r.evictions), _si(r.ops_per_s),
            )))
        lines.append("")
    lines.append(
        "MIN* = Belady's offline optimum with bypass on the same block accesses (an upper "
        "bound on block hits); gap = MIN minus the policy, in points."
    )
    for point in report.capacities:
        skipped = max(
            (r.skipped_requests for r in report.results if r.capacity_blocks == point.blocks),
            default=0,
        )
        if skipped:
            lines.append(
                f"At {point.blocks} blocks, {skipped} requests did not fit in the cache; "
                "they count as misses."
            )
    if report.tier_blocks:
        lines += ["", *_tier_lines(report)]
    if report.costs is not None:
        lines += ["", *_time_lines(report, report.costs)]
    lines.append(
        f"loaded in {report.load_seconds:.2f}s, replayed in {report.elapsed_seconds:.2f}s"
    )
    return "\n".join(lines)


def _tier_lines(report: ReplayReport) -> list[str]:
    """The lower tier's columns: hits per level, writes and bytes written per tier hit."""
    out = [
        f"lower tier: {report.tier_blocks} blocks (LRU), admission {report.tier_admission}; "
        "hit ratios are prompt tokens served from each level over prompt tokens",
        f"{'policy':<14} {'capacity':>10} {'device hit':>10} {'tier hit':>9} "
        f"{'tier writes':>11} {'tier hits':>10} {'bytes/tier hit':>14}",
    ]
    for r in report.results:
        t = r.tier
        if t is None:
            continue
        per_hit = _si(t.bytes_per_hit) + "B" if t.hit_blocks else "-"
        out.append(
            f"{r.policy:<14} {r.capacity_blocks:>10} {100 * r.device_hit_ratio:>9.2f}% "
            f"{100 * r.tier_hit_ratio:>8.2f}% {t.written_blocks:>11} {t.hit_blocks:>10} "
            f"{per_hit:>14}"
        )
    return out


def _costs_json(costs: CostSpec | None) -> dict[str, float | int | None] | None:
    if costs is None:
        return None
    return {
        "prefill_tokens_s": costs.prefill_tokens_s,
        "pair_s": costs.pair_s,
        "tier_bytes_s": costs.tier_bytes_s if costs.tier_bytes_s != float("inf") else None,
        "tier_latency_s": costs.tier_latency_s,
        "block_bytes": costs.block_bytes,
    }


def _time_lines(report: ReplayReport, costs: CostSpec) -> list[str]:
    """Prefill seconds per rule: no cache, tier hits computed, loaded, and the plan."""
    bw = costs.tier_bytes_s
    tier = (
        f"tier {_si(bw)}B/s + {1e3 * costs.tier_latency_s:g} ms a call, "
        f"{_si(costs.block_bytes)}B a block; "
        if report.tier_blocks and bw != float("inf")
        else ("tier free to load; " if report.tier_blocks else "")
    )
    out = [
        f"prefill time ({tier}model {costs.prefill_tokens_s:g} tokens/s"
        + (f", {costs.pair_s:g} s per attention pair" if costs.pair_s else "")
        + "), each admitted request alone:",
        f"{'policy':<14} {'capacity':>10} {'no cache':>10} {'compute tier':>12} "
        f"{'load tier':>10} {'plan':>10} {'plan/load':>9} {'plan/compute':>12} "
        f"{'tier blocks loaded':>18}",
    ]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.3f}x" if b > 0 else "-"

    for r in report.results:
        t = r.time
        if t is None:
            continue
        loaded = f"{t.loaded_blocks}/{t.tier_blocks}" if t.tier_blocks else "-"
        out.append(
            f"{r.policy:<14} {r.capacity_blocks:>10} {t.uncached_s:>9.1f}s "
            f"{t.recompute_s:>11.1f}s {t.load_all_s:>9.1f}s {t.plan_s:>9.1f}s "
            f"{ratio(t.plan_s, t.load_all_s):>9} {ratio(t.plan_s, t.recompute_s):>12} "
            f"{loaded:>18}"
        )
    return out
