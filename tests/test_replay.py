"""Trace replay: loading, capacities, both simulation models and Belady's MIN.

The small traces here are worked through by hand (the comments show the cache
after each request), so the expected counters are independent of the code.
"""

from __future__ import annotations

import gzip
import json
import random
from collections import OrderedDict
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvtier import BadRequestError, ConfigError, KVCacheManager, KvTierError
from kvtier.policy import available_policies
from kvtier.replay import (
    Trace,
    belady_min,
    load_sample_trace,
    load_trace,
    parse_capacity,
    simulate,
    simulate_block,
    simulate_min,
    simulate_prefix,
    simulator,
)
from kvtier.replay.progress import ProgressBar, want_progress
from kvtier.replay.report import format_table, run_replay, to_json
from kvtier.replay.simulator import access_sequence


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mooncake(ids: list[int], n: int) -> dict[str, Any]:
    return {"timestamp": 0, "input_length": n, "output_length": 1, "hash_ids": ids}


# Five Mooncake requests (512-token blocks). Ids after the prompt's full
# blocks (10..14) cover partial blocks.
HAND = [
    mooncake([1, 2, 10], 1100),
    mooncake([1, 3, 11], 1100),
    mooncake([1, 2, 12], 1100),
    mooncake([4, 5, 6, 13], 1600),
    mooncake([1, 3, 14], 1100),
    mooncake([1, 3], 1024),  # exactly two full blocks: the last is never a prefix hit
]


@pytest.fixture
def hand(tmp_path: Path) -> Trace:
    return load_trace(write_jsonl(tmp_path / "hand.jsonl", HAND))


# -- trace loading --------------------------------------------------------------


def test_mooncake_trace_loads(hand: Trace) -> None:
    assert hand.format == "mooncake" and hand.block_size == 512
    assert len(hand.requests) == 6
    assert hand.requests[0].keys == [1, 2, 10]
    assert hand.requests[0].full_keys(512) == [1, 2]
    assert hand.requests[5].full_keys(512) == [1, 3]
    assert hand.unique_blocks == 11
    assert hand.prompt_tokens == 4 * 1100 + 1600 + 1024


def test_token_trace_keys_match_the_manager(tmp_path: Path) -> None:
    from kvtier import KVCacheManager

    rows = [{"tokens": list(range(10))}, {"tokens": [*range(8), 7, 7], "timestamp": 1.5}]
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", rows), block_size=4)
    assert trace.format == "tokens" and trace.block_size == 4
    m = KVCacheManager(8, 4)
    assert trace.requests[0].keys == m.hasher.chain(list(range(10)))
    assert trace.requests[0].keys == trace.requests[1].keys  # same two full blocks
    assert trace.requests[1].timestamp == 1.5
    assert load_trace(tmp_path / "t.jsonl").block_size == 16  # the token-level default


def test_gz_blank_lines_and_limit(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("\n" + json.dumps(HAND[0]) + "\n\n" + json.dumps(HAND[1]) + "\n")
    assert len(load_trace(path).requests) == 2
    assert len(load_trace(path, limit=1).requests) == 1


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        ([json.dumps(HAND[0]), "{not json"], r"bad\.jsonl:2: not valid JSON"),
        ([json.dumps(HAND[0]), "", json.dumps({"tokens": [1]})], r":3: Mooncake line needs"),
        ([json.dumps({"tokens": [1, 2]}), json.dumps(HAND[0])], r":2: token-level line needs"),
        ([json.dumps(mooncake([1, 2], 5000))], r":1: input_length 5000 needs 10 blocks"),
        ([json.dumps(mooncake([1, -2], 600))], r":1: 'hash_ids' must hold non-negative"),
        ([json.dumps(mooncake([], 0))], r":1: 'hash_ids' is empty"),
        ([json.dumps({"hash_ids": [1], "input_length": "9"})], r":1: 'input_length' must be"),
        ([json.dumps({"tokens": []})], r":1: 'tokens' is empty"),
        ([json.dumps({"tokens": [1, -1]})], r":1: 'tokens' must hold integer token ids"),
        ([json.dumps({"prompt": "hi"})], r":1: unknown trace format"),
        (["[1, 2]"], r":1: not a JSONL trace"),
        (["TIMESTAMP,ContextTokens,GeneratedTokens", "x,1,2"], r":1: not a JSONL trace.*CSV"),
        ([json.dumps(HAND[0]), "[1]"], r":2: expected a JSON object"),
    ],
)
def test_malformed_lines_name_the_line(tmp_path: Path, lines: list[str], match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadRequestError, match=match):
        load_trace(path)


