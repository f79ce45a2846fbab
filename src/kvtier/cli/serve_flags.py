"""``kvtier serve``'s flags: every option, its help, and the text after ``--help``.

:func:`add_flags` puts them on the ``serve`` subcommand's parser
(:mod:`kvtier.cli.serve`); :mod:`kvtier.cli.serve_config` turns the parsed
flags into an :class:`~kvtier.engine.config.EngineConfig` and the server's
limits.
"""

from __future__ import annotations

import argparse

from kvtier.cli.args import (
    arg,
    float_in,
    non_negative_int,
    parse_memory_size,
    policy_name,
    port,
    positive_int,
    thresholds,
    window_ratio,
)
from kvtier.cli.serve_auth import (
    add_auth_flags,
)
from kvtier.errors import ConfigError
from kvtier.layout import KV_CACHE_DTYPES
from kvtier.policy import available_policies
from kvtier.pressure.detect import MONITOR_NAMES

#: ``--default-max-tokens``: long enough for a whole chat answer, short enough that a small
#: model looping on CPU (about 10 tokens/s) answers within a minute instead of filling its
#: context. Equal to ServerLimits.default_max_tokens, which stays importable without the
#: serve extras' dependencies.
DEFAULT_MAX_TOKENS = 512

#: ``--policy``'s default. Replayed on every trace that loads here at 1-25% of its
#: unique blocks, it is never more than 0.2 points of prefix hits below LRU and up to
#: 4.5 points above (docs/benchmarks.md, "Never more than 0.5 point below LRU?").
DEFAULT_POLICY = "learned-reuse"

EPILOG = """\
The server speaks OpenAI's API: point any OpenAI client at http://HOST:PORT/v1
(with --api-key, clients send that key; see 'access' below). Besides
/v1/chat/completions, /v1/completions and /v1/models it serves /health, /metrics
(Prometheus) and /v1/cache/stats (JSON: prefix-cache hits, KV blocks, evictions).

The KV cache holds --kv-cache-memory worth of blocks of --block-size tokens
(or exactly --num-blocks); finished requests' blocks stay cached and later
requests sharing a prefix reuse them. Nothing is ever downloaded: --model is
a local Hugging Face model directory or a .gguf file.

tiers (--tier, repeatable, fastest first; URL settings: size, codec, policy, write):
  device:1GiB                                compressed blocks (int8, or ?codec=fp8) in the
                                             device's own memory, beside --kv-cache-memory:
                                             evicted blocks are encoded there, hits decoded
  host:4GiB                                  host memory (pinned when CUDA is present)
  disk:/var/cache/kvtier?size=100GiB&codec=int8   files that survive restarts
  redis://10.0.0.5:6379/0?size=16GiB         shared by every engine on that Redis
  redis+cluster://10.0.0.5:7000,10.0.0.6:7001    a Redis Cluster
  Shared media (Redis) write through by default (other engines hit a prefix at
  once), local ones write back (a block moves down when evicted); write=back
  or write=through, or --write-mode for every tier, overrides that.

config file (--config FILE): TOML with the flags' names (dashes or underscores),
optionally grouped in tables, e.g.
  port = 9000
  kv_cache_memory = "1GiB"
  tier = ["host:4GiB", "disk:/var/cache/kvtier?size=100GiB"]
  [pressure]
  pressure = "pool"
Flags given on the command line override the file.

examples:
  kvtier serve
  kvtier serve --port 9000 --kv-cache-memory 1GiB --policy arc
  kvtier serve --tier host:2GiB --tier redis://127.0.0.1:6379/0
  kvtier serve --kv-cache-dtype int8 --kv-cache-memory 256MiB
  kvtier serve --tier device:256MiB --tier host:2GiB
  kvtier serve --model ./Qwen2.5-0.5B-Instruct --served-model-name qwen --dtype bfloat16
  kvtier serve --default-max-tokens 0    # no cap for requests without max_tokens
  kvtier serve --api-key-file keys.txt --tenant-max-requests 8 \\
    --tenant-max-kv-fraction 0.5 --tenant-limit alpha:max_requests=32
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "SmolLM2-135M-Instruct", "max_tokens": 64, "temperature": 0,
         "messages": [{"role": "user", "content": "Hi"}]}'
"""


