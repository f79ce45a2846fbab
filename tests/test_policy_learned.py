"""The learned-reuse policy: its bookkeeping, what it learns, its guard and its owners.

A state machine plays the device pool around the policy (requests announced
with ``on_request``, hits pinned, new keys inserted pinned, releases, owner
evictions and removals, inserts outside any request) and checks the policy
against a plain model after every step. The other tests show that decisions
depend only on the calls and the injected clock, that what the policy learns
changes which blocks it evicts, that the guard falls back to recency order,
and that the manager, the offloading manager, the tier chain, the replay and
vLLM's adapter all drive it.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_policies import RequestPolicyMachine

from kvtier import ConfigError, KVCacheManager, OutOfBlocksError, OversizeError, make_policy
from kvtier.engine import KvTierCache
from kvtier.layout import KVLayout
from kvtier.offload.chain import Tier, TierChain
from kvtier.offload.host import HostStore
from kvtier.offload.manager import OffloadingManager
from kvtier.policy import Admitted, LearnedReusePolicy, LRUPolicy
from kvtier.policy.base import request_hook
from kvtier.policy.guard import LRUGuard
from kvtier.policy.learned import LOOSE, age_bin, hit_density, request_class
from kvtier.replay import load_sample_trace, simulate_prefix
from kvtier.storage import KVBlockStorage

C = 8


class LearnedMachine(RuleBasedStateMachine):
    """The owner of a level of ``C`` keys around a small-history learned-reuse policy."""

    def __init__(self) -> None:
        super().__init__()
        self.p = LearnedReusePolicy(history=1, min_history=24, refresh=3)
        self.p.bind(C)
        self.ref: Counter[int] = Counter()  # pins per resident key (0: evictable)
        self.sizes: dict[int, int] = {}
        self.live: list[list[int]] = []  # keys each live request pinned, chain order
        self.convs: list[list[int]] = []
        self.now = 0.0
        self.n = 0
        self.outside = 0  # keys inserted outside a request since the last one
        self.gone: list[int] = []

    def _fresh(self) -> int:
        self.n += 1
        return self.n

    def _evictable(self) -> set[int]:
        return {k for k, r in self.ref.items() if r == 0}

    def _took(self, victims: Sequence[int]) -> None:
        for v in victims:
            assert self.ref.get(v) == 0, f"evicted {v}, which is pinned or not resident"
            del self.ref[v]
            self.sizes.pop(v, None)
            self.gone.append(v)

    def _pin(self, keys: Sequence[int]) -> None:
        first = [k for k in keys if self.ref[k] == 0]
        self.p.pin_many(first)
        for k in keys:
            self.ref[k] += 1

    @rule(
        conv=st.integers(0, 5),
        grow=st.integers(0, 3),
        branch=st.booleans(),
        dt=st.sampled_from([0.0, 0.3, 1.0, 7.0, 40.0, 300.0]),
    )
    def request(self, conv: int, grow: int, branch: bool, dt: float) -> None:
        self.now += dt
        known = conv < len(self.convs)
        chain = list(self.convs[conv]) if known else []
        if branch and len(chain) > 1:
            chain = chain[: len(chain) // 2]
        chain += [self._fresh() for _ in range(grow)]
        if not chain:
            return
        if known:
            self.convs[conv] = chain
        else:
            self.convs.append(chain)
        hit = 0
        while hit < len(chain) and chain[hit] in self.ref:
            hit += 1
        self.p.on_request(chain, hit, self.now, None)
        self.outside = 0
        hits = chain[:hit]
        self._pin(hits)
        self.p.access_many(hits)
        new = [k for k in chain[hit:] if k not in self.ref]
        room = C - len(self.ref)
        if len(new) > room:
            self._took(self.p.evict_many(len(new) - room))
            new = new[: C - len(self.ref)]
        self.p.insert_many(new, True)
        for k in new:
            self.ref[k] = 1
        self.live.append(hits + new)

    @precondition(lambda self: bool(self.live))
    @rule(i=st.integers(0, 9))
    def free(self, i: int) -> None:
        keys = self.live.pop(i % len(self.live))
        last = []
        for k in reversed(keys):  # tail first, as the pool releases
            if k in self.ref:
                self.ref[k] -= 1
                if self.ref[k] == 0:
                    last.append(k)
        self.p.unpin_many(last)

    @rule(size=st.integers(1, 3), pinned=st.booleans(), back=st.booleans())
    def insert_outside(self, size: int, pinned: bool, back: bool) -> None:
        """A key no request named (generated tokens, a tier's store), maybe one that left."""
        if len(self.ref) + 1 > C:
            self._took(self.p.evict_many(1))
            if len(self.ref) + 1 > C:
                return
        returning = [k for k in self.gone[-4:] if k not in self.ref]
        k = returning[-1] if back and returning else self._fresh()
        self.p.insert(k, pinned, size)
        self.ref[k] = 1 if pinned else 0
        if pinned:
            self.live.append([k])
        self.sizes[k] = size
        self.outside += 1

    @rule(picks=st.lists(st.integers(0, 99), max_size=3))
    def access_outside(self, picks: list[int]) -> None:
        keys = sorted(self.ref)
        if keys:
            self.p.access_many(sorted({keys[i % len(keys)] for i in picks}))

    @rule(n=st.integers(0, 5))
    def evict_many(self, n: int) -> None:
        expected = min(n, len(self._evictable()))
        got = self.p.evict_many(n)
        assert len(got) == expected == len(set(got))
        self._took(got)

    @rule(i=st.integers(0, 99))
    def remove(self, i: int) -> None:
        keys = sorted(self._evictable())
        if keys:
            k = keys[i % len(keys)]
            self.p.remove(k)
            del self.ref[k]
            self.sizes.pop(k, None)
            self.gone.append(k)
        self.p.remove(10**9 + i)  # not resident: ignored

    @invariant()
    def agrees_with_model(self) -> None:
        p = self.p
        assert len(p) == len(self.ref) <= C
        assert p.num_evictable == len(self._evictable())
        assert p.used == sum(self.sizes.get(k, 1) for k in self.ref)
        for k in self.ref:
            assert k in p
        for k in range(max(1, self.n - 5), self.n + 1):
            assert (k in p) == (k in self.ref)

    @invariant()
    def history_is_bounded(self) -> None:
        p = self.p
        assert p.history_size <= p.history_limit + len(p) + self.outside
        assert p.history_chains[1] <= 2 * p.history_limit + self.outside + 3


TestLearnedMachine = LearnedMachine.TestCase
TestLearnedMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)


