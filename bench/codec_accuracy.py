"""What storing KV blocks in fewer bytes costs in accuracy, on the real model.

Five varied prompts (a README passage, Python source, a Markdown table of
numbers, a design document, a list of arithmetic word problems), each in
SmolLM2's chat format and cut to an exact length between 220 and 500
tokens, run through SmolLM2-135M-Instruct (float32) with kvtier's KV cache.
The prompts are built from the repository's texts once and kept as token
ids in ``bench/data/accuracy_prompts.json``, so the set stays fixed while
those texts change.
Every *setting* is one way the blocks are kept; the reference is the
float32 device pool (``--kv-cache-dtype auto``):

* ``device <dtype>``: the device pool itself stores the blocks as
  ``--kv-cache-dtype`` (bfloat16, float16, int8 or fp8_e4m3 with per-head
  scales): K/V are rounded or quantized as they are written, prompt and
  generated tokens alike, and dequantized whenever attention reads them;
* ``device tier <codec>``: a float32 pool with a compressed device tier
  (``--tier device:SIZE?codec=...``): the prompt is computed, its blocks
  are moved into the tier with ``compress`` (encoded, freed in the pool),
  and the next request's prefix hit decodes them back;
* ``host tier <codec>``: a float32 pool with a host tier of that codec,
  written through; the device cache is emptied and the next request loads
  the blocks back (verify, decode).

(a) Logits. Every block of the prompt but those covering its last 64-79
tokens is computed first and kept the setting's way; those last tokens are
then computed on top of the cached blocks, and the next-token logits at each
of their positions are compared with the reference's: max and mean absolute
difference (over positions and the vocabulary), mean KL divergence of the
softmax from the reference's, and top-1 agreement (positions whose argmax
matches). A sanity row compares the reference with one forward pass of the
whole prompt without any cache.

(b) Greedy output. The engine generates 32 tokens greedily for each prompt:
with the pool in the setting's dtype (the whole request, prefill and
decode), or with the prompt's blocks (every full block before the last
prompt token) coming back from the tier. The tokens are compared with the
reference's: how many of the 32 match position by position, how many lead
before the first difference (after it the texts drift apart, so later
positions say little), and whether the whole output matches. The reference
is also compared with an engine that recomputes the prompt (no cache hit).

Run ``python bench/codec_accuracy.py --help``. Results go to
``bench/results/codec_accuracy.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
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
from kvtier.engine.hf_cache import KvTierCache, layout_for_model
from kvtier.engine.model import load_model
from kvtier.keys import Namespace
from kvtier.layout import cache_layout
from kvtier.manager import KVCacheManager
from kvtier.offload.chain import Tier, TierChain
from kvtier.offload.config import TierSpec
from kvtier.offload.device_tier import DeviceStore
from kvtier.offload.host import HostStore
from kvtier.storage import make_storage

BLOCK_SIZE = 16
#: Tokens at the end of each prompt whose logits part (a) compares (at least).
TAIL_TOKENS = 64
GENERATE_TOKENS = 32


@dataclass(frozen=True)
class Setting:
    """One way of keeping the blocks: ``kind`` device, device-tier or host-tier."""

    kind: str
    #: The pool's kv_cache_dtype (device), or the tier's codec.
    value: str

    @property
    def label(self) -> str:
        if self.kind == "device":
            return "device float32 (reference)" if self.value == "auto" else f"device {self.value}"
        return f"{self.kind.replace('-', ' ')} {self.value}"


REFERENCE = Setting("device", "auto")
SETTINGS = [
    REFERENCE,
    Setting("device", "bfloat16"),
    Setting("device", "float16"),
    Setting("device", "int8"),
    Setting("device", "fp8_e4m3"),
    Setting("device-tier", "int8"),
    Setting("device-tier", "fp8"),
    Setting("host-tier", "int8"),
    Setting("host-tier", "fp8"),
]


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


#: The prompt set as token ids, frozen so later edits of the texts (README, docs) do not
#: change it; ``--rebuild-prompts`` writes it again from the builders above.
PROMPT_FILE = Path(__file__).resolve().parent / "data" / "accuracy_prompts.json"


def load_prompts(tokenizer: Any, model_id: str, rebuild: bool) -> list[tuple[str, list[int]]]:
    """The fixed prompt set: from :data:`PROMPT_FILE`, or built from the texts and saved."""
    if PROMPT_FILE.exists() and not rebuild:
        data = json.loads(PROMPT_FILE.read_text(encoding="utf-8"))
        if data["model"] != model_id:
            raise SystemExit(f"{PROMPT_FILE} holds {data['model']} token ids, not {model_id}'s")
        return [(p["name"], list(p["tokens"])) for p in data["prompts"]]
    prompts = [(name, build_prompt(tokenizer, build(), total)) for name, build, total in PROMPTS]
    PROMPT_FILE.parent.mkdir(parents=True, exist_ok=True)
    PROMPT_FILE.write_text(
        json.dumps(
            {
                "model": model_id,
                "prompts": [{"name": n, "tokens": ids} for n, ids in prompts],
            },
            separators=(",", ":"),
        )
        + "\n",
        encoding="utf-8",
    )
    log(f"wrote {PROMPT_FILE}")
    return prompts


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
    """A device pool (and tier) kept one setting's way, for part (a)."""

    def __init__(self, model: Any, model_id: str, setting: Setting, num_blocks: int) -> None:
        dtype = next(model.parameters()).dtype
        model_layout = layout_for_model(model.config, BLOCK_SIZE, dtype)
        pool_dtype = setting.value if setting.kind == "device" else "auto"
        layout = cache_layout(model_layout, pool_dtype)
        self.setting = setting
        self.storage = make_storage(layout, num_blocks, compute_dtype=dtype)
        self.manager = KVCacheManager(
            num_blocks, BLOCK_SIZE, namespace=Namespace(model_id, layout)
        )
        self.chain: TierChain | None = None
        if setting.kind == "host-tier":
            tier = Tier(HostStore(), num_blocks, codec=setting.value)
            self.chain = TierChain(self.storage, self.manager, [tier], write_mode="write_through")
        elif setting.kind == "device-tier":
            tier = Tier(DeviceStore(), num_blocks, codec=setting.value)
            self.chain = TierChain(self.storage, self.manager, [tier])
        self.n = 0

    def cache(self, ids: list[int]) -> KvTierCache:
        self.n += 1
        return KvTierCache(self.storage, self.manager, f"r{self.n}", ids, tiers=self.chain)

    def keep(self, ids: list[int]) -> None:
        """Move the cached blocks of ``ids`` to where the setting keeps them."""
        if self.setting.kind == "host-tier":
            self.manager.reset_prefix_cache()  # the tier has them (write-through)
        elif self.setting.kind == "device-tier":
            assert self.chain is not None
            moved = self.chain.compress(self.manager.hasher.chain(ids))
            if moved.blocks != len(ids) // BLOCK_SIZE:
                raise SystemExit(f"compress moved {moved.blocks} blocks of {len(ids)} tokens")

    def close(self) -> None:
        if self.chain is not None:
            self.chain.close()