def _integer(text: str) -> int:
    """Any integer; the flag's own range is checked with the other settings."""
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"expected an integer, got {text!r}") from None


# -- flags ----------------------------------------------------------------------------------


def add_flags(serve: argparse.ArgumentParser) -> None:
    """Every ``kvtier serve`` flag, on ``serve`` (the subcommand's parser)."""
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of settings (the flags' names); flags given here override it",
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
        type=arg(port, "port"),
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
        type=arg(positive_int, "block size"),
        default=None,
        metavar="TOKENS",
        help="tokens per KV block (default 16; for a model with linear-attention or Mamba "
        "layers, the smallest multiple of 16 whose block holds one checkpoint of each such "
        "layer's state without padding, e.g. 1056 for Qwen3-Next in bfloat16)",
    )
    serve.add_argument(
        "--kv-cache-memory",
        type=arg(parse_memory_size, "memory size"),
        default=512 * 2**20,
        metavar="SIZE",
        help="memory for KV blocks: 512MiB, 1GiB, 1.5G, 800MB, or bytes (default 512MiB)",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        choices=tuple(KV_CACHE_DTYPES),
        default="auto",
        help="how KV blocks are stored: auto (the model's --dtype), float32, bfloat16, "
        "float16, or quantized with per-head scales: int8, fp8_e4m3 (dequantized as "
        "attention reads them). Narrower blocks fit more of them in --kv-cache-memory: "
        "int8 holds about 4x the float32 blocks (default auto)",
    )
    serve.add_argument(
        "--window-kv-ratio",
        type=arg(window_ratio, "ratio"),
        default="auto",
        metavar="R",
        help="models with sliding-window layers (Gemma 3, Mistral) or linear-attention / "
        "Mamba layers (Qwen3-Next, Bamba): keep those layers' share of a block (K/V, or the "
        "state checkpoint) for R blocks per block of the pool, only where requests read or "
        "resume (never fewer than the running requests need), so the same "
        "--kv-cache-memory holds more blocks; a cached prefix resumes only where its last "
        "window or checkpoint is kept. auto: 0.5 for sliding windows, 0.05 for "
        "checkpoints; off keeps every layer in every block (default auto)",
    )
    serve.add_argument(
        "--num-blocks",
        type=arg(positive_int, "block count"),
        metavar="N",
        help="exact number of KV blocks (overrides --kv-cache-memory)",
    )
    serve.add_argument(
        "--policy",
        type=arg(policy_name, "policy"),
        default=DEFAULT_POLICY,
        metavar="P",
        help=f"eviction policy for cached blocks ({', '.join(available_policies())}, "
        f"or an import path pkg.mod:Class; default {DEFAULT_POLICY}: it learns online which "
        "new blocks each kind of request reuses, and on every replayed trace it is at most "
        "0.2 points below lru and up to 4.5 points above)",
    )
    serve.add_argument(
        "--max-num-seqs",
        type=arg(positive_int, "request count"),
        metavar="N",
        help="requests generating at once; more wait in a queue (default: sized from the KV "
        "cache, the sequences of 512 tokens it holds, at least 4 and at most 32 on a CPU or 256 "
        "on an accelerator; the startup banner says what it came to)",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=arg(positive_int, "token count"),
        metavar="N",
        help="tokens one forward pass computes at most: every running request's next token, "
        "then chunks of prompts (default 512; at least --max-num-seqs)",
    )
    serve.add_argument(
        "--max-model-len",
        type=arg(positive_int, "token count"),
        metavar="TOKENS",
        help="longest prompt + completion, in tokens (default: the model's context, "
        "capped by the KV cache)",
    )
    serve.add_argument(
        "--default-temperature",
        type=arg(float_in("temperature", 0.0, 2.0), "temperature"),
        metavar="T",
        help="temperature for requests that send none (default: the model's recommendation, "
        "0.2 for the bundled SmolLM2; else OpenAI's 1.0)",
    )
    serve.add_argument(
        "--default-top-p",
        type=arg(float_in("top_p", 0.0, 1.0, open_low=True), "top_p"),
        metavar="P",
        help="top_p for requests that send none (default: the model's recommendation, "
        "0.9 for the bundled SmolLM2; else 1.0)",
    )
    serve.add_argument(
        "--default-max-tokens",
        type=arg(_integer, "integer"),
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="most tokens a request that sends no max_tokens (nor max_completion_tokens) "
        f"generates (default {DEFAULT_MAX_TOKENS}; 0: no cap, a chat completion runs up to "
        "the context as OpenAI's does; /v1/completions keeps OpenAI's 16 when that is fewer). "
        "A request's own max_tokens is never capped by it",
    )
    serve.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="keep every request's KV blocks private (no reuse across requests)",
    )
    serve.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="prefill/decode disaggregation behind a P/D router (vllm-router "
        "--vllm-pd-disaggregation): prefill computes prompts and hands their KV over on the "
        "shared --tier redis://...; decode loads it and generates. Both need the same shared "
        "tier, model and --block-size. Default both: prefill and decode here",
    )
    _add_limits(serve)
    _add_tiers(serve)
    _add_pressure(serve)
    _add_images(serve)
    add_auth_flags(serve)
    serve.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish KV events (blocks stored / removed, per medium) on this ZeroMQ endpoint "
        "in vLLM's format, e.g. tcp://*:5557; consumers of vLLM's events read them unchanged",
    )
    serve.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="server log level (default info)",
    )


