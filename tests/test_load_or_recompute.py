"""Load or recompute, per request: the plan's choice on a real engine, and where hits came from.

A tiny random-weight Llama runs in the engine over real tiers: host memory,
and a throttled medium whose every call sleeps (a store behind a slow link).
A prompt is computed once, the device cache is emptied, and the prompt comes
again: the first repeat loads everything (nothing is known yet, and the load
teaches the cost model the tier), later ones follow the plan. Every answer
must be the model's own greedy tokens, whatever was loaded or computed.

Where the test needs the compute side of the plan fixed, it teaches the
engine's cost model exact prefill observations at 1 ms a token, with no
forgetting (``decay=1.0``), so the few real passes the test runs move it
little; the tiers' side is always learned from their real loads.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from serving import serving
from tiny_model import greedy_ignoring_eos, seeded_prompt, solo_greedy, tiny_model_and_tokenizer

from kvtier.costs import CostModel
from kvtier.engine import Engine
from kvtier.engine.request import RequestMetrics
from kvtier.offload.host import HostStore
from kvtier.offload.throttled import ThrottledStore
from kvtier.offload.tier import Tier
from kvtier.server.metrics import metric_families, snapshot_engine
from kvtier.server.streaming import usage_body

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

BS = 4
NEW = 5
#: 41 tokens: 10 full blocks a tier can serve (the last token is always computed).
PROMPT = seeded_prompt(11, 41)
TIER_TOKENS = 40


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer()


@pytest.fixture(scope="module")
def greedy(model_tok: tuple[Any, Any]) -> list[int]:
    return solo_greedy(model_tok[0], PROMPT, NEW)


def engine(model_tok: tuple[Any, Any], tiers: list[Tier], per_token_s: float | None) -> Engine:
    model, tok = model_tok
    e = Engine(model, tok, model_id="tiny", block_size=BS, num_blocks=64, tiers=tiers)
    if per_token_s is not None:
        costs = CostModel(decay=1.0)
        for _ in range(100):
            for n in (16, 64, 256):
                costs.observe_pass([(0, n)], per_token_s * n)
        e.connector.costs = costs
    return e


def run(e: Engine, greedy: list[int]) -> RequestMetrics:
    """One greedy request; its answer must be the model's own."""
    outs = list(e.generate(PROMPT, greedy_ignoring_eos(NEW)))
    assert [t for o in outs for t in o.token_ids] == greedy
    return outs[-1].metrics