def test_missing_empty_and_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="directory"):
        load_trace(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no requests"):
        load_trace(tmp_path / "empty.jsonl")
    write_jsonl(tmp_path / "ok.jsonl", HAND)
    with pytest.raises(ConfigError, match="block size"):
        load_trace(tmp_path / "ok.jsonl", block_size=0)
    with pytest.raises(ConfigError, match="limit"):
        load_trace(tmp_path / "ok.jsonl", limit=0)
    (tmp_path / "bin.jsonl").write_bytes(b"{\xff\xfe}\n")
    with pytest.raises(KvTierError, match="UTF-8"):
        load_trace(tmp_path / "bin.jsonl")


def test_bundled_sample_loads() -> None:
    trace = load_sample_trace()
    assert trace.format == "mooncake" and 300 <= len(trace.requests) <= 1000
    assert trace.unique_blocks > 1000


# -- capacities -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "blocks"),
    [
        ("2048", 2048), ("2k", 2048), ("1M", 1024**2), ("65536t", 128), ("64kt", 128),
        ("64KT", 128), ("1Mt", 2048), ("5%", 50), ("0.5%", 5), ("0.01%", 1), ("200%", 2000),
        (" 7 ", 7), ("1.5k", 1536), ("1000t", 1),
    ],
)
def test_capacity_parsing(text: str, blocks: int) -> None:
    assert parse_capacity(text).blocks(block_size=512, unique_blocks=1000) == blocks


@pytest.mark.parametrize("text", ["", "abc", "0", "-5", "5%%", "1.5", "0%", "5x", "t", "%", "1e3"])
def test_bad_capacities_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        parse_capacity(text)


def test_token_capacity_below_one_block() -> None:
    with pytest.raises(ConfigError, match="less than one block"):
        parse_capacity("100t").blocks(block_size=512, unique_blocks=10)


# -- the block model ----------------------------------------------------------------


def test_block_model_lru_by_hand(hand: Trace) -> None:
    # LRU over 4 blocks, every id accessed (oldest first after each request):
    # r0 1 2 10 miss            -> 1 2 10
    # r1 1 hit, 3 miss, 11 miss (evict 2)            -> 10 1 3 11
    # r2 1 hit, 2 miss (evict 10), 12 miss (evict 3) -> 11 1 2 12
    # r3 4 5 6 13 miss (evict 11 1 2 12)             -> 4 5 6 13
    # r4 1 3 14 miss (evict 4 5 6)                   -> 13 1 3 14
    # r5 1 hit, 3 hit                                -> 13 14 1 3
    r = simulate_block(hand, "lru", 4)
    assert (r.block_accesses, r.block_hits, r.evictions) == (18, 4, 10)
    assert (r.prefix_blocks, r.prefix_hit_blocks) == (18, 4)
    assert (r.prompt_tokens, r.cached_tokens) == (7024, 512 + 512 + 1024)
    assert r.block_hit_ratio == pytest.approx(4 / 18)
    assert r.token_hit_ratio == pytest.approx(2048 / 7024)
    assert r.ops_per_s > 0 and r.skipped_requests == 0


def test_block_model_counts_hits_after_a_miss(tmp_path: Path) -> None:
    # The block model ignores chains: block 2 hits although block 3 before it missed.
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", [mooncake([1, 2], 1024),
                                                         mooncake([3, 2], 1024)]))
    r = simulate_block(trace, "lru", 4)
    assert (r.block_hits, r.prefix_hit_blocks, r.cached_tokens) == (1, 0, 0)


