"""Agent workloads through the replay: trace hints, the goals' figures, robustness to bad hints."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import BadRequestError, ConfigError
from kvtier.agents import workloads as W
from kvtier.replay.bounds import cyclic_prefix_bound, max_window_hits
from kvtier.replay.simulator import simulate, simulate_min
from kvtier.replay.traces import SAMPLE_TRACE, load_trace

HINTS = ("workflow_id", "agent_id", "step", "session_id", "cache_ttl_s", "reuse")
SAMPLE = Path(__file__).resolve().parent.parent / "src" / "kvtier" / "data" / SAMPLE_TRACE


def _trace(lines: list[dict[str, Any]], tmp_path: Path, name: str, bs: int = W.BLOCK_SIZE) -> Any:
    return load_trace(W.write_trace(lines, tmp_path / f"{name}.jsonl"), block_size=bs)


def test_the_cyclic_loop_hits_like_min_and_lru_never_hits(tmp_path: Path) -> None:
    # 10 agents x 512-token prompts, room for 6 prompts.
    tr = _trace(W.cyclic_workflow(10, 512, rounds=8), tmp_path, "cyclic")
    cap = 6 * 512 // W.BLOCK_SIZE
    wf = simulate(tr, "workflow", cap, "block")
    assert wf.block_hits == simulate_min(tr, cap, "block").block_hits > 0
    assert simulate(tr, "lru", cap, "block").block_hits == 0
    assert simulate(tr, "lru", cap, "prefix").cached_tokens == 0


def test_trace_hints_and_workflows_are_read_and_checked(tmp_path: Path) -> None:
    lines = W.synthetic_workflows(workflows=2, runs=1)
    tr = _trace(lines, tmp_path, "synth")
    assert len(tr.workflows) == 2 and all(r.hints for r in tr.requests)
    assert tr.requests[0].hints is not None and "agent_id" in tr.requests[0].hints
    bad = [lines[0], {**lines[-1], "reuse": "sometimes"}]
    with pytest.raises(BadRequestError, match=r"bad\.jsonl:2: .*reuse"):
        _trace(bad, tmp_path, "bad")
    with pytest.raises(BadRequestError, match=r"bad2\.jsonl:1: .*waits for .zz."):
        _trace([{"workflow": {"workflow_id": "w", "agents": [{"agent_id": "a", "after": "zz"}]}}],
               tmp_path, "bad2")  # fmt: skip


def test_sessions_are_inferred_from_shared_prefixes() -> None:
    chains = [[1, 2], [1, 2, 3], [1, 9], [1, 2, 3, 4]]
    lines = W.mooncake_sessions([{"hash_ids": c} for c in chains])
    sessions = [line["session_id"] for line in lines]
    assert sessions[0] == sessions[1] == sessions[3] != sessions[2]


def _scramble(lines: list[dict[str, Any]], mode: str, seed: int = 0) -> list[dict[str, Any]]:
    """Random hints, or each request's hints taken from a request 50 places earlier."""
    rng = random.Random(seed)
    agents = [
        (w["workflow"]["workflow_id"], a["agent_id"])
        for w in lines
        if "workflow" in w
        for a in w["workflow"]["agents"]
    ]
    reqs = [line for line in lines if "hash_ids" in line]
    out = [line for line in lines if "workflow" in line]
    for i, line in enumerate(reqs):
        base = {k: v for k, v in line.items() if k not in HINTS}
        hints: dict[str, Any] = {}
        if mode == "random":
            if agents and rng.random() < 0.7:
                hints.update(zip(("workflow_id", "agent_id"), rng.choice(agents), strict=True))
            if rng.random() < 0.5:
                hints["session_id"] = f"r{rng.randrange(50)}"
            if rng.random() < 0.3:
                hints["reuse"] = rng.choice(["likely", "unlikely", "never"])
            if rng.random() < 0.3:
                hints["cache_ttl_s"] = rng.uniform(0, 60)
        else:
            hints = {k: v for k, v in reqs[max(0, i - 50)].items() if k in HINTS and k != "step"}
        out.append({**base, **hints})
    return out


