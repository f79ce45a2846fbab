"""Paused tool-using agent sessions through a real ``kvtier serve``: do hints make them faster?

Concurrent agent sessions talk to one ``kvtier serve`` on the bundled
SmolLM2-135M-Instruct through the official ``openai`` client (streamed chat
completions, usage included, temperature 0, ``--max-tokens`` tokens each):

* agent kinds (``--kinds``, default coder, researcher and planner) each have
  their own system prompt of ``--system-words`` words of the model's
  vocabulary (one token each); sessions are assigned to kinds round-robin
  and start staggered (gaps of 0.5-1.5x ``--stagger`` seconds);
* a session is its kind's system prompt and a user task, then ``--turns``
  turns: after each turn the client "runs a tool" for a pause drawn from a
  log-normal distribution (median ``--pause-medians``, one per kind, spread
  ``--pause-sigma``, cut at ``--max-pause`` medians), then appends the
  model's reply and the tool's result (``--result-words`` words, as a user
  message) and sends the next turn.

The device KV cache is sized to ``--device-fraction`` of the blocks the live
sessions' contexts need at their peak, computed from the schedule with each
request taken to last ``--plan-service`` seconds (a session is live from its
first request until its last one ends; a kind's system prompt counts once),
or to ``--num-blocks``; ``--tiers`` puts a host tier, a disk tier or both
below it, sized as fractions of the same peak.

The same seeded arrivals, pauses and texts run in each configuration
(``--configs``), each on a fresh server:

* ``default``: the server's defaults (its default policy, learned-reuse), no
  hints;
* ``hints``: ``--policy workflow``; every request carries ``session_id`` and
  ``agent_id`` (the kind), every turn but the last ``cache_ttl_s`` = the
  coming tool pause + ``--ttl-margin`` (20%), the last ``session_end``;
* ``wrong-hints``: the same, but each TTL is off by a factor drawn from
  ``--wrong-factor`` (2-10x), too short or too long at even odds;
* ``lru``: ``--policy lru``, no hints (the workflow policy's own fallback:
  what ``hints`` does without its hints);
* ``learned-reuse``: ``--policy learned-reuse``, no hints (named explicitly;
  today the same as ``default``, so a second run of it shows the noise);
* ``hints-prefetch``: ``hints`` with ``--prefetch-session-lead 1``: a paused
  session's blocks come back from the tiers a second before its TTL runs
  out (needs ``--tiers``).

Before the clock starts, each server answers a small warm-up request, then a
private prompt the size of the largest context, twice, alone: the TTFT of
computing it and of finding it cached. They anchor the run's figures: a turn
near the cached figure found its context and did not wait; near the computed
one it recomputed it; well above both it queued behind other requests, and
the machine is too slow for this load (fewer ``--sessions``, a longer
``--stagger`` or longer ``--pause-medians``).

Per configuration, over the turns after each session's first: time to first
token (the first content chunk) p50 and p90, and the share of their prompt
tokens served from the device cache, loaded from each tier and computed (the
usage's ``prompt_tokens_details``, with kvtier's per-source split); the
same shares over all requests from ``/v1/cache/stats`` before and after;
requests per second over the run; errors. Ratios against ``default``: TTFT
p50 as a factor, the device share as a difference in points.

The model's replies are its own (greedy), so the prompts of later turns are
the same across configurations as long as the replies are; each row records
a digest of its replies to show whether they were.

``python bench/agent_sessions.py --help``; ``--quick`` is a short smoke run,
``--plan-only`` prints the schedule and the cache sizes without starting a
server. Results go to ``bench/results/agent_sessions.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    REPO,
    format_markdown_table,
    format_table,
    git_state,
    log,
    machine_info,
    percentile,
    write_json,
)

DEFAULT_JSON = REPO / "bench" / "results" / "agent_sessions.json"
#: K and V bytes per token of the bundled SmolLM2-135M in float32: 30 layers x 3 KV heads x
#: 64 dims x 2 x 4 bytes. Tier sizes are computed with it; the server's own figure is checked.
BUNDLED_BYTES_PER_TOKEN = 46080
_SERVING = re.compile(r"^kvtier: serving (?P<name>.+) at (?P<url>\S+)/v1 ")
START_TIMEOUT_S = 600.0

Messages = list[dict[str, str]]


# -- the workload ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    """What the seeded workload is drawn from (every configuration replays the same one)."""

    sessions: int = 12
    turns: int = 5
    kinds: tuple[str, ...] = ("coder", "researcher", "planner")
    system_words: int = 192
    task_words: int = 32
    result_words: tuple[int, int] = (24, 72)
    pause_medians: tuple[float, ...] = (2.0, 4.0, 3.0)  # seconds, one per kind (cycled)
    pause_sigma: float = 0.5
    max_pause: float = 4.0  # pauses are cut at this many medians
    stagger_s: float = 5.0
    ttl_margin: float = 0.2
    wrong_factor: tuple[float, float] = (2.0, 10.0)
    seed: int = 0


@dataclass(frozen=True)
class SessionPlan:
    """One session: when it starts, what it says, how long its tools take."""

    index: int
    session_id: str
    kind: str
    start_s: float
    task: str
    #: Per turn but the last: the tool's pause after it, and the tool's result text.
    pauses: tuple[float, ...]
    results: tuple[str, ...]
    #: Per turn but the last: the exact TTL hint (pause + margin) and the wrong one.
    ttl_exact: tuple[float, ...]
    ttl_wrong: tuple[float, ...]


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    systems: dict[str, str]
    sessions: tuple[SessionPlan, ...]


def _words(rng: random.Random, words: Sequence[str], n: int) -> str:
    return "".join(rng.choice(words) for _ in range(n))


def make_workload(words: Sequence[str], spec: WorkloadSpec) -> Workload:
    """The seeded workload: every draw comes from its own named stream of ``spec.seed``.

    ``words`` are single-token words with their leading space. Nothing here
    depends on the configuration a workload is replayed in.
    """
    if spec.turns < 1 or spec.sessions < 1 or not spec.kinds:
        raise ValueError("a workload needs at least one session, one turn and one kind")
    lo, hi = spec.wrong_factor
    if not 1.0 < lo <= hi:
        raise ValueError(f"wrong TTL factors must be > 1, got {spec.wrong_factor}")
    systems = {
        kind: f"You are the {kind} agent of a tool-using team. Reference notes:"
        + _words(random.Random(f"{spec.seed}:system:{kind}"), words, spec.system_words)
        for kind in spec.kinds
    }
    arrivals = random.Random(f"{spec.seed}:arrivals")
    start = 0.0
    sessions = []
    for i in range(spec.sessions):
        if i:
            start += spec.stagger_s * arrivals.uniform(0.5, 1.5)
        k = i % len(spec.kinds)
        kind = spec.kinds[k]
        median = spec.pause_medians[k % len(spec.pause_medians)]
        # One stream per kind of draw, so changing one setting leaves the other draws alone.
        stream = f"{spec.seed}:session:{i}"
        task_rng = random.Random(f"{stream}:task")
        pause_rng = random.Random(f"{stream}:pauses")
        result_rng = random.Random(f"{stream}:results")
        wrong_rng = random.Random(f"{stream}:wrong")
        task = f"Task {i} for the {kind}:" + _words(task_rng, words, spec.task_words)
        pauses, results, exact, wrong = [], [], [], []
        for _ in range(spec.turns - 1):
            pause = pause_rng.lognormvariate(math.log(median), spec.pause_sigma)
            pause = round(min(spec.max_pause * median, pause), 3)
            results.append(
                "Tool result:" + _words(result_rng, words, result_rng.randint(*spec.result_words))
            )
            factor = wrong_rng.uniform(lo, hi)
            if wrong_rng.random() < 0.5:
                factor = 1.0 / factor
            ttl = round(pause * (1.0 + spec.ttl_margin), 3)
            pauses.append(pause)
            exact.append(ttl)
            wrong.append(round(ttl * factor, 3))
        sessions.append(
            SessionPlan(
                index=i,
                session_id=f"session-{i:03d}",
                kind=kind,
                start_s=round(start, 3),
                task=task,
                pauses=tuple(pauses),
                results=tuple(results),
                ttl_exact=tuple(exact),
                ttl_wrong=tuple(wrong),
            )
        )
    return Workload(spec, systems, tuple(sessions))


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    policy: str | None  # None: the server's default
    hints: str  # "none", "exact" or "wrong"
    #: More server flags (a configuration's own feature).
    serve_flags: tuple[str, ...] = ()


CONFIGS: dict[str, Config] = {
    c.key: c
    for c in (
        Config("default", "server defaults, no hints", None, "none"),
        Config("hints", "workflow, session + TTL hints", "workflow", "exact"),
        Config("wrong-hints", "workflow, TTLs off by a factor", "workflow", "wrong"),
        Config(
            "hints-prefetch",
            "workflow, session + TTL hints, sessions prefetched 1 s early",
            "workflow",
            "exact",
            ("--prefetch-session-lead", "1"),
        ),
        Config("lru", "LRU, no hints", "lru", "none"),
        Config("learned-reuse", "learned-reuse, no hints", "learned-reuse", "none"),
    )
}
DEFAULT_CONFIGS = ("default", "hints", "wrong-hints", "lru")


def hints_for(plan: SessionPlan, turn: int, mode: str) -> dict[str, Any] | None:
    """The ``kvtier`` hints of a session's turn in a configuration's hint mode."""
    if mode == "none":
        return None
    hints: dict[str, Any] = {"session_id": plan.session_id, "agent_id": plan.kind}
    if turn >= len(plan.pauses):  # the last turn: no tool call follows
        hints["session_end"] = True
    elif mode == "exact":
        hints["cache_ttl_s"] = plan.ttl_exact[turn]
    elif mode == "wrong":
        hints["cache_ttl_s"] = plan.ttl_wrong[turn]
    else:
        raise ValueError(f"unknown hint mode {mode!r}")
    return hints


def turn_messages(
    workload: Workload, plan: SessionPlan, turn: int, replies: Sequence[str]
) -> Messages:
    """The chat of a session's ``turn``: system, task, then each earlier reply and tool result."""
    messages: Messages = [
        {"role": "system", "content": workload.systems[plan.kind]},
        {"role": "user", "content": plan.task},
    ]
    for j in range(turn):
        messages.append({"role": "assistant", "content": replies[j]})
        messages.append({"role": "user", "content": plan.results[j]})
    return messages


