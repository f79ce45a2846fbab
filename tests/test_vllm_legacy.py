"""LegacyOffloadingManager against vLLM 0.12 - 0.16's OffloadingManager protocol.

No vLLM of that age is installed: the backend here is a plain-Python
stand-in with the shape of that release line's ``CPUBackend`` (``block_size``,
``medium``, ``get_num_free_blocks``, ``get_load_store_spec`` reading
``block.block_id``), and the expectations are the protocol's documented ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier import BadRequestError
from kvtier.integrations.vllm import (
    LegacyOffloadingEvent,
    LegacyOffloadingManager,
    LegacyPrepareStoreOutput,
)
from kvtier.integrations.vllm.legacy import SlotBlock, block_hash_key
from kvtier.policy import available_policies, make_policy


class Spec:
    """What the old CPULoadStoreSpec carried: the CPU block ids."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids


class Backend:
    """The old CPUBackend's shape; its allocator is unused by the adapter."""

    def __init__(self, num_blocks: int, block_size: int = 256) -> None:
        self.block_size = block_size
        self.medium = "CPU"
        self.num_blocks = num_blocks
        self.spec_calls: list[tuple[list[bytes], list[SlotBlock]]] = []

    def get_num_free_blocks(self) -> int:
        return self.num_blocks

    def get_load_store_spec(self, block_hashes: Iterable[bytes], blocks: Iterable[Any]) -> Spec:
        hashes, blocks = list(block_hashes), list(blocks)
        self.spec_calls.append((hashes, blocks))
        return Spec([b.block_id for b in blocks])


def H(name: str) -> bytes:
    return name.encode()


def hs(*names: str) -> list[bytes]:
    return [H(n) for n in names]


def names(hashes: Iterable[bytes]) -> list[str]:
    return [h.decode() for h in hashes]


def store(m: LegacyOffloadingManager, *blocks: str, success: bool = True) -> list[str]:
    out = m.prepare_store(hs(*blocks))
    assert out is not None
    m.complete_store(out.block_hashes_to_store, success)
    return names(out.block_hashes_evicted)


def test_protocol_walkthrough_lru() -> None:
    backend = Backend(4)
    m = LegacyOffloadingManager(backend, "lru", enable_events=True)
    assert m.lookup(hs("a", "b")) == 0
    out = m.prepare_store(hs("a", "b", "c"))
    assert isinstance(out, LegacyPrepareStoreOutput)
    assert names(out.block_hashes_to_store) == ["a", "b", "c"]
    assert out.block_hashes_evicted == []
    assert out.store_spec.block_ids == [0, 1, 2]
    assert [b.ref_cnt for b in backend.spec_calls[-1][1]] == [-1, -1, -1]
    # Being stored: not loadable yet.
    assert m.lookup(hs("a")) == 0
    m.complete_store(hs("a", "b", "c"))
    assert m.lookup(hs("a", "b", "c", "d")) == 3
    assert m.lookup(hs("b", "x", "c")) == 1
    events = list(m.take_events())
    assert events == [LegacyOffloadingEvent(hs("a", "b", "c"), 256, "CPU", False)]
    assert list(m.take_events()) == []

    # Already held blocks are not stored twice.
    out = m.prepare_store(hs("a", "d"))
    assert out is not None and names(out.block_hashes_to_store) == ["d"]
    assert out.store_spec.block_ids == [3]
    m.complete_store(hs("d"))

    # Load a and b: pinned until complete_load.
    spec = m.prepare_load(hs("a", "b"))
    assert spec.block_ids == [0, 1]
    m.touch(hs("c"))
    out = m.prepare_store(hs("e", "f"))
    # LRU order: a, b pinned; d is older than c (c was touched): d then c go.
    assert out is not None and names(out.block_hashes_evicted) == ["d", "c"]
    assert sorted(out.store_spec.block_ids) == [2, 3]
    m.complete_store(hs("e", "f"))
    # g needs one slot: e, the older of the two unpinned blocks, goes.
    out = m.prepare_store(hs("g"))
    assert out is not None and names(out.block_hashes_evicted) == ["e"]
    m.complete_load(hs("a", "b"))
    assert list(m.take_events()) == [
        LegacyOffloadingEvent(hs("d"), 256, "CPU", False),
        LegacyOffloadingEvent(hs("d", "c"), 256, "CPU", True),
        LegacyOffloadingEvent(hs("e", "f"), 256, "CPU", False),
        LegacyOffloadingEvent(hs("e"), 256, "CPU", True),
    ]
    m.check()


@pytest.mark.parametrize("policy", available_policies())
def test_pinned_and_pending_blocks_are_never_evicted(policy: str) -> None:
    m = LegacyOffloadingManager(Backend(3), policy, enable_events=True)
    assert store(m, "a", "b") == []
    m.prepare_load(hs("a"))
    out = m.prepare_store(hs("c"))
    assert out is not None
    # a is loading, c is being stored: b is the only candidate for two blocks.
    assert m.prepare_store(hs("x", "y")) is None
    assert m.lookup(hs("a", "b")) == 2
    assert store(m, "x") == ["b"]
    m.complete_store(hs("c"))
    m.complete_load(hs("a"))
    assert len(store(m, "y")) == 1
    m.check()


