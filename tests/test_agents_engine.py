"""Agent hints and prefetch in the engine: the tiny model, real host/disk/Redis tiers.

Hints change no output; bad hints are refused; a finished hinted request
pins its blocks for its TTL; prefetch brings the next agents' blocks back
from the tiers before their requests, within its byte bound, soonest first,
never evicting blocks due sooner; and a request whose blocks are still
loading lets a ready request run first.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_model import solo_greedy, tiny_model_and_tokenizer

from kvtier import BadRequestError, ConfigError
from kvtier.agents import sequential, workflow_policy_of
from kvtier.agents.prefetch import Candidate, plan_prefetch
from kvtier.agents.ranks import PINNED
from kvtier.engine import Engine, SamplingParams
from kvtier.offload.chain import Tier
from kvtier.offload.disk import DiskStore
from kvtier.offload.host import HostStore
from kvtier.offload.redis_store import RedisStore

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
AGENTS = ["plan", "code", "test", "review"]


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer()


def agent_prompts(n_tokens: int = 48) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)
    return {a: torch.randint(5, 90, (n_tokens,), generator=g).tolist() for a in AGENTS}


def run(engine: Engine, prompt: list[int], hints: dict[str, Any] | None = None) -> list[int]:
    rid = engine.add_request(prompt, GREEDY, hints=hints)
    toks: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                toks.extend(out.token_ids)
    return toks


def test_hints_change_no_output_and_bad_ones_are_refused(model_tok: tuple[Any, Any]) -> None:
    model, tok = model_tok
    eng = Engine(model, tok, model_id="tiny", block_size=4, num_blocks=64, policy="workflow")
    eng.agents.register(sequential("w", AGENTS, cyclic=True))
    prompts = agent_prompts(20)
    for step, a in enumerate(AGENTS):
        hints = {"workflow_id": "w", "agent_id": a, "step": step, "session_id": "s"}
        assert run(eng, prompts[a], hints) == solo_greedy(model, prompts[a], 4)
    assert eng.agents.tracker.distance("w", "plan") == 0
    for bad, match in (
        ({"agent": "x"}, "unknown hint 'agent'"),
        ({"reuse": "maybe"}, "reuse"),
        ({"cache_ttl_s": -1}, "cache_ttl_s"),
        ("plan", "object of hints"),
    ):
        with pytest.raises(BadRequestError, match=match):
            eng.add_request(prompts["plan"], GREEDY, hints=bad)  # type: ignore[arg-type]
    assert not eng.has_unfinished()
    eng.manager.check()


def test_a_finished_request_pins_its_blocks_for_its_ttl(model_tok: tuple[Any, Any]) -> None:
    model, tok = model_tok
    clock = [100.0]
    eng = Engine(model, tok, model_id="tiny", block_size=4, num_blocks=64, policy="workflow")
    eng.manager.clock = lambda: clock[0]
    policy = workflow_policy_of(eng.manager.pool.policy)
    assert policy is not None  # its pins follow the manager's clock, replaced or not
    prompt = agent_prompts(20)["plan"]
    run(eng, prompt, {"session_id": "tool-1", "cache_ttl_s": 30})
    keys = eng.manager.hasher.chain(prompt + [0] * 0)[:5]
    assert policy.evict_many(0) == []  # an eviction pass expires pins by the policy's clock
    assert keys and all(policy.rank_of(k) == PINNED for k in keys)
    assert 0 < policy.protected_used <= policy.pin_cap
    clock[0] = 131.0
    policy.expire(clock[0])
    assert all(policy.rank_of(k) != PINNED for k in keys)


def test_a_session_whose_request_waits_keeps_its_blocks_past_its_ttl(
    model_tok: tuple[Any, Any],
) -> None:
    """Its request arrived within the TTL but is served later, behind others: the
    blocks are held until then, and it finds its whole context cached."""
    model, tok = model_tok
    clock = [100.0]
    # 16 blocks, one request at a time: the session's 5 cached blocks and the first
    # other request's 5 fit; the second other request's 10 evict 5 of them.
    eng = Engine(
        model, tok, model_id="tiny", block_size=4, num_blocks=16, policy="workflow",
        max_num_seqs=1,
    )  # fmt: skip
    eng.manager.clock = lambda: clock[0]
    policy = workflow_policy_of(eng.manager.pool.policy)
    assert policy is not None
    g = torch.Generator().manual_seed(11)
    turn1 = torch.randint(5, 90, (20,), generator=g).tolist()
    others = [torch.randint(5, 90, (n,), generator=g).tolist() for n in (20, 40)]
    hints = {"session_id": "tool-1", "cache_ttl_s": 2.0}
    out1 = run(eng, turn1, hints)
    turn2 = turn1 + out1 + torch.randint(5, 90, (4,), generator=g).tolist()
    clock[0] = 101.5  # the tool answered within the TTL ...
    for i, p in enumerate(others):  # sessions whose pins last longer than its TTL
        eng.add_request(p, GREEDY, hints={"session_id": f"other-{i}", "cache_ttl_s": 60.0})
    rid = eng.add_request(turn2, GREEDY, hints=hints)
    clock[0] = 110.0  # ... and the queue before it took longer than the TTL
    cached: dict[str, int] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished and out.metrics is not None:
                cached[out.request_id] = out.metrics.cached_tokens
    # Held while it waited (past its TTL: the hold is renewed every step), the
    # session's blocks outlived the first other request's, pinned for longer.
    assert cached[rid] == (len(turn1) + len(out1) - 1) // 4 * 4
    assert policy.sessions.wait == pytest.approx(8.5)
    assert max(v for k, v in cached.items() if k != rid) == 0
    eng.manager.check()


def _tiered(model_tok: tuple[Any, Any], tiers: list[Tier], **kw: Any) -> Engine:
    model, tok = model_tok
    return Engine(
        model,
        tok,
        model_id="tiny",
        block_size=4,
        num_blocks=30,
        policy="workflow",
        tiers=tiers,
        **kw,
    )


def _loop(eng: Engine, rounds: int, prompts: dict[str, list[int]]) -> list[bool]:
    """Run the agent loop; per step, whether the agent's prompt was on the device when it came."""
    warm: list[bool] = []
    bs = eng.manager.block_size
    step = 0
    for _ in range(rounds):
        for a in AGENTS:
            p = prompts[a]
            keys = eng.manager.hasher.chain(p)
            # The client's think time between steps: an idle engine keeps polling its
            # tier stores and prefetches (as the server's worker does) until none is left.
            while eng.background_pending():
                eng.poll_background()
                time.sleep(0.001)
            warm.append(len(eng.manager.pool.lookup(keys)) * bs >= len(p) - bs)
            run(eng, p, {"workflow_id": "w", "agent_id": a, "step": step})
            step += 1
    return warm


