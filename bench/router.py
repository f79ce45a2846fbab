"""Round-robin against cache-aware routing in front of real ``kvtier serve`` instances.

For each routing policy, in one run, the script starts a fresh ``kvtier
cluster`` (``--instances`` ``kvtier serve`` on the bundled SmolLM2-135M, a
router from PyPI in front, or kvtier's own routing on the instances' KV
events with ``kvtier:POLICY``, optionally a shared Redis tier with
``--shared-tier``), warms each instance up with one private request, and
replays the same multi-turn conversations through the router with the
official ``openai`` client (streaming chat completions, usage included) at a
fixed concurrency.

The conversations come from the Mooncake conversation trace: requests whose
first two 512-token blocks are the same are turns of one conversation (the
trace's block ids are prefix-chained, so later turns extend earlier ones).
The first ``--conversations`` with at least two turns are kept, at most
``--max-turns`` turns each. Token counts are divided by ``--scale`` to fit a
small model on a CPU (32: a 512-token trace block becomes 16 tokens, one
kvtier block). Each block id stands for a fixed run of words picked from the
model's vocabulary by the id, so requests sharing block ids share text, and
a turn's prompt is its blocks' words cut to its scaled length. Requests are
sent in trace order; a turn starts only after the previous turn of its
conversation has finished, and at most ``--concurrency`` are in flight.

Per policy: the prefix hit ratio (``cached_tokens`` / ``prompt_tokens``
from the responses' usage), time to first token p50 / p99, output and prompt
tokens per second over the replay's wall time, and where the requests went
(each instance's ``/v1/cache/stats``: requests, tokens found in its device
cache, tokens loaded from the shared tier).

``python bench/router.py --help``; results go to ``bench/results/router.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    percentile,
    write_json,
)

DEFAULT_JSON = REPO / "bench" / "results" / "router.json"
_INSTANCE = re.compile(r"^kvtier:   instance \d+: (?P<url>\S+)/v1 \(pid (?P<pid>\d+)\)")
_SERVING = re.compile(r"^kvtier: cluster serving (?P<name>.+) at (?P<url>\S+)/v1 ")


# -- the workload ---------------------------------------------------------------------------


@dataclass
class Turn:
    conversation: int
    index: int
    order: int  # position in the trace
    prompt: str


def load_conversations(
    path: Path, count: int, max_turns: int, scale: int, max_prompt_tokens: int, words: list[str]
) -> list[Turn]:
    """The first ``count`` multi-turn conversations of the trace, turns in trace order."""
    groups: dict[tuple[int, ...], list[tuple[int, dict[str, Any]]]] = {}
    with open(path, encoding="utf-8") as fh:
        for order, line in enumerate(fh):
            rec = json.loads(line)
            key = tuple(rec["hash_ids"][:2])
            if len(key) == 2:
                groups.setdefault(key, []).append((order, rec))
    multi = [g for g in groups.values() if len(g) >= 2]
    multi.sort(key=lambda g: g[0][0])
    per_block = max(1, 512 // scale)
    turns: list[Turn] = []
    for conv, group in enumerate(multi[:count]):
        for index, (order, rec) in enumerate(group[:max_turns]):
            n = min(max_prompt_tokens, max(1, round(rec["input_length"] / scale)))
            text: list[str] = []
            for block in rec["hash_ids"]:
                rng = random.Random(block)
                text.extend(rng.choice(words) for _ in range(per_block))
                if len(text) >= n:
                    break
            turns.append(Turn(conv, index, order, "".join(text[:n]).strip()))
    turns.sort(key=lambda t: t.order)
    return turns


def vocabulary_words(model: str | None) -> list[str]:
    """Single-token words (with their leading space) of the served model's tokenizer."""
    from kvtier.engine import default_model_file
    from kvtier.engine.model import load_tokenizer

    tok = load_tokenizer(model or str(default_model_file()))
    words = []
    for token, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        word = token[1:]
        if token.startswith("\u0120") and word.isalpha() and word.islower() and 4 <= len(word) <= 9:
            words.append(" " + word)
    if len(words) < 1000:
        raise SystemExit(f"the tokenizer of {model or 'the bundled model'} has too few words")
    return words[:5000]


# -- one cluster ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    proc: subprocess.Popen[bytes]
    url: str
    model: str
    instances: list[str]
    pids: list[int]
    log_path: Path


