"""Encoder-output cache: repeated images through a SigLIP-base vision tower, with and without it.

The workload: ``--images`` distinct PNG files (224 x 224 random pixels,
seeded) and ``--requests`` requests, each carrying one image drawn from a
Zipf distribution (exponent ``--zipf``) over them; and a no-repeat control,
``--control-requests`` requests each with an image never seen before.

The encoder is a SigLIP-base vision tower (12 layers, hidden size 768,
patch 16, 224 px: 196 output rows of 768 floats, 602,112 bytes) with random
weights: its cost and output shape are those of the trained model. Each miss
decodes the PNG, runs the SigLIP image processor (PIL) and the tower; a hit
hashes the file's bytes (SHA-256) and looks the key up.

Systems:

* ``kvtier EncoderCache``: the cache the reference engine uses
  (:meth:`~kvtier.mm.cache.EncoderCache.acquire`, pinned while the request
  holds it, released after), under ``--budget`` bytes, policy ``lru``.
* ``no cache``: every request encodes. Running 1,000 encodes would take
  minutes, so ``--baseline-samples`` requests of the stream are encoded and
  timed; their latencies stand for every request's, and encoder calls equal
  the requests.
* Policy rows (``lfu``, ``arc``, ``s3fifo``): the same cache and stream with
  another policy, its encoder returning a tensor of the tower's output shape
  without computing it (the hit ratio does not depend on encode time, so
  these rows report counts only).
* ``vLLM EncoderCacheManager``: vLLM 0.33's scheduler-side encoder cache
  (``vllm.v1.core.encoder_cache_manager``) given the same budget in
  embeddings (``--budget`` / 3,072 bytes per row) and the same stream, each
  request checking, allocating on a miss, then freeing (its entry becomes
  freeable, evicted oldest first). Counts only: it holds no tensors.
* SGLang's ``MultiModalStaticCache`` is not installed in this environment
  and is not run (nothing is reimplemented in its place).

Time to embeddings is wall time from handing the image over to having its
features. Results go to ``bench/results/encoder_cache.json``; ``--quick`` is
a short smoke run with a tiny tower.
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import time
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
    package_version,
    write_json,
)

from kvtier.mm import EncoderCache, EncoderSpec, MediaItem
from kvtier.mm.images import ImageLimits, decode_image


def make_pngs(n: int, seed: int, size: int = 224) -> list[bytes]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def zipf_stream(n_items: int, n_requests: int, s: float, seed: int) -> list[int]:
    weights = [1.0 / (i + 1) ** s for i in range(n_items)]
    return random.Random(seed).choices(range(n_items), weights=weights, k=n_requests)


class SiglipEncoder:
    """A random-weight SigLIP vision tower as an :class:`~kvtier.mm.cache.ItemEncoder`."""

    def __init__(self, tiny: bool) -> None:
        from transformers import SiglipVisionConfig, SiglipVisionModel
        from transformers.models.siglip.image_processing_pil_siglip import (
            SiglipImageProcessorPil,
        )

        cfg = SiglipVisionConfig() if not tiny else SiglipVisionConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2
        )
        torch.manual_seed(0)
        self.model = SiglipVisionModel(cfg).eval()
        size = cfg.image_size
        self.processor = SiglipImageProcessorPil(size={"height": size, "width": size})
        self.rows = (size // cfg.patch_size) ** 2
        self.dim = cfg.hidden_size
        self.spec = EncoderSpec.make(
            "bench/siglip-base-random", "vision", "image", revision="seed0",
            params={"size": size},
        )
        self.limits = ImageLimits()

    def encode(self, item: MediaItem) -> torch.Tensor:
        image = decode_image(bytes(item.data), self.limits)
        pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            return self.model(pixel_values=pixels).last_hidden_state[0]  # type: ignore[no-any-return]


class ShapeOnlyEncoder:
    """Returns a tensor of the tower's output shape without computing it (count-only rows)."""

    def __init__(self, spec: EncoderSpec, rows: int, dim: int) -> None:
        self.spec = spec
        self.rows, self.dim = rows, dim

    def encode(self, item: MediaItem) -> torch.Tensor:
        return torch.zeros(self.rows, self.dim)


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(int(q * len(v)), len(v) - 1)]