@pytest.mark.parametrize("medium", ["host", "disk"])
def test_prefetch_warms_the_next_agents_from_a_tier(
    model_tok: tuple[Any, Any], tmp_path: Path, medium: str
) -> None:
    prompts = agent_prompts()
    store = HostStore() if medium == "host" else DiskStore(tmp_path)
    eng = _tiered(model_tok, [Tier(store, 200)])
    eng.agents.register(sequential("w", AGENTS, cyclic=True))
    eng.agents.enable_prefetch(lookahead=1, max_bytes=12 * eng.layout.bytes_per_block)
    warm = _loop(eng, 4, prompts)
    p = eng.agents.prefetcher
    assert p is not None and p.counters.started > 0 and p.counters.loaded_blocks > 0
    # After the first round every agent's prompt is back before its request.
    assert all(warm[len(AGENTS) :]), warm
    assert p.counters.peak_bytes <= 12 * eng.layout.bytes_per_block
    eng.manager.check()
    assert eng.tier_chain is not None
    eng.tier_chain.check()
    eng.close()


def test_without_prefetch_the_loop_finds_prompts_cold(
    model_tok: tuple[Any, Any],
) -> None:
    eng = _tiered(model_tok, [Tier(HostStore(), 200)])
    eng.agents.register(sequential("w", AGENTS, cyclic=True))
    warm = _loop(eng, 3, agent_prompts())
    # The device holds about two agents' prompts: the policy keeps some, not all.
    assert not all(warm[len(AGENTS) :])
    eng.close()


def test_prefetch_needs_a_tier(model_tok: tuple[Any, Any]) -> None:
    model, tok = model_tok
    eng = Engine(model, tok, model_id="tiny", block_size=4, num_blocks=30)
    with pytest.raises(ConfigError, match="tier"):
        eng.agents.enable_prefetch()


