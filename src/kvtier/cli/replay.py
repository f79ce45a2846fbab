"""``kvtier replay``: replay a request trace through the cache, policies side by side with MIN."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from kvtier.cli.args import arg, parse_memory_size
from kvtier.errors import ConfigError
from kvtier.layout import KV_CACHE_DTYPES
from kvtier.policy import available_policies, make_policy
from kvtier.units import parse_rate, parse_seconds

if TYPE_CHECKING:
    from kvtier.replay.capacity import Capacity
    from kvtier.replay.timing import CostSpec

_REPLAY_EPILOG = """\
trace formats (JSONL, one request per line; the first line decides; .gz is read too):
  Mooncake     {"timestamp": 0, "input_length": 6758, "output_length": 500,
                "hash_ids": [0, 1, 2, ...]}
               hash_ids name the prompt's blocks of 512 tokens, prefix-chained
               (two requests sharing their first k ids share their first k blocks);
               there are ceil(input_length / 512) ids, the last maybe partial.
  token-level  {"tokens": [101, 2023, ...], "timestamp": 0.5, "output_tokens": [...]}
               timestamp and output_tokens are optional; block keys are computed
               with kvtier's BlockHasher, blocks of --block-size tokens (default 16).
  With no TRACE, a bundled 600-request sample of the Mooncake conversation
  trace is replayed.

capacity (one or more; blocks, tokens or a share of the trace's unique blocks):
  2048, 2k     blocks (k, M, G are 1024, 1024^2, 1024^3)
  65536t, 64kt tokens, rounded down to whole blocks
  5%, 0.5%     percent of the distinct block keys in the trace
  default: 1% 5% 10%
  --kv-cache-memory SIZE...   as KV memory: the blocks of --kv-model's geometry (at the
               trace's block size) that fit, for each --kv-cache-dtype, e.g.
               --kv-cache-memory 110GiB --kv-cache-dtype auto bfloat16 int8

models:
  prefix  (default) each request is allocated and freed on a real KVCacheManager
          with the policy: hits are the longest cached prefix, as in serving.
          --window K keeps up to K requests live (oldest freed first).
  block   every block access is one cache get (as in libCacheSim): hit ->
          policy.access; miss -> policy.admit, policy.evict when full,
          policy.insert. Any block can hit, chains are ignored.

metrics (totals over the trace):
  block hit   block accesses whose key was cached at access time
  prefix hit  blocks in each request's leading run of hits / its blocks
  token hit   prompt tokens served from cache / prompt tokens
  MIN         Belady's offline optimum with bypass on the same accesses: the
              upper bound on block hits; gap = MIN - policy, in points
  ops/s       block accesses replayed per second of the simulation loop

prefill time (--prefill-rate, prefix model):
  With the model's compute speed (--prefill-rate tokens/s, optionally
  --prefill-pair-cost s per attention query-key pair) and, with --tier-blocks,
  the tier's load speed (--tier-bandwidth, --tier-latency), each admitted
  request's prefill is timed alone under four rules: no cache at all, the
  tier's blocks computed again, the tier's blocks loaded, and kvtier's plan
  (load the tier blocks whose load beats computing them, compute the rest).
  Blocks weigh --bytes-per-token x the block size.

several engines (--engines N):
  Each engine has its own device cache (--capacity, per engine) and optionally
  its own host tier (--host-tier); --shared-tier adds one tier every engine
  sees (Redis Cluster, a global pool), written through. --route picks the
  engine: round-robin, least-loaded, or prefix (the engine holding the
  longest cached prefix, unless its queue is over --load-cap times the
  shortest).
  The table shows the cluster's and each engine's hit ratios, where hits came
  from, load imbalance and the bytes fetched from the shared tier.

