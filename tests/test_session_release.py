"""An ended session's own blocks leave every tier: the disk tier and Redis (its shared
copy included); what it shares with other sessions stays, and so does every other
session's. Real tiny model, a real disk tier and a real redis-server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_model import tiny_model_and_tokenizer

from kvtier.engine import Engine, SamplingParams
from kvtier.offload.chain import Tier
from kvtier.offload.disk import DiskStore
from kvtier.offload.redis_store import RedisStore

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


def _run(engine: Engine, prompt: list[int], hints: dict[str, Any] | None = None) -> None:
    engine.add_request(prompt, GREEDY, hints=hints)
    while engine.has_unfinished():
        engine.step()
    engine.tier_chain.flush()  # type: ignore[union-attr]
    engine.poll_background()


def _held(engine: Engine, keys: list[int]) -> dict[str, set[int]]:
    """Per tier, which of ``keys`` its bookkeeping holds and its medium has."""
    out: dict[str, set[int]] = {}
    assert engine.tier_chain is not None
    for tier in engine.tier_chain.tiers:
        mgr = tier.offload_manager
        tracked = [k for k in keys if mgr.is_ready(k)]
        present = tier.medium.contains(tracked) if tracked else []
        out[tier.name] = {k for k, here in zip(tracked, present, strict=True) if here}
    return out


def _prompts() -> tuple[list[int], list[int], list[int]]:
    g = torch.Generator().manual_seed(7)
    system = torch.randint(5, 90, (16,), generator=g).tolist()
    a = system + torch.randint(5, 90, (24,), generator=g).tolist()
    b = system + torch.randint(5, 90, (24,), generator=g).tolist()
    return system, a, b


@pytest.mark.parametrize("how", ["delete", "hint"])
def test_an_ended_sessions_own_blocks_leave_every_tier(
    redis: Any, tmp_path: Path, how: str
) -> None:
    model, tok = tiny_model_and_tokenizer()
    redis_store = RedisStore(redis.url)
    engine = Engine(
        model, tok, model_id="tiny", block_size=4, num_blocks=24, policy="workflow",
        tiers=[Tier(DiskStore(tmp_path), 256), Tier(redis_store, 256)],
    )  # fmt: skip
    system, a, b = _prompts()
    # No TTL: nothing pins the sessions' blocks on the device.
    _run(engine, a, {"session_id": "a"})
    _run(engine, b, {"session_id": "b"})
    # Other work pushes both sessions' blocks off the 24-block device to the disk tier.
    g = torch.Generator().manual_seed(8)
    for _ in range(4):
        _run(engine, torch.randint(5, 90, (40,), generator=g).tolist())
    chain = engine.manager.hasher.chain
    shared = chain(system)
    own_a = [k for k in chain(a) if k not in set(shared)]
    own_b = [k for k in chain(b) if k not in set(shared)]
    before = _held(engine, own_a)
    # Redis writes through, the disk tier took the device's evictions: both hold A's blocks.
    assert before["redis"] == set(own_a) and before["disk"], before

    if how == "delete":
        assert engine.agents.end_session("a")
    else:  # a last turn that says so (a short one: the session is done)
        _run(engine, [7, 8, 9], {"session_id": "a", "session_end": True})

    after = _held(engine, own_a)
    assert after == {"disk": set(), "redis": set()}, after
    # Gone from Redis itself, not only from this engine's bookkeeping.
    assert not any(redis_store.contains(own_a))
    stats = engine.tier_chain.stats()  # type: ignore[union-attr]
    assert stats["redis"]["released_blocks"] == len(own_a)
    assert stats["disk"]["released_blocks"] == len(before["disk"])
    # What A shared with B, and B's own blocks, stay where they were.
    assert _held(engine, shared)["redis"] == set(shared)
    assert _held(engine, own_b)["redis"] == set(own_b)
    # Ending an unknown (or already ended) session frees nothing more.
    assert not engine.agents.end_session("a")
    assert engine.tier_chain.stats()["redis"]["released_blocks"] == len(own_a)  # type: ignore[union-attr]
    engine.close()


def test_without_tiers_ending_a_session_keeps_nothing_for_them() -> None:
    model, tok = tiny_model_and_tokenizer()
    engine = Engine(model, tok, model_id="tiny", block_size=4, num_blocks=24, policy="workflow")
    _, a, _ = _prompts()
    _run_no_tiers(engine, a, {"session_id": "a", "cache_ttl_s": 600})
    assert engine.agents.end_session("a")
    policy = engine.agents.policy
    assert policy is not None and not policy.collect_released
    assert policy.take_released() == []
    engine.close()


def _run_no_tiers(engine: Engine, prompt: list[int], hints: dict[str, Any]) -> None:
    engine.add_request(prompt, GREEDY, hints=hints)
    while engine.has_unfinished():
        engine.step()
