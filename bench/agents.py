"""Agent workloads: the workflow policy against LRU and MIN, and an agent loop in the engine.

Part one replays the agent workloads of :mod:`kvtier.agents.workloads`
through kvtier's own cache code (:mod:`kvtier.replay.simulator`):

* ``cyclic``: one deterministic loop of 10 agents with 512-token prompts, the
  cache holding 6 prompts;
* ``synthetic``: 16 concurrent workflows (sequential, fan-out/fan-in, cyclic;
  4-8 agents with 500-4,000-token prompts, 6 runs each);
* ``tools``: 60 tool-calling sessions (log-normal tool latency, median 3 s,
  hinted ``cache_ttl_s`` within 50% of the truth); ``tools-busy``: 200
  sessions arriving 7x as often;
* ``mooncake``: the Mooncake conversation trace (``shared/traces``) with
  sessions inferred from shared prefixes.

Each at a cache of a third and a tenth of the trace's unique blocks (the
cyclic loop: 6 of its 10 prompts), in the ``prefix`` model (a real
:class:`~kvtier.manager.KVCacheManager`, what serving sees) and the
``block`` model. Per policy: the token hit ratio and the re-prefilled
tokens, prompt tokens an unbounded cache would have served that this one
computed again. MIN is Belady's optimum over the same block accesses.

Part two runs a 4-agent loop on the real model (SmolLM2-135M-Instruct) in the
reference engine: each step's prompt is the agent's fixed prompt
(``--prompt-tokens``) plus fresh tokens, and generates one token; the device
holds about 2.4 requests (``--device-blocks``). Configurations: LRU without
hints, the workflow policy with hints, LRU over a host tier, and the
workflow policy with hints over a host tier with prefetch (lookahead 1).
Between steps the loop waits for prefetches in flight (the client's think
time). Reported per configuration: the median TTFT of the steps after the
first round, the share of those steps whose agent prompt was already on the
device when the request came ("warm"), and the cached prompt tokens.

Part three runs interleaved tool-calling sessions on the same model
(``--tool-sessions``, ``--tool-turns``, ``--tool-device-blocks``): a shared
system prompt, a user message, then turns that append the model's reply and a
tool result after a log-normal tool latency, each request hinted with its
``session_id`` and a ``cache_ttl_s`` within 50% of the truth (not on the
last turn). Requests run one at a time on a simulated clock shared with the
cache, so a TTFT is the request's own prefill and tier loads. Configurations:
LRU and the workflow policy with hints, each without and with a disk tier.
Reported: the median TTFT of the turns after the first, and the prompt tokens
per turn served from the device and loaded from the disk.

``--speed`` instead measures replay speed alone: block accesses replayed per
second by the workflow policy and by LRU, in the same run, on the goals'
workloads (tool sessions with exact, lying and no hints, the cyclic
workflow, concurrent workflows), best of ``--repeats`` runs each, and writes
``bench/results/agents_speed.json``.

Run ``python bench/agents.py --help``; ``--quick`` is a short smoke run.
Results go to ``bench/results/agents.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
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
    median,
    write_json,
)

from kvtier.agents import workloads as W
from kvtier.replay.bounds import cyclic_prefix_bound
from kvtier.replay.simulator import Model, simulate, simulate_min
from kvtier.replay.traces import Trace, load_trace

POLICIES = ("lru", "workflow", "MIN")


def _workloads(quick: bool, tmp: Path) -> dict[str, Trace]:
    def load(name: str, lines: list[dict[str, Any]], bs: int = W.BLOCK_SIZE) -> Trace:
        return load_trace(W.write_trace(lines, tmp / f"{name}.jsonl"), block_size=bs)

    out = {
        "cyclic": load("cyclic", W.cyclic_workflow(10, 512, rounds=8)),
        "synthetic": load("synthetic", W.synthetic_workflows(4 if quick else 16)),
        "tools": load("tools", W.tool_sessions(20 if quick else 60)),
        "tools-busy": load("tools-busy", W.tool_sessions(60 if quick else 200, arrival_s=0.3)),
    }
    if CONVERSATION_TRACE.exists():
        with CONVERSATION_TRACE.open() as fh:
            raw = [json.loads(line) for line in fh if line.strip()]
        out["mooncake"] = load("mooncake", W.mooncake_sessions(raw[: 1000 if quick else None]), 512)
    else:
        log(f"{CONVERSATION_TRACE} not found: the mooncake rows are skipped")
    return out


def replay_rows(quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, trace in _workloads(quick, Path(tmp)).items():
            if name == "cyclic":
                sizes = [("6 of 10 prompts", 6 * 512 // W.BLOCK_SIZE)]
            else:
                sizes = [(f"1/{d}", max(1, trace.unique_blocks // d)) for d in (3, 10)]
            models: tuple[Model, ...] = ("prefix", "block")
            for model in models:
                unbounded = simulate(trace, "lru", trace.unique_blocks + 1, model).cached_tokens
                for label, cap in sizes:
                    log(f"replay {name} {model} {label}")
                    row: dict[str, Any] = {
                        "workload": name, "model": model, "cache": label, "capacity_blocks": cap,
                        "requests": len(trace.requests), "unique_blocks": trace.unique_blocks,
                    }  # fmt: skip
                    for p in POLICIES:
                        r = (
                            simulate_min(trace, cap, model)
                            if p == "MIN"
                            else simulate(trace, p, cap, model)
                        )
                        row[f"{p}_hit"] = r.token_hit_ratio
                        row[f"{p}_reprefill"] = max(unbounded - r.cached_tokens, 0)
                    rows.append(row)
    return rows


def _ratio(a: int, b: int) -> str:
    return "-" if b == 0 else f"{a / b:.2f}x"


def replay_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[object]]]:
    headers = [
        "workload", "model", "cache", "LRU hit", "workflow hit", "MIN hit",
        "LRU re-prefill", "workflow re-prefill", "MIN re-prefill", "workflow/LRU",
    ]  # fmt: skip
    out: list[list[object]] = []
    for r in rows:
        out.append([
            r["workload"], r["model"], r["cache"],
            *(f"{r[f'{p}_hit']:.3f}" for p in POLICIES),
            *(f"{r[f'{p}_reprefill']:,}" for p in POLICIES),
            _ratio(r["workflow_reprefill"], r["lru_reprefill"]),
        ])  # fmt: skip
    return headers, out


# -- the goals: several seeds of each shape ---------------------------------------------------

GOAL_SEEDS = (0, 1, 2)


def _strip(lines: list[dict[str, Any]], mode: str, seed: int) -> list[dict[str, Any]]:
    """No hints, random TTLs (lying), each TTL off by a random 2-10x either way (wrong),
    or each request's hints from 50 requests earlier (stale)."""
    import random

    rng = random.Random(seed)
    reqs = [line for line in lines if "hash_ids" in line]
    out = [line for line in lines if "hash_ids" not in line]
    names = ("session_id", "cache_ttl_s", "workflow_id", "agent_id", "step", "reuse")
    for i, line in enumerate(reqs):
        base = {k: v for k, v in line.items() if k not in names}
        if mode == "random":
            base["session_id"] = line.get("session_id", f"r{rng.randrange(50)}")
            base["cache_ttl_s"] = round(rng.uniform(0, 60), 3)
        elif mode == "wrong":
            base.update({k: v for k, v in line.items() if k in names})
            if line.get("cache_ttl_s"):
                factor = rng.uniform(2.0, 10.0) ** rng.choice((-1, 1))
                base["cache_ttl_s"] = round(line["cache_ttl_s"] * factor, 3)
        elif mode == "stale":
            base.update({k: v for k, v in reqs[max(0, i - 50)].items() if k in names})
        out.append(base)
    return out


