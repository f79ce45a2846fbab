"""vLLM's CPU offloading tier with a disk tier below it: vLLM's own file tier against kvtier's.

What runs: vLLM 0.33's real scheduler-side offloading objects (the
``TieringOffloadingSpec`` from its spec factory: the CPU tier, its cache
policy, the tiering manager and the secondary tier), driven on the CPU the
way its offloading connector's scheduler drives them
(:class:`kvtier.integrations.vllm.driver.SchedulerDriver`). No GPU and no
model: a request's "computed" chunks are written into the CPU tier's memory
(each chunk starts with its own key, so every load is checked for the right
bytes) and vLLM cascades them to the secondary tier, whose reads and writes
are real files.

The workload is the Mooncake conversation trace (one chunk per 512-token
block id, a request's full blocks in order), replayed request by request:
a request looks its blocks up (stepping while a promotion or a background
lookup is pending, 1 ms per step as a stand-in for the forward pass), loads
the leading hits, stores the rest, finishes, and the step ends.

Configurations, all with the same CPU tier (``--cpu-percent`` of the unique
blocks, vLLM's LRU):

* CPU only;
* CPU + vLLM's ``fs`` tier (it has no size limit and never evicts);
* CPU + kvtier's disk tier sized to hold every block (the same capacity as
  ``fs``), LRU;
* CPU + kvtier's disk tier bounded at ``--disk-percent`` of the unique blocks,
  with LRU and S3-FIFO choosing what it keeps.

The garbage collector's heap is frozen once a configuration is set up, as
vLLM's engine core freezes it after start-up (``freeze_gc_heap``); otherwise a
full collection of the trace's objects (about 0.35 s here) lands in whichever
scheduler call happens to trigger it.

Reported: block hit ratio (and the part served from the disk tier), bytes
the process wrote (``wchar`` of /proc/self/io: every write() the replay's
threads made) and bytes left on disk, steps per request, and the scheduler
side's time: the sum of the manager calls in each step (mean, p99, max) and
the longest single call.

    python bench/vllm_tiers.py            # 1500 requests, about a minute a configuration
    python bench/vllm_tiers.py --quick    # 300 requests
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    CONVERSATION_TRACE,
    REPO,
    disk_bytes,
    format_markdown_table,
    format_table,
    git_state,
    log,
    machine_info,
    package_version,
    write_json,
)

from kvtier.replay import load_trace

DEFAULT_JSON = REPO / "bench" / "results" / "vllm_tiers.json"
STEP_SLEEP_S = 0.001


def wchar() -> int:
    """Bytes this process has passed to write() so far."""
    with open("/proc/self/io", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def replay(
    requests: list[list[int]],
    tiers: list[dict[str, Any]],
    cpu_chunks: int,
    chunk_bytes: int,
) -> dict[str, Any]:
    from kvtier.integrations.vllm.driver import HIT, SchedulerDriver, offload_key

    d = SchedulerDriver(tiers, cpu_chunks=cpu_chunks, chunk_bytes=chunk_bytes)
    # As vLLM's engine core does once it has started: what set-up allocated (here the
    # trace and the earlier configurations' leftovers) is never scanned by the
    # collector again, so a full collection does not land in a timed call.
    gc.collect()
    gc.freeze()
    looked = hits = from_disk = wrong = waits = 0
    written_before = wchar()
    start = time.perf_counter()
    for blocks in requests:
        keys = [offload_key(b) for b in blocks]
        ctx = d.request()
        first: dict[Any, Any] = {}
        n = d.resolve(ctx, keys, first)
        while n is None:
            waits += 1
            d.step()
            time.sleep(STEP_SLEEP_S)
            n = d.resolve(ctx, keys, first)
        looked += len(keys)
        hits += n
        from_disk += sum(1 for k in keys[:n] if first[k] is not HIT)
        for key, chunk in zip(keys[:n], d.load(ctx, keys[:n]), strict=True):
            wrong += chunk[: len(key)] != key
        d.store(ctx, {k: k.ljust(chunk_bytes, b"\0") for k in keys[n:]})
        d.finish(ctx)
        d.step()
    d.settle()
    wall = time.perf_counter() - start
    gc.unfreeze()
    written = wchar() - written_before
    steps = d.step_times
    tier_stats = [t.stats() for t in d.tiers if hasattr(t, "stats")]
    d.shutdown()
    ordered = sorted(steps)
    return {
        "blocks": looked,
        "hit_ratio": hits / looked if looked else 0.0,
        "disk_hit_ratio": from_disk / looked if looked else 0.0,
        "wrong_bytes": wrong,
        "bytes_written": written,
        "steps": len(steps),
        "wait_steps": waits,
        "step_mean_us": statistics.fmean(steps) * 1e6,
        "step_p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
        "step_max_us": ordered[-1] * 1e6,
        "sched_total_s": sum(steps),
        "longest_call_us": d.longest_call[0] * 1e6,
        "longest_call": d.longest_call[1],
        "wall_s": wall,
        "kvtier_tier": tier_stats[0] if tier_stats else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    ap.add_argument("--limit", type=int, default=1500, help="requests replayed")
    ap.add_argument("--cpu-percent", type=float, default=5.0,
                    help="CPU tier size, in percent of the unique blocks")
    ap.add_argument("--disk-percent", type=float, default=25.0,
                    help="the bounded kvtier disk tier's size, in percent of the unique blocks")
    ap.add_argument("--chunk-kib", type=int, default=8, help="bytes of one chunk, in KiB")
    ap.add_argument("--dir", type=Path, default=None, help="where the disk tiers write")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--quick", action="store_true", help="300 requests")
    args = ap.parse_args(argv)
    limit = 300 if args.quick else args.limit

    trace = load_trace(args.trace, limit=limit)
    requests = [r.full_keys(trace.block_size) for r in trace.requests]
    unique = len({k for r in requests for k in r})
    chunk_bytes = args.chunk_kib * 1024
    cpu_chunks = max(1, int(unique * args.cpu_percent / 100))
    disk_chunks = max(1, int(unique * args.disk_percent / 100))
    from kvtier.integrations.flat import FlatPages

    blob = FlatPages.make(chunk_bytes).blob_size
    base = Path(tempfile.mkdtemp(prefix="kvtier-vllm-tiers-", dir=args.dir))
    def kvtier(sub: str, chunks: int, policy: str) -> list[dict[str, Any]]:
        return [{
            "type": "KvTierSecondaryTier", "module_path": "kvtier.integrations.vllm.tiering",
            "url": f"disk:{base / sub}?size={chunks * blob}&policy={policy}", "workers": 8,
        }]

    # (name, secondary tiers, the directory they write under base)
    configs: list[tuple[str, list[dict[str, Any]], str | None]] = [
        ("CPU only", [], None),
        ("CPU + vLLM fs (no limit)", [{
            "type": "fs", "root_dir": str(base / "fs"), "n_read_threads": 4,
            "n_write_threads": 4,
        }], "fs"),
        ("CPU + kvtier disk (all blocks, lru)", kvtier("kv-all", unique + 1, "lru"), "kv-all"),
    ]
    for policy in ("lru", "s3fifo"):
        configs.append((
            f"CPU + kvtier disk ({args.disk_percent:g}%, {policy})",
            kvtier(f"kv-{policy}", disk_chunks, policy),
            f"kv-{policy}",
        ))

    log(f"{limit} requests, {sum(map(len, requests))} block lookups, {unique} unique blocks; "
        f"CPU tier {cpu_chunks} chunks of {chunk_bytes} B; bounded disk {disk_chunks} chunks")
    results: list[dict[str, Any]] = []
    try:
        for name, tiers, sub in configs:
            log(f"  {name} ...")
            out = replay(requests, tiers, cpu_chunks, chunk_bytes)
            out["disk_bytes"], out["disk_files"] = disk_bytes(base / sub) if sub else (0, 0)
            out["config"] = name
            results.append(out)
            log(f"    hit {out['hit_ratio']:.1%}, wrote {out['bytes_written'] / 2**20:.1f} MiB, "
                f"{out['wall_s']:.1f}s")
    finally:
        shutil.rmtree(base, ignore_errors=True)

    headers = ["configuration", "hit ratio", "from disk", "MiB written", "MiB on disk",
               "steps/req", "sched us/step mean", "p99", "max", "longest call us", "wrong"]
    rows = [
        [r["config"], f"{r['hit_ratio']:.1%}", f"{r['disk_hit_ratio']:.1%}",
         f"{r['bytes_written'] / 2**20:.1f}", f"{r['disk_bytes'] / 2**20:.1f}",
         f"{r['steps'] / limit:.2f}", f"{r['step_mean_us']:.0f}", f"{r['step_p99_us']:.0f}",
         f"{r['step_max_us']:.0f}", f"{r['longest_call_us']:.0f} ({r['longest_call']})",
         r["wrong_bytes"]]
        for r in results
    ]
    print(format_table(headers, rows))
    payload = {
        "benchmark": "vllm_tiers",
        "trace": str(args.trace.name),
        "requests": limit,
        "unique_blocks": unique,
        "cpu_chunks": cpu_chunks,
        "disk_chunks_bounded": disk_chunks,
        "chunk_bytes": chunk_bytes,
        "vllm": package_version("vllm"),
        "machine": machine_info(),
        "git": git_state(REPO),
        "results": results,
        "markdown": format_markdown_table(headers, rows),
    }
    write_json(args.json, payload)
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
