"""Time to first token with a cached 2,048-token prefix, on the real model.

The workload: one shared prefix of exactly 2,048 tokens (a system prompt and
a document, in SmolLM2's chat format) followed by different questions of
exactly 64 tokens each; every request generates one token. Systems, all in
one process on the same model weights:

* ``kvtier, prefix cached``: the reference engine with the prefix's blocks
  already cached (a warm-up request put them there); each question reuses the
  2,048 cached tokens and computes its 64.
* ``kvtier, recompute``: the same engine with prefix caching off: all 2,112
  tokens computed for every question.
* ``HF generate, copied DynamicCache``: plain transformers, the
  HF-recommended way to reuse a prefix: a ``DynamicCache`` of the prefix is
  computed once; each question ``copy.deepcopy``-s it and calls
  ``model.generate(full_ids, cache=copy, max_new_tokens=1)``.
* ``HF forward, no cache``: one forward pass over all 2,112 tokens.
* ``floor: suffix forward``: the pure compute of the 64-token suffix given a
  ready ``DynamicCache`` of the prefix (copied outside the timer): the least
  any prefix-caching system can take.
* ``kvtier, prefix cached, kv <dtype>``: the cached-prefix engine with its
  blocks stored as ``--kv-cache-dtype`` (``--kv-cache-dtypes``, default
  bfloat16, int8 and fp8_e4m3): every layer dequantizes the 2,112 tokens'
  K/V it reads. Paired with the float32 engine on the same question, the
  ratio of the two is the cost of reading narrower blocks.

Every kvtier engine gets the same ``--kv-cache-memory`` (default 256 MiB);
a second table shows how many blocks each dtype fits in it.

TTFT is wall time from handing the request over to having the first token
(for the engine: ``RequestMetrics.ttft``, arrival to first token; queueing is
nil here). Systems alternate per question, in an order rotated per repeat;
the table reports medians over ``--questions`` x ``--repeat`` samples.
Every sample uses a question of its own, never seen by the cache; after
each, outside the timings, the cached-prefix engines are checked to reuse
exactly 2,048 tokens, and the float32 one's first token to equal the greedy
token of a full forward (the narrower dtypes' agreement is counted).

Run ``python bench/ttft.py --help``; ``--quick`` is a short smoke run.
Results go to ``bench/results/ttft.json``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import (
    REPO,
    format_markdown_table,
    format_table,
    git_state,
    machine_info,
    median,
    package_version,
    write_json,
)
from transformers import DynamicCache

from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model import load_model
from kvtier.units import parse_memory_size

PREFIX_TOKENS = 2048
QUESTION_TOKENS = 64

SYSTEM = (
    "You are a careful assistant. Answer questions about the document below using only "
    "what it says, and say so when the document does not answer the question."
)
TOPICS = [
    "how blocks are keyed",
    "what happens when the pool is full",
    "which eviction policies exist",
    "how copy-on-write works for forks",
    "what the replay simulator measures",
    "how the offload tiers are ordered",
    "what a pressure callback is told",
    "why the last prompt token is never cached",
    "how prefix chains are kept consistent",
    "what the block layout on the device is",
    "how admission control works",
    "what the benchmarks compare against",
]


def _document_text() -> str:
    parts = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        parts.append(path.read_text(encoding="utf-8"))
    return "\n\n".join(parts)


def _exact(tokenizer: Any, text: str, n: int, filler: str) -> list[int]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    pad = list(tokenizer.encode(filler, add_special_tokens=False))
    while len(ids) < n:
        ids.extend(pad)
    return ids[:n]


def build_prompts(
    tokenizer: Any, n_questions: int, prefix_tokens: int = PREFIX_TOKENS
) -> tuple[list[int], list[list[int]]]:
    """A ``prefix_tokens`` prefix (2,048) and ``n_questions`` distinct 64-token suffixes."""
    head = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nDocument:\n"
    prefix = _exact(tokenizer, head + _document_text(), prefix_tokens, " more text")
    tail = list(tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False))
    questions = []
    for i in range(n_questions):
        topic = TOPICS[i % len(TOPICS)]
        text = (
            f"\n\nQuestion {i + 1}: according to the document, {topic}? "
            "Answer in one short paragraph and cite the section you used."
        )
        body = _exact(tokenizer, text, QUESTION_TOKENS - len(tail), " Please be precise.")
        questions.append(body + tail)
    return prefix, questions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="local HF directory or .gguf (default: SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--questions", type=int, default=8, help="distinct questions (default 8)")
    ap.add_argument("--repeat", type=int, default=2, help="passes over the questions (default 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 questions, 1 pass")
    ap.add_argument(
        "--kv-cache-dtypes",
        nargs="*",
        default=["bfloat16", "int8", "fp8_e4m3"],
        help="KV dtypes of extra cached-prefix engines (default bfloat16 int8 fp8_e4m3)",
    )
    ap.add_argument(
        "--cached-only",
        action="store_true",
        help="time only the cached-prefix engines and the floor (leave out recompute and the "
        "transformers systems, the slow ones): for comparing KV dtypes",
    )
    ap.add_argument(
        "--kv-cache-memory",
        type=parse_memory_size,
        default=256 * 2**20,
        help="KV memory of every kvtier engine (default 256MiB)",
    )
    ap.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ttft.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.questions, args.repeat = 3, 1
    if args.questions < 1 or args.repeat < 1:
        ap.error("--questions and --repeat must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)

    print("loading the model ...", file=sys.stderr)
    loaded = load_model(args.model, dtype=args.dtype)
    model, tok = loaded.model, loaded.tokenizer
    # Every sample gets a question of its own, plus one to warm up with.
    prefix, questions = build_prompts(tok, args.questions * args.repeat + 1)
    bs = 16
    mem = args.kv_cache_memory

    def make(kv_cache_dtype: str = "auto", **kw: Any) -> Engine:
        return Engine(
            model,
            tok,
            model_id=loaded.model_id,
            block_size=bs,
            kv_cache_bytes=mem,
            kv_cache_dtype=kv_cache_dtype,
            **kw,
        )

    cached = make()
    nocache = make(prefix_caching=False)
    narrow = {dt: make(dt) for dt in args.kv_cache_dtypes}
    capacity = {"auto": cached, **narrow}
    need = (PREFIX_TOKENS + QUESTION_TOKENS) // bs + 1
    for dt, e in capacity.items():
        if e.manager.pool.num_blocks < need:
            raise SystemExit(f"--kv-cache-memory holds {e.manager.pool.num_blocks} {dt} blocks")
    one = SamplingParams(max_tokens=1, temperature=0)

    def engine_ttft(engine: Engine, ids: list[int]) -> tuple[float, int, int]:
        outs = list(engine.generate(ids, one))
        m = outs[-1].metrics
        assert m.ttft is not None
        return m.ttft, outs[-1].token_ids[0], m.cached_tokens

    with torch.no_grad():
        prefix_t = torch.tensor([prefix])
        ready = DynamicCache(config=model.config)
        model(prefix_t, cache=ready, use_cache=True, logits_to_keep=1)

        # Warm up every path once (and put the prefix in kvtier's cache) with
        # a question of its own: every timed question is new to the cache.
        warm = questions.pop()
        for e in (cached, nocache, *narrow.values()):
            engine_ttft(e, prefix + warm)
        seen: dict[tuple[str, int], tuple[int, int]] = {}

        def kv_cached_in(dt: str, engine: Engine) -> Callable[[list[int]], float]:
            def run(q: list[int]) -> float:
                ttft, token, hit = engine_ttft(engine, prefix + q)
                seen[(dt, id(q))] = (token, hit)
                return ttft

            return run

        kv_cached = kv_cached_in("auto", cached)

        def kv_recompute(q: list[int]) -> float:
            return engine_ttft(nocache, prefix + q)[0]

        def hf_generate(q: list[int]) -> float:
            ids = torch.tensor([prefix + q])
            t0 = time.perf_counter()
            c = copy.deepcopy(ready)
            model.generate(
                ids,
                cache=c,
                max_new_tokens=1,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
            )
            return time.perf_counter() - t0

        def hf_full(q: list[int]) -> float:
            ids = torch.tensor([prefix + q])
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)
            return time.perf_counter() - t0

        def floor(q: list[int]) -> float:
            c = copy.deepcopy(ready)
            ids = torch.tensor([q])
            t0 = time.perf_counter()
            model(ids, cache=c, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t0

        systems: dict[str, Callable[[list[int]], float]] = {
            "kvtier, prefix cached": kv_cached,
            "kvtier, recompute": kv_recompute,
            "HF generate, copied DynamicCache": hf_generate,
            "HF forward, no cache": hf_full,
            "floor: suffix forward": floor,
        }
        for dt, e in narrow.items():
            systems[f"kvtier, prefix cached, kv {dt}"] = kv_cached_in(dt, e)
        if args.cached_only:
            for name in ("kvtier, recompute", "HF generate, copied DynamicCache",
                         "HF forward, no cache"):
                del systems[name]
        names = list(systems)
        agree = {dt: 0 for dt in narrow}
        samples: dict[str, list[float]] = {n: [] for n in names}
        total = args.repeat * args.questions
        done = 0
        for r in range(args.repeat):
            for i in range(args.questions):
                q = questions[r * args.questions + i]
                k = (r + i) % len(names)
                for name in names[k:] + names[:k]:
                    samples[name].append(systems[name](q))
                # Outside the timings: the cached path must match a full forward.
                logits = model(torch.tensor([prefix + q]), logits_to_keep=1).logits
                want = int(logits[0, -1].argmax())
                token, hit = seen[("auto", id(q))]
                if token != want or hit != PREFIX_TOKENS:
                    raise SystemExit(
                        f"check failed: the cached engine gave token {token} with {hit} cached "
                        f"tokens; a full forward gives {want} (expected {PREFIX_TOKENS} cached)"
                    )
                for dt in narrow:
                    token, hit = seen[(dt, id(q))]
                    if hit != PREFIX_TOKENS:
                        raise SystemExit(f"check failed: kv {dt} reused {hit} tokens")
                    agree[dt] += token == want
                done += 1
                print(f"\r  {done}/{total} questions", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)

    med = {n: median(v) for n, v in samples.items()}
    base = med["kvtier, prefix cached"]
    fl = med["floor: suffix forward"]
    headers = ["system", "TTFT ms (median)", "min ms", "vs kvtier cached", "vs floor"]
    rows = [
        [
            n,
            f"{med[n] * 1e3:.1f}",
            f"{min(samples[n]) * 1e3:.1f}",
            f"{med[n] / base:.2f}x",
            f"{med[n] / fl:.2f}x",
        ]
        for n in names
    ]
    print(
        f"\nTTFT, {PREFIX_TOKENS}-token cached prefix + {QUESTION_TOKENS}-token question, "
        f"{loaded.model_id} ({args.dtype}), torch threads {torch.get_num_threads()}"
    )
    print(format_table(headers, rows))
    speedup = med["kvtier, recompute"] / base if "kvtier, recompute" in med else None
    print(
        "\ncached-prefix speedup over recompute: "
        + ("not measured" if speedup is None else f"{speedup:.1f}x (target >= 15x)")
        + f"; cached / floor: {base / fl:.2f}x (target <= 1.3x)"
    )
    # Narrow blocks against float32 on the same question: the paired ratios' spread is the noise.
    paired: dict[str, list[float]] = {}
    for dt in narrow:
        mine, f32 = samples[f"kvtier, prefix cached, kv {dt}"], samples["kvtier, prefix cached"]
        paired[dt] = sorted(a / b for a, b in zip(mine, f32, strict=True))
        r = paired[dt]
        print(
            f"kv {dt} cached / float32 cached, paired per question: median {median(r):.2f}x, "
            f"range {r[0]:.2f}-{r[-1]:.2f}x over {len(r)} (target <= 1.3x for int8); "
            f"first token equal to float32's greedy {agree[dt]}/{total}"
        )
    f32_bytes = cached.layout.bytes_per_block
    bf16 = narrow.get("bfloat16")
    cap_headers = ["KV dtype", "bytes per block", f"blocks in {mem / 2**20:.0f} MiB",
                   "vs float32", "vs bfloat16"]
    cap_rows = []
    for dt, e in capacity.items():
        n = e.manager.pool.num_blocks
        cap_rows.append([
            "float32 (auto)" if dt == "auto" else dt,
            f"{e.layout.bytes_per_block:,}",
            f"{n:,}",
            f"{n / cached.manager.pool.num_blocks:.2f}x",
            "-" if bf16 is None else f"{n / bf16.manager.pool.num_blocks:.2f}x",
        ])
    print(f"\nblocks of {bs} tokens each engine's pool holds in --kv-cache-memory "
          f"(float32 blocks: {f32_bytes:,} bytes)")
    print(format_table(cap_headers, cap_rows))
    if args.markdown:
        print()
        print(format_markdown_table(headers, rows))
        print()
        print(format_markdown_table(cap_headers, cap_rows))
    write_json(
        args.out,
        {
            "benchmark": "ttft",
            "model": loaded.model_id,
            "dtype": args.dtype,
            "prefix_tokens": PREFIX_TOKENS,
            "question_tokens": QUESTION_TOKENS,
            "questions": args.questions,
            "repeat": args.repeat,
            "torch_threads": torch.get_num_threads(),
            "samples_s": samples,
            "median_s": med,
            "speedup_vs_recompute": speedup,
            "cached_over_floor": base / fl,
            "kv_cache_memory": mem,
            "pool_blocks": {dt: e.manager.pool.num_blocks for dt, e in capacity.items()},
            "bytes_per_block": {dt: e.layout.bytes_per_block for dt, e in capacity.items()},
            "narrow_over_float32_paired": paired,
            "narrow_first_token_agree": agree,
            "machine": machine_info(),
            "git": git_state(REPO),
            "versions": {p: package_version(p) for p in ("torch", "transformers", "kvtier")},
        },
    )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
