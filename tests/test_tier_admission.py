"""Tier admission: the policy's reuse predictions, the admission rules and the replay's tier.

The learned-reuse policy answers, without changing what it evicts, how
likely a block (resident or just evicted) is to be reused; the admission
rules decide, per batch of device evictions, which blocks a lower tier
writes, never a child whose parent in the same batch is skipped; the replay
hangs a tier under a real KVCacheManager and its counters add up.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier import ConfigError, KVCacheManager
from kvtier.offload.admission import (
    PredictedReuse,
    TierAdmission,
    WriteAll,
    make_admission,
)
from kvtier.policy import LearnedReusePolicy
from kvtier.replay import load_sample_trace, simulate_prefix
from kvtier.replay.tiers import ReplayTier


def _chains(seed: int, n: int, universe: int) -> list[list[int]]:
    """``n`` prefix chains over a small universe, so requests share and extend each other."""
    rng = random.Random(seed)
    roots = [[1000 * r + i for i in range(1, 9)] for r in range(universe)]
    out = []
    for _ in range(n):
        base = rng.choice(roots)
        out.append(base[: rng.randint(1, len(base))])
    return out


# -- the policy's predictions -------------------------------------------------------------------


def test_predictions_unknown_key_is_none() -> None:
    p = LearnedReusePolicy()
    p.bind(16)
    assert p.predicted_reuse(5) is None
    assert p.reuse_probability(5, 10.0) is None
    assert p.was_reused(5) is None


def test_predictions_answer_for_evicted_keys_and_grow_with_the_horizon() -> None:
    p = LearnedReusePolicy(refresh=1)
    p.bind(4)
    now = 0.0
    for chain in _chains(1, 200, 5):
        now += 1.0
        p.on_request(chain, 0, now)
        for k in chain:
            if k in p:
                p.access(k)
            else:
                while len(p) >= 4:
                    p.evict()
                p.insert(k)
    gone = [k for k in (1000 * r + i for r in range(5) for i in range(1, 9)) if k not in p]
    assert gone
    seen = 0
    for k in gone:
        v = p.predicted_reuse(k)
        if v is None:
            continue
        seen += 1
        assert v >= 0.0
        probs = [p.reuse_probability(k, h) for h in (0.0, 1.0, 10.0, 1e3, 1e6)]
        assert all(x is not None and 0.0 <= x <= 1.0 for x in probs)
        assert probs == sorted(probs)  # type: ignore[type-var]
        assert probs[0] == 0.0
        assert p.was_reused(k) in (True, False)
    assert seen


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000))
def test_asking_for_predictions_changes_no_eviction(seed: int) -> None:
    def run(ask: bool) -> list[int]:
        p = LearnedReusePolicy(refresh=2)
        p.bind(6)
        victims: list[int] = []
        now = 0.0
        for chain in _chains(seed, 60, 4):
            now += 0.7
            p.on_request(chain, 0, now)
            for k in chain:
                if ask:
                    p.predicted_reuse(k)
                    p.reuse_probability(k, 5.0)
                    p.was_reused(k)
                if k in p:
                    p.access(k)
                    continue
                while len(p) >= 6:
                    v = p.evict()
                    assert v is not None
                    victims.append(v)
                    if ask:
                        p.reuse_probability(v, 30.0)
                p.insert(k)
        return victims

    assert run(True) == run(False)


# -- the admission rules ------------------------------------------------------------------------


class TablePredictor:
    """A predictor that reads reuse probabilities from a table (keys not in it are unknown)."""

    def __init__(self, table: dict[int, float], reused: set[int]) -> None:
        self.table = table
        self.reused = reused

    def reuse_probability(self, key: int, horizon: float) -> float | None:
        return self.table.get(key)

    def was_reused(self, key: int) -> bool | None:
        return key in self.reused if key in self.table else None


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[int], list[int | None], list[int]]:
    """An eviction batch as the pool announces it: subtrees, children before parents."""
    n = draw(st.integers(1, 30))
    parent_idx = [draw(st.integers(-1, i - 1)) for i in range(n)]  # parents come first
    keys = [100 + i for i in range(n)]
    # Some roots hang under a parent still on the device (not in the batch).
    outside = [draw(st.booleans()) for _ in range(n)]
    parents: list[int | None] = [
        keys[j] if j >= 0 else (7 if outside[i] else None) for i, j in enumerate(parent_idx)
    ]
    order = list(range(n))[::-1]  # children (higher index) before their parents
    sizes = [draw(st.integers(1, 4)) * 1024 for _ in range(n)]
    return [keys[i] for i in order], [parents[i] for i in order], [sizes[i] for i in order]


@settings(max_examples=200, deadline=None)
@given(_batches(), st.data())
def test_admission_never_writes_a_child_of_a_skipped_parent(
    batch: tuple[list[int], list[int | None], list[int]], data: st.DataObject
) -> None:
    keys, parents, sizes = batch
    table = {k: data.draw(st.floats(0.0, 1.0)) for k in keys if data.draw(st.booleans())}
    reused = {k for k in table if data.draw(st.booleans())}
    adm = PredictedReuse(
        TablePredictor(table, reused), 64 * 1024, 1024, threshold=data.draw(st.floats(0.01, 1.0))
    )
    # Teach it that some cells are not worth writing.
    for k in list(table)[:5]:
        adm.decide([k], [None], [1024], 0.0)
        adm.stored([k], 0.0)
        adm.left([k])
    before = (adm.offered, adm.written, adm.skipped, adm.bytes_written)
    out = adm.decide(keys, parents, sizes, 1.0)
    assert len(out) == len(keys)
    write = dict(zip(keys, out, strict=True))
    for k, p in zip(keys, parents, strict=True):
        if write[k] and p is not None and p in write:
            assert write[p], f"child {k} written under skipped parent {p}"
    assert adm.offered - before[0] == len(keys)
    assert adm.written - before[1] == sum(out)
    assert adm.skipped - before[2] == len(keys) - sum(out)
    assert adm.bytes_written - before[3] == sum(s for s, ok in zip(sizes, out, strict=True) if ok)


@settings(max_examples=100, deadline=None)
@given(_batches())
def test_write_all_writes_everything_and_counts_bytes_exactly(
    batch: tuple[list[int], list[int | None], list[int]],
) -> None:
    keys, parents, sizes = batch
    adm = make_admission("write-all")
    assert isinstance(adm, WriteAll)
    assert adm.decide(keys, parents, sizes, 0.0) == [True] * len(keys)
    assert adm.bytes_written == sum(sizes)
    assert adm.written == adm.offered == len(keys)


def test_admission_errors_say_what_to_do() -> None:
    with pytest.raises(ConfigError, match="learned-reuse"):
        make_admission("predicted", object(), capacity_bytes=10, typical_size=1)
    with pytest.raises(ConfigError, match="write-all"):
        make_admission("sometimes")
    with pytest.raises(ConfigError):
        TierAdmission().decide([1, 2], [None], [1, 1], 0.0)
    with pytest.raises(ConfigError):
        PredictedReuse(TablePredictor({}, set()), 10, 1, threshold=0.0)


def test_predicted_stops_writing_a_cell_that_is_never_read_and_resumes_on_regret() -> None:
    table = {k: 0.5 for k in range(1000)}
    adm = PredictedReuse(TablePredictor(table, set()), 100, 1, threshold=0.2, prior=4.0)
    written = 0
    for k in range(200):
        if adm.decide([k], [None], [1], float(k))[0]:
            adm.stored([k], float(k))
            adm.left([k])  # leaves unread: a wasted write
            written += 1
    assert written < 200
    assert not adm.decide([500], [None], [1], 300.0)[0]
    # Skipped keys asked for later: the cell proves worth writing again.
    for k in range(500, 560):
        if not adm.decide([k], [None], [1], 300.0)[0]:
            adm.missed(k)
    assert adm.regrets > 0
    assert adm.decide([900], [None], [1], 400.0)[0]


def test_unknown_keys_are_written() -> None:
    adm = PredictedReuse(TablePredictor({}, set()), 100, 1)
    assert adm.decide([1, 2], [2, None], [1, 1], 0.0) == [True, True]
    assert adm.unknown == 2


# -- the replay's tier --------------------------------------------------------------------------


class TierMachine(RuleBasedStateMachine):
    """A real KVCacheManager with learned-reuse and a predicted-admission tier under it."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.clock = lambda: self.now
        self.manager = KVCacheManager(12, 4, policy="learned-reuse", clock=self.clock)
        self.tier = ReplayTier(self.manager, 10, self.clock, admission="predicted", block_bytes=1)
        adm = self.tier.admission
        assert isinstance(adm, PredictedReuse)
        # Start skipping at once, so both branches are exercised.
        adm._hits = [0.1 * h for h in adm._hits]
        self.batches: list[tuple[list[int], list[int | None], list[bool]]] = []
        inner = adm.decide

        def recording(
            keys: Sequence[int], parents: Sequence[int | None], sizes: Sequence[int], now: float
        ) -> list[bool]:
            out = inner(keys, parents, sizes, now)
            self.batches.append((list(keys), list(parents), out))
            return out

        adm.decide = recording  # type: ignore[method-assign]
        self.rid = 0

    @rule(root=st.integers(0, 5), length=st.integers(1, 6), dt=st.floats(0.0, 30.0))
    def request(self, root: int, length: int, dt: float) -> None:
        self.now += dt
        keys = [1000 * root + i for i in range(1, length + 1)]
        n_tokens = 4 * length + 1
        limit = (n_tokens - 1) // 4
        device = self.manager.device_hits(keys[:limit])
        served = self.tier.serve(keys, device, limit)
        # Tier hits continue the device prefix: every one of them is held by the tier.
        assert all(self.tier.tier.is_ready(k) for k in keys[device : device + served])
        self.manager.allocate(self.rid, range(n_tokens), block_keys=keys)
        self.manager.free(self.rid)
        self.rid += 1

    @invariant()
    def no_child_of_a_skipped_parent_is_written(self) -> None:
        for keys, parents, out in self.batches:
            write = dict(zip(keys, out, strict=True))
            for k, p in zip(keys, parents, strict=True):
                if write[k] and p is not None and p in write:
                    assert write[p]
        self.batches.clear()

    @invariant()
    def counters_add_up(self) -> None:
        c = self.tier.counters
        assert c.offered_blocks == c.written_blocks + c.skipped_blocks + self._held_again()
        assert c.distinct_hit <= c.distinct_written
        self.tier.tier.check()

    def _held_again(self) -> int:
        # Blocks admitted that the tier already held cost no write.
        adm = self.tier.admission
        return adm.written - self.tier.counters.written_blocks


TierMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
test_tier_machine = TierMachine.TestCase


def test_replay_without_a_tier_is_unchanged() -> None:
    trace = load_sample_trace()
    plain = simulate_prefix(trace, "learned-reuse", 500)
    zero = simulate_prefix(trace, "learned-reuse", 500, tier_blocks=0)
    assert plain.tier is None and zero.tier is None
    for name in ("block_hits", "prefix_hit_blocks", "cached_tokens", "evictions"):
        assert getattr(plain, name) == getattr(zero, name)


@pytest.mark.parametrize("admission", ["write-all", "predicted"])
def test_replay_tier_columns_add_up(admission: str) -> None:
    trace = load_sample_trace()
    plain = simulate_prefix(trace, "learned-reuse", 500)
    r = simulate_prefix(trace, "learned-reuse", 500, tier_blocks=1000, tier_admission=admission)
    t = r.tier
    assert t is not None and t.admission == admission
    # The device's own hits are those of a replay without the tier.
    assert r.device_hit_ratio == pytest.approx(plain.token_hit_ratio)
    assert r.token_hit_ratio == pytest.approx(r.device_hit_ratio + r.tier_hit_ratio)
    assert t.hit_tokens == t.hit_blocks * trace.block_size
    # Every device eviction is offered; written + skipped never exceeds it.
    assert t.offered_blocks == r.evictions
    assert t.written_blocks + t.skipped_blocks <= t.offered_blocks
    assert t.distinct_hit <= t.distinct_written <= t.written_blocks
    assert t.bytes_written == t.written_blocks * t.block_bytes
    assert t.hit_blocks > 0
    if admission == "write-all":
        assert t.skipped_blocks == 0


