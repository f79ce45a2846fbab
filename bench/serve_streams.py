"""Concurrent streams through ``kvtier serve`` with its defaults, and what one decode step costs.

Two parts, on the bundled SmolLM2-135M-Instruct:

* **serving**: starts a real ``kvtier serve`` process with its default
  flags, then for each concurrency (1, 8, 16 by default) runs that many
  clients at once, each sending ``--requests-per-stream`` chat completions
  one after another with the official ``openai`` client (streamed, distinct
  prompts, ``max_tokens`` 64, temperature 0). Per concurrency: completion
  tokens per second of wall time (from each response's ``usage``), the ratio
  to one stream, and p50/p99 time to first token.
* **decode step**: in this process, an engine with the same defaults holds
  exactly 1, 8 and 16 running sequences past their prompts and times
  ``Engine.step()`` against the model's forward inside it (the model is
  wrapped in a timer). What is not the forward is the engine's Python work
  per step: scheduling, metadata, sampling, detokenizing. ``--profile``
  also prints the top functions of a cProfile of those steps.

Prints tables; writes ``bench/results/serve_streams.json`` (``--out``).
``--quick`` runs 1 and 8 streams, one request each, and fewer steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import REPO, format_table, git_state, log, machine_info, package_version, write_json

# Imported before the server part runs, so the decode-step part measures the same source.
import kvtier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model import load_model

MAX_TOKENS = 64

TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "the history of the bicycle",
    "how bread rises",
    "a robot learning to paint",
    "the water cycle",
    "a city built on stilts",
    "why the sky is blue",
    "a cat who runs a bakery",
    "the first trip to the moon",
    "how a compass works",
    "a dragon afraid of heights",
    "the life of a honeybee",
    "a train that never stops",
    "how volcanoes form",
    "a library under the sea",
    "the invention of paper",
)


def prompt(i: int, concurrency: int) -> str:
    """A distinct prompt per request: a different topic and number, so no two share a prefix."""
    topic = TOPICS[i % len(TOPICS)]
    return f"Request {concurrency}-{i}. Write a long, detailed story about {topic}."


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """``rows`` as a text table: ``(key, header, format)`` per column (``-`` for missing)."""
    cells = [
        ["-" if row.get(k) is None else format(row[k], f) for k, _, f in columns] for row in rows
    ]
    return format_table([h for _, h, _ in columns], cells)


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


# -- serving ---------------------------------------------------------------------------------
class StepLog:
    """The server's periodic ``engine: N steps ...`` lines (what its steps cost), as they come."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def follow(self, stream: Any) -> None:
        for line in stream:
            if "engine: " in line and " steps of " in line:
                with self._lock:
                    self.lines.append(line.split("engine: ", 1)[1].strip())

    def take(self) -> list[str]:
        with self._lock:
            out, self.lines = self.lines, []
        return out


