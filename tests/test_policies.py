"""Every registered policy against the owner's contract, alone and under the manager.

A state machine plays the owner of a cache level: it draws the level's
capacity and whether items have sizes (one unit each, like device blocks,
or random sizes against a budget, like bytes), makes room with
``evict_for`` before every insert, pins, unpins, hits, removes and evicts at
random, and checks after each step that the policy agrees with a plain model
of resident and pinned keys and their sizes: ``used`` never exceeds the
capacity, a pinned key is never a victim, an item larger than the capacity
is refused at once and changes nothing. Then each policy runs a random
manager workload with shared prefixes and the full pool check after every
step.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_manager_stateful import ManagerMachine

from kvtier import (
    ConfigError,
    EvictionPolicy,
    InternalInvariantError,
    KVCacheManager,
    OutOfBlocksError,
    OversizeError,
    make_policy,
)
from kvtier.policy import (
    Admitted,
    ARCPolicy,
    S3FIFOPolicy,
    admit_chain,
    available_policies,
)

C = 6
VARIANTS = [(name, None) for name in available_policies()] + [
    ("lru", "tinylfu"),
    ("arc", "tinylfu"),
]


def _bare(p: Any) -> Any:
    return p.policy if isinstance(p, Admitted) else p


def _check_arc(p: ARCPolicy) -> None:
    c = p.key_capacity
    t1, t2, b1, b2 = p.sizes
    assert t1 + t2 == len(p)
    assert t1 + b1 <= max(c, t1) and b1 + b2 <= c, "ARC's ghost lists are bounded"
    assert 0.0 <= p.p <= c


def _check_s3fifo(p: S3FIFOPolicy) -> None:
    s, m, g = p.sizes
    assert s + m == len(p)
    assert g <= p.key_capacity, "S3-FIFO's ghost queue is bounded"


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
        self.evictable: set[int] = set()
        self.pinned: set[int] = set()
        #: Size of every resident key.
        self.size: dict[int, int] = {}
        self.gone: list[int] = []
        self.n = 0
        self.capacity = C
        self.max_size = 1

    @initialize(sized=st.booleans(), capacity=st.integers(1, 40), typical=st.integers(1, 4))
    def bind(self, sized: bool, capacity: int, typical: int) -> None:
        if sized:
            # A budget in units (bytes, say) and items of random sizes.
            self.capacity = capacity
            self.max_size = capacity
            self.p.bind(capacity, min(typical, capacity))
        else:
            # One unit per item, like the device pool's blocks.
            self.p.bind(C)

    # -- helpers -------------------------------------------------------------------
    def _resident(self) -> list[int]:
        return sorted(self.evictable | self.pinned)

    def _used(self) -> int:
        return sum(self.size.values())

    def _took(self, victim: int | None) -> None:
        if victim is None:
            assert not self.evictable, "evict() found nothing although keys are evictable"
            return
        assert victim in self.evictable, f"evicted {victim:#x}, which is pinned or not resident"
        self.evictable.remove(victim)
        del self.size[victim]
        self.gone.append(victim)

    def _candidate(self, reuse: int) -> int:
        # Sometimes bring back a key that left, to exercise ghosts and history.
        back = [k for k in self.gone[-2 * C :] if k not in self.size]
        if reuse and back:
            return back[reuse % len(back)]
        self.n += 1
        return _key(self.n)

    def _make_room(self, size: int) -> bool:
        """Evict as the protocol says; whether an item of ``size`` fits now."""
        used = self._used()
        pinned = sum(self.size[k] for k in self.pinned)
        before = self.p.snapshot()
        victims = self.p.evict_for(size)
        if victims is None:
            assert pinned + size > self.capacity, "evict_for gave up although it could make room"
            assert self.p.snapshot() == before, "evict_for gave up but changed the policy"
            return False
        assert len(set(victims)) == len(victims)
        freed = [self.size[k] for k in victims if k in self.size]
        for victim in victims:
            self._took(victim)
        assert used - sum(freed) + size <= self.capacity, "evict_for left too little room"
        if victims:
            assert used - sum(freed[:-1]) + size > self.capacity, "evict_for evicted too much"
        else:
            assert used + size <= self.capacity
        return True

    def _refused(self, call: Callable[[], object]) -> None:
        before = self.p.snapshot()
        with pytest.raises(OversizeError):
            call()
        assert self.p.snapshot() == before, "a refused item changed the policy"

    # -- rules -----------------------------------------------------------------------
    @rule(pinned=st.booleans(), reuse=st.integers(0, 3), pick=st.integers(1, 1000))
    def insert(self, pinned: bool, reuse: int, pick: int) -> None:
        size = 1 + pick % self.max_size
        key = self._candidate(reuse)
        if not self.p.admit(key) or not self._make_room(size):
            return
        self.p.insert(key, pinned, size)
        (self.pinned if pinned else self.evictable).add(key)
        self.size[key] = size

    @rule(over=st.integers(1, 5), batch=st.booleans())
    def oversize_is_refused(self, over: int, batch: bool) -> None:
        size = self.capacity + over
        self.n += 1
        key = _key(self.n)
        with pytest.raises(OversizeError):
            self.p.evict_for(size)
        if batch:
            self._refused(lambda: self.p.insert_many([key, _key(10**9)], False, [1, size]))
        else:
            self._refused(lambda: self.p.insert(key, False, size))

    @rule(
        n=st.integers(1, 4),
        pinned=st.booleans(),
        reuse=st.integers(0, 3),
        picks=st.lists(st.integers(1, 1000), min_size=4, max_size=4),
        unit_form=st.booleans(),
    )
    def insert_many(
        self, n: int, pinned: bool, reuse: int, picks: list[int], unit_form: bool
    ) -> None:
        sizes = [1 + pick % self.max_size for pick in picks[:n]]
        while sum(sizes) > self.capacity:
            sizes.pop()
        keys: list[int] = []
        for _ in sizes:
            key = self._candidate(reuse if not keys else 0)
            if key in keys:
                break
            keys.append(key)
        # Like the pool: a declined key ends the run, the filter still sees the rest.
        keys = keys[: admit_chain(self.p.admit, keys)]
        sizes = sizes[: len(keys)]
        if not keys or not self._make_room(sum(sizes)):
            return
        if unit_form and self.max_size == 1:
            self.p.insert_many(keys, pinned)
        else:
            self.p.insert_many(keys, pinned, sizes)
        (self.pinned if pinned else self.evictable).update(keys)
        self.size.update(zip(keys, sizes, strict=True))

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
            self.size.pop(k, None)

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
        assert len(p) == len(self.evictable) + len(self.pinned) == len(self.size)
        assert p.num_evictable == len(self.evictable)
        assert p.used == self._used() <= self.capacity == p.capacity
        for k in self.size:
            assert k in p
        for k in self.gone[-4:]:
            assert (k in p) == (k in self.size)
        bare = _bare(p)
        assert bare.pinned_used == sum(self.size[k] for k in self.pinned)
        check = EXTRA_CHECKS.get(type(bare))
        if check is not None:
            check(bare)

    @invariant()
    def snapshot_is_plain_data(self) -> None:
        snap = self.p.snapshot()
        assert copy.deepcopy(snap) == snap == self.p.snapshot(), "snapshot() has side effects"


class RequestPolicyMachine(PolicyMachine):
    """:class:`PolicyMachine` plus whole requests: chains of keys that grow and branch, each
    told to the policy's ``on_request`` (with the hit it found) before its new keys go in."""

    def __init__(self) -> None:
        super().__init__()
        self.convs: list[list[int]] = []
        self.now = 0.0

    @rule(
        conv=st.integers(0, 4),
        grow=st.integers(0, 3),
        branch=st.booleans(),
        dt=st.sampled_from([0.0, 0.3, 2.0, 40.0, 900.0]),
        picks=st.lists(st.integers(1, 1000), min_size=3, max_size=3),
    )
    def request(self, conv: int, grow: int, branch: bool, dt: float, picks: list[int]) -> None:
        self.now += dt
        known = conv < len(self.convs)
        chain = list(self.convs[conv]) if known else []
        if branch and len(chain) > 1:
            chain = chain[: len(chain) // 2]
        for _ in range(grow):
            self.n += 1
            chain.append(_key(self.n))
        if not chain:
            return
        if known:
            self.convs[conv] = chain
        else:
            self.convs.append(chain)
        hit = 0
        while hit < len(chain) and chain[hit] in self.size:
            hit += 1
        self.p.on_request(chain, hit, self.now, None)  # type: ignore[attr-defined]
        hits = chain[:hit]
        first = [k for k in hits if k in self.evictable]
        self.p.pin_many(first)
        self.p.access_many(hits)
        self.evictable.difference_update(first)
        self.pinned.update(first)
        for i, key in enumerate(chain[hit:]):
            if key in self.size:
                continue
            size = 1 + picks[i % len(picks)] % self.max_size
            if not self._make_room(size):
                break  # a chain cached past a missing block is useless
            self.p.insert(key, True, size)
            self.pinned.add(key)
            self.size[key] = size


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


@pytest.mark.parametrize("name", available_policies())
def test_a_byte_budget_evicts_until_the_item_fits(name: str) -> None:
    p = make_policy(name)
    p.bind(100, typical_size=10)
    assert (p.capacity, p.key_capacity, p.used) == (100, 10, 0)
    p.insert_many([1, 2, 3], False, [30, 30, 30])
    p.insert(4, pinned=True, size=10)
    assert p.used == 100
    first = p.evict_for(1)  # full: one 30-unit key goes, whichever the policy picks
    assert first is not None and len(first) == 1 and p.used == 70 and len(p) == 3
    assert p.evict_for(30) == [], "it fits already"
    victims = p.evict_for(90)  # both remaining 30-unit keys must go
    assert victims is not None and len(victims) == 2 and p.used == 10
    assert 4 not in victims, "a pinned key is never a victim"
    assert p.evict_for(91) is None and p.used == 10, "the pinned 10 units cannot make room"
    with pytest.raises(OversizeError, match=r"size 101 cannot fit .* capacity 100"):
        p.evict_for(101)
    with pytest.raises(OversizeError):
        p.insert(5, size=101)
    with pytest.raises(ConfigError, match="positive"):
        p.insert(5, size=0)
    assert len(p) == 1 and p.used == 10


def test_unit_sizes_keep_no_size_entries() -> None:
    """The device pool's blocks are size 1: no per-key size is stored for them."""
    for name in available_policies():
        p: Any = _bare(make_policy(name))
        p.bind(8)
        p.insert_many([1, 2, 3], True)
        p.insert(4)
        p.insert_many([5], False, [1])
        assert p._sizes == {} and p.used == 5 and p.pinned_used == 3, name
        assert p.evict_for(4) == [4], name


def test_binding_checks_its_arguments() -> None:
    p = make_policy("lru")
    with pytest.raises(ConfigError, match="bind"):
        p.evict_for(1)  # unbound: no capacity to fit into
    for capacity, typical in ((0, 1), (8, 0), (8, 9), (True, 1)):
        with pytest.raises(ConfigError):
            p.bind(capacity, typical)  # type: ignore[arg-type]


def test_admit_chain_cuts_at_the_first_decline_and_shows_every_key() -> None:
    asked: list[int] = []

    def admit(key: int) -> bool:
        asked.append(key)
        return key != 3

    assert admit_chain(admit, [1, 2, 3, 4, 5]) == 2
    assert asked == [1, 2, 3, 4, 5], "the filter sees the whole chain"
    assert admit_chain(admit, []) == 0
    assert admit_chain(admit, [1, 2]) == 2


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


# The manager machine once more under every other shipped policy: its rollback
# check compares each policy's whole snapshot (ghosts, counts, heaps) after every
# failed call, not only an LRU order.
for _name in sorted(set(available_policies()) - {"lru", "s3fifo"}):
    _managed: Any = type(
        f"ManagerMachine_{_name}",
        (ManagerMachine,),
        {"policy_factory": staticmethod(lambda name=_name: name)},
    )
    _case = _managed.TestCase
    _case.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
    globals()[f"TestManagerMachine_{_name}"] = _case
del _name, _managed, _case
