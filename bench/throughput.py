"""Throughput and latency under concurrent streams, on the real model: batched vs one-at-a-time.

The workload: ``--streams`` clients (1, 4, 8, 16), each sending
``--requests-per-stream`` requests one after another (a closed loop: a
client's next request arrives when its previous one finished). Every prompt
is 256 tokens, a 128-token system prompt shared by all plus 128 tokens of
its own; every request generates exactly 64 tokens (greedy, EOS ignored).
Systems, in one process on the same SmolLM2-135M weights:

* ``kvtier batched``: the engine, one forward pass per step over every
  running request (continuous batching), ``max_num_seqs`` = streams,
  ``max_num_batched_tokens`` 512;
* ``kvtier sequential``: the same engine as it was before continuous
  batching (commit ``SEQUENTIAL_REV``: one sequence per forward pass,
  requests interleaved), loaded from the repository's history;
* ``transformers CB``: transformers' own continuous batching
  (``ContinuousBatchingManager``, SDPA, prefix sharing on), the same
  concurrency and token budget.

Per system and concurrency: aggregate decode throughput (generated tokens
per second of the run's wall time), time to first token (arrival to first
token) and inter-token latency (gaps between a request's tokens), p50 and
p99. ``--http`` adds a run of 64 concurrent clients through a real
``kvtier serve`` process with the official ``openai`` client: every request
must be answered.

Run ``python bench/throughput.py --help``; ``--quick`` is a short smoke run.
Results go to ``bench/results/throughput.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import (
    REPO,
    format_markdown_table,
    format_table,
    git_state,
    machine_info,
    package_version,
    write_json,
)

from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model import DEFAULT_MODEL_ID, load_model

#: The engine before continuous batching: one sequence per forward pass.
SEQUENTIAL_REV = "0e97cbe"
SYSTEM_TOKENS = 128
OWN_TOKENS = 128
OUTPUT_TOKENS = 64
BUDGET = 512

TEXT = (
    "Prefix caching keeps the attention keys and values of a prompt's blocks after the request "
    "that computed them ends, so that a later request starting with the same tokens reuses them "
    "instead of computing them again. Eviction policies decide which blocks stay when memory runs "
    "out; tiers below the device hold what the device cannot. "
)


@dataclass
class Timeline:
    """When one request arrived and when each of its tokens came out."""

    arrival: float
    tokens: list[float] = field(default_factory=list)


@dataclass
class Run:
    system: str
    streams: int
    wall_s: float
    generated: int
    timelines: list[Timeline]

    def row(self) -> dict[str, Any]:
        ttft = sorted(t.tokens[0] - t.arrival for t in self.timelines if t.tokens)
        itl = sorted(
            b - a for t in self.timelines for a, b in zip(t.tokens, t.tokens[1:], strict=False)
        )
        return {
            "system": self.system,
            "streams": self.streams,
            "requests": len(self.timelines),
            "generated_tokens": self.generated,
            "wall_s": self.wall_s,
            "decode_tokens_per_s": self.generated / self.wall_s,
            "ttft_p50_s": _pct(ttft, 50),
            "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_s": _pct(itl, 50),
            "itl_p99_s": _pct(itl, 99),
        }


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


def make_prompts(tok: Any, n: int) -> list[list[int]]:
    """``n`` prompts: one shared 128-token system prompt + 128 tokens of each's own."""
    base = tok.encode(TEXT * 8, add_special_tokens=False)
    system = base[:SYSTEM_TOKENS]
    out = []
    for i in range(n):
        own = tok.encode(f"Question {i}: " + TEXT[i % 50 :] * 4, add_special_tokens=False)
        out.append(system + own[:OWN_TOKENS])
    assert all(len(p) == SYSTEM_TOKENS + OWN_TOKENS for p in out)
    return out


def drive_engine(engine: Any, prompts: list[list[int]], streams: int, per_stream: int) -> Run:
    """Closed loop over an engine's ``add_request``/``step``; returns every request's timeline."""
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    queue = list(prompts[: streams * per_stream])
    timelines: dict[str, Timeline] = {}
    started = time.perf_counter()

    def submit() -> None:
        rid = engine.add_request(queue.pop(0), params)
        timelines[rid] = Timeline(time.perf_counter())

    for _ in range(min(streams, len(queue))):
        submit()
    generated = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.token_ids:
                timelines[out.request_id].tokens.append(now)
                generated += len(out.token_ids)
            if out.finished and queue:
                submit()
    return Run("", streams, time.perf_counter() - started, generated, list(timelines.values()))


