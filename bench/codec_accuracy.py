"""What the int8 and fp8 block codecs cost in accuracy, on the real model.

Five varied prompts (a README passage, Python source, a Markdown table of
numbers, a design document, a list of arithmetic word problems), each in
SmolLM2's chat format and cut to an exact length between 220 and 500
tokens, run through SmolLM2-135M-Instruct (float32) with kvtier's KV cache.
For every codec (raw, int8, fp8) the prompt's K/V blocks take kvtier's real
offload path: a host tier with that codec stores them as they are computed
(``write_mode="write_through"``: encode, checksum), the device cache is
emptied, and the next request loads them back from the tier (verify,
decode). Raw is lossless, so it is the reference.

(a) Logits. Every block of the prompt but those covering its last 64-79
tokens is stored and loaded back through the codec; those last tokens are
then computed on top of the loaded blocks, and the next-token logits at each
of their positions are compared with the raw codec's: max and mean absolute
difference (over positions and the vocabulary), mean KL divergence of the
softmax from raw's, and top-1 agreement (positions whose argmax matches).
A sanity row compares raw with a full forward pass of the whole prompt
without any cache.

(b) Greedy output. The engine (one host tier with the codec, write-through)
computes the prompt once, its device cache is emptied, then it generates 32
tokens greedily with the prompt's blocks loaded from the tier (every full
block before the last prompt token). The tokens are compared with raw's:
how many of the 32 match position by position, how many lead before the
first difference (after it the texts drift apart, so later positions say
little), and whether the whole output matches. Raw is also compared with an
engine that recomputes the prompt (no tier), which shows the effect of
loading instead of recomputing at all.

Run ``python bench/codec_accuracy.py --help``. Results go to
``bench/results/codec_accuracy.json``.
"""

from __future__ import annotations

import argparse
import re
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
    machine_info,
    package_version,
    write_json,
)

from kvtier.engine import Engine, SamplingParams
from kvtier.engine.hf_cache import KvTierCache
from kvtier.engine.model import load_model
from kvtier.keys import Namespace
from kvtier.manager import KVCacheManager
from kvtier.offload.chain import Tier, TierChain
from kvtier.offload.host import HostStore
from kvtier.storage import KVBlockStorage

BLOCK_SIZE = 16
CODECS = ("raw", "int8", "fp8")
#: Tokens at the end of each prompt whose logits part (a) compares (at least).
TAIL_TOKENS = 64
GENERATE_TOKENS = 32


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _word_problems() -> str:
    names = ["Ada", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "June"]
    things = ["apples", "bolts", "cables", "lamps", "maps", "notebooks", "pencils", "tiles"]
    lines = []
    for i in range(24):
        a, b, c = 3 + (7 * i) % 19, 2 + (5 * i) % 11, 1 + (3 * i) % 7
        lines.append(
            f"{i + 1}. {names[i % len(names)]} buys {a} boxes of {things[i % len(things)]} "
            f"with {b} in each box and gives away {c}. How many are left?"
        )
    return "Solve each problem and give only the number.\n" + "\n".join(lines)


def _source_excerpt() -> str:
    text = (REPO / "src" / "kvtier" / "layout.py").read_text(encoding="utf-8")
    return "Explain what this Python module does:\n\n" + text


def _table_excerpt() -> str:
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return "Which row of this table has the largest ratio, and why?\n\n" + "\n".join(rows)


def _doc_excerpt(name: str, question: str) -> str:
    text = (REPO / name).read_text(encoding="utf-8")
    text = re.sub(r"\n{3,}", "\n\n", text)
    return question + "\n\n" + text


#: (name, builder, total prompt tokens)
PROMPTS: list[tuple[str, Any, int]] = [
    ("README passage", lambda: _doc_excerpt("README.md", "Summarize this README:"), 220),
    ("Python source", _source_excerpt, 300),
    ("Markdown table", _table_excerpt, 380),
    (
        "design document",
        lambda: _doc_excerpt("docs/architecture.md", "What are the main components?"),
        450,
    ),
    ("word problems", _word_problems, 500),
]


def build_prompt(tokenizer: Any, body: str, total: int) -> list[int]:
    """``body`` as a chat user turn, its text cut so the whole prompt is ``total`` tokens."""
    head = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids = tokenizer.encode(body, add_special_tokens=False)
    n = total - len(head) - len(tail)
    if len(ids) < n:
        raise SystemExit(f"prompt text is only {len(ids)} tokens; {n} needed")
    return list(head) + list(ids[:n]) + list(tail)


class Rig:
    """A device storage and manager with one host tier of ``codec`` (write-through)."""

    def __init__(self, model: Any, model_id: str, codec: str, num_blocks: int) -> None:
        from kvtier.engine.hf_cache import layout_for_model

        layout = layout_for_model(model.config, BLOCK_SIZE, next(model.parameters()).dtype)
        self.storage = KVBlockStorage(layout, num_blocks)
        self.manager = KVCacheManager(
            num_blocks, BLOCK_SIZE, namespace=Namespace(model_id, layout)
        )
        self.tier = Tier(HostStore(), num_blocks, codec=codec)
        self.chain = TierChain(
            self.storage, self.manager, [self.tier], write_mode="write_through"
        )
        self.n = 0

    def cache(self, ids: list[int]) -> KvTierCache:
        self.n += 1
        return KvTierCache(self.storage, self.manager, f"r{self.n}", ids, tiers=self.chain)

    def close(self) -> None:
        self.chain.close()


