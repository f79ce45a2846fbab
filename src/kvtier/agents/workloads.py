"""Agent workloads for the replay: synthetic workflows, tool-calling sessions, Mooncake sessions.

Each generator returns trace lines (plain dicts) in the Mooncake format at a
block size of :data:`BLOCK_SIZE` tokens (``hash_ids`` name blocks, prefix-
chained; ``timestamp`` in milliseconds), with the agent hints as optional
fields and ``{"workflow": ...}`` lines registering the step graphs; write them
with :func:`write_trace` and replay with ``kvtier replay FILE --block-size 16``.

* :func:`cyclic_workflow`: one deterministic agent loop (KVFlow's cyclic
  case): ``agents`` agents, each step's prompt the agent's fixed prompt.
* :func:`synthetic_workflows`: many concurrent workflows in KVFlow's shapes
  (sequential pipelines, fan-out/fan-in, cycles), each run again and again;
  agents have fixed prompts of 500-4,000 tokens, and each step adds a fresh
  dynamic input (the previous agent's output). Steps of different workflows
  interleave in time.
* :func:`tool_sessions`: multi-turn function-calling sessions: a shared
  system prompt with the tool definitions, a conversation that grows each
  turn, and a tool call between turns whose latency is drawn from a
  log-normal distribution (long tail). Every turn that calls a tool hints
  ``cache_ttl_s``: the application's estimate of the tool's latency.
* :func:`mooncake_sessions`: a real Mooncake trace with sessions inferred from
  shared prefixes: a request whose blocks extend a whole earlier request's
  chain continues that request's session.

From the command line: ``python -m kvtier.agents.workloads KIND OUT.jsonl``
(``KIND`` one of cyclic, synthetic, tools, mooncake; ``--help`` for sizes).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvtier.agents.graph import AgentSpec, WorkflowSpec, fan_out_in, sequential
from kvtier.errors import ConfigError, KvTierError

#: Tokens per block of the generated traces.
BLOCK_SIZE = 16
SHAPES: tuple[str, ...] = ("sequential", "fanout", "cyclic")

Line = dict[str, Any]


class _Ids:
    """Fresh block ids."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def take(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def _spec_line(spec: WorkflowSpec) -> Line:
    return {
        "workflow": {
            "workflow_id": spec.workflow_id,
            "agents": [
                {
                    "agent_id": a.agent_id,
                    "after": list(a.after),
                    "join": a.join,
                    "entry": a.entry,
                    "prefix_keys": list(a.prefix_keys),
                }
                for a in spec.agents
            ],
        }
    }


def _with_prefixes(spec: WorkflowSpec, prefixes: dict[str, list[int]]) -> WorkflowSpec:
    agents = tuple(
        AgentSpec(a.agent_id, a.after, a.join, a.entry, prefix_keys=tuple(prefixes[a.agent_id]))
        for a in spec.agents
    )
    return WorkflowSpec(spec.workflow_id, agents)


def _request(ts_ms: float, ids: list[int], input_length: int, output: int, **hints: Any) -> Line:
    line: Line = {
        "timestamp": round(ts_ms, 3),
        "input_length": input_length,
        "output_length": output,
        "hash_ids": ids,
    }
    line.update({k: v for k, v in hints.items() if v is not None})
    return line