def test_prefetch_from_redis_lets_ready_requests_go_first(
    model_tok: tuple[Any, Any], redis: Any
) -> None:
    prompts = agent_prompts()
    eng = _tiered(model_tok, [Tier(RedisStore(redis.url), 200)])
    # The tiny model computes a prompt faster than Redis loads it, so the load-or-recompute
    # plan would recompute: this test is about the order prefetched requests run in.
    eng.connector.load_all = True
    eng.agents.register(sequential("w", AGENTS, cyclic=True))
    _loop(eng, 1, prompts)
    eng.agents.enable_prefetch(lookahead=3, max_bytes=64 * eng.layout.bytes_per_block)
    assert eng.tier_chain is not None
    eng.tier_chain.flush()
    # The small device kept the agents due first; the others' prompts went to Redis.
    grants = eng.agents.prefetcher.start() if eng.agents.prefetcher else []
    assert grants, "an agent due soon had its prompt on Redis"
    agent = grants[0].candidate.target[1]
    waiting = eng.add_request(prompts[agent], GREEDY)
    ready = eng.add_request(list(range(5, 40)), GREEDY)
    batch = eng.scheduler.schedule().batch
    # The prefetched request waits for its blocks; the ready one behind it runs now.
    assert [s.request_id for s, _ in batch] == [ready]
    assert [s.request_id for s in eng.queues.waiting] == [waiting]
    done: dict[str, list[int]] = {}
    # Steps while a Redis read is in flight produce nothing: bound by time, not steps.
    give_up = time.monotonic() + 120
    while eng.has_unfinished() and time.monotonic() < give_up:
        for out in eng.step():
            done.setdefault(out.request_id, []).extend(out.token_ids)
    model = model_tok[0]
    assert done[waiting] == solo_greedy(model, prompts[agent], 4)
    assert done[ready] == solo_greedy(model, list(range(5, 40)), 4)
    assert eng.counters.cached_prompt_tokens > 0
    eng.manager.check()
    eng.close()


candidates = st.lists(
    st.builds(
        Candidate,
        st.integers(0, 5),
        st.tuples(st.just("w"), st.sampled_from(["a", "b", "c", "d"])),
        st.integers(1, 20),
    ),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(
    cands=candidates,
    budget=st.integers(0, 4000),
    empty=st.integers(0, 30),
    later=st.lists(st.integers(0, 10), min_size=7, max_size=7),
)
def test_a_prefetch_plan_keeps_its_bounds_and_order(
    cands: list[Candidate], budget: int, empty: int, later: list[int]
) -> None:
    # Blocks due later than d: fewer as d grows (monotone, like the policy's classes).
    due_after = sorted(later, reverse=True)
    grants = plan_prefetch(
        cands,
        bytes_per_block=100,
        budget_bytes=budget,
        empty_blocks=empty,
        evictable_after=lambda d: due_after[min(d, 6)],
    )
    assert sum(g.blocks for g in grants) * 100 <= budget
    assert [g.candidate.distance for g in grants] == sorted(g.candidate.distance for g in grants)
    used_empty = 0
    evicted = 0
    for g in grants:
        assert 0 < g.blocks <= g.candidate.blocks
        from_empty = min(g.blocks, empty - used_empty)
        used_empty += from_empty
        evicted += g.blocks - from_empty
        # Everything evicted so far was due later than this agent.
        assert evicted <= due_after[min(g.candidate.distance, 6)]


def test_an_idle_server_worker_prefetches_between_steps(
    model_tok: tuple[Any, Any], tmp_path: Path
) -> None:
    """Between steps no request runs; the worker still lands stores and starts prefetches."""
    from kvtier.engine.worker import EngineWorker

    prompts = agent_prompts()
    eng = _tiered(model_tok, [Tier(DiskStore(tmp_path), 200)])
    eng.agents.register(sequential("w", AGENTS, cyclic=True))
    eng.agents.enable_prefetch(lookahead=1, max_bytes=12 * eng.layout.bytes_per_block)
    worker = EngineWorker(eng).start()
    try:
        warm: list[bool] = []
        step = 0
        for _ in range(3):
            for a in AGENTS:
                keys = eng.manager.hasher.chain(prompts[a])
                # Think time: only the worker's own idle polling may bring the prompt back.
                deadline = time.monotonic() + 10.0
                while worker.call(lambda e: e.background_pending()):
                    assert time.monotonic() < deadline, "background work never settled"
                    time.sleep(0.005)
                cached = worker.call(lambda e, k=keys: len(e.manager.pool.lookup(k)))
                warm.append(cached * eng.manager.block_size >= len(prompts[a]) - 4)
                hints = {"workflow_id": "w", "agent_id": a, "step": step}
                handle = worker.submit(prompts[a], GREEDY, hints=hints)
                handle.result()
                step += 1
        assert all(warm[len(AGENTS) :]), warm
        prefetcher = eng.agents.prefetcher
        assert prefetcher is not None and prefetcher.counters.loaded_blocks > 0
    finally:
        worker.stop()
    eng.manager.check()