def start_cluster(
    args: argparse.Namespace, routing: str, shared: bool, workdir: Path, router: str
) -> Cluster:
    log_path = workdir / f"cluster-{router}-{routing}{'-redis' if shared else ''}.log"
    argv = [sys.executable, "-m", "kvtier.cli", "cluster"]
    argv += ["--instances", str(args.instances), "--router", router, "--routing", routing]
    argv += ["--port", str(_free_port()), "--instance-port", "0"]
    argv += ["--on-instance-exit", args.on_instance_exit]
    if args.model:
        argv += ["--model", args.model]
    if shared:
        argv += ["--start-redis"]
    if router != "kvtier":
        argv += [f"--router-arg={a}" for a in args.router_arg]
    argv += ["--", "--log-level", "warning", *args.serve_arg]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        lines = log_path.read_text(errors="replace").splitlines()
        serving = [m for m in map(_SERVING.match, lines) if m]
        if serving:
            found = [m for m in map(_INSTANCE.match, lines) if m]
            return Cluster(
                proc,
                serving[0]["url"],
                serving[0]["name"],
                [m["url"] for m in found],
                [int(m["pid"]) for m in found],
                log_path,
            )
        if proc.poll() is not None:
            raise SystemExit(f"kvtier cluster exited:\n{log_path.read_text()}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"kvtier cluster did not start:\n{log_path.read_text()}")


def stop_cluster(cluster: Cluster) -> None:
    cluster.proc.send_signal(signal.SIGINT)
    try:
        cluster.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        cluster.proc.kill()
        cluster.proc.wait()


def instance_stats(cluster: Cluster) -> list[dict[str, Any]]:
    out = []
    for url in cluster.instances:
        with urllib.request.urlopen(f"{url}/v1/cache/stats", timeout=30) as r:
            out.append(json.loads(r.read())["engine"])
    return out


def router_stats(cluster: Cluster) -> dict[str, Any]:
    """kvtier route's ``/stats``: its routing decisions and each instance's event stream."""
    with urllib.request.urlopen(f"{cluster.url}/stats", timeout=30) as r:
        stats: dict[str, Any] = json.loads(r.read())
    return stats


def warm_up(cluster: Cluster) -> None:
    """One private request per instance, straight to it: first-request costs off the clock."""
    import openai

    for i, url in enumerate(cluster.instances):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        client.chat.completions.create(
            model=cluster.model,
            messages=[{"role": "user", "content": f"warm up instance {i}"}],
            max_tokens=2,
        )


# -- the replay -----------------------------------------------------------------------------


@dataclass
class Result:
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class Replay:
    results: list[Result] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    #: With --kill-after: the requests in flight when the instance was killed, and how
    #: many of the failures were among them (the others started after the kill).
    killed_at_s: float | None = None
    in_flight_at_kill: int = 0
    errors_in_flight: int = 0
    #: Seconds from the kill to the cluster's "serving again" line (restart), if seen.
    back_after_s: float | None = None


def session_id(conversation: int) -> str:
    """A conversation's id for the router: hex digits that share no prefix by design."""
    return hashlib.sha256(f"conversation {conversation}".encode()).hexdigest()[:16]


async def replay(cluster: Cluster, turns: Sequence[Turn], args: argparse.Namespace) -> Replay:
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=600
    )
    out = Replay()
    sem = asyncio.Semaphore(args.concurrency)
    in_flight: set[tuple[int, int]] = set()
    caught: set[tuple[int, int]] = set()  # in flight at the kill
    completed = 0
    started = time.perf_counter()
    watchers: list[asyncio.Future[None]] = []

    async def back_up(url: str) -> None:
        """Time until the killed instance answers again (the cluster restarts it)."""
        while not await asyncio.to_thread(_healthy, url):
            await asyncio.sleep(0.25)
        assert out.killed_at_s is not None
        out.back_after_s = time.perf_counter() - started - out.killed_at_s

    def maybe_kill() -> None:
        if args.kill_after is None or out.killed_at_s is not None:
            return
        if completed < args.kill_after:
            return
        victim = cluster.pids[args.kill_instance - 1]
        os.kill(victim, signal.SIGKILL)
        out.killed_at_s = time.perf_counter() - started
        caught.update(in_flight)
        out.in_flight_at_kill = len(in_flight)
        watchers.append(asyncio.ensure_future(back_up(cluster.instances[args.kill_instance - 1])))
        log(f"  killed instance {args.kill_instance} (pid {victim}) after {completed} requests, "
            f"{len(in_flight)} in flight")  # fmt: skip

    done: dict[tuple[int, int], asyncio.Event] = {
        (t.conversation, t.index): asyncio.Event() for t in turns
    }

    async def one(turn: Turn) -> None:
        nonlocal completed
        previous = done.get((turn.conversation, turn.index - 1))
        try:
            if previous is not None:
                await previous.wait()
            async with sem:
                in_flight.add((turn.conversation, turn.index))
                start = time.perf_counter()
                first: float | None = None
                usage: Any = None
                stream = await client.chat.completions.create(
                    model=cluster.model,
                    messages=[{"role": "user", "content": turn.prompt}],
                    max_tokens=args.max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    # vllm-router 0.1.17 routes a chat request under cache_aware on this
                    # id alone (its routing text is empty without it), matching ids as text
                    # prefixes: ids must not share one ("conversation-1" and
                    # "conversation-2" match each other past the 0.3 threshold).
                    extra_body=(
                        {"session_params": {"session_id": session_id(turn.conversation)}}
                        if args.session_ids
                        else None
                    ),
                )
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - start
                    if chunk.usage is not None:
                        usage = chunk.usage
                end = time.perf_counter() - start
                if usage is None:
                    raise RuntimeError("no usage in the stream")
                details = usage.prompt_tokens_details
                out.results.append(
                    Result(
                        ttft_s=first if first is not None else end,
                        latency_s=end,
                        prompt_tokens=usage.prompt_tokens,
                        cached_tokens=(details.cached_tokens or 0) if details else 0,
                        completion_tokens=usage.completion_tokens,
                    )
                )
        except Exception as exc:  # counted and reported; the replay goes on
            out.errors.append(f"{type(exc).__name__}: {exc}")
            out.errors_in_flight += (turn.conversation, turn.index) in caught
        finally:
            in_flight.discard((turn.conversation, turn.index))
            completed += 1
            maybe_kill()
            done[(turn.conversation, turn.index)].set()

    await asyncio.gather(*(one(t) for t in turns))
    for watcher in watchers:
        watcher.cancel()
    out.wall_s = time.perf_counter() - started
    await client.close()
    return out


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return 200 <= int(r.status) < 300
    except OSError:
        return False


