"""The agent-sessions benchmark's workload (bench/agent_sessions.py), without a server.

Every configuration must replay the same seeded arrivals, pauses and texts;
hints differ only in what they say: exact TTLs are the coming pause plus the
margin, wrong ones are off by the configured factor either way, and the last
turn of a session ends it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from bench_scripts import load_bench

ab = load_bench("agent_sessions")
WORDS = [f" w{i}" for i in range(2000)]


def _workload(**changes: object) -> Any:
    fields: dict[str, Any] = {"sessions": 7, "turns": 4, "system_words": 40, "task_words": 8}
    return ab.make_workload(WORDS, ab.WorkloadSpec(**{**fields, **changes}))


def _count_words(messages: list[dict[str, str]]) -> int:
    """Stands in for the tokenizer: a word is a token, a message costs 4 more."""
    return sum(len(m["content"].split()) + 4 for m in messages) + 3


def test_same_seed_same_workload_in_every_configuration() -> None:
    a, b = _workload(), _workload()
    assert a == b
    assert [p.start_s for p in a.sessions] == sorted(p.start_s for p in a.sessions)
    assert [p.kind for p in a.sessions] == ["coder", "researcher", "planner"] * 2 + ["coder"]
    assert len(set(a.systems.values())) == 3
    replies = ["reply one", "reply two", "reply three"]
    for plan in a.sessions:
        assert len(plan.pauses) == len(plan.results) == 3
        # What a configuration sends differs in its hints only.
        for turn in range(4):
            msgs = ab.turn_messages(a, plan, turn, replies)
            assert msgs == ab.turn_messages(b, b.sessions[plan.index], turn, replies)
            assert len(msgs) == 2 + 2 * turn
            assert msgs[0]["content"] == a.systems[plan.kind]
    other = _workload(seed=1)
    assert [p.pauses for p in other.sessions] != [p.pauses for p in a.sessions]
    assert [p.task for p in other.sessions] != [p.task for p in a.sessions]


def test_changing_one_draw_leaves_the_others() -> None:
    """Each draw has its own stream: longer tool results keep the same pauses and arrivals."""
    a, b = _workload(), _workload(result_words=(100, 200))
    assert [p.pauses for p in a.sessions] == [p.pauses for p in b.sessions]
    assert [p.start_s for p in a.sessions] == [p.start_s for p in b.sessions]
    assert [p.results for p in a.sessions] != [p.results for p in b.sessions]


def test_pauses_follow_each_kinds_median_and_cap() -> None:
    wl = ab.make_workload(
        WORDS,
        ab.WorkloadSpec(sessions=60, turns=6, pause_medians=(1.0, 5.0), max_pause=3.0, seed=3),
    )
    by_kind: dict[str, list[float]] = {}
    for plan in wl.sessions:
        by_kind.setdefault(plan.kind, []).extend(plan.pauses)
    coder, researcher = sorted(by_kind["coder"]), sorted(by_kind["researcher"])
    assert max(coder) <= 3.0 and max(researcher) <= 15.0
    assert 0.7 < coder[len(coder) // 2] < 1.4
    assert 3.5 < researcher[len(researcher) // 2] < 7.0


def test_exact_and_wrong_ttls() -> None:
    wl = _workload(sessions=40)
    shorter = longer = 0
    for plan in wl.sessions:
        for pause, exact, wrong in zip(plan.pauses, plan.ttl_exact, plan.ttl_wrong, strict=True):
            assert exact == pytest.approx(1.2 * pause, abs=1e-3)
            ratio = wrong / exact
            if ratio < 1:
                shorter += 1
                assert 1 / 10 - 1e-3 <= ratio <= 1 / 2 + 1e-3
            else:
                longer += 1
                assert 2 - 1e-3 <= ratio <= 10 + 1e-3
    assert shorter > 20 and longer > 20


def test_hints_per_turn() -> None:
    wl = _workload()
    plan = wl.sessions[1]
    for turn in range(3):
        assert ab.hints_for(plan, turn, "none") is None
        exact = ab.hints_for(plan, turn, "exact")
        wrong = ab.hints_for(plan, turn, "wrong")
        assert exact == {
            "session_id": plan.session_id,
            "agent_id": "researcher",
            "cache_ttl_s": plan.ttl_exact[turn],
        }
        assert wrong == {**exact, "cache_ttl_s": plan.ttl_wrong[turn]}
    for mode in ("exact", "wrong"):
        last = ab.hints_for(plan, 3, mode)
        assert last == {
            "session_id": plan.session_id,
            "agent_id": "researcher",
            "session_end": True,
        }
    assert ab.hints_for(plan, 3, "none") is None
    # Every hint object is one kvtier accepts.
    from kvtier.hints import parse_hints

    for turn in range(4):
        assert parse_hints(ab.hints_for(plan, turn, "wrong")) is not None


def test_configs_cover_the_comparison() -> None:
    assert ab.CONFIGS["default"].policy is None and ab.CONFIGS["default"].hints == "none"
    assert (ab.CONFIGS["hints"].policy, ab.CONFIGS["hints"].hints) == ("workflow", "exact")
    assert (ab.CONFIGS["wrong-hints"].policy, ab.CONFIGS["wrong-hints"].hints) == (
        "workflow",
        "wrong",
    )
    assert ab.CONFIGS["learned-reuse"].hints == "none"
    args = ab.parse_args(["--quick", "--configs", "hints", "default"])
    assert args.configs == ["hints", "default"]
    assert (args.sessions, args.turns) == (3, 3)
    # Session prefetch is the hinted run plus its flag, and needs a tier to fetch from.
    prefetch = ab.CONFIGS["hints-prefetch"]
    assert (prefetch.policy, prefetch.hints) == ("workflow", "exact")
    args = ab.parse_args(["--configs", "hints", "hints-prefetch", "--tiers", "host"])
    sizing = ab.Sizing(num_blocks=10, host_blocks=20, disk_blocks=0, peak_live_blocks=12,
                       peak_at_s=1.0, largest_context_tokens=64)  # fmt: skip
    argv = ab.serve_argv(prefetch, sizing, args, Path("/tmp"))
    assert argv[argv.index("--prefetch-session-lead") + 1] == "1"
    assert "--tier" in argv and "--prefetch-session-lead" not in ab.serve_argv(
        ab.CONFIGS["hints"], sizing, args, Path("/tmp")
    )
    with pytest.raises(SystemExit):
        ab.parse_args(["--configs", "hints-prefetch"])


def test_cache_sizing() -> None:
    # One session of one kind: its live context is its last turn's prompt and reply.
    wl = ab.make_workload(
        WORDS, ab.WorkloadSpec(sessions=1, turns=2, kinds=("coder",), system_words=64, seed=0)
    )
    plan = wl.sessions[0]
    last = _count_words(ab.turn_messages(wl, plan, 1, [" ok" * 8])) + 8
    peak, at, largest = ab.peak_live_blocks(wl, _count_words, 8, 16)
    assert largest == last and peak == -(-last // 16) and at == ab.send_times(plan)[1]
    # Sessions live at once add up, their kind's system prompt counted once.
    spec = ab.WorkloadSpec(sessions=2, turns=1, kinds=("coder",), system_words=64, stagger_s=0.0)
    wl = ab.make_workload(WORDS, spec)
    system = _count_words([{"role": "system", "content": wl.systems["coder"]}]) // 16
    ctx = [-(-(_count_words(ab.turn_messages(wl, p, 0, [])) + 8) // 16) for p in wl.sessions]
    assert ab.peak_live_blocks(wl, _count_words, 8, 16)[0] == sum(ctx) - system
    # A session whose last request came before the next one starts is not live with it.
    wl = ab.make_workload(WORDS, ab.WorkloadSpec(**{**spec.__dict__, "stagger_s": 100.0}))
    assert ab.peak_live_blocks(wl, _count_words, 8, 16)[0] == max(ctx)
    wl = _workload(stagger_s=0.0)
    peak, _, largest = ab.peak_live_blocks(wl, _count_words, 8, 16)
    sizing = ab.size_cache(
        wl,
        _count_words,
        reply_tokens=8,
        block_size=16,
        device_fraction=0.5,
        num_blocks=None,
        host_fraction=0.5,
        disk_fraction=2.0,
    )
    assert sizing.peak_live_blocks == peak
    assert sizing.num_blocks == max(math.ceil(1.25 * -(-largest // 16)), -(-peak // 2))
    assert sizing.disk_blocks == 2 * peak
    fixed = ab.size_cache(
        wl,
        _count_words,
        reply_tokens=8,
        block_size=16,
        device_fraction=0.5,
        num_blocks=77,
        host_fraction=0.5,
        disk_fraction=2.0,
    )
    assert fixed.num_blocks == 77


def test_ratios_against_default() -> None:
    def row(key: str, p50: float, device: float, host: float) -> dict[str, Any]:
        shares = {"device": device, "host": host, "computed": 1.0 - device - host}
        return {"config": key, "policy": key, "requests": 9, "errors": 0, "ttft_p50_ms": p50,
                "ttft_p90_ms": 2 * p50, "later_shares": shares, "requests_per_s": 1.0}  # fmt: skip

    rows = [row("default", 400.0, 0.5, 0.1), row("hints", 300.0, 0.6, 0.1)]
    ab.add_ratios(rows)
    assert rows[1]["vs_default"]["ttft_p50_ratio"] == pytest.approx(0.75)
    assert rows[1]["vs_default"]["device_share_points"] == pytest.approx(10.0)
    assert rows[1]["vs_default"]["cached_share_points"] == pytest.approx(10.0)
    headers, table = ab.result_table(rows, ["host"])
    assert len(headers) == len(table[1])
    cells = dict(zip(headers, table[1], strict=True))
    assert cells["p50 vs default"] == "0.75x" and cells["device vs default"] == "+10.0 pts"
    assert cells["host"] == "10.0%" and cells["computed"] == "30.0%"


def test_rounds_rotate_and_combine_into_medians_with_the_spread() -> None:
    configs = ["default", "hints", "lru"]
    firsts = [ab.round_order(configs, r)[0] for r in range(4)]
    assert firsts == ["default", "hints", "lru", "default"]

    def row(key: str, p50: float, device: float) -> dict[str, Any]:
        return {"config": key, "policy": key, "requests": 10, "errors": 0,
                "error_samples": [], "ttft_p50_ms": p50, "ttft_p90_ms": 2 * p50,
                "first_turn_ttft_p50_ms": p50, "latency_p50_ms": p50, "requests_per_s": 1.0,
                "wall_s": 9.0, "later_turns": 8, "later_prompt_tokens": 100,
                "later_shares": {"device": device, "computed": 1.0 - device}}  # fmt: skip

    rounds = []
    for base, hinted, dev in ((400.0, 200.0, 0.2), (800.0, 600.0, 0.1), (500.0, 450.0, 0.3)):
        rows = [row("default", base, 0.5), row("hints", hinted, 0.5 + dev)]
        ab.add_ratios(rows)
        rounds.append(rows)
    assert ab.combine_rounds(rounds[:1]) == rounds[0]
    combined = ab.combine_rounds(rounds)
    hints = combined[1]
    assert hints["config"] == "hints" and hints["ttft_p50_ms"] == 450.0
    assert hints["requests"] == 30 and len(hints["rounds"]) == 3
    # Each round's ratio first (0.5, 0.75, 0.9), then their median and range.
    assert hints["vs_default"]["ttft_p50_ratio"] == pytest.approx(0.75)
    assert hints["ratio_ranges"]["ttft_p50_ratio"] == pytest.approx([0.5, 0.9])
    assert hints["vs_default"]["device_share_points"] == pytest.approx(20.0)
    assert hints["later_shares"]["device"] == pytest.approx(0.7)
    headers, table = ab.result_table(combined, [])
    cells = dict(zip(headers, table[1], strict=True))
    assert cells["p50 vs default, range"] == "0.50-0.90x"
    assert cells["device vs default, range"] == "+10.0 to +30.0"
