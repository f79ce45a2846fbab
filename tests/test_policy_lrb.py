"""The LRB-style policy: its bookkeeping under the owner's contract, its learning, its owners.

A state machine drives the generic contract harness with requests announced
between the calls (chains that grow, branch and come back, hits pinned,
new keys inserted pinned after ``evict_for``), under a policy whose training
thresholds are tiny so models are trained and used within a run. The other
tests show that training only uses labels the past has settled, that chain
leaves go before their parents, that decisions are deterministic, that a
missing LightGBM is a ConfigError, and that the manager and the replay drive it.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant
from test_policies import RequestPolicyMachine

pytest.importorskip("lightgbm")

from kvtier import ConfigError, KVCacheManager, OutOfBlocksError, make_policy
from kvtier.policy.lrb import FEATURES, IMPORT_PATH, LRBPolicy
from kvtier.replay import load_sample_trace, simulate_prefix


def _small(**kw: Any) -> LRBPolicy:
    """A policy that trains after a handful of labels, so tests see models."""
    args: dict[str, Any] = {
        "sample": 4,
        "train_samples": 3,
        "window": 64,
        "retrain": 6,
        "min_train": 6,
        "rounds": 2,
        "history": 1,
        "min_history": 12,
        "boundary": 1.0,
    }
    args.update(kw)
    return LRBPolicy(**args)


class LRBContractMachine(RequestPolicyMachine):
    """The protocol's bookkeeping contract, with requests and a model being trained."""

    policy_name = IMPORT_PATH

    def __init__(self) -> None:
        super().__init__()
        self.lrb = _small()
        self.p = self.lrb

    @invariant()
    def bookkeeping_is_bounded(self) -> None:
        p = self.lrb
        assert len(p._labelled) <= p.window
        assert len(p._feat) <= 4 * p.window + p.train_samples
        # Remembered keys: the history limit, plus what residency or a pending label holds.
        assert len(p._meta) <= p._hist_limit + len(p) + len(p._pending) + 1
        # Each evictable key sits in exactly one candidate pool.
        assert not (set(p._leaves.keys) & set(p._inner.keys))
        assert len(p._leaves.at) == len(p._leaves.keys)


TestLRBContract = LRBContractMachine.TestCase
TestLRBContract.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def _chat(p: LRBPolicy, base: int, n: int, now: float, num_hit: int = 0) -> list[int]:
    keys = [base + i for i in range(n)]
    p.on_request(keys, num_hit, now, None)
    return keys


def test_a_clock_that_never_moves_keeps_the_samples_bounded() -> None:
    p = _small(window=16)
    p.bind(8)
    for i in range(200):
        _chat(p, 1000 * i, 3, 5.0)
    assert p.horizon == float("inf") and not p._labelled
    assert len(p._feat) <= 4 * p.window + p.train_samples


def test_bad_arguments_are_config_errors() -> None:
    for kw in ({"sample": 0}, {"boundary": 0.0}, {"leaves": 1}, {"window": True}):
        with pytest.raises(ConfigError):
            LRBPolicy(**kw)
    with pytest.raises(ConfigError):
        make_policy(IMPORT_PATH, per_round=-1)


def test_a_missing_lightgbm_says_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightgbm", None)  # import now fails
    with pytest.raises(ConfigError, match="pip install lightgbm"):
        make_policy(IMPORT_PATH)


def test_leaves_go_before_their_parents() -> None:
    p = LRBPolicy(sample=64)
    p.bind(16)
    keys = _chat(p, 100, 5, 1.0)
    p.insert_many(keys, True)
    p.unpin_many(list(reversed(keys)))
    other = _chat(p, 200, 3, 2.0)
    p.insert_many(other, False)
    victims = p.evict_many(8)
    assert sorted(victims) == sorted(keys + other)
    for chain in (keys, other):
        # Within each chain, the tail leaves first.
        order = [v for v in victims if v in chain]
        assert order == list(reversed(chain))


