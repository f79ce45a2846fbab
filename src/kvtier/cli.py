"""The ``kvtier`` command line: ``kvtier info``, ``kvtier replay`` and ``kvtier serve``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier import __version__
from kvtier.errors import ConfigError, KvTierError
from kvtier.keys import HASH_ALGORITHMS
from kvtier.policy import available_policies, make_policy
from kvtier.pressure.detect import MONITOR_NAMES

_OPTIONAL = ("torch", "transformers", "fastapi", "redis", "vllm", "libcachesim")


def _info(args: argparse.Namespace) -> int:
    info = {
        "kvtier": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "policies": available_policies(),
        "hash_algorithms": list(HASH_ALGORITHMS),
        "optional_packages": {
            name: importlib.util.find_spec(name) is not None for name in _OPTIONAL
        },
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"kvtier {info['kvtier']} on Python {info['python']} ({info['platform']})")
    print(f"  policies:         {', '.join(info['policies'])}")
    print(f"  hash algorithms:  {', '.join(info['hash_algorithms'])}")
    extras = info["optional_packages"]
    assert isinstance(extras, dict)
    print("  optional packages:")
    for name, present in extras.items():
        print(f"    {name:<13} {'installed' if present else 'missing'}")
    return 0


_REPLAY_EPILOG = """\
trace formats (JSONL, one request per line; the first line decides; .gz is read too):
  Mooncake     {"timestamp": 0, "input_length": 6758, "output_length": 500,
                "hash_ids": [0, 1, 2, ...]}
               hash_ids name the prompt's blocks of 512 tokens, prefix-chained
               (two requests sharing their first k ids share their first k blocks);
               there are ceil(input_length / 512) ids, the last maybe partial.
  token-level  {"tokens": [101, 2023, ...], "timestamp": 0.5, "output_tokens": [...]}
               timestamp and output_tokens are optional; block keys are computed
               with kvtier's BlockHasher, blocks of --block-size tokens (default 16).
  With no TRACE, a bundled 600-request sample of the Mooncake conversation
  trace is replayed.

