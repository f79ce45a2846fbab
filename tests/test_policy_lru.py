"""The LRU policy and the policy registry."""

from __future__ import annotations

import sys
import types
from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import ConfigError, EvictionPolicy, InternalInvariantError, LRUPolicy, make_policy
from kvtier.policy import available_policies, register_policy


def test_lru_order_follows_release_time() -> None:
    p = LRUPolicy()
    for k in (1, 2, 3):
        p.insert(k, pinned=True)
    assert p.evict() is None, "pinned keys are never victims"
    p.unpin(2)
    p.unpin(1)
    p.unpin(3)
    assert p.num_evictable == 3 and len(p) == 3
    p.pin(2)
    p.unpin(2)  # 2 is now the most recent
    assert [p.evict(), p.evict(), p.evict(), p.evict()] == [1, 3, 2, None]
    assert len(p) == 0


def test_access_refreshes_and_remove_forgets() -> None:
    p = LRUPolicy()
    for k in (1, 2, 3):
        p.insert(k)
    p.access(1)
    p.remove(2)
    p.remove(99)  # unknown keys are ignored
    assert 2 not in p and 1 in p
    assert [p.evict(), p.evict()] == [3, 1]
    p.insert(5, pinned=True)
    p.remove(5)
    assert len(p) == 0


def test_lru_misuse_is_an_invariant_error() -> None:
    p = LRUPolicy()
    p.insert(1)
    with pytest.raises(InternalInvariantError):
        p.unpin(1)
    p.pin(1)
    with pytest.raises(InternalInvariantError):
        p.pin(1)


def test_registry_by_name_and_import_path() -> None:
    assert "lru" in available_policies()
    assert isinstance(make_policy("LRU"), LRUPolicy)
    module = types.ModuleType("my_policies")

    class MyPolicy(LRUPolicy):
        name = "mine"

    module.MyPolicy = MyPolicy  # type: ignore[attr-defined]
    sys.modules["my_policies"] = module
    try:
        assert isinstance(make_policy("my_policies:MyPolicy"), MyPolicy)
        assert isinstance(make_policy("my_policies.MyPolicy"), MyPolicy)
        assert isinstance(make_policy("my_policies:MyPolicy"), EvictionPolicy)
    finally:
        del sys.modules["my_policies"]
    with pytest.raises(ConfigError, match="unknown policy"):
        make_policy("nonsense")
    with pytest.raises(ConfigError, match="cannot import"):
        make_policy("no_such_module_xyz:Foo")
    with pytest.raises(ConfigError, match="has no policy class"):
        make_policy("collections:NoSuchThing")
    with pytest.raises(ConfigError, match="does not implement"):
        make_policy("collections:OrderedDict")
    with pytest.raises(ConfigError, match="rejected its arguments"):
        make_policy("lru", capacity=3)
    with pytest.raises(ConfigError, match="already registered"):
        register_policy("lru", MyPolicy)


class LRUMachine(RuleBasedStateMachine):
    """LRU against a reference: an ordered dict of evictable keys and a pinned set."""

    def __init__(self) -> None:
        super().__init__()
        self.p = LRUPolicy()
        self.order: OrderedDict[int, None] = OrderedDict()
        self.pinned: set[int] = set()
        self.next = 0

    @rule(pinned=st.booleans())
    def insert(self, pinned: bool) -> None:
        self.next += 1
        self.p.insert(self.next, pinned)
        if pinned:
            self.pinned.add(self.next)
        else:
            self.order[self.next] = None

    @precondition(lambda self: bool(self.order))
    @rule(i=st.integers(0, 100))
    def pin(self, i: int) -> None:
        k = list(self.order)[i % len(self.order)]
        self.p.pin(k)
        del self.order[k]
        self.pinned.add(k)

    @precondition(lambda self: bool(self.pinned))
    @rule(i=st.integers(0, 100))
    def unpin(self, i: int) -> None:
        k = sorted(self.pinned)[i % len(self.pinned)]
        self.p.unpin(k)
        self.pinned.remove(k)
        self.order[k] = None

    @precondition(lambda self: bool(self.order))
    @rule(i=st.integers(0, 100))
    def access(self, i: int) -> None:
        k = list(self.order)[i % len(self.order)]
        self.p.access(k)
        self.order.move_to_end(k)

    @rule()
    def evict(self) -> None:
        got = self.p.evict()
        if not self.order:
            assert got is None
        else:
            assert got == self.order.popitem(last=False)[0]
            assert got not in self.pinned

    @precondition(lambda self: bool(self.order) or bool(self.pinned))
    @rule(i=st.integers(0, 100))
    def remove(self, i: int) -> None:
        keys = sorted([*self.order, *self.pinned])
        k = keys[i % len(keys)]
        self.p.remove(k)
        self.order.pop(k, None)
        self.pinned.discard(k)

    @invariant()
    def sizes(self) -> None:
        assert len(self.p) == len(self.order) + len(self.pinned)
        assert self.p.num_evictable == len(self.order)


TestLRUMachine = LRUMachine.TestCase
TestLRUMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


def test_bind_sets_capacity_and_rejects_nonsense() -> None:
    p = LRUPolicy()
    p.bind(8)
    assert p.capacity == 8
    with pytest.raises(ConfigError, match="capacity"):
        p.bind(0)