def goal_rows(quick: bool) -> list[dict[str, Any]]:
    """The workflow policy against its goals, per seed (prefix model, what serving sees)."""
    rows: list[dict[str, Any]] = []
    seeds = GOAL_SEEDS[:1] if quick else GOAL_SEEDS
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            shapes: list[tuple[str, list[dict[str, Any]], int, str]] = [
                ("cyclic+suffix", W.cyclic_workflow(
                    10, 512, rounds=8, suffix_tokens=32, answer_tokens=(8, 40), seed=seed
                ), 6 * 512 // W.BLOCK_SIZE, "min"),
            ]  # fmt: skip
            tools = W.tool_sessions(
                100 if quick else 300, arrival_s=1.0, tool_latency_median_s=10.0,
                system_tokens=800, tool_result_tokens=(50, 400), seed=seed,
            )  # fmt: skip
            shapes += [
                ("tools", tools, 1000, "gap"),
                ("tools, lying TTLs", _strip(tools, "random", seed), 1000, "lie"),
                ("tools, TTLs off 2-10x", _strip(tools, "wrong", seed), 1000, "lie"),
                ("tools, stale hints", _strip(tools, "stale", seed), 1000, "lie"),
                ("tools, no hints", _strip(tools, "none", seed), 1000, "same"),
            ]
            for name, lines, cap, goal in shapes:
                log(f"goals: {name}, seed {seed}")
                path = W.write_trace(lines, Path(tmp) / "goal.jsonl")
                trace = load_trace(path, block_size=W.BLOCK_SIZE)
                wf = simulate(trace, "workflow", cap, "prefix")
                lru = simulate(trace, "lru", cap, "prefix").token_hit_ratio
                mn = simulate_min(trace, cap, "prefix").token_hit_ratio
                fb = simulate(trace, "learned-reuse", cap, "prefix").token_hit_ratio
                # The most any policy can hit while holding each running request.
                bound = cyclic_prefix_bound(trace, cap) if goal == "min" else None
                w = wf.token_hit_ratio
                if goal == "min":
                    score, target, met = w / mn if mn else 0.0, ">= 95% of MIN", w >= 0.95 * mn
                elif goal == "gap":
                    score = (w - lru) / (mn - lru) if mn > lru else 0.0
                    target, met = ">= 50% of the LRU->MIN gap", score >= 0.5
                elif goal == "lie":
                    score, target, met = w / lru if lru else 0.0, ">= 90% of LRU", w >= 0.9 * lru
                else:
                    score, target, met = w / lru if lru else 0.0, "= LRU", w == lru
                rows.append({
                    "workload": name, "seed": seed, "capacity_blocks": cap, "workflow": w,
                    "lru": lru, "min": mn, "learned_reuse": fb, "score": score, "goal": target,
                    "met": met, "workflow_accesses_per_s": wf.ops_per_s,
                    "prefix_model_bound": bound,
                })  # fmt: skip
    return rows


def goal_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[object]]]:
    headers = [
        "workload", "seed", "workflow", "LRU", "MIN", "bound (prefix model)",
        "fallback (learned-reuse)", "score", "goal", "met?", "workflow M acc/s",
    ]  # fmt: skip
    return headers, [
        [r["workload"], r["seed"], f"{r['workflow']:.3f}", f"{r['lru']:.3f}", f"{r['min']:.3f}",
         "" if r["prefix_model_bound"] is None else f"{r['prefix_model_bound']:.3f}",
         f"{r['learned_reuse']:.3f}", f"{100 * r['score']:.0f}%", r["goal"],
         "yes" if r["met"] else "NO", f"{r['workflow_accesses_per_s'] / 1e6:.2f}"]
        for r in rows
    ]  # fmt: skip


