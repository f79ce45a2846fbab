"""Load and compute together: a prefix on a tier as fast as the model, loaded from its end
while it is computed from its start, on a real engine and a real paced medium.

A tiny random-weight Llama runs over a throttled medium (items in this
process, every read sleeping its bytes at a set bandwidth, payloads
checksummed). The engine's cost model is taught a prefill cost of 5 ms a
token with no forgetting, so the plan sees computing the 40-token tier
prefix as 0.2 s; the medium is paced so that loading it takes about as long,
and the tier's side is learned from its real loads. The tests drive the
engine step by step and wait between steps for the load to read what they
need, so where the two meet does not depend on this machine's speed. Every
answer must be the model's own greedy tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from tiny_model import greedy_ignoring_eos, seeded_prompt, solo_greedy, tiny_model_and_tokenizer

from kvtier.costs import OVERLAP_RATIO, CostModel
from kvtier.engine import Engine
from kvtier.engine.request import RequestMetrics, RequestOutput
from kvtier.offload import throttled
from kvtier.offload.throttled import ThrottledStore
from kvtier.offload.tier import Tier

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

BS = 4
NEW = 5
#: 41 tokens: 10 full blocks a tier can serve (the last token is always computed).
PROMPT = seeded_prompt(23, 41)
TIER_TOKENS = 40
PER_TOKEN_S = 5e-3
#: One block on the medium: header and the tiny model's K and V (2 layers, 2 heads of 16).
BLOB_BYTES = 2 * 2 * 2 * 16 * BS * 4 + 64
#: Loading the 10 blocks takes as long as the taught compute of 40 tokens (0.2 s).
BANDWIDTH = 10 * BLOB_BYTES / (TIER_TOKENS * PER_TOKEN_S)


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer()


@pytest.fixture(scope="module")
def greedy(model_tok: tuple[Any, Any]) -> list[int]:
    """The model's own greedy tokens: a forward pass per token, and transformers' generate."""
    import torch

    tokens = solo_greedy(model_tok[0], PROMPT, NEW)
    with torch.no_grad():
        out = model_tok[0].generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=NEW,
            do_sample=False,
        )
    # generate stops at an end-of-sequence token, the engine's requests ignore it.
    generated = out[0, len(PROMPT) :].tolist()
    assert generated == tokens[: len(generated)] and len(generated) >= NEW - 1
    return tokens


def engine(model_tok: tuple[Any, Any], name: str) -> Engine:
    model, tok = model_tok
    medium = ThrottledStore(name, bytes_per_s=BANDWIDTH, pace_writes=False)
    tier = Tier(medium, 64, write_mode="write_through")
    e = Engine(model, tok, model_id="tiny", block_size=BS, num_blocks=64, tiers=[tier])
    costs = CostModel(decay=1.0)
    for _ in range(100):
        for n in (16, 64, 256):
            costs.observe_pass([(0, n)], PER_TOKEN_S * n)
    e.connector.costs = costs
    return e


def settle(e: Engine) -> None:
    assert e.tier_chain is not None
    e.tier_chain.flush()
    e.manager.reset_prefix_cache()
    e.tier_chain.flush()


def prepare(e: Engine, greedy: list[int]) -> None:
    """Compute the prompt once (stored through), then load it whole once (the tier learns)."""
    for _ in range(2):
        outs = list(e.generate(PROMPT, greedy_ignoring_eos(NEW)))
        assert [t for o in outs for t in o.token_ids] == greedy
        settle(e)


def backward_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvtier-backward-load" and t.is_alive()]


def loaded_run_start(e: Engine) -> int:
    """Where the running request's loaded run starts, in tier blocks (10: nothing yet)."""
    got = e.connector.loaded_run(e.queues.running[0])
    assert got is not None
    return got


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the backward load made no progress"
        time.sleep(0.005)


def finish(e: Engine, rid: str) -> tuple[list[int], RequestMetrics]:
    tokens: list[int] = []
    last: RequestOutput | None = None
    while e.has_unfinished():
        for o in e.step():
            if o.request_id == rid:
                tokens.extend(o.token_ids)
                last = o
    assert last is not None and last.finished
    return tokens, last.metrics


