"""KV memory of a sliding-window model at long context: kvtier's windowed storage vs vLLM.

A model shaped like Gemma 3 1B in its layers (26 layers, five sliding layers
of window 512 then one full layer, one KV head of 256) but a few channels
wide (random weights, so a CPU runs 8k tokens in seconds) serves one request
of ``--context`` tokens through kvtier's engine, prompt chunked by
``--budget`` tokens a step. After every step the script reads what the
request holds: its blocks' full layers, and the window slots its sliding
layers hold (:class:`~kvtier.storage.windowed.WindowedKVStorage`). It
prints, in bytes at the model's own widths (bfloat16):

* ``full-attention KV``: every layer for every block (what kvtier held
  before, and what a cache without per-layer-group blocks holds);
* kvtier's peak during prefill and what it holds at the end (decoding at
  full context);
* the issue's bound: full-attention KV x (share of full layers + window /
  context);
* vLLM's own per-request figure for the same shape: its ``FullAttentionSpec``
  blocks for the full layers plus ``SlidingWindowSpec.max_admission_blocks_per_request``
  for the sliding ones (vLLM 0.33's hybrid KV cache manager sizes and admits
  by it; its page-size padding of layer groups is not counted).

It also checks that the windowed engine's tokens equal the same engine's
with every layer kept in every block (``window_kv_ratio=None``), and times
both (CPU, for orientation: a decode step here is mostly the model).

    python bench/window_kv.py [--context 8192] [--budget 512 128] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO,
    format_markdown_table,
    format_table,
    git_state,
    log,
    machine_info,
    package_version,
    write_json,
)


def _model(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch
    import transformers

    sys.path.insert(0, str(REPO / "tests"))
    from tiny_model import tiny_tokenizer

    tok = tiny_tokenizer()
    types = [
        "full_attention" if (i + 1) % args.pattern == 0 else "sliding_attention"
        for i in range(args.layers)
    ]
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=args.layers,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=args.head_dim,
        query_pre_attn_scalar=args.head_dim,
        max_position_embeddings=args.context + 64,
        sliding_window=args.window,
        layer_types=types,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(config).eval(), tok


def _vllm_bytes(
    args: argparse.Namespace, budget: int, full_layers: int, sliding: int
) -> int | None:
    """vLLM's per-request KV bytes for this shape in bfloat16, or None without vLLM."""
    try:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    except ImportError:
        return None
    common = {
        "block_size": args.block_size,
        "num_kv_heads": 1,
        "head_size": args.head_dim,
        "dtype": torch.bfloat16,
    }
    full = FullAttentionSpec(**common)
    swa = SlidingWindowSpec(**common, sliding_window=args.window)
    full_blocks = -(-args.context // args.block_size)
    swa_blocks = swa.max_admission_blocks_per_request(
        max_in_flight_tokens=budget, max_model_len=args.context
    )
    return full_layers * full_blocks * full.page_size_bytes + sliding * (
        swa_blocks * swa.page_size_bytes
    )


def _run(
    model: Any, tok: Any, args: argparse.Namespace, budget: int, ratio: float | None
) -> dict[str, Any]:
    import copy

    from kvtier.engine import Engine, SamplingParams
    from kvtier.layout import cdiv

    bs = args.block_size
    engine = Engine(
        copy.deepcopy(model),
        tok,
        model_id="gemma3-1b-shaped",
        block_size=bs,
        num_blocks=cdiv(args.context, bs) + 4,
        max_num_seqs=1,
        max_num_batched_tokens=budget,
        window_kv_ratio=ratio,
    )
    storage = engine.storage
    windowed = ratio is not None
    prompt = [5 + (i * 7919) % 90 for i in range(args.context - args.new_tokens)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params, "long")
    tokens: list[int] = []
    peak_prefill = 0
    last = 0
    decode_times: list[float] = []
    started = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        new = [t for o in outs for t in o.token_ids]
        blocks = engine.manager.stats().used_blocks
        held = storage.held_bytes(blocks, storage.slab.held) if windowed else 0
        if tokens:
            decode_times.append(dt)
        else:
            peak_prefill = max(peak_prefill, held)
        if blocks:
            last = held
        tokens.extend(new)
    total = time.perf_counter() - started
    return {
        "tokens": tokens,
        "peak_prefill": peak_prefill,
        "at_context": last,
        "seconds": total,
        "decode_step_ms": 1000 * sorted(decode_times)[len(decode_times) // 2],
        "slots": storage.slab.num_slots if windowed else 0,
        "storage_bytes": storage.nbytes,
        "full_block_bytes": storage.full_bytes_per_block if windowed else 0,
        "window_block_bytes": storage.window_bytes_per_block if windowed else 0,
        "bytes_per_block": storage.bytes_per_block,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--context", type=int, default=8192, help="prompt + new tokens")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens decoded at the end")
    p.add_argument("--budget", type=int, nargs="+", default=[512, 128],
                   help="tokens per step (prefill chunk), one run each")  # fmt: skip
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--pattern", type=int, default=6, help="every n-th layer is full")
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--ratio", type=float, default=0.5, help="window_kv_ratio of the run")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "window_kv.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.new_tokens < 1 or args.context <= args.new_tokens:
        raise SystemExit("--context must exceed --new-tokens, which must be at least 1")
    model, tok = _model(args)
    rows: list[list[object]] = []
    results: list[dict[str, Any]] = []
    for budget in args.budget:
        log(f"budget {budget}: windowed storage ...")
        win = _run(model, tok, args, budget, args.ratio)
        log(f"budget {budget}: every layer in every block ...")
        whole = _run(model, tok, args, budget, None)
        if win["tokens"] != whole["tokens"]:
            raise SystemExit(f"budget {budget}: the windowed engine's tokens differ")
        bs = args.block_size
        blocks = -(-args.context // bs)
        # bfloat16 bytes at the model's widths; the run stores float32, and every figure
        # here is a count of layers x blocks, so the ratios do not depend on it.
        scale = 2 / 4
        full_kv = blocks * whole["bytes_per_block"] * scale
        full_layers = args.layers // args.pattern
        sliding = args.layers - full_layers
        bound = full_kv * (full_layers / args.layers + args.window / args.context)
        vllm = _vllm_bytes(args, budget, full_layers, sliding)
        peak = win["peak_prefill"] * scale
        end = win["at_context"] * scale
        mib = 2**20
        rows.append(
            [
                budget,
                f"{full_kv / mib:.1f}",
                f"{peak / mib:.1f} ({peak / full_kv:.3f})",
                f"{end / mib:.1f} ({end / full_kv:.3f})",
                f"{bound / mib:.1f} ({bound / full_kv:.3f})",
                "n/a" if vllm is None else f"{vllm / mib:.1f} ({vllm / full_kv:.3f})",
                f"{win['decode_step_ms']:.1f} / {whole['decode_step_ms']:.1f}",
            ]
        )
        results.append(
            {
                "budget": budget,
                "full_attention_kv_bytes": full_kv,
                "kvtier_peak_prefill_bytes": peak,
                "kvtier_at_context_bytes": end,
                "goal_bound_bytes": bound,
                "vllm_admission_bytes": vllm,
                "slots": win["slots"],
                "kvtier_storage_bytes": win["storage_bytes"] * scale,
                "whole_storage_bytes": whole["storage_bytes"] * scale,
                "decode_step_ms": {
                    "windowed": win["decode_step_ms"],
                    "whole": whole["decode_step_ms"],
                },
                "seconds": {"windowed": win["seconds"], "whole": whole["seconds"]},
                "tokens_equal": True,
            }
        )
    headers = [
        "budget",
        "full-attention KV MiB",
        "kvtier peak (prefill)",
        "kvtier at context",
        "goal bound",
        "vLLM 0.33 admission",
        "decode ms windowed / whole",
    ]
    print(
        f"One request of {args.context} tokens, {args.layers} layers ({args.layers // args.pattern}"
        f" full), window {args.window}, blocks of {args.block_size}, bf16 bytes (share of "
        "full-attention KV in brackets)"
    )
    table = format_markdown_table if args.markdown else format_table
    print(table(headers, rows))
    write_json(
        args.json,
        {
            "benchmark": "window_kv",
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": machine_info(),
            "git": git_state(REPO),
            "versions": {"vllm": package_version("vllm"), "torch": package_version("torch")},
            "results": results,
        },
    )
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
