"""Moving requests between engines in one process: the same tokens as never moving.

Two engines over the tiny random Llama (same weights) run requests; one is
moved from the first to the second at a chosen step (waiting, mid-prefill,
mid-decode), its KV copied block by block, and its tokens must equal the
plain model's greedy tokens (or, seeded, the tokens of a run that never
moved). A move that cannot happen leaves the request running on its source.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiny_model import solo_greedy as plain_greedy  # noqa: E402
from tiny_model import tiny_model_and_tokenizer  # noqa: E402

from kvtier.engine import Engine, EngineWorker, SamplingParams  # noqa: E402
from kvtier.engine.migrate import attach, detach, migrate, migrate_between  # noqa: E402
from kvtier.errors import MigrationError  # noqa: E402


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer()


_REFERENCE: dict[tuple[tuple[int, ...], int], list[int]] = {}


def solo_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """The plain model's greedy tokens (every model here has the same weights), computed once."""
    key = (tuple(prompt), n)
    if key not in _REFERENCE:
        _REFERENCE[key] = plain_greedy(model, prompt, n)
    return list(_REFERENCE[key])


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def drain(engine: Engine, got: dict[str, list[int]], rename: dict[str, str]) -> None:
    while engine.has_unfinished():
        for out in engine.step():
            got[rename.get(out.request_id, out.request_id)].extend(out.token_ids)
            assert out.finish_reason in (None, "length"), out


def engine(model_tok: tuple[Any, Any], **kw: Any) -> Engine:
    model, tok = model_tok
    kw.setdefault("num_blocks", 64)
    return Engine(model, tok, model_id="tiny", block_size=4, **kw)


PROMPT = [7, 21, 33, 40, 8, 9, 60, 61, 62, 5, 17, 29, 31, 44, 50, 52, 70]


@pytest.mark.parametrize("steps_before", [0, 1, 5, 12])
@pytest.mark.parametrize("dst_has_prefix", [False, True])
def test_a_moved_request_generates_the_same_tokens(
    model_tok: tuple[Any, Any], steps_before: int, dst_has_prefix: bool
) -> None:
    model, _ = model_tok
    want = solo_greedy(model, PROMPT, 16)
    # A small token budget chunks the prompt: step 1 moves it mid-prefill.
    a = engine(model_tok, max_num_batched_tokens=8)
    b = engine(model_tok, num_blocks=40)
    if dst_has_prefix:
        b.add_request(PROMPT[:12], greedy(1), "warm")
        drain(b, {"warm": []}, {})
    got: dict[str, list[int]] = {"r": []}
    a.add_request(PROMPT, greedy(16), "r")
    for _ in range(steps_before):
        for out in a.step():
            got["r"].extend(out.token_ids)
    computed_before = b.counters.computed_prompt_tokens
    assert migrate(a, b, "r", new_id="moved") == "moved"
    assert not a.has_unfinished() and len(a.manager) == 0
    drain(b, got, {"moved": "r"})
    assert got["r"] == want
    assert a.counters.migrated_out == 1 and b.counters.migrated_in == 1
    a.manager.check()
    b.manager.check()
    if steps_before >= 5:
        # Moved after its prefill: the destination computed none of the prompt.
        assert b.counters.computed_prompt_tokens == computed_before


def test_other_requests_on_both_engines_are_unaffected(model_tok: tuple[Any, Any]) -> None:
    model, _ = model_tok
    prompts = {
        "a1": PROMPT,
        "a2": [*PROMPT[:9], 3, 4, 5],
        "b1": [11, 12, 13, 14, 15, 16, 17],
        "b2": PROMPT[:5],
    }
    want = {rid: solo_greedy(model, p, 10) for rid, p in prompts.items()}
    a = engine(model_tok)
    b = engine(model_tok)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, p in prompts.items():
        (a if rid.startswith("a") else b).add_request(p, greedy(10), rid)
    for _ in range(4):
        for e in (a, b):
            for out in e.step():
                got[out.request_id].extend(out.token_ids)
    migrate(a, b, "a1")
    drain(a, got, {})
    drain(b, got, {})
    assert got == want


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    prompt=st.lists(st.integers(5, 90), min_size=1, max_size=30),
    steps=st.integers(0, 14),
    n=st.integers(1, 12),
    budget=st.integers(4, 32),
)
def test_moving_at_any_step(
    model_tok: tuple[Any, Any], prompt: list[int], steps: int, n: int, budget: int
) -> None:
    model, _ = model_tok
    want = solo_greedy(model, prompt, n)
    a = engine(model_tok, max_num_batched_tokens=budget)
    b = engine(model_tok)
    got: dict[str, list[int]] = {"r": []}
    a.add_request(prompt, greedy(n), "r")
    for _ in range(steps):
        for out in a.step():
            got["r"].extend(out.token_ids)
    if a.has_unfinished():
        migrate(a, b, "r")
    drain(b, got, {})
    assert got["r"] == want
    assert len(a.manager) == 0 and len(b.manager) == 0
    a.manager.check()
    b.manager.check()


def test_seeded_sampling_and_penalties_continue_where_they_were(
    model_tok: tuple[Any, Any],
) -> None:
    params = SamplingParams(
        max_tokens=20, temperature=1.3, seed=11, frequency_penalty=0.8, ignore_eos=True
    )
    stay = engine(model_tok)
    stay.add_request(PROMPT, params, "r")
    want: dict[str, list[int]] = {"r": []}
    drain(stay, want, {})
    a, b = engine(model_tok), engine(model_tok)
    got: dict[str, list[int]] = {"r": []}
    a.add_request(PROMPT, params, "r")
    for _ in range(8):
        for out in a.step():
            got["r"].extend(out.token_ids)
    migrate(a, b, "r")
    drain(b, got, {})
    assert got == want
    assert len(set(want["r"])) > 3  # really sampled, not a constant


