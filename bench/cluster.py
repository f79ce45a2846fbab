"""A global KV pool against per-engine local caches of the same total size, on real traces.

Mooncake (FAST'25) reports that a global cache pool gives 2.22x, 1.38x and
2.36x the hit ratio of per-engine local caches on its conversation,
tool-agent and synthetic traces. This script replays the conversation and
synthetic traces of ``shared/traces`` through ``kvtier.replay.cluster``: N
engines, each with a device cache of ``--device`` blocks, and either

* **local**: each engine also has a host tier of ``C / N`` blocks of its own
  (the device's evictions go there), or
* **global**: one shared tier of ``C`` blocks that every engine writes
  through to and loads from (Redis Cluster, Mooncake Store),

for total capacities ``C`` given as shares of the trace's unique blocks, under
round-robin, least-loaded and prefix-aware routing. Every number is a
deterministic count (no timing); the table gives the token hit ratio, the
global/local ratio under the same router, load imbalance and the bytes the
engines fetched from the shared tier.

``python bench/cluster.py --help`` lists the options; results go to
``bench/results/cluster.json``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import (
    REPO,
    SHARED,
    format_markdown_table,
    format_table,
    git_state,
    log,
    machine_info,
    write_json,
)

from kvtier.replay import ClusterConfig, load_trace, parse_capacity, simulate_cluster
from kvtier.replay.cluster import ROUTES, ClusterResult, Route

DEFAULT_JSON = REPO / "bench" / "results" / "cluster.json"
TRACES = ("mooncake_conversation_dev.jsonl", "mooncake_synthetic.jsonl")
#: What the paper reports: global pool / local caches, by workload.
PAPER = {"conversation": 2.22, "tool-agent": 1.38, "synthetic": 2.36}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Hit ratio of a global pool against local caches of the same total size."
    )
    p.add_argument("--traces", nargs="+", type=Path, help="trace files (default: both Mooncake)")
    p.add_argument("--engines", nargs="+", type=int, default=[4, 8], help="engine counts")
    p.add_argument(
        "--total", nargs="+", default=["10%", "25%", "50%"], help="total tier capacities"
    )
    p.add_argument("--device", type=int, default=400, help="each engine's device cache, blocks")
    p.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    p.add_argument("--policy", default="lru")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--json-out", type=Path, default=DEFAULT_JSON)
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    return p.parse_args(argv)


def _row(r: ClusterResult) -> dict[str, Any]:
    t = r.total()
    return {
        "token_hit_ratio": t.token_hit_ratio,
        "prefix_hit_ratio": t.prefix_hit_ratio,
        "device_hit_blocks": t.device_hit_blocks,
        "host_hit_blocks": t.host_hit_blocks,
        "shared_hit_blocks": t.shared_hit_blocks,
        "load_imbalance": r.load_imbalance,
        "shared_bytes_fetched": r.shared_bytes_fetched,
        "per_engine_token_hit_ratio": [e.token_hit_ratio for e in r.engines],
        "seconds": r.seconds,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    paths = args.traces or [SHARED / "traces" / name for name in TRACES]
    runs: list[dict[str, Any]] = []
    headers = [
        "trace", "engines", "total", "route", "local hit", "global hit", "global/local",
        "local imbalance", "global imbalance", "shared GiB fetched",
    ]  # fmt: skip
    rows: list[list[object]] = []
    started = time.perf_counter()
    for path in paths:
        trace = load_trace(path, limit=args.limit)
        label = trace.name.removesuffix(".jsonl")
        for n in args.engines:
            for text in args.total:
                total = parse_capacity(text).blocks(trace.block_size, trace.unique_blocks)
                for route in args.routes:
                    r_route: Route = route
                    log(f"{label}: {n} engines, total {text} ({total} blocks), {route}")
                    local = simulate_cluster(
                        trace,
                        ClusterConfig(
                            n, args.device, host_blocks=total // n, route=r_route,
                            policy=args.policy,
                        ),
                    )  # fmt: skip
                    pooled = simulate_cluster(
                        trace,
                        ClusterConfig(
                            n, args.device, shared_blocks=total, route=r_route,
                            policy=args.policy,
                        ),
                    )  # fmt: skip
                    ratio = (
                        pooled.token_hit_ratio / local.token_hit_ratio
                        if local.token_hit_ratio
                        else float("inf")
                    )
                    runs.append(
                        {
                            "trace": trace.name,
                            "engines": n,
                            "total": text,
                            "total_blocks": total,
                            "device_blocks": args.device,
                            "route": route,
                            "local": _row(local),
                            "global": _row(pooled),
                            "global_over_local": ratio,
                        }
                    )
                    rows.append([
                        label, n, f"{text} ({total})", route,
                        f"{100 * local.token_hit_ratio:.1f}%",
                        f"{100 * pooled.token_hit_ratio:.1f}%", f"{ratio:.2f}x",
                        f"{local.load_imbalance:.2f}", f"{pooled.load_imbalance:.2f}",
                        f"{pooled.shared_bytes_fetched / 2**30:,.0f}",
                    ])  # fmt: skip
    log(f"done in {time.perf_counter() - started:.1f}s")
    fmt = format_markdown_table if args.markdown else format_table
    print(fmt(headers, rows))
    write_json(
        args.json_out,
        {
            "benchmark": "cluster",
            "paper_global_over_local": PAPER,
            "device_blocks": args.device,
            "policy": args.policy,
            "machine": machine_info(),
            "git": git_state(REPO),
            "runs": runs,
        },
    )
    log(f"results written to {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