def start_server(steps: StepLog) -> tuple[subprocess.Popen[str], int, list[str]]:
    """``kvtier serve`` with its defaults on a free loopback port; returns once it serves."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    banner: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        banner.append(line.rstrip("\n"))
        if line.startswith("kvtier: serving"):
            break
    else:
        raise SystemExit("kvtier serve exited before serving:\n" + "\n".join(banner))
    threading.Thread(target=steps.follow, args=(proc.stdout,), daemon=True).start()
    return proc, port, banner


def stream_one(client: Any, model: str, text: str) -> dict[str, Any]:
    """One streamed chat completion: its time to first token, tokens and wall time."""
    t0 = time.perf_counter()
    first: float | None = None
    usage = None
    chunks = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in chunks:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    return {
        "ttft_s": None if first is None else first - t0,
        "completion_tokens": 0 if usage is None else usage.completion_tokens,
        "seconds": end - t0,
    }


def serve_runs(concurrencies: list[int], per_stream: int) -> tuple[list[dict[str, Any]], list[str]]:
    import openai

    steps = StepLog()
    proc, port, banner = start_server(steps)
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=900
        )
        model = client.models.list().data[0].id
        stream_one(client, model, "Warm up: say hello.")
        steps.take()
        rows: list[dict[str, Any]] = []
        for c in concurrencies:
            log(f"serving: {c} concurrent streams x {per_stream} requests")

            def client_loop(k: int, c: int = c) -> list[dict[str, Any]]:
                return [
                    stream_one(client, model, prompt(k * per_stream + j, c))
                    for j in range(per_stream)
                ]

            started = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                results = [r for rs in pool.map(client_loop, range(c)) for r in rs]
            wall = time.perf_counter() - started
            tokens = sum(r["completion_tokens"] for r in results)
            ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
            rows.append(
                {
                    "streams": c,
                    "requests": len(results),
                    "completion_tokens": tokens,
                    "wall_s": wall,
                    "completion_tokens_per_s": tokens / wall,
                    "ttft_p50_s": pct(ttfts, 50),
                    "ttft_p99_s": pct(ttfts, 99),
                    # The server logs what its steps cost every 10 s of work: these
                    # lines came while this concurrency ran (one may straddle two).
                    "server_step_log": steps.take(),
                }
            )
        base = rows[0]["completion_tokens_per_s"] if rows and rows[0]["streams"] == 1 else None
        for row in rows:
            row["ratio_vs_1"] = None if base is None else row["completion_tokens_per_s"] / base
        return rows, banner
    finally:
        proc.terminate()
        proc.wait(60)


# -- one decode step -------------------------------------------------------------------------
class TimedModel:
    """The model, with the seconds its forward calls took added up."""

    def __init__(self, model: Any) -> None:
        self.inner = model
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def step_profile(
    sizes: list[int], steps: int, profile: bool
) -> tuple[list[dict[str, Any]], dict[str, str], int]:
    """Decode steps at each batch size: step time, forward time, the rest (Python overhead)."""
    loaded = load_model(None)
    tok = loaded.tokenizer
    # The defaults but for max_num_seqs, which must admit the largest batch measured.
    engine = Engine(loaded.model, tok, model_id=loaded.model_id, max_num_seqs=max(sizes))
    timed = TimedModel(engine.model)
    engine.model = timed
    rows: list[dict[str, Any]] = []
    profiles: dict[str, str] = {}
    # The first passes of a process are slow (weights and the KV pool paged in): one
    # throwaway request first, so the first size measured is not charged for them.
    warm = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for _ in engine.generate(engine.encode_chat([{"role": "user", "content": "Hi"}]), warm):
        pass
    for n in sizes:
        # Enough tokens for warm-up plus the timed steps, and EOS ignored: all n stay running.
        params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        for i in range(n):
            engine.add_request(
                engine.encode_chat([{"role": "user", "content": prompt(i, n)}]), params
            )
        while engine.num_waiting or any(
            s.computed < len(s.prompt_ids) for s in engine.queues.running
        ):
            engine.step()
        for _ in range(3):  # warm-up decode steps
            engine.step()
        assert engine.num_running == n, (engine.num_running, n)
        prof = cProfile.Profile() if profile else None
        timed.seconds = 0.0
        total = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            engine.step()
            if prof is not None:
                prof.disable()
            total += time.perf_counter() - t0
        forward = timed.seconds
        rows.append(
            {
                "sequences": n,
                "steps": steps,
                "step_s": total / steps,
                "forward_s": forward / steps,
                "overhead_s": (total - forward) / steps,
                "overhead_fraction": (total - forward) / total,
            }
        )
        if prof is not None:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            profiles[str(n)] = buf.getvalue()
        while engine.has_unfinished():
            engine.step()
    engine.close()
    # What the defaults give (the scheduler limits are resolved while the engine is built).
    default = Engine(loaded.model, tok, model_id=loaded.model_id)
    auto = default.max_num_seqs
    default.close()
    return rows, profiles, auto


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--step-sizes", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the steps")
    parser.add_argument("--no-serve", action="store_true", help="only the decode-step part")
    parser.add_argument("--no-steps", action="store_true", help="only the serving part")
    parser.add_argument("--quick", action="store_true", help="1 and 8 streams, one request each")
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "serve_streams.json"
    )
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.quick:
        args.streams, args.requests_per_stream, args.steps = [1, 8], 1, 8
    serving: list[dict[str, Any]] = []
    banner: list[str] = []
    if not args.no_serve:
        serving, banner = serve_runs(args.streams, args.requests_per_stream)
        print("kvtier serve (defaults), openai client, streamed chat, max_tokens 64, temperature 0")
        print(
            table(
                serving,
                [
                    ("streams", "streams", "d"),
                    ("requests", "requests", "d"),
                    ("completion_tokens", "tokens", "d"),
                    ("wall_s", "wall s", ".1f"),
                    ("completion_tokens_per_s", "tok/s", ".1f"),
                    ("ratio_vs_1", "x 1 stream", ".2f"),
                    ("ttft_p50_s", "TTFT p50 s", ".3f"),
                    ("ttft_p99_s", "TTFT p99 s", ".3f"),
                ],
            )
        )
    for row in serving:
        for line in row["server_step_log"]:
            print(f"  server, {row['streams']} streams: {line}")
    steps: list[dict[str, Any]] = []
    profiles: dict[str, str] = {}
    auto = None
    if not args.no_steps:
        steps, profiles, auto = step_profile(args.step_sizes, args.steps, args.profile)
        print(f"\ndecode steps (the defaults give max_num_seqs {auto}), model forward timed inside")
        print(
            table(
                steps,
                [
                    ("sequences", "sequences", "d"),
                    ("step_s", "step s", ".4f"),
                    ("forward_s", "forward s", ".4f"),
                    ("overhead_s", "overhead s", ".4f"),
                    ("overhead_fraction", "overhead", ".1%"),
                ],
            )
        )
        for n, text in profiles.items():
            print(f"\ncProfile of {args.steps} decode steps at {n} sequences (by own time):")
            print(text)
    write_json(
        args.out,
        {
            "benchmark": "serve_streams",
            "machine": machine_info(),
            "git": git_state(REPO),
            # The package the numbers come from (PYTHONPATH may point at another checkout).
            "kvtier_source": str(Path(kvtier.__file__).parent),
            "versions": {p: package_version(p) for p in ("torch", "transformers", "openai")},
            "max_tokens": MAX_TOKENS,
            "requests_per_stream": args.requests_per_stream,
            "server_banner": banner,
            "serving": serving,
            "engine_max_num_seqs": auto,
            "decode_steps": steps,
            "profiles": profiles,
        },
    )
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
