"""A paused session's blocks come back from a tier shortly before its TTL says it returns.

With ``enable_prefetch(session_lead=S)`` (``kvtier serve --prefetch-session-lead S``)
and the workflow policy, a session whose pinned blocks the device evicted down to a
tier has them loaded back in the background once it is within ``S`` seconds of its
expected return: its next turn finds its whole context on the device instead of
loading it then. Nothing comes back before the lead, nothing for a session that
ended or whose request already came, and an idle server's worker wakes for it on
its own. Real tiny model, a real host tier; the clock is moved by hand except in the
worker case. The bookkeeping of expected returns is checked against a plain model.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_session_release import GREEDY, _run
from test_tier_pins import Clock
from tiny_model import tiny_model_and_tokenizer

from kvtier.agents.policy import workflow_policy_of
from kvtier.agents.ranks import TIMED
from kvtier.agents.sessions import SessionBook
from kvtier.engine import Engine, SamplingParams
from kvtier.errors import ConfigError
from kvtier.hints import Hints
from kvtier.offload.chain import Tier
from kvtier.offload.host import HostStore

TTL = 10.0
LEAD = 2.0


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer()


def _engine(model_tok: tuple[Any, Any], clock: Clock | None, lead: float | None) -> Engine:
    model, tok = model_tok
    engine = Engine(
        model,
        tok,
        model_id="tiny",
        block_size=4,
        num_blocks=24,
        policy="workflow",
        tiers=[Tier(HostStore(), 64)],
    )
    if clock is not None:
        engine.manager.clock = clock
    engine.agents.enable_prefetch(lookahead=0, session_lead=lead)
    return engine


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _on_device(engine: Engine, keys: list[int]) -> int:
    return len(engine.manager.pool.lookup(keys))


def _pause_off_device(engine: Engine, sid: str = "a") -> tuple[list[int], list[int]]:
    """Session ``sid``'s first turn (pinned for TTL), then a request that needs nearly
    every device block, so the session's blocks go down to the host tier with their pin.
    Returns the turn's prompt and its block keys."""
    prompt = _prompt(1, 40)
    _run(engine, prompt, {"session_id": sid, "cache_ttl_s": TTL})
    keys = list(engine.manager.hasher.chain(prompt))
    _run(engine, _prompt(2, 92))
    assert engine.tier_chain is not None
    engine.connector.demote_pending()
    engine.tier_chain.flush()
    engine.poll_background()
    assert _on_device(engine, keys) < len(keys)
    return prompt, keys


def _settle(engine: Engine) -> None:
    """Land every prefetch in flight (what the server's worker does between steps)."""
    engine.poll_background()
    while engine.agents.wait():
        pass


def _next_turn(engine: Engine, prompt: list[int], sid: str = "a") -> Any:
    """The session's next turn (its context plus a tool's output); its final output."""
    hints = {"session_id": sid, "cache_ttl_s": TTL}
    rid = engine.add_request(prompt + _prompt(3, 6), SamplingParams(max_tokens=2), hints=hints)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                last = out
    return last


def test_a_paused_sessions_blocks_come_back_within_the_lead_of_its_return(
    model_tok: tuple[Any, Any],
) -> None:
    clock = Clock()
    engine = _engine(model_tok, clock, LEAD)
    prompt, keys = _pause_off_device(engine)
    paused_at = clock.now
    # Before the lead nothing comes back; the idle worker would sleep until the lead.
    clock.now = paused_at + TTL - LEAD - 1.0
    assert engine.background_due_in() == pytest.approx(1.0)
    _settle(engine)
    assert _on_device(engine, keys) < len(keys)
    prefetcher = engine.agents.prefetcher
    assert prefetcher is not None and prefetcher.counters.started == 0
    # Within the lead it does, in the background.
    clock.now = paused_at + TTL - LEAD / 2
    assert engine.background_due_in() == 0.0
    _settle(engine)
    assert _on_device(engine, keys) == len(keys)
    assert prefetcher.counters.loaded_blocks > 0
    # Back on the device, they are pinned again (the pin went down and up with them).
    policy = workflow_policy_of(engine.manager.policy)
    assert policy is not None and {policy.rank_of(k) for k in keys} <= TIMED
    loaded_before = engine.counters.loaded_prompt_tokens
    # The next turn finds its context on the device and loads nothing then.
    out = _next_turn(engine, prompt)
    assert out.metrics.cached_tokens == len(keys) * 4
    assert engine.counters.loaded_prompt_tokens == loaded_before
    engine.manager.check()
    engine.close()


def test_without_the_lead_the_next_turn_loads_its_context_from_the_tier(
    model_tok: tuple[Any, Any],
) -> None:
    clock = Clock()
    engine = _engine(model_tok, clock, None)
    prompt, keys = _pause_off_device(engine)
    clock.now += TTL - LEAD / 2
    _settle(engine)
    assert _on_device(engine, keys) < len(keys)
    assert engine.background_due_in() is None
    loaded_before = engine.counters.loaded_prompt_tokens
    out = _next_turn(engine, prompt)
    assert out.metrics.cached_tokens == len(keys) * 4
    assert engine.counters.loaded_prompt_tokens > loaded_before
    engine.close()