class LearnedContractMachine(RequestPolicyMachine):
    """The protocol's bookkeeping contract, with requests announced between the calls.

    The generic harness drives every transition (insert, insert_many, access,
    pin/unpin, remove, evict, evict_many, oversize refusals) and checks the
    resident set, the pins, ``used <= capacity`` and ``evict_for`` (room made
    whenever the unpinned keys allow, nothing changed when they do not)
    against its model, under unit sizes or a byte budget with random sizes.
    Here a request rule adds what a real owner does around ``on_request``:
    chains that grow, branch and come back after gaps of every age bin, their
    cached prefix pinned and used, their missing keys inserted pinned after
    ``evict_for`` made room for each. The history is tiny, so chains are
    forgotten while their keys are still resident.
    """

    policy_name = "learned-reuse"

    def __init__(self) -> None:
        super().__init__()
        self.learned = LearnedReusePolicy(history=1, min_history=12, refresh=2)
        self.p = self.learned

    @invariant()
    def history_is_bounded(self) -> None:
        p = self.learned
        assert p.history_chains[1] <= 2 * p.history_limit + len(p) + 8


TestLearnedContract = LearnedContractMachine.TestCase
TestLearnedContract.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# -- the pieces ------------------------------------------------------------------------------
def test_request_classes_and_age_bins() -> None:
    assert request_class(1, 0) == 0 and request_class(1, 1) == 1
    assert request_class(1, 3) == request_class(1, 2) == 2
    assert request_class(1, 1000) == 5
    assert request_class(2, 1) == request_class(3, 1) == 7
    assert request_class(99, 99) == LOOSE - 1
    assert [age_bin(a) for a in (0.0, 0.3, 1.0, 1.9, 100.0, 1e9)] == [0, 1, 3, 3, 9, 16]


def test_hit_density_prefers_soon_and_likely_reuse() -> None:
    never = hit_density([0.0] * 17)
    assert never == [0.0] * 17
    soon = [0.0] * 17
    soon[6] = 0.5  # reused between 8 and 16 s with probability 1/2
    late = [0.0] * 17
    late[12] = 0.5  # the same, between 512 and 1024 s
    v_soon, v_late = hit_density(soon), hit_density(late)
    assert v_soon[0] > v_late[0] > 0.0
    # Past the bin where reuse could come, nothing is left to wait for.
    assert v_soon[7] == 0.0 and v_late[13] == 0.0