def _add_limits(serve: argparse.ArgumentParser) -> None:
    limits = serve.add_argument_group(
        "request limits",
        "What one client may ask: a request over a limit is refused before it costs anything "
        "(413 body too large, 408 body too slow, 400 prompt or chat too long, 429 with "
        "Retry-After when too many requests wait).",
    )
    limits.add_argument(
        "--max-request-bytes",
        type=arg(parse_memory_size, "memory size"),
        default=8 * 2**20,
        metavar="SIZE",
        help="largest request body (default 8MiB)",
    )
    limits.add_argument(
        "--max-prompt-chars",
        type=arg(positive_int, "character count"),
        metavar="N",
        help="longest prompt in characters, checked before tokenizing (default: the context "
        "length times the longest token, so no longer prompt could fit)",
    )
    limits.add_argument(
        "--max-messages",
        type=arg(positive_int, "message count"),
        default=1024,
        metavar="N",
        help="most messages in one chat request (default 1024)",
    )
    limits.add_argument(
        "--max-queued-requests",
        type=arg(non_negative_int, "request count"),
        default=256,
        metavar="N",
        help="requests that may wait beyond the running ones; more get 429 (default 256)",
    )
    limits.add_argument(
        "--request-timeout",
        type=arg(float_in("number of seconds", 0.0, 3600.0, open_low=True), "seconds"),
        default=30.0,
        metavar="SECONDS",
        help="longest a client may take to send its request body; then 408 (default 30)",
    )
    _add_tenant_limits(serve)


def _add_tenant_limits(serve: argparse.ArgumentParser) -> None:
    tenants = serve.add_argument_group(
        "per-tenant limits",
        "What one tenant (the TENANT of --api-key KEY:TENANT; requests whose key has no "
        "tenant, or of a server without keys, are one shared anonymous tenant) may hold: a "
        "request over a limit is answered 429 with Retry-After at admission. A request "
        "counts from admission until it finishes, is cancelled, fails, or moves to another "
        "server. Default: no limit.",
    )
    tenants.add_argument(
        "--tenant-max-requests",
        type=arg(_integer, "integer"),
        metavar="N",
        help="requests one tenant may have in the server at once, waiting or running; one "
        "more gets 429 (default: no limit)",
    )
    tenants.add_argument(
        "--tenant-max-kv-fraction",
        type=float,
        metavar="F",
        help="share of the device KV cache, in (0, 1], one tenant's requests may hold: while "
        "they hold at least F of the blocks, a new request of the tenant gets 429. Checked at "
        "admission only: a running request is never preempted for it (default: no limit)",
    )
    tenants.add_argument(
        "--tenant-limit",
        action="append",
        metavar="TENANT:SETTINGS",
        help="limits of one tenant, overriding the two flags above, e.g. "
        "alpha:max_requests=8,max_kv_fraction=0.5 (either setting may be left out and keeps "
        "the default; repeatable; TENANT must be a tenant of an API key)",
    )