def test_an_ended_session_or_one_already_back_is_not_prefetched(
    model_tok: tuple[Any, Any],
) -> None:
    clock = Clock()
    engine = _engine(model_tok, clock, LEAD)
    _pause_off_device(engine)
    assert engine.agents.end_session("a")
    clock.now += TTL - LEAD / 2
    _settle(engine)
    prefetcher = engine.agents.prefetcher
    assert prefetcher is not None and prefetcher.counters.started == 0
    assert engine.background_due_in() is None
    engine.close()

    clock = Clock()
    engine = _engine(model_tok, clock, LEAD)
    prompt, _ = _pause_off_device(engine)
    # Its request arrives before the lead: it is back, and loads what it needs itself.
    clock.now += 1.0
    engine.add_request(prompt + _prompt(3, 6), GREEDY, hints={"session_id": "a"})
    clock.now += TTL - LEAD
    while engine.has_unfinished():
        engine.step()
    prefetcher = engine.agents.prefetcher
    assert prefetcher is not None and prefetcher.counters.started == 0
    engine.close()


def test_session_prefetch_needs_the_workflow_policy_and_a_tier(
    model_tok: tuple[Any, Any],
) -> None:
    model, tok = model_tok
    lru = Engine(model, tok, model_id="tiny", block_size=4, num_blocks=24,
                 tiers=[Tier(HostStore(), 64)])  # fmt: skip
    with pytest.raises(ConfigError, match="--policy workflow"):
        lru.agents.enable_prefetch(lookahead=0, session_lead=1.0)
    with pytest.raises(ConfigError, match="seconds >= 0"):
        _engine(model_tok, None, -1.0)
    bare = Engine(model, tok, model_id="tiny", block_size=4, num_blocks=24, policy="workflow")
    with pytest.raises(ConfigError, match="tier"):
        bare.agents.enable_prefetch(lookahead=0, session_lead=1.0)


def test_an_idle_server_worker_wakes_for_a_sessions_prefetch(
    model_tok: tuple[Any, Any],
) -> None:
    """No request runs between the turns: the worker sleeps until the session is within
    the lead of its return, then brings its blocks back on its own."""
    from kvtier.engine.worker import EngineWorker

    ttl, lead = 1.5, 1.0
    engine = _engine(model_tok, None, lead)
    prompt = _prompt(1, 40)
    keys = list(engine.manager.hasher.chain(prompt))
    worker = EngineWorker(engine).start()
    try:
        worker.submit(prompt, GREEDY, hints={"session_id": "a", "cache_ttl_s": ttl}).result()
        worker.submit(_prompt(2, 92), GREEDY).result()
        paused = time.monotonic()

        def on_device() -> int:
            return int(worker.call(lambda e: _on_device(e, keys)))

        while worker.call(lambda e: e.background_pending()):
            time.sleep(0.005)
        early = on_device()
        deadline = paused + 30.0
        while on_device() < len(keys):
            assert time.monotonic() < deadline, "the session's blocks never came back"
            time.sleep(0.02)
        # Back before its TTL ran out, and not (all) before the lead began.
        assert time.monotonic() - paused < ttl + 5.0
        assert early < len(keys) or time.monotonic() - paused >= ttl - lead
        prefetcher = engine.agents.prefetcher
        assert prefetcher is not None and prefetcher.counters.loaded_blocks > 0
    finally:
        worker.stop()
    engine.manager.check()


# -- the bookkeeping of expected returns, against a plain model -----------------------------


_events = st.lists(
    st.tuples(
        st.sampled_from(["turn", "finish", "arrive", "end", "ask"]),
        st.sampled_from(["a", "b", "c"]),
        st.floats(0.0, 5.0),  # time passing before the event
        st.sampled_from([None, 1.0, 4.0]),  # the turn's cache_ttl_s
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_events, st.sampled_from([0.0, 0.5, 2.0]))
def test_returning_lists_the_paused_sessions_due_within_the_lead(
    events: list[tuple[str, str, float, float | None]], lead: float
) -> None:
    """``returning`` equals a scan of every session's record, soonest first, and
    ``next_return`` is the earliest expected return among those not yet listed."""
    book = SessionBook()
    book.expect_returns = True
    now = 1.0
    for kind, sid, dt, ttl in events:
        now += dt
        h = Hints(session_id=sid, cache_ttl_s=ttl)
        if kind in ("turn", "finish"):
            book.observe(h, [hash((sid, 1)), hash((sid, 2))], now, progress=kind == "turn")
        elif kind == "arrive":
            book.arrive(h, now)
        elif kind == "end":
            book.end(sid)
        got = book.returning(now, lead)
        recs = {s: book.get(s) for s in "abc"}
        want = sorted(
            (r.back, s)
            for s, r in recs.items()
            if r is not None and r.back > 0.0 and r.back - lead <= now and r.until > now
        )
        assert got == [s for _, s in want]
        pending = [
            r.back for r in recs.values() if r is not None and r.back > 0.0 and r.back - lead > now
        ]
        nxt = book.next_return()
        if pending:
            assert nxt == min(pending)
        else:
            assert nxt is None
