"""Every registered policy against the owner's contract, alone and under the manager.

A state machine plays the owner of a cache level with capacity ``C``: it
inserts only when there is room (evicting first), pins, unpins, hits,
removes and evicts at random, and checks after each step that the policy
agrees with a plain model of resident and pinned keys and never hands out a
key it must not. Then each policy runs a random manager workload with shared
prefixes and the full pool check after every step.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from test_manager_stateful import ManagerMachine

from kvtier import (
    EvictionPolicy,
    InternalInvariantError,
    KVCacheManager,
    OutOfBlocksError,
    make_policy,
)
from kvtier.policy import (
    Admitted,
    ARCPolicy,
    S3FIFOPolicy,
    available_policies,
)

C = 6
SIZED = {"gdsf", "hybrid"}
VARIANTS = [(name, None) for name in available_policies()] + [
    ("lru", "tinylfu"),
    ("arc", "tinylfu"),
]


def _bare(p: Any) -> Any:
    return p.policy if isinstance(p, Admitted) else p


def _check_arc(p: ARCPolicy) -> None:
    t1, t2, b1, b2 = p.sizes
    assert t1 + t2 == len(p)
    assert t1 + b1 <= C and b1 + b2 <= C, "ARC's ghost lists are bounded"
    assert 0.0 <= p.p <= C


def _check_s3fifo(p: S3FIFOPolicy) -> None:
    s, m, g = p.sizes
    assert s + m == len(p)
    assert g <= C, "S3-FIFO's ghost queue is bounded"


EXTRA_CHECKS: dict[type, Callable[[Any], None]] = {
    ARCPolicy: _check_arc,
    S3FIFOPolicy: _check_s3fifo,
}


def _key(n: int) -> int:
    # Spread small counters over 128 bits, like real block keys.
    return (n * 0x9E3779B97F4A7C15F39CC0605CEDC835) % (1 << 128)


class PolicyMachine(RuleBasedStateMachine):
    policy_name: ClassVar[str] = "lru"
    admission: ClassVar[str | None] = None

    def __init__(self) -> None:
        super().__init__()
        kwargs = {"admission": self.admission} if self.admission else {}
        self.p: EvictionPolicy = make_policy(self.policy_name, **kwargs)
        self.p.bind(C)
        self.evictable: set[int] = set()
        self.pinned: set[int] = set()
        self.gone: list[int] = []
        self.n = 0

    # -- helpers -------------------------------------------------------------------
    def _resident(self) -> list[int]:
        return sorted(self.evictable | self.pinned)

    def _took(self, victim: int | None) -> None:
        if victim is None:
            assert not self.evictable, "evict() found nothing although keys are evictable"
            return
        assert victim in self.evictable, f"evicted {victim:#x}, which is pinned or not resident"
        self.evictable.remove(victim)
        self.gone.append(victim)

    def _candidate(self, reuse: int) -> int:
        # Sometimes bring back a key that left, to exercise ghosts and history.
        back = [k for k in self.gone[-2 * C :] if k not in self.evictable | self.pinned]
        if reuse and back:
            return back[reuse % len(back)]
        self.n += 1
        return _key(self.n)

    def _insert_kwargs(self, size: int) -> dict[str, Any]:
        return {"size": size} if self.policy_name in SIZED else {}

    # -- rules -----------------------------------------------------------------------
    @rule(pinned=st.booleans(), reuse=st.integers(0, 3), size=st.integers(1, 9))
    def insert(self, pinned: bool, reuse: int, size: int) -> None:
        if len(self.p) >= C:
            self._took(self.p.evict())
            if len(self.p) >= C:
                return  # every resident key is pinned
        key = self._candidate(reuse)
        if not self.p.admit(key):
            return
        p: Any = self.p
        p.insert(key, pinned, **self._insert_kwargs(size))
        (self.pinned if pinned else self.evictable).add(key)

    @rule(n=st.integers(1, 4), pinned=st.booleans(), reuse=st.integers(0, 3))
    def insert_many(self, n: int, pinned: bool, reuse: int) -> None:
        while len(self.p) + n > C:
            victim = self.p.evict()
            self._took(victim)
            if victim is None:
                n = C - len(self.p)
        keys: list[int] = []
        for _ in range(n):
            key = self._candidate(reuse if not keys else 0)
            if key in keys or not self.p.admit(key):
                break  # like the pool: a declined key ends the run
            keys.append(key)
        self.p.insert_many(keys, pinned)
        (self.pinned if pinned else self.evictable).update(keys)

    @rule(i=st.integers(0, 99))
    def access(self, i: int) -> None:
        keys = self._resident()
        if keys:
            self.p.access(keys[i % len(keys)])

    @rule(picks=st.lists(st.integers(0, 99), max_size=4))
    def access_many(self, picks: list[int]) -> None:
        keys = self._resident()
        if keys:
            self.p.access_many(sorted({keys[i % len(keys)] for i in picks}))

    @rule(i=st.integers(0, 99))
    def pin(self, i: int) -> None:
        keys = sorted(self.evictable)
        if keys:
            k = keys[i % len(keys)]
            self.p.pin(k)
            self.evictable.remove(k)
            self.pinned.add(k)

    @rule(picks=st.lists(st.integers(0, 99), max_size=4), hit=st.booleans())
    def pin_many(self, picks: list[int], hit: bool) -> None:
        keys = sorted(self.evictable)
        if keys:
            chosen = sorted({keys[i % len(keys)] for i in picks})
            self.p.pin_many(chosen)
            if hit:  # what the pool does on a prefix hit
                self.p.access_many(chosen)
            self.evictable.difference_update(chosen)
            self.pinned.update(chosen)

    @rule(i=st.integers(0, 99))
    def unpin(self, i: int) -> None:
        keys = sorted(self.pinned)
        if keys:
            k = keys[i % len(keys)]
            self.p.unpin(k)
            self.pinned.remove(k)
            self.evictable.add(k)

    @rule(picks=st.lists(st.integers(0, 99), max_size=4))
    def unpin_many(self, picks: list[int]) -> None:
        keys = sorted(self.pinned)
        if keys:
            chosen = sorted({keys[i % len(keys)] for i in picks})
            self.p.unpin_many(chosen)
            self.pinned.difference_update(chosen)
            self.evictable.update(chosen)

    @rule(i=st.integers(0, 99), resident=st.booleans())
    def remove(self, i: int, resident: bool) -> None:
        keys = self._resident() if resident else [*self.gone[-3:], _key(10**9 + i)]
        if keys:
            k = keys[i % len(keys)]
            self.p.remove(k)  # non-resident keys must be ignored
            self.evictable.discard(k)
            self.pinned.discard(k)

    @rule()
    def evict(self) -> None:
        self._took(self.p.evict())

    @rule(n=st.integers(0, 8))
    def evict_many(self, n: int) -> None:
        expected = min(n, len(self.evictable))
        got = self.p.evict_many(n)
        assert len(got) == expected == len(set(got))
        for victim in got:
            self._took(victim)

    # -- invariants ----------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        p = self.p
        assert len(p) == len(self.evictable) + len(self.pinned) <= C
        assert p.num_evictable == len(self.evictable)
        for k in self.evictable | self.pinned:
            assert k in p
        for k in self.gone[-4:]:
            assert (k in p) == (k in self.evictable or k in self.pinned)
        bare = _bare(p)
        check = EXTRA_CHECKS.get(type(bare))
        if check is not None:
            check(bare)


_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)

for _name, _admission in VARIANTS:
    _label = f"{_name}_{_admission}" if _admission else _name
    _machine: Any = type(
        f"PolicyMachine_{_label}",
        (PolicyMachine,),
        {"policy_name": _name, "admission": _admission},
    )
    _case = _machine.TestCase
    _case.settings = _SETTINGS
    globals()[f"TestPolicyMachine_{_label}"] = _case
del _name, _admission, _label, _machine, _case  # or pytest collects _case twice


def test_every_shipped_policy_is_covered() -> None:
    assert {"lru", "lfu", "fifo", "arc", "s3fifo", "sieve", "gdsf", "hybrid"} <= set(
        available_policies()
    )


@pytest.mark.parametrize("name", available_policies())
def test_misuse_is_an_invariant_error(name: str) -> None:
    p = make_policy(name)
    assert isinstance(p, EvictionPolicy)
    p.bind(4)
    p.insert(1)
    p.insert(2, pinned=True)
    for method, key in ((p.unpin, 1), (p.pin, 2), (p.pin, 3), (p.unpin, 3)):
        with pytest.raises(InternalInvariantError):
            method(key)
    assert len(p) == 2 and p.num_evictable == 1


def test_all_pinned_means_no_victim() -> None:
    for name in available_policies():
        p = make_policy(name)
        p.bind(3)
        p.insert_many([1, 2, 3], True)
        p.access(2)
        assert p.evict() is None and p.evict_many(3) == [], name
        assert len(p) == 3 and p.num_evictable == 0
        p.unpin(2)
        assert p.evict_many(3) == [2], name


def test_eviction_below_capacity_and_unbound() -> None:
    # Owner-driven eviction (gc) with few keys resident, and a bare unbound policy.
    for name in available_policies():
        for bound in (True, False):
            p = make_policy(name)
            if bound:
                p.bind(100)
            p.insert(7)
            p.insert(8, pinned=True)
            assert p.evict() == 7 and p.evict() is None, name
            p.unpin(8)
            assert p.evict() == 8 and len(p) == 0, name


# -- the manager under every policy ---------------------------------------------------
def _workload(policy: str | EvictionPolicy, seed: int, steps: int = 300) -> KVCacheManager:
    rng = random.Random(seed)
    m = KVCacheManager(24, 4, policy=policy)
    # A few system prompts and documents shared by many requests.
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(6)]
    live: list[int] = []
    next_id = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.45 or not live:
            toks = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(rng.randrange(1, 9)))]
            try:
                m.allocate(next_id, toks)
            except OutOfBlocksError:
                pass
            else:
                live.append(next_id)
            next_id += 1
        elif op < 0.7:
            rid = rng.choice(live)
            with contextlib.suppress(OutOfBlocksError):
                m.extend(rid, [rng.randrange(50) for _ in range(rng.randrange(1, 7))])
        elif op < 0.95:
            rid = live.pop(rng.randrange(len(live)))
            m.free(rid)
        else:
            m.gc(rng.randrange(4))
        m.check()
    for rid in live:
        m.free(rid)
    m.check()
    assert m.pool.num_free == m.pool.num_blocks
    return m


@pytest.mark.parametrize("name", available_policies())
def test_manager_random_workload(name: str) -> None:
    m = _workload(name, seed=len(name))
    stats = m.stats()
    assert stats.hit_tokens > 0, "shared prefixes must produce hits"
    assert stats.evictions > 0, "the workload must exercise eviction"


@pytest.mark.parametrize("name", ["lru", "lfu", "s3fifo", "sieve"])
def test_manager_random_workload_with_admission(name: str) -> None:
    m = _workload(make_policy(name, admission="tinylfu"), seed=7)
    stats = m.stats()
    assert stats.declined_blocks > 0 and stats.hit_tokens > 0
    assert stats.policy == f"{name}+tinylfu"


class TinyLFUArcManagerMachine(ManagerMachine):
    """The manager machine (contents read back) with declines and ARC's lists."""

    policy_factory = staticmethod(lambda: make_policy("arc", admission="tinylfu"))


TestTinyLFUArcManagerMachine = TinyLFUArcManagerMachine.TestCase
TestTinyLFUArcManagerMachine.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None
)


class S3FIFOManagerMachine(ManagerMachine):
    policy_factory = staticmethod(lambda: "s3fifo")


TestS3FIFOManagerMachine = S3FIFOManagerMachine.TestCase
TestS3FIFOManagerMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