capacity (one or more; blocks, tokens or a share of the trace's unique blocks):
  2048, 2k     blocks (k, M, G are 1024, 1024^2, 1024^3)
  65536t, 64kt tokens, rounded down to whole blocks
  5%, 0.5%     percent of the distinct block keys in the trace
  default: 1% 5% 10%

models:
  prefix  (default) each request is allocated and freed on a real KVCacheManager
          with the policy: hits are the longest cached prefix, as in serving.
          --window K keeps up to K requests live (oldest freed first).
  block   every block access is one cache get (as in libCacheSim): hit ->
          policy.access; miss -> policy.admit, policy.evict when full,
          policy.insert. Any block can hit, chains are ignored.

metrics (totals over the trace):
  block hit   block accesses whose key was cached at access time
  prefix hit  blocks in each request's leading run of hits / its blocks
  token hit   prompt tokens served from cache / prompt tokens
  MIN         Belady's offline optimum with bypass on the same accesses: the
              upper bound on block hits; gap = MIN - policy, in points
  ops/s       block accesses replayed per second of the simulation loop

examples:
  kvtier replay
  kvtier replay trace.jsonl --policy all --capacity 1% 5% 10% --model block
  kvtier replay trace.jsonl -p lru -c 64kt 1Mt --json-out out.json --plot out.png
"""


def _policy_names(requested: Sequence[str] | None) -> list[str]:
    """Expand ``all`` and drop repeats; unknown names raise ConfigError here, early."""
    names: list[str] = []
    for name in requested or ["lru"]:
        expanded = available_policies() if name.lower() == "all" else [name]
        for n in expanded:
            if n.lower() not in (x.lower() for x in names):
                make_policy(n)  # validates the name or import path
                names.append(n)
    return names


def _trace_swallowed(args: argparse.Namespace) -> None:
    """Take the trace back from ``--policy``/``--capacity`` when it was written after them.

    Both options take several values, so ``kvtier replay -p lru arc t.jsonl``
    parses ``t.jsonl`` as a policy. An existing file there is not a policy or a
    capacity, so it can only be the trace.
    """
    if args.trace is not None:
        return
    for values in (args.policy, args.capacity):
        if values and len(values) > 1 and os.path.isfile(values[-1]):
            args.trace = values.pop()
            return


def _replay(args: argparse.Namespace) -> int:
    # Imported here so ``kvtier info`` stays fast and replay-free.
    from kvtier.replay.capacity import parse_capacity
    from kvtier.replay.progress import ProgressBar, want_progress
    from kvtier.replay.report import format_table, resolve_capacities, run_replay, to_json
    from kvtier.replay.traces import load_sample_trace, load_trace

    _trace_swallowed(args)
    policies = _policy_names(args.policy)
    capacities = [parse_capacity(c) for c in (args.capacity or ["1%", "5%", "10%"])]
    if args.window < 1:
        raise ConfigError(f"--window must be at least 1, got {args.window}")
    if args.model == "block" and args.window != 1:
        raise ConfigError("--window applies to the prefix model only")
    started = time.perf_counter()
    if args.trace is None:
        trace = load_sample_trace(block_size=args.block_size, limit=args.limit)
    else:
        trace = load_trace(args.trace, block_size=args.block_size, limit=args.limit)
    load_seconds = time.perf_counter() - started
    points = resolve_capacities(trace, capacities)
    bar = ProgressBar(
        len(policies) * len(points) * len(trace.requests), enabled=want_progress(args.progress)
    )
    try:
        report = run_replay(
            trace, policies, capacities, model=args.model, window=args.window, progress=bar
        )
    finally:
        bar.close()
    report.load_seconds = load_seconds
    data = to_json(report)
    skipped: dict[int, int] = {}
    for r in report.results:
        if r.skipped_requests:
            skipped[r.capacity_blocks] = max(skipped.get(r.capacity_blocks, 0), r.skipped_requests)
    for blocks, count in skipped.items():
        print(
            f"kvtier: warning: at {blocks} blocks, {count} of {len(trace.requests)} requests "
            "need more blocks than the cache holds; they were skipped and counted as misses",
            file=sys.stderr,
        )
    if args.json_out:
        try:
            with open(args.json_out, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=2)
                fh.write("\n")
        except OSError as exc:
            raise ConfigError(f"cannot write {args.json_out}: {exc}") from None
    if args.plot:
        from kvtier.replay.plot import plot_report

        plot_report(report, args.plot)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(format_table(report))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _add_replay(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    replay = sub.add_parser(
        "replay",
        help="replay a request trace through the cache and compare policies with MIN",
        description="Replay a request trace through kvtier's cache with one or more "
        "eviction policies at one or more capacities, next to Belady's offline optimum.",
        epilog=_REPLAY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument(
        "trace",
        nargs="?",
        metavar="TRACE",
        help="trace file (.jsonl or .jsonl.gz); default: the bundled sample",
    )
    replay.add_argument(
        "-p",
        "--policy",
        nargs="+",
        action="extend",
        metavar="P",
        help=f"policies to compare, or 'all' (registered: {', '.join(available_policies())}; "
        "also an import path pkg.mod:Class); default lru",
    )
    replay.add_argument(
        "-c",
        "--capacity",
        nargs="+",
        action="extend",
        metavar="C",
        help="cache sizes: blocks (2048), tokens (64kt) or %% of unique blocks (5%%); "
        "default 1%% 5%% 10%%",
    )
    replay.add_argument(
        "--model",
        choices=("prefix", "block"),
        default="prefix",
        help="prefix: a real KVCacheManager (default); block: block-level cache gets",
    )
    replay.add_argument(
        "--window",
        type=int,
        default=1,
        metavar="K",
        help="prefix model: requests live at once, oldest freed first (default 1)",
    )
    replay.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    replay.add_argument(
        "--block-size",
        type=int,
        metavar="TOKENS",
        help="tokens per block (default 512 for Mooncake traces, 16 for token-level ones)",
    )
    replay.add_argument("--json", action="store_true", help="print JSON instead of the table")
    replay.add_argument("--json-out", metavar="FILE", help="also write the JSON to FILE")
    replay.add_argument(
        "--plot", metavar="FILE.png", help="plot hit ratio against capacity (needs matplotlib)"
    )
    replay.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )
    replay.set_defaults(func=_replay)


_SERVE_EPILOG = """\
The server speaks OpenAI's API: point any OpenAI client at http://HOST:PORT/v1
(the API key is not checked). Besides /v1/chat/completions, /v1/completions and
/v1/models it serves /health, /metrics (Prometheus) and /v1/cache/stats (JSON:
prefix-cache hits, KV blocks, evictions).

The KV cache holds --kv-cache-memory worth of blocks of --block-size tokens
(or exactly --num-blocks); finished requests' blocks stay cached and later
requests sharing a prefix reuse them. Nothing is ever downloaded: --model is
a local Hugging Face model directory or a .gguf file.

examples:
  kvtier serve
  kvtier serve --port 9000 --kv-cache-memory 1GiB --policy arc
  kvtier serve --model ./Qwen2.5-0.5B-Instruct --served-model-name qwen --dtype bfloat16
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
"""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 10**3,
    "kib": 2**10,
    "m": 2**20,
    "mb": 10**6,
    "mib": 2**20,
    "g": 2**30,
    "gb": 10**9,
    "gib": 2**30,
    "t": 2**40,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_memory_size(text: str) -> int:
    """Bytes in ``512MiB``, ``1GiB``, ``1.5G``, ``800MB`` or ``1048576``; ConfigError otherwise.

    KiB/MiB/GiB/TiB (and the bare K/M/G/T) are powers of 1024, KB/MB/GB/TB powers of 1000.
    """
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"cannot parse memory size {text!r}: use a number of bytes with an optional unit, "
            "e.g. 512MiB, 1GiB, 1.5G, 800MB"
        )
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise ConfigError(f"memory size {text!r} must be at least 1 byte")
    return value


def _arg(parse: Callable[[str], object], what: str) -> Callable[[str], object]:
    """An argparse ``type`` that turns a ConfigError (or ValueError) into a usage error."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except (ConfigError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = what
    return convert


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"expected a positive integer, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"expected a port number in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise ConfigError(f"expected a port number in [0, 65535], got {text!r}")
    return value


def _float_in(
    what: str, low: float, high: float, *, open_low: bool = False
) -> Callable[[str], float]:
    """A parser of a number in ``[low, high]`` (``(low, high]`` when ``open_low``)."""
    bounds = f"{'(' if open_low else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not ((low < value) if open_low else (low <= value)) or not value <= high:
            raise ConfigError(f"expected a {what} in {bounds}, got {text!r}")
        return value

    return parse


def _policy_name(text: str) -> str:
    make_policy(text)  # raises ConfigError for an unknown name or import path
    return text


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on ``host:port`` (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise ConfigError(f"--host {host!r} cannot be resolved: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} "
            "(is another server using the port? pick another with --port)"
        ) from None
    sock.set_inheritable(True)
    return sock


def _client_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def _tier_specs(args: argparse.Namespace) -> list[Any]:
    """The tiers the serve flags ask for, fastest first."""
    from kvtier.offload.config import TierSpec

    specs: list[Any] = []
    if args.host_tier:
        specs.append(TierSpec("host", args.host_tier, codec=args.host_codec, policy=args.policy))
    if args.disk_tier:
        specs.append(
            TierSpec(
                "disk",
                args.disk_tier_size,
                codec=args.disk_codec,
                policy=args.policy,
                path=os.path.expanduser(args.disk_tier),
            )
        )
    if args.redis_url:
        specs.append(
            TierSpec(
                "redis",
                args.redis_tier_size,
                codec=args.redis_codec,
                policy=args.policy,
                url=args.redis_url,
                cluster=args.redis_cluster,
            )
        )
    return specs


def _thresholds(text: str) -> tuple[float, float, float, float]:
    """Four rising fractions ``N,P,C,E`` for the pressure ladder."""
    from kvtier.pressure.ladder import Ladder

    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 4:
        raise ConfigError(
            f"expected four rising fractions N,P,C,E in (0, 1], e.g. 0.5,0.8,0.9,0.97; got {text!r}"
        )
    fractions = (values[0], values[1], values[2], values[3])
    Ladder.from_fractions(fractions, hysteresis=0.0)  # rising, within (0, 1]
    return fractions


def _pressure_spec(args: argparse.Namespace) -> Any:
    """The pressure settings the serve flags ask for (``None``: off)."""
    if args.pressure == "off":
        return None
    from kvtier.pressure.config import PressureSpec

    extra = {} if args.pressure_thresholds is None else {"thresholds": args.pressure_thresholds}
    return PressureSpec(
        monitor=args.pressure,
        interval=args.pressure_interval,
        hysteresis=args.pressure_hysteresis,
        emergency=args.pressure_emergency,
        max_wait=args.pressure_max_wait,
        **extra,
    )


def _serve(args: argparse.Namespace) -> int:
    if args.model is not None and not os.path.exists(os.path.expanduser(args.model)):
        raise ConfigError(
            f"--model {args.model!r} does not exist: pass a local Hugging Face model directory "
            "or a .gguf file (models are never downloaded), or leave --model out to serve the "
            "bundled SmolLM2-135M-Instruct"
        )
    # Imported here so the other commands (and --help) do not load torch or fastapi.
    import logging

    try:
        import torch
        import uvicorn

        from kvtier.engine import DEFAULT_MODEL_ID, Engine, EngineWorker
        from kvtier.server import create_app
    except ImportError as exc:
        raise ConfigError(
            f"kvtier serve needs the torch and serve extras ({exc.name} is missing): "
            "pip install 'kvtier[torch,serve]'"
        ) from None

    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"--device {args.device!r} is not a torch device: use cpu, cuda, cuda:1, mps, ..."
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: CUDA is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {args.device}: MPS is not available on this machine")

    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(levelname)s:     %(name)s: %(message)s")
    sock = _bind(args.host, args.port)
    try:
        what = args.model or f"{DEFAULT_MODEL_ID} (the bundled default)"
        print(f"kvtier: loading {what} ({args.dtype}, {args.device}) ...", flush=True)
        started = time.perf_counter()
        engine = Engine.from_pretrained(
            args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_bytes=args.kv_cache_memory,
            policy=args.policy,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            prefix_caching=not args.no_prefix_caching,
            tiers=_tier_specs(args),
            write_mode=args.write_mode,
            pressure=_pressure_spec(args),
        )
        if args.default_temperature is not None:
            engine.sampling_defaults["temperature"] = args.default_temperature
        if args.default_top_p is not None:
            engine.sampling_defaults["top_p"] = args.default_top_p
        name = args.served_model_name or engine.model_id
        stats = engine.manager.stats()
        layout = engine.layout
        print(
            f"kvtier: loaded {engine.model_id} in {time.perf_counter() - started:.1f}s; "
            f"KV cache: {stats.total_blocks} blocks of {layout.block_size} tokens "
            f"({stats.total_blocks * layout.bytes_per_block / 2**20:.0f} MiB, {layout.dtype}), "
            f"policy {stats.policy}, prefix caching {'on' if engine.prefix_caching else 'off'}, "
            f"max_model_len {engine.max_model_len}",
            flush=True,
        )
        d = engine.sampling_defaults
        print(
            "kvtier: requests without temperature/top_p get "
            f"temperature {d.get('temperature', 1.0)}, top_p {d.get('top_p', 1.0)}",
            flush=True,
        )
        if engine.tiers is not None:
            for tier in engine.tiers.tiers:
                fmt = tier.fmt
                size = tier.capacity * (fmt.blob_size if fmt else 0)
                print(
                    f"kvtier: {tier.name} tier: {tier.capacity} blocks "
                    f"({size / 2**20:.0f} MiB, codec {tier.codec.name}, "
                    f"policy {tier.manager.policy.name}); {engine.tiers.write_mode}",
                    flush=True,
                )
        if engine.pressure is not None:
            p = engine.pressure
            print(
                f"kvtier: memory pressure from {p.monitor.name} every {p.interval:g}s; "
                f"mode {p.mode.name} at {100 * p.fraction:.1f}%",
                flush=True,
            )
        worker = EngineWorker(engine).start()
        try:
            app = create_app(worker, served_model_name=name)
            config = uvicorn.Config(
                app,
                log_level=args.log_level,
                timeout_graceful_shutdown=5,
            )
            server = uvicorn.Server(config)
            # Listen now, so a client told the address below is queued, never refused.
            sock.listen(config.backlog)
            url = _client_url(args.host, sock.getsockname()[1])
            print(
                f"kvtier: serving {name} at {url}/v1 (OpenAI-compatible; "
                f"try: curl {url}/v1/models)",
                flush=True,
            )
            # uvicorn re-raises Ctrl-C once its graceful shutdown is done.
            with contextlib.suppress(KeyboardInterrupt):
                server.run(sockets=[sock])
            print("kvtier: server stopped", flush=True)
        finally:
            worker.stop()
            engine.close()
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        sock.close()
    return 0


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a model behind an OpenAI-compatible HTTP API, KV cache managed by kvtier",
        description="Serve a causal language model behind an OpenAI-compatible API "
        "(chat completions, completions, streaming), generating through kvtier's KV-cache "
        "manager with prefix caching. Default model: SmolLM2-135M-Instruct, bundled offline.",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "--model",
        metavar="PATH",
        help="a local Hugging Face model directory or .gguf file "
        "(default: the bundled SmolLM2-135M-Instruct GGUF)",
    )
    serve.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send and /v1/models lists "
        "(default: the model's name, e.g. SmolLM2-135M-Instruct)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve.add_argument(
        "--port",
        type=_arg(_port, "port"),
        default=8000,
        help="port to listen on; 0 picks a free one (default 8000)",
    )
    serve.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="model and KV cache dtype (default float32)",
    )
    serve.add_argument(
        "--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps (default cpu)"
    )
    serve.add_argument(
        "--block-size",
        type=_arg(_positive_int, "block size"),
        default=16,
        metavar="TOKENS",
        help="tokens per KV block (default 16)",
    )
    serve.add_argument(
        "--kv-cache-memory",
        type=_arg(parse_memory_size, "memory size"),
        default=512 * 2**20,
        metavar="SIZE",
        help="memory for KV blocks: 512MiB, 1GiB, 1.5G, 800MB, or bytes (default 512MiB)",
    )
    serve.add_argument(
        "--num-blocks",
        type=_arg(_positive_int, "block count"),
        metavar="N",
        help="exact number of KV blocks (overrides --kv-cache-memory)",
    )
    serve.add_argument(
        "--policy",
        type=_arg(_policy_name, "policy"),
        default="lru",
        metavar="P",
        help=f"eviction policy for cached blocks ({', '.join(available_policies())}, "
        "or an import path pkg.mod:Class; default lru)",
    )
    serve.add_argument(
        "--max-num-seqs",
        type=_arg(_positive_int, "request count"),
        default=4,
        metavar="N",
        help="requests generating at once; more wait in a queue (default 4)",
    )
    serve.add_argument(
        "--max-model-len",
        type=_arg(_positive_int, "token count"),
        metavar="TOKENS",
        help="longest prompt + completion, in tokens (default: the model's context, "
        "capped by the KV cache)",
    )
    serve.add_argument(
        "--default-temperature",
        type=_arg(_float_in("temperature", 0.0, 2.0), "temperature"),
        metavar="T",
        help="temperature for requests that send none (default: the model's recommendation, "
        "0.2 for the bundled SmolLM2; else OpenAI's 1.0)",
    )
    serve.add_argument(
        "--default-top-p",
        type=_arg(_float_in("top_p", 0.0, 1.0, open_low=True), "top_p"),
        metavar="P",
        help="top_p for requests that send none (default: the model's recommendation, "
        "0.9 for the bundled SmolLM2; else 1.0)",
    )
    serve.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="keep every request's KV blocks private (no reuse across requests)",
    )
    tiers = serve.add_argument_group(
        "offload tiers",
        "Blocks the device evicts move down to these tiers (write-back) and come back on a "
        "later hit; all are optional and may be combined (host, then disk, then Redis).",
    )
    codecs = ("raw", "int8", "fp8")
    tiers.add_argument(
        "--host-tier",
        type=_arg(parse_memory_size, "memory size"),
        metavar="SIZE",
        help="host-memory tier size, e.g. 4GiB (pinned when CUDA is present)",
    )
    tiers.add_argument("--host-codec", choices=codecs, default="raw", help="default raw")
    tiers.add_argument(
        "--disk-tier",
        metavar="DIR",
        help="directory of a disk tier; blocks survive restarts and are found again",
    )
    tiers.add_argument(
        "--disk-tier-size",
        type=_arg(parse_memory_size, "memory size"),
        default=16 * 2**30,
        metavar="SIZE",
        help="disk tier size (default 16GiB)",
    )
    tiers.add_argument("--disk-codec", choices=codecs, default="raw", help="default raw")
    tiers.add_argument(
        "--redis-url",
        metavar="URL",
        help="a Redis tier shared by many engines, e.g. redis://127.0.0.1:6379/0",
    )
    tiers.add_argument(
        "--redis-cluster", action="store_true", help="the Redis URL names a Redis Cluster node"
    )
    tiers.add_argument(
        "--redis-tier-size",
        type=_arg(parse_memory_size, "memory size"),
        default=16 * 2**30,
        metavar="SIZE",
        help="blocks this engine tracks in Redis, as bytes (default 16GiB); the server's "
        "maxmemory policy bounds what Redis really keeps",
    )
    tiers.add_argument("--redis-codec", choices=codecs, default="raw", help="default raw")
    tiers.add_argument(
        "--write-mode",
        choices=("write_back", "write_through"),
        default="write_back",
        help="write_back: store a block below when the device evicts it (default); "
        "write_through: store every computed block on every tier at once",
    )
    pressure = serve.add_argument_group(
        "memory pressure",
        "A monitor is sampled in the background; as memory fills the mode climbs RELAXED, "
        "NORMAL, PRESSURE, CRITICAL, EMERGENCY. PRESSURE and above keep a share of the pool "
        "empty by evicting in the policy's order (demoting to the tiers, if any); EMERGENCY "
        "holds new requests back (HTTP 503 after --pressure-max-wait) or refuses them.",
    )
    pressure.add_argument(
        "--pressure",
        choices=("off", *MONITOR_NAMES),
        default="auto",
        help="memory source: auto (NVML, AMD SMI, torch.cuda, else the KV pool's occupancy; "
        "the choice is logged), one of them by name, host (cgroup-aware), or off "
        "(plain evict-on-full). Default auto",
    )
    pressure.add_argument(
        "--pressure-thresholds",
        type=_arg(_thresholds, "thresholds"),
        default=None,
        metavar="N,P,C,E",
        help="enter fractions of NORMAL, PRESSURE, CRITICAL and EMERGENCY, rising "
        "(default 0.5,0.8,0.9,0.97)",
    )
    pressure.add_argument(
        "--pressure-hysteresis",
        metavar="FRACTION",
        type=_arg(_float_in("fraction", 0.0, 0.5), "hysteresis"),
        default=0.05,
        help="a mode is left only below its enter fraction minus this (default 0.05)",
    )
    pressure.add_argument(
        "--pressure-interval",
        metavar="SECONDS",
        type=_arg(_float_in("number of seconds", 0.0, 60.0, open_low=True), "interval"),
        default=0.05,
        help="seconds between readings (default 0.05)",
    )
    pressure.add_argument(
        "--pressure-emergency",
        choices=("delay", "reject"),
        default="delay",
        help="EMERGENCY: delay new requests up to --pressure-max-wait, or reject them at once "
        "(default delay)",
    )
    pressure.add_argument(
        "--pressure-max-wait",
        metavar="SECONDS",
        type=_arg(_float_in("number of seconds", 0.0, 3600.0), "seconds"),
        default=30.0,
        help="longest a new request waits under EMERGENCY before HTTP 503 (default 30)",
    )
    serve.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="server log level (default info)",
    )
    serve.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a KV-cache manager for LLM inference (prefix caching, "
        "eviction policies, tiered offload, memory pressure).",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="show the version, policies and optional packages")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_info)
    _add_replay(sub)
    _add_serve(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except KvTierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