@pytest.mark.parametrize("mode", ["random", "stale"])
@pytest.mark.parametrize("workload", ["mooncake", "tools"])
def test_wrong_hints_keep_nine_tenths_of_the_fallbacks_hit_ratio(
    tmp_path: Path, mode: str, workload: str
) -> None:
    if workload == "mooncake":
        with SAMPLE.open() as fh:
            lines = W.mooncake_sessions(json.loads(line) for line in fh if line.strip())
        bs = 512
    else:
        lines = W.tool_sessions(sessions=60, arrival_s=0.5)
        bs = W.BLOCK_SIZE
    tr = _trace(_scramble(lines, mode), tmp_path, f"{workload}-{mode}", bs)
    for frac in (0.05, 0.2, 0.5):
        cap = max(1, int(tr.unique_blocks * frac))
        for model in ("prefix", "block"):
            lru = simulate(tr, "lru", cap, model).token_hit_ratio
            wf = simulate(tr, "workflow", cap, model).token_hit_ratio
            assert wf >= 0.9 * lru, (frac, model, wf, lru)


def test_the_generator_writes_traces_the_replay_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tools.jsonl"
    assert W.main(["tools", str(out), "-n", "5"]) == 0
    assert "kvtier replay" in capsys.readouterr().out
    tr = load_trace(out, block_size=W.BLOCK_SIZE)
    assert tr.requests and all(r.hints and "session_id" in r.hints for r in tr.requests)
    assert W.main(["mooncake", str(tmp_path / "m.jsonl")]) == 1
    assert "--trace" in capsys.readouterr().err


@pytest.mark.parametrize("seed", [5, 6])
def test_ttl_hints_close_half_the_gap_to_min_on_tool_sessions(tmp_path: Path, seed: int) -> None:
    lines = W.tool_sessions(
        100, arrival_s=1.0, tool_latency_median_s=10.0, system_tokens=800,
        tool_result_tokens=(50, 400), seed=seed,
    )  # fmt: skip
    tr = _trace(lines, tmp_path, f"tools-{seed}", W.BLOCK_SIZE)
    lru = simulate(tr, "lru", 600, "prefix").token_hit_ratio
    wf = simulate(tr, "workflow", 600, "prefix").token_hit_ratio
    best = simulate_min(tr, 600, "prefix").token_hit_ratio
    assert wf - lru >= 0.5 * (best - lru), (wf, lru, best)


def _brute_window_hits(cycle: int, limits: list[int], room: list[int]) -> int:
    free = range(cycle, len(limits))
    best = 0
    for hs in itertools.product(*(range(max(0, limits[s]) + 1) for s in free)):
        h = dict(zip(free, hs, strict=True))
        if all(
            sum(h.get(s, 0) for s in range(t + 1, min(t + cycle, len(limits)))) <= max(r, 0)
            for t, r in enumerate(room)
        ):
            best = max(best, sum(hs))
    return best


@settings(max_examples=150, deadline=None)
@given(
    cycle=st.integers(1, 4),
    rows=st.lists(st.tuples(st.integers(-1, 3), st.integers(-2, 6)), min_size=1, max_size=8),
)
def test_the_greedy_window_packing_is_the_optimum(cycle: int, rows: list[tuple[int, int]]) -> None:
    limits, room = [list(x) for x in zip(*rows, strict=True)]
    assert max_window_hits(cycle, limits, room) == _brute_window_hits(cycle, limits, room)


def test_no_policy_beats_the_cyclic_bound_and_the_workflow_policy_reaches_it(
    tmp_path: Path,
) -> None:
    lines = W.cyclic_workflow(6, 256, rounds=5, suffix_tokens=32, answer_tokens=(8, 40), seed=3)
    tr = _trace(lines, tmp_path, "cyclic-bound")
    cap = 4 * 256 // W.BLOCK_SIZE
    bound = cyclic_prefix_bound(tr, cap)
    best = simulate_min(tr, cap, "prefix").token_hit_ratio
    assert 0 < bound < best  # holding each running request costs hits MIN never pays
    for policy in ("lru", "fifo", "arc", "learned-reuse", "workflow"):
        assert simulate(tr, policy, cap, "prefix").token_hit_ratio <= bound + 1e-12, policy
    assert simulate(tr, "workflow", cap, "prefix").token_hit_ratio == pytest.approx(bound)
    with pytest.raises(ConfigError, match="agent_id"):
        cyclic_prefix_bound(_trace(W.tool_sessions(3), tmp_path, "tools-bound"), cap)