def test_block_lru_matches_a_reference_lru() -> None:
    trace = load_sample_trace(limit=200)
    keys, _, _ = access_sequence(trace, "block")
    cap = 300
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            if len(cache) >= cap:
                cache.popitem(last=False)
            cache[k] = None
    assert simulate_block(trace, "lru", cap).block_hits == hits


# -- the prefix model (a real KVCacheManager) ------------------------------------------


def test_prefix_model_lru_by_hand(hand: Trace) -> None:
    # A KVCacheManager with 4 blocks; only full blocks are cached, a request's
    # partial tail goes back to the free list, release is tail first.
    # r0 [1,2]: no hit; 3 blocks; cached 1 2, evictable order 2 1, 2 empty
    # r1 [1,3]: 1 hit (512 tokens); 2 new from the empty ones; order 2 3 1, 1 empty
    # r2 [1,2]: 2 hits (1024 tokens); 1 new; order 3 2 1, 1 empty
    # r3 [4,5,6]: no hit; 4 new: 1 empty + evict 3 2 1 (3 evictions); order 6 5 4
    # r4 [1,3]: no hit; 3 new: 1 empty + evict 6 5; order 4 3 1, 1 empty
    # r5 [1,3] with 1024 tokens: both cached (2 block hits) but the last token
    #    is never reported cached, so the prefix hit is 1 block (512 tokens)
    r = simulate_prefix(hand, "lru", 4)
    assert (r.block_accesses, r.block_hits, r.evictions) == (11 + 2, 3 + 2, 5)
    assert (r.prefix_blocks, r.prefix_hit_blocks) == (13, 1 + 2 + 1)
    assert (r.prompt_tokens, r.cached_tokens) == (7024, 512 + 1024 + 512)
    assert r.prefix_hit_ratio == pytest.approx(4 / 13)
    assert r.block_hit_ratio == pytest.approx(5 / 13)
    assert r.extra["duplicate_blocks"] == 1  # r5's second block was already cached
    assert r.policy == "lru" and r.model == "prefix"


def test_prefix_model_window_keeps_requests_live(tmp_path: Path) -> None:
    rows = [mooncake([1, 2, 10], 1100), mooncake([3, 4, 11], 1100),
            mooncake([5, 6, 12], 1100), mooncake([1, 7, 13], 1100)]
    trace = load_trace(write_jsonl(tmp_path / "w.jsonl", rows))
    # Window 1, 6 blocks: r2 evicts only key 2 (LRU), so r3 finds key 1.
    one = simulate_prefix(trace, "lru", 6, window=1)
    assert (one.block_hits, one.evictions) == (1, 2)
    # Window 2: r1 is still live (pinned) while r2 allocates, so r2 must evict
    # both of r0's blocks, and r3 finds nothing.
    two = simulate_prefix(trace, "lru", 6, window=2)
    assert (two.block_hits, two.evictions) == (0, 4)
    # Window 3 would need 9 blocks: the oldest live request is freed to make room.
    three = simulate_prefix(trace, "lru", 6, window=3)
    assert three.skipped_requests == 0


def test_prefix_model_skips_requests_larger_than_the_cache(hand: Trace) -> None:
    r = simulate_prefix(hand, "lru", 3)  # r3 needs 4 blocks
    assert r.skipped_requests == 1
    assert r.block_accesses == 13, "a skipped request's blocks still count, as misses"


def test_output_tokens_are_cached_like_generated_blocks(tmp_path: Path) -> None:
    # r0's output completes block 2; r1's prompt holds that output and finds it.
    rows = [
        {"tokens": [1, 2, 3, 4, 5, 6], "output_tokens": [7, 8, 9, 10]},
        {"tokens": [1, 2, 3, 4, 5, 6, 7, 8, 50]},
    ]
    trace = load_trace(write_jsonl(tmp_path / "o.jsonl", rows), block_size=4)
    assert len(trace.requests[0].output_keys) == 1
    assert trace.requests[0].output_keys[0] == trace.requests[1].keys[1]
    p = simulate_prefix(trace, "lru", 8)
    assert (p.block_accesses, p.block_hits, p.cached_tokens) == (3, 2, 8)
    b = simulate_block(trace, "lru", 8)
    assert (b.block_accesses, b.block_hits, b.cached_tokens) == (3, 2, 8)
    m = simulate_min(trace, 8, "prefix")
    assert (m.block_accesses, m.block_hits) == (3, 2)


