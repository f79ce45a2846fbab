"""TinyLFU admission and the ``admission=`` option every shipped policy takes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import ConfigError, EvictionPolicy, KVCacheManager, make_policy
from kvtier.policy import (
    AdmissionFilter,
    Admitted,
    GDSFPolicy,
    LRUPolicy,
    TinyLFUAdmission,
    available_policies,
    make_admission,
)

BIG = 0xDEADBEEF_CAFEBABE_01234567_89ABCDEF


def test_first_sight_declined_second_admitted() -> None:
    f = TinyLFUAdmission()
    f.bind(64)
    for key in (1, 2, BIG):
        assert f.admit(key) is False
        assert f.admit(key) is True
    assert isinstance(f, AdmissionFilter)


def test_window_forgets_single_sightings() -> None:
    f = TinyLFUAdmission(window=16)
    f.bind(64)
    assert not f.admit(BIG)
    for k in range(100, 116):  # a full window of other keys: reset
        f.record(k)
    assert not f.admit(BIG), "seen once in an earlier window is first sight again"
    assert f.admit(BIG)


def test_halving_keeps_frequent_keys() -> None:
    f = TinyLFUAdmission(window=32)
    f.bind(64)
    for _ in range(8):
        f.record(BIG)
    for k in range(24):
        f.record(1000 + k)  # the window fills: counts halve, the doorkeeper clears
    assert f.estimate(BIG) >= 3
    assert f.admit(BIG)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=200))
def test_estimate_never_undercounts(keys: list[int]) -> None:
    f = TinyLFUAdmission(window=10**6)
    f.bind(16)
    for k in keys:
        f.record(k)
    for k in set(keys):
        assert f.estimate(k) >= min(keys.count(k), 16)


@pytest.mark.parametrize("name", available_policies())
def test_every_policy_takes_admission(name: str) -> None:
    bare = make_policy(name)
    assert not isinstance(bare, Admitted)
    p = make_policy(name, admission="tinylfu")
    assert isinstance(p, Admitted) and isinstance(p, EvictionPolicy)
    assert p.name == f"{name}+tinylfu"
    assert type(p.policy) is type(bare)
    p.bind(8)
    assert not p.admit(5) and p.admit(5)
    p.insert(5)
    assert 5 in p and len(p) == 1 and p.num_evictable == 1
    assert make_policy(name, admission=None).name == name


def test_admission_arguments() -> None:
    with pytest.raises(ConfigError, match="unknown admission"):
        make_policy("lru", admission="bogus")
    with pytest.raises(ConfigError, match="rejected its arguments"):
        make_policy("lru", admission="tinylfu", capacity=3)
    f = TinyLFUAdmission(window=50)
    p = make_policy("arc", admission=f)
    assert isinstance(p, Admitted) and p.admission is f
    assert make_admission(f) is f
    with pytest.raises(ConfigError):
        make_admission(LRUPolicy())  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TinyLFUAdmission(threshold=0)


def test_hits_count_toward_readmission() -> None:
    p = Admitted(LRUPolicy(), TinyLFUAdmission())
    p.bind(4)
    assert not p.admit(1) and p.admit(1)
    p.insert(1)
    p.access_many([1])
    assert p.evict() == 1
    assert p.admit(1), "a key seen recently comes straight back"


def test_sizes_reach_a_wrapped_sized_policy() -> None:
    p = Admitted(GDSFPolicy())
    p.bind(16, typical_size=4)
    assert p.key_capacity == 4 and p.admission.window == 8 * 4  # the sketch counts keys
    p.insert(1, size=1)
    p.insert_many([2], sizes=[8])
    assert p.used == 9 and p.size_of(2) == 8
    assert p.evict_for(8) == [2] and p.used == 1
    assert p.evict() == 1 and p.used == 0


def test_abort_withdraws_the_blocks_published_before_a_decline() -> None:
    """A chain cut by admission still records the blocks it published before the cut."""
    m = KVCacheManager(6, 2, policy=make_policy("arc", admission="tinylfu"))
    m.allocate("seen", [0, 0, 0])  # one full block: its key's first sighting, declined
    m.free("seen")
    m.allocate("a", [0, 0, 0, 0, 0])  # the first block is admitted, the second declined
    assert m.stats().cached_blocks == 1
    # The forward pass failed before computing anything: its published block goes.
    assert m.abort("a", 0) == 1
    assert m.stats().cached_blocks == 0
    assert m.allocate("b", [0, 0, 0]).num_cached_tokens == 0, "a garbage block was hit"
    m.check()


def test_pool_publishes_a_whole_chain_on_its_second_sight() -> None:
    m = KVCacheManager(16, 4, policy=make_policy("lru", admission="tinylfu"))
    prompt = list(range(13))  # three full blocks and a tail
    first = m.allocate("a", prompt)
    assert first.num_cached_tokens == 0
    assert m.stats().declined_blocks == 1, "the chain stops at its first declined block"
    m.free("a")
    assert m.stats().cached_blocks == 0
    # The filter heard about the whole chain, so the second sighting admits
    # all of it and the third one hits it.
    second = m.allocate("b", prompt)
    assert second.num_cached_tokens == 0
    m.free("b")
    m.check()
    assert m.stats().cached_blocks == 3
    third = m.allocate("c", prompt)
    assert third.num_cached_tokens == 12
    m.free("c")
    m.check()