def load_sequential_engine() -> type[Any]:
    """The ``Engine`` class at ``SEQUENTIAL_REV``, from git, beside today's modules."""
    try:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{SEQUENTIAL_REV}:src/kvtier/engine/engine.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(
            f"cannot read the sequential engine at {SEQUENTIAL_REV} from git ({exc}); run from a "
            "clone with history, or pass --no-sequential"
        ) from None
    spec = importlib.util.spec_from_loader("kvtier_sequential_engine", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    exec(compile(source, f"{SEQUENTIAL_REV}:engine.py", "exec"), module.__dict__)
    engine_cls: type[Any] = module.Engine
    return engine_cls


def drive_transformers(model: Any, prompts: list[list[int]], streams: int, per_stream: int) -> Run:
    """The same closed loop through transformers' ContinuousBatchingManager."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(
        max_new_tokens=OUTPUT_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    cb = ContinuousBatchingConfig(max_requests_per_batch=streams, max_batch_tokens=BUDGET)
    model.set_attn_implementation("sdpa")  # one it supports; kvtier's engines switch back
    manager = model.init_continuous_batching(
        generation_config=gen, continuous_batching_config=cb
    )
    manager.start()
    queue = list(prompts[: streams * per_stream])
    done: list[Timeline] = []
    generated = 0
    started = time.perf_counter()
    try:
        for _ in range(min(streams, len(queue))):
            manager.add_request(queue.pop(0), max_new_tokens=OUTPUT_TOKENS, record_timestamps=True)
        total = min(streams * per_stream, len(prompts))
        while len(done) < total:
            result = manager.get_result(timeout=600)
            if result is None:
                raise SystemExit("transformers' continuous batching stopped answering")
            if not result.is_finished():
                continue
            stamps = list(result.timestamps or [])
            done.append(Timeline(result.created_time, stamps))
            generated += len(result.generated_tokens)
            if queue:
                manager.add_request(
                    queue.pop(0), max_new_tokens=OUTPUT_TOKENS, record_timestamps=True
                )
        wall = time.perf_counter() - started
    finally:
        manager.stop(block=True)
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()
    return Run("", streams, wall, generated, done)


def http_run(clients: int, max_num_seqs: int) -> dict[str, Any]:
    """``clients`` concurrent chat requests through a real ``kvtier serve`` process."""
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port)]
    command += ["--max-num-seqs", str(max_num_seqs), "--log-level", "warning"]
    proc = subprocess.Popen(
        [*command, "--pressure", "off"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("kvtier: serving"):
                break
        else:
            raise SystemExit("kvtier serve exited before serving")
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=900
        )

        def ask(i: int) -> tuple[bool, float]:
            t0 = time.perf_counter()
            r = client.chat.completions.create(
                model=DEFAULT_MODEL_ID,
                messages=[{"role": "user", "content": f"Say something about the number {i}."}],
                max_tokens=32,
                temperature=0,
            )
            ok = bool(r.choices and r.choices[0].finish_reason in ("stop", "length"))
            return ok, time.perf_counter() - t0

        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(ask, range(clients)))
        wall = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(60)
    latencies = sorted(t for _, t in results)
    return {
        "clients": clients,
        "max_num_seqs": max_num_seqs,
        "answered": sum(ok for ok, _ in results),
        "wall_s": wall,
        "latency_p50_s": _pct(latencies, 50),
        "latency_p99_s": _pct(latencies, 99),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--no-sequential", action="store_true", help="skip the old engine")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers CB")
    parser.add_argument("--http", action="store_true", help="also 64 clients over HTTP")
    parser.add_argument("--quick", action="store_true", help="1 and 4 streams, one request each")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "throughput.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.requests_per_stream = [1, 4], 1
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model()
    model, tok = loaded.model, loaded.tokenizer
    prompts = make_prompts(tok, max(args.streams) * args.requests_per_stream)
    systems: list[tuple[str, Callable[[int], Run]]] = []

    def engine_system(cls: type[Any], **extra: Any) -> Callable[[int], Run]:
        def run(streams: int) -> Run:
            engine = cls(
                model,
                tok,
                model_id=loaded.model_id,
                kv_cache_bytes=512 * 2**20,
                max_num_seqs=streams,
                **extra,
            )
            drive_engine(engine, prompts[:1], 1, 1)  # warm-up, and the shared prompt cached
            return drive_engine(engine, prompts, streams, args.requests_per_stream)

        return run

    systems.append(("kvtier batched", engine_system(Engine, max_num_batched_tokens=BUDGET)))
    if not args.no_sequential:
        systems.append(("kvtier sequential", engine_system(load_sequential_engine())))
    if not args.no_transformers:
        systems.append(
            (
                "transformers CB",
                lambda streams: drive_transformers(
                    model, prompts, streams, args.requests_per_stream
                ),
            )
        )
    rows: list[dict[str, Any]] = []
    for streams in args.streams:
        for name, run in systems:
            print(f"{name}: {streams} streams ...", file=sys.stderr, flush=True)
            result = run(streams)
            result.system = name
            rows.append(result.row())
    headers = ["system", "streams", "decode tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
    table = [
        [
            r["system"],
            r["streams"],
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['ttft_p50_s']:.3f}",
            f"{r['ttft_p99_s']:.3f}",
            f"{r['itl_p50_s']:.3f}",
            f"{r['itl_p99_s']:.3f}",
        ]
        for r in rows
    ]
    print(format_markdown_table(headers, table) if args.markdown else format_table(headers, table))
    http = http_run(64, 16) if args.http else None
    if http is not None:
        print(
            f"HTTP: {http['answered']}/{http['clients']} answered in {http['wall_s']:.1f} s "
            f"(latency p50 {http['latency_p50_s']:.1f} s, p99 {http['latency_p99_s']:.1f} s)"
        )
    write_json(
        args.out,
        {
            "machine": machine_info(),
            "git": git_state(REPO),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "transformers": package_version("transformers"),
            "workload": {
                "system_tokens": SYSTEM_TOKENS,
                "own_tokens": OWN_TOKENS,
                "output_tokens": OUTPUT_TOKENS,
                "requests_per_stream": args.requests_per_stream,
                "max_num_batched_tokens": BUDGET,
            },
            "results": rows,
            "http": http,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