# -- replay speed --------------------------------------------------------------------------

SPEED_POLICIES = ("workflow", "lru")


def speed_rows(quick: bool, repeats: int) -> list[dict[str, Any]]:
    """Accesses/s of the workflow policy and LRU on the same traces (prefix model), best of N."""
    tools = W.tool_sessions(
        100 if quick else 300, arrival_s=1.0, tool_latency_median_s=10.0,
        system_tokens=800, tool_result_tokens=(50, 400), seed=0,
    )  # fmt: skip
    shapes: list[tuple[str, list[dict[str, Any]], int]] = [
        ("tools", tools, 1000),
        ("tools, lying TTLs", _strip(tools, "random", 0), 1000),
        ("tools, no hints", _strip(tools, "none", 0), 1000),
        ("cyclic+suffix", W.cyclic_workflow(
            10, 512, rounds=8, suffix_tokens=32, answer_tokens=(8, 40), seed=0
        ), 6 * 512 // W.BLOCK_SIZE),
        ("synthetic", W.synthetic_workflows(4 if quick else 16, seed=0), 2000),
    ]  # fmt: skip
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, lines, cap in shapes:
            path = W.write_trace(lines, Path(tmp) / "speed.jsonl")
            trace = load_trace(path, block_size=W.BLOCK_SIZE)
            row: dict[str, Any] = {
                "workload": name, "capacity_blocks": cap, "requests": len(trace.requests),
            }  # fmt: skip
            log(f"speed: {name}")
            # The policies take turns within each repeat, so both see the same load.
            for _ in range(repeats):
                for p in SPEED_POLICIES:
                    r = simulate(trace, p, cap, "prefix")
                    key = f"{p}_accesses_per_s"
                    row[key] = max(row.get(key, 0.0), r.ops_per_s)
                    row[f"{p}_hit"] = r.token_hit_ratio
                    row["block_accesses"] = r.block_accesses
            row["workflow_over_lru"] = row["workflow_accesses_per_s"] / row["lru_accesses_per_s"]
            rows.append(row)
    return rows


def speed_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[object]]]:
    headers = [
        "workload", "accesses", "workflow M acc/s", "LRU M acc/s", "workflow/LRU",
        "workflow hit", "LRU hit",
    ]  # fmt: skip
    return headers, [
        [r["workload"], f"{r['block_accesses']:,}", f"{r['workflow_accesses_per_s'] / 1e6:.3f}",
         f"{r['lru_accesses_per_s'] / 1e6:.3f}", f"{r['workflow_over_lru']:.2f}x",
         f"{r['workflow_hit']:.3f}", f"{r['lru_hit']:.3f}"]
        for r in rows
    ]  # fmt: skip


