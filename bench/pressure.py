"""Memory pressure on a growing working set: the mode ladder against plain evict-on-full.

The workload is the Mooncake conversation trace (``--trace``): multi-turn
conversations whose prompts share prefixes, arriving at the trace's
timestamps. It runs through a :class:`~kvtier.KVCacheManager` of
``--blocks`` blocks in a step-synchronous scheduler like a serving engine's:

* one Mooncake block (512 tokens) is one kvtier block; the trace's block
  ids are the block keys, so shared conversation prefixes are cache hits;
* one step is ``--step-ms`` of trace time; every running request decodes 32
  tokens per step (one kvtier token, a new block every 512 tokens) until
  its ``output_length`` is reached, then it ends and its blocks stay cached;
* arrivals queue FIFO; at most ``--max-seqs`` run; a request that cannot
  get blocks waits; a running request that cannot grow is preempted (freed,
  requeued first, its prompt recomputed later, cached blocks reused).

Systems, on the same requests:

* ``off``: no pressure handling, evict on demand when the pool is full;
* ``delay``: a :class:`~kvtier.PressureController` over the pool-occupancy
  monitor (blocks held by requests), sampled once per step, default ladder
  (NORMAL 50%, PRESSURE 80%, CRITICAL 90%, EMERGENCY 97%, hysteresis 5%):
  PRESSURE/CRITICAL keep 5%/10% of the pool empty by evicting in LRU order,
  EMERGENCY holds new requests back (up to ``--max-wait-steps``, then they
  are rejected);
* ``reject``: the same, EMERGENCY refuses new requests at once.

Each runs twice: on the device pool alone, and with a host tier of
``--host-blocks`` blocks below it (``+ host``; write-back: every block the
device evicts, on demand or to a mode's target, is stored there, LRU; a
prompt's blocks past the device hit that the host tier holds are loaded,
not recomputed).

Printed per system: requests finished / rejected, prompt hit ratio (prompt
blocks found cached, of all prompt blocks admitted; with the host tier also
the share found on the device or the host), evictions (on demand and
to a target), preemptions, blocks recomputed after a preemption, admissions held back, queueing
delay, and for the pressure systems the share of steps in each mode and the
first mode changes. On a machine with an NVIDIA GPU and ``nvidia-ml-py``,
``--nvml`` also fills device memory with tensors step by step and prints
the NVML monitor's readings and modes.

Run ``python bench/pressure.py --help``. Results go to ``bench/results/pressure.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from _common import CONVERSATION_TRACE, REPO, format_table, git_state, machine_info, write_json

from kvtier import (
    AdmissionRejectedError,
    KVCacheManager,
    Mode,
    OutOfBlocksError,
    PoolMonitor,
    PressureController,
)
from kvtier.offload import OffloadingManager
from kvtier.pressure import PressureSpec
from kvtier.replay import TraceRequest, load_trace

BLOCK = 16  #: kvtier tokens per block; one Mooncake block of 512 tokens
SCALE = 512 // BLOCK  #: trace tokens per kvtier token
SYSTEMS = ("off", "delay", "reject")


@dataclasses.dataclass
class _Req:
    rid: int
    req: TraceRequest
    arrival: int
    keys: list[int]
    tokens: list[int]
    decode_left: int
    admitted_at: int | None = None
    held_back: bool = False


@dataclasses.dataclass
class Result:
    system: str
    host_blocks: int = 0
    finished: int = 0
    rejected: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    host_hit_blocks: int = 0
    demoted_blocks: int = 0
    evictions: int = 0
    pressure_evictions: int = 0
    preemptions: int = 0
    recomputed_blocks: int = 0
    held_back: int = 0
    queue_steps: list[int] = dataclasses.field(default_factory=list)
    steps: int = 0
    mode_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Mode changes: (step, old, new, fraction in use).
    timeline: list[tuple[int, str, str, float]] = dataclasses.field(default_factory=list)
    #: One letter per step (R, N, P, C, E): the mode the step ran in.
    strip: str = ""
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.system} + host" if self.host_blocks else self.system

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def reuse_ratio(self) -> float:
        """Prompt blocks found on the device or in the host tier."""
        hits = self.hit_blocks + self.host_hit_blocks
        return hits / self.prompt_blocks if self.prompt_blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        q = sorted(self.queue_steps)
        d.pop("queue_steps")
        d["hit_ratio"] = self.hit_ratio
        d["reuse_ratio"] = self.reuse_ratio
        d["queue_steps_mean"] = sum(q) / len(q) if q else 0.0
        d["queue_steps_p99"] = q[min(len(q) - 1, math.ceil(0.99 * len(q)) - 1)] if q else 0
        return d


def _controller(mgr: KVCacheManager, system: str) -> PressureController | None:
    if system == "off":
        return None
    ladder = PressureSpec(
        monitor="pool", emergency="delay" if system == "delay" else "reject"
    ).ladder()
    ctrl = PressureController(PoolMonitor(mgr.pool), ladder)
    mgr.set_pressure_gate(ctrl)
    return ctrl


def simulate(
    requests: list[TraceRequest],
    system: str,
    *,
    blocks: int,
    step_ms: float,
    max_seqs: int,
    max_wait_steps: int,
    host_blocks: int,
    progress: bool,
) -> Result:
    mgr = KVCacheManager(blocks, BLOCK, policy="lru")
    ctrl = _controller(mgr, system)
    res = Result(system, host_blocks)
    host = OffloadingManager(host_blocks, "lru", enable_events=False) if host_blocks else None
    if host is not None:
        # Write-back, as the tier chain does: evicted blocks go to host memory.
        def demote(keys: list[int], _blocks: list[int]) -> None:
            out = host.prepare_store(keys)
            if out is not None:
                host.complete_store(out.keys_to_store)
                res.demoted_blocks += len(out.keys_to_store)

        mgr.add_evict_listener(demote)
    started = time.perf_counter()
    pending = deque(
        _Req(
            i,
            r,
            int((r.timestamp or 0.0) / step_ms),
            r.full_keys(512),
            [0] * (len(r.full_keys(512)) * BLOCK) + [1],  # one tail token: every block hittable
            max(math.ceil(r.output_length / SCALE), 1),
        )
        for i, r in enumerate(requests)
    )
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    step = 0
    total = len(pending)
    mode_steps: Counter[str] = Counter()
    strip: list[str] = []
    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        if ctrl is not None:
            old = ctrl.mode
            ctrl.sample()  # one reading per step: deterministic, and never inside allocate
            if ctrl.mode is not old:
                res.timeline.append((step, old.name, ctrl.mode.name, round(ctrl.fraction, 4)))
            mode_steps[ctrl.mode.name] += 1
            strip.append(ctrl.mode.name[0])
        # Admit in FIFO order while there is room.
        while waiting and len(running) < max_seqs:
            r = waiting[0]
            try:
                alloc = mgr.allocate(r.rid, r.tokens, block_keys=r.keys)
            except OutOfBlocksError:
                if not running:  # can never fit: drop it rather than stall the queue
                    waiting.popleft()
                    res.rejected += 1
                    continue
                break
            except AdmissionRejectedError as exc:
                if not r.held_back:
                    r.held_back = True
                    res.held_back += 1
                if exc.retry and step - r.arrival < max_wait_steps:
                    break
                waiting.popleft()
                res.rejected += 1
                continue
            waiting.popleft()
            n = len(r.keys)
            hit = alloc.num_cached_tokens // BLOCK
            loaded = 0
            if host is not None and hit < n:
                loaded = host.lookup(r.keys[hit:]) or 0
                if loaded:
                    host.touch(r.keys[hit : hit + loaded])
            res.prompt_blocks += n
            res.hit_blocks += hit
            res.host_hit_blocks += loaded
            if r.admitted_at is None:
                r.admitted_at = step
                res.queue_steps.append(step - r.arrival)
            else:
                res.recomputed_blocks += n - hit - loaded
            running.append(r)
        # Decode one kvtier token (32 trace tokens) for every running request.
        for r in list(running):
            if r.decode_left <= 0:
                continue
            try:
                mgr.extend(r.rid, [2])
            except OutOfBlocksError:
                mgr.free(r.rid)
                running.remove(r)
                waiting.appendleft(r)
                res.preemptions += 1
                continue
            r.decode_left -= 1
        for r in [r for r in running if r.decode_left <= 0]:
            mgr.free(r.rid)
            running.remove(r)
            res.finished += 1
        step += 1
        if progress and step % 200 == 0:
            done = res.finished + res.rejected
            print(f"\r  {system}: step {step}, {done}/{total} done", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    mgr.check()
    s = mgr.stats()
    res.evictions = s.evictions
    res.pressure_evictions = s.pressure_evictions
    res.steps = step
    res.seconds = time.perf_counter() - started
    if ctrl is not None:
        res.mode_steps = dict(mode_steps)
        res.strip = "".join(strip)
    return res


def nvml_fill(step_gib: float, limit_gib: float) -> list[dict[str, Any]]:
    """Fill a GPU with tensors and record what the NVML monitor and the ladder say."""
    import torch

    from kvtier.pressure import NvmlMonitor

    ctrl = PressureController(NvmlMonitor(0))
    ctrl.sample()
    rows = []
    held = []
    try:
        while sum(t.numel() for t in held) / 2**30 < limit_gib:
            try:
                held.append(torch.empty(int(step_gib * 2**30), dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                rows.append({"allocated_gib": None, "event": "torch OOM"})
                break
            torch.cuda.synchronize()
            ctrl.sample()
            r = ctrl.monitor.read()
            rows.append(
                {
                    "allocated_gib": round(sum(t.numel() for t in held) / 2**30, 2),
                    "used_gib": round(r.used / 2**30, 2),
                    "total_gib": round(r.total / 2**30, 2),
                    "fraction": round(r.fraction, 4),
                    "mode": ctrl.mode.name,
                }
            )
    finally:
        held.clear()
        torch.cuda.empty_cache()
        ctrl.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=CONVERSATION_TRACE, help="Mooncake JSONL trace")
    p.add_argument("--requests", type=int, default=0, help="first N requests (0: all)")
    p.add_argument("--blocks", type=int, default=1024, help="pool size in blocks (default 1024)")
    p.add_argument("--step-ms", type=float, default=1000.0, help="trace ms per step (1000)")
    p.add_argument("--max-seqs", type=int, default=64, help="requests running at once (64)")
    p.add_argument(
        "--max-wait-steps", type=int, default=30, help="delay bound before rejecting (30 steps)"
    )
    p.add_argument(
        "--host-blocks",
        type=int,
        default=8192,
        help="host tier size for the '+ host' runs (default 8192; 0: no tier runs)",
    )
    p.add_argument("--nvml", action="store_true", help="also fill a GPU and read NVML")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pressure.json")
    args = p.parse_args()
    trace = load_trace(args.trace)
    if trace.format != "mooncake":
        raise SystemExit("this benchmark expects a Mooncake trace (block ids per request)")
    requests = trace.requests[: args.requests or None]
    print(
        f"{len(requests)} requests of {trace.name}, {trace.unique_blocks} distinct blocks; "
        f"pool {args.blocks} blocks, step {args.step_ms:g} ms, max {args.max_seqs} running"
    )
    results = [
        simulate(
            requests,
            system,
            blocks=args.blocks,
            step_ms=args.step_ms,
            max_seqs=args.max_seqs,
            max_wait_steps=args.max_wait_steps,
            host_blocks=host,
            progress=not args.no_progress,
        )
        for host in sorted({0, args.host_blocks})
        for system in SYSTEMS
    ]
    rows = []
    for r in results:
        d = r.as_dict()
        rows.append(
            [
                r.label,
                r.finished,
                r.rejected,
                f"{r.hit_ratio:.4f}",
                f"{r.reuse_ratio:.4f}" if r.host_blocks else "-",
                r.evictions - r.pressure_evictions,
                r.pressure_evictions,
                r.preemptions,
                r.recomputed_blocks,
                r.held_back,
                f"{d['queue_steps_mean']:.2f}",
                d["queue_steps_p99"],
            ]
        )
    headers = [
        "system",
        "finished",
        "rejected",
        "device hit",
        "device+host hit",
        "evict (demand)",
        "evict (target)",
        "preempt",
        "recomputed blk",
        "held back",
        "queue mean",
        "queue p99",
    ]
    print(format_table(headers, rows))
    for r in results:
        if r.mode_steps:
            share = ", ".join(
                f"{m.name} {100 * r.mode_steps.get(m.name, 0) / r.steps:.1f}%" for m in Mode
            )
            print(f"{r.label}: steps per mode: {share}; {len(r.timeline)} mode changes")
            first = "; ".join(f"step {t} {a}->{b} ({f:.3f})" for t, a, b, f in r.timeline[:6])
            print(f"  first changes: {first}")
            width = 100
            chunk = max(len(r.strip) // width, 1)
            # Each character: the highest mode within its run of steps.
            order = "RNPCE"
            line = "".join(
                max(r.strip[i : i + chunk], key=order.index) for i in range(0, len(r.strip), chunk)
            )
            print(f"  timeline ({chunk} steps per char, highest mode): {line}")
    payload: dict[str, Any] = {
        "benchmark": "pressure",
        "machine": machine_info(),
        "git": git_state(REPO),
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": [r.as_dict() for r in results],
    }
    if args.nvml:
        try:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            payload["nvml"] = nvml_fill(4.0, 60.0)
            for row in payload["nvml"]:
                print(row)
        except Exception as exc:  # report and go on: the CPU part stands alone
            print(f"--nvml skipped: {type(exc).__name__}: {exc}")
            payload["nvml"] = f"skipped: {exc}"
    write_json(args.out, payload)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