def test_matched_tier_loads_from_the_end_while_computing_from_the_start(
    model_tok: tuple[Any, Any], greedy: list[int]
) -> None:
    e = engine(model_tok, "overlap-meet")
    try:
        prepare(e, greedy)
        rid = e.add_request(PROMPT, greedy_ignoring_eos(NEW))
        e.step()  # admitted: the first chunk computed, the load started from the end
        assert e.connector.overlapping(e.queues.running[0])
        assert e.connector.costs.overlaps == 1
        # Let the load read two groups from the end before the compute goes on.
        wait_for(lambda: loaded_run_start(e) <= 6)
        tokens, m = finish(e, rid)
        assert tokens == greedy
        assert 0 < m.loaded_tokens < TIER_TOKENS
        assert m.tier_tokens == {"throttled": m.loaded_tokens}
        assert m.cached_tokens == m.loaded_tokens
        assert m.computed_tokens == len(PROMPT) - m.loaded_tokens
        assert m.computed_tokens > 1  # part of the prefix was computed, not only the last token
        assert m.recomputed_tier_tokens == TIER_TOKENS - m.loaded_tokens
        assert m.plan_estimate_s is not None and m.recompute_estimate_s is not None
        assert m.plan_estimate_s < m.recompute_estimate_s
        wait_for(lambda: not backward_threads())
        e.poll_background()
        assert e.connector.backward_loads == 0
    finally:
        e.close()
    assert not backward_threads()