def summarize(
    router: str,
    routing: str,
    shared: bool,
    run: Replay,
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
) -> dict[str, Any]:
    res = run.results
    prompt = sum(r.prompt_tokens for r in res)
    cached = sum(r.cached_tokens for r in res)
    completion = sum(r.completion_tokens for r in res)
    ttft = [r.ttft_s for r in res]

    def delta(key: str) -> list[int]:
        # A killed and restarted instance counts from zero again: its figure is since then.
        return [
            int(a[key]) - (0 if int(a[key]) < int(b[key]) else int(b[key]))
            for a, b in zip(after, before, strict=True)
        ]

    return {
        "router": router,
        "routing": routing,
        "shared_tier": "redis" if shared else None,
        "requests": len(res),
        "errors": len(run.errors),
        "error_samples": run.errors[:5],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * percentile(ttft, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttft, 0.99),
        "latency_p50_ms": 1000 * percentile([r.latency_s for r in res], 0.5),
        "output_tokens_per_s": completion / run.wall_s if run.wall_s else 0.0,
        "prompt_tokens_per_s": prompt / run.wall_s if run.wall_s else 0.0,
        "wall_s": run.wall_s,
        "killed": None
        if run.killed_at_s is None
        else {
            "at_s": run.killed_at_s,
            "in_flight": run.in_flight_at_kill,
            "errors_in_flight": run.errors_in_flight,
            "errors_after": len(run.errors) - run.errors_in_flight,
            "serving_again_after_s": run.back_after_s,
        },
        "per_instance": {
            "requests": delta("requests_added"),
            "device_cached_tokens": [
                c - lo
                for c, lo in zip(
                    delta("cached_prompt_tokens"), delta("loaded_prompt_tokens"), strict=True
                )
            ],
            "tier_loaded_tokens": delta("loaded_prompt_tokens"),
            "computed_tokens": delta("computed_prompt_tokens"),
        },
    }