def forward(model: Any, cache: KvTierCache, ids: list[int]) -> torch.Tensor:
    """Compute ``ids`` (the tokens past the cache's prefix); logits at every position."""
    cache.feed(ids)
    out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return out.logits[0].float()


def logits_through(model: Any, rig: Rig, ids: list[int]) -> tuple[torch.Tensor, int]:
    """Part (a) for one prompt: logits of its tail computed over the kept prefix blocks."""
    prefix = (len(ids) - TAIL_TOKENS) // BLOCK_SIZE * BLOCK_SIZE
    with rig.cache(ids[:prefix]) as c:
        forward(model, c, ids[:prefix])
    rig.keep(ids[:prefix])
    with rig.cache(ids) as c:
        from_tier = rig.setting.kind != "device"
        if c.num_cached_tokens != prefix or c.num_loaded_tokens != (prefix if from_tier else 0):
            raise SystemExit(
                f"{rig.setting.label}: expected the {prefix}-token prefix cached, got "
                f"{c.num_cached_tokens} cached, {c.num_loaded_tokens} loaded"
            )
        logits = forward(model, c, ids[prefix:])
    rig.manager.reset_prefix_cache()
    return logits, prefix


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


def make_engine(model: Any, tok: Any, model_id: str, setting: Setting, num_blocks: int) -> Engine:
    kwargs: dict[str, Any] = {}
    if setting.kind == "device":
        kwargs["kv_cache_dtype"] = setting.value
    elif setting.kind == "host-tier":
        kwargs["tiers"] = [Tier(HostStore(), num_blocks, codec=setting.value)]
        kwargs["write_mode"] = "write_through"
    elif setting.kind == "device-tier":
        size = num_blocks * 2**20  # far more than the prompts' blocks
        kwargs["tiers"] = [TierSpec("device", size, codec=setting.value)]
    return Engine(
        model, tok, model_id=model_id, block_size=BLOCK_SIZE, num_blocks=num_blocks, **kwargs
    )