def test_misuse_and_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        LearnedReusePolicy(history=0)
    with pytest.raises(ConfigError):
        LearnedReusePolicy(prior=0.0)
    with pytest.raises(ConfigError):
        LearnedReusePolicy(refresh=0)
    p = LearnedReusePolicy()
    p.bind(4)
    with pytest.raises(OversizeError):
        p.insert(1, size=5)
    with pytest.raises(ConfigError):
        p.insert_many([1, 2], sizes=[1])
    assert len(p) == 0 and p.used == 0


def test_a_repeated_prompt_does_not_grow_the_history() -> None:
    p = LearnedReusePolicy(min_history=64)
    p.bind(8)
    prompt = list(range(10))
    for i in range(5000):
        p.on_request(prompt, 0, float(i), None)
    chains, keys = p.history_chains
    assert p.history_size == 10 and keys == 10 * chains <= 2 * p.history_limit + 10


def test_sizes_count_against_capacity() -> None:
    p = LearnedReusePolicy()
    p.bind(10)
    p.insert_many([1, 2, 3], sizes=[2, 3, 4])
    assert p.used == 9
    p.remove(2)
    assert p.used == 6
    victims = p.evict_many(2)
    assert sorted(victims) == [1, 3] and p.used == 0


# -- determinism and learning --------------------------------------------------------------
class ChatAndDocs:
    """Chats that come back after a minute with one new block, and documents that never do.

    Every second one chat turn and one document (24 new blocks) arrive; a chat
    has four turns, 60 s apart. Whether blocks will be reused depends only on
    how many new blocks their request added, which the policy must learn.
    """

    def __init__(self, seconds: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.requests: list[tuple[float, list[int]]] = []
        n = 0
        chats: dict[int, list[int]] = {}
        for t in range(seconds):
            chains = []
            for start in (t - 180, t - 120, t - 60):
                if start in chats:
                    n += 1
                    chats[start] = [*chats[start], n]
                    chains.append(chats[start])
            n += 2
            chats[t] = [n - 1, n]
            chains.append(chats[t])
            chats.pop(t - 180, None)
            doc = list(range(n + 1, n + 25))
            n += 24
            chains.append(doc)
            rng.shuffle(chains)
            self.requests += [(float(t), c) for c in chains]

    def replay(self, m: KVCacheManager, clock: list[float]) -> float:
        """Allocate and free every request on ``m``; the prefix hit ratio."""
        hits = total = 0
        for rid, (t, keys) in enumerate(self.requests):
            clock[0] = t
            a = m.allocate(rid, range(4 * len(keys) + 1), block_keys=keys)
            m.free(rid)
            hits += a.num_cached_tokens // 4
            total += len(keys)
        return hits / total


class RecordingVictims(LearnedReusePolicy):
    """The learned policy, remembering its victims in order."""

    def __init__(self) -> None:
        super().__init__()
        self.victims: list[int] = []

    def evict_many(self, n: int) -> list[int]:
        out = super().evict_many(n)
        self.victims.extend(out)
        return out


def _manager(policy: Any, capacity: int = 300) -> tuple[KVCacheManager, list[float]]:
    clock = [0.0]
    return KVCacheManager(capacity, 4, policy=policy, clock=lambda: clock[0]), clock


def test_decisions_depend_only_on_calls_and_clock() -> None:
    runs = []
    for _ in range(2):
        policy = RecordingVictims()
        m, clock = _manager(policy)
        ratio = ChatAndDocs(240, seed=3).replay(m, clock)
        m.check()
        runs.append((ratio, policy.victims, sorted(m.pool._cached)))
    assert runs[0] == runs[1]
    assert runs[0][1], "the workload must evict"


def test_learning_changes_what_is_evicted() -> None:
    work = ChatAndDocs(600)
    learned, clock = _manager(LearnedReusePolicy())
    lru, lru_clock = _manager("lru")
    r_learned = work.replay(learned, clock)
    r_lru = work.replay(lru, lru_clock)
    # LRU cannot keep chats for a minute behind the documents; the policy learns to.
    assert r_learned > 1.5 * r_lru and r_learned > r_lru + 0.05
    p: Any = learned.pool.policy
    chat, doc = request_class(2, 1), request_class(1, 24)
    assert p.value(chat, 30.0) > 10 * p.value(doc, 30.0)

    # A probe: an old first chat turn, then a fresh document. Trained, the policy
    # gives up the document first; untrained, the older chat goes first.
    def order(m: KVCacheManager, clock: list[float], t0: float) -> list[str]:
        """Which of the probe's two requests loses its first block first."""
        chat_keys = [10**6, 10**6 + 1]
        doc_keys = list(range(10**6 + 2, 10**6 + 26))
        clock[0] = t0
        m.allocate("chat", range(9), block_keys=chat_keys)
        m.free("chat")
        clock[0] = t0 + 40.0
        m.allocate("doc", range(97), block_keys=doc_keys)
        m.free("doc")
        gone: list[str] = []
        while len(gone) < 2 and m.pool.num_evictable:
            m.gc(1)
            for name, keys in (("chat", chat_keys), ("doc", doc_keys)):
                if name not in gone and m.pool.cached_block(keys[-1]) is None:
                    gone.append(name)
        return gone

    t_end = work.requests[-1][0]
    assert order(learned, clock, t_end + 1)[0] == "doc"
    fresh, fresh_clock = _manager(LearnedReusePolicy())
    assert order(fresh, fresh_clock, 0.0)[0] == "chat"
    learned.check()
    fresh.check()


# -- the guard -------------------------------------------------------------------------------
def test_guard_switches_to_recency_and_probes_back() -> None:
    g = LRUGuard(64, target=64, window=32, margin=0.05, probe=2)
    assert g.period == 1 and not g.recency
    loop = list(range(16))  # two observations make a window

    def windows(n: int, owner_hits: bool) -> None:
        for _ in range(2 * n):
            g.observe(loop, set(loop) if owner_hits else set())

    # The owner never has what LRU would have: switch to recency order.
    windows(1, owner_hits=False)
    assert g.recency and g.switches == 1
    # In recency order the owner matches LRU (no bias); after two windows it probes.
    windows(1, owner_hits=True)
    assert g.recency
    windows(1, owner_hits=True)
    assert not g.recency and abs(g.bias) < 0.05
    # The probe fails at once: back to recency, and the next wait doubles.
    windows(1, owner_hits=False)
    assert g.recency and g.switches == 2
    windows(3, owner_hits=True)
    assert g.recency
    windows(1, owner_hits=True)
    assert not g.recency
    # Doing as well as LRU keeps the policy's own order.
    windows(4, owner_hits=True)
    assert not g.recency and g.switches == 2


def test_guard_sampling_follows_the_capacity() -> None:
    g = LRUGuard(100_000)
    assert g.period == 100_000 // 512 and g.size == 100_000 // g.period
    with pytest.raises(ConfigError):
        LRUGuard(0)
    with pytest.raises(ConfigError):
        LRUGuard(8, margin=1.5)


def test_recency_order_evicts_the_request_used_longest_ago() -> None:
    p = LearnedReusePolicy()
    p.bind(64)
    assert p.guard is not None
    for i, t in enumerate((0.0, 10.0, 20.0)):
        keys = [100 * i + j for j in range(3)]
        p.on_request(keys, 0, t, None)
        p.insert_many(keys)
    p.on_request([0, 1], 2, 30.0, None)  # request 0's chain is used again
    p.guard.recency = True
    assert p.recency_order
    # Request 0's last block was used longest ago, then request 1, tail first.
    assert p.evict_many(4) == [2, 102, 101, 100]
    p.guard.recency = False
    assert not p.recency_order
    assert p.evict_many(1) == [202]  # learned order (nothing learned yet): the oldest bin


# -- owners ----------------------------------------------------------------------------------
class Recording(LRUPolicy):
    """LRU that records what on_request tells it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[int], int, float, Mapping[str, object] | None]] = []

    def on_request(
        self,
        keys: Sequence[int],
        num_hit: int,
        now: float,
        hints: Mapping[str, object] | None = None,
    ) -> None:
        self.calls.append((list(keys), num_hit, now, hints))


def test_only_overriding_policies_get_a_hook() -> None:
    assert request_hook(LRUPolicy()) is None
    assert request_hook(make_policy("arc")) is None
    assert request_hook(Recording()) is not None
    assert request_hook(LearnedReusePolicy()) is not None


def test_manager_calls_the_hook_with_its_clock_and_hints() -> None:
    rec = Recording()
    t = [5.0]
    m = KVCacheManager(4, 2, policy=rec, clock=lambda: t[0])
    a = m.allocate("a", [1, 2, 3, 4, 5], hints={"session_id": "s1"})
    m.free("a")
    t[0] = 7.0
    m.allocate("b", [1, 2, 3, 4, 9])
    keys = m.block_keys("b")
    assert rec.calls == [
        (m.block_keys("b")[:2], 0, 5.0, {"session_id": "s1"}),
        (keys, 2, 7.0, None),
    ]
    assert a.num_cached_tokens == 0
    # A request that cannot be allocated changes nothing, the policy's history included.
    with pytest.raises(OutOfBlocksError):
        m.allocate("c", list(range(100, 120)))
    assert len(rec.calls) == 2
    m.check()


def test_offloading_manager_and_admission_wrapper_forward_the_hook() -> None:
    rec = Recording()
    om = OffloadingManager(8, rec, clock=lambda: 3.0)
    om.on_request([1, 2, 3], 1)
    assert rec.calls == [([1, 2, 3], 1, 3.0, None)]
    OffloadingManager(8, "lru").on_request([1], 0)  # no hook: nothing to do
    inner = Recording()
    wrapped = Admitted(inner, "tinylfu")
    hook = request_hook(wrapped)
    assert hook is not None
    hook([4, 5], 0, 1.0, {"x": 1})
    assert inner.calls == [([4, 5], 0, 1.0, {"x": 1})]
    assert make_policy("learned-reuse", admission="tinylfu").name == "learned-reuse+tinylfu"


def test_tier_chain_tells_each_tier_about_the_request() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")
    storage = KVBlockStorage(layout, 8)
    mgr = KVCacheManager(8, 4)  # LRU on the device: the first prompt is demoted whole
    host = LearnedReusePolicy()
    chain = TierChain(storage, mgr, [Tier(HostStore(), 16, policy=host)])
    try:
        prompts = [[1000 * (i + 1) + j for j in range(17)] for i in range(3)]
        for i, p in enumerate(prompts):
            alloc = mgr.allocate(f"r{i}", p)
            storage.import_blocks(alloc.block_table.blocks, torch.randn(5, *storage.block_shape))
            mgr.free(f"r{i}")
        before = host.requests
        cache = KvTierCache(storage, mgr, "again", prompts[0], tiers=chain)
        assert cache.num_loaded_tokens == 16
        assert host.requests == before + 1
        cache.release()
        chain.check()
        mgr.check()
    finally:
        chain.close()


def test_replay_drives_it_deterministically_and_ahead_of_lru() -> None:
    trace = load_sample_trace()
    capacity = trace.unique_blocks // 10
    a = simulate_prefix(trace, "learned-reuse", capacity)
    b = simulate_prefix(trace, "learned-reuse", capacity)
    lru = simulate_prefix(trace, "lru", capacity)
    assert a.prefix_hit_blocks == b.prefix_hit_blocks and a.evictions == b.evictions
    assert a.prefix_hit_ratio > lru.prefix_hit_ratio


def test_no_block_stays_cached_below_an_evicted_parent() -> None:
    """After every request of a replay, each chain's cached blocks form a prefix of it."""
    trace = load_sample_trace()
    bs = trace.block_size
    mgr = KVCacheManager(trace.unique_blocks // 20, bs, policy="learned-reuse")
    seen: list[list[int]] = []
    for rid, req in enumerate(trace.requests):
        keys = req.full_keys(bs)
        try:
            mgr.allocate(rid, range(req.input_length), block_keys=keys)
        except OutOfBlocksError:
            continue
        mgr.free(rid)
        seen.append(keys)
        if rid % 25 == 0:
            for chain in seen[-60:]:
                held = [mgr.pool.cached_block(k) is not None for k in chain]
                assert held == sorted(held, reverse=True), "a block is cached below a gap"
    mgr.check()


def test_vllm_resolves_the_policy_by_name() -> None:
    pytest.importorskip("vllm.v1.kv_offload.cpu.manager")
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvtier.integrations.vllm import cache_policy as cp

    assert getattr(cp, "kvtier:learned-reuse") is cp.KvTierLearnedReuseCachePolicy
    m = CPUOffloadingManager(
        3, cache_policy="kvtier:learned-reuse", cache_policy_module_path=cp.MODULE_PATH
    )
    policy: Any = m._policy
    assert policy.policy.name == "learned-reuse"

    def store(rid: str, *names: str) -> list[bytes]:
        ctx = ReqContext(req_id=rid)
        m.on_new_request(ctx)
        keys = [make_offload_key(n.encode(), 0) for n in names]
        out = m.prepare_store(keys, ctx)
        assert out is not None
        m.complete_store(keys, ctx)
        m.on_request_finished(ctx)
        return [bytes(k[:-4]) for k in out.evicted_keys]

    assert store("r1", "a1", "a2") == []
    assert store("r2", "b1") == []
    # The batch stored longest ago goes first, its chain's tail before its root.
    assert store("r3", "c1") == [b"a2"]
    policy.check()