def forward(model: Any, cache: KvTierCache, ids: list[int]) -> torch.Tensor:
    """Compute ``ids`` (the tokens past the cache's prefix); logits at every position."""
    cache.feed(ids)
    out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return out.logits[0].float()


def logits_through(model: Any, rig: Rig, ids: list[int]) -> tuple[torch.Tensor, int, int]:
    """Part (a) for one prompt: logits of its tail computed over prefix blocks from the tier."""
    prefix = (len(ids) - TAIL_TOKENS) // BLOCK_SIZE * BLOCK_SIZE
    # Compute the prefix once: write-through stores its blocks on the tier.
    with rig.cache(ids[:prefix]) as c:
        forward(model, c, ids[:prefix])
    rig.manager.reset_prefix_cache()
    with rig.cache(ids) as c:
        loaded = c.num_loaded_tokens
        if loaded != prefix or c.num_cached_tokens != prefix:
            raise SystemExit(
                f"expected the {prefix}-token prefix to load from the tier, got "
                f"{loaded} loaded of {c.num_cached_tokens} cached"
            )
        logits = forward(model, c, ids[prefix:])
    rig.manager.reset_prefix_cache()
    return logits, prefix, loaded


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    diff = (got - ref).abs()
    logp_ref = torch.log_softmax(ref.double(), dim=-1)
    logp = torch.log_softmax(got.double(), dim=-1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    return {
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "mean_kl": float(kl.mean()),
        "top1_agree": int((ref.argmax(-1) == got.argmax(-1)).sum()),
        "positions": int(ref.shape[0]),
    }


def generate_through(
    engine: Engine, ids: list[int], *, from_tier: bool
) -> tuple[list[int], int]:
    """Part (b) for one prompt: 32 greedy tokens, the prompt's blocks loaded from the tier."""
    greedy = SamplingParams(max_tokens=GENERATE_TOKENS, temperature=0, ignore_eos=True)
    if from_tier:
        list(engine.generate(ids, SamplingParams(max_tokens=1, temperature=0)))
        assert engine.tiers is not None
        engine.tiers.flush()
        engine.manager.reset_prefix_cache()
    before = engine.counters.loaded_prompt_tokens
    tokens: list[int] = []
    for out in engine.generate(ids, greedy):
        tokens.extend(out.token_ids)
    loaded = engine.counters.loaded_prompt_tokens - before
    engine.manager.reset_prefix_cache()
    want = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE if from_tier else 0
    if loaded != want or len(tokens) != GENERATE_TOKENS:
        raise SystemExit(
            f"expected {want} prompt tokens loaded and {GENERATE_TOKENS} generated, got "
            f"{loaded} and {len(tokens)}"
        )
    return tokens, loaded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts (5)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: nothing here is timed, and one thread is steady "
        "on a shared machine; 0 keeps torch's default)",
    )
    ap.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    ap.add_argument(
        "--json", type=Path, default=REPO / "bench" / "results" / "codec_accuracy.json"
    )
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be between 1 and {len(PROMPTS)}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    log("loading the model ...")
    loaded = load_model(None, dtype="float32")
    model, tok = loaded.model, loaded.tokenizer
    prompts = [
        (name, build_prompt(tok, build(), total)) for name, build, total in PROMPTS[: args.prompts]
    ]
    num_blocks = max(len(ids) for _, ids in prompts) // BLOCK_SIZE * 2 + 16

    per_prompt: list[dict[str, Any]] = []
    logits: dict[str, list[torch.Tensor]] = {c: [] for c in CODECS}
    full: list[torch.Tensor] = []
    outputs: dict[str, list[list[int]]] = {c: [] for c in (*CODECS, "recompute")}
    with torch.no_grad():
        log("(a) logits over prefix blocks loaded through each codec ...")
        rigs = {c: Rig(model, loaded.model_id, c, num_blocks) for c in CODECS}
        try:
            for name, ids in prompts:
                entry: dict[str, Any] = {"prompt": name, "tokens": len(ids)}
                for codec in CODECS:
                    lg, prefix, n_loaded = logits_through(model, rigs[codec], ids)
                    logits[codec].append(lg)
                    entry["prefix_tokens_loaded"] = n_loaded
                ref = model(input_ids=torch.tensor([ids])).logits[0].float()
                full.append(ref[prefix:])
                entry["compared_positions"] = len(ids) - prefix
                per_prompt.append(entry)
                log(f"  {name}: {len(ids)} tokens, {prefix} loaded")
        finally:
            for rig in rigs.values():
                rig.close()

        log("(b) 32 greedy tokens with the prompt's blocks loaded through each codec ...")
        engines = {
            c: Engine(
                model,
                tok,
                model_id=loaded.model_id,
                block_size=BLOCK_SIZE,
                num_blocks=num_blocks,
                tiers=[Tier(HostStore(), num_blocks, codec=c)],
                write_mode="write_through",
            )
            for c in CODECS
        }
        plain = Engine(
            model, tok, model_id=loaded.model_id, block_size=BLOCK_SIZE, num_blocks=num_blocks
        )
        try:
            for (name, ids), entry in zip(prompts, per_prompt, strict=True):
                for codec in CODECS:
                    out, n_loaded = generate_through(engines[codec], ids, from_tier=True)
                    outputs[codec].append(out)
                    entry["generate_prompt_tokens_loaded"] = n_loaded
                outputs["recompute"].append(generate_through(plain, ids, from_tier=False)[0])
                log(f"  {name}: done")
        finally:
            for e in engines.values():
                if e.tiers is not None:
                    e.tiers.close()

    # (a) tables
    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(xs, dim=0)

    ref_all = cat(logits["raw"])
    summary_a: dict[str, dict[str, float]] = {}
    rows_a = []
    for label, ref, got in [
        ("raw vs full forward (sanity)", cat(full), ref_all),
        ("int8 vs raw", ref_all, cat(logits["int8"])),
        ("fp8 vs raw", ref_all, cat(logits["fp8"])),
    ]:
        s = compare(ref, got)
        summary_a[label] = s
        rows_a.append(
            [
                label,
                f"{s['max_abs_diff']:.4f}",
                f"{s['mean_abs_diff']:.5f}",
                f"{s['mean_kl']:.2e}",
                f"{s['top1_agree']}/{s['positions']}",
                f"{s['top1_agree'] / s['positions'] * 100:.1f}%",
            ]
        )
    for i, entry in enumerate(per_prompt):
        entry["logits"] = {
            c: compare(logits["raw"][i], logits[c][i]) for c in ("int8", "fp8")
        }
        # How close raw's first choice was to its second at the last prompt position.
        top2 = logits["raw"][i][-1].topk(2).values
        entry["raw_last_position_top2_margin"] = float(top2[0] - top2[1])
    scale = float(ref_all.abs().mean())
    headers_a = [
        "comparison",
        "max abs logit diff",
        "mean abs logit diff",
        "mean KL",
        "top-1 agree",
        "top-1 %",
    ]
    print(
        f"\n(a) next-token logits at {ref_all.shape[0]} positions of {len(prompts)} prompts "
        f"({loaded.model_id}, float32), prefix blocks through each codec; "
        f"mean |logit| {scale:.2f}"
    )
    print(format_table(headers_a, rows_a))

    # (b) tables
    rows_b = []
    summary_b: dict[str, dict[str, Any]] = {}
    comparisons = [
        ("raw vs recompute (sanity)", "recompute", "raw"),
        ("int8 vs raw", "raw", "int8"),
        ("fp8 vs raw", "raw", "fp8"),
    ]
    for label, ref_name, got_name in comparisons:
        matched = []
        leading = []
        whole = 0
        for ref_tokens, got_tokens in zip(outputs[ref_name], outputs[got_name], strict=True):
            same = [a == b for a, b in zip(ref_tokens, got_tokens, strict=True)]
            matched.append(sum(same))
            leading.append(same.index(False) if False in same else len(same))
            whole += all(same)
        summary_b[label] = {
            "matched_per_prompt": matched,
            "leading_equal_per_prompt": leading,
            "whole_outputs_equal": whole,
        }
        rows_b.append(
            [
                label,
                " ".join(str(m) for m in matched),
                " ".join(str(m) for m in leading),
                f"{sum(matched)}/{GENERATE_TOKENS * len(matched)}",
                f"{whole}/{len(matched)}",
            ]
        )
    for i, entry in enumerate(per_prompt):
        entry["outputs"] = {k: outputs[k][i] for k in outputs}
        entry["text"] = {k: tok.decode(outputs[k][i]) for k in outputs}
    headers_b = [
        "comparison",
        "same position, per prompt (of 32)",
        "equal before first difference",
        "total same position",
        "whole output equal",
    ]
    print(f"\n(b) {GENERATE_TOKENS} greedy tokens, prompt blocks loaded through each codec")
    print(format_table(headers_b, rows_b))
    if args.markdown:
        print()
        print(format_markdown_table(headers_a, rows_a))
        print()
        print(format_markdown_table(headers_b, rows_b))

    write_json(
        args.json,
        {
            "benchmark": "codec_accuracy",
            "model": loaded.model_id,
            "dtype": "float32",
            "block_size": BLOCK_SIZE,
            "generate_tokens": GENERATE_TOKENS,
            "torch_threads": torch.get_num_threads(),
            "mean_abs_logit": scale,
            "logits": summary_a,
            "greedy": summary_b,
            "prompts": per_prompt,
            "machine": machine_info(),
            "git": git_state(REPO),
            "versions": {p: package_version(p) for p in ("torch", "transformers", "kvtier")},
        },
    )
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
