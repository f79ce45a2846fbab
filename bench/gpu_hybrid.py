"""Linear-attention / Mamba hybrids on a device: exact tokens, and what a prefix hit saves.

Two parts, each on ``--device`` (a GPU when there is one; ``cpu`` works):

``correctness``
    For each hybrid family kvtier serves (tiny random-weight Qwen3-Next,
    Qwen3.5 dense and MoE, and Bamba, float32, built from the configs
    ``tests/test_state_layers.py`` uses), greedy tokens through the engine
    against transformers' own ``generate`` on the same device: requests one
    at a time, a batch with chunked prompts sharing a prefix, the same
    prompts again (prefix hits), and prefixes loaded back from a host tier;
    and every block's checkpoint against the state transformers' own cache
    holds at the block's end.
``speed``
    A model of Qwen3-Next's widths (hidden 2048, gated delta-net layers of
    16 key heads / 32 value heads of 128, attention of 2 KV heads of 256,
    three linear layers to one attention layer; fewer layers and experts
    than the real one, random bfloat16 weights) at the block size
    ``kvtier serve`` picks for it: new tokens/s for a batch of sequences,
    and the time to first token of a long prompt cold against the same
    prompt's prefix cached.

transformers' reference PyTorch scans run the linear layers (the fused
kernels of ``flash-linear-attention`` / ``mamba_ssm`` are not used), so the
speed figures are for orientation. Writes ``gpu_hybrid.json`` to ``--out``.

    python bench/gpu_hybrid.py --device cuda --out bench/results/gpu_hybrid
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from _common import REPO, machine_info, write_json

sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

import torch
import transformers


def say(text: str) -> None:
    print(text, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def correctness(device: torch.device, new_tokens: int) -> dict[str, Any]:
    from test_state_layers import FAMILIES, checkpoints_and_states
    from tiny_model import greedy_ignoring_eos, run_all, seeded_prompt, tiny_tokenizer

    from kvtier.engine import Engine
    from kvtier.offload.host import HostStore
    from kvtier.offload.tier import Tier

    tok = tiny_tokenizer()
    report: dict[str, Any] = {}
    for name, (model_class, config) in sorted(FAMILIES.items()):
        torch.manual_seed(0)
        model = model_class(config(tok)).eval().to(device)
        model.generation_config.eos_token_id = None

        def hf(prompt: list[int], model: Any = model) -> list[int]:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt], device=device),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                )
            return list(out[0, len(prompt) :].tolist())

        shared = seeded_prompt(5, 13)
        prompts = [seeded_prompt(6, 3), shared + seeded_prompt(7, 20), seeded_prompt(8, 31)]
        prompts += [shared + seeded_prompt(9, 6)]
        want = [hf(p) for p in prompts]
        cases: dict[str, bool] = {}
        eng = Engine(model, tok, model_id=name, block_size=4, num_blocks=64)
        cases["one at a time"] = [run_all(eng, [p], new_tokens)[0] for p in prompts] == want
        chunked = Engine(
            model, tok, model_id=name, block_size=4, num_blocks=64, max_num_batched_tokens=7
        )
        cases["batched, chunked"] = run_all(chunked, prompts, new_tokens) == want
        cached_before = chunked.counters.cached_prompt_tokens
        cases["again, from cached prefixes"] = run_all(chunked, prompts, new_tokens) == want
        hits = chunked.counters.cached_prompt_tokens - cached_before
        tiered = Engine(
            model,
            tok,
            model_id=name,
            block_size=4,
            num_blocks=16,
            tiers=[Tier(HostStore(), 64)],
        )
        long = [seeded_prompt(20 + i, 29) for i in range(4)]
        long_want = [hf(p) for p in long]
        ok = True
        for _round in range(2):
            for p, w in zip(long, long_want, strict=True):
                outs = list(tiered.generate(p, greedy_ignoring_eos(new_tokens)))
                ok &= [t for o in outs for t in o.token_ids] == w
        cases["host tier round trip"] = ok
        # Tokens alone can miss a wrong state (a tiny random Mamba barely uses it): compare
        # every block's checkpoint with the state transformers' own cache holds there.
        worst = 0.0
        for conv, want_conv, rec, want_rec in checkpoints_and_states(model, str(device)):
            for got, want in ((conv, want_conv), (rec, want_rec)):
                scale = float(want.abs().max()) or 1.0
                worst = max(worst, float((got - want).abs().max()) / scale)
        cases["checkpoints equal transformers' states"] = worst < 1e-3
        loaded = tiered.counters.loaded_prompt_tokens
        report[name] = {
            "cases": cases,
            "checkpoint_max_relative_error": worst,
            "cached_prompt_tokens_second_pass": hits,
            "loaded_prompt_tokens_from_host": loaded,
            "ok": all(cases.values()) and hits > 0 and loaded > 0,
        }
        say(
            f"{name}: {cases} prefix-hit tokens {hits}, loaded from host {loaded}, "
            f"checkpoint error {worst:.1e}"
        )
        tiered.close()
    report["ok"] = all(v["ok"] for v in report.values() if isinstance(v, dict))
    return report


def speed(device: torch.device, layers: int, seqs: int, prompt: int, new: int) -> dict[str, Any]:
    from tiny_model import greedy_ignoring_eos, run_all, seeded_prompt, tiny_tokenizer

    from kvtier.engine import Engine
    from kvtier.layers.geometry import geometry
    from kvtier.layers.state_spec import state_block_size, state_spec

    tok = tiny_tokenizer()
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    config = transformers.Qwen3NextConfig(
        vocab_size=len(tok),
        num_hidden_layers=layers,
        layer_types=types,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
    )
    get = lambda name: getattr(config, name, None)  # noqa: E731
    spec = state_spec(get)
    assert spec is not None
    _, _, kv_heads, head_dim = geometry(get)
    bs = state_block_size(spec, head_dim, kv_heads, 2)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval().to(device, torch.bfloat16)
    blocks = seqs * ((prompt + new) // bs + 2) + 16
    eng = Engine(
        model,
        tok,
        model_id="qwen3-next-shape",
        block_size=bs,
        num_blocks=blocks,
        max_num_seqs=seqs,
        max_num_batched_tokens=4096,
    )
    say(
        f"speed: {layers} layers ({types.count('linear_attention')} linear), block size {bs}, "
        f"{blocks} blocks of {eng.layout.bytes_per_block / 2**20:.1f} MiB"
    )
    prompts = [seeded_prompt(100 + i, prompt) for i in range(seqs)]
    run_all(eng, prompts[:1], 2)  # warm-up
    sync(device)
    started = time.perf_counter()
    run_all(eng, prompts, new)
    sync(device)
    batch_s = time.perf_counter() - started
    # A long prompt cold, then another that shares all but its last tokens.
    shared = seeded_prompt(300, 4 * bs)
    timings = {}
    tails = {"cold": seeded_prompt(301, 5), "warm": seeded_prompt(302, 5)}
    for label, tail in tails.items():
        p = shared + tail
        sync(device)
        t0 = time.perf_counter()
        first = next(iter(eng.generate(p, greedy_ignoring_eos(1))))
        sync(device)
        timings[label] = {
            "ttft_s": round(time.perf_counter() - t0, 4),
            "cached_tokens": first.metrics.cached_tokens,
            "prompt_tokens": len(p),
        }
    result = {
        "layers": layers,
        "linear_layers": types.count("linear_attention"),
        "block_size": bs,
        "bytes_per_block": eng.layout.bytes_per_block,
        "state_bytes_per_layer": spec.nbytes(2),
        "sequences": seqs,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "batch_seconds": round(batch_s, 3),
        "new_tokens_per_s": round(seqs * new / batch_s, 1),
        "long_prompt": timings,
        "ttft_speedup_from_prefix": round(
            timings["cold"]["ttft_s"] / max(timings["warm"]["ttft_s"], 1e-9), 1
        ),
        "ok": timings["warm"]["cached_tokens"] >= 4 * bs - bs,
    }
    say(f"speed: {result}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_hybrid")
    p.add_argument("--parts", default="correctness,speed", help="comma-separated parts")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per check request")
    p.add_argument("--layers", type=int, default=8, help="layers of the speed model (default 8)")
    p.add_argument("--seqs", type=int, default=32, help="sequences in the speed batch")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per speed sequence")
    p.add_argument("--new", type=int, default=64, help="new tokens per speed sequence")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA GPU")
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    payload: dict[str, Any] = {
        "machine": machine_info(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if "correctness" in parts:
        payload["correctness"] = correctness(device, args.new_tokens)
    if "speed" in parts:
        payload["speed"] = speed(device, args.layers, args.seqs, args.prompt, args.new)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_hybrid.json"
    write_json(path, payload)
    for name in parts:
        say(f"{name}: {'ok' if payload.get(name, {}).get('ok') else 'NOT OK'}")
    say(f"results: {path}")


if __name__ == "__main__":
    main()
