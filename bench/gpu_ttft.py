"""Time to first token with a long cached prefix, at a real model's size.

For each model geometry and prefix length, four ways of serving the same
request (a prefix of P random tokens and a 16-token suffix, one greedy
token) on kvtier's :class:`~kvtier.engine.Engine`, each on a fresh engine
over the same model:

* **recompute**: nothing cached, the whole prompt is computed;
* **device**: the prefix is in the device's block pool (an earlier request
  with another suffix left it there);
* **host**: the prefix is only in a host-memory tier (pinned when CUDA is
  present): the earlier request stored it there as it was computed
  (write-through), then the device's cached blocks were dropped;
* **host-layers**: the same, the load landing layer by layer while the
  forward pass starts (``tier_layer_loads``, ``kvtier serve
  --tier-layer-loads``);
* **disk**: the same with a disk tier under a temporary directory.

Beside them, the **copy ceiling**: the prefix's KV bytes moved host to
device in one ``copy_`` from a pinned buffer (what a load cannot beat), and
the load's share of the host TTFT over the device one. Each engine's cost
model starts with nothing observed, so a tier prefix is loaded, not
recomputed; the engine's counters say how many prompt tokens came from the
device and from the tiers, and a case whose prefix did not come from where
it should is marked so.

The models are random-weight ones built on the device from transformers
configs with the geometry of Llama-3.1-8B and Qwen3-30B-A3B (layers,
heads, head size, experts; nothing downloaded), in bfloat16 by default.
``--layers N`` keeps only the first N layers (to try the script on a CPU:
the per-layer cost is the real one, the total is not), and the ``tiny-*``
geometries are for checking the script itself: on a CPU they and prefixes
of 256 and 1024 tokens are the defaults.

    python bench/gpu_ttft.py --device cuda --prefixes 2048 8192 32768
    python bench/gpu_ttft.py --device cpu --geometries tiny-llama --prefixes 64 128 --dtype float32

Writes ``OUT/gpu_ttft.json``; ``bench/gpu_check.py --parts ttft`` runs the
same as one of its parts.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import REPO, format_table, git_state, machine_info, write_json

sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))  # the character tokenizer

import torch

#: Tokens after the shared prefix, different in each request.
SUFFIX = 16
#: Real models' KV and expert geometry (values from their published configs).
GEOMETRIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.1-8b": (
        "llama",
        {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3-30b-a3b": (
        "qwen3_moe",
        {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
        },
    ),
    "tiny-llama": (
        "llama",
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
        },
    ),
    "tiny-moe": (
        "qwen3_moe",
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 4096,
        },
    ),
}
CASES = ("recompute", "device", "host", "host-layers", "disk")

#: Geometries and prefix lengths when none are given: the real sizes on a GPU; on a CPU,
#: where an 8B model's 32k-token prefill takes hours, the tiny ones that check the script.
GPU_DEFAULTS: tuple[tuple[str, ...], tuple[int, ...]] = (
    ("llama-3.1-8b", "qwen3-30b-a3b"),
    (2048, 8192, 32768),
)
CPU_DEFAULTS: tuple[tuple[str, ...], tuple[int, ...]] = (("tiny-llama", "tiny-moe"), (256, 1024))


def _words(items: Sequence[object]) -> str:
    return " ".join(map(str, items))


def defaults_for(device: torch.device) -> tuple[tuple[str, ...], tuple[int, ...]]:
    return GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS


def say(text: str = "") -> None:
    print(text, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(name: str, device: torch.device, dtype: torch.dtype, layers: int | None) -> Any:
    """A random-weight model of ``name``'s geometry, built on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = GEOMETRIES[name]
    fields = dict(fields)
    if layers is not None:
        fields["num_hidden_layers"] = min(layers, fields["num_hidden_layers"])
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def prompt_pair(prefix: int, vocab: int, seed: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing a ``prefix``-token start, with different ``SUFFIX``-token ends."""
    g = torch.Generator().manual_seed(seed)
    hi = min(vocab, 30000)
    shared = torch.randint(5, hi, (prefix,), generator=g).tolist()
    a = shared + torch.randint(5, hi, (SUFFIX,), generator=g).tolist()
    b = shared + torch.randint(5, hi, (SUFFIX,), generator=g).tolist()
    return a, b


def first_token_s(engine: Any, prompt: list[int]) -> float:
    """Seconds from queueing ``prompt`` to its first token; the request then runs to its end."""
    from kvtier.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    sync(engine.device)
    start = time.perf_counter()
    rid = engine.add_request(prompt, params)
    took: float | None = None
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if took is None and out.request_id == rid and out.token_ids:
                sync(engine.device)
                took = time.perf_counter() - start
        steps += 1
        if steps > 100_000:
            raise RuntimeError("the engine made no progress in 100000 steps")
    if took is None:
        raise RuntimeError("the request ended without a token")
    return took


def copy_ceiling_s(nbytes: int, device: torch.device, repeat: int) -> float | None:
    """Best time of one pinned host-to-device ``copy_`` of ``nbytes`` (None on a CPU)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = math.inf
    for _ in range(repeat + 1):  # the first one warms up
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return best


def run_case(
    case: str,
    model: Any,
    tok: Any,
    prompts: tuple[list[int], list[int]],
    *,
    block_size: int,
    batch_tokens: int,
    tmp: Path,
) -> dict[str, Any]:
    """One case on a fresh engine: the second prompt's TTFT and where its prompt came from."""
    from kvtier.engine import Engine
    from kvtier.offload.disk import DiskStore
    from kvtier.offload.host import HostStore
    from kvtier.offload.tier import Tier

    a, b = prompts
    per_request = math.ceil((len(b) + 1) / block_size)
    tiers: list[Tier] = []
    if case in ("host", "host-layers"):
        tiers = [Tier(HostStore(), 2 * per_request, write_mode="write_through")]
    elif case == "disk":
        root = tmp / "disk-tier"
        tiers = [Tier(DiskStore(root), 2 * per_request, write_mode="write_through")]
    engine = Engine(
        model,
        tok,
        model_id="ttft",
        block_size=block_size,
        num_blocks=2 * per_request + 8,
        max_num_seqs=1,
        max_num_batched_tokens=batch_tokens,
        max_model_len=len(b) + 8,
        tiers=tiers,
        tier_layer_loads=case == "host-layers",
    )
    try:
        # A prompt that shares no block with ``a`` or ``b`` warms kernels and allocator.
        vocab = int(model.config.vocab_size)
        warm = [(t + 1) % vocab for t in a[: min(len(a), 2 * block_size)]]
        first_token_s(engine, warm)
        if case != "recompute":
            first_token_s(engine, a)
        if tiers:
            assert engine.tier_chain is not None
            engine.tier_chain.flush()
            engine.manager.reset_prefix_cache()
        counters = engine.counters
        cached_before = int(counters.cached_prompt_tokens)
        loaded_before = int(counters.loaded_prompt_tokens)
        seconds = first_token_s(engine, b)
        # Cached prompt tokens count the loaded ones too.
        loaded_tokens = int(counters.loaded_prompt_tokens) - loaded_before
        device_tokens = int(counters.cached_prompt_tokens) - cached_before - loaded_tokens
        want = {"recompute": (0, 0), "device": (1, 0)}.get(case, (0, 1))
        prefix = len(b) - SUFFIX
        got_device = device_tokens >= prefix - block_size
        got_loaded = loaded_tokens >= prefix - block_size
        as_planned = (got_device, got_loaded) == (bool(want[0]), bool(want[1]))
        storage = engine.storage
        if case == "host-layers" and storage.fills == 0:
            as_planned = False  # the load did not land layer by layer
        plans = dict(engine.connector.costs.plans) if tiers else {}
        return {
            "ttft_s": seconds,
            "device_tokens": device_tokens,
            "loaded_tokens": loaded_tokens,
            "as_planned": as_planned,
            "plans": plans,
            "layer_fills": storage.fills,
            "fill_copies": dict(getattr(storage, "fill_copies", {})),
        }
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def ttft(
    device: torch.device,
    *,
    geometries: Sequence[str] = GPU_DEFAULTS[0],
    prefixes: Sequence[int] = GPU_DEFAULTS[1],
    dtype: torch.dtype = torch.bfloat16,
    layers: int | None = None,
    block_size: int = 16,
    batch_tokens: int = 8192,
    repeat: int = 3,
) -> dict[str, Any]:
    """Every geometry x prefix x case (see the module docstring); ``ok`` if each case's
    prefix came from where it should."""
    from tiny_model import tiny_tokenizer  # type: ignore[import-not-found]

    from kvtier.engine.hf_cache import layout_for_model

    tok = tiny_tokenizer()
    results: list[dict[str, Any]] = []
    rows = []
    for name in geometries:
        say(f"{name}: building on {device} ({dtype}, layers: {layers or 'all'})")
        t0 = time.perf_counter()
        model = build_model(name, device, dtype, layers)
        built_s = time.perf_counter() - t0
        layout = layout_for_model(model.config, block_size, dtype)
        vocab = int(model.config.vocab_size)
        for prefix in prefixes:
            prompts = prompt_pair(prefix, vocab, seed=prefix)
            kv_bytes = math.ceil(prefix / block_size) * layout.bytes_per_block
            ceiling = copy_ceiling_s(kv_bytes, device, repeat)
            row: dict[str, Any] = {
                "geometry": name,
                "layers": int(model.config.num_hidden_layers),
                "prefix_tokens": prefix,
                "prefix_kv_bytes": kv_bytes,
                "copy_ceiling_s": ceiling,
                "model_build_s": round(built_s, 2),
            }
            with tempfile.TemporaryDirectory() as tmp:
                for case in CASES:
                    say(f"{name}: {prefix}-token prefix, {case}")
                    row[case] = run_case(
                        case,
                        model,
                        tok,
                        prompts,
                        block_size=block_size,
                        batch_tokens=batch_tokens,
                        tmp=Path(tmp),
                    )
            rec = row["recompute"]["ttft_s"]
            dev = row["device"]["ttft_s"]
            for case in CASES[1:]:
                row[case]["vs_recompute"] = row[case]["ttft_s"] / rec
            row["host_vs_device"] = row["host"]["ttft_s"] / dev
            row["host_layers_vs_device"] = row["host-layers"]["ttft_s"] / dev
            # What loading the prefix added over finding it on the device, against what
            # moving its bytes once costs.
            if ceiling is not None:
                extra = row["host"]["ttft_s"] - dev
                row["host_load_vs_ceiling"] = extra / ceiling if ceiling > 0 else None
            results.append(row)
            rows.append(
                (
                    name,
                    prefix,
                    f"{kv_bytes / 2**20:.1f}",
                    f"{1000 * rec:.1f}",
                    f"{1000 * dev:.1f}",
                    f"{1000 * row['host']['ttft_s']:.1f}",
                    f"{1000 * row['host-layers']['ttft_s']:.1f}",
                    f"{1000 * row['disk']['ttft_s']:.1f}",
                    "-" if ceiling is None else f"{1000 * ceiling:.2f}",
                    f"{row['host']['vs_recompute']:.3f}x",
                    f"{row['host_vs_device']:.2f}x",
                    f"{row['host_layers_vs_device']:.2f}x",
                    "yes" if all(row[c]["as_planned"] for c in CASES) else "NO",
                )
            )
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    say(
        format_table(
            [
                "geometry",
                "prefix",
                "KV MiB",
                "recompute ms",
                "device ms",
                "host ms",
                "host by layer ms",
                "disk ms",
                "copy ceiling ms",
                "host vs recompute",
                "host vs device",
                "by layer vs device",
                "as planned",
            ],
            rows,
        )
    )
    ok = all(r[c]["as_planned"] for r in results for c in CASES)
    return {"ok": ok, "dtype": str(dtype).removeprefix("torch."), "rows": results}


def parse_dtype(name: str) -> torch.dtype:
    from kvtier.engine.config import resolve_dtype

    return resolve_dtype(name)


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The options of :func:`ttft` (``prefix`` names them apart inside another script)."""
    p.add_argument(
        f"--{prefix}geometries",
        nargs="+",
        default=None,
        choices=sorted(GEOMETRIES),
        help=f"model geometries (default: {_words(GPU_DEFAULTS[0])} on a GPU, "
        f"{_words(CPU_DEFAULTS[0])} on a CPU)",
    )
    p.add_argument(
        f"--{prefix}prefixes",
        nargs="+",
        type=int,
        default=None,
        help=f"cached prefix lengths in tokens (default: {_words(GPU_DEFAULTS[1])} on a GPU, "
        f"{_words(CPU_DEFAULTS[1])} on a CPU)",
    )
    p.add_argument(
        f"--{prefix}dtype",
        default="bfloat16",
        help="weights and KV dtype: bfloat16, float16 or float32",
    )
    p.add_argument(
        f"--{prefix}layers",
        type=int,
        default=None,
        help="keep only the first N layers (default: all)",
    )
    p.add_argument(
        f"--{prefix}batch-tokens",
        type=int,
        default=8192,
        help="tokens one engine step computes at most (default 8192)",
    )


def ttft_from_args(device: torch.device, args: argparse.Namespace, prefix: str = "") -> Any:
    p = prefix.replace("-", "_")
    geometries, prefixes = defaults_for(device)
    return ttft(
        device,
        geometries=getattr(args, f"{p}geometries") or geometries,
        prefixes=getattr(args, f"{p}prefixes") or prefixes,
        dtype=parse_dtype(getattr(args, f"{p}dtype")),
        layers=getattr(args, f"{p}layers"),
        batch_tokens=getattr(args, f"{p}batch_tokens"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "bench" / "results" / "gpu_ttft",
        help="directory for gpu_ttft.json",
    )
    add_arguments(p)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU")
    if args.prefixes is not None and any(n < 1 for n in args.prefixes):
        raise SystemExit("--prefixes must be positive token counts")
    result = ttft_from_args(device, args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_ttft.json"
    write_json(
        path,
        {
            "machine": machine_info(),
            "git": git_state(REPO),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "ttft": result,
        },
    )
    say(f"results: {path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
