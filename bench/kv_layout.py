"""KV tensor layout: block-contiguous against per-layer storage, on CPU.

What is measured: the tensor work an engine does on a paged KV cache, for two
memory layouts of the same blocks, with SmolLM2-135M's KV geometry (30
layers, 3 KV heads, head_dim 64) and 16-token blocks, in bf16 and fp32:

* ``decode write``: one decode step of a batch (8 sequences, 1 token each,
  slots in 8 random blocks) written to every layer: 30 ``write`` calls.
* ``prefill write``: a 2,048-token prefill written to every layer (30 calls).
* ``read``: a 2,048-token sequence read back through its block table (128
  scattered blocks) from every layer (30 calls).
* ``export`` / ``import``: 64 scattered blocks (all layers' K and V) copied
  out to, and back in from, a contiguous block-major staging buffer, as an
  offload tier does (``export_blocks(ids, out=buf)`` / ``import_blocks``).
* ``CoW copy``: 8 ``(src, dst)`` block copies, every layer (``copy_blocks``).

Layouts (systems):

* ``block``: ``KVBlockStorage(layout_kind="block")``, one tensor
  ``[num_blocks, layers, 2, block_size, heads, dim]``; a block is contiguous.
* ``layer``: ``KVBlockStorage(layout_kind="layer")``, one tensor
  ``[layers, 2, num_blocks, block_size, heads, dim]``; a layer is contiguous.
* ``layer-list``: per-layer tensors ``[2, num_blocks, block_size, heads, dim]``
  in a Python list (the way vLLM allocates its paged caches), driven by plain
  torch calls; whole-block operations loop over the layers.
* ``block (batched)``: the block layout scattering blocks with one
  ``index_copy_`` instead of its CPU default, one ``copy_`` per block
  (import and CoW only).
* ``memcpy``: the ceiling, ``dst.copy_(src)`` of contiguous tensors moving the
  same number of bytes with the same number of calls (30 for per-layer ops).

The ``KVBlockStorage`` rows include its argument checks; the slot mapping
and block-id tensors are passed as the same tensor objects for all layers,
as an engine does, so their validation is paid once per pass. Times are
medians over ``--repeat`` samples, each sample the mean of enough calls to
last about ``--sample-ms``; the systems alternate within each repeat, in an
order rotated from one repeat to the next. GB/s counts the K/V payload bytes
moved (once, not read + write). Before timing, the layouts are checked to
store and return identical data.

Run ``python bench/kv_layout.py --help``; ``--quick`` is a smoke run of a few
seconds. Results go to ``bench/results/kv_layout.json``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Sequence
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
    write_json,
)

sys.path.insert(0, str(REPO / "src"))

from kvtier.layout import KVLayout
from kvtier.storage import KVBlockStorage

DEFAULT_JSON = REPO / "bench" / "results" / "kv_layout.json"
#: SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, head_dim 64.
GEOMETRY = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

Op = Callable[[], object]


class LayerList:
    """Per-layer caches ``[2, num_blocks, block_size, heads, dim]``, driven by plain torch."""

    def __init__(self, layout: KVLayout, num_blocks: int, dtype: torch.dtype) -> None:
        L, H, D, bs = layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
        self.caches = [torch.zeros(2, num_blocks, bs, H, D, dtype=dtype) for _ in range(L)]
        self.rows = [c.view(2, num_blocks * bs, H, D) for c in self.caches]
        self.H, self.D = H, D

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = self.rows[layer]
        rows[0].index_copy_(0, slots, k)
        rows[1].index_copy_(0, slots, v)

    def read(self, layer: int, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.caches[layer]
        k = c[0].index_select(0, ids).view(-1, self.H, self.D)[:n]
        v = c[1].index_select(0, ids).view(-1, self.H, self.D)[:n]
        return k, v

    def export_blocks(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        for layer, c in enumerate(self.caches):
            torch.index_select(c, 1, ids, out=out[:, layer].transpose(0, 1))

    def import_blocks(self, ids: torch.Tensor, data: torch.Tensor) -> None:
        for layer, c in enumerate(self.caches):
            c.index_copy_(1, ids, data[:, layer].transpose(0, 1))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for c in self.caches:
            c.index_copy_(1, dst, c.index_select(1, src))


def time_op(fn: Op, sample_s: float) -> tuple[float, int]:
    """Calls per sample so one sample lasts about ``sample_s``; returns (first time, number)."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    return once, max(1, int(sample_s / once))


