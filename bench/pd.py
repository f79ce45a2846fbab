"""Prefill/decode disaggregation under a mixed load: one ``kvtier serve`` against a P/D pair.

On the bundled SmolLM2-135M-Instruct, two set-ups serve the same load:

* **single**: one ``kvtier serve`` (``--role both``, the default) doing
  every prefill and every decode;
* **pd**: ``kvtier serve --role prefill`` and ``kvtier serve --role decode``
  sharing a ``redis-server`` this script starts, behind vllm-router in its
  P/D mode (``--vllm-pd-disaggregation``), which sends each request to the
  prefill server (``max_tokens`` 1) and then, with the ``kv_transfer_params``
  it answered, to the decode server.

The load (``--duration`` seconds): ``--decoders`` clients each stream
completions of a short prompt with ``--decode-tokens`` tokens, one after
another, while long prompts (about ``--long-words`` words, each one
distinct so nothing is cached) arrive every ``--long-every`` seconds, each
generating ``--long-tokens`` tokens. Every request is streamed; its time to
first token (TTFT) and the gaps between its streamed tokens (inter-token
latency, ITL) are measured at the client. Printed per set-up and kind of
request: p50 and p99 TTFT and ITL; written to ``bench/results/pd.json``
(``--out``).

Both set-ups run on the same machine, so on a small one the prefill and
decode servers share its cores: the pair's processes get
``--threads-per-server`` torch threads each (default: cores / 2) and the
single server all the cores (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _common import REPO, format_table, git_state, log, machine_info, package_version, write_json

WORDS = (
    "archive", "lighthouse", "keeper", "letter", "harbour", "storm", "lantern", "island",
    "ledger", "tide", "rope", "gull", "winter", "signal", "beacon", "rock", "chart", "compass",
    "voyage", "anchor", "shore", "cliff", "fog", "bell",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def long_prompt(i: int, words: int) -> str:
    """A long prompt no other request shares a prefix with (it starts with its own number)."""
    body = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))
    return f"Document {i}. {body}\nSummarise the document above in one sentence."


# -- processes ------------------------------------------------------------------------------


class Proc:
    """A child process whose output is drained on a thread (kept for errors)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("kvtier: serving"):
                self.url = line.split(" at ", 1)[1].split(" ", 1)[0].removesuffix("/v1")
                self.ready.set()
        self.ready.set()

    def wait_serving(self, timeout: float = 600) -> str:
        self.ready.wait(timeout)
        if not self.url:
            raise SystemExit(f"{self.name} did not start:\n{''.join(self.lines[-30:])}")
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve(name: str, threads: int, *flags: str) -> Proc:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    argv = [sys.executable, "-m", "kvtier.cli", "serve", "--port", "0", "--log-level", "warning"]
    return Proc(name, [*argv, *flags], env)