def test_the_plan_is_logged_and_a_slow_tier_is_not_overlapped(
    model_tok: tuple[Any, Any], greedy: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    e = engine(model_tok, "overlap-log")
    try:
        prepare(e, greedy)
        with caplog.at_level(logging.DEBUG, logger="kvtier.engine.connector"):
            tokens, _ = finish(e, e.add_request(PROMPT, greedy_ignoring_eos(NEW)))
        assert tokens == greedy
        text = [r.getMessage() for r in caplog.records]
        assert any("loaded from the end while computed from the start" in t for t in text)
        assert any("load and compute met at token" in t for t in text)
        settle(e)
        # The same tier 20 times slower: computing is far cheaper, so it is recomputed.
        e.connector.costs.loads._fits.clear()
        e.connector.costs.observe_load("throttled", 10 * BLOB_BYTES, 4.0)
        tokens, m = finish(e, e.add_request(PROMPT, greedy_ignoring_eos(NEW)))
        assert tokens == greedy and m.loaded_tokens == 0
        assert e.connector.costs.overlaps == 1
    finally:
        e.close()


def test_an_abort_mid_load_leaves_no_thread_and_no_blocks(
    model_tok: tuple[Any, Any], greedy: list[int]
) -> None:
    e = engine(model_tok, "overlap-abort")
    try:
        prepare(e, greedy)
        free = e.manager.num_free
        tier = e.tier_chain.tiers[0]  # type: ignore[union-attr]
        rid = e.add_request(PROMPT, greedy_ignoring_eos(NEW))
        e.step()
        assert e.connector.overlapping(e.queues.running[0])
        assert backward_threads()
        e.cancel(rid)
        outs = e.step()
        assert [o.finish_reason for o in outs if o.request_id == rid] == ["abort"]
        assert not backward_threads()
        assert e.connector.backward_loads == 0
        assert e.manager.num_free == free
        tier.offload_manager.check()
        # No pins left on the tier: every block can be removed.
        keys = list(e.manager.match(PROMPT).keys[: TIER_TOKENS // BS])
        assert all(tier.offload_manager.is_ready(k) for k in keys)
        assert tier.offload_manager.remove(keys) == keys  # a pinned key would stay
    finally:
        e.close()
    assert not backward_threads()


def test_a_corrupt_block_mid_load_is_computed_instead(
    model_tok: tuple[Any, Any], greedy: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    e = engine(model_tok, "overlap-corrupt")
    try:
        prepare(e, greedy)
        chain = e.tier_chain
        assert chain is not None
        keys = list(e.manager.match(PROMPT).keys[: TIER_TOKENS // BS])
        # Block 8's payload gets a flipped bit: its checksum no longer matches.
        shelf = throttled._SHELVES["overlap-corrupt"]
        blob = bytearray(shelf[(chain.namespace, keys[8])])
        blob[-1] ^= 0x01
        shelf[(chain.namespace, keys[8])] = bytes(blob)
        corrupt = chain.tiers[0].counters.corrupt_blocks
        rid = e.add_request(PROMPT, greedy_ignoring_eos(NEW))
        with caplog.at_level(logging.DEBUG, logger="kvtier.engine.connector"):
            e.step()
            wait_for(lambda: loaded_run_start(e) <= 6)
            tokens, m = finish(e, rid)
        assert tokens == greedy
        met = [r.args for r in caplog.records if "load and compute met" in r.msg]
        assert len(met) == 1
        _, at, loaded, _ = met[0]  # type: ignore[misc]
        # The compute met the loaded run at block 6 at the latest; block 8 failed its check,
        # so only the blocks before it were installed, and 8 and 9 were computed.
        assert at <= 6 * BS
        assert loaded == m.loaded_tokens == 8 * BS - at > 0
        assert m.computed_tokens == len(PROMPT) - loaded
        assert chain.tiers[0].counters.corrupt_blocks == corrupt + 1
        # Dropped from the tier, then stored again (write-through) once it was computed.
        chain.flush()
        assert shelf[(chain.namespace, keys[8])] != bytes(blob)
    finally:
        e.close()
    assert not backward_threads()


def test_the_cost_model_overlaps_only_where_load_and_compute_are_close() -> None:
    costs = CostModel(decay=1.0)
    for n in (16, 64, 256):
        costs.observe_pass([(0, n)], 0.01 + PER_TOKEN_S * n)
    blob = 1000
    for name, per_block in (("matched", 10 * PER_TOKEN_S), ("slow", 40 * PER_TOKEN_S)):
        for blocks in (2, 5, 10):
            costs.observe_load(name, blocks * blob, 0.002 + blocks * per_block)
    args = {"cached_tokens": 0, "prompt_tokens": 161, "block_size": 10, "block_bytes": blob}
    matched = costs.overlap(tier="matched", tier_blocks=16, **args)
    assert matched is not None
    assert 0.5 < matched.load_s / matched.compute_s < 2.0
    sequential = costs.plan(tier_plan=["matched"] * 16, **args)
    assert sequential.estimate_s is not None
    assert matched.estimate_s < 0.8 * sequential.estimate_s
    assert 0 < matched.meet_blocks < 16
    # Four times slower to load than to compute: the plan computes, nothing overlaps.
    assert costs.overlap(tier="slow", tier_blocks=16, **args) is None
    assert costs.overlap(tier="slow", tier_blocks=16, max_ratio=2 * OVERLAP_RATIO, **args)
    assert costs.overlap(tier="unknown", tier_blocks=16, **args) is None


def test_closing_the_engine_mid_load_stops_the_thread(
    model_tok: tuple[Any, Any], greedy: list[int]
) -> None:
    e = engine(model_tok, "overlap-close")
    try:
        prepare(e, greedy)
        e.add_request(PROMPT, greedy_ignoring_eos(NEW))
        e.step()
        assert e.connector.overlapping(e.queues.running[0]) and backward_threads()
    finally:
        e.close()
    assert not backward_threads()
    assert e.connector.backward_loads == 0


def test_a_preempted_request_stops_its_load_and_still_answers_right(
    model_tok: tuple[Any, Any], greedy: list[int]
) -> None:
    e = engine(model_tok, "overlap-preempt")
    try:
        prepare(e, greedy)
        tier = e.tier_chain.tiers[0]  # type: ignore[union-attr]
        rid = e.add_request(PROMPT, greedy_ignoring_eos(NEW))
        e.step()
        seq = e.queues.running[0]
        assert e.connector.overlapping(seq) and backward_threads()
        e.scheduler.preempt(seq, [])  # as when a running request needs its blocks
        assert not backward_threads() and e.connector.backward_loads == 0
        tier.offload_manager.check()
        tokens, m = finish(e, rid)
        assert tokens == greedy
        assert m.preemptions == 1
    finally:
        e.close()
    assert not backward_threads()
