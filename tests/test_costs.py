"""The cost model: fits, the load-or-recompute plan, and what it learns from a medium that sleeps.

The fits are checked on exact observations (what a tier or a pass would
report if it had no noise): the model must give back the costs they were
made from. The plan is checked at both extremes and in the middle. Then a
real tier chain over a throttled medium (every call sleeps, like a store
behind a slow link) and a host tier teach the model through the chain's
own load reports, and the model must rank them the way they are.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import KVCacheManager
from kvtier.costs import CostModel, LoadCosts, PrefillCosts
from kvtier.errors import BadRequestError, ConfigError, KvTierError
from kvtier.layout import KVLayout
from kvtier.offload.chain import TierChain
from kvtier.offload.config import TierSpec
from kvtier.offload.host import HostStore
from kvtier.offload.registry import make_medium
from kvtier.offload.throttled import ThrottledStore
from kvtier.offload.tier import Tier
from kvtier.storage import KVBlockStorage


def test_load_costs_separate_latency_from_bandwidth() -> None:
    costs = LoadCosts()
    # 20 ms per call and 5 MB/s, at three batch sizes.
    for nbytes in (100_000, 1_000_000, 3_000_000) * 4:
        costs.observe("slow", nbytes, 0.020 + nbytes / 5e6)
    est = costs.estimate("slow")
    assert est is not None
    assert est.latency_s == pytest.approx(0.020, rel=1e-6)
    assert est.bandwidth_bytes_s == pytest.approx(5e6, rel=1e-6)
    assert est.seconds(2_000_000) == pytest.approx(0.420, rel=1e-6)
    assert costs.estimate("never-loaded") is None


def test_one_load_size_is_all_bandwidth() -> None:
    costs = LoadCosts()
    for _ in range(3):
        costs.observe("t", 1_000_000, 0.5)
    est = costs.estimate("t")
    assert est is not None and est.latency_s == 0.0
    assert est.bandwidth_bytes_s == pytest.approx(2e6)


def test_prefill_costs_recover_overhead_token_and_attention_terms() -> None:
    pre = PrefillCosts()
    overhead, per_token, per_pair = 0.004, 2e-4, 3e-8
    for chunks in ([(0, 100)], [(0, 400)], [(512, 256), (9, 1)], [(1000, 1000)], [(30, 64)]):
        tokens = sum(n for _, n in chunks)
        pairs = sum(n * (c + n / 2) for c, n in chunks)
        pre.observe(chunks, overhead + per_token * tokens + per_pair * pairs)
    est = pre.estimate()
    assert est is not None
    assert est.overhead_s == pytest.approx(overhead, rel=1e-6)
    assert est.per_token_s == pytest.approx(per_token, rel=1e-6)
    assert est.per_pair_s == pytest.approx(per_pair, rel=1e-6)
    # One more token costs more deeper in the context.
    assert est.per_token_at(4096) > est.per_token_at(128)
    assert est.seconds(100, 300) == pytest.approx(
        overhead + per_token * 200 + per_pair * 200 * 200, rel=1e-6
    )


def test_the_fits_never_say_more_work_costs_less() -> None:
    costs = LoadCosts()
    # Bigger loads that came back faster (a cold start, then a warm cache): no negative slope.
    costs.observe("t", 1_000_000, 0.3)
    costs.observe("t", 4_000_000, 0.1)
    est = costs.estimate("t")
    assert est is not None and est.latency_s >= 0.0 and est.bandwidth_bytes_s > 0.0


def learned(per_token_s: float, tiers: dict[str, tuple[float, float]]) -> CostModel:
    """A model taught by exact observations: prefill at ``per_token_s`` a token (no attention
    term), and per tier ``(latency s, bytes/s)``."""
    model = CostModel()
    for n in (64, 256, 1024):
        model.observe_pass([(0, n)], 0.001 + per_token_s * n)
    for name, (latency, bandwidth) in tiers.items():
        for nbytes in (10_000, 100_000, 1_000_000):
            model.observe_load(name, nbytes, latency + nbytes / bandwidth)
    return model


BLOCK_BYTES = 10_000


def plan_for(model: CostModel, tier_plan: list[str], cached: int = 0, prompt: int = 1000) -> int:
    return model.plan(
        cached_tokens=cached,
        prompt_tokens=prompt,
        block_size=16,
        tier_plan=tier_plan,
        block_bytes=BLOCK_BYTES,
    ).load_blocks


def test_plan_loads_everything_from_a_fast_tier() -> None:
    model = learned(1e-3, {"host": (1e-5, 10e9)})
    plan = model.plan(
        cached_tokens=16, prompt_tokens=1000, block_size=16, tier_plan=["host"] * 50,
        block_bytes=BLOCK_BYTES,
    )  # fmt: skip
    assert plan.load_blocks == 50 and plan.learned
    assert plan.estimate_s is not None and plan.recompute_s is not None
    assert plan.estimate_s < plan.recompute_s
    assert model.plans == {"load_all": 1, "load_part": 0, "recompute": 0}


def test_plan_recomputes_what_a_slow_tier_holds() -> None:
    # 20 ms per call and 3 MB/s: a 10 kB block takes 3.3 ms, computing its 16 tokens 1.6 ms.
    model = learned(1e-4, {"remote": (0.020, 3e6)})
    assert plan_for(model, ["remote"] * 50) == 0
    assert model.plans["recompute"] == 1


def test_plan_loads_the_fast_beginning_and_computes_the_slow_rest() -> None:
    model = learned(1e-4, {"host": (1e-5, 10e9), "remote": (0.020, 3e6)})
    assert plan_for(model, ["host"] * 20 + ["remote"] * 30) == 20
    assert model.plans["load_part"] == 1


def test_plan_with_nothing_learned_loads_everything() -> None:
    model = CostModel()
    plan = model.plan(
        cached_tokens=0, prompt_tokens=100, block_size=16, tier_plan=["x"] * 3, block_bytes=1
    )
    assert plan.load_blocks == 3 and not plan.learned


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cached_tokens": -1, "prompt_tokens": 100},
        {"cached_tokens": 100, "prompt_tokens": 100},
        {"cached_tokens": 0, "prompt_tokens": 48},  # 3 tier blocks reach the last token
        {"cached_tokens": 0, "prompt_tokens": 100, "block_bytes": [1, 2]},
    ],
)
def test_a_plan_of_impossible_numbers_is_refused(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"block_size": 16, "tier_plan": ["x"] * 3, "block_bytes": 1}
    args.update(kwargs)
    with pytest.raises(BadRequestError):
        CostModel().plan(**args)  # type: ignore[arg-type]
    with pytest.raises(KvTierError):
        CostModel(decay=0.0)


def test_stats_are_plain_data() -> None:
    model = learned(1e-4, {"host": (1e-5, 10e9)})
    s = model.stats()
    tiers = s["tiers"]
    assert isinstance(tiers, dict) and set(tiers) == {"host"}
    prefill = s["prefill"]
    assert isinstance(prefill, dict)
    assert set(prefill["per_token_s_at_context"]) >= {"128", "4096"}


# -- a medium that sleeps -----------------------------------------------------------------

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")


def test_a_throttled_tier_url_builds_a_sleeping_medium() -> None:
    spec = TierSpec.from_url("throttled:slow?latency_ms=20&mb_s=3&size=1MiB")
    medium = make_medium("throttled", "slow", {"latency_ms": "20", "mb_s": "3"})
    assert isinstance(medium, ThrottledStore)
    assert medium.latency_s == pytest.approx(0.020) and medium.bytes_per_s == pytest.approx(3e6)
    assert spec.medium == "throttled"
    for bad in ({"latency_ms": "-1"}, {"mb_s": "fast"}, {"speed": "1"}):
        with pytest.raises(ConfigError):
            make_medium("throttled", "slow", bad)


def test_the_chain_teaches_the_model_each_tier_and_the_plan_ranks_them() -> None:
    n = 12
    storage = KVBlockStorage(LAYOUT, 2 * n)
    storage.tensor[:n].normal_(generator=torch.Generator().manual_seed(0))
    mgr = KVCacheManager(2 * n, LAYOUT.block_size)
    slow = Tier(ThrottledStore("costs-test", latency_s=0.05, bytes_per_s=2e6), 4 * n)
    host = Tier(HostStore(), 4 * n)
    chain = TierChain(storage, mgr, [host, slow], write_mode="write_through")
    model = CostModel()
    chain.on_load = lambda tier, blocks, nbytes, seconds: model.observe_load(tier, nbytes, seconds)
    try:
        for size in (2, 5, 9):  # loads of several sizes from each tier
            keys = [k + 1000 * size for k in range(size)]
            chain.store_blocks(1, keys, list(range(size)))
            chain.flush()
            assert chain.load(keys, list(range(n, n + size))) == size  # all from the slow tier
            chain.store_blocks(0, keys, list(range(size)))
            assert chain.load(keys, list(range(n, n + size))) == size  # now from host memory
            assert torch.equal(storage.tensor[n : n + size], storage.tensor[:size])
    finally:
        chain.close()
    slow_est, host_est = model.loads.estimate("throttled"), model.loads.estimate("host")
    assert slow_est is not None and host_est is not None
    assert slow_est.loads == 3 and host_est.loads == 3
    fmt = slow.fmt
    assert fmt is not None
    # The sleeping tier is the dearer one, per call and per block.
    assert slow_est.seconds(fmt.blob_size) > host_est.seconds(fmt.blob_size)
    assert slow_est.latency_s > host_est.latency_s
    # Computing a block costs half of what loading the twenty slow ones costs a block, and
    # far more than a host copy: load the host blocks, compute the rest.
    per_block = slow_est.seconds(20 * fmt.blob_size) / 20 / 2
    per_token = per_block / LAYOUT.block_size
    for c in (16, 64, 256):
        model.observe_pass([(0, c)], per_token * c)
    plan = model.plan(
        cached_tokens=0, prompt_tokens=200, block_size=LAYOUT.block_size,
        tier_plan=["host"] * 5 + ["throttled"] * 20, block_bytes=fmt.blob_size,
    )  # fmt: skip
    assert plan.load_blocks == 5
    assert plan.estimate_s is not None and plan.recompute_s is not None
    assert plan.load_all_s is not None
    assert plan.estimate_s < min(plan.recompute_s, plan.load_all_s)