def _run_partly(a: Engine, steps: int) -> list[int]:
    got: list[int] = []
    a.add_request(PROMPT, greedy(16), "r")
    for _ in range(steps):
        for out in a.step():
            got.extend(out.token_ids)
    return got


@pytest.mark.parametrize(
    "make_dst",
    [
        # Full: it already runs as many requests as it may.
        lambda mt: _busy(engine(mt, max_num_seqs=1)),
        # No room for the request's blocks.
        lambda mt: _busy(engine(mt, num_blocks=6)),
        # Another block size: its blocks cannot hold this request's KV.
        lambda mt: Engine(mt[0], mt[1], model_id="tiny", block_size=8, num_blocks=64),
        # Another model namespace.
        lambda mt: Engine(mt[0], mt[1], model_id="other", block_size=4, num_blocks=64),
    ],
    ids=["full", "small", "block-size", "model"],
)
def test_a_failed_move_leaves_the_request_running_where_it_was(
    model_tok: tuple[Any, Any], make_dst: Any
) -> None:
    model, _ = model_tok
    want = solo_greedy(model, PROMPT, 16)
    a = engine(model_tok)
    b = make_dst(model_tok)
    got = _run_partly(a, 6)
    before = (len(b.manager), b.manager.stats().free_blocks)
    with pytest.raises(MigrationError):
        migrate(a, b, "r")
    assert (len(b.manager), b.manager.stats().free_blocks) == before
    assert a.num_running == 1 and a.counters.migrated_out == 0
    rest: dict[str, list[int]] = {"r": got}
    drain(a, rest, {})
    assert rest["r"] == want
    b.manager.check()


def _busy(e: Engine) -> Engine:
    e.add_request([1, 2, 3], greedy(10), "other")
    e.step()
    return e


def test_unknown_and_multi_choice_requests_do_not_move(model_tok: tuple[Any, Any]) -> None:
    a, b = engine(model_tok), engine(model_tok)
    with pytest.raises(MigrationError, match="not on this engine"):
        migrate(a, b, "nope")
    a.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0, n=2), "two")
    with pytest.raises(MigrationError, match="several choices"):
        migrate(a, b, "two")
    a.add_request(PROMPT, greedy(4), "dup")
    b.add_request(PROMPT, greedy(4), "dup")
    with pytest.raises(MigrationError, match="already in use"):
        migrate(a, b, "dup")
    assert a.num_waiting == 2


def test_a_detached_request_cannot_be_detached_twice(model_tok: tuple[Any, Any]) -> None:
    a, b = engine(model_tok), engine(model_tok)
    _run_partly(a, 3)
    dep = detach(a, "r")
    with pytest.raises(MigrationError, match="already moving"):
        detach(a, "r")
    attach(b, dep)


def test_moving_between_workers_keeps_the_stream(model_tok: tuple[Any, Any]) -> None:
    # Separate model objects (same weights): each engine thread runs its own.
    mt_b = tiny_model_and_tokenizer()
    model, _ = model_tok
    want = solo_greedy(model, PROMPT, 40)
    wa = EngineWorker(engine(model_tok)).start()
    wb = EngineWorker(engine(mt_b)).start()
    try:
        handle = wa.submit(PROMPT, greedy(40))
        got: list[int] = []
        outs = iter(handle)
        while len(got) < 5:
            got.extend(next(outs).token_ids)
        new_id = migrate_between(wa, wb, handle.request_id)
        # The source let go of it at once; the destination runs it under its own id.
        assert wa.call(lambda e: not e.queues.group(handle.request_id))
        assert isinstance(new_id, str) and new_id
        for out in outs:
            assert out.request_id == handle.request_id
            got.extend(out.token_ids)
        assert got == want
        assert wa.in_flight == 0
        counts = wb.call(lambda e: (e.counters.migrated_in, len(e.manager)))
        assert counts == (1, 0)
        assert wa.call(lambda e: e.counters.migrated_out) == 1
    finally:
        wa.stop()
        wb.stop()


def test_cancelling_a_moved_request_cancels_it_where_it_runs(
    model_tok: tuple[Any, Any],
) -> None:
    mt_b = tiny_model_and_tokenizer()
    wa = EngineWorker(engine(model_tok)).start()
    wb = EngineWorker(engine(mt_b)).start()
    try:
        handle = wa.submit(PROMPT, greedy(200))
        outs = iter(handle)
        next(outs)
        migrate_between(wa, wb, handle.request_id)
        handle.cancel()
        last = None
        for out in outs:
            last = out
        assert last is not None and last.finish_reason == "abort"
        done = threading.Event()
        assert wb.call(lambda e: e.has_unfinished() or done.set() or False) is False
    finally:
        wa.stop()
        wb.stop()


def test_a_failed_move_between_workers_keeps_streaming(model_tok: tuple[Any, Any]) -> None:
    model, _ = model_tok
    want = solo_greedy(model, PROMPT, 30)
    mt_b = tiny_model_and_tokenizer()
    wa = EngineWorker(engine(model_tok)).start()
    wb = EngineWorker(Engine(mt_b[0], mt_b[1], model_id="tiny", block_size=8)).start()
    try:
        handle = wa.submit(PROMPT, greedy(30))
        got: list[int] = []
        outs = iter(handle)
        got.extend(next(outs).token_ids)
        with pytest.raises(MigrationError, match="not alike"):
            migrate_between(wa, wb, handle.request_id)
        for out in outs:
            got.extend(out.token_ids)
        assert got == want
        assert wb.in_flight == 0
    finally:
        wa.stop()
        wb.stop()