def test_simulate_rejects_bad_arguments(hand: Trace) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        simulate(hand, "lru", 0)
    with pytest.raises(ConfigError, match="window"):
        simulate(hand, "lru", 4, "block", window=2)
    with pytest.raises(ConfigError, match="window"):
        simulate(hand, "lru", 4, "prefix", window=0)
    with pytest.raises(ConfigError, match="model"):
        simulate(hand, "lru", 4, "tiered")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="policy"):
        simulate(hand, "no-such-policy", 4)


# -- Belady's MIN --------------------------------------------------------------------


def test_min_by_hand() -> None:
    # 1 2 3 1 2 3 with room for 2: keep 1 and 2, bypass 3 (needed last): 2 hits.
    r = belady_min([1, 2, 3, 1, 2, 3], 2)
    assert (r.num_hits, r.evictions, r.bypasses) == (2, 0, 2)
    assert list(r.hits) == [0, 0, 0, 1, 1, 0]
    # 1 2 3 2 3 1: 3 is needed before 1, so 1 is evicted for it.
    r = belady_min([1, 2, 3, 2, 3, 1], 2)
    assert (r.num_hits, r.evictions) == (2, 1)
    # Room for everything: every reuse hits.
    assert belady_min([5, 6, 5, 6, 7, 5], 3).num_hits == 3
    # A write (reads[i] = 0) brings a key in for free but never counts.
    r = belady_min([9, 9, 8, 9], 1, reads=[0, 1, 1, 1])
    assert (r.num_hits, r.num_reads) == (2, 3)
    with pytest.raises(ConfigError):
        belady_min([1], 0)


def _brute_force_opt(keys: list[int], reads: list[int], cap: int) -> int:
    """Most read hits any cache of ``cap`` keys can get (may bypass; evicts on demand)."""

    @cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(keys):
            return 0
        k = keys[i]
        if k in cache:
            return reads[i] + best(i + 1, cache)
        options = [best(i + 1, cache)]  # bypass
        if len(cache) < cap:
            options.append(best(i + 1, cache | {k}))
        else:
            options.extend(best(i + 1, (cache - {v}) | {k}) for v in cache)
        return max(options)

    return best(0, frozenset())


def test_min_is_optimal_on_random_small_sequences() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 11)
        keys = [rng.randint(0, 4) for _ in range(n)]
        reads = [1 if rng.random() < 0.8 else 0 for _ in range(n)]
        cap = rng.randint(1, 3)
        assert belady_min(keys, cap, reads).num_hits == _brute_force_opt(keys, reads, cap), (
            keys, reads, cap,
        )


def test_min_bounds_lru_by_hand(hand: Trace) -> None:
    best = simulate_min(hand, 4, "block")
    assert best.block_hits >= simulate_block(hand, "lru", 4).block_hits
    # Ids (reads): 1 2 10 | 1 3 11 | 1 2 12 | 4 5 6 13 | 1 3 14 | 1 3. Reused: 1
    # (4 more times), 2 (once) and 3 (twice); 4 blocks hold all three: 7 hits.
    assert best.block_hits == 7
    assert best.prefix_hit_blocks == 1 + 2 + 0 + 2 + 2


# -- every registered policy ----------------------------------------------------------


@pytest.fixture(scope="module")
def sample() -> Trace:
    return load_sample_trace(limit=300)