def send_times(plan: SessionPlan, service_s: float = 0.0) -> list[float]:
    """When each turn is sent (seconds from the run's start) if each request takes
    ``service_s``."""
    times = [plan.start_s]
    for pause in plan.pauses:
        times.append(times[-1] + service_s + pause)
    return times


# -- cache sizing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizing:
    peak_live_blocks: int
    peak_at_s: float
    largest_context_tokens: int
    num_blocks: int
    host_blocks: int
    disk_blocks: int


def peak_live_blocks(
    workload: Workload,
    count_tokens: Callable[[Messages], int],
    reply_tokens: int,
    block_size: int,
    service_s: float = 0.0,
) -> tuple[int, float, int]:
    """The most blocks the live sessions' contexts need at once, when, and the largest context.

    Each request is taken to last ``service_s``. A session is live from its
    first request until its last one finishes; from turn k's send time it
    holds turn k's prompt and reply (a reply taken as ``reply_tokens``
    tokens). A kind's system prompt counts once for all live sessions of it.
    """
    placeholder = " ok" * reply_tokens
    system_blocks = {
        kind: count_tokens([{"role": "system", "content": text}]) // block_size
        for kind, text in workload.systems.items()
    }
    # (start, end, session, blocks): what a session holds between two of its requests.
    spans: list[tuple[float, float, int, int]] = []
    largest = 0
    for plan in workload.sessions:
        replies = [placeholder] * len(plan.pauses)
        times = send_times(plan, service_s)
        for turn, at in enumerate(times):
            tokens = count_tokens(turn_messages(workload, plan, turn, replies)) + reply_tokens
            largest = max(largest, tokens)
            end = times[turn + 1] if turn + 1 < len(times) else at + service_s
            spans.append((at, end, plan.index, -(-tokens // block_size)))
    peak, peak_at = 0, 0.0
    for t in sorted({start for start, *_ in spans}):
        live = {s: n for start, end, s, n in spans if start <= t < end or start == t}
        kinds = {workload.sessions[s].kind for s in live}
        total = sum(system_blocks[k] for k in kinds) + sum(
            n - system_blocks[workload.sessions[s].kind] for s, n in live.items()
        )
        if total > peak:
            peak, peak_at = total, t
    return peak, peak_at, largest


def size_cache(
    workload: Workload,
    count_tokens: Callable[[Messages], int],
    *,
    reply_tokens: int,
    block_size: int,
    device_fraction: float,
    num_blocks: int | None,
    host_fraction: float,
    disk_fraction: float,
    service_s: float = 0.0,
) -> Sizing:
    """Device blocks (a fraction of the peak, at least 1.25 of the largest context) and the
    tiers' (fractions of the peak), the schedule taking each request to last ``service_s``."""
    peak, at, largest = peak_live_blocks(
        workload, count_tokens, reply_tokens, block_size, service_s
    )
    floor = math.ceil(1.25 * -(-largest // block_size))
    blocks = num_blocks if num_blocks else max(floor, math.ceil(device_fraction * peak))
    return Sizing(
        peak_live_blocks=peak,
        peak_at_s=at,
        largest_context_tokens=largest,
        num_blocks=blocks,
        host_blocks=max(1, math.ceil(host_fraction * peak)),
        disk_blocks=max(1, math.ceil(disk_fraction * peak)),
    )


def vocabulary_words(tok: Any) -> list[str]:
    """Single-token lowercase words (with their leading space) of the model's tokenizer."""
    words = []
    for token, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        word = token[1:]
        if token.startswith("\u0120") and word.isalpha() and word.islower() and 4 <= len(word) <= 9:
            words.append(" " + word)
    if len(words) < 1000:
        raise SystemExit("the bundled model's tokenizer has too few words")
    return words[:5000]


def chat_token_counter(tok: Any) -> Callable[[Messages], int]:
    def count(messages: Messages) -> int:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)

    return count


# -- one server -----------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    model: str
    log_path: Path


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    # Progress bars rewrite one line with carriage returns: keep their last state.
    out = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return "\n".join(out[-lines:])


def serve_argv(
    config: Config, sizing: Sizing, args: argparse.Namespace, workdir: Path
) -> list[str]:
    argv = [sys.executable, "-m", "kvtier.cli", "serve", "--port", "0", "--log-level", "warning"]
    argv += ["--num-blocks", str(sizing.num_blocks), "--block-size", str(args.block_size)]
    if config.policy is not None:
        argv += ["--policy", config.policy]
    argv += config.serve_flags
    if args.max_num_seqs:
        argv += ["--max-num-seqs", str(args.max_num_seqs)]
    per_block = BUNDLED_BYTES_PER_TOKEN * args.block_size
    if "host" in args.tiers:
        argv += ["--tier", f"host:{sizing.host_blocks * per_block}"]
    if "disk" in args.tiers:
        disk = workdir / f"disk-{config.key}"
        argv += ["--tier", f"disk:{disk}?size={sizing.disk_blocks * per_block}"]
    return argv + list(args.serve_arg)


def start_server(argv: list[str], log_path: Path) -> Server:
    # The same environment (PYTHONPATH included): the server runs the kvtier this script imports.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            m = _SERVING.match(line)
            if m:
                return Server(proc, m["url"], m["name"], log_path)
        if proc.poll() is not None:
            raise SystemExit(
                f"kvtier serve exited with status {proc.returncode} before serving.\n"
                f"command: {' '.join(argv)}\nlast lines of its log ({log_path}):\n"
                f"{log_tail(log_path)}"
            )
        time.sleep(0.25)
    proc.kill()
    proc.wait()
    raise SystemExit(
        f"kvtier serve did not start within {START_TIMEOUT_S:.0f}s.\ncommand: {' '.join(argv)}\n"
        f"last lines of its log ({log_path}):\n{log_tail(log_path)}"
    )


def stop_server(server: Server) -> None:
    if server.proc.poll() is not None:
        return
    server.proc.send_signal(signal.SIGINT)
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


def cache_stats(server: Server) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{server.url}/v1/cache/stats", timeout=60) as r:
            stats: dict[str, Any] = json.loads(r.read())
    except (OSError, urllib.error.URLError) as exc:
        raise SystemExit(
            f"GET /v1/cache/stats failed ({exc}); last lines of the server's log:\n"
            f"{log_tail(server.log_path)}"
        ) from None
    return stats


def _timed(client: Any, model: str, text: str, max_tokens: int) -> dict[str, float]:
    """One streamed request of ``text``: its TTFT (first content chunk) and token counts."""
    start = time.perf_counter()
    first: float | None = None
    usage: Any = None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter() - start
    details = usage.prompt_tokens_details if usage is not None else None
    return {
        "ttft_s": first if first is not None else end,
        "prompt_tokens": usage.prompt_tokens if usage is not None else 0,
        "cached_tokens": (details.cached_tokens or 0) if details else 0,
    }


def warm_up(server: Server, probe_text: str, max_tokens: int) -> dict[str, Any]:
    """Off the clock: one small request (first-request costs), then a probe of the largest
    context's size sent twice, alone: its TTFT computed from scratch and from the cache.

    These anchor the run's TTFTs: near the cached probe, a turn found its
    context and did not wait; near the cold one, it computed it; far above
    both, it waited behind other requests (the server was saturated).
    """
    import openai

    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600
    )
    try:
        _timed(client, server.model, "Warm-up request: reply with one word.", 2)
        cold = _timed(client, server.model, probe_text, max_tokens)
        hit = _timed(client, server.model, probe_text, max_tokens)
    finally:
        client.close()
    return {
        "probe_prompt_tokens": cold["prompt_tokens"],
        "solo_cold_ttft_ms": 1000 * cold["ttft_s"],
        "solo_cached_ttft_ms": 1000 * hit["ttft_s"],
        "solo_cached_tokens": hit["cached_tokens"],
    }


def probe_text(words: Sequence[str], tokens: int, seed: int) -> str:
    """Private text of about ``tokens`` tokens that shares no prefix with the workload."""
    rng = random.Random(f"{seed}:probe")
    return "Calibration request, not part of any session:" + _words(rng, words, max(1, tokens))


# -- the replay -----------------------------------------------------------------------------


@dataclass
class Record:
    session: int
    turn: int
    kind: str
    sent_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class Replay:
    records: list[Record] = field(default_factory=list)
    replies: dict[int, list[str]] = field(default_factory=dict)
    wall_s: float = 0.0


def _by_source(details: Any) -> dict[str, int]:
    raw = getattr(details, "kvtier_cached_tokens_by_source", None)
    if raw is None and getattr(details, "model_extra", None):
        raw = details.model_extra.get("kvtier_cached_tokens_by_source")
    return {str(k): int(v) for k, v in (raw or {}).items()}


async def replay(server: Server, workload: Workload, config: Config, max_tokens: int) -> Replay:
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600
    )
    out = Replay()
    t0 = time.perf_counter()

    async def session(plan: SessionPlan) -> None:
        replies: list[str] = []
        out.replies[plan.index] = replies
        await asyncio.sleep(max(0.0, plan.start_s - (time.perf_counter() - t0)))
        for turn in range(workload.spec.turns):
            hints = hints_for(plan, turn, config.hints)
            start = time.perf_counter()
            rec = Record(plan.index, turn, plan.kind, sent_s=start - t0)
            text: list[str] = []
            try:
                stream = await client.chat.completions.create(
                    model=server.model,
                    messages=turn_messages(workload, plan, turn, replies),
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"kvtier": hints} if hints else None,
                )
                usage: Any = None
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - start
                        text.append(chunk.choices[0].delta.content)
                    if chunk.usage is not None:
                        usage = chunk.usage
                rec.latency_s = time.perf_counter() - start
                if rec.ttft_s is None:
                    rec.ttft_s = rec.latency_s
                if usage is None:
                    raise RuntimeError("no usage in the stream")
                details = usage.prompt_tokens_details
                rec.prompt_tokens = usage.prompt_tokens
                rec.completion_tokens = usage.completion_tokens
                rec.cached_tokens = (details.cached_tokens or 0) if details else 0
                rec.by_source = _by_source(details) if details else {}
            except Exception as exc:  # counted and reported; the session goes on
                rec.error = f"{type(exc).__name__}: {exc}"
            out.records.append(rec)
            if turn < len(plan.pauses):
                replies.append("".join(text))
                await asyncio.sleep(plan.pauses[turn])  # the tool runs

    await asyncio.gather(*(session(p) for p in workload.sessions))
    out.wall_s = time.perf_counter() - t0
    await client.close()
    return out


# -- summaries ------------------------------------------------------------------------------


def _shares(prompt: int, by_source: dict[str, int]) -> dict[str, float]:
    cached = sum(by_source.values())
    out = {src: n / prompt if prompt else 0.0 for src, n in sorted(by_source.items())}
    out["computed"] = (prompt - cached) / prompt if prompt else 0.0
    return out


def summarize(
    config: Config, run: Replay, before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    ok = [r for r in run.records if r.error is None]
    later = [r for r in ok if r.turn > 0]
    first = [r for r in ok if r.turn == 0]
    later_prompt = sum(r.prompt_tokens for r in later)
    later_sources: dict[str, int] = {}
    for r in later:
        for src, n in r.by_source.items():
            later_sources[src] = later_sources.get(src, 0) + n
    eb, ea = before["engine"], after["engine"]
    stats_prompt = int(ea["prompt_tokens"]) - int(eb["prompt_tokens"])
    stats_sources = {
        src: int(n) - int(eb["cached_prompt_tokens_by_source"].get(src, 0))
        for src, n in ea["cached_prompt_tokens_by_source"].items()
    }
    replies = json.dumps([run.replies[k] for k in sorted(run.replies)])
    errors = [f"session {r.session} turn {r.turn}: {r.error}" for r in run.records if r.error]
    return {
        "config": config.key,
        "label": config.label,
        "policy": after.get("policy"),
        "hints": config.hints,
        "requests": len(run.records),
        "errors": len(errors),
        "error_samples": errors[:5],
        "later_turns": len(later),
        "ttft_p50_ms": 1000 * percentile([r.ttft_s or 0.0 for r in later], 0.5),
        "ttft_p90_ms": 1000 * percentile([r.ttft_s or 0.0 for r in later], 0.9),
        "first_turn_ttft_p50_ms": 1000 * percentile([r.ttft_s or 0.0 for r in first], 0.5),
        "latency_p50_ms": 1000 * percentile([r.latency_s or 0.0 for r in later], 0.5),
        "later_prompt_tokens": later_prompt,
        "later_shares": _shares(later_prompt, later_sources),
        "stats_delta": {
            "requests": int(ea["requests_added"]) - int(eb["requests_added"]),
            "prompt_tokens": stats_prompt,
            "cached_by_source": stats_sources,
            "computed_prompt_tokens": int(ea["computed_prompt_tokens"])
            - int(eb["computed_prompt_tokens"]),
            "loaded_prompt_tokens": int(ea["loaded_prompt_tokens"])
            - int(eb["loaded_prompt_tokens"]),
            "preemptions": int(ea["preemptions"]) - int(eb["preemptions"]),
            "evictions": int(after["evictions"]) - int(before["evictions"]),
            "shares": _shares(stats_prompt, stats_sources),
        },
        "sessions": after.get("sessions"),
        "tiers": {
            name: {k: t.get(k) for k in ("stored_blocks", "loaded_blocks", "released_blocks")}
            for name, t in (after.get("tiers") or {}).items()
        },
        "requests_per_s": len(ok) / run.wall_s if run.wall_s else 0.0,
        "wall_s": run.wall_s,
        "replies_sha1": hashlib.sha1(replies.encode()).hexdigest(),
        "records": [asdict(r) for r in sorted(run.records, key=lambda r: (r.session, r.turn))],
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """TTFT p50 as a factor of ``default``'s; the device share's and the cached share's
    (device and tiers) differences in points."""
    base = next((r for r in rows if r["config"] == "default"), None)
    for r in rows:
        if base is None:
            r["vs_default"] = None
            continue
        p50 = base["ttft_p50_ms"]
        r["vs_default"] = {
            "ttft_p50_ratio": r["ttft_p50_ms"] / p50 if p50 else None,
            "device_share_points": 100
            * (r["later_shares"].get("device", 0.0) - base["later_shares"].get("device", 0.0)),
            "cached_share_points": 100
            * (base["later_shares"]["computed"] - r["later_shares"]["computed"]),
        }


def round_order(configs: Sequence[str], round_index: int) -> list[str]:
    """The configurations of one round: each round starts one further along, so no
    configuration always runs first (a machine's load drifts over a long run)."""
    k = round_index % len(configs)
    return [*configs[k:], *configs[:k]]


def _median(xs: Sequence[float]) -> float:
    ordered = sorted(xs)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def combine_rounds(rounds: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per configuration from several rounds (each already through
    :func:`add_ratios`): the median of every figure, the ratios against default taken
    within each round first, with their spread (``ratio_ranges``) and every round's row
    (``rounds``). A single round is returned as it is."""
    if len(rounds) == 1:
        return list(rounds[0])
    out: list[dict[str, Any]] = []
    for config in [r["config"] for r in rounds[0]]:
        runs = [next(r for r in rnd if r["config"] == config) for rnd in rounds]
        row = dict(runs[0])
        for key in ("ttft_p50_ms", "ttft_p90_ms", "first_turn_ttft_p50_ms", "latency_p50_ms",
                    "requests_per_s", "wall_s"):  # fmt: skip
            row[key] = _median([r[key] for r in runs])
        for key in ("requests", "errors", "later_turns", "later_prompt_tokens"):
            row[key] = sum(r[key] for r in runs)
        sources = sorted({k for r in runs for k in r["later_shares"]})
        row["later_shares"] = {
            k: _median([r["later_shares"].get(k, 0.0) for r in runs]) for k in sources
        }
        row["error_samples"] = [e for r in runs for e in r["error_samples"]][:5]
        vs = [r["vs_default"] for r in runs]
        if all(v is not None for v in vs):
            row["vs_default"] = {}
            row["ratio_ranges"] = {}
            for key in vs[0]:
                got = [v[key] for v in vs if v[key] is not None]
                row["vs_default"][key] = _median(got) if got else None
                row["ratio_ranges"][key] = [min(got), max(got)] if got else None
        row["rounds"] = runs
        out.append(row)
    return out


def result_table(
    rows: list[dict[str, Any]], tiers: Sequence[str]
) -> tuple[list[str], list[list[object]]]:
    headers = [
        "config",
        "policy",
        "requests",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "p50 vs default",
        "device",
        *tiers,
        "computed",
        "device vs default",
        *(["cached vs default"] if tiers else []),
        "req/s",
    ]
    ranged = any(r.get("ratio_ranges") for r in rows)
    if ranged:
        headers += ["p50 vs default, range", "device vs default, range"]
    table: list[list[object]] = []
    for r in rows:
        vs = r.get("vs_default")
        sh = r["later_shares"]
        spread = r.get("ratio_ranges") or {}
        p50_range = spread.get("ttft_p50_ratio")
        pts_range = spread.get("device_share_points")
        table.append(
            [
                r["config"],
                r["policy"] or "-",
                r["requests"] if not r["errors"] else f"{r['requests']} ({r['errors']} failed)",
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['ttft_p90_ms']:.0f}",
                f"{vs['ttft_p50_ratio']:.2f}x" if vs and vs["ttft_p50_ratio"] else "-",
                f"{100 * sh.get('device', 0.0):.1f}%",
                *[f"{100 * sh.get(t, 0.0):.1f}%" for t in tiers],
                f"{100 * sh['computed']:.1f}%",
                f"{vs['device_share_points']:+.1f} pts" if vs else "-",
                *([f"{vs['cached_share_points']:+.1f} pts" if vs else "-"] if tiers else []),
                f"{r['requests_per_s']:.2f}",
                *(
                    [
                        f"{p50_range[0]:.2f}-{p50_range[1]:.2f}x" if p50_range else "-",
                        f"{pts_range[0]:+.1f} to {pts_range[1]:+.1f}" if pts_range else "-",
                    ]
                    if ranged
                    else []
                ),
            ]
        )
    return headers, table


# -- main -----------------------------------------------------------------------------------

QUICK = {
    "sessions": 3,
    "turns": 3,
    "system_words": 160,
    "task_words": 32,
    "result_words": (24, 48),
    "pause_medians": (1.0, 1.5, 1.2),
    "stagger": 0.5,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = WorkloadSpec()
    w = p.add_argument_group("the workload")
    w.add_argument(
        "--sessions", type=int, default=d.sessions, help=f"sessions (default {d.sessions})"
    )
    w.add_argument(
        "--turns", type=int, default=d.turns, help=f"requests per session (default {d.turns})"
    )
    w.add_argument(
        "--kinds",
        nargs="+",
        default=list(d.kinds),
        help=f"agent kinds, each with its own system prompt (default {' '.join(d.kinds)})",
    )
    w.add_argument(
        "--system-words",
        type=int,
        default=d.system_words,
        help=f"words (tokens) of each kind's system prompt (default {d.system_words})",
    )
    w.add_argument(
        "--task-words",
        type=int,
        default=d.task_words,
        help=f"words of each session's task (default {d.task_words})",
    )
    w.add_argument(
        "--result-words",
        type=int,
        nargs=2,
        default=list(d.result_words),
        metavar=("MIN", "MAX"),
        help="words of a tool result, uniform (default {} {})".format(*d.result_words),
    )
    w.add_argument(
        "--pause-medians",
        type=float,
        nargs="+",
        default=list(d.pause_medians),
        help="median tool latency in seconds, one per kind, cycled (default "
        f"{' '.join(f'{m:g}' for m in d.pause_medians)})",
    )
    w.add_argument(
        "--pause-sigma",
        type=float,
        default=d.pause_sigma,
        help=f"log-normal spread of the pauses (default {d.pause_sigma:g})",
    )
    w.add_argument(
        "--max-pause",
        type=float,
        default=d.max_pause,
        help=f"pauses are cut at this many medians (default {d.max_pause:g})",
    )
    w.add_argument(
        "--stagger",
        type=float,
        default=d.stagger_s,
        help="mean seconds between session starts; each gap is drawn from 0.5-1.5x it "
        f"(default {d.stagger_s:g})",
    )
    w.add_argument(
        "--max-tokens", type=int, default=8, help="tokens generated per request (default 8)"
    )
    w.add_argument("--seed", type=int, default=d.seed)
    h = p.add_argument_group("the hints")
    h.add_argument(
        "--ttl-margin",
        type=float,
        default=d.ttl_margin,
        help=f"exact hints: cache_ttl_s = the coming pause x (1 + this) (default {d.ttl_margin:g})",
    )
    h.add_argument(
        "--wrong-factor",
        type=float,
        nargs=2,
        default=list(d.wrong_factor),
        metavar=("MIN", "MAX"),
        help="wrong-hints: each TTL multiplied or divided by a factor in [MIN, MAX] "
        "(default {:g} {:g})".format(*d.wrong_factor),
    )
    s = p.add_argument_group("the server")
    s.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=list(DEFAULT_CONFIGS),
        help=f"configurations to run, in order (default: {' '.join(DEFAULT_CONFIGS)})",
    )
    s.add_argument(
        "--device-fraction",
        type=float,
        default=0.75,
        help="device blocks as a fraction of the live contexts' peak (default 0.75)",
    )
    s.add_argument(
        "--plan-service",
        type=float,
        default=1.0,
        help="seconds each request is taken to last when the schedule's peak is computed "
        "(default 1)",
    )
    s.add_argument(
        "--num-blocks", type=int, default=0, help="device blocks (overrides the fraction)"
    )
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument(
        "--tiers",
        choices=("none", "host", "disk", "host+disk"),
        default="none",
        help="tiers below the device (default none)",
    )
    s.add_argument(
        "--host-fraction",
        type=float,
        default=0.5,
        help="host tier size as a fraction of the peak (default 0.5)",
    )
    s.add_argument(
        "--disk-fraction",
        type=float,
        default=2.0,
        help="disk tier size as a fraction of the peak (default 2)",
    )
    s.add_argument("--max-num-seqs", type=int, default=0, help="passed to kvtier serve when set")
    s.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="an extra flag for every kvtier serve, e.g. --serve-arg=--pressure=off",
    )
    o = p.add_argument_group("the run")
    o.add_argument(
        "--quick",
        action="store_true",
        help="a short smoke run: 3 sessions x 3 turns, short prompts and pauses",
    )
    o.add_argument(
        "--plan-only",
        action="store_true",
        help="print the schedule and the cache sizes, start no server",
    )
    o.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every configuration this many times (each round in another order) and "
        "report the medians, with the spread of the ratios against default (default 1)",
    )
    o.add_argument("--json-out", type=Path, default=DEFAULT_JSON)
    o.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, list(v) if isinstance(v, tuple) else v)
    if args.sessions < 1 or args.turns < 1:
        p.error("--sessions and --turns must be at least 1")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if not 1.0 < args.wrong_factor[0] <= args.wrong_factor[1]:
        p.error("--wrong-factor MIN MAX needs 1 < MIN <= MAX")
    if "hints-prefetch" in args.configs and args.tiers == "none":
        p.error("hints-prefetch brings sessions back from a tier: add --tiers host (or disk)")
    return args


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        sessions=args.sessions,
        turns=args.turns,
        kinds=tuple(args.kinds),
        system_words=args.system_words,
        task_words=args.task_words,
        result_words=(args.result_words[0], args.result_words[1]),
        pause_medians=tuple(args.pause_medians),
        pause_sigma=args.pause_sigma,
        max_pause=args.max_pause,
        stagger_s=args.stagger,
        ttl_margin=args.ttl_margin,
        wrong_factor=(args.wrong_factor[0], args.wrong_factor[1]),
        seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import kvtier
    from kvtier.engine import default_model_file
    from kvtier.engine.model import load_tokenizer

    tok = load_tokenizer(str(default_model_file()))
    words = vocabulary_words(tok)
    workload = make_workload(words, spec_from_args(args))
    sizing = size_cache(
        workload,
        chat_token_counter(tok),
        reply_tokens=args.max_tokens,
        block_size=args.block_size,
        device_fraction=args.device_fraction,
        num_blocks=args.num_blocks or None,
        host_fraction=args.host_fraction,
        disk_fraction=args.disk_fraction,
        service_s=args.plan_service,
    )
    span = max(send_times(p, args.plan_service)[-1] for p in workload.sessions)
    probe = probe_text(words, sizing.largest_context_tokens - 16, args.seed)
    tiers = [] if args.tiers == "none" else args.tiers.split("+")
    log(
        f"{args.sessions} sessions x {args.turns} turns of {len(args.kinds)} kinds, "
        f"schedule {span:.0f}s at {args.plan_service:g}s a request; live contexts peak at "
        f"{sizing.peak_live_blocks} blocks ({sizing.peak_at_s:.1f}s), largest context "
        f"{sizing.largest_context_tokens} tokens; device {sizing.num_blocks} blocks"
        + "".join(f", {t} tier {getattr(sizing, t + '_blocks')} blocks" for t in tiers)
    )
    if args.plan_only:
        for plan in workload.sessions:
            log(
                f"  {plan.session_id} {plan.kind:<10} start {plan.start_s:6.2f}s "
                f"pauses {list(plan.pauses)} TTLs {list(plan.ttl_exact)} "
                f"wrong {list(plan.ttl_wrong)}"
            )
        return 0
    rounds: list[list[dict[str, Any]]] = []
    argvs: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-agent-sessions-") as tmp:
        for rnd in range(args.repeats):
            rows = run_round(args, round_order(args.configs, rnd), sizing, workload, probe,
                             tiers, Path(tmp), argvs, rnd)  # fmt: skip
            add_ratios(rows)
            rows.sort(key=lambda r: args.configs.index(r["config"]))
            rounds.append(rows)
    rows = combine_rounds(rounds)
    headers, table = result_table(rows, tiers)
    print(
        f"{args.sessions} agent sessions x {args.turns} turns, device {sizing.num_blocks} blocks "
        f"({args.device_fraction:g} of the {sizing.peak_live_blocks}-block peak), tiers: "
        f"{args.tiers}; TTFT and prompt-token shares over turns 2-{args.turns}"
        + (f"; medians of {args.repeats} rounds" if args.repeats > 1 else "")
    )
    print(format_markdown_table(headers, table) if args.markdown else format_table(headers, table))
    if args.repeats == 1:
        print(
            "alone on each server, the largest context's size: "
            + ", ".join(
                f"{r['config']} {r['solo']['solo_cold_ttft_ms']:.0f} ms computed / "
                f"{r['solo']['solo_cached_ttft_ms']:.0f} ms cached"
                for r in rows
            )
        )
    write_json(
        args.json_out,
        {
            "benchmark": "agent_sessions",
            "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "sizing": asdict(sizing),
            "serve_args": argvs,
            "workload": {
                "schedule_s": span,
                "sessions": [
                    {
                        "session_id": p.session_id,
                        "kind": p.kind,
                        "start_s": p.start_s,
                        "pauses_s": list(p.pauses),
                        "ttl_exact_s": list(p.ttl_exact),
                        "ttl_wrong_s": list(p.ttl_wrong),
                    }
                    for p in workload.sessions
                ],
            },
            "machine": machine_info(),
            "git": git_state(REPO),
            "kvtier": {"version": kvtier.__version__, "path": str(Path(kvtier.__file__).parent)},
            "results": rows,
        },
    )
    log(f"wrote {args.json_out}")
    return 0 if all(not r["errors"] for r in rows) else 1


def run_round(
    args: argparse.Namespace,
    order: Sequence[str],
    sizing: Sizing,
    workload: Workload,
    probe: str,
    tiers: Sequence[str],
    tmp: Path,
    argvs: dict[str, list[str]],
    rnd: int,
) -> list[dict[str, Any]]:
    """Each configuration of ``order`` once, on a fresh server: its summary row."""
    rows: list[dict[str, Any]] = []
    for key in order:
        config = CONFIGS[key]
        argv_serve = serve_argv(config, sizing, args, tmp)
        argvs[key] = argv_serve[3:]
        prefix = f"round {rnd + 1}/{args.repeats}: " if args.repeats > 1 else ""
        log(f"{prefix}{key} ({config.label}): starting kvtier serve ...")
        server = start_server(argv_serve, tmp / f"serve-r{rnd}-{key}.log")
        try:
            solo = warm_up(server, probe, args.max_tokens)
            before = cache_stats(server)
            per_block = before.get("bytes_per_block")
            if tiers and per_block != BUNDLED_BYTES_PER_TOKEN * args.block_size:
                log(
                    f"  note: the server's blocks are {per_block} bytes, tier sizes assumed "
                    f"{BUNDLED_BYTES_PER_TOKEN * args.block_size}"
                )
            run = asyncio.run(replay(server, workload, config, args.max_tokens))
            if server.proc.poll() is not None:
                raise SystemExit(
                    f"kvtier serve exited during the run (status {server.proc.returncode});"
                    f" last lines of its log:\n{log_tail(server.log_path)}"
                )
            after = cache_stats(server)
        finally:
            stop_server(server)
        row = summarize(config, run, before, after)
        row["solo"] = solo
        log(
            f"  TTFT p50 {row['ttft_p50_ms']:.0f} ms, p90 {row['ttft_p90_ms']:.0f} ms "
            f"(turns 2+), device {100 * row['later_shares'].get('device', 0.0):.1f}% of "
            f"their prompt tokens, {row['errors']} errors, {row['wall_s']:.0f}s; alone, a "
            f"{solo['probe_prompt_tokens']}-token prompt: {solo['solo_cold_ttft_ms']:.0f} ms "
            f"computed, {solo['solo_cached_ttft_ms']:.0f} ms cached"
        )
        if row["ttft_p50_ms"] > solo["solo_cold_ttft_ms"]:
            log(
                "  note: the median turn waited longer than computing the largest prompt "
                "alone takes: requests queued, and queueing, not the cache, sets these "
                "TTFTs (fewer --sessions, a longer --stagger or longer --pause-medians "
                "fit this machine better)"
            )
        if row["errors"]:
            log(
                f"  errors: {row['error_samples']}\n  server log tail:\n"
                f"{log_tail(server.log_path, 15)}"
            )
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
