"""The hybrid-model replay benchmark's cache model (bench/hybrid_replay.py).

The byte figures are checked against Qwen3-Next's config by hand; the
replay runs on the first requests of the Mooncake sample bundled with kvtier
(and the conversation trace when it is present), and a stateful property
test drives the byte-accounted LRU of blocks and checkpoints through random
prefix-chained requests, checking its bookkeeping after every step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_scripts import load_bench
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.errors import ConfigError
from kvtier.replay import load_sample_trace

hr = load_bench("hybrid_replay")


@pytest.fixture(scope="module")
def memory() -> Any:
    return hr.qwen3_next_memory()


@pytest.fixture(scope="module")
def trace() -> Any:
    return load_sample_trace(limit=400)


def test_qwen3_next_byte_figures(memory: Any) -> None:
    assert memory.attention_layers == 12
    assert memory.linear_layers == 36
    # 12 layers x (K + V) x 2 KV heads x 256 x bf16.
    assert memory.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24_576
    # conv_dim = 2 x 16 x 128 + 32 x 128 = 8192, x kernel 4, bf16.
    assert memory.conv_state_bytes == 8192 * 4 * 2
    # 32 value heads x 128 x 128, float32.
    assert memory.recurrent_state_bytes == 32 * 128 * 128 * 4
    assert memory.checkpoint_bytes == 36 * (65_536 + 2_097_152) == 77_856_768
    assert memory.block_kv_bytes(512) == 12 * 1024**2


def test_infinite_memory_orders_the_strategies(trace: Any, memory: Any) -> None:
    inf = hr.Budget("inf", None)
    none, every, sparse, flop, slots = (hr.replay(trace, memory, s, inf) for s in hr.STRATEGIES)
    # Unlimited slots keep every block's checkpoint, as every_block does.
    assert slots.reused_blocks == every.reused_blocks
    assert none.reused_blocks == 0 and none.token_hit_ratio == 0.0
    # With nothing evicted, every cached prefix resumes under every_block: its
    # reuse is all the attention KV found, the same KV the others keep.
    assert every.reused_blocks == every.kv_found_blocks == none.kv_found_blocks > 0
    assert sparse.kv_found_blocks == every.kv_found_blocks
    assert 0 < sparse.reused_blocks <= every.reused_blocks
    assert none.sum_blocks == every.sum_blocks == sparse.sum_blocks
    assert every.block_evictions == sparse.block_evictions == 0
    assert sparse.mean_checkpoints < every.mean_checkpoints
    # Nothing is evicted, so the eviction rule cannot matter.
    assert flop.as_dict() | {"strategy": "sparse", "seconds": 0} == sparse.as_dict() | {
        "seconds": 0
    }
    assert 0 < every.saved_flops < every.prompt_flops
    for r in (none, every, sparse, flop, slots):
        assert r.requests == 400
        assert r.prompt_blocks == sum(len(q.full_keys(512)) for q in trace.requests)


@pytest.mark.parametrize("budget_text", ["20b", "300b", "3GiB"])
def test_bounded_budgets_keep_their_books(trace: Any, memory: Any, budget_text: str) -> None:
    kv_block = memory.block_kv_bytes(512)
    (budget,) = hr.parse_budgets(budget_text, kv_block)
    for strategy in hr.STRATEGIES:
        r = hr.replay(trace, memory, strategy, budget, check_every=1)
        assert r.peak_bytes <= budget.bytes
        for ratio in (r.token_hit_ratio, r.block_hit_ratio, r.kv_found_ratio):
            assert 0.0 <= ratio <= 1.0
        assert r.reused_blocks <= r.kv_found_blocks <= r.prompt_blocks
        assert 0.0 <= r.flop_hit_ratio <= 1.0
        assert r.stored_blocks + r.unstored_blocks <= r.prompt_blocks
        # LRU takes chains from the tail, so no block outlives its parent.
        assert r.cascade_drops == 0
        if strategy == "every_block":
            assert r.sum_checkpoints == r.sum_blocks
            per_block = kv_block + memory.checkpoint_bytes
            assert r.sum_bytes == r.sum_blocks * per_block
        else:
            assert r.sum_bytes == r.sum_blocks * kv_block + r.sum_checkpoints * (
                memory.checkpoint_bytes
            )
        if strategy == "none":
            assert r.reused_blocks == 0 and r.sum_checkpoints == 0


def test_flop_aware_eviction_with_alpha_zero_is_lru(trace: Any, memory: Any) -> None:
    (budget,) = hr.parse_budgets("400b", memory.block_kv_bytes(512))
    lru = hr.replay(trace, memory, "sparse", budget).as_dict()
    zero = hr.replay(trace, memory, "sparse_flop", budget, alpha=0.0, window=8).as_dict()
    assert zero | {"strategy": "sparse", "seconds": 0} == lru | {"seconds": 0}
    assert lru["checkpoint_evictions"] > 0
    weighted = hr.replay(trace, memory, "sparse_flop", budget, alpha=4.0, check_every=1)
    # Weighting FLOPs per byte changes what is evicted, still within budget.
    assert weighted.as_dict() != zero | {"strategy": "sparse_flop"}
    assert weighted.peak_bytes <= budget.bytes


def test_small_budget_favours_sparse_checkpoints(trace: Any, memory: Any) -> None:
    # 300 attention-only blocks hold fewer than 50 blocks with a checkpoint
    # each: the sparse strategy caches far more of the shared prefixes.
    (budget,) = hr.parse_budgets("300b", memory.block_kv_bytes(512))
    every = hr.replay(trace, memory, "every_block", budget)
    sparse = hr.replay(trace, memory, "sparse", budget)
    assert sparse.mean_blocks > 3 * every.mean_blocks
    assert sparse.bytes_per_cached_token < every.bytes_per_cached_token


def test_parse_budgets() -> None:
    got = hr.parse_budgets("8GiB, 512MiB,1000b,inf", 12 * 1024**2)
    assert [b.bytes for b in got] == [8 * 1024**3, 512 * 1024**2, 1000 * 12 * 1024**2, None]
    for bad in ("", "8GB", "-1GiB", "0b", "lots"):
        with pytest.raises(ConfigError):
            hr.parse_budgets(bad, 12 * 1024**2)
    with pytest.raises(ConfigError):
        hr.parse_strategies("every_block,marconi")
    assert hr.parse_strategies("sparse,none,sparse") == ["sparse", "none"]


def test_main_writes_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sample = tmp_path / "trace.jsonl"
    trace = load_sample_trace(limit=150)
    with sample.open("w", encoding="utf-8") as fh:
        for r in trace.requests:
            row = {"timestamp": r.timestamp, "input_length": r.input_length, "hash_ids": r.keys}
            fh.write(json.dumps(row) + "\n")
    out = tmp_path / "out.json"
    rc = hr.main(
        ["--trace", str(sample), "--limit", "100", "--budgets", "1GiB,inf", "--out", str(out)]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "74.25 MiB" in printed and "checkpoint where reuse is likely" in printed
    data = json.loads(out.read_text())
    assert data["trace_requests"] == 100
    assert data["memory"]["checkpoint_bytes"] == 77_856_768
    assert len(data["results"]) == 2 * len(hr.STRATEGIES)
    assert {r["strategy"] for r in data["results"]} == set(hr.STRATEGIES)
    assert hr.main(["--trace", str(sample), "--budgets", "8GB", "--out", str(out)]) == 2
    assert "cannot parse budget" in capsys.readouterr().err


def test_help_explains_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        hr.parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--limit", "--budgets", "--strategies", "--out", "--trace", "--progress"):
        assert option in text


# Prefix-chained requests over a small tree: a request is a path from the
# root, and a node's key is fixed by its path, as Mooncake's hash_ids are.
_paths = st.lists(st.integers(0, 2), min_size=1, max_size=6)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.node_keys: dict[tuple[int, ...], int] = {}
        self.cache: Any = None

    @initialize(
        strategy=st.sampled_from([s for s in hr.STRATEGIES if s != "slots"]),
        budget=st.one_of(st.none(), st.integers(1, 40)),
        ckpt=st.integers(1, 8),
        alpha=st.sampled_from([0.0, 0.5, 3.0]),
        window=st.integers(1, 6),
    )
    def setup(
        self, strategy: str, budget: int | None, ckpt: int, alpha: float, window: int
    ) -> None:
        stats = hr.RunStats(strategy, str(budget), budget, 4)
        self.cache = hr.HybridPrefixCache(
            strategy, budget, 1, ckpt, stats, alpha=alpha, window=window
        )

    def _keys(self, path: list[int]) -> list[int]:
        keys = []
        for depth in range(1, len(path) + 1):
            keys.append(self.node_keys.setdefault(tuple(path[:depth]), len(self.node_keys)))
        return keys

    @rule(path=_paths, last_partial=st.booleans())
    def serve(self, path: list[int], last_partial: bool) -> None:
        keys = self._keys(path)
        max_reuse = len(keys) if last_partial else len(keys) - 1
        cache = self.cache
        out = cache.serve(keys, max_reuse)
        assert 0 <= out.reused <= min(out.kv_found, max_reuse)
        assert out.kv_found <= out.stored <= len(keys)
        if cache.strategy == "none":
            assert out.reused == 0
        if cache.strategy == "every_block":
            assert out.reused == min(out.kv_found, max_reuse)
        cost = 1 + cache.checkpoint_bytes if cache.strategy == "every_block" else 1
        if cache.budget is None or cost * len(keys) + 2 * cache.checkpoint_bytes <= cache.budget:
            # Room for the whole request: it is all cached, and served again
            # it resumes as far as it may.
            assert out.stored == len(keys)
            again = cache.serve(keys, max_reuse)
            assert again.kv_found == len(keys)
            if cache.strategy == "every_block" or (
                cache.strategy in ("sparse", "sparse_flop") and max_reuse == len(keys)
            ):
                # Sparse keeps a checkpoint at the prompt's last full block,
                # not one block before it.
                assert again.reused == max_reuse

    @invariant()
    def books_balance(self) -> None:
        if self.cache is not None:
            self.cache.check()
            assert self.cache.stats.cascade_drops == 0


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


class SlotMachine(RuleBasedStateMachine):
    """kvtier's checkpoint slots (``slots``) over the same tree of prefix-chained requests."""

    def __init__(self) -> None:
        super().__init__()
        self.node_keys: dict[tuple[int, ...], int] = {}
        self.cache: Any = None

    @initialize(budget=st.one_of(st.none(), st.integers(4, 60)), ratio=st.sampled_from(
        [0.05, 0.25, 0.5, 1.0]))  # fmt: skip
    def setup(self, budget: int | None, ratio: float) -> None:
        stats = hr.RunStats("slots", str(budget), budget, 4)
        self.cache = hr.SlotCache(budget, 1, 4, ratio, stats)

    @rule(path=_paths, last_partial=st.booleans())
    def serve(self, path: list[int], last_partial: bool) -> None:
        keys = [
            self.node_keys.setdefault(tuple(path[:d]), len(self.node_keys))
            for d in range(1, len(path) + 1)
        ]
        max_reuse = len(keys) if last_partial else len(keys) - 1
        cache = self.cache
        out = cache.serve(keys, max_reuse)
        assert 0 <= out.reused <= min(out.kv_found, max_reuse)
        assert out.kv_found <= out.stored <= len(keys)
        # The checkpoint it resumed from (held), its prompt's end and the block after that.
        roomy = cache.num_slots is None or cache.num_slots >= 3
        if out.stored == len(keys) and max_reuse and roomy:
            # The prompt's end is a likely resume point: served again at once, it
            # resumes there (its checkpoint outlives the ones it passed).
            again = cache.serve(keys, max_reuse)
            assert again.reused == max_reuse

    @invariant()
    def books_balance(self) -> None:
        if self.cache is not None:
            self.cache.check()
            assert self.cache.budget is None or self.cache.used <= self.cache.budget
            assert self.cache.stats.cascade_drops == 0


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_slots_with_resume_points_beat_plain_lru_slots(trace: Any, memory: Any) -> None:
    """Reclaiming passed-over checkpoints first keeps the prompt ends and branch points."""
    (budget,) = hr.parse_budgets("10000b", memory.block_kv_bytes(512))
    slots = hr.replay(trace, memory, "slots", budget, check_every=50)
    plain = hr.replay(trace, memory, "slots", budget, resume_points=False)
    every = hr.replay(trace, memory, "every_block", budget)
    sparse = hr.replay(trace, memory, "sparse", budget)
    assert slots.reused_blocks > 2 * every.reused_blocks
    assert slots.reused_blocks > 2 * plain.reused_blocks
    assert slots.reused_blocks >= 0.9 * sparse.reused_blocks
