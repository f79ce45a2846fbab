"""The learned-reuse policy in the replay's prefix model: replay speed, and gap closed.

Two modes.

Speed (the default). What is measured: block accesses replayed per second by
``kvtier.replay.simulate_prefix`` (a real ``KVCacheManager`` per run, every
request allocated and freed, window 1; the simulator's own timer around its
request loop), for each policy at each capacity, plus the prefix hit ratio
(deterministic, checked identical across repeats). The policies run
alternately within each repeat, so load from other processes on the machine
hits both alike; the table gives the median over repeats, the spread (min to
max), and the median of per-repeat ratios to the first policy.

The target (reported, not tuned to): the learned-reuse policy replays at least
500,000 block accesses per second.

Gap closed (``--gap``). For every trace and capacity: the prefix hit ratio
of LRU, of Belady's MIN (with bypass, on the same block accesses) and of
each policy, and the share of the LRU->MIN gap each policy closes, ``(policy
- LRU) / (MIN - LRU)``; then, per policy, its worst cell against LRU in
points. ``--halves`` also replays each trace's first and second halves (by
request order, which is time order in the Mooncake files) as traces of their
own. Hit ratios are deterministic, so one run per cell.

``--policies lrb`` adds the LRB-style policy (:mod:`kvtier.policy.lrb`,
needs LightGBM); in ``--gap`` mode each of its cells also records what its
model did: models trained, the online AUC (scores given before the labels
were known), the last model's hold-out AUC, how often a round's first victim
was also the oldest sampled candidate (what a sampled LRU would evict), and
the last model's share of gain per feature; ``--lrb-stats`` prints them.

``python bench/learned_reuse.py --help`` lists the options; results go to
``bench/results/learned_reuse.json`` (speed) or
``bench/results/learned_reuse_gap.json`` (gap).
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

from kvtier.policy import available_policies
from kvtier.replay import load_sample_trace, load_trace, parse_capacity, simulate_prefix
from kvtier.replay.simulator import simulate_min
from kvtier.replay.traces import Trace

DEFAULT_JSON = REPO / "bench" / "results" / "learned_reuse.json"
DEFAULT_GAP_JSON = REPO / "bench" / "results" / "learned_reuse_gap.json"
SYNTHETIC_TRACE = CONVERSATION_TRACE.with_name("mooncake_synthetic.jsonl")
DEFAULT_GAP_TRACES = (str(CONVERSATION_TRACE), str(SYNTHETIC_TRACE), "sample")
DEFAULT_GAP_CAPACITIES = ("1%", "2%", "5%", "10%", "25%")
DEFAULT_CAPACITIES = ("2.8%", "5.6%", "11%")
DEFAULT_POLICIES = ("lru", "learned-reuse")
TARGET_POLICY = "learned-reuse"
TARGET_OPS = 500_000.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Replay speed (prefix model) of the learned-reuse policy next to LRU."
    )
    p.add_argument("--trace", type=Path, default=CONVERSATION_TRACE, help="trace file (speed)")
    p.add_argument(
        "--gap",
        action="store_true",
        help="report the share of the LRU->MIN prefix-hit gap closed instead of speed",
    )
    p.add_argument(
        "--traces",
        nargs="+",
        default=list(DEFAULT_GAP_TRACES),
        metavar="T",
        help="--gap: trace files, or 'sample' for the bundled one "
        "(default: the conversation and synthetic files, and the sample)",
    )
    p.add_argument(
        "--halves",
        action="store_true",
        help="--gap: also replay each trace's first and second halves on their own",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--capacity",
        nargs="+",
        default=None,
        metavar="C",
        help="cache sizes as kvtier replay takes them "
        "(default 2.8%% 5.6%% 11%%; with --gap 1%% 2%% 5%% 10%% 25%%)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=list(DEFAULT_POLICIES),
        metavar="P",
        help="policies, the first one is the reference (default lru learned-reuse)",
    )
    p.add_argument("--repeat", type=int, default=5, help="timed runs per cell (default 5)")
    p.add_argument(
        "--lrb-stats",
        action="store_true",
        help="--gap: print the lrb policy's model statistics per cell (always in the JSON)",
    )
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--json-out", type=Path, default=None, help="where to write JSON")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.capacity is None:
        args.capacity = list(DEFAULT_GAP_CAPACITIES if args.gap else DEFAULT_CAPACITIES)
    if args.json_out is None:
        args.json_out = DEFAULT_GAP_JSON if args.gap else DEFAULT_JSON
    if args.gap and "lru" in args.policies:
        # LRU is always replayed as the reference; listing it again adds nothing.
        args.policies = [x for x in args.policies if x != "lru"]
    return args


def load_gap_traces(specs: Sequence[str], limit: int | None, halves: bool) -> list[Trace]:
    """The traces named, each followed by its two halves when asked."""
    out: list[Trace] = []
    for spec in specs:
        t = load_sample_trace(limit=limit) if spec == "sample" else load_trace(spec, limit=limit)
        out.append(t)
        if halves:
            mid = len(t.requests) // 2
            for label, part in (
                ("first half", t.requests[:mid]),
                ("second half", t.requests[mid:]),
            ):
                out.append(
                    Trace(
                        f"{t.name} ({label})",
                        t.format,
                        t.block_size,
                        part,
                        workflows=list(t.workflows),
                    )
                )
    return out


#: The name the gap mode replays the lrb policy under, to see the instance it built.
LRB_WATCHED = "lrb (watched)"
_watched: list[Any] = []


def _watch_lrb() -> None:
    """Register ``LRB_WATCHED``: the lrb policy with its defaults, instances kept."""
    from kvtier.policy.lrb import LRBPolicy
    from kvtier.policy.registry import register_policy

    def make(**kwargs: Any) -> Any:
        policy = LRBPolicy(**kwargs)
        _watched.append(policy)
        return policy

    register_policy(LRB_WATCHED, make)


def lrb_stats(policy: Any) -> dict[str, Any]:
    """What the lrb policy's models did in one replay."""
    gains = policy.feature_importance()
    total = sum(gains.values()) or 1.0
    return {
        "trainings": policy.trainings,
        "online_auc": policy.online_auc(),
        "holdout_auc": policy.holdout_auc,
        "trusted": policy.trusted,
        "rounds": policy.rounds_done,
        "first_victim_is_oldest": policy.rounds_like_lru / max(policy.rounds_done, 1),
        "horizon_s": policy.horizon,
        "gain_share": {k: v / total for k, v in gains.items()},
    }