@pytest.mark.parametrize("policy", available_policies())
@pytest.mark.parametrize("model", ["block", "prefix"])
def test_every_policy_replays_below_min(sample: Trace, policy: str, model: str) -> None:
    cap = max(250, round(0.02 * sample.unique_blocks))  # fits the largest request
    r = simulate(sample, policy, cap, model)  # type: ignore[arg-type]
    best = simulate_min(sample, cap, model)  # type: ignore[arg-type]
    assert r.block_accesses == best.block_accesses > 0
    assert r.skipped_requests == 0
    assert 0.0 <= r.block_hit_ratio <= best.block_hit_ratio + 1e-12
    assert 0.0 <= r.token_hit_ratio <= 1.0 and 0.0 <= r.prefix_hit_ratio <= 1.0


class _CheckedManager(KVCacheManager):
    """The real manager, running its full invariant check after every call that changes it."""

    instances: ClassVar[list[_CheckedManager]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks = 0
        _CheckedManager.instances.append(self)

    def _checked(self) -> None:
        self.check()
        self.checks += 1

    def allocate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().allocate(*args, **kwargs)
        finally:
            self._checked()  # after a failed allocation too: it must change nothing

    def extend(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().extend(*args, **kwargs)
        finally:
            self._checked()

    def free(self, *args: Any, **kwargs: Any) -> None:
        super().free(*args, **kwargs)
        self._checked()


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_keeps_the_manager_consistent(
    sample: Trace, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(simulator, "KVCacheManager", _CheckedManager)
    _CheckedManager.instances.clear()
    # Window 4 pins several requests at once and makes allocations fail and retry.
    r = simulate_prefix(sample, policy, 300, window=4)
    (manager,) = _CheckedManager.instances
    assert manager.checks >= 2 * len(sample.requests), "every allocate and free was checked"
    assert manager.stats().allocation_failures > 0, "the window must make allocations fail"
    assert len(manager) == 0 and manager.pool.num_used == 0
    best = simulate_min(sample, 300, "prefix")
    assert r.requests == len(sample.requests)
    assert 0 < r.block_hits <= best.block_hits


# -- the report ----------------------------------------------------------------------


def test_run_replay_table_and_json(hand: Trace) -> None:
    caps = [parse_capacity(c) for c in ("4", "50%", "4")]  # repeats are dropped
    report = run_replay(hand, ["lru"], caps, model="block")
    assert [p.blocks for p in report.capacities] == [4, 6]
    data = to_json(report)
    json.dumps(data)  # plain data
    row = data["results"][0]
    assert row["policy"] == "lru" and row["capacity_blocks"] == 4
    assert row["block_hit_ratio"] == pytest.approx(4 / 18, abs=1e-6)
    assert row["min_block_hit_ratio"] == pytest.approx(7 / 18, abs=1e-6)
    assert row["gap_to_min_points"] == pytest.approx(100 * 3 / 18, abs=1e-3)
    assert data["min"][0]["policy"] == "MIN"
    table = format_table(report)
    assert "MIN*" in table and "lru" in table and "16.67" in table  # the gap


def test_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    import io

    stream = io.StringIO()
    bar = ProgressBar(10, enabled=True, stream=stream, min_interval=0.0)
    bar.set_label("lru @ 5")
    for _ in range(10):
        bar.advance(1)
    bar.close()
    out = stream.getvalue()
    assert "lru @ 5" in out and "100%" in out and out.endswith("\n")
    quiet = io.StringIO()
    off = ProgressBar(10, enabled=False, stream=quiet)
    off.advance(5)
    off.close()
    assert quiet.getvalue() == ""
    assert want_progress(True) and not want_progress(False)
    assert not want_progress(None, io.StringIO())  # not a terminal


def test_grid_runs_every_policy_at_every_capacity_and_min_once_each() -> None:
    trace = load_sample_trace(limit=50)
    caps = [parse_capacity(c) for c in ("1%", "5%")]
    report = run_replay(trace, ["lru", "LRU"], caps, model="prefix")
    assert len(report.results) == 4 and len(report.mins) == 2
    assert list(report.cells) == [
        (name, p.blocks) for p in report.capacities for name in ("lru", "LRU")
    ]
