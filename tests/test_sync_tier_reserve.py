"""Property tests of ``reserve_leading``: the longest leading run of keys a tier has room for.

The engine adapters (vLLM's secondary tier, SGLang's storage, llama.cpp's
cache) store a block only with the blocks before it, so when a tier cannot
take all of a request's keys it reserves the longest leading run it can.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.integrations.sync_tier import reserve_leading
from kvtier.offload.manager import OffloadingManager

KEYS = st.integers(min_value=1, max_value=24)


@st.composite
def tier_states(draw: st.DrawFn) -> tuple[int, list[int], list[int], list[int], list[int]]:
    """(capacity, stored keys, pinned of those, keys being stored, the keys asked for)."""
    capacity = draw(st.integers(min_value=1, max_value=8))
    stored = draw(st.lists(KEYS, unique=True, max_size=capacity))
    pinned = draw(st.lists(st.sampled_from(stored), unique=True)) if stored else []
    room = capacity - len(stored)
    pending = draw(st.lists(KEYS.filter(lambda k: k not in stored), unique=True, max_size=room))
    asked = draw(st.lists(KEYS, max_size=12))
    return capacity, stored, pinned, pending, asked


def build(capacity: int, stored: list[int], pinned: list[int], pending: list[int],
          policy: str) -> OffloadingManager:
    manager = OffloadingManager(capacity, policy)
    out = manager.prepare_store(stored)
    assert out is not None
    manager.complete_store(out.keys_to_store)
    manager.prepare_load(pinned)
    assert manager.prepare_store(pending) is not None
    return manager


@settings(max_examples=300, deadline=None)
@given(state=tier_states(), policy=st.sampled_from(["lru", "arc", "s3fifo"]))
def test_the_run_reserved_is_the_longest_that_fits(
    state: tuple[int, list[int], list[int], list[int], list[int]], policy: str
) -> None:
    capacity, stored, pinned, pending, asked = state
    manager = build(capacity, stored, pinned, pending, policy)
    out, n = reserve_leading(manager, asked)
    assert 0 <= n <= len(asked)
    if out is None:
        assert n == 0
    else:
        run = asked[:n]
        # Exactly the run's keys not held were reserved, each once.
        want = list(dict.fromkeys(k for k in run if k not in stored and k not in pending))
        assert out.keys_to_store == want
        # Nothing pinned or being stored was evicted, nor a key of the run.
        assert not set(out.evicted_keys) & (set(pinned) | set(pending) | set(run))
        assert len(manager) <= capacity
        manager.complete_store(out.keys_to_store)
        manager.check()
    if n < len(asked):
        # One more key does not fit: the same tier refuses the longer run.
        again = build(capacity, stored, pinned, pending, policy)
        assert again.prepare_store(asked[: n + 1]) is None
