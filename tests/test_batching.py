"""Continuous batching: one forward pass for every running request, output as if each ran alone.

The tiny random Llama runs requests that arrive at random steps, share
prefixes, get chunked by a small token budget and preempted by a small
pool; every request's greedy tokens must equal what the same weights give
it alone (one sequence per pass, no cache). Scheduling rules are checked
directly: FCFS, ``max_num_seqs`` and the token budget per step, the newest
request preempted first, a shared prefix computed once, cancels freeing
blocks in the step that sees them, and a request loading its prefix from a
slow tier not holding the others up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiny_model import solo_greedy, tiny_model_and_tokenizer  # noqa: E402

from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.offload.chain import Tier  # noqa: E402
from kvtier.offload.disk import DiskStore  # noqa: E402


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer()


def run_all(engine: Engine, arrivals: Sequence[tuple[int, list[int], int]]) -> dict[str, list[int]]:
    """Add each ``(step, prompt, max_tokens)`` at its step; run until all finish."""
    pending = sorted(arrivals, key=lambda a: a[0])
    got: dict[str, list[int]] = {}
    order: dict[str, int] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens = pending.pop(0)
            rid = engine.add_request(
                prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            )
            order[rid] = len(order)
            got[rid] = []
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
            assert out.finish_reason in (None, "length"), out
        step += 1
        assert step < 5000, "the engine made no progress"
    return got


prompt_st = st.lists(st.integers(5, 90), min_size=1, max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(),
    shared=prompt_st,
    num_blocks=st.integers(24, 80),
    max_num_seqs=st.integers(1, 5),
    budget_extra=st.integers(0, 40),
)
def test_batched_output_equals_solo_output(
    model_tok: tuple[Any, Any],
    data: Any,
    shared: list[int],
    num_blocks: int,
    max_num_seqs: int,
    budget_extra: int,
) -> None:
    model, tok = model_tok
    requests = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, 6),  # arrival step
                st.booleans(),  # shares the common prefix
                prompt_st,
                st.integers(1, 12),  # max_tokens
            ),
            min_size=1,
            max_size=6,
        )
    )
    arrivals = [(step, (shared + own) if share else own, mt) for step, share, own, mt in requests]
    # Every request must fit the pool alone; preemption makes room for the rest.
    assume_fits = all(len(p) + mt <= (num_blocks - 2) * 4 for _, p, mt in arrivals)
    if not assume_fits:
        return
    engine = Engine(
        model,
        tok,
        model_id="tiny",
        block_size=4,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + budget_extra,
    )
    got = run_all(engine, arrivals)
    for (rid, tokens), (_, prompt, mt) in zip(
        got.items(), arrivals_in_order(arrivals), strict=True
    ):
        assert tokens == solo_greedy(model, prompt, mt), rid
    engine.manager.check()
    assert engine.manager.stats().used_blocks == 0


def arrivals_in_order(
    arrivals: list[tuple[int, list[int], int]],
) -> list[tuple[int, list[int], int]]:
    return sorted(arrivals, key=lambda a: a[0])


def _engine(model_tok: tuple[Any, Any], **kw: Any) -> Engine:
    model, tok = model_tok
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 128)
    return Engine(model, tok, model_id="tiny", **kw)


def test_one_pass_per_step_runs_every_request(model_tok: tuple[Any, Any]) -> None:
    engine = _engine(model_tok, max_num_seqs=4)
    calls = {"passes": 0, "tokens": []}

    def count(module: Any, args: Any, kwargs: Any) -> None:
        calls["passes"] += 1
        calls["tokens"].append(kwargs["input_ids"].shape[1])

    handle = engine.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        for i in range(4):
            engine.add_request(
                [10 + i] * 6, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
            )
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
    finally:
        handle.remove()
    assert steps == calls["passes"] == 5  # one prefill step, then four decode steps
    assert calls["tokens"] == [24, 4, 4, 4, 4]  # four prompts, then four decodes a pass


def test_the_token_budget_chunks_prompts_and_decodes_go_first(
    model_tok: tuple[Any, Any],
) -> None:
    engine = _engine(model_tok, max_num_seqs=3, max_num_batched_tokens=8)
    sizes: list[int] = []
    handle = engine.model.register_forward_pre_hook(
        lambda m, a, k: sizes.append(k["input_ids"].shape[1]), with_kwargs=True
    )
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        a = engine.add_request(list(range(5, 10)), p)  # 5 tokens: one step
        first = engine.step()
        b = engine.add_request(list(range(20, 40)), p)  # 20 tokens: chunked
        got: dict[str, list[int]] = {a: [t for o in first for t in o.token_ids], b: []}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id].extend(out.token_ids)
    finally:
        handle.remove()
    assert max(sizes) <= 8
    # a decodes in every step while b's prompt goes in chunks of the budget left (7).
    assert sizes[:4] == [5, 8, 8, 7]
    model, _ = model_tok
    assert got[b] == solo_greedy(model, list(range(20, 40)), 4)
    assert got[a] == solo_greedy(model, list(range(5, 10)), 4)


def test_fcfs_and_max_num_seqs(model_tok: tuple[Any, Any]) -> None:
    engine = _engine(model_tok, max_num_seqs=2)
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    rids = [engine.add_request([30 + i] * 5, p) for i in range(5)]
    first_token: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        assert engine.num_running <= 2
        for out in engine.step():
            first_token.setdefault(out.request_id, step)
        step += 1
    starts = [first_token[r] for r in rids]
    assert starts == sorted(starts)  # first come, first served
    assert starts[0] == starts[1] < starts[2] == starts[3] < starts[4]


def test_preemption_picks_the_newest_request(model_tok: tuple[Any, Any]) -> None:
    # 9 blocks of 4: two requests growing to 5 blocks each cannot both stay.
    engine = _engine(model_tok, num_blocks=9, max_num_seqs=2)
    p = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    old = engine.add_request(list(range(5, 11)), p)
    new = engine.add_request(list(range(40, 46)), p)
    preempted: list[str] = []
    got: dict[str, list[int]] = {old: [], new: []}
    while engine.has_unfinished():
        before = {s.request_id: s.metrics.preemptions for s in engine.queues.running}
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
        for s in engine.queues.waiting:
            if s.metrics.preemptions > before.get(s.request_id, s.metrics.preemptions):
                preempted.append(s.request_id)
    assert preempted and set(preempted) == {new}, preempted
    model, _ = model_tok
    assert got[old] == solo_greedy(model, list(range(5, 11)), 14)
    assert got[new] == solo_greedy(model, list(range(40, 46)), 14)
    engine.manager.check()


def test_a_prefix_shared_in_one_batch_is_computed_once(model_tok: tuple[Any, Any]) -> None:
    engine = _engine(model_tok, max_num_seqs=4)
    prefix = list(range(5, 5 + 24))  # six full blocks
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    a = engine.add_request([*prefix, 60, 61], p)
    b = engine.add_request([*prefix, 70, 71, 72], p)
    got: dict[str, list[int]] = {a: [], b: []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
    # b waited one step for a's prefix instead of computing it again.
    assert engine.counters.computed_prompt_tokens == len(prefix) + 2 + 3
    assert engine.counters.cached_prompt_tokens == len(prefix)
    model, _ = model_tok
    assert got[b] == solo_greedy(model, [*prefix, 70, 71, 72], 3)
    engine.manager.check()


def test_a_cancel_frees_blocks_in_the_same_step(model_tok: tuple[Any, Any]) -> None:
    engine = _engine(model_tok, max_num_seqs=2)
    p = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    a = engine.add_request(list(range(5, 30)), p)
    b = engine.add_request(list(range(40, 60)), p)
    engine.step()
    used = engine.manager.stats().used_blocks
    engine.cancel(a)
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == a] == ["abort"]
    assert any(o.request_id == b for o in outs)  # b went on in the same step
    assert engine.manager.stats().used_blocks < used
    assert engine.num_running == 1


class SlowDisk(DiskStore):
    """A disk tier whose reads wait until the test lets them through."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.reads = 0

    def get(self, items: Sequence[tuple[int, int]]) -> Any:
        self.reads += 1
        assert self.gate.wait(30), "the test never opened the gate"
        return super().get(items)