def run_cache(
    cache: EncoderCache, encoder: Any, pngs: list[bytes], stream: list[int]
) -> dict[str, Any]:
    """Every request of ``stream`` through ``cache``; latencies, calls, the most bytes held."""
    calls = 0
    inner = encoder.encode

    def counted(item: MediaItem) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return inner(item)  # type: ignore[no-any-return]

    encoder.encode = counted
    lat: list[float] = []
    max_held = 0
    try:
        for i in stream:
            t0 = time.perf_counter()
            lease = cache.acquire(MediaItem("image", pngs[i]), encoder)
            lat.append(time.perf_counter() - t0)
            lease.release()
            max_held = max(max_held, cache.bytes_held)
    finally:
        encoder.encode = inner
    s = cache.stats()
    return {
        "requests": len(stream),
        "distinct_images": len(set(stream)),
        "encoder_calls": calls,
        "hit_ratio": s.hit_ratio,
        "evictions": s.evictions,
        "p50_s": pct(lat, 0.5),
        "p99_s": pct(lat, 0.99),
        "max_bytes_held": max_held,
        "peak_bytes": s.peak_bytes,
        "budget_bytes": cache.capacity_bytes,
        "latencies_s": lat,
    }


def run_vllm(
    budget_embeds: int, rows: int, row_bytes: int, stream: list[int]
) -> dict[str, Any] | None:
    try:
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    except ImportError as exc:  # pragma: no cover - vLLM is in the bench environment
        log(f"vLLM is not importable ({exc}); its row is skipped")
        return None

    class _Feature:
        def __init__(self, identifier: str) -> None:
            self.identifier = identifier

    class _Request:
        """What EncoderCacheManager reads of a request: its id, features and their sizes."""

        def __init__(self, rid: str, image: int) -> None:
            self.request_id = rid
            self.mm_features = [_Feature(f"img-{image}")]

        def get_num_encoder_embeds(self, input_id: int) -> int:
            return rows

    mgr = EncoderCacheManager(cache_size=budget_embeds)
    calls = 0
    max_used = 0
    for n, image in enumerate(stream):
        req = _Request(f"r{n}", image)
        if not mgr.check_and_update_cache(req, 0):
            if not mgr.can_allocate(req, 0, rows, 0):
                raise RuntimeError("vLLM's encoder cache refused an allocation")
            mgr.allocate(req, 0)
            calls += 1
        max_used = max(max_used, budget_embeds - mgr.num_free_slots)
        mgr.free(req)
    return {
        "requests": len(stream),
        "encoder_calls": calls,
        "hit_ratio": 1 - calls / len(stream),
        "max_bytes_held": max_used * row_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--control-requests", type=int, default=200)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--budget", type=int, default=64 * 2**20, help="bytes (default 64 MiB)")
    ap.add_argument("--baseline-samples", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a tiny tower and a short stream")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "encoder_cache.json"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.requests, args.control_requests = 20, 100, 20
        args.baseline_samples = 10
    encoder = SiglipEncoder(tiny=args.quick)
    row_bytes = encoder.dim * 4
    out_bytes = encoder.rows * row_bytes
    log(f"{args.images} images, {args.requests} requests (Zipf {args.zipf}); output "
        f"{encoder.rows} x {encoder.dim} float32 = {out_bytes:,} bytes; budget {args.budget:,} "
        f"bytes ({args.budget // out_bytes} outputs); torch threads {torch.get_num_threads()}")
    pngs = make_pngs(args.images, args.seed)
    control_pngs = make_pngs(args.control_requests, args.seed + 1)
    stream = zipf_stream(args.images, args.requests, args.zipf, args.seed)

    encoder.encode(MediaItem("image", pngs[0]))  # warm-up, outside every timing
    log("kvtier EncoderCache, Zipf stream ...")
    cached = run_cache(EncoderCache(args.budget), encoder, pngs, stream)
    log("kvtier EncoderCache, no-repeat control ...")
    control = run_cache(
        EncoderCache(args.budget), encoder, control_pngs, list(range(args.control_requests))
    )
    log("no cache: sampled encodes ...")
    sample = random.Random(args.seed + 2).sample(stream, min(args.baseline_samples, len(stream)))
    base_lat = []
    for i in sample:
        t0 = time.perf_counter()
        encoder.encode(MediaItem("image", pngs[i]))
        base_lat.append(time.perf_counter() - t0)
    # The cost of a hit on its own: one hot image looked up many times.
    hot = EncoderCache(args.budget)
    hot.get_or_encode(MediaItem("image", pngs[0]), encoder)
    hit_lat = []
    for _ in range(2000):
        t0 = time.perf_counter()
        hot.acquire(MediaItem("image", pngs[0]), encoder).release()
        hit_lat.append(time.perf_counter() - t0)
    hit_s = pct(hit_lat, 0.5)
    encode_s = pct(base_lat, 0.5)

    policies: dict[str, dict[str, Any]] = {}
    shape_only = ShapeOnlyEncoder(encoder.spec, encoder.rows, encoder.dim)
    for policy in ("lru", "lfu", "arc", "s3fifo"):
        r = run_cache(EncoderCache(args.budget, policy=policy), shape_only, pngs, stream)
        r.pop("latencies_s")
        policies[policy] = r
    vllm = run_vllm(args.budget // row_bytes, encoder.rows, row_bytes, stream)

    ms = 1e3
    headers = ["system", "stream", "requests", "encoder calls", "hit ratio",
               "p50 ms", "p99 ms", "most bytes held"]
    rows: list[list[object]] = [
        ["kvtier EncoderCache (lru)", "Zipf", cached["requests"], cached["encoder_calls"],
         f"{cached['hit_ratio']:.3f}", f"{cached['p50_s'] * ms:.3f}",
         f"{cached['p99_s'] * ms:.1f}", f"{cached['max_bytes_held']:,}"],
        ["no cache (sampled)", "Zipf", args.requests, args.requests, "0.000",
         f"{encode_s * ms:.1f}", f"{pct(base_lat, 0.99) * ms:.1f}", "0"],
        ["kvtier EncoderCache (lru)", "no repeats", control["requests"],
         control["encoder_calls"], f"{control['hit_ratio']:.3f}",
         f"{control['p50_s'] * ms:.1f}", f"{control['p99_s'] * ms:.1f}",
         f"{control['max_bytes_held']:,}"],
    ]
    for name, r in policies.items():
        if name == "lru":
            continue
        rows.append([f"kvtier EncoderCache ({name}), counts", "Zipf", r["requests"],
                     r["encoder_calls"], f"{r['hit_ratio']:.3f}", "-", "-",
                     f"{r['max_bytes_held']:,}"])
    if vllm is not None:
        rows.append(["vLLM EncoderCacheManager, counts", "Zipf", vllm["requests"],
                     vllm["encoder_calls"], f"{vllm['hit_ratio']:.3f}", "-", "-",
                     f"{vllm['max_bytes_held']:,}"])
    rows.append(["SGLang MultiModalStaticCache", "-", "not installed: not run", "", "", "",
                 "", ""])
    print(format_table(headers, rows))
    print(f"\nhit (p50) {hit_s * 1e6:.1f} us, encode (p50) {encode_s * ms:.1f} ms: a hit is "
          f"{encode_s / hit_s:,.0f}x cheaper; distinct images in the Zipf stream "
          f"{cached['distinct_images']}, encoder calls {cached['encoder_calls']}, evictions "
          f"{cached['evictions']}; budget {args.budget:,} bytes")
    if args.markdown:
        print()
        print(format_markdown_table(headers, rows))
    cached.pop("latencies_s")
    control.pop("latencies_s")
    write_json(
        args.out,
        {
            "benchmark": "encoder_cache",
            "quick": args.quick,
            "images": args.images,
            "requests": args.requests,
            "zipf": args.zipf,
            "budget_bytes": args.budget,
            "output_shape": [encoder.rows, encoder.dim],
            "output_bytes": out_bytes,
            "torch_threads": torch.get_num_threads(),
            "kvtier_zipf": cached,
            "kvtier_control": control,
            "no_cache_sampled": {
                "samples": len(base_lat),
                "p50_s": encode_s,
                "p99_s": pct(base_lat, 0.99),
                "encoder_calls": args.requests,
            },
            "hit_p50_s": hit_s,
            "hit_speedup": encode_s / hit_s,
            "policies": policies,
            "vllm_encoder_cache_manager": vllm,
            "vllm_version": package_version("vllm"),
            "sglang": "not installed: not run",
            "machine": machine_info(),
            "git": git_state(REPO),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
