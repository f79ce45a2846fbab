"""A 4-agent loop on ``kvtier serve`` through the official openai client, with and without hints.

Four agents (planner, coder, tester, reviewer) take turns, round after round;
each has a long fixed system prompt, and each step's user message is the
previous agent's reply. The server's device cache holds about two and a half
of the agents' prompts, so a recency-based cache always evicts the prompt
needed next. The script runs the loop twice, each time on a fresh server
started with the same flags (``--policy workflow`` and a host tier with
prefetch):

* without hints: plain requests, and the workflow policy falls back to LRU;
* with hints: the workflow is registered (``POST /v1/workflows``) and every
  request carries ``{"kvtier": {"workflow_id", "agent_id", "step"}}`` through
  ``extra_body``, so the server keeps (or prefetches) the prompt of the agent
  due next.

It prints each step's time to first token (streamed; the first content
chunk) and prompt tokens served from cache, then the medians after the first
round. Run it from a checkout with the serve extra installed::

    python examples/agent_loop.py --rounds 4
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import openai

AGENTS = ("planner", "coder", "tester", "reviewer")
WORDS = (
    "cache", "block", "prefix", "agent", "tool", "plan", "review", "test", "code", "memory",
    "latency", "token", "request", "policy", "workflow", "step", "queue", "tier", "host", "disk",
)  # fmt: skip


def system_prompt(agent: str, words: int) -> str:
    """A long, fixed, agent-specific instruction text (deterministic)."""
    body = " ".join(WORDS[(i * 7 + len(agent) * 3 + i // 5) % len(WORDS)] for i in range(words))
    return f"You are the {agent} of a software team. Follow these notes exactly: {body}."


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable, "-m", "kvtier.cli", "serve", "--port", "0",
        "--policy", "workflow", "--num-blocks", str(args.num_blocks),
        "--host-tier", "1GiB", "--prefetch-lookahead", "1", "--max-num-seqs", "1",
        "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line.rstrip(), file=sys.stderr)
        m = re.search(r"serving \S+ at (\S+)/v1", line)
        if m:
            return proc, m.group(1)
    raise SystemExit(f"kvtier serve exited with status {proc.wait()}")


def run_loop(args: argparse.Namespace, hinted: bool) -> list[dict[str, Any]]:
    proc, base = start_server(args)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id
        systems = {a: system_prompt(a, args.prompt_words) for a in AGENTS}
        if hinted:
            spec = {
                "workflow_id": "team",
                "agents": [
                    {"agent_id": a, "after": [AGENTS[i - 1]], "entry": i == 0,
                     "prefix_messages": [{"role": "system", "content": systems[a]}]}
                    for i, a in enumerate(AGENTS)
                ],
            }  # fmt: skip
            httpx.post(f"{base}/v1/workflows", json=spec, timeout=60).raise_for_status()
        message = "Write a function that adds two numbers."
        steps: list[dict[str, Any]] = []
        for step in range(args.rounds * len(AGENTS)):
            agent = AGENTS[step % len(AGENTS)]
            hints = {"workflow_id": "team", "agent_id": agent, "step": step}
            start = time.perf_counter()
            ttft = None
            text: list[str] = []
            cached = 0
            stream = client.chat.completions.create(
                model=model,
                messages=[
                    {"role": "system", "content": systems[agent]},
                    {"role": "user", "content": message},
                ],
                max_tokens=args.max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"kvtier": hints} if hinted else None,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                    cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
            message = "".join(text).strip() or "Go on."
            steps.append({"step": step, "agent": agent, "ttft_s": ttft, "cached": cached})
            # The agent's own work (a tool call, parsing the reply) before the next step.
            time.sleep(args.think_s)
        return steps
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=220, help="words per system prompt")
    ap.add_argument("--num-blocks", type=int, default=56, help="device KV blocks of 16 tokens")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--think-s", type=float, default=0.2, help="pause between steps")
    args = ap.parse_args()
    runs = {"without hints": run_loop(args, False), "with hints": run_loop(args, True)}
    plain, hinted = runs["without hints"], runs["with hints"]
    print(f"{'step':>4}  {'agent':<9} {'TTFT no hints':>14} {'cached':>7} "
          f"{'TTFT hints':>11} {'cached':>7}")  # fmt: skip
    for a, b in zip(plain, hinted, strict=True):
        print(f"{a['step']:>4}  {a['agent']:<9} {1000 * a['ttft_s']:>11.0f} ms {a['cached']:>7} "
              f"{1000 * b['ttft_s']:>8.0f} ms {b['cached']:>7}")  # fmt: skip
    later = len(AGENTS)  # the first round is cold either way
    for name, steps in runs.items():
        rest = steps[later:]
        med = statistics.median(s["ttft_s"] for s in rest)
        cached = sum(s["cached"] for s in rest) / len(rest)
        print(f"{name}: median TTFT after round 1 {1000 * med:.0f} ms, "
              f"{cached:.0f} cached prompt tokens a step")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