def killed_cell(killed: dict[str, Any] | None) -> str:
    if not killed:
        return "-"
    back = killed["serving_again_after_s"]
    return (
        f"at {killed['at_s']:.0f} s: {killed['errors_in_flight']} of {killed['in_flight']} "
        f"in flight failed, {killed['errors_after']} after"
        + (f"; back in {back:.0f} s" if back is not None else "")
    )


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=CONVERSATION_TRACE)
    p.add_argument("--conversations", type=int, default=24, help="multi-turn conversations")
    p.add_argument("--max-turns", type=int, default=6, help="turns kept per conversation")
    p.add_argument("--scale", type=int, default=32, help="divide the trace's token counts by")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    p.add_argument("--instances", type=int, default=2)
    p.add_argument(
        "--router",
        choices=("vllm", "sglang", "kvtier"),
        default="vllm",
        help="the router of policies named without one (kvtier: kvtier route, on KV events)",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=["round_robin", "cache_aware"],
        help="routing policies, each POLICY (on --router) or ROUTER:POLICY, e.g. "
        "round_robin cache_aware kvtier:cache_aware",
    )
    p.add_argument(
        "--shared-tier",
        action="store_true",
        help="also run every policy with a shared Redis tier (redis-server on PATH)",
    )
    p.add_argument("--model", help="model for every instance (default: the bundled SmolLM2)")
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="an extra flag for the Rust router, e.g. --router-arg=--cache-threshold=0.1",
    )
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="an extra flag for every kvtier serve, e.g. --serve-arg=--kv-cache-memory=64MiB",
    )
    p.add_argument(
        "--no-session-ids",
        dest="session_ids",
        action="store_false",
        help="send no session_params.session_id (vllm-router's cache_aware then sees every "
        "chat request as the same empty text)",
    )
    p.add_argument(
        "--kill-after",
        type=int,
        metavar="N",
        help="SIGKILL one instance once N requests have finished, mid-run; the row then "
        "says how many requests were in flight, how many failed among them and after",
    )
    p.add_argument(
        "--kill-instance", type=int, default=0, metavar="K",
        help="with --kill-after: which instance, 1-based (default: the last)",
    )  # fmt: skip
    p.add_argument(
        "--on-instance-exit",
        choices=("restart", "continue", "stop"),
        default="restart",
        help="kvtier cluster's --on-instance-exit (default restart)",
    )
    p.add_argument("--json-out", type=Path, default=DEFAULT_JSON)
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.kill_after is not None:
        args.kill_instance = args.kill_instance or args.instances
        if not 1 <= args.kill_instance <= args.instances:
            raise SystemExit(f"--kill-instance must be 1..{args.instances}")
    words = vocabulary_words(args.model)
    turns = load_conversations(
        args.trace, args.conversations, args.max_turns, args.scale, args.max_prompt_tokens, words
    )
    log(
        f"{len(turns)} requests from {args.conversations} conversations of {args.trace.name} "
        f"(token counts / {args.scale}), concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, {args.instances} instances"
    )
    policies = [p.split(":", 1) if ":" in p else [args.router, p] for p in args.policies]
    configs = [(r, p, False) for r, p in policies]
    if args.shared_tier:
        configs += [(r, p, True) for r, p in policies]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-router-") as tmp:
        for router, routing, shared in configs:
            log(f"{router} {routing}{' + redis' if shared else ''}: starting the cluster ...")
            cluster = start_cluster(args, routing, shared, Path(tmp), router)
            try:
                warm_up(cluster)
                before = instance_stats(cluster)
                run = asyncio.run(replay(cluster, turns, args))
                after = instance_stats(cluster)
                decisions = router_stats(cluster) if router == "kvtier" else None
            finally:
                stop_cluster(cluster)
            row = summarize(router, routing, shared, run, before, after)
            if decisions is not None:
                row["router_stats"] = decisions
            log(
                f"  hit ratio {row['hit_ratio']:.1%}, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                f"p99 {row['ttft_p99_ms']:.0f} ms, {row['output_tokens_per_s']:.1f} output tok/s, "
                f"{row['errors']} errors, {row['wall_s']:.0f}s"
            )
            rows.append(row)
    headers = [
        "router", "routing", "shared tier", "requests", "hit ratio", "TTFT p50 ms", "TTFT p99 ms",
        "requests/s", "output tok/s", "prompt tok/s", "requests per instance",
    ]  # fmt: skip
    if any(r["killed"] for r in rows):
        headers.append("instance killed")
    table = [
        [
            r["router"],
            r["routing"],
            r["shared_tier"] or "-",
            r["requests"] if not r["errors"] else f"{r['requests']} ({r['errors']} failed)",
            f"{r['hit_ratio']:.1%}",
            f"{r['ttft_p50_ms']:.0f}",
            f"{r['ttft_p99_ms']:.0f}",
            f"{r['requests'] / r['wall_s']:.2f}" if r["wall_s"] else "-",
            f"{r['output_tokens_per_s']:.1f}",
            f"{r['prompt_tokens_per_s']:.0f}",
            "/".join(str(n) for n in r["per_instance"]["requests"]),
            *([killed_cell(r["killed"])] if any(r["killed"] for r in rows) else []),
        ]
        for r in rows
    ]
    print(format_markdown_table(headers, table) if args.markdown else format_table(headers, table))
    write_json(
        args.json_out,
        {
            "benchmark": "router",
            "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "requests": len(turns),
            "router_version": {
                r: package_version(f"{r}-router") if r != "kvtier" else "kvtier route"
                for r in sorted({r for r, _, _ in configs})
            },
            "machine": machine_info(),
            "git": git_state(REPO),
            "results": rows,
        },
    )
    log(f"wrote {args.json_out}")
    # A killed instance's in-flight requests may fail; any other failure is the bench's.
    return (
        0 if all(r["errors"] == (r["killed"] or {}).get("errors_in_flight", 0) for r in rows) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
