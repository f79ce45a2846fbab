"""Prefill time in the replay: the load-or-recompute rule with a given tier and model speed."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.replay.timing import CostSpec, PrefillClock
from kvtier.units import parse_rate, parse_seconds

BS = 16


def _clock(**kw: float) -> PrefillClock:
    spec = {"prefill_tokens_s": 1000.0, "block_bytes": 1_000_000, **kw}
    return PrefillClock(CostSpec(**spec))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(10.0, 1e6),
    pair=st.floats(0.0, 1e-5),
    bandwidth=st.floats(1e3, 1e12),
    latency=st.floats(0.0, 1.0),
    requests=st.lists(
        st.tuples(st.integers(1, 4000), st.integers(0, 4000), st.integers(0, 300)),
        min_size=1,
        max_size=20,
    ),
)
def test_the_plan_is_never_slower_than_loading_or_computing(
    rate: float,
    pair: float,
    bandwidth: float,
    latency: float,
    requests: list[tuple[int, int, int]],
) -> None:
    clock = PrefillClock(CostSpec(rate, pair, bandwidth, latency, 32 * 1024))
    added = 0
    for prompt, device, tier in requests:
        device = min(device, prompt - 1) // BS * BS
        tier = min(tier, (prompt - 1 - device) // BS)
        clock.add(prompt, device, tier, BS)
        added += 1
        slack = 1e-9 * max(1.0, clock.recompute_s, clock.load_all_s)
        assert clock.plan_s <= min(clock.recompute_s, clock.load_all_s) + slack
        assert clock.recompute_s <= clock.uncached_s + slack
    assert clock.requests == added
    assert 0 <= clock.loaded_blocks <= clock.tier_blocks
    assert clock.partial_plans + clock.recompute_plans <= added


def test_a_free_tier_is_always_loaded_and_a_crawling_one_never() -> None:
    free = _clock(tier_bytes_s=math.inf)
    crawl = _clock(tier_bytes_s=1e3, tier_latency_s=0.5)
    for clock in (free, crawl):
        clock.add(1000, 0, 40, BS)
        clock.add(1000, 320, 20, BS)
        clock.add(500, 480, 0, BS)  # a device hit only: the rules agree
    assert free.loaded_blocks == free.tier_blocks == 60
    assert free.plan_s == pytest.approx(free.load_all_s) and free.plan_s < free.recompute_s
    assert crawl.loaded_blocks == 0 and crawl.recompute_plans == 2
    assert crawl.plan_s == pytest.approx(crawl.recompute_s) and crawl.plan_s < crawl.load_all_s
    # Device hits are free under every rule; no cache at all computes every token.
    assert free.uncached_s == pytest.approx((1000 + 1000 + 500) / 1000.0)


def test_in_between_the_rule_loads_long_contexts_and_computes_short_ones() -> None:
    # Attention makes a token at position 8,000 dearer than one at 100, so the same tier
    # pays off for a long context's prefix and not for a short one's.
    clock = _clock(pair_s=1e-6, tier_bytes_s=16e6, tier_latency_s=0.02)
    clock.add(20 * BS + 1, 0, 20, BS)
    assert clock.loaded_blocks == 0 and clock.recompute_plans == 1
    clock.add(500 * BS + 1, 0, 500, BS)
    assert clock.loaded_blocks == 500
    assert clock.plan_s < min(clock.load_all_s, clock.recompute_s)


def test_bad_costs_and_requests_are_refused() -> None:
    with pytest.raises(ConfigError, match="--prefill-rate"):
        CostSpec(0.0)
    with pytest.raises(ConfigError, match="--tier-bandwidth"):
        CostSpec(100.0, tier_bytes_s=-1.0)
    with pytest.raises(ConfigError, match="--tier-latency"):
        CostSpec(100.0, tier_latency_s=math.nan)
    with pytest.raises(ConfigError, match="last token"):
        _clock().add(32, 32, 0, BS)


@pytest.mark.parametrize(
    ("text", "value"),
    [("3MB/s", 3e6), ("1.5GiB/s", 1.5 * 2**30), ("250e6", 250e6), ("10MBps", 1e7)],
)
def test_rates_parse_as_people_write_them(text: str, value: float) -> None:
    assert parse_rate(text) == pytest.approx(value)


@pytest.mark.parametrize(("text", "value"), [("0.02", 0.02), ("20ms", 0.02), ("150us", 1.5e-4)])
def test_latencies_parse_as_people_write_them(text: str, value: float) -> None:
    assert parse_seconds(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["fast", "3 parsecs", "-1ms"])
def test_unreadable_rates_and_latencies_say_what_to_write(text: str) -> None:
    with pytest.raises(ConfigError, match=r"e\.g\."):
        parse_rate(text) if text != "-1ms" else parse_seconds("soon")
    if text == "-1ms":
        with pytest.raises(ConfigError, match=">= 0"):
            parse_seconds(text)


def _replay_json(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, object]:
    argv = ["replay", "--json", "--no-progress", "-c", "1%", "--tier-blocks", "20000", *flags]
    assert main(argv) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


def test_the_replay_times_the_bundled_trace_under_each_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    slow = _replay_json(
        capsys, "--prefill-rate", "4000", "--tier-bandwidth", "3MB/s", "--tier-latency", "20ms"
    )
    fast = _replay_json(capsys, "--prefill-rate", "4000", "--tier-bandwidth", "100GB/s")
    times = []
    for data in (slow, fast):
        (row,) = data["results"]  # type: ignore[index]
        t = row["time"]
        assert t["tier_blocks"] == row["tier"]["hit_blocks"] > 0
        assert t["plan_s"] <= min(t["load_all_s"], t["recompute_s"]) + 1e-6
        assert t["recompute_s"] < t["uncached_s"]
        times.append(t)
    assert data["costs"]["block_bytes"] == 327680 * 512  # type: ignore[index]
    slow_t, fast_t = times
    # The same replay (the cache does not depend on the rule), timed two ways.
    assert slow_t["recompute_s"] == fast_t["recompute_s"]
    assert slow_t["loaded_blocks"] == 0 and slow_t["plan_s"] == slow_t["recompute_s"]
    assert fast_t["loaded_blocks"] == fast_t["tier_blocks"]
    assert fast_t["plan_s"] == fast_t["load_all_s"] < fast_t["recompute_s"]


def test_the_table_shows_the_rules_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--no-progress", "-c", "1%", "--tier-blocks", "20000", "--prefill-rate",
            "4000", "--tier-bandwidth", "1GB/s", "--bytes-per-token", "65536"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prefill time (tier 1.00GB/s" in out and "33.55MB a block" in out
    assert "plan/load" in out and "tier blocks loaded" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tier-bandwidth", "3MB/s"], "add --prefill-rate"),
        (["--prefill-rate", "100", "--tier-latency", "20ms"], "add --tier-blocks"),
        (["--prefill-rate", "100", "--tier-blocks", "5", "--tier-bandwidth", "fast"], "e.g."),
        (["--prefill-rate", "-3"], "--prefill-rate"),
        (["--prefill-rate", "100", "--model", "block"], "prefix model only"),
    ],
)
def test_timing_flags_that_do_not_fit_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["replay", "--limit", "20", *argv])
    except SystemExit as exc:  # argparse's own refusal of a value
        code = exc.code  # type: ignore[assignment]
    assert code in (1, 2)
    assert message in capsys.readouterr().err