def settle(e: Engine, keep_on_host: int | None = None) -> None:
    """Finish tier writes, empty the device cache (its blocks demote to a write-back host
    tier); ``keep_on_host``: the host tier then keeps only that many leading blocks."""
    assert e.tier_chain is not None
    e.tier_chain.flush()
    e.manager.reset_prefix_cache()
    e.tier_chain.flush()
    if keep_on_host is not None:
        keys = list(e.manager.match(PROMPT).keys[: TIER_TOKENS // BS])
        e.tier_chain.tiers[0].offload_manager.remove(keys[keep_on_host:])


def test_a_slow_tier_is_recomputed(model_tok: tuple[Any, Any], greedy: list[int]) -> None:
    slow = Tier(ThrottledStore("lor-slow", latency_s=0.25), 64, write_mode="write_through")
    e = engine(model_tok, [slow], per_token_s=None)  # both sides learned for real
    try:
        assert run(e, greedy).cached_tokens == 0
        settle(e)
        first = run(e, greedy)  # nothing known of the tier yet: it loads, and learns
        assert first.tier_tokens == {"throttled": TIER_TOKENS}
        assert first.cached_tokens == TIER_TOKENS and first.plan_estimate_s is None
        settle(e)
        m = run(e, greedy)
        assert m.loaded_tokens == 0 and m.cached_tokens == 0
        assert m.recomputed_tier_tokens == TIER_TOKENS
        assert m.computed_tokens == len(PROMPT)
        assert m.plan_estimate_s is not None and m.recompute_estimate_s == m.plan_estimate_s
        assert e.connector.costs.plans == {"load_all": 1, "load_part": 0, "recompute": 1}
        assert e.counters.recomputed_tier_tokens == TIER_TOKENS
    finally:
        e.close()


def test_a_fast_tier_is_loaded_whole(model_tok: tuple[Any, Any], greedy: list[int]) -> None:
    e = engine(model_tok, [Tier(HostStore(), 64)], per_token_s=1e-3)
    try:
        run(e, greedy)
        settle(e)
        run(e, greedy)
        settle(e)
        m = run(e, greedy)
        assert m.tier_tokens == {"host": TIER_TOKENS} and m.cached_tokens == TIER_TOKENS
        assert m.recomputed_tier_tokens == 0 and m.computed_tokens == 1
        assert m.plan_estimate_s is not None and m.recompute_estimate_s is not None
        assert m.plan_estimate_s < m.recompute_estimate_s
        assert e.connector.costs.plans["load_all"] == 2
    finally:
        e.close()


def test_the_fast_beginning_is_loaded_and_the_slow_rest_computed(
    model_tok: tuple[Any, Any], greedy: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    host = Tier(HostStore(), 64, write_mode="write_back")
    slow = Tier(ThrottledStore("lor-mid", latency_s=0.25), 64, write_mode="write_through")
    e = engine(model_tok, [host, slow], per_token_s=1e-3)
    try:
        run(e, greedy)
        settle(e, keep_on_host=4)
        first = run(e, greedy)  # learns both tiers
        assert first.tier_tokens == {"host": 16, "throttled": 24}
        settle(e, keep_on_host=4)
        with caplog.at_level(logging.DEBUG, logger="kvtier.engine.connector"):
            m = run(e, greedy)
        assert m.tier_tokens == {"host": 16} and m.cached_tokens == 16
        assert m.recomputed_tier_tokens == 24 and m.computed_tokens == len(PROMPT) - 16
        assert e.connector.costs.plans["load_part"] == 1
        assert any("16 of 40 on tiers loaded" in r.getMessage() for r in caplog.records), (
            "the plan is logged at debug level"
        )
        snap = snapshot_engine(e)
        assert snap.cached_by_source == {"device": 0, "host": 32, "throttled": 24}
        assert snap.costs is not None and set(snap.costs["tiers"]) == {"host", "throttled"}
    finally:
        e.close()


def test_usage_and_metrics_say_where_cached_tokens_came_from(
    model_tok: tuple[Any, Any], greedy: list[int]
) -> None:
    e = engine(model_tok, [Tier(HostStore(), 64)], per_token_s=1e-3)
    try:
        run(e, greedy)
        settle(e)
        outs = list(e.generate(PROMPT, greedy_ignoring_eos(NEW)))
        details = usage_body([outs[-1]])["prompt_tokens_details"]
        assert details == {
            "cached_tokens": TIER_TOKENS,
            "kvtier_cached_tokens_by_source": {"device": 0, "host": TIER_TOKENS},
        }
        # Now the same prompt again, hitting the device's own cache.
        outs = list(e.generate(PROMPT, greedy_ignoring_eos(NEW)))
        details = usage_body([outs[-1]])["prompt_tokens_details"]
        assert details["kvtier_cached_tokens_by_source"] == {"device": TIER_TOKENS}
        families = {f.name: f for f in metric_families(snapshot_engine(e))}
        by_source = {
            s.labels["source"]: s.value
            for s in families["kvtier_prompt_tokens_cached_by_source"].samples
            if s.name.endswith("_total")
        }
        assert by_source == {"device": TIER_TOKENS, "host": TIER_TOKENS}
        latency = families["kvtier_tier_load_latency_seconds"].samples
        assert [s.labels["tier"] for s in latency] == ["host"]
        assert "kvtier_prefill_seconds_per_token" in families
    finally:
        e.close()


def test_cache_stats_show_costs_and_hits_by_source(
    model_tok: tuple[Any, Any], greedy: list[int]
) -> None:
    slow = Tier(ThrottledStore("lor-http", latency_s=0.05), 64, write_mode="write_through")
    e = engine(model_tok, [slow], per_token_s=None)
    with serving(e) as srv:
        for _ in range(2):
            completion = srv.client().completions.create(
                model="tiny-chat", prompt=PROMPT, max_tokens=NEW, temperature=0
            )
            assert completion.usage is not None
            srv.worker.call(lambda eng: settle(eng))
        stats = httpx.get(f"{srv.base}/v1/cache/stats", timeout=30).json()
        metrics = httpx.get(f"{srv.base}/metrics", timeout=30).text
    assert stats["engine"]["cached_prompt_tokens_by_source"] == {
        "device": 0,
        "throttled": TIER_TOKENS,
    }
    assert stats["costs"]["tiers"]["throttled"]["loads"] == 1
    assert stats["costs"]["prefill"]["passes"] >= 1
    assert 'kvtier_prompt_tokens_cached_by_source_total{source="throttled"} 40.0' in metrics
    assert 'kvtier_tier_load_latency_seconds{tier="throttled"}' in metrics