def wait_http(url: str, proc: Proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                why = "".join(proc.lines)
                raise SystemExit(f"{proc.name} did not answer {url}:\n{why}") from None
            time.sleep(0.1)


@contextmanager
def single(args: argparse.Namespace) -> Iterator[str]:
    server = serve("kvtier serve", args.threads_single, *args.serve_flags)
    try:
        yield server.wait_serving()
    finally:
        server.stop()


@contextmanager
def pair(args: argparse.Namespace) -> Iterator[str]:
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise SystemExit("the P/D set-up needs redis-server on PATH (apt-get install redis-server)")
    procs: list[Proc] = []
    workdir = tempfile.mkdtemp(prefix="kvtier-pd-bench-")
    try:
        rport = free_port()
        redis = Proc(
            "redis-server",
            [redis_bin, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir],
            dict(os.environ),
        )  # fmt: skip
        procs.append(redis)
        time.sleep(0.5)
        tier = ["--tier", f"redis://127.0.0.1:{rport}/0"]
        t = args.threads_per_server
        prefill = serve("prefill", t, "--role", "prefill", *tier, *args.serve_flags)
        decode = serve("decode", t, "--role", "decode", *tier, *args.serve_flags)
        procs += [prefill, decode]
        purl, durl = prefill.wait_serving(), decode.wait_serving()
        port = free_port()
        router = Proc(
            "vllm-router",
            [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--vllm-pd-disaggregation", "--prefill", purl,
             "--decode", durl, "--policy", "round_robin", "--prometheus-port", str(free_port()),
             "--worker-startup-check-interval", "1", "--log-level", "warning"],
            dict(os.environ),
        )  # fmt: skip
        procs.append(router)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/v1/models", router)
        yield url
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# -- load -----------------------------------------------------------------------------------


def stream(client: Any, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: TTFT and the gaps between its tokens, at the client."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return {
        "ttft_s": stamps[0] - t0 if stamps else None,
        "itl_s": [b - a for a, b in itertools.pairwise(stamps)],
        "tokens": len(stamps),
    }


def run_load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    stream(client, model, "Warm up.", 4)
    stream(client, model, long_prompt(-1, args.long_words), 2)
    results: dict[str, list[dict[str, Any]]] = {"decode": [], "long": []}
    lock = threading.Lock()
    stop_at = time.monotonic() + args.duration

    def decoder(k: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            text = f"Client {k}, story {i}: tell me about the lighthouse keeper's winter."
            r = stream(client, model, text, args.decode_tokens)
            with lock:
                results["decode"].append(r)
            i += 1

    def longs() -> None:
        i = 0
        threads = []
        while time.monotonic() < stop_at:

            def one(i: int = i) -> None:
                r = stream(client, model, long_prompt(i, args.long_words), args.long_tokens)
                with lock:
                    results["long"].append(r)

            th = threading.Thread(target=one)
            th.start()
            threads.append(th)
            i += 1
            time.sleep(args.long_every)
        for th in threads:
            th.join()

    workers = [threading.Thread(target=decoder, args=(k,)) for k in range(args.decoders)]
    workers.append(threading.Thread(target=longs))
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - started
    out: dict[str, Any] = {"wall_s": wall}
    for kind, rs in results.items():
        ttft = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        itl = [g for r in rs for g in r["itl_s"]]
        out[kind] = {
            "requests": len(rs),
            "tokens": sum(r["tokens"] for r in rs),
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50),
            "itl_p99_s": pct(itl, 99),
        }
    out["tokens_per_s"] = sum(out[k]["tokens"] for k in results) / wall
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Example: python bench/pd.py --duration 40 --decoders 4",
    )
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of load per set-up")
    parser.add_argument("--decoders", type=int, default=4, help="clients streaming short prompts")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens per short request")
    parser.add_argument("--long-words", type=int, default=300, help="words per long prompt")
    parser.add_argument("--long-every", type=float, default=5.0, help="seconds between long ones")
    parser.add_argument("--long-tokens", type=int, default=8, help="tokens per long request")
    cores = os.cpu_count() or 2
    parser.add_argument(
        "--threads-single", type=int, default=cores, help="torch threads of the single server"
    )
    parser.add_argument(
        "--threads-per-server",
        type=int,
        default=max(1, cores // 2),
        help="torch threads of each server of the pair",
    )
    parser.add_argument("--setups", nargs="+", choices=("single", "pd"), default=["single", "pd"])
    parser.add_argument(
        "--serve-flag",
        dest="serve_flags",
        action="append",
        default=[],
        metavar="FLAG",
        help="an extra kvtier serve flag for every server, e.g. --serve-flag=--block-size=32",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pd.json")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for name in args.setups:
        log(f"{name}: starting")
        with (single if name == "single" else pair)(args) as url:
            log(f"{name}: {args.duration:g}s of mixed load at {url}")
            result = run_load(url, args)
        rows.append({"setup": name, **result})

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    headers = ["set-up", "kind", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
               "ITL p99 ms"]  # fmt: skip
    cells = [
        [r["setup"], kind, r[kind]["requests"], ms(r[kind]["ttft_p50_s"]),
         ms(r[kind]["ttft_p99_s"]), ms(r[kind]["itl_p50_s"]), ms(r[kind]["itl_p99_s"])]
        for r in rows
        for kind in ("decode", "long")
    ]  # fmt: skip
    print(format_table(headers, cells))
    for r in rows:
        print(f"{r['setup']}: {r['tokens_per_s']:.1f} streamed tokens/s over {r['wall_s']:.0f}s")
    write_json(
        args.out,
        {
            "benchmark": "pd",
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "machine": machine_info(),
            "git": git_state(REPO),
            "vllm_router": package_version("vllm-router"),
            "results": rows,
        },
    )
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