def test_a_request_loading_from_a_slow_tier_does_not_hold_up_the_others(
    model_tok: tuple[Any, Any], tmp_path: Path
) -> None:
    disk = SlowDisk(tmp_path)
    disk.gate.set()
    engine = _engine(
        model_tok,
        num_blocks=24,
        max_num_seqs=3,
        tiers=[Tier(disk, 256, write_mode="write_through")],
    )
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    long_prompt = list(range(5, 5 + 40))  # ten blocks, written through to disk
    list(engine.generate(long_prompt, p))
    assert engine.tier_chain is not None
    engine.tier_chain.flush()
    engine.manager.reset_prefix_cache()  # the device forgets; the disk still has it
    disk.gate.clear()
    loading = engine.add_request(long_prompt, p)
    other = engine.add_request(list(range(60, 66)), SamplingParams(max_tokens=6, temperature=0))
    steps_while_loading = 0
    finished: set[str] = set()
    deadline = time.monotonic() + 30
    while other not in finished:
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        steps_while_loading += 1
        assert time.monotonic() < deadline
    assert loading not in finished and disk.reads >= 1  # still waiting on its read
    assert steps_while_loading >= 6  # the other request ran all its steps meanwhile
    disk.gate.set()
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == loading:
                got.extend(out.token_ids)
                if out.finished:
                    assert out.metrics.cached_tokens == 40 - 4  # all but the last block's
    model, _ = model_tok
    assert got == solo_greedy(model, long_prompt, 4)
    assert engine.counters.loaded_prompt_tokens >= 36
    engine.manager.check()
    engine.close()


def test_a_request_aware_policy_hears_of_the_whole_prompt_when_it_is_chunked(
    model_tok: tuple[Any, Any],
) -> None:
    from kvtier.policy import LRUPolicy

    heard: list[tuple[int, int]] = []

    class Recording(LRUPolicy):
        def on_request(self, keys: Any, num_hit: int, now: float, hints: Any = None) -> None:
            heard.append((len(keys), num_hit))

    engine = _engine(model_tok, max_num_seqs=2, max_num_batched_tokens=8, policy=Recording())
    prompt = list(range(5, 5 + 30))  # 7 full blocks of 4, computed in chunks of 8
    list(engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0)))
    assert heard == [(7, 0)]
    list(engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0)))
    assert heard[-1] == (7, 7)
