"""The paged attention of one decode step, alone: what kvtier's own part of the forward costs.

Builds a real :class:`~kvtier.storage.KVBlockStorage` with SmolLM2-135M's
attention geometry (30 layers, 9 query heads over 3 KV heads, head_dim 64,
16-token blocks, float32), fills it, gives each of ``B`` sequences a
scattered block table and a context length, and times what the engine does
for them in one decode step:

* ``meta``: building the step's :class:`~kvtier.engine.paged.BatchMeta`
  (index tensors and masks, once per step);
* ``attention``: :func:`~kvtier.engine.paged.paged_attention` for every
  layer (write the new token's K/V, gather each sequence's K/V, attend),
  with the metadata already built;
* ``step``: both, as a forward pass pays them.

The model's projections, MLP and norms are not run: this is the part of the
step the paged attention owns. Each figure is the best of ``--rounds``
rounds of ``--iters`` steps (the machine is shared; the minimum is the
least disturbed), with the median round beside it. It also checks the
output against dense attention over each sequence's own K/V and prints the
largest difference.

Prints a table; writes ``bench/results/attention_step.json`` (``--out``).
Compare two checkouts by running it with ``PYTHONPATH`` at each one's ``src``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _common import REPO, format_table, git_state, log, machine_info, package_version, write_json

import kvtier
from kvtier.engine.paged import paged_attention
from kvtier.layers.batch import BatchMeta, SeqSlice
from kvtier.layout import KVLayout
from kvtier.storage import KVBlockStorage

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16


class _Layer(torch.nn.Module):
    """What paged attention reads from a model's attention module: its layer index."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.layer_idx = index


def _setup(
    batch: int, context: int, seed: int
) -> tuple[KVBlockStorage, list[SeqSlice], list[list[int]], list[int]]:
    """A filled storage and ``batch`` decode slices of about ``context`` tokens each."""
    rng = random.Random(seed)
    lengths = [max(1, context - rng.randrange(0, max(1, context // 2))) for _ in range(batch)]
    needed = sum(-(-n // BLOCK) for n in lengths)
    storage = KVBlockStorage(
        KVLayout(LAYERS, KV_HEADS, DIM, BLOCK, "float32"), needed + 8, dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(seed)
    storage.tensor.copy_(torch.randn(storage.tensor.shape, generator=gen))
    ids = list(range(needed + 8))
    rng.shuffle(ids)
    tables: list[list[int]] = []
    slices: list[SeqSlice] = []
    for n in lengths:
        blocks = [ids.pop() for _ in range(-(-n // BLOCK))]
        tables.append(blocks)
        slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        slices.append(SeqSlice(n - 1, 1, slots))
    return storage, slices, tables, lengths


def _best(fn: Callable[[], object], iters: int, rounds: int) -> tuple[float, float]:
    """(best, median) seconds per call over ``rounds`` rounds of ``iters`` calls."""
    for _ in range(3):
        fn()
    per: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per.append((time.perf_counter() - t0) / iters)
    return min(per), statistics.median(per)


def _dense_error(
    storage: KVBlockStorage, slices: list[SeqSlice], lengths: list[int], seed: int
) -> float:
    """Largest difference of one layer's paged output from dense SDPA per sequence."""
    gen = torch.Generator().manual_seed(seed + 1)
    B = len(slices)
    q = torch.randn(1, HEADS, B, DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, B, DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, B, DIM, generator=gen)
    meta = BatchMeta(storage, slices)
    out, _ = paged_attention(_Layer(0), q, k, v, None, scaling=DIM**-0.5, kvtier_batch=meta)
    worst = 0.0
    for i, (s, n) in enumerate(zip(slices, lengths, strict=True)):
        rows = storage.slot_rows(torch.tensor(list(s.slots[:n]), dtype=torch.int64))
        kk, vv = storage.read_rows(0, rows)
        ref = F.scaled_dot_product_attention(
            q[:, :, i : i + 1],
            kk.transpose(0, 1)[None],
            vv.transpose(0, 1)[None],
            scale=DIM**-0.5,
            enable_gqa=True,
        )
        worst = max(worst, (out[0, i] - ref[0, :, 0]).abs().max().item())
    return worst


def measure(batch: int, context: int, iters: int, rounds: int, seed: int) -> dict[str, Any]:
    storage, slices, _, lengths = _setup(batch, context, seed)
    layers = [_Layer(i) for i in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, batch, DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, batch, DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, batch, DIM, generator=gen)
    scale = DIM**-0.5
    meta = BatchMeta(storage, slices)

    def build() -> None:
        BatchMeta(storage, slices)

    def attend(m: BatchMeta = meta) -> None:
        for layer in layers:
            paged_attention(layer, q, k, v, None, scaling=scale, kvtier_batch=m)

    def step() -> None:
        attend(BatchMeta(storage, slices))

    with torch.no_grad():
        meta_s = _best(build, iters, rounds)
        attn_s = _best(attend, iters, rounds)
        step_s = _best(step, iters, rounds)
        err = _dense_error(storage, slices, lengths, seed)
    return {
        "sequences": batch,
        "context_max": max(lengths),
        "context_mean": sum(lengths) / len(lengths),
        "meta_s": meta_s[0],
        "meta_median_s": meta_s[1],
        "attention_s": attn_s[0],
        "attention_median_s": attn_s[1],
        "step_s": step_s[0],
        "step_median_s": step_s[1],
        "per_layer_us": attn_s[0] / LAYERS * 1e6,
        "max_abs_diff_vs_dense": err,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[100, 500], help="longest context per case"
    )
    parser.add_argument("--iters", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "attention_step.json"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for context in args.contexts:
        for batch in args.sizes:
            log(f"{batch} sequences, contexts up to {context}")
            rows.append(measure(batch, context, args.iters, args.rounds, args.seed))
    print(
        "paged attention of one decode step (30 layers, 9/3 heads, dim 64, 16-token blocks, fp32)"
    )
    print(
        format_table(
            [
                "sequences",
                "ctx max",
                "meta ms",
                "attention ms",
                "(median)",
                "step ms",
                "us/layer",
                "max diff",
            ],
            [
                [
                    r["sequences"],
                    r["context_max"],
                    f"{r['meta_s'] * 1e3:.3f}",
                    f"{r['attention_s'] * 1e3:.3f}",
                    f"{r['attention_median_s'] * 1e3:.3f}",
                    f"{r['step_s'] * 1e3:.3f}",
                    f"{r['per_layer_us']:.1f}",
                    f"{r['max_abs_diff_vs_dense']:.1e}",
                ]
                for r in rows
            ],
        )
    )
    write_json(
        args.out,
        {
            "benchmark": "attention_step",
            "machine": machine_info(),
            "git": git_state(REPO),
            "kvtier_source": str(Path(kvtier.__file__).parent),
            "versions": {p: package_version(p) for p in ("torch", "transformers")},
            "torch_threads": torch.get_num_threads(),
            "geometry": {
                "layers": LAYERS,
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "head_dim": DIM,
                "block_size": BLOCK,
                "dtype": "float32",
            },
            "rows": rows,
        },
    )
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