def _compiled() -> bool:
    import kvtier.pool

    return str(kvtier.pool.__file__).endswith(".so")


# -- the engine loop ------------------------------------------------------------------------

AGENTS = ("plan", "code", "test", "review")
CONFIGS: tuple[tuple[str, str, bool, bool, bool], ...] = (
    # label, policy, hints, host tier, prefetch
    ("LRU, no hints", "lru", False, False, False),
    ("workflow, hints", "workflow", True, False, False),
    ("LRU, no hints, host tier", "lru", False, True, False),
    ("workflow, hints, host tier, prefetch", "workflow", True, True, True),
)


def engine_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from kvtier.agents import sequential
    from kvtier.engine import Engine, SamplingParams
    from kvtier.engine.model import load_model
    from kvtier.offload.chain import Tier
    from kvtier.offload.host import HostStore

    if args.threads:
        torch.set_num_threads(args.threads)
    log("loading the model ...")
    loaded = load_model(None)
    model, tok = loaded.model, loaded.tokenizer
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    prompts = {a: torch.randint(100, vocab - 100, (args.prompt_tokens,), generator=g).tolist()
               for a in AGENTS}  # fmt: skip
    one = SamplingParams(max_tokens=1, temperature=0.0)
    rows: list[dict[str, Any]] = []
    bs = 16
    for label, policy, hinted, tier, prefetch in CONFIGS:
        log(f"engine: {label}")
        eng = Engine(
            model, tok, model_id=loaded.model_id, block_size=bs, num_blocks=args.device_blocks,
            policy=policy, tiers=[Tier(HostStore(), 4096)] if tier else (),
        )  # fmt: skip
        spec = sequential("loop", list(AGENTS), cyclic=True)
        agents = tuple(replace(a, prefix_tokens=tuple(prompts[a.agent_id])) for a in spec.agents)
        spec = replace(spec, agents=agents)
        eng.agents.register(spec)
        if prefetch:
            eng.agents.enable_prefetch(lookahead=1)
        ttfts: list[float] = []
        warm: list[bool] = []
        cached: list[int] = []
        step = 0
        with torch.no_grad():
            for rnd in range(args.rounds):
                for a in AGENTS:
                    pf = eng.agents.prefetcher
                    while pf is not None and pf.busy:
                        pf.finish(wait=True)
                    keys = eng.manager.hasher.chain(prompts[a])
                    on_device = len(eng.manager.pool.lookup(keys)) == len(keys)
                    fresh = torch.randint(100, vocab - 100, (32,), generator=g).tolist()
                    hints = {"workflow_id": "loop", "agent_id": a, "step": step} if hinted else None
                    rid = eng.add_request(prompts[a] + fresh, one, hints=hints)
                    m = None
                    while eng.has_unfinished():
                        for out in eng.step():
                            if out.request_id == rid and out.finished:
                                if out.error is not None:
                                    raise RuntimeError(f"{label}, step {step}: {out.error}")
                                m = out.metrics
                    if pf is not None:
                        pf.poll()
                    step += 1
                    assert m is not None and m.ttft is not None
                    if rnd > 0:  # the first round is cold everywhere
                        ttfts.append(m.ttft)
                        warm.append(on_device)
                        cached.append(m.cached_tokens)
        eng.manager.check()
        eng.close()
        rows.append({
            "config": label, "steps": len(ttfts), "median_ttft_s": median(ttfts),
            "ttft_s": ttfts, "warm": sum(warm) / len(warm),
            "mean_cached_tokens": sum(cached) / len(cached),
        })  # fmt: skip
    return rows


# -- tool sessions in the engine, over a disk tier ---------------------------------------------

