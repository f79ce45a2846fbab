"""Tables and JSON for multi-engine replays (``kvtier replay --engines N``).

One line per configuration (routing rule x device capacity) with the
cluster's hit ratios, where the hits came from (device, host tier, shared
tier), load imbalance and the bytes the engines fetched from the shared
tier; under it one line per engine.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvtier._version import __version__
from kvtier.replay.cluster import ClusterResult, EngineResult
from kvtier.replay.report import trace_json
from kvtier.replay.traces import Trace


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f}"


def _share(part: int, whole: int) -> str:
    return _pct(part / whole) if whole else "-"


def _engine_row(e: EngineResult) -> dict[str, Any]:
    return {
        "requests": e.requests,
        "skipped_requests": e.skipped_requests,
        "prompt_tokens": e.prompt_tokens,
        "cached_tokens": e.cached_tokens,
        "token_hit_ratio": round(e.token_hit_ratio, 6),
        "prefix_hit_ratio": round(e.prefix_hit_ratio, 6),
        "prompt_blocks": e.prompt_blocks,
        "device_hit_blocks": e.device_hit_blocks,
        "host_hit_blocks": e.host_hit_blocks,
        "shared_hit_blocks": e.shared_hit_blocks,
        "work_tokens": e.work_tokens,
        "peak_load_s": round(e.peak_load_s, 3),
    }


def cluster_to_json(trace: Trace, results: list[ClusterResult]) -> dict[str, Any]:
    """The replays as plain JSON-serialisable data."""
    rows = []
    for r in results:
        row: dict[str, Any] = {"config": asdict(r.config)}
        row.update(_engine_row(r.total()))
        row["load_imbalance"] = round(r.load_imbalance, 4)
        row["service_rate_tokens_per_s"] = round(r.service_rate, 1)
        row["shared_bytes_fetched"] = r.shared_bytes_fetched
        row["shared_bytes_stored"] = r.shared_bytes_stored
        row["seconds"] = round(r.seconds, 3)
        row["engines"] = [_engine_row(e) for e in r.engines]
        rows.append(row)
    return {
        "kvtier": __version__,
        "trace": trace_json(trace),
        "model": "cluster",
        "results": rows,
    }


_COLS = (
    ("route", "<", 12),
    ("device", ">", 7),
    ("host", ">", 7),
    ("shared", ">", 7),
    ("token hit", ">", 9),
    ("prefix hit", ">", 10),
    ("from dev", ">", 8),
    ("from host", ">", 9),
    ("from shared", ">", 11),
    ("imbalance", ">", 9),
    ("shared GiB", ">", 10),
)


def _line(values: tuple[str, ...]) -> str:
    return "  ".join(
        f"{v:{align}{width}}" for v, (_, align, width) in zip(values, _COLS, strict=True)
    )


def format_cluster_table(trace: Trace, results: list[ClusterResult]) -> str:
    """A fixed-width table: each configuration, then its engines."""
    head = (
        f"trace {trace.name}: {trace.format} format, {len(trace.requests)} requests, "
        f"{trace.unique_blocks} unique blocks of {trace.block_size} tokens"
    )
    header = _line(tuple(name for name, _, _ in _COLS))
    lines = [head, "", header, "-" * len(header)]
    for r in results:
        c = r.config
        t = r.total()
        hits = t.hit_blocks
        lines.append(
            _line(
                (
                    c.route,
                    str(c.device_blocks),
                    str(c.host_blocks) if c.host_blocks else "-",
                    str(c.shared_blocks) if c.shared_blocks else "-",
                    _pct(t.token_hit_ratio),
                    _pct(t.prefix_hit_ratio),
                    _share(t.device_hit_blocks, hits),
                    _share(t.host_hit_blocks, hits),
                    _share(t.shared_hit_blocks, hits),
                    f"{r.load_imbalance:.2f}",
                    _gib(r.shared_bytes_fetched) if c.shared_blocks else "-",
                )
            )
        )
        mean = t.work_tokens / len(r.engines) if r.engines else 0.0
        for i, e in enumerate(r.engines):
            load = f"{e.work_tokens / mean:.2f}" if mean else "-"
            lines.append(
                f"  engine {i}: {e.requests} requests, token hit {_pct(e.token_hit_ratio)}, "
                f"prefix hit {_pct(e.prefix_hit_ratio)}, work {load}x the mean, "
                f"peak queue {e.peak_load_s:.1f}s"
                + (f", {e.skipped_requests} skipped" if e.skipped_requests else "")
            )
        lines.append("")
    c0 = results[0].config if results else None
    lines.append(
        "device/host = each engine's own caches, shared = one tier every engine sees (in "
        "blocks); from X = share of the hits served by X; imbalance = busiest engine's work "
        "over the mean"
        + (
            f"; shared GiB at {c0.bytes_per_token} KV bytes per token"
            if c0 is not None and c0.shared_blocks
            else ""
        )
    )
    if results:
        lines.append(
            f"engines serve {results[0].service_rate:,.0f} tokens/s each; replayed in "
            f"{sum(r.seconds for r in results):.2f}s"
        )
    return "\n".join(lines)
