"""The engine cases a family must pass to be served: every token equal to transformers'.

Each ``check_*`` serves a :class:`~kvtier.conformance.tiny.TinyFamily`
through kvtier's engine in one situation that stresses the cache and raises
:class:`Mismatch` where a token differs from transformers' own greedy
``generate`` (or the engine did not do what the case needs, such as
preempting). :data:`CASES` lists them in the order the sweep runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.conformance.tiny import TinyFamily


class Mismatch(AssertionError):
    """kvtier's engine answered differently from the model itself."""


def expect(ok: bool, what: str) -> None:
    """Raise :class:`Mismatch` with ``what`` unless ``ok``."""
    if not ok:
        raise Mismatch(what)


def seeded_prompt(seed: int, length: int) -> list[int]:
    """``length`` token ids drawn from a seeded generator (stable across runs)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(5, 90, (length,), generator=g).tolist())


def greedy_ignoring_eos(max_tokens: int) -> Any:
    """Greedy sampling of exactly ``max_tokens`` tokens."""
    from kvtier.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_all(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Every prompt added at once and stepped to the end; each one's generated tokens."""
    rids = [engine.add_request(p, greedy_ignoring_eos(n)) for p in prompts]
    got: dict[str, list[int]] = {r: [] for r in rids}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"the engine failed a request: {out.error}")
            got[out.request_id].extend(out.token_ids)
        steps += 1
        expect(steps < 2000, "the engine made no progress")
    return [got[r] for r in rids]


#: Two greedy runs may part where the reference's two best logits are within float
#: rounding of each other (kvtier's batched kernels and transformers' sum in another
#: order, and AVX2 and AVX-512 kernels round differently): relative to the logits' scale.
TIE_TOLERANCE = 1e-4


def _same(family: TinyFamily, prompts: list[list[int]], got: list[list[int]], n: int) -> None:
    """Each prompt's tokens equal the reference's, up to the first near-tie (then stop)."""
    for i, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        want = family.hf_greedy(prompt, n)
        if tokens == want:
            continue
        where = next(
            (j for j, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), None
        )
        detail = f"prompt {i} ({len(prompt)} tokens): {tokens} != {want}"
        expect(where is not None and len(tokens) == len(want), detail)
        assert where is not None
        margin, scale = family.logit_margin(prompt + want[:where], want[where], tokens[where])
        expect(
            margin <= TIE_TOLERANCE * max(1.0, scale),
            f"{detail} (at token {where} the reference prefers {want[where]} by {margin:.3g})",
        )


def check_long_prompts(family: TinyFamily) -> None:
    """Single prompts that cross many blocks (and windows), one at a time and in one batch."""
    prompts = [seeded_prompt(1, 41), seeded_prompt(2, 23)]
    engine = family.engine()
    for prompt in prompts:
        _same(family, [prompt], run_all(engine, [prompt], 10), 10)
    _same(family, prompts, run_all(family.engine(max_num_seqs=2), prompts, 10), 10)


def check_chunked_batches_and_preemption(family: TinyFamily, max_batched_tokens: int = 8) -> None:
    """Chunked prompts sharing a prefix in one batch, then a pool small enough to preempt:
    every request gets the reference's greedy tokens."""
    chunked = family.engine(max_num_seqs=4, max_num_batched_tokens=max_batched_tokens)
    shared = seeded_prompt(5, 13)
    prompts = [
        seeded_prompt(6, 3),
        shared + seeded_prompt(7, 20),
        seeded_prompt(8, 31),
        shared + seeded_prompt(9, 6),
    ]
    _same(family, prompts, run_all(chunked, prompts, 9), 9)
    tight = family.engine(num_blocks=14, max_num_seqs=3)
    prompts = [seeded_prompt(10, 19), seeded_prompt(11, 17), seeded_prompt(12, 21)]
    _same(family, prompts, run_all(tight, prompts, 11), 11)
    expect(tight.counters.preemptions > 0, "the tight pool preempted nothing")
    tight.manager.check()


def check_prefix_hit_and_host_tier(family: TinyFamily) -> None:
    """Prompts evicted to a host tier and loaded back, then one cached prefix continued two
    ways (the same prompt, and another tail after its first 25 tokens): the reference's
    greedy tokens every time, with 24 tokens (six blocks of 4) taken from the cache."""
    from kvtier.offload.host import HostStore
    from kvtier.offload.tier import Tier

    engine = family.engine(num_blocks=16, tiers=[Tier(HostStore(), 64)])
    prompts = [seeded_prompt(20 + i, 29) for i in range(4)]
    for _round in range(2):
        for prompt in prompts:
            _same(family, [prompt], run_all(engine, [prompt], 6), 6)
    expect(engine.counters.loaded_prompt_tokens > 0, "nothing came back from the host tier")
    engine.close()
    again = family.engine()
    prompt = seeded_prompt(30, 27)
    run_all(again, [prompt], 4)
    for tail in (prompt, prompt[:25] + seeded_prompt(31, 5)):
        outs = list(again.generate(tail, greedy_ignoring_eos(4)))
        cached = outs[-1].metrics.cached_tokens
        expect(cached == 24, f"{cached} prompt tokens came from the cache, not 24")
        _same(family, [tail], [[t for o in outs for t in o.token_ids]], 4)


def check_moved_request(family: TinyFamily, steps_before: int = 5) -> None:
    """A request moved to another engine after ``steps_before`` steps (1: mid-prefill, 5:
    mid-decode) keeps the reference's greedy tokens; moved after its prefill, the
    destination computes none of its prompt."""
    from kvtier.engine.migrate import migrate

    prompt = seeded_prompt(33, 17)
    a = family.engine(max_num_batched_tokens=8)
    b = family.engine(num_blocks=40)
    a.add_request(prompt, greedy_ignoring_eos(12), "r")
    got: list[int] = []
    for _ in range(steps_before):
        got.extend(t for out in a.step() for t in out.token_ids)
    computed = b.counters.computed_prompt_tokens
    expect(migrate(a, b, "r", new_id="moved") == "moved", "the request was not moved")
    while b.has_unfinished():
        got.extend(t for out in b.step() for t in out.token_ids)
    _same(family, [prompt], [got], 12)
    if steps_before >= 5:
        expect(b.counters.computed_prompt_tokens == computed, "the destination recomputed")
    b.manager.check()


#: The sweep's cases, by name, in the order it runs them (cheapest first).
CASES: dict[str, Callable[[TinyFamily], None]] = {
    "long prompts": check_long_prompts,
    "chunked batches and preemption": check_chunked_batches_and_preemption,
    "prefix hit and host tier": check_prefix_hit_and_host_tier,
    "moved request": check_moved_request,
}