examples:
  kvtier replay
  kvtier replay --tier-blocks 2000 --tier-bandwidth 3MB/s --tier-latency 20ms --prefill-rate 4000
  kvtier replay trace.jsonl --engines 4 --route round-robin prefix -c 400 --host-tier 2.5%
  kvtier replay trace.jsonl --engines 4 --route round-robin -c 400 --shared-tier 10%
  kvtier replay trace.jsonl --policy all --capacity 1% 5% 10% --model block
  kvtier replay trace.jsonl -p lru -c 64kt 1Mt --json-out out.json --plot out.png
"""


def _policy_names(requested: Sequence[str] | None) -> list[str]:
    """Expand ``all`` and drop repeats; unknown names raise ConfigError here, early."""
    names: list[str] = []
    for name in requested or ["lru"]:
        expanded = available_policies() if name.lower() == "all" else [name]
        for n in expanded:
            if n.lower() not in (x.lower() for x in names):
                make_policy(n)  # validates the name or import path
                names.append(n)
    return names


def _trace_swallowed(args: argparse.Namespace) -> None:
    """Take the trace back from a multi-value option when it was written after it.

    Both options take several values, so ``kvtier replay -p lru arc t.jsonl``
    parses ``t.jsonl`` as a policy. An existing file there is not a policy or a
    capacity, so it can only be the trace.
    """
    if args.trace is not None:
        return
    for values in (args.policy, args.capacity, args.route):
        if values and len(values) > 1 and os.path.isfile(values[-1]):
            args.trace = values.pop()
            return


def _run_cluster(args: argparse.Namespace) -> int:
    """``--engines N``: every routing rule at every device capacity, over N engines."""
    from kvtier.replay.capacity import parse_capacity
    from kvtier.replay.cluster import (
        DEFAULT_BYTES_PER_TOKEN,
        ROUTES,
        ClusterConfig,
        Route,
        simulate_cluster,
    )
    from kvtier.replay.cluster_report import cluster_to_json, format_cluster_table
    from kvtier.replay.progress import ProgressBar, want_progress
    from kvtier.replay.traces import load_sample_trace, load_trace

    if args.model != "prefix" or args.window != 1 or args.plot:
        raise ConfigError(
            "--engines replays the prefix model only (no --model block, --window or --plot)"
        )
    if args.policy and len(args.policy) > 1:
        raise ConfigError("--engines replays one policy at a time; give one --policy")
    policy = _policy_names(args.policy)[0]
    routes = list(dict.fromkeys(args.route or ["prefix"]))
    for r in routes:
        if r not in ROUTES:
            raise ConfigError(f"unknown --route {r!r}; choose from {', '.join(ROUTES)}")
    if args.trace is None:
        trace = load_sample_trace(block_size=args.block_size, limit=args.limit)
    else:
        trace = load_trace(args.trace, block_size=args.block_size, limit=args.limit)

    def blocks(text: str | None) -> int:
        if not text or text == "0":
            return 0
        return parse_capacity(text).blocks(trace.block_size, trace.unique_blocks)

    devices = [blocks(c) for c in (args.capacity or ["1%"])]
    configs = [
        ClusterConfig(
            args.engines, dev, blocks(args.host_tier), blocks(args.shared_tier),
            cast("Route", route),
            load_cap=args.load_cap, policy=policy, service_rate=args.service_rate,
            bytes_per_token=args.bytes_per_token or DEFAULT_BYTES_PER_TOKEN,
        )
        for dev in devices
        for route in routes
    ]
    for c in configs:
        c.check()
    bar = ProgressBar(len(configs) * len(trace.requests), enabled=want_progress(args.progress))
    try:
        results = [simulate_cluster(trace, c, bar.advance) for c in configs]
    finally:
        bar.close()
    data = cluster_to_json(trace, results)
    if args.json_out:
        _write_json(args.json_out, data)
    print(json.dumps(data, indent=2) if args.json else format_cluster_table(trace, results))
    return 0


def _write_json(path: str, data: object) -> None:
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    if args.engines is not None:
        _trace_swallowed(args)
        return _run_cluster(args)
    # Imported here so ``kvtier info`` stays fast and replay-free.
    from kvtier.replay.capacity import parse_capacity
    from kvtier.replay.progress import ProgressBar, want_progress
    from kvtier.replay.report import format_table, resolve_capacities, run_replay, to_json
    from kvtier.replay.traces import load_sample_trace, load_trace

    _trace_swallowed(args)
    policies = _policy_names(args.policy)
    default = [] if args.kv_cache_memory else ["1%", "5%", "10%"]
    capacities = [parse_capacity(c) for c in (args.capacity or default)]
    if args.window < 1:
        raise ConfigError(f"--window must be at least 1, got {args.window}")
    if args.model == "block" and args.window != 1:
        raise ConfigError("--window applies to the prefix model only")
    if args.tier_blocks < 0:
        raise ConfigError(f"--tier-blocks must be >= 0, got {args.tier_blocks}")
    if args.model == "block" and args.tier_blocks:
        raise ConfigError("--tier-blocks applies to the prefix model only")
    _cost_spec(args, 1)  # bad flags fail before the trace loads
    started = time.perf_counter()
    if args.trace is None:
        trace = load_sample_trace(block_size=args.block_size, limit=args.limit)
    else:
        trace = load_trace(args.trace, block_size=args.block_size, limit=args.limit)
    load_seconds = time.perf_counter() - started
    costs = _cost_spec(args, trace.block_size)
    sized: list[Capacity] = []
    if args.kv_cache_memory:
        sized = memory_capacities(
            args.kv_cache_memory, args.kv_cache_dtype or ["auto"], args.kv_model, trace.block_size
        )
        capacities += sized
    points = resolve_capacities(trace, capacities)
    bar = ProgressBar(
        len(policies) * len(points) * len(trace.requests), enabled=want_progress(args.progress)
    )
    try:
        report = run_replay(
            trace,
            policies,
            capacities,
            model=args.model,
            window=args.window,
            progress=bar,
            tier_blocks=args.tier_blocks,
            tier_admission=args.tier_admission,
            costs=costs,
        )
    finally:
        bar.close()
    report.load_seconds = load_seconds
    data = to_json(report)
    skipped: dict[int, int] = {}
    for r in report.results:
        if r.skipped_requests:
            skipped[r.capacity_blocks] = max(skipped.get(r.capacity_blocks, 0), r.skipped_requests)
    for blocks, count in skipped.items():
        print(
            f"kvtier: warning: at {blocks} blocks, {count} of {len(trace.requests)} requests "
            "need more blocks than the cache holds; they were skipped and counted as misses",
            file=sys.stderr,
        )
    if args.json_out:
        _write_json(args.json_out, data)
    if args.plot:
        from kvtier.replay.plot import plot_report

        plot_report(report, args.plot)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for cap in sized:
            print(f"KV memory {cap.text}: {int(cap.value)} blocks of {trace.block_size} tokens")
        print(format_table(report))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _cost_spec(args: argparse.Namespace, block_size: int) -> CostSpec | None:
    """The prefill-timing costs the flags give for blocks of ``block_size`` tokens
    (``None``: no timing), checked together; called with 1 to check before a trace loads."""
    from kvtier.replay.cluster import DEFAULT_BYTES_PER_TOKEN
    from kvtier.replay.timing import CostSpec

    tier_flags = args.tier_bandwidth is not None or args.tier_latency is not None
    if args.prefill_rate is None:
        if tier_flags or args.prefill_pair_cost is not None:
            raise ConfigError(
                "--tier-bandwidth, --tier-latency and --prefill-pair-cost time prefills, "
                "which needs the model's speed too: add --prefill-rate TOKENS/S (measure it "
                "with `kvtier serve` and /v1/cache/stats, or take it from a benchmark)"
            )
        return None
    if tier_flags and not args.tier_blocks:
        raise ConfigError(
            "--tier-bandwidth and --tier-latency describe the lower tier: add --tier-blocks N"
        )
    if args.model == "block":
        raise ConfigError("prefill timing (--prefill-rate) applies to the prefix model only")
    bytes_per_token = args.bytes_per_token or DEFAULT_BYTES_PER_TOKEN
    if bytes_per_token <= 0:
        raise ConfigError(f"--bytes-per-token must be positive, got {bytes_per_token}")
    return CostSpec(
        prefill_tokens_s=args.prefill_rate,
        pair_s=args.prefill_pair_cost or 0.0,
        tier_bytes_s=args.tier_bandwidth if args.tier_bandwidth is not None else float("inf"),
        tier_latency_s=args.tier_latency or 0.0,
        block_bytes=bytes_per_token * block_size,
    )


def memory_capacities(
    sizes: Sequence[int], dtypes: Sequence[str], model: str | None, block_size: int
) -> list[Capacity]:
    """Capacities in blocks: what ``sizes`` bytes of KV memory hold in each dtype.

    Blocks take ``model``'s KV geometry (the bundled SmolLM2 by default) at
    ``block_size`` tokens; ``auto`` is float32, the engine's default. A model
    whose sliding-window, chunked, convolution or linear-attention layers the
    engine keeps in window slots (``kvtier serve --window-kv-ratio auto``) is
    sized as the engine sizes it: a block costs its other layers plus its
    share of the slots. The replay then counts every cached block as a place
    to resume, where the engine resumes only where a window is kept, so its
    hit ratios for such models are an upper bound.
    """
    from kvtier.engine.model import probe_model
    from kvtier.layout import cache_layout
    from kvtier.replay.capacity import Capacity

    info = probe_model(model)
    base = info.layout(block_size, "float32")
    out: list[Capacity] = []
    rounded = [d for d in dtypes if d not in ("auto", base.dtype)]
    if info.state is not None and rounded:
        raise ConfigError(
            f"--kv-cache-dtype {' '.join(rounded)}: {info.model_id} keeps its linear-attention "
            "states in the KV blocks exactly, so kvtier serves it only at --kv-cache-dtype auto"
        )
    for size in sizes:
        for dtype in dtypes:
            layout = cache_layout(base, dtype)
            windows = info.windows if layout.dtype == base.dtype else None
            cost = layout.bytes_per_block if windows is None else windows.block_bytes(layout)
            blocks = size // cost
            if blocks < 1:
                raise ConfigError(
                    f"--kv-cache-memory {size:,} bytes hold no {dtype} block of {block_size} "
                    f"tokens of {info.model_id} ({layout.bytes_per_block:,} bytes): give more"
                )
            text = f"{_size_text(size)} {dtype}"
            if windows is not None:
                text += f" (window slots {windows.ratio:g} per block)"
            out.append(Capacity(text, "blocks", blocks))
    return out


def _size_text(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    replay = sub.add_parser(
        "replay",
        help="replay a request trace through the cache and compare policies with MIN",
        description="Replay a request trace through kvtier's cache with one or more "
        "eviction policies at one or more capacities, next to Belady's offline optimum.",
        epilog=_REPLAY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument(
        "trace",
        nargs="?",
        metavar="TRACE",
        help="trace file (.jsonl or .jsonl.gz); default: the bundled sample",
    )
    replay.add_argument(
        "-p",
        "--policy",
        nargs="+",
        action="extend",
        metavar="P",
        help=f"policies to compare, or 'all' (registered: {', '.join(available_policies())}; "
        "also an import path pkg.mod:Class); default lru",
    )
    replay.add_argument(
        "-c",
        "--capacity",
        nargs="+",
        action="extend",
        metavar="C",
        help="cache sizes: blocks (2048), tokens (64kt) or %% of unique blocks (5%%); "
        "default 1%% 5%% 10%%",
    )
    replay.add_argument(
        "--kv-cache-memory",
        nargs="+",
        action="extend",
        type=arg(parse_memory_size, "memory size"),
        metavar="SIZE",
        help="capacities as KV memory (110GiB, 512MiB): the blocks --kv-model's KV geometry "
        "fits in it at the trace's block size, for each --kv-cache-dtype",
    )
    replay.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        action="extend",
        choices=tuple(KV_CACHE_DTYPES),
        metavar="DTYPE",
        help=f"block dtypes for --kv-cache-memory: {', '.join(KV_CACHE_DTYPES)} "
        "(auto: float32; default auto)",
    )
    replay.add_argument(
        "--kv-model",
        metavar="PATH",
        help="model whose KV geometry sizes --kv-cache-memory (a HF directory or .gguf; "
        "default: the bundled SmolLM2-135M-Instruct)",
    )
    replay.add_argument(
        "--model",
        choices=("prefix", "block"),
        default="prefix",
        help="prefix: a real KVCacheManager (default); block: block-level cache gets",
    )
    replay.add_argument(
        "--window",
        type=int,
        default=1,
        metavar="K",
        help="prefix model: requests live at once, oldest freed first (default 1)",
    )
    replay.add_argument(
        "--tier-blocks",
        type=int,
        default=0,
        metavar="N",
        help="prefix model: a lower tier of N blocks (LRU) takes the device's evictions",
    )
    replay.add_argument(
        "--tier-admission",
        choices=("write-all", "predicted"),
        default="write-all",
        help="which evicted blocks the lower tier writes: all (default), or those the "
        "learned-reuse policy predicts are worth their bytes",
    )
    timing = replay.add_argument_group("prefill time (prefix model)")
    timing.add_argument(
        "--prefill-rate",
        type=float,
        metavar="TOK/S",
        help="tokens a second the model computes in a prefill: times each request's prefill "
        "under each load rule",
    )
    timing.add_argument(
        "--prefill-pair-cost",
        type=float,
        metavar="S",
        help="seconds per attention query-key pair, for long contexts (default 0)",
    )
    timing.add_argument(
        "--tier-bandwidth",
        type=arg(parse_rate, "rate"),
        metavar="RATE",
        help="the lower tier's load bandwidth, e.g. 3MB/s or 10GiB/s (default: free)",
    )
    timing.add_argument(
        "--tier-latency",
        type=arg(parse_seconds, "latency"),
        metavar="T",
        help="seconds each load call from the lower tier pays, e.g. 20ms (default 0)",
    )
    replay.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    replay.add_argument(
        "--block-size",
        type=int,
        metavar="TOKENS",
        help="tokens per block (default 512 for Mooncake traces, 16 for token-level ones)",
    )
    replay.add_argument("--json", action="store_true", help="print JSON instead of the table")
    replay.add_argument("--json-out", metavar="FILE", help="also write the JSON to FILE")
    replay.add_argument(
        "--plot", metavar="FILE.png", help="plot hit ratio against capacity (needs matplotlib)"
    )
    replay.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )
    cluster = replay.add_argument_group("several engines")
    cluster.add_argument(
        "--engines", type=int, metavar="N", help="replay over N engines, each with its own cache"
    )
    cluster.add_argument(
        "--route",
        nargs="+",
        action="extend",
        metavar="R",
        help="routing rules to compare: round-robin, least-loaded, prefix (default prefix)",
    )
    cluster.add_argument(
        "--load-cap",
        type=float,
        default=1.5,
        metavar="X",
        help="prefix routing passes over engines whose queue is over X times the shortest "
        "(default 1.5)",
    )
    cluster.add_argument(
        "--host-tier", metavar="C", help="each engine's own host tier (a capacity, as -c)"
    )
    cluster.add_argument(
        "--shared-tier", metavar="C", help="one tier every engine shares (a capacity, as -c)"
    )
    cluster.add_argument(
        "--service-rate",
        type=float,
        metavar="TOK/S",
        help="tokens per second one engine serves (default: 70%% busy on the trace uncached)",
    )
    cluster.add_argument(
        "--bytes-per-token",
        type=int,
        metavar="B",
        help="KV bytes per token, for the bytes fetched and the tier's load times "
        "(default 327680: a 70B GQA model, bf16)",
    )
    replay.set_defaults(func=run)