def sample(fn: Op, number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def build_ops(
    dtype_name: str, num_blocks: int, block_size: int, seed: int
) -> tuple[dict[str, dict[str, Op]], dict[str, int], dict[str, int]]:
    """For each operation: one callable per system; the payload bytes and calls of each op."""
    dtype = DTYPES[dtype_name]
    layout = KVLayout(block_size=block_size, dtype=dtype_name, **GEOMETRY)
    L, H, D, bs = layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
    gen = torch.Generator().manual_seed(seed)
    stores: dict[str, Any] = {
        "block": KVBlockStorage(layout, num_blocks, layout_kind="block"),
        "layer": KVBlockStorage(layout, num_blocks, layout_kind="layer"),
        "layer-list": LayerList(layout, num_blocks, dtype),
    }
    perm = torch.randperm(num_blocks, generator=gen)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    # A 2,048-token sequence in 128 scattered blocks; a decode batch of 8
    # sequences whose next token lands at a random offset of its own block.
    seq_tokens = 2048
    seq_blocks = perm[: seq_tokens // bs].clone()
    seq_slots = (seq_blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:seq_tokens].clone()
    dec_blocks = perm[seq_tokens // bs : seq_tokens // bs + 8]
    dec_slots = (dec_blocks * bs + torch.randint(0, bs, (8,), generator=gen)).clone()
    pre_k = [rand(seq_tokens, H, D) for _ in range(L)]
    pre_v = [rand(seq_tokens, H, D) for _ in range(L)]
    dec_k = [rand(8, H, D) for _ in range(L)]
    dec_v = [rand(8, H, D) for _ in range(L)]
    io_ids = perm[-64:].clone()
    cow_src = perm[-72:-64].tolist()
    cow_dst = perm[-80:-72].tolist()
    cow_pairs = list(zip(cow_src, cow_dst, strict=True))
    cow_src_t, cow_dst_t = torch.tensor(cow_src), torch.tensor(cow_dst)
    staging = torch.empty(64, L, 2, bs, H, D, dtype=dtype)

    # Fill every store identically and check that the layouts agree.
    for layer in range(L):
        for s in stores.values():
            s.write(layer, seq_slots, pre_k[layer], pre_v[layer])
    ref = stores["block"].export_blocks(seq_blocks)
    check = torch.empty_like(ref)
    stores["layer-list"].export_blocks(seq_blocks, check)
    same = torch.equal(ref, check) and torch.equal(ref, stores["layer"].export_blocks(seq_blocks))
    if not same:
        raise SystemExit("layouts disagree after identical writes: a bug")
    for layer in (0, L - 1):
        for s in stores.values():
            k, v = s.read(layer, seq_blocks, seq_tokens)
            if not (torch.equal(k, pre_k[layer]) and torch.equal(v, pre_v[layer])):
                raise SystemExit("read did not return what was written: a bug")

    token_bytes = H * D * dtype.itemsize  # one token's K (or V) in one layer
    block_bytes = layout.bytes_per_block
    nbytes = {
        "decode write (8 tok x 30 layers)": 2 * 8 * token_bytes * L,
        "prefill write (2048 tok x 30 layers)": 2 * seq_tokens * token_bytes * L,
        "read 2048 tok (x 30 layers)": 2 * seq_tokens * token_bytes * L,
        "export 64 blocks": 64 * block_bytes,
        "import 64 blocks": 64 * block_bytes,
        "CoW copy 8 blocks": 8 * block_bytes,
    }
    calls = {op: (L if "layers" in op else 1) for op in nbytes}

    def writer(s: Any, slots: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> Op:
        def run() -> None:
            for layer in range(L):
                s.write(layer, slots, ks[layer], vs[layer])

        return run

    def reader(s: Any) -> Op:
        def run() -> None:
            for layer in range(L):
                s.read(layer, seq_blocks, seq_tokens)

        return run

    def memcpy(total: int, n_calls: int) -> Op:
        per = total // n_calls // dtype.itemsize
        src, dst = torch.randn(per, generator=gen).to(dtype), torch.empty(per, dtype=dtype)

        def run() -> None:
            for _ in range(n_calls):
                dst.copy_(src)

        return run

    ops: dict[str, dict[str, Op]] = {}
    for op in nbytes:
        ops[op] = {}
    for name, s in stores.items():
        ops["decode write (8 tok x 30 layers)"][name] = writer(s, dec_slots, dec_k, dec_v)
        ops["prefill write (2048 tok x 30 layers)"][name] = writer(s, seq_slots, pre_k, pre_v)
        ops["read 2048 tok (x 30 layers)"][name] = reader(s)
        if name == "layer-list":
            ops["export 64 blocks"][name] = lambda s=s: s.export_blocks(io_ids, staging)
            ops["import 64 blocks"][name] = lambda s=s: s.import_blocks(io_ids, staging)
            ops["CoW copy 8 blocks"][name] = lambda s=s: s.copy_blocks(cow_src_t, cow_dst_t)
        else:
            ops["export 64 blocks"][name] = lambda s=s: s.export_blocks(io_ids, out=staging)
            ops["import 64 blocks"][name] = lambda s=s: s.import_blocks(io_ids, staging)
            ops["CoW copy 8 blocks"][name] = lambda s=s: s.copy_blocks(cow_pairs)
    # The batched alternative to the block layout's per-block copies on CPU.
    block = stores["block"]

    def batched(fn: Callable[[], None]) -> Op:
        def run() -> None:
            block._copy_per_block = False
            try:
                fn()
            finally:
                block._copy_per_block = True

        return run

    ops["import 64 blocks"]["block (batched)"] = batched(
        lambda: block.import_blocks(io_ids, staging)
    )
    ops["CoW copy 8 blocks"]["block (batched)"] = batched(lambda: block.copy_blocks(cow_pairs))
    for op, total in nbytes.items():
        ops[op]["memcpy"] = memcpy(total, calls[op])
    return ops, nbytes, calls


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    for dtype_name in args.dtypes:
        ops, nbytes, calls = build_ops(dtype_name, args.num_blocks, args.block_size, args.seed)
        for op, systems in ops.items():
            numbers = {name: time_op(fn, args.sample_ms / 1000)[1] for name, fn in systems.items()}
            times: dict[str, list[float]] = {name: [] for name in systems}
            gc.disable()
            try:
                names = list(systems)
                for r in range(args.repeat):
                    # Rotate the order each repeat so no system always runs first.
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        times[name].append(sample(systems[name], numbers[name]))
            finally:
                gc.enable()
            ceiling = median(times["memcpy"])
            for name in systems:
                t = median(times[name])
                rows.append(
                    {
                        "dtype": dtype_name,
                        "op": op,
                        "system": name,
                        "median_us": t * 1e6,
                        "per_call_us": t * 1e6 / calls[op],
                        "bytes": nbytes[op],
                        "gb_per_s": nbytes[op] / t / 1e9,
                        "memcpy_over_this": ceiling / t,
                        "samples_us": [x * 1e6 for x in times[name]],
                        "calls_per_sample": numbers[name],
                    }
                )
            print(f"  {dtype_name} {op}: done", file=sys.stderr, flush=True)
        del ops
        gc.collect()
    return {
        "benchmark": "kv_layout",
        "machine": machine_info(),
        "git": git_state(REPO),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "params": {
            **GEOMETRY,
            "block_size": args.block_size,
            "num_blocks": args.num_blocks,
            "dtypes": list(args.dtypes),
            "repeat": args.repeat,
            "sample_ms": args.sample_ms,
            "quick": args.quick,
        },
        "results": rows,
    }


def table_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            r["dtype"],
            r["op"],
            r["system"],
            f"{r['median_us']:,.1f}",
            f"{r['per_call_us']:,.2f}",
            f"{r['gb_per_s']:.2f}",
            f"{r['memcpy_over_this']:.2f}",
        ]
        for r in results
    ]


HEADERS = ["dtype", "operation", "layout", "median us", "us per call", "GB/s", "vs memcpy"]
PIVOT_SYSTEMS = ["block", "layer", "layer-list", "block (batched)", "memcpy"]


def pivot(results: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One row per dtype and operation: median us of each layout, and layer/block."""
    cells: dict[tuple[str, str], dict[str, float]] = {}
    for r in results:
        cells.setdefault((r["dtype"], r["op"]), {})[r["system"]] = r["median_us"]
    headers = ["dtype", "operation", *(f"{s} us" for s in PIVOT_SYSTEMS), "layer / block"]
    rows = []
    for (dtype, op), by in cells.items():
        row = [dtype, op]
        row += [f"{by[s]:,.0f}" if s in by else "" for s in PIVOT_SYSTEMS]
        row.append(f"{by['layer'] / by['block']:.2f}x")
        rows.append(row)
    return headers, rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Block-contiguous vs per-layer KV tensor layout (CPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--num-blocks", type=int, default=2048, help="blocks in each store")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--repeat", type=int, default=15, help="timed samples per system")
    p.add_argument("--sample-ms", type=float, default=40.0, help="target length of one sample")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: small store, few samples")
    p.add_argument(
        "--markdown", action="store_true", help="also print the summary table as Markdown"
    )
    p.add_argument("--json-out", type=Path, default=DEFAULT_JSON, help="where to write JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.num_blocks = min(args.num_blocks, 512)
        args.repeat = min(args.repeat, 3)
        args.sample_ms = min(args.sample_ms, 5.0)
    if args.num_blocks < 2048 // args.block_size + 80:
        p.error(f"--num-blocks must be at least {2048 // args.block_size + 80}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    payload = run(args)
    print(
        f"torch {payload['torch']}, {payload['torch_threads']} threads, "
        f"{payload['machine']['cpu']}; SmolLM2-135M geometry, block size {args.block_size}, "
        f"{args.num_blocks} blocks per store"
    )
    print(format_table(HEADERS, table_rows(payload["results"])))
    headers, rows = pivot(payload["results"])
    print()
    print(format_table(headers, rows))
    if args.markdown:
        print()
        print(format_markdown_table(headers, rows))
    write_json(args.json_out, payload)
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