def _size_or_off(text: str) -> int:
    """A memory size, or 0 (off)."""
    return 0 if text.strip() == "0" else parse_memory_size(text)


def _add_images(serve: argparse.ArgumentParser) -> None:
    images = serve.add_argument_group(
        "images",
        "For a vision-language model (a LLaVA-style or Idefics3/SmolVLM-style directory): chat "
        "content parts {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}. "
        "Images are never fetched from the network. Encoder outputs are cached by content.",
    )
    images.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        help="serve file:// image URLs for files under DIR (default: file:// is refused)",
    )
    images.add_argument(
        "--max-images-per-request",
        type=arg(positive_int, "image count"),
        default=8,
        metavar="N",
        help="most images in one chat request (default 8)",
    )
    images.add_argument(
        "--max-image-bytes",
        type=arg(parse_memory_size, "memory size"),
        default=16 * 2**20,
        metavar="SIZE",
        help="largest image file (default 16MiB; --max-request-bytes bounds data URLs too)",
    )
    images.add_argument(
        "--max-image-pixels",
        type=arg(positive_int, "pixel count"),
        default=40_000_000,
        metavar="N",
        help="most pixels in one image, read from its header before decoding (default 40M)",
    )
    images.add_argument(
        "--encoder-cache-size",
        type=arg(_size_or_off, "memory size"),
        default=256 * 2**20,
        metavar="SIZE",
        help="memory for cached encoder outputs (default 256MiB; 0: off)",
    )
    images.add_argument(
        "--encoder-cache-entries",
        type=arg(positive_int, "entry count"),
        metavar="N",
        help="most cached encoder outputs (default: no limit but the size)",
    )
    images.add_argument(
        "--encoder-cache-policy",
        choices=available_policies(),
        default="lru",
        help="eviction policy of the encoder cache (default lru)",
    )
    images.add_argument(
        "--encoder-cache-tier",
        action="append",
        metavar="URL",
        help="a lower tier for encoder outputs, fastest first: host:1GiB, disk:DIR?size=10GiB, "
        "redis://HOST:6379/0 (repeatable); other processes on the same disk or Redis share it",
    )
    images.add_argument(
        "--encoder-cache-salt",
        default="",
        metavar="TEXT",
        help="tenant salt mixed into every encoder-cache key (servers with different salts "
        "never share entries)",
    )


