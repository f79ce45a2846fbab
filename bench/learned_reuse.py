"""Speed of the learned-reuse policy in the replay's prefix model, next to LRU.

What is measured: block accesses replayed per second by
``kvtier.replay.simulate_prefix`` (a real ``KVCacheManager`` per run, every
request allocated and freed, window 1; the simulator's own timer around its
request loop), for each policy at each capacity, plus the prefix hit ratio
(deterministic, checked identical across repeats). The policies run
alternately within each repeat, so load from other processes on the machine
hits both alike; the table gives the median over repeats, the spread (min to
max), and the median of per-repeat ratios to the first policy.

The target (reported, not tuned to): the learned-reuse policy replays at least
300,000 block accesses per second.

``python bench/learned_reuse.py --help`` lists the options; results go to
``bench/results/learned_reuse.json``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import (
    CONVERSATION_TRACE,
    REPO,
    format_markdown_table,
    format_table,
    git_state,
    machine_info,
    median,
    package_version,
    write_json,
)

from kvtier.replay import load_trace, parse_capacity, simulate_prefix

DEFAULT_JSON = REPO / "bench" / "results" / "learned_reuse.json"
DEFAULT_CAPACITIES = ("2.8%", "5.6%", "11%")
DEFAULT_POLICIES = ("lru", "learned-reuse")
TARGET_POLICY = "learned-reuse"
TARGET_OPS = 300_000.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Replay speed (prefix model) of the learned-reuse policy next to LRU."
    )
    p.add_argument("--trace", type=Path, default=CONVERSATION_TRACE, help="trace file")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--capacity", nargs="+", default=list(DEFAULT_CAPACITIES), metavar="C",
        help="cache sizes as kvtier replay takes them (default 2.8%% 5.6%% 11%%)",
    )
    p.add_argument(
        "--policies", nargs="+", default=list(DEFAULT_POLICIES), metavar="P",
        help="policies, the first one is the reference (default lru learned-reuse)",
    )
    p.add_argument("--repeat", type=int, default=5, help="timed runs per cell (default 5)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--json-out", type=Path, default=DEFAULT_JSON, help="where to write JSON")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    trace = load_trace(args.trace, limit=args.limit)
    unique = trace.unique_blocks
    caps = [(c, parse_capacity(c).blocks(trace.block_size, unique)) for c in args.capacity]
    log(f"loaded {trace.name}: {len(trace.requests):,} requests, {unique:,} unique blocks")
    gc.collect()
    gc.freeze()
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    t0 = time.perf_counter()
    for text, blocks in caps:
        for rep in range(args.repeat):
            # Alternate the order so neither policy always runs first.
            order = args.policies if rep % 2 == 0 else list(reversed(args.policies))
            for policy in order:
                gc.collect()
                r = simulate_prefix(trace, policy, blocks)
                cell = cells.setdefault(
                    (text, policy),
                    {"capacity": text, "blocks": blocks, "policy": policy, "ops": [],
                     "prefix_hit_ratio": r.prefix_hit_ratio, "accesses": r.block_accesses},
                )
                if r.prefix_hit_ratio != cell["prefix_hit_ratio"]:
                    raise SystemExit(f"{policy} at {text}: hit ratio changed between repeats")
                cell["ops"].append(r.ops_per_s)
        log(f"  {text} done ({time.perf_counter() - t0:.1f}s)")
    ref = args.policies[0]
    rows: list[list[object]] = []
    for text, _ in caps:
        base = cells[(text, ref)]["ops"]
        for policy in args.policies:
            cell = cells[(text, policy)]
            ops = cell["ops"]
            cell["ops_median"] = median(ops)
            cell["ratio_to_ref"] = median([o / b for o, b in zip(ops, base, strict=True)])
            rows.append([
                text, cell["blocks"], policy, f"{100 * cell['prefix_hit_ratio']:.2f}%",
                f"{cell['ops_median'] / 1e3:,.0f}k",
                f"{min(ops) / 1e3:,.0f}k-{max(ops) / 1e3:,.0f}k",
                f"{cell['ratio_to_ref']:.2f}x",
            ])
    fmt = format_markdown_table if args.markdown else format_table
    headers = ["capacity", "blocks", "policy", "prefix hit", "accesses/s", "range",
               f"vs {ref}"]
    print(f"trace {trace.name}: prefix model, window 1, {args.repeat} repeats\n")
    print(fmt(headers, rows))
    targets = []
    for text, _ in caps:
        cell = cells.get((text, TARGET_POLICY))
        if cell is not None:
            met = cell["ops_median"] >= TARGET_OPS
            targets.append({"capacity": text, "ops_median": cell["ops_median"], "met": met})
            print(f"  {'met ' if met else 'MISS'}  {text}: {TARGET_POLICY} "
                  f"{cell['ops_median'] / 1e3:,.0f}k accesses/s (target {TARGET_OPS / 1e3:,.0f}k)")
    payload: dict[str, Any] = {
        "benchmark": "learned_reuse",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "machine": machine_info(),
        "git": git_state(REPO),
        "versions": {"kvtier": package_version("kvtier")},
        "trace": {"path": str(args.trace), "name": trace.name,
                  "requests": len(trace.requests), "unique_blocks": unique},
        "repeat": args.repeat,
        "cells": list(cells.values()),
        "targets": targets,
    }
    write_json(args.json_out, payload)
    log(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
