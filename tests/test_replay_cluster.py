"""Multi-engine replay: routing rules, local and shared tiers, load, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import ConfigError
from kvtier.cli import main
from kvtier.replay import load_sample_trace, load_trace, simulate_prefix
from kvtier.replay.cluster import ClusterConfig, ClusterReplay, simulate_cluster
from kvtier.replay.cluster_report import cluster_to_json, format_cluster_table
from kvtier.replay.traces import Trace, TraceRequest


def mooncake(ids: list[int], n: int, ts: int = 0, out: int = 1) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}


def write(path: Path, rows: list[dict[str, Any]]) -> Trace:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_trace(path)


@pytest.fixture(scope="module")
def sample() -> Trace:
    return load_sample_trace(limit=300)


def test_one_engine_without_tiers_is_the_one_engine_replay(sample: Trace) -> None:
    single = simulate_prefix(sample, "lru", 300)
    cluster = simulate_cluster(sample, ClusterConfig(1, 300))
    total = cluster.total()
    assert total.cached_tokens == single.cached_tokens
    assert total.hit_blocks == single.prefix_hit_blocks
    assert total.prompt_tokens == single.prompt_tokens
    assert cluster.load_imbalance == 1.0


def test_round_robin_spreads_requests_evenly(sample: Trace) -> None:
    r = simulate_cluster(sample, ClusterConfig(4, 300, route="round-robin"))
    assert [e.requests for e in r.engines] == [75, 75, 75, 75]


def test_a_repeated_conversation_sticks_to_its_engine(tmp_path: Path) -> None:
    # Three conversations, each turn extending the previous one, interleaved.
    rows = []
    for turn in range(1, 6):
        for conv in range(3):
            ids = [100 * conv + k for k in range(turn + 1)]
            rows.append(mooncake(ids, 512 * (turn + 1) - 10, ts=turn * 1000 + conv))
    trace = write(tmp_path / "conv.jsonl", rows)
    replay = ClusterReplay(trace, ClusterConfig(3, 64, route="prefix", service_rate=1e9))
    homes: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
    for rid, req in enumerate(trace.requests):
        j = replay.route(req)
        replay.engines[j].last_routed = rid
        replay._serve(rid, req, replay.engines[j])
        homes[req.keys[0] // 100].add(j)
    # Idle engines (an infinite service rate): each conversation keeps one home.
    assert all(len(h) == 1 for h in homes.values())
    assert len(set().union(*homes.values())) == 3
    total = sum((e.result.hit_blocks for e in replay.engines), 0)
    # Turn t hits its t - 1 earlier full blocks... except the first turn's.
    assert total == 3 * sum(range(1, 5))


def test_the_load_cap_sends_traffic_away_from_a_busy_prefix_holder(tmp_path: Path) -> None:
    # Every request shares one long prefix and they all arrive at once: caring
    # only for the prefix would queue everything on one engine.
    rows = [mooncake([1, 2, 3, 4, 1000 + i], 2100, ts=0, out=200) for i in range(40)]
    trace = write(tmp_path / "hot.jsonl", rows)
    tight = simulate_cluster(trace, ClusterConfig(4, 64, route="prefix", load_cap=1.0))
    loose = simulate_cluster(trace, ClusterConfig(4, 64, route="prefix", load_cap=1e9))
    assert all(e.requests > 0 for e in tight.engines)
    assert tight.load_imbalance < 1.5
    assert [e.requests for e in loose.engines].count(0) == 3
    assert loose.load_imbalance == pytest.approx(4.0)
    # The tight cap pays for balance with hits: each engine computes the prefix once.
    assert loose.token_hit_ratio > tight.token_hit_ratio


def test_least_loaded_balances_work(sample: Trace) -> None:
    least = simulate_cluster(sample, ClusterConfig(4, 300, route="least-loaded"))
    assert least.load_imbalance < 1.1
    assert sum(e.requests for e in least.engines) == len(sample.requests)


def _conversations(n_conv: int, turns: int) -> Trace:
    """``n_conv`` chats of ``turns`` turns, interleaved; each turn extends the one before."""
    reqs = []
    for t in range(1, turns + 1):
        for c in range(n_conv):
            ids = [1000 * c + k for k in range(t + 1)]
            reqs.append(TraceRequest(512 * len(ids) - 3, ids, float(len(reqs)), 10))
    return Trace("chats", "mooncake", 512, reqs)


def _unbounded_hits(trace: Trace) -> int:
    """Prefix hits with caches that never evict, worked out without kvtier."""
    seen: set[int] = set()
    hits = 0
    for req in trace.requests:
        keys = req.full_keys(512)[: (req.input_length - 1) // 512]
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits += n
        seen.update(req.full_keys(512))
    return hits


def test_a_shared_tier_makes_hits_independent_of_routing() -> None:
    # 15 chats over 4 engines: round-robin sends each turn of a chat to another engine.
    trace = _conversations(15, 6)
    expected = _unbounded_hits(trace)
    # A shared tier that holds everything: every route gets every reuse.
    for route in ("round-robin", "least-loaded", "prefix"):
        r = simulate_cluster(trace, ClusterConfig(4, 8, shared_blocks=500, route=route))  # type: ignore[arg-type]
        t = r.total()
        assert t.hit_blocks == expected, route
        assert t.host_hit_blocks == 0
        assert r.shared_bytes_fetched == t.shared_hit_blocks * 512 * r.config.bytes_per_token
        # Written through once each: every distinct full block, partial last blocks never.
        assert r.shared_stored_blocks == len({k for q in trace.requests for k in q.full_keys(512)})
    # Local tiers of the same total size, round-robin: a turn rarely finds its chat.
    local = simulate_cluster(trace, ClusterConfig(4, 8, host_blocks=125, route="round-robin"))
    assert local.total().shared_hit_blocks == 0
    assert local.total().hit_blocks < expected / 2
    # Prefix routing brings the locality back.
    sticky = simulate_cluster(trace, ClusterConfig(4, 8, host_blocks=125, route="prefix"))
    assert sticky.total().hit_blocks > 2 * local.total().hit_blocks


def test_host_tier_receives_device_evictions(tmp_path: Path) -> None:
    # A then B then A on one engine whose device holds one request: A's blocks
    # come back from the host tier.
    rows = [
        mooncake([1, 2, 3, 9], 2000),
        mooncake([4, 5, 6, 8], 2000),
        mooncake([1, 2, 3, 7], 2000),
    ]
    trace = write(tmp_path / "aba.jsonl", rows)
    r = simulate_cluster(trace, ClusterConfig(1, 4, host_blocks=8))
    t = r.total()
    assert t.device_hit_blocks == 0 and t.host_hit_blocks == 3
    bare = simulate_cluster(trace, ClusterConfig(1, 4))
    assert bare.total().hit_blocks == 0


def test_requests_larger_than_a_device_are_skipped_and_counted(tmp_path: Path) -> None:
    trace = write(tmp_path / "big.jsonl", [mooncake(list(range(10)), 5000)])
    r = simulate_cluster(trace, ClusterConfig(2, 4))
    assert r.total().skipped_requests == 1 and r.total().hit_blocks == 0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ClusterConfig(0, 10), "--engines"),
        (ClusterConfig(2, 0), "capacity"),
        (ClusterConfig(2, 10, host_blocks=-1), "host tier"),
        (ClusterConfig(2, 10, route="random"), "unknown route"),  # type: ignore[arg-type]
        (ClusterConfig(2, 10, load_cap=0.5), "--load-cap"),
        (ClusterConfig(2, 10, service_rate=0.0), "--service-rate"),
    ],
)
def test_bad_configurations(sample: Trace, config: ClusterConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        simulate_cluster(sample, config)


def _trace(convs: list[list[int]]) -> Trace:
    reqs = [
        TraceRequest(512 * len(ids) - 3, ids, timestamp=float(i * 100), output_length=5)
        for i, ids in enumerate(convs)
    ]
    return Trace("gen", "mooncake", 512, reqs)


chains = st.lists(
    st.integers(0, 3).flatmap(
        lambda root: st.lists(st.integers(0, 4), min_size=1, max_size=6).map(
            lambda tail: [root * 1000 + 10 * i + t for i, t in enumerate(tail)]
        )
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(
    convs=chains,
    engines=st.integers(1, 4),
    device=st.integers(6, 12),
    host=st.integers(0, 10),
    shared=st.integers(0, 60),
    route=st.sampled_from(["round-robin", "least-loaded", "prefix"]),
    cap=st.floats(1.0, 4.0),
)
def test_counters_add_up_on_any_trace(
    convs: list[list[int]],
    engines: int,
    device: int,
    host: int,
    shared: int,
    route: str,
    cap: float,
) -> None:
    trace = _trace(convs)
    config = ClusterConfig(engines, device, host, shared, route, load_cap=cap)  # type: ignore[arg-type]
    replay = ClusterReplay(trace, config)
    r = replay.run()
    t = r.total()
    assert t.requests == len(trace.requests)
    assert t.prompt_tokens == trace.prompt_tokens
    for e in r.engines:
        assert e.hit_blocks <= e.prompt_blocks
        assert e.cached_tokens == e.hit_blocks * 512 <= e.prompt_tokens
    assert (t.host_hit_blocks == 0) if not host else True
    assert (t.shared_hit_blocks == 0) if not shared else True
    for e in replay.engines:
        e.manager.check()
        assert len(e.manager) == 0
        if e.host is not None:
            e.host.check()
    if replay.shared is not None:
        replay.shared.check()
        assert len(replay.shared) <= shared
    # A shared tier that never evicts: every block computed before hits, on any engine.
    if shared >= len({k for q in trace.requests for k in q.full_keys(512)}):
        assert t.hit_blocks == _unbounded_hits(trace)


def test_table_and_json(sample: Trace) -> None:
    results = [
        simulate_cluster(sample, ClusterConfig(2, 300, shared_blocks=900, route="prefix")),
        simulate_cluster(sample, ClusterConfig(2, 300, host_blocks=450, route="round-robin")),
    ]
    table = format_cluster_table(sample, results)
    assert "engine 0:" in table and "engine 1:" in table and "shared GiB" in table
    data = cluster_to_json(sample, results)
    assert data["model"] == "cluster" and len(data["results"]) == 2
    row = data["results"][0]
    assert row["config"]["route"] == "prefix" and len(row["engines"]) == 2
    assert row["shared_bytes_fetched"] == results[0].shared_bytes_fetched
    assert sum(e["requests"] for e in row["engines"]) == 300


def test_cli_engines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.json"
    argv = [
        "replay",
        "--limit",
        "200",
        "--engines",
        "3",
        "--route",
        "round-robin",
        "prefix",
        "-c",
        "300",
        "--shared-tier",
        "5%",
        "--json-out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "round-robin" in table and "prefix" in table and "engine 2:" in table
    data = json.loads(out.read_text())
    assert [r["config"]["route"] for r in data["results"]] == ["round-robin", "prefix"]
    assert all(r["config"]["shared_blocks"] == round(0.05 * 13712) for r in data["results"]) or (
        data["trace"]["unique_blocks"] != 13712
    )
    assert all(r["shared_hit_blocks"] > 0 for r in data["results"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engines", "2", "--model", "block"], "prefix model only"),
        (["--engines", "2", "-p", "lru", "arc"], "one policy"),
        (["--engines", "2", "--route", "random"], "unknown --route"),
        (["--engines", "0"], "--engines"),
    ],
)
def test_cli_engine_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--limit", "20", *argv]) == 1
    assert message in capsys.readouterr().err