def _add_tiers(serve: argparse.ArgumentParser) -> None:
    tiers = serve.add_argument_group(
        "offload tiers",
        "Blocks below the device pool: compressed in device memory, host memory, disk, Redis "
        "(see 'tiers' below). --tier takes "
        "URLs; the --host-tier, --disk-tier and --redis-url flags are older spellings of it.",
    )
    tiers.add_argument(
        "--tier",
        action="append",
        metavar="URL",
        help="a tier as a URL, fastest first: device:1GiB (compressed, in device memory), "
        "host:4GiB, disk:DIR?size=100GiB&codec=int8, redis://HOST:6379/0, "
        "redis+cluster://HOST:7000,... (repeatable)",
    )
    codecs = ("raw", "int8", "fp8")
    tiers.add_argument(
        "--host-tier",
        type=arg(parse_memory_size, "memory size"),
        metavar="SIZE",
        help="host-memory tier size, e.g. 4GiB (= --tier host:SIZE)",
    )
    tiers.add_argument("--host-codec", choices=codecs, default="raw", help="default raw")
    tiers.add_argument(
        "--disk-tier",
        metavar="DIR",
        help="directory of a disk tier; blocks survive restarts (= --tier disk:DIR)",
    )
    tiers.add_argument(
        "--disk-tier-size",
        type=arg(parse_memory_size, "memory size"),
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
        type=arg(parse_memory_size, "memory size"),
        default=16 * 2**30,
        metavar="SIZE",
        help="blocks this engine tracks in Redis, as bytes (default 16GiB); the server's "
        "maxmemory policy bounds what Redis really keeps",
    )
    tiers.add_argument("--redis-codec", choices=codecs, default="raw", help="default raw")
    tiers.add_argument(
        "--write-mode",
        choices=("write_back", "write_through"),
        default=None,
        help="every tier alike: write_back (store a block below when it is evicted) or "
        "write_through (store every computed block at once). Default: Redis writes through, "
        "host and disk write back",
    )
    tiers.add_argument(
        "--tier-admission",
        choices=("write-all", "predicted"),
        default="write-all",
        help="which evicted blocks the first write-back tier stores: write-all (default) or "
        "predicted (only blocks whose learned reuse makes a tier hit likely: fewer writes "
        "to disk or host memory for about the same tier hits; needs the learned-reuse "
        "policy, the default)",
    )
    tiers.add_argument(
        "--tier-layer-loads",
        action="store_true",
        help="land a prefix loaded from the host tier layer by layer while the forward pass "
        "that needs it starts: its first layers compute while the later ones are still "
        "being copied (for a GPU, where the copy and the compute run side by side; off by "
        "default)",
    )
    tiers.add_argument(
        "--tier-recheck-interval",
        type=arg(float_in("number of seconds", 0.0, 86400.0, open_low=True), "interval"),
        default=30.0,
        metavar="S",
        help="seconds between checks that each tier still holds what kvtier tracks on it "
        "(a Redis restarted empty loses blocks without an error; they leave the bookkeeping "
        "and the KV events at the next check, also while the server idles); default 30",
    )
    tiers.add_argument(
        "--prefetch-lookahead",
        type=arg(non_negative_int, "step count"),
        default=0,
        metavar="N",
        help="bring the blocks of agents due within N steps of their registered workflows "
        "back from the tiers before their requests (needs a tier; best with --policy "
        "workflow; default 0: off)",
    )
    tiers.add_argument(
        "--prefetch-session-lead",
        type=arg(float_in("number of seconds", 0.0, 86400.0), "lead"),
        default=None,
        metavar="S",
        help="bring the blocks of a paused session back from the tiers S seconds before "
        "it is due (its cache_ttl_s hint, as the workflow policy learns it, or its own "
        "mean pause); needs a tier and --policy workflow (default: off)",
    )
    tiers.add_argument(
        "--prefetch-memory",
        type=arg(parse_memory_size, "memory size"),
        default=64 * 2**20,
        metavar="SIZE",
        help="bytes of blocks prefetches read at once, at most (default 64MiB)",
    )


def _add_pressure(serve: argparse.ArgumentParser) -> None:
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
        type=arg(thresholds, "thresholds"),
        default=None,
        metavar="N,P,C,E",
        help="enter fractions of NORMAL, PRESSURE, CRITICAL and EMERGENCY, rising "
        "(default 0.5,0.8,0.9,0.97)",
    )
    pressure.add_argument(
        "--pressure-hysteresis",
        metavar="FRACTION",
        type=arg(float_in("fraction", 0.0, 0.5), "hysteresis"),
        default=0.05,
        help="a mode is left only below its enter fraction minus this (default 0.05)",
    )
    pressure.add_argument(
        "--pressure-interval",
        metavar="SECONDS",
        type=arg(float_in("number of seconds", 0.0, 60.0, open_low=True), "interval"),
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
        type=arg(float_in("number of seconds", 0.0, 3600.0), "seconds"),
        default=30.0,
        help="longest a new request waits under EMERGENCY before HTTP 503 (default 30)",
    )