TOOL_CONFIGS: tuple[tuple[str, str, bool, bool], ...] = (
    # label, policy, hints, disk tier
    ("LRU, no hints", "lru", False, False),
    ("workflow, session + TTL hints", "workflow", True, False),
    ("LRU, no hints, disk tier", "lru", False, True),
    ("workflow, session + TTL hints, disk tier", "workflow", True, True),
)


def _loaded_blocks(chain: Any) -> int:
    """Blocks loaded from every tier so far (0 without tiers)."""
    if chain is None:
        return 0
    return int(sum(t["loaded_blocks"] for t in chain.stats().values()))


def tool_engine_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Interleaved tool-calling sessions on the real model over a disk tier.

    Each session: a shared system prompt, its own user message, then turns that
    append the model's reply and a tool result after a tool call of log-normal
    latency (the hint names it within +-50%, as an application's estimate would).
    The device holds a couple of sessions; with a disk tier, what it evicts
    goes there.
    Requests run one at a time in order of arrival on a simulated clock (the
    cache's clock too, so TTLs mean the same as in the replay), so a TTFT is the
    request's own prefill and tier loads, not queueing. Per configuration: the
    median TTFT of the turns after each session's first, and the prompt tokens
    served from the device and loaded from the disk per such turn.
    """
    import random

    import torch

    from kvtier.engine import Engine, SamplingParams
    from kvtier.engine.model import load_model
    from kvtier.offload.chain import Tier
    from kvtier.offload.disk import DiskStore

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(None)
    model, tok = loaded.model, loaded.tokenizer
    vocab = int(model.config.vocab_size)
    rng = random.Random(0)
    system = [rng.randrange(100, vocab - 100) for _ in range(192)]
    sessions: list[dict[str, Any]] = []
    for i in range(args.tool_sessions):
        user = [rng.randrange(100, vocab - 100) for _ in range(96)]
        results, pauses, ttls = [], [], []
        for _ in range(args.tool_turns - 1):
            results.append([rng.randrange(100, vocab - 100) for _ in range(rng.randint(48, 128))])
            pause = rng.lognormvariate(0.0, 1.0)
            pauses.append(pause)
            ttls.append(round(pause * rng.uniform(0.5, 1.5), 3))
        sessions.append({"start": 0.5 * i, "user": user, "results": results,
                         "pauses": pauses, "ttls": ttls})  # fmt: skip
    gen = SamplingParams(max_tokens=8, temperature=0.0)
    rows: list[dict[str, Any]] = []
    for label, policy, hinted, on_disk in TOOL_CONFIGS:
        log(f"engine, tool sessions: {label}")
        with tempfile.TemporaryDirectory() as disk:
            eng = Engine(
                model, tok, model_id=loaded.model_id, block_size=16,
                num_blocks=args.tool_device_blocks, policy=policy,
                tiers=[Tier(DiskStore(disk), 8192)] if on_disk else (),
            )  # fmt: skip
            chain = eng.tier_chain
            clock = [0.0]
            eng.manager.clock = lambda c=clock: c[0]
            # Per session: its conversation so far, its turn, when its next request comes.
            state = [{"tokens": system + s["user"], "turn": 0, "due": s["start"]} for s in sessions]
            ttfts: list[float] = []
            device_tokens: list[int] = []
            disk_tokens: list[int] = []
            with torch.no_grad():
                while True:
                    due = [(st["due"], i) for i, st in enumerate(state) if st["due"] is not None]
                    if not due:
                        break
                    clock[0], i = min(due)
                    st, s = state[i], sessions[i]
                    turn = st["turn"]
                    last = turn + 1 >= args.tool_turns
                    hints: dict[str, Any] | None = None
                    if hinted:
                        hints = {"session_id": f"s{i}"}
                        if not last:
                            hints["cache_ttl_s"] = s["ttls"][turn]
                    before = _loaded_blocks(chain)
                    rid = eng.add_request(list(st["tokens"]), gen, hints=hints)
                    reply: list[int] = []
                    m = None
                    while eng.has_unfinished():
                        for out in eng.step():
                            if out.request_id != rid:
                                continue
                            reply += out.token_ids
                            if out.finished:
                                if out.error is not None:
                                    raise RuntimeError(f"{label}: {out.error}")
                                m = out.metrics
                    if turn > 0 and m is not None and m.ttft is not None:
                        from_disk = 16 * (_loaded_blocks(chain) - before)
                        ttfts.append(m.ttft)
                        disk_tokens.append(from_disk)
                        device_tokens.append(max(0, m.cached_tokens - from_disk))
                    if last:
                        st["due"] = None
                        continue
                    st["tokens"] = st["tokens"] + reply
                    st["tokens"] += s["results"][turn]
                    st["turn"] = turn + 1
                    st["due"] = clock[0] + 0.2 + s["pauses"][turn]
            eng.manager.check()
            eng.close()
        rows.append({
            "config": label, "turns": len(ttfts), "median_ttft_s": median(ttfts),
            "ttft_s": ttfts, "device_tokens_per_turn": sum(device_tokens) / len(ttfts),
            "disk_tokens_per_turn": sum(disk_tokens) / len(ttfts),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small workloads, 2 rounds")
    ap.add_argument("--no-engine", action="store_true", help="the replay table only")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="each agent's fixed prompt")
    ap.add_argument("--device-blocks", type=int, default=44, help="device blocks of 16 tokens")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the engine loop")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--tool-sessions", type=int, default=8, help="sessions of the engine's tool run"
    )
    ap.add_argument("--tool-turns", type=int, default=4, help="turns per tool session")
    ap.add_argument(
        "--tool-device-blocks", type=int, default=96, help="device blocks of the tool run"
    )
    ap.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    ap.add_argument(
        "--speed", action="store_true", help="replay speed only: workflow vs LRU accesses/s"
    )
    ap.add_argument("--repeats", type=int, default=3, help="--speed: runs per policy (best kept)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON file to write")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 2
    if args.speed:
        speed = speed_rows(args.quick, max(1, args.repeats))
        s_headers, s_table = speed_table(speed)
        compiled = _compiled()
        print(f"replay speed, prefix model, best of {args.repeats} "
              f"({'compiled' if compiled else 'pure Python'} hot paths)")  # fmt: skip
        print(format_table(s_headers, s_table))
        if args.markdown:
            print()
            print(format_markdown_table(s_headers, s_table))
        write_json(args.out or REPO / "bench" / "results" / "agents_speed.json", {
            "benchmark": "agents-speed", "args": {k: str(v) for k, v in vars(args).items()},
            "compiled": compiled, "speed": speed, "machine": machine_info(),
            "git": git_state(REPO),
        })  # fmt: skip
        return 0
    if args.out is None:
        args.out = REPO / "bench" / "results" / "agents.json"
    goals = goal_rows(args.quick)
    g_headers, g_table = goal_table(goals)
    print("goals: token hit ratio in the prefix model (a real KVCacheManager)")
    print(format_table(g_headers, g_table))
    rows = replay_rows(args.quick)
    headers, table = replay_table(rows)
    print("replay: token hit ratio and re-prefilled tokens (unbounded cache's hits - these)")
    print(format_table(headers, table))
    engine: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    if not args.no_engine:
        engine = engine_rows(args)
        e_headers = ["configuration", "steps", "median TTFT ms", "warm", "cached tokens/step"]
        e_table: list[list[object]] = [
            [r["config"], r["steps"], f"{1000 * r['median_ttft_s']:.1f}",
             f"{100 * r['warm']:.0f}%", f"{r['mean_cached_tokens']:.0f}"]
            for r in engine
        ]  # fmt: skip
        print(f"\nengine: 4-agent loop, {args.prompt_tokens}-token prompts, "
              f"{args.device_blocks} device blocks, rounds 2-{args.rounds}")  # fmt: skip
        print(format_table(e_headers, e_table))
        tools = tool_engine_rows(args)
        t_headers = ["configuration", "turns", "median TTFT ms", "device tokens/turn",
                     "disk tokens/turn"]  # fmt: skip
        t_table: list[list[object]] = [
            [r["config"], r["turns"], f"{1000 * r['median_ttft_s']:.1f}",
             f"{r['device_tokens_per_turn']:.0f}", f"{r['disk_tokens_per_turn']:.0f}"]
            for r in tools
        ]  # fmt: skip
        print(f"\nengine: {args.tool_sessions} interleaved tool sessions, {args.tool_turns} turns, "
              f"{args.tool_device_blocks} device blocks, turns 2-")  # fmt: skip
        print(format_table(t_headers, t_table))
    if args.markdown:
        print()
        print(format_markdown_table(headers, table))
        if engine:
            print()
            print(format_markdown_table(e_headers, e_table))
            print()
            print(format_markdown_table(t_headers, t_table))
    write_json(args.out, {
        "benchmark": "agents", "args": {k: str(v) for k, v in vars(args).items()},
        "goals": goals, "replay": rows, "engine": engine, "tool_engine": tools,
        "machine": machine_info(),
        "git": git_state(REPO),
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
