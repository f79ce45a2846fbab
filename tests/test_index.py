"""Prefix index: longest prefix, tiers, chains, versions, pins."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import BadRequestError, InternalInvariantError, PrefixIndex, Tier

D, H = int(Tier.DEVICE), int(Tier.HOST)


def chain(index: PrefixIndex, keys: list[int], tier: int = D) -> None:
    parent = None
    for i, k in enumerate(keys):
        index.add(k, parent, tier, block_id=i if tier & D else -1)
        parent = k


def test_longest_prefix_stops_at_first_miss() -> None:
    index = PrefixIndex()
    chain(index, [1, 2, 3])
    assert index.longest_prefix([1, 2, 3, 4]) == 3
    assert index.longest_prefix([1, 2, 9, 3]) == 2
    assert index.longest_prefix([9, 1, 2]) == 0
    assert index.longest_prefix([]) == 0
    # Tier masks: nothing is on the host yet.
    assert index.longest_prefix([1, 2, 3], H) == 0
    assert index.longest_prefix([1, 2, 3], D | H) == 3


def test_depth_parent_and_children() -> None:
    index = PrefixIndex()
    chain(index, [1, 2, 3])
    index.add(4, 2, D, 9)
    e = index.get(3)
    assert e is not None and e.depth == 3 and e.parent == 2
    e2 = index.get(2)
    assert e2 is not None and e2.children == {3, 4}
    index.check()


def test_adding_under_a_missing_parent_is_refused() -> None:
    index = PrefixIndex()
    with pytest.raises(BadRequestError, match="parent"):
        index.add(5, 99, D, 0)
    assert len(index) == 0


def test_drop_refuses_to_strand_children() -> None:
    index = PrefixIndex()
    chain(index, [1, 2, 3])
    with pytest.raises(InternalInvariantError, match="strand"):
        index.drop(2, D)
    for k in index.resident_subtree(1, D):
        index.drop(k, D)
    assert index.resident_subtree(1, D) == []
    index.drop(1, D)
    assert len(index) == 0


def test_resident_subtree_is_children_first() -> None:
    index = PrefixIndex()
    chain(index, [1, 2, 3, 4])
    index.add(5, 2, D, 7)
    index.add(6, 5, D, 8)
    order = index.resident_subtree(1, D)
    assert set(order) == {2, 3, 4, 5, 6}
    pos = {k: i for i, k in enumerate(order)}
    assert pos[4] < pos[3] < pos[2] and pos[6] < pos[5] < pos[2]


def test_multi_tier_and_versions() -> None:
    index = PrefixIndex()
    chain(index, [1, 2])
    v = index.get(2).version  # type: ignore[union-attr]
    assert index.is_current(2, v)
    index.add(2, 1, H)
    index.drop(2, D)
    e = index.get(2)
    assert e is not None and e.tiers == H and e.block_id == -1
    index.check()
    index.drop(2, H)
    assert not index.is_current(2, v)
    index.add(2, 1, D, 5)
    assert not index.is_current(2, v), "a re-created key must get a new version"


def test_child_on_a_tier_whose_parent_chain_is_gone_is_detected() -> None:
    index = PrefixIndex()
    index.add(1, None, H)
    index.add(2, 1, D, 0)  # device child of a host-only parent: stranded on device
    with pytest.raises(InternalInvariantError, match="parent chain"):
        index.check()


def test_pins() -> None:
    index = PrefixIndex()
    chain(index, [1])
    index.pin(1)
    index.pin(1)
    index.unpin(1)
    assert index.get(1).pins == 1  # type: ignore[union-attr]
    index.unpin(1)
    with pytest.raises(BadRequestError):
        index.unpin(1)
    with pytest.raises(BadRequestError):
        index.pin(77)


class IndexMachine(RuleBasedStateMachine):
    """Random adds and subtree evictions against a plain dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model: dict[int, int | None] = {}  # key -> parent
        self.next_key = 1

    @rule(parent_pick=st.integers(0, 1000), as_root=st.booleans())
    def add(self, parent_pick: int, as_root: bool) -> None:
        keys = sorted(self.model)
        parent = None if as_root or not keys else keys[parent_pick % len(keys)]
        key = self.next_key
        self.next_key += 1
        self.index.add(key, parent, D, key)
        self.model[key] = parent

    @precondition(lambda self: bool(self.model))
    @rule(pick=st.integers(0, 1000))
    def evict_subtree(self, pick: int) -> None:
        keys = sorted(self.model)
        victim = keys[pick % len(keys)]
        sub = self.index.resident_subtree(victim, D)
        for k in [*sub, victim]:
            self.index.drop(k, D)
            del self.model[k]
        # Nothing left whose ancestor chain is broken.
        for p in self.model.values():
            assert p is None or p in self.model

    @rule(keys=st.lists(st.integers(1, 60), max_size=8))
    def lookup(self, keys: list[int]) -> None:
        expected = 0
        for k in keys:
            if k not in self.model:
                break
            expected += 1
        assert self.index.longest_prefix(keys) == expected

    @invariant()
    def consistent(self) -> None:
        self.index.check()
        assert len(self.index) == len(self.model)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_drop_from_device_refuses_while_a_child_is_on_device() -> None:
    index = PrefixIndex()
    chain(index, [1, 2])
    index.add(1, None, H)
    with pytest.raises(InternalInvariantError, match="strand"):
        index.drop(1, D)
    index.add(2, 1, H)
    index.drop(2, D)
    index.drop(1, D)  # both now on the host only: the chain holds there
    index.check()