def test_predicted_writes_less_than_write_all_on_the_sample() -> None:
    trace = load_sample_trace()
    runs = {
        adm: simulate_prefix(trace, "learned-reuse", 300, tier_blocks=600, tier_admission=adm)
        for adm in ("write-all", "predicted")
    }
    a, p = runs["write-all"].tier, runs["predicted"].tier
    assert a is not None and p is not None
    assert p.written_blocks < a.written_blocks
    assert p.skipped_blocks > 0


def test_replay_tier_needs_a_predicting_policy_and_a_size() -> None:
    trace = load_sample_trace()
    with pytest.raises(ConfigError, match="learned-reuse"):
        simulate_prefix(trace, "lru", 100, tier_blocks=200, tier_admission="predicted")
    with pytest.raises(ConfigError, match="tier-blocks"):
        simulate_prefix(trace, "lru", 100, tier_blocks=-1)
    with pytest.raises(ConfigError, match="admission"):
        simulate_prefix(trace, "lru", 100, tier_blocks=10, tier_admission="maybe")


def test_replay_cli_prints_and_writes_the_tier_columns(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    argv = ["replay", "--policy", "learned-reuse", "-c", "300", "--no-progress"]
    assert main([*argv, "--tier-blocks", "600", "--tier-admission", "predicted"]) == 0
    out = capsys.readouterr().out
    assert "lower tier: 600 blocks (LRU), admission predicted" in out
    assert "bytes/tier hit" in out
    assert main([*argv, "--tier-blocks", "600", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    tier = data["results"][0]["tier"]
    assert tier["admission"] == "write-all" and tier["skipped_blocks"] == 0
    assert tier["offered_blocks"] >= tier["written_blocks"] > 0
    assert main([*argv, "--tier-blocks", "600", "--model", "block"]) == 1
    assert "prefix model only" in capsys.readouterr().err


# -- the tier chain, over real tensors ----------------------------------------------------------

BS = 4


def _device(num_blocks: int) -> tuple[Any, KVCacheManager]:
    from kvtier.layout import KVLayout
    from kvtier.storage import KVBlockStorage

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype="float32")
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    mgr = KVCacheManager(num_blocks, BS, policy="learned-reuse", clock=clock)
    return KVBlockStorage(layout, num_blocks), mgr


def _compute(
    storage: Any, mgr: KVCacheManager, rid: str, tokens: list[int], seed: int, chain: Any = None
) -> Any:
    """Stand in for a forward pass: fill the request's blocks with data; end it."""
    import torch

    alloc = mgr.allocate(rid, tokens)
    if chain is not None:
        chain.demote_pending()  # deferred demotions go before anything writes the blocks
    blocks = alloc.block_table.blocks
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn((len(blocks), *storage.block_shape), generator=gen)
    storage.import_blocks(blocks, data)
    mgr.free(rid)
    return data


def _prompt(base: int, n_blocks: int) -> list[int]:
    return [base + i for i in range(n_blocks * BS + 1)]


def _teach(adm: PredictedReuse, *, fresh: float, reused: float) -> None:
    """Set every cell's learned hit chance: blocks never used again, and blocks used again."""
    from kvtier.offload.admission import _CELLS

    half = _CELLS // 2
    for c in range(_CELLS):
        adm._hits[c] = (reused if c >= half else fresh) * adm._seen[c]


@pytest.mark.parametrize("deferred", [False, True])
def test_chain_writes_reused_blocks_and_skips_the_rest(deferred: bool) -> None:
    import torch

    from kvtier.engine import KvTierCache
    from kvtier.offload.chain import Tier, TierChain
    from kvtier.offload.host import HostStore

    storage, mgr = _device(8)
    chain = TierChain(storage, mgr, [Tier(HostStore(), 32)], tier_admission="predicted")
    chain.defer_demotions = deferred
    adm = chain.admission
    assert isinstance(adm, PredictedReuse)
    _teach(adm, fresh=0.0, reused=1.0)
    a = _prompt(1000, 2)
    data_a = _compute(storage, mgr, "a", a, seed=1, chain=chain)
    _compute(storage, mgr, "a-again", a, seed=1, chain=chain)  # a's blocks are used again
    x = _prompt(5000, 2)
    _compute(storage, mgr, "x", x, seed=2, chain=chain)  # x's are not
    # Requests that need the whole pool evict a's and x's blocks.
    for i, base in enumerate((2000, 3000, 4000)):
        _compute(storage, mgr, f"fill{i}", _prompt(base, 4), seed=3 + i, chain=chain)
    host = chain.tiers[0].offload_manager
    keys_a = mgr.hasher.chain(a)[:2]
    keys_x = mgr.hasher.chain(x)[:2]
    assert mgr.pool.lookup(keys_a) == [] and mgr.pool.lookup(keys_x) == []
    assert all(host.is_ready(k) for k in keys_a)
    assert not any(k in host for k in keys_x)
    assert adm.skipped >= 2
    assert chain.stats()["host"]["admission_skipped_blocks"] == adm.skipped
    # a comes back from the tier bit-exact; x is computed again.
    cache = KvTierCache(storage, mgr, "a3", a, tiers=chain)
    assert cache.num_loaded_tokens == 2 * BS
    assert torch.equal(storage.export_blocks(cache.block_table.blocks[:2]), data_a[:2])
    cache.release()
    cache = KvTierCache(storage, mgr, "x2", x, tiers=chain)
    assert cache.num_loaded_tokens == 0
    cache.release()
    chain.check()
    mgr.check()
    chain.close()


def test_chain_lookups_never_return_a_child_without_its_parent() -> None:
    from kvtier.offload.chain import Tier, TierChain
    from kvtier.offload.host import HostStore

    storage, mgr = _device(8)
    chain = TierChain(storage, mgr, [Tier(HostStore(), 12)], tier_admission="predicted")
    adm = chain.admission
    assert isinstance(adm, PredictedReuse)
    host = chain.tiers[0].offload_manager
    rng = random.Random(7)
    prompts = [_prompt(1000 * (r + 1), rng.randint(1, 4)) for r in range(6)]
    #: Each key's chain from the root, through the key.
    prefix: dict[int, list[int]] = {}
    for step in range(80):
        if step % 10 == 0:
            _teach(adm, fresh=rng.random(), reused=rng.random())
        tokens = rng.choice(prompts)
        keys = mgr.hasher.chain(tokens)
        for i, k in enumerate(keys):
            prefix[k] = keys[: i + 1]
        _compute(storage, mgr, f"r{step}", tokens, seed=step, chain=chain)
        for k in host.ready_keys():
            path = prefix[k]
            plan = chain.lookup(path)
            # Served keys are a run from the chain's first key, each held by the tier.
            assert all(host.is_ready(x) for x in path[: len(plan)])
            above = [x for x in path[:-1] if x not in host]
            if above:
                # The tier holds k but not all of its ancestors: a lookup from the root
                # stops before k (the device recomputes the ancestors first).
                assert len(plan) < len(path)
    chain.check()
    chain.close()


def test_chain_write_all_stores_what_no_admission_stores() -> None:
    from kvtier.offload.chain import Tier, TierChain
    from kvtier.offload.host import HostStore

    stats = []
    for name in (None, "write-all"):
        storage, mgr = _device(8)
        kw: dict[str, Any] = {} if name is None else {"tier_admission": name}
        chain = TierChain(storage, mgr, [Tier(HostStore(), 16)], **kw)
        assert isinstance(chain.admission, WriteAll)
        for i in range(12):
            _compute(storage, mgr, f"r{i}", _prompt(1000 * (i % 5 + 1), 3), seed=i)
        stats.append(chain.stats()["host"]["stored_blocks"])
        assert "admission_skipped_blocks" not in chain.stats()["host"]
        chain.close()
    assert stats[0] == stats[1] > 0


def test_chain_predicted_needs_the_learned_policy() -> None:
    from kvtier.layout import KVLayout
    from kvtier.offload.chain import Tier, TierChain
    from kvtier.offload.host import HostStore
    from kvtier.storage import KVBlockStorage

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=BS, dtype="float32")
    storage, mgr = KVBlockStorage(layout, 4), KVCacheManager(4, BS)
    with pytest.raises(ConfigError, match="learned-reuse"):
        TierChain(storage, mgr, [Tier(HostStore(), 8)], tier_admission="predicted")


# -- through the engine and `kvtier serve`'s flags -------------------------------------------


def test_engine_and_serve_flags_pass_the_admission_to_the_chain() -> None:
    from tiny_model import tiny_model_and_tokenizer

    from kvtier.cli import build_parser
    from kvtier.cli.serve_config import engine_config
    from kvtier.engine import Engine, SamplingParams
    from kvtier.offload.chain import Tier
    from kvtier.offload.host import HostStore

    model, tok = tiny_model_and_tokenizer()
    eng = Engine(
        model, tok, model_id="tiny", block_size=4, num_blocks=16, policy="learned-reuse",
        tiers=[Tier(HostStore(), 64)], tier_admission="predicted",
    )  # fmt: skip
    assert eng.tier_chain is not None and eng.tier_chain.admission.name == "predicted"
    assert "tier admission: predicted" in "\n".join(eng.describe())
    for i in range(16):  # enough distinct prompts to make the device evict
        outs = list(eng.generate([3 + i, 7, 11, 13, 17, 19, 23, 29, 31, 37], SamplingParams(
            max_tokens=2, temperature=0.0)))  # fmt: skip
        assert outs[-1].finished and outs[-1].error is None
    assert eng.tier_chain.admission.offered > 0
    eng.manager.check()
    eng.close()
    with pytest.raises(ConfigError, match="learned-reuse"):
        Engine(
            model, tok, model_id="tiny", block_size=4, num_blocks=16, policy="lru",
            tiers=[Tier(HostStore(), 64)], tier_admission="predicted",
        )  # fmt: skip
    with pytest.raises(ConfigError, match="tier_admission"):
        Engine(model, tok, model_id="tiny", block_size=4, num_blocks=16, tier_admission="some")
    parser, _ = build_parser()
    args = parser.parse_args(
        ["serve", "--policy", "learned-reuse", "--tier-admission", "predicted"]
    )
    assert engine_config(args).tier_admission == "predicted"
    assert engine_config(parser.parse_args(["serve"])).tier_admission == "write-all"
    # learned-reuse is serve's default policy, so predicted admission needs no --policy.
    default = engine_config(parser.parse_args(["serve", "--tier-admission", "predicted"]))
    assert (default.cache.policy, default.tier_admission) == ("learned-reuse", "predicted")
    assert engine_config(parser.parse_args(["serve", "--policy", "lru"])).cache.policy == "lru"
