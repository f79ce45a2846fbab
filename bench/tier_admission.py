"""Tier admission in the replay: tier bytes written per tier hit, write-all against predicted.

What is measured: ``kvtier.replay.simulate_prefix`` with the learned-reuse
device policy and a lower tier (LRU, ``--tier`` times the device's blocks)
that receives the device's evictions, once with every evicted block
written (``write-all``) and once with ``predicted`` admission
(:class:`kvtier.offload.admission.PredictedReuse`). Per cell: the device
and tier hit ratios (prompt tokens served from each over prompt tokens),
tier blocks written, blocks served from the tier, blocks written per tier
hit (bytes per hit divided by the block's bytes) and predicted's writes per
hit as a share of write-all's.

The goal (reported, not tuned to): predicted writes at most 0.5x
write-all's bytes per tier hit at an equal or better tier hit ratio.
Constants are chosen on the development trace and checked on the synthetic
one. Hit ratios are deterministic: one run per cell.

``python bench/tier_admission.py --help`` lists the options; results go to
``bench/results/tier_admission.json``.
"""

from __future__ import annotations

import argparse
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
    log,
    machine_info,
    write_json,
)

from kvtier.replay import load_trace
from kvtier.replay.simulator import RunResult, simulate_prefix

DEFAULT_JSON = REPO / "bench" / "results" / "tier_admission.json"
SYNTHETIC_TRACE = CONVERSATION_TRACE.with_name("mooncake_synthetic.jsonl")
GOAL_RATIO = 0.5


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--trace",
        type=Path,
        action="append",
        help="trace file (repeatable; default: the development and synthetic traces)",
    )
    p.add_argument(
        "--device",
        type=int,
        nargs="+",
        default=[2500, 5000, 10000],
        help="device sizes in blocks",
    )
    p.add_argument(
        "--tier", type=int, nargs="+", default=[2, 4], help="tier sizes, times the device's"
    )
    p.add_argument("--policy", default="learned-reuse", help="device policy")
    p.add_argument("--threshold", type=float, default=None, help="predicted's threshold")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where the JSON goes")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    return p.parse_args(argv)


def _row(r: RunResult) -> dict[str, Any]:
    t = r.tier
    assert t is not None
    return {
        "device_hit_ratio": r.device_hit_ratio,
        "tier_hit_ratio": r.tier_hit_ratio,
        "token_hit_ratio": r.token_hit_ratio,
        "tier_written_blocks": t.written_blocks,
        "tier_skipped_blocks": t.skipped_blocks,
        "tier_hit_blocks": t.hit_blocks,
        "tier_bytes_written": t.bytes_written,
        "bytes_per_tier_hit": t.bytes_per_hit,
        "writes_per_tier_hit": t.writes_per_hit,
        "seconds": r.seconds,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    traces = args.trace or [CONVERSATION_TRACE, SYNTHETIC_TRACE]
    cells: list[dict[str, Any]] = []
    rows: list[list[object]] = []
    t0 = time.perf_counter()
    for path in traces:
        trace = load_trace(path)
        log(f"loaded {trace.name}: {len(trace.requests):,} requests")
        for dev in args.device:
            for mult in args.tier:
                tier = dev * mult
                runs = {}
                for adm in ("write-all", "predicted"):
                    r = simulate_prefix(
                        trace,
                        args.policy,
                        dev,
                        tier_blocks=tier,
                        tier_admission=adm,
                        tier_threshold=args.threshold if adm == "predicted" else None,
                    )
                    runs[adm] = _row(r)
                base, pred = runs["write-all"], runs["predicted"]
                share = pred["writes_per_tier_hit"] / base["writes_per_tier_hit"]
                met = share <= GOAL_RATIO and pred["tier_hit_ratio"] >= base["tier_hit_ratio"]
                cells.append(
                    {
                        "trace": trace.name,
                        "device_blocks": dev,
                        "tier_blocks": tier,
                        "write_all": base,
                        "predicted": pred,
                        "bytes_per_hit_share": share,
                        "goal_met": met,
                    }
                )
                for adm, row in runs.items():
                    rows.append(
                        [
                            trace.name,
                            f"{dev:,}",
                            f"{tier:,}",
                            adm,
                            f"{100 * row['device_hit_ratio']:.2f}%",
                            f"{100 * row['tier_hit_ratio']:.2f}%",
                            f"{row['tier_written_blocks']:,}",
                            f"{row['tier_hit_blocks']:,}",
                            f"{row['writes_per_tier_hit']:.2f}",
                            f"{share:.2f}x" if adm == "predicted" else "1.00x",
                        ]
                    )
                log(
                    f"{trace.name} device {dev} tier {tier}: share {share:.2f}, tier hit "
                    f"{base['tier_hit_ratio']:.4f} -> {pred['tier_hit_ratio']:.4f}"
                )
    headers = [
        "trace",
        "device",
        "tier",
        "admission",
        "device hit",
        "tier hit",
        "tier writes",
        "tier hits",
        "writes/hit",
        "vs write-all",
    ]
    fmt = format_markdown_table if args.markdown else format_table
    print(fmt(headers, rows))
    write_json(
        args.json,
        {
            "benchmark": "tier_admission",
            "what": "tier blocks written per block served from the tier, write-all vs predicted",
            "policy": args.policy,
            "threshold": args.threshold,
            "goal": f"predicted <= {GOAL_RATIO}x write-all bytes per tier hit at >= tier hit ratio",
            "cells": cells,
            "seconds": time.perf_counter() - t0,
            "machine": machine_info(),
            "git": git_state(REPO),
            "command": " ".join(["python", "bench/tier_admission.py", *sys.argv[1:]]),
        },
    )
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