@pytest.mark.parametrize("policy", available_policies())
def test_failed_store_releases_its_blocks(policy: str) -> None:
    m = LegacyOffloadingManager(Backend(2), policy, enable_events=True)
    out = m.prepare_store(hs("a", "b"))
    assert out is not None
    m.complete_store(hs("a", "b"), success=False)
    assert m.lookup(hs("a")) == 0 and len(m) == 0
    assert list(m.take_events()) == []
    assert store(m, "a", "b") == []
    assert m.lookup(hs("a", "b")) == 2
    m.check()


def test_lookup_can_ask_to_retry_while_storing() -> None:
    m = LegacyOffloadingManager(Backend(4), "lru", retry_pending=True)
    store(m, "a")
    assert m.prepare_store(hs("a", "b")) is not None
    assert m.lookup(hs("a", "b")) is None
    assert m.lookup(hs("a", "x")) == 1
    m.complete_store(hs("b"))
    assert m.lookup(hs("a", "b")) == 2


def test_prepare_load_of_a_missing_block_is_a_typed_error() -> None:
    m = LegacyOffloadingManager(Backend(2), "lru")
    with pytest.raises(BadRequestError):
        m.prepare_load(hs("nope"))
    with pytest.raises(BadRequestError):
        m.complete_load(hs("nope"))


def test_admission_filter_declines_one_off_chains() -> None:
    m = LegacyOffloadingManager(Backend(4), "lru", admission="tinylfu")
    out = m.prepare_store(hs("a", "b"))
    # First sighting: nothing is stored.
    assert out is not None and out.block_hashes_to_store == []
    out = m.prepare_store(hs("a", "b"))
    assert out is not None and names(out.block_hashes_to_store) == ["a", "b"]


def test_policy_instance_and_int_keys() -> None:
    m = LegacyOffloadingManager(Backend(2), make_policy("fifo"))
    assert m.manager.policy.name == "fifo"
    out = m.prepare_store([5, 6])
    assert out is not None
    m.complete_store([5, 6])
    assert m.lookup([5, 6]) == 2
    assert block_hash_key(5) == 5
    assert block_hash_key(b"\x00\x05") != block_hash_key(b"\x05")
    with pytest.raises(BadRequestError):
        block_hash_key("text")


def test_events_off_by_default() -> None:
    m = LegacyOffloadingManager(Backend(2), "arc")
    store(m, "a", "b")
    assert list(m.take_events()) == []


class LegacyMachine(RuleBasedStateMachine):
    """Random protocol use: capacity holds, pinned and pending blocks survive."""

    @initialize(policy=st.sampled_from(available_policies()), capacity=st.integers(1, 5))
    def setup(self, policy: str, capacity: int) -> None:
        self.m = LegacyOffloadingManager(Backend(capacity), policy, enable_events=True)
        self.capacity = capacity
        self.ready: set[str] = set()
        self.pending: set[str] = set()
        self.readers: dict[str, int] = {}

    @rule(blocks=st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=3, unique=True),
          success=st.booleans(), complete=st.booleans())
    def store(self, blocks: list[str], success: bool, complete: bool) -> None:
        out = self.m.prepare_store(hs(*blocks))
        if out is None:
            return
        for b in names(out.block_hashes_evicted):
            assert b in self.ready and not self.readers.get(b) and b not in blocks
            self.ready.discard(b)
        new = names(out.block_hashes_to_store)
        assert new == [b for b in blocks if b not in self.ready | self.pending]
        self.pending |= set(new)
        if complete:
            self.m.complete_store(hs(*new), success)
            self.pending -= set(new)
            if success:
                self.ready |= set(new)

    @rule()
    def complete_all(self) -> None:
        done = sorted(self.pending)
        self.m.complete_store(hs(*done))
        self.pending.clear()
        self.ready |= set(done)

    @rule(blocks=st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=3, unique=True))
    def load(self, blocks: list[str]) -> None:
        n = self.m.lookup(hs(*blocks))
        assert n is not None
        expected = 0
        for b in blocks:
            if b not in self.ready:
                break
            expected += 1
        assert n == expected
        if n:
            self.m.prepare_load(hs(*blocks[:n]))
            for b in blocks[:n]:
                self.readers[b] = self.readers.get(b, 0) + 1

    @rule()
    def unload(self) -> None:
        for b, n in list(self.readers.items()):
            if n:
                self.m.complete_load(hs(b))
                self.readers[b] = n - 1

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        assert len(self.m) == len(self.ready) + len(self.pending) <= self.capacity
        self.m.check()


LegacyMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLegacy = LegacyMachine.TestCase