def generate_with(engine: Engine, setting: Setting | None, ids: list[int]) -> list[int]:
    """Part (b) for one prompt: 32 greedy tokens (``None``: recompute the prompt)."""
    greedy = SamplingParams(max_tokens=GENERATE_TOKENS, temperature=0, ignore_eos=True)
    from_tier = setting is not None and setting.kind != "device"
    if from_tier:
        rid = f"prime-{time.perf_counter_ns()}"
        for _ in engine.generate(ids, SamplingParams(max_tokens=1, temperature=0), rid):
            pass
        assert engine.tier_chain is not None
        if setting.kind == "device-tier":
            if not engine.compress_request(rid).blocks:
                raise SystemExit("compress_request moved no block")
        else:
            engine.tier_chain.flush()
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
    return tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts (5)")
    ap.add_argument(
        "--settings",
        nargs="+",
        metavar="KIND:VALUE",
        help="settings to compare with the reference, e.g. device:int8 device-tier:fp8 "
        "host-tier:int8 (default: all)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: nothing here is timed, and one thread is steady "
        "on a shared machine; 0 keeps torch's default)",
    )
    ap.add_argument("--markdown", action="store_true", help="also print Markdown tables")
    ap.add_argument(
        "--rebuild-prompts",
        action="store_true",
        help=f"build the prompt set from the repository's texts again and save it to "
        f"{PROMPT_FILE.relative_to(REPO)} (it is otherwise fixed)",
    )
    ap.add_argument(
        "--json", type=Path, default=REPO / "bench" / "results" / "codec_accuracy.json"
    )
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be between 1 and {len(PROMPTS)}")
    settings = SETTINGS
    if args.settings:
        chosen = [Setting(*text.split(":", 1)) for text in args.settings if ":" in text]
        unknown = [c for c in chosen if c not in SETTINGS]
        if unknown or len(chosen) != len(args.settings):
            ap.error(f"--settings take {' '.join(f'{s.kind}:{s.value}' for s in SETTINGS)}")
        settings = [REFERENCE, *(c for c in chosen if c != REFERENCE)]
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    log("loading the model ...")
    loaded = load_model(None, dtype="float32")
    model, tok = loaded.model, loaded.tokenizer
    prompts = load_prompts(tok, loaded.model_id, args.rebuild_prompts)[: args.prompts]
    num_blocks = max(len(ids) for _, ids in prompts) // BLOCK_SIZE * 2 + 16

    per_prompt: list[dict[str, Any]] = []
    logits: dict[Setting, list[torch.Tensor]] = {s: [] for s in settings}
    full: list[torch.Tensor] = []
    outputs: dict[Setting | None, list[list[int]]] = {s: [] for s in (*settings, None)}
    with torch.no_grad():
        log("(a) logits over prefix blocks kept each way ...")
        for name, ids in prompts:
            entry: dict[str, Any] = {"prompt": name, "tokens": len(ids)}
            for setting in settings:
                rig = Rig(model, loaded.model_id, setting, num_blocks)
                try:
                    lg, prefix = logits_through(model, rig, ids)
                finally:
                    rig.close()
                logits[setting].append(lg)
            ref = model(input_ids=torch.tensor([ids])).logits[0].float()
            full.append(ref[prefix:])
            entry["prefix_tokens"] = prefix
            entry["compared_positions"] = len(ids) - prefix
            per_prompt.append(entry)
            log(f"  {name}: {len(ids)} tokens, {prefix} kept")

        log(f"(b) {GENERATE_TOKENS} greedy tokens ...")
        engines = {
            s: make_engine(model, tok, loaded.model_id, s, num_blocks) for s in settings
        }
        plain = Engine(
            model, tok, model_id=loaded.model_id, block_size=BLOCK_SIZE, num_blocks=num_blocks
        )
        try:
            for name, ids in prompts:
                for setting, engine in engines.items():
                    outputs[setting].append(generate_with(engine, setting, ids))
                outputs[None].append(generate_with(plain, None, ids))
                log(f"  {name}: done")
        finally:
            for e in engines.values():
                e.close()

    # (a) tables
    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(xs, dim=0)

    ref_all = cat(logits[REFERENCE])
    summary_a: dict[str, dict[str, float]] = {}
    rows_a = []
    pairs = [("reference vs full forward (sanity)", cat(full), ref_all)]
    pairs += [(s.label, ref_all, cat(logits[s])) for s in settings if s != REFERENCE]
    for label, ref, got in pairs:
        st = compare(ref, got)
        summary_a[label] = st
        rows_a.append(
            [
                label,
                f"{st['max_abs_diff']:.4f}",
                f"{st['mean_abs_diff']:.5f}",
                f"{st['mean_kl']:.2e}",
                f"{st['top1_agree']}/{st['positions']}",
                f"{st['top1_agree'] / st['positions'] * 100:.1f}%",
            ]
        )
    for i, entry in enumerate(per_prompt):
        entry["logits"] = {
            s.label: compare(logits[REFERENCE][i], logits[s][i]) for s in settings if s != REFERENCE
        }
        # How close the reference's first choice was to its second at the last prompt position.
        top2 = logits[REFERENCE][i][-1].topk(2).values
        entry["reference_last_position_top2_margin"] = float(top2[0] - top2[1])
    scale = float(ref_all.abs().mean())
    headers_a = [
        "setting vs float32 device",
        "max abs logit diff",
        "mean abs logit diff",
        "mean KL",
        "top-1 agree",
        "top-1 %",
    ]
    print(
        f"\n(a) next-token logits at {ref_all.shape[0]} positions of {len(prompts)} prompts "
        f"({loaded.model_id}, float32), over prefix blocks kept each way; "
        f"mean |logit| {scale:.2f}"
    )
    print(format_table(headers_a, rows_a))

    # (b) tables
    rows_b = []
    summary_b: dict[str, dict[str, Any]] = {}
    comparisons: list[tuple[str, Setting | None, Setting | None]] = [
        ("reference vs recompute (sanity)", None, REFERENCE)
    ]
    comparisons += [(s.label, REFERENCE, s) for s in settings if s != REFERENCE]
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
        entry["outputs"] = {
            ("recompute" if k is None else k.label): v[i] for k, v in outputs.items()
        }
        entry["text"] = {name: tok.decode(t) for name, t in entry["outputs"].items()}
    headers_b = [
        "setting vs float32 device",
        f"same position, per prompt (of {GENERATE_TOKENS})",
        "equal before first difference",
        "total same position",
        "whole output equal",
    ]
    print(f"\n(b) {GENERATE_TOKENS} greedy tokens, blocks kept each way")
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
            "settings": [s.label for s in settings],
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
