"""KvTierConnector against vLLM's own OffloadingConnector (LRU, ARC), inside vLLM's scheduler side.

What runs: vLLM 0.33's connector factory builds each connector's scheduler
side (vLLM's ``OffloadingConnectorScheduler`` and ``CPUOffloadingManager``;
for kvtier, the same objects under :class:`KvTierConnector`, with a kvtier
policy on the CPU tier), and
:class:`kvtier.integrations.vllm.driver.ConnectorDriver` calls it as vLLM's
scheduler does, one vLLM ``Request`` at a time (its block hashes from
vLLM's own hasher): lookup, allocation, the step's connector metadata (loads
and stores), every transfer reported done, finish, the step storing the
last chunks. No GPU and no GPU prefix cache between requests, so every
reused block comes from the CPU tier; no model: the workers' copies are not
made. The CPU tier has the same number of chunks in every configuration.

Workloads (one trace block = one vLLM block of ``--block-tokens`` tokens):

* ``conversation``: the Mooncake conversation trace (``shared/traces``),
  CPU tier at ``--percent`` of its unique blocks; "hints" are the sessions
  :func:`kvtier.agents.workloads.mooncake_sessions` infers;
* ``tools``: the tool-calling sessions of ``bench/agents.py`` (300 sessions,
  hinted ``session_id`` and ``cache_ttl_s``), 1000 blocks;
* ``cyclic``: its cyclic 10-agent workflow (hinted ``workflow_id``,
  ``agent_id``, ``step``; the step graph registered), 6 of the 10 prompts.

Configurations: vLLM's ``OffloadingConnector`` with its ``lru`` and ``arc``
``CachePolicy``; ``KvTierConnector`` with ``learned-reuse``, and with the
``workflow`` policy (fallback learned-reuse) without and with the hints
(``extra_args={"kvtier": {...}}`` on each request; the trace's clock is the
connector's). MIN is Belady's optimum with bypass in kvtier's replay
(prefix model) at the same size, for reference.

Reported: the block hit ratio (blocks loaded from the CPU tier / prompt
blocks), the share of the LRU -> MIN gap closed, and the scheduler side's
time per step: every connector call of the step (``on_new_request``,
``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output``,
``request_finished``), mean over the steps, from the fastest of
``--repeat`` passes (the hit ratios repeat exactly).

    python bench/vllm_connector.py            # every workload
    python bench/vllm_connector.py --quick    # 1500 conversation requests, fewer sessions
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
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
    package_version,
    write_json,
)

from kvtier.agents import workloads as W
from kvtier.hints import HINT_NAMES
from kvtier.replay.simulator import simulate_min
from kvtier.replay.traces import load_trace

DEFAULT_JSON = REPO / "bench" / "results" / "vllm_connector.json"
CONFIGS: tuple[tuple[str, str, str | None, bool], ...] = (
    # label, connector, policy, hints
    ("vLLM LRU", "OffloadingConnector", "lru", False),
    ("vLLM ARC", "OffloadingConnector", "arc", False),
    ("kvtier learned-reuse", "KvTierConnector", "learned-reuse", False),
    ("kvtier workflow, no hints", "KvTierConnector", "workflow", False),
    ("kvtier workflow, hints", "KvTierConnector", "workflow", True),
)


def transfer(connector: str, policy: str | None) -> dict[str, Any]:
    if connector == "OffloadingConnector":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1, "eviction_policy": policy},
        }
    from kvtier.integrations.vllm.connector import connector_config

    return connector_config(1, policy or "workflow")


def replay(
    lines: list[dict[str, Any]],
    cpu_chunks: int,
    connector: str,
    policy: str | None,
    hinted: bool,
    block_tokens: int,
) -> dict[str, Any]:
    from kvtier.agents import workflow_policy_of
    from kvtier.agents.graph import parse_workflow
    from kvtier.integrations.vllm.driver import ConnectorDriver

    d = ConnectorDriver(transfer(connector, policy), cpu_chunks, block_size=block_tokens)
    bridge = getattr(d.connector, "kvtier", None)
    clock = [0.0]
    if bridge is not None:
        bridge.clock = lambda: clock[0]
        wp = workflow_policy_of(bridge.policy)
        if wp is not None and hinted:
            for line in lines:
                if "workflow" in line:
                    wp.tracker.register(parse_workflow(line["workflow"]))
    requests = [line for line in lines if "hash_ids" in line]
    toks = [
        [h * block_tokens + j for h in line["hash_ids"] for j in range(block_tokens)]
        for line in requests
    ]
    gc.collect()
    gc.freeze()  # as vLLM's engine core does after start-up
    looked = hits = 0
    start = time.perf_counter()
    for line, tokens in zip(requests, toks, strict=True):
        clock[0] = float(line.get("timestamp", 0.0)) / 1000.0
        hints = {k: line[k] for k in HINT_NAMES if k in line} if hinted else {}
        req = d.request(tokens, extra_args={"kvtier": hints} if hints else None)
        loaded, params = d.serve(req)
        if params and "kvtier_error" in params:
            raise RuntimeError(f"hints refused: {params}")
        looked += len(line["hash_ids"])
        hits += loaded // block_tokens
    wall = time.perf_counter() - start
    gc.unfreeze()
    steps = d.step_times
    return {
        "hit_ratio": hits / looked if looked else 0.0,
        "requests": len(requests),
        "steps": len(steps),
        "step_us_mean": 1e6 * statistics.fmean(steps),
        "step_us_p99": 1e6 * sorted(steps)[int(0.99 * (len(steps) - 1))],
        "request_us_mean": 1e6 * sum(steps) / max(1, len(requests)),
        "wall_s": wall,
    }


def min_ratio(lines: list[dict[str, Any]], cap: int, tmp: Path) -> float:
    """Belady's MIN (with bypass) as block hits over prompt blocks, kvtier's prefix model."""
    plain = [
        {k: v for k, v in line.items() if k in ("timestamp", "hash_ids", "input_length",
                                                 "output_length")}
        for line in lines if "hash_ids" in line
    ]  # fmt: skip
    for line in plain:
        # Full blocks only, as vLLM stores them (the trace's last block may be partial).
        line["input_length"] = len(line["hash_ids"]) * W.BLOCK_SIZE
        line["output_length"] = 0
    trace = load_trace(W.write_trace(plain, tmp / "min.jsonl"), block_size=W.BLOCK_SIZE)
    r = simulate_min(trace, cap, "prefix")
    return r.prefix_hit_blocks / r.prefix_blocks if r.prefix_blocks else 0.0


def workloads(args: argparse.Namespace) -> list[tuple[str, list[dict[str, Any]], list[int]]]:
    out: list[tuple[str, list[dict[str, Any]], list[int]]] = []
    if "conversation" in args.workloads:
        if not CONVERSATION_TRACE.exists():
            log(f"{CONVERSATION_TRACE} not found: the conversation rows are skipped")
        else:
            with CONVERSATION_TRACE.open() as fh:
                raw = [json.loads(line) for line in fh if line.strip()]
            if args.limit:
                raw = raw[: args.limit]
            lines = W.mooncake_sessions(raw)
            unique = len({h for line in lines for h in line["hash_ids"]})
            out.append(("conversation", lines, [max(1, unique * p // 100) for p in args.percent]))
    if "tools" in args.workloads:
        lines = W.tool_sessions(
            100 if args.quick else 300, arrival_s=1.0, tool_latency_median_s=10.0,
            system_tokens=800, tool_result_tokens=(50, 400), seed=0,
        )  # fmt: skip
        out.append(("tools", lines, [1000]))
    if "cyclic" in args.workloads:
        lines = W.cyclic_workflow(10, 512, rounds=8)
        out.append(("cyclic", lines, [6 * 512 // W.BLOCK_SIZE]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="1500 conversation requests")
    ap.add_argument("--limit", type=int, default=0, help="conversation requests (0: all)")
    ap.add_argument("--percent", type=int, nargs="+", default=[5, 10],
                    help="conversation CPU tier sizes, %% of its unique blocks")  # fmt: skip
    ap.add_argument("--block-tokens", type=int, default=4, help="tokens per trace block")
    ap.add_argument("--workloads", nargs="+", default=["conversation", "tools", "cyclic"])
    ap.add_argument("--repeat", type=int, default=1, help="passes per configuration, in turns; "
                    "the fastest one's times are reported")  # fmt: skip
    ap.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    ap.add_argument("--out", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    if args.quick and not args.limit:
        args.limit = 1500
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, lines, caps in workloads(args):
            for cap in caps:
                log(f"{name}: {cap} CPU chunks, MIN")
                mn = min_ratio(lines, cap, Path(tmp))
                # The configurations take turns, each pass in another order, so none is
                # always the first (the process still warming up) or the last; hit ratios
                # repeat exactly, and the fastest pass is the timing least disturbed by
                # the rest of a shared machine.
                best: dict[str, dict[str, Any]] = {}
                for rep in range(args.repeat):
                    k = rep % len(CONFIGS)
                    for label, connector, policy, hinted in CONFIGS[k:] + CONFIGS[:k]:
                        log(f"{name}: {cap} CPU chunks, {label} (pass {rep + 1})")
                        r = replay(lines, cap, connector, policy, hinted, args.block_tokens)
                        if label not in best or r["step_us_mean"] < best[label]["step_us_mean"]:
                            best[label] = r
                lru = None
                for label, _connector, _policy, _hinted in CONFIGS:
                    r = best[label]
                    if label == "vLLM LRU":
                        lru = r["hit_ratio"]
                    gap = (
                        (r["hit_ratio"] - lru) / (mn - lru)
                        if lru is not None and mn > lru
                        else None
                    )
                    rows.append({"workload": name, "cpu_chunks": cap, "config": label,
                                 "min_hit_ratio": mn, "gap_closed": gap, **r})  # fmt: skip
    headers = ["workload", "CPU chunks", "configuration", "hit ratio", "MIN", "LRU->MIN gap",
               "µs/step", "p99 µs/step", "µs/request"]  # fmt: skip
    table: list[list[object]] = [
        [r["workload"], r["cpu_chunks"], r["config"], f"{100 * r['hit_ratio']:.2f}%",
         f"{100 * r['min_hit_ratio']:.2f}%",
         "" if r["gap_closed"] is None else f"{100 * r['gap_closed']:.0f}%",
         f"{r['step_us_mean']:.0f}", f"{r['step_us_p99']:.0f}", f"{r['request_us_mean']:.0f}"]
        for r in rows
    ]  # fmt: skip
    print(format_table(headers, table))
    if args.markdown:
        print()
        print(format_markdown_table(headers, table))
    write_json(args.out, {
        "benchmark": "vllm_connector", "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows, "vllm": package_version("vllm"), "machine": machine_info(),
        "git": git_state(REPO),
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