def test_labels_come_only_from_what_already_happened() -> None:
    p = _small(train_samples=8, min_train=10**6, boundary=1000.0, window=10**5)
    p.bind(8)
    now = 0.0
    for i in range(20):
        now += 1.0
        _chat(p, 1000 * i, 3, now)
    # Every sample waits until the boundary has passed for it: nothing is labelled yet.
    assert p._feat and not p._labelled
    assert p.horizon > 100.0
    # A later request naming a sampled key marks its samples reused, still unlabelled.
    target = next(iter(p._pending))
    first = (target // 1000) * 1000
    chat = [first, first + 1, first + 2]
    sampled = [i for k in chat for i in p._pending.get(k, [])]
    now += 1.0
    p.on_request(chat, 3, now, None)
    assert set(sampled) <= p._reused and not p._labelled
    # Much later, at a rate that makes the boundary far shorter than the wait, every
    # old sample is labelled, in sampling order: 1 for the reused ones, 0 for the rest.
    before = dict(p._feat)
    now += 10**6
    for i in range(300):
        p.on_request([10**9 + i], 0, now + i, None)
    assert p.horizon < 10**5
    old = sorted(before)
    settled = list(p._labelled)[: len(old)]
    assert [f for f, _, _ in settled] == [before[i] for i in old]
    assert [y for _, y, _ in settled] == [1 if i in sampled else 0 for i in old]
    assert not p._reused & set(before)


def test_it_learns_which_chains_come_back() -> None:
    """Long documents never return; short chats do: the model learns to keep the chats."""
    p = LRBPolicy(sample=16, train_samples=6, min_train=200, retrain=200, rounds=16)
    m = KVCacheManager(60, 4, policy=p, clock=lambda: clock[0])
    clock = [0.0]
    convs: list[list[int]] = []
    nxt = 10**6
    for step in range(700):
        clock[0] = step * 1.0
        if step % 2 and convs:
            chat = convs[(step * 7) % len(convs)]
            chat.append(nxt)
            nxt += 1
            keys = chat
        elif step % 4 == 0:
            keys = list(range(nxt, nxt + 12))  # a document, read once
            nxt += 12
        else:
            keys = [nxt]
            nxt += 1
            convs.append(keys)
            if len(convs) > 12:
                convs.pop(0)
        try:
            m.allocate(step, range(4 * len(keys) + 1), block_keys=list(keys))
        except OutOfBlocksError:
            continue
        m.free(step)
    m.check()
    assert p.trainings >= 2
    auc = p.online_auc()
    assert auc is not None and auc > 0.6
    assert set(p.feature_importance()) == set(FEATURES)


def test_decisions_are_deterministic_and_replay_is_consistent() -> None:
    trace = load_sample_trace()
    capacity = trace.unique_blocks // 10
    a = simulate_prefix(trace, IMPORT_PATH, capacity)
    b = simulate_prefix(trace, IMPORT_PATH, capacity)
    assert a.prefix_hit_blocks == b.prefix_hit_blocks and a.evictions == b.evictions
    assert a.prefix_hit_blocks > 0


def test_no_block_stays_cached_below_an_evicted_parent() -> None:
    trace = load_sample_trace()
    bs = trace.block_size
    mgr = KVCacheManager(trace.unique_blocks // 20, bs, policy=IMPORT_PATH)
    seen: list[list[int]] = []
    for rid, req in enumerate(trace.requests[:300]):
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


def test_the_history_is_trimmed_when_only_inserts_arrive() -> None:
    """Blocks no request named (a generated token's) are remembered on insert: with no
    request between, their history must still stay within its limit."""
    machine = LRBContractMachine()
    machine.bind(sized=False, capacity=1, typical=1)
    for n in (4, 3, 4, 1, 4, 4):
        machine.insert_many(n=n, picks=[1, 1, 1, 1], pinned=False, reuse=0, unit_form=False)
        machine.bookkeeping_is_bounded()
    machine.teardown()