def cyclic_workflow(
    agents: int = 10,
    prompt_tokens: int = 512,
    rounds: int = 20,
    *,
    suffix_tokens: int = 0,
    answer_tokens: tuple[int, int] = (0, 0),
    step_seconds: float = 1.0,
    seed: int = 0,
) -> list[Line]:
    """One agent loop: each step's prompt is the agent's fixed prompt plus fresh tokens.

    With ``suffix_tokens`` (and ``answer_tokens``, a range drawn per step)
    each step appends that many fresh tokens after the fixed prompt: the
    step's own input and a short answer, blocks no later step uses. Without
    them (the default) every step's prompt is exactly the fixed prompt.
    """
    if agents < 2 or prompt_tokens < BLOCK_SIZE or rounds < 1:
        raise ConfigError("a cyclic workflow needs 2+ agents, a prompt of a block, 1+ rounds")
    if suffix_tokens < 0 or not 0 <= answer_tokens[0] <= answer_tokens[1]:
        raise ConfigError("suffix_tokens and the answer_tokens range must be >= 0")
    rng = random.Random(seed)
    ids = _Ids()
    n = prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    names = [f"agent{i}" for i in range(agents)]
    prefixes = {a: ids.take(n // BLOCK_SIZE) for a in names}
    spec = _with_prefixes(sequential("loop", names, cyclic=True), prefixes)
    lines: list[Line] = [_spec_line(spec)]
    for step in range(agents * rounds):
        a = names[step % agents]
        fresh = suffix_tokens + rng.randint(*answer_tokens)
        total = n + fresh
        blocks = prefixes[a] + ids.take(_blocks(total) - len(prefixes[a]))
        lines.append(
            _request(
                1000.0 * step * step_seconds, blocks, total, 0,
                workflow_id="loop", agent_id=a, step=step,
            )
        )  # fmt: skip
    return lines


def _shape(wid: str, shape: str, n: int) -> tuple[WorkflowSpec, list[list[str]]]:
    """A workflow of ``shape`` with ``n`` agents, and one run's steps (grouped as they run)."""
    names = [f"{wid}.a{i}" for i in range(n)]
    if shape == "fanout":
        head, tail, workers = names[0], names[-1], names[1:-1]
        base = fan_out_in(wid, head, workers, tail)
        # Runs repeat: the tail hands back to the head.
        agents = [
            AgentSpec(head, (tail,), entry=True),
            *[a for a in base.agents if a.agent_id not in (head,)],
        ]
        return WorkflowSpec(wid, tuple(agents)), [[head], workers, [tail]]
    # A pipeline run again is a loop through its agents; so is a cycle.
    return sequential(wid, names, cyclic=True), [[a] for a in names]


def synthetic_workflows(
    workflows: int = 16,
    *,
    shapes: Sequence[str] = SHAPES,
    agents: tuple[int, int] = (4, 8),
    prompt_tokens: tuple[int, int] = (500, 4000),
    dynamic_tokens: tuple[int, int] = (64, 256),
    runs: int = 6,
    step_seconds: tuple[float, float] = (1.0, 4.0),
    seed: int = 0,
) -> list[Line]:
    """Many concurrent workflows of KVFlow's shapes (see the module docstring)."""
    for s in shapes:
        if s not in SHAPES:
            raise ConfigError(f"unknown workflow shape {s!r}; choose from {', '.join(SHAPES)}")
    if workflows < 1 or runs < 1 or agents[0] < 3:
        raise ConfigError("synthetic workflows need 1+ workflows, 1+ runs and 3+ agents each")
    rng = random.Random(seed)
    ids = _Ids()
    lines: list[Line] = []
    plans: list[tuple[str, list[list[str]], dict[str, list[int]], dict[str, int]]] = []
    for w in range(workflows):
        wid = f"wf{w}"
        shape = shapes[w % len(shapes)]
        spec, order = _shape(wid, shape, rng.randint(*agents))
        prefixes: dict[str, list[int]] = {}
        lengths: dict[str, int] = {}
        for a in spec.agents:
            tokens = rng.randint(*prompt_tokens) // BLOCK_SIZE * BLOCK_SIZE
            prefixes[a.agent_id] = ids.take(tokens // BLOCK_SIZE)
            lengths[a.agent_id] = tokens
        lines.append(_spec_line(_with_prefixes(spec, prefixes)))
        plans.append((wid, order, prefixes, lengths))
    # Each workflow walks its steps; a group's agents run one after another here.
    events: list[tuple[float, int, int, int]] = []  # (time, tie, workflow, position)
    tie = itertools.count()
    for w in range(workflows):
        heapq.heappush(events, (rng.uniform(0, step_seconds[1]), next(tie), w, 0))
    steps = {w: 0 for w in range(workflows)}
    while events:
        t, _, w, pos = heapq.heappop(events)
        wid, order, prefixes, lengths = plans[w]
        flat = [a for group in order for a in group]
        run, i = divmod(pos, len(flat))
        if run >= runs:
            continue
        agent = flat[i]
        dyn = rng.randint(*dynamic_tokens)
        n = lengths[agent] + dyn
        lines.append(
            _request(
                1000.0 * t,
                prefixes[agent] + ids.take(_blocks(n) - len(prefixes[agent])),
                n,
                dyn,
                workflow_id=wid,
                agent_id=agent,
                step=steps[w],
            )
        )
        steps[w] += 1
        heapq.heappush(events, (t + rng.uniform(*step_seconds), next(tie), w, pos + 1))
    return lines


def tool_sessions(
    sessions: int = 60,
    *,
    system_tokens: int = 1500,
    turns: tuple[int, int] = (3, 8),
    user_tokens: tuple[int, int] = (30, 200),
    reply_tokens: tuple[int, int] = (40, 300),
    tool_result_tokens: tuple[int, int] = (50, 800),
    tool_latency_median_s: float = 3.0,
    tool_latency_sigma: float = 1.0,
    arrival_s: float = 2.0,
    ttl_error: float = 0.5,
    seed: int = 0,
) -> list[Line]:
    """Tool-calling sessions with injected tool latency (see the module docstring).

    Tool latencies are log-normal (median ``tool_latency_median_s``, shape
    ``tool_latency_sigma``); sessions arrive every ``arrival_s`` seconds on
    average. The hinted TTL is the true latency times a factor drawn from
    ``[1 - ttl_error, 1 + ttl_error]`` (the application's estimate), so some
    pins run out before the session comes back.
    """
    if sessions < 1 or turns[0] < 1 or system_tokens < BLOCK_SIZE:
        raise ConfigError("tool sessions need 1+ sessions, 1+ turns and a system prompt")
    rng = random.Random(seed)
    ids = _Ids()
    system = ids.take(system_tokens // BLOCK_SIZE)
    sys_len = len(system) * BLOCK_SIZE
    events: list[tuple[float, int, int]] = []
    tie = itertools.count()
    state: dict[int, dict[str, Any]] = {}
    t = 0.0
    for s in range(sessions):
        t += rng.expovariate(1.0 / arrival_s)
        n_turns = rng.randint(*turns)
        state[s] = {"turn": 0, "turns": n_turns, "blocks": list(system), "tokens": sys_len}
        heapq.heappush(events, (t, next(tie), s))
    lines: list[Line] = []
    while events:
        t, _, s = heapq.heappop(events)
        st = state[s]
        # The new turn: a user message (first turn) or the tool's result.
        grow = rng.randint(*(user_tokens if st["turn"] == 0 else tool_result_tokens))
        n = st["tokens"] + grow
        # Blocks are prefix-chained: the old partial tail block changes when the prompt grows.
        full_old = st["tokens"] // BLOCK_SIZE
        blocks = st["blocks"][:full_old] + ids.take(_blocks(n) - full_old)
        reply = rng.randint(*reply_tokens)
        last = st["turn"] + 1 >= st["turns"]
        latency = rng.lognormvariate(math.log(tool_latency_median_s), tool_latency_sigma)
        ttl = None if last else round(latency * rng.uniform(1 - ttl_error, 1 + ttl_error), 3)
        lines.append(_request(1000.0 * t, blocks, n, reply, session_id=f"s{s}", cache_ttl_s=ttl))
        if last:
            continue
        # The reply (the tool call) joins the conversation; the next turn starts after the tool.
        total = n + reply
        st["blocks"] = blocks[: n // BLOCK_SIZE] + ids.take(_blocks(total) - n // BLOCK_SIZE)
        st["tokens"] = total
        st["turn"] += 1
        decode_s = reply * 0.02
        heapq.heappush(events, (t + decode_s + latency, next(tie), s))
    return lines


def mooncake_sessions(lines: Iterable[Line]) -> list[Line]:
    """Mooncake lines with ``session_id`` inferred: extending a whole earlier chain continues it."""
    out: list[Line] = []
    sessions: dict[int, str] = {}  # last block id of a request's chain -> its session
    count = itertools.count()
    for line in lines:
        ids = line.get("hash_ids")
        if not isinstance(ids, list):
            out.append(line)
            continue
        session = None
        # The longest earlier chain this request extends (its last id is a prefix end).
        for i in range(len(ids) - 1, -1, -1):
            session = sessions.get(ids[i])
            if session is not None:
                break
        if session is None:
            session = f"m{next(count)}"
        if ids:
            sessions[ids[-1]] = session
        out.append({**line, "session_id": session})
    return out


def read_lines(path: str | Path) -> Iterator[Line]:
    with open(path, encoding="utf-8") as fh:
        for raw in fh:
            if raw.strip():
                yield json.loads(raw)


def write_trace(lines: Iterable[Line], path: str | Path) -> Path:
    """Write trace lines as JSONL; returns the path."""
    p = Path(path)
    with p.open("w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")
    return p


KINDS: tuple[str, ...] = ("cyclic", "synthetic", "tools", "mooncake")


def main(argv: Sequence[str] | None = None) -> int:
    """Write one agent workload as a trace file (see the module docstring)."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(
        prog="python -m kvtier.agents.workloads",
        description="Write an agent workload as a trace for kvtier replay.",
    )
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("out", help="the JSONL trace to write")
    ap.add_argument(
        "-n", type=int, default=None,
        help="agents (cyclic, default 10), workflows (synthetic, 16) or sessions (tools, 60)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", help="the Mooncake trace to infer sessions in (mooncake)")
    args = ap.parse_args(argv)
    try:
        if args.kind == "cyclic":
            lines = cyclic_workflow(args.n or 10)
        elif args.kind == "synthetic":
            lines = synthetic_workflows(args.n or 16, seed=args.seed)
        elif args.kind == "tools":
            lines = tool_sessions(args.n or 60, seed=args.seed)
        else:
            if not args.trace:
                raise ConfigError("mooncake needs --trace FILE (a Mooncake JSONL trace)")
            lines = mooncake_sessions(read_lines(args.trace))
    except (KvTierError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    path = write_trace(lines, args.out)
    block = 512 if args.kind == "mooncake" else BLOCK_SIZE
    print(f"wrote {path} ({len(lines)} lines); replay it with: "
          f"kvtier replay {path} --block-size {block} --policy lru workflow")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