def _policy(name: str) -> str:
    """What to hand the replay for a policy named on the command line."""
    if name == "lrb":
        from kvtier.policy.lrb import IMPORT_PATH

        return IMPORT_PATH
    return name


def closed(hit: float, lru: float, best: float) -> float | None:
    """Share of the LRU->MIN gap a hit ratio closes (None where there is no gap)."""
    return (hit - lru) / (best - lru) if best > lru else None


def gap_main(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    traces = load_gap_traces(args.traces, args.limit, args.halves)
    policies = list(args.policies)
    cells: list[dict[str, Any]] = []
    rows: list[list[object]] = []
    t0 = time.perf_counter()
    for trace in traces:
        unique = trace.unique_blocks
        log(f"{trace.name}: {len(trace.requests):,} requests, {unique:,} unique blocks")
        for text in args.capacity:
            blocks = parse_capacity(text).blocks(trace.block_size, unique)
            best = simulate_min(trace, blocks, "prefix").prefix_hit_ratio
            lru = simulate_prefix(trace, "lru", blocks).prefix_hit_ratio
            cell: dict[str, Any] = {
                "trace": trace.name,
                "capacity": text,
                "blocks": blocks,
                "min": best,
                "lru": lru,
                "policies": {},
            }
            row: list[object] = [
                trace.name,
                text,
                blocks,
                f"{100 * best:.2f}%",
                f"{100 * lru:.2f}%",
            ]
            for policy in policies:
                watched = policy == "lrb"
                if watched and LRB_WATCHED not in available_policies():
                    _watch_lrb()
                r = simulate_prefix(trace, LRB_WATCHED if watched else _policy(policy), blocks)
                share = closed(r.prefix_hit_ratio, lru, best)
                cell["policies"][policy] = {
                    "prefix_hit_ratio": r.prefix_hit_ratio,
                    "vs_lru_points": 100 * (r.prefix_hit_ratio - lru),
                    "gap_closed": share,
                    "ops_per_s": r.ops_per_s,
                }
                if watched:
                    st = lrb_stats(_watched.pop())
                    cell["policies"][policy]["lrb"] = st
                    if args.lrb_stats:
                        auc = st["online_auc"]
                        top = sorted(st["gain_share"].items(), key=lambda kv: -kv[1])[:4]
                        log(
                            f"    lrb at {text}: {st['trainings']} models, online AUC "
                            f"{'-' if auc is None else f'{auc:.3f}'}, first victim = oldest "
                            f"candidate in {100 * st['first_victim_is_oldest']:.0f}% of rounds, "
                            f"{r.ops_per_s / 1e3:,.1f}k accesses/s; top gain: "
                            + ", ".join(f"{k} {100 * v:.0f}%" for k, v in top)
                        )
                row.append(f"{100 * r.prefix_hit_ratio:.2f}%")
                row.append("-" if share is None else f"{100 * share:.1f}%")
            cells.append(cell)
            rows.append(row)
        log(f"  done ({time.perf_counter() - t0:.1f}s)")
    headers = ["trace", "capacity", "blocks", "MIN", "LRU"]
    for policy in policies:
        headers += [policy, "closed"]
    fmt = format_markdown_table if args.markdown else format_table
    print("prefix model, window 1; closed = (policy - LRU) / (MIN - LRU)\n")
    print(fmt(headers, rows))
    worst: dict[str, dict[str, Any]] = {}
    for policy in policies:
        w = min(cells, key=lambda c: c["policies"][policy]["vs_lru_points"])
        d = w["policies"][policy]["vs_lru_points"]
        worst[policy] = {
            "trace": w["trace"],
            "capacity": w["capacity"],
            "vs_lru_points": d,
            "within_half_point": d >= -0.5,
        }
        print(
            f"  worst cell vs LRU, {policy}: {d:+.2f} points ({w['trace']} at {w['capacity']})"
            f"{'' if d >= -0.5 else '  MORE THAN 0.5 POINTS BELOW LRU'}"
        )
    payload: dict[str, Any] = {
        "benchmark": "learned_reuse_gap",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "machine": machine_info(),
        "git": git_state(REPO),
        "versions": {"kvtier": package_version("kvtier")},
        "traces": [
            {"name": t.name, "requests": len(t.requests), "unique_blocks": t.unique_blocks}
            for t in traces
        ],
        "cells": cells,
        "worst_vs_lru": worst,
    }
    write_json(args.json_out, payload)
    log(f"wrote {args.json_out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gap:
        return gap_main(args, argv)
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
                r = simulate_prefix(trace, _policy(policy), blocks)
                cell = cells.setdefault(
                    (text, policy),
                    {
                        "capacity": text,
                        "blocks": blocks,
                        "policy": policy,
                        "ops": [],
                        "prefix_hit_ratio": r.prefix_hit_ratio,
                        "accesses": r.block_accesses,
                    },
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
            rows.append(
                [
                    text,
                    cell["blocks"],
                    policy,
                    f"{100 * cell['prefix_hit_ratio']:.2f}%",
                    f"{cell['ops_median'] / 1e3:,.0f}k",
                    f"{min(ops) / 1e3:,.0f}k-{max(ops) / 1e3:,.0f}k",
                    f"{cell['ratio_to_ref']:.2f}x",
                ]
            )
    fmt = format_markdown_table if args.markdown else format_table
    headers = ["capacity", "blocks", "policy", "prefix hit", "accesses/s", "range", f"vs {ref}"]
    print(f"trace {trace.name}: prefix model, window 1, {args.repeat} repeats\n")
    print(fmt(headers, rows))
    targets = []
    for text, _ in caps:
        found = cells.get((text, TARGET_POLICY))
        if found is not None:
            met = found["ops_median"] >= TARGET_OPS
            targets.append({"capacity": text, "ops_median": found["ops_median"], "met": met})
            print(
                f"  {'met ' if met else 'MISS'}  {text}: {TARGET_POLICY} "
                f"{found['ops_median'] / 1e3:,.0f}k accesses/s (target {TARGET_OPS / 1e3:,.0f}k)"
            )
    payload: dict[str, Any] = {
        "benchmark": "learned_reuse",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "machine": machine_info(),
        "git": git_state(REPO),
        "versions": {"kvtier": package_version("kvtier")},
        "trace": {
            "path": str(args.trace),
            "name": trace.name,
            "requests": len(trace.requests),
            "unique_blocks": unique,
        },
        "repeat": args.repeat,
        "cells": list(cells.values()),
        "targets": targets,
    }
    write_json(args.json_out, payload)
    log(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
