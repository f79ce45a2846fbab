"""A state machine over :class:`SyncTier` on a real disk directory.

SGLang's storage backend (and any engine that calls its storage from its own
threads) rests on SyncTier's bookkeeping: which keys it holds, what a read
hands back, what a write keeps when the tier is full, and what happens when
an item is damaged, deleted behind its back, or the medium stops answering.
Hypothesis drives writes, reads, existence checks, forgets, clears, bit
flips, deleted files and outages in any order, and checks against a model:
a read never hands back bytes other than the last ones written for the key,
a held key reads back exactly, and the tier never holds more than its
capacity or leaks a reservation.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier.errors import TierUnavailableError
from kvtier.integrations.flat import FlatPages
from kvtier.integrations.sync_tier import SyncTier
from kvtier.offload.config import TierSpec
from kvtier.offload.media import PutItem, Stored

PAGE = 64
KEYS = st.integers(min_value=1, max_value=12)
RUNS = st.lists(KEYS, min_size=1, max_size=6)


class _Outage:
    """Wraps a medium; while ``down`` every call fails as an unreachable medium does."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.down = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise TierUnavailableError("the medium is down (test)")
            return attr(*args, **kwargs)

        return call


class SyncTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-synctier-"))
        self.pages = FlatPages.make(PAGE)
        self.rng = random.Random(0)
        #: The bytes last written for each key (what a read may hand back).
        self.model: dict[int, bytes] = {}
        self.tier: SyncTier | None = None
        #: Held keys whose file was damaged or deleted behind the tier's back.
        self.damaged: set[int] = set()

    @initialize(capacity=st.integers(min_value=1, max_value=6),
                policy=st.sampled_from(["lru", "arc", "s3fifo", "sieve"]))
    def build(self, capacity: int, policy: str) -> None:
        spec = TierSpec.from_url(f"disk:{self.root}?policy={policy}")
        self.tier = SyncTier(spec, "ns", capacity, self.pages.format.payload_size,
                             retry_interval_s=0.0)
        self.outage = _Outage(self.tier.medium)
        self.tier.medium = self.outage  # type: ignore[assignment]
        self.disk = self.outage._inner

    def teardown(self) -> None:
        if self.tier is not None:
            self.outage.down = False
            self.tier.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------------------
    @property
    def t(self) -> SyncTier:
        assert self.tier is not None
        return self.tier

    def held(self) -> set[int]:
        return set(self.t.offload_manager.ready_keys())

    def leading_held(self, keys: Sequence[int]) -> int:
        held = self.held()
        return next((i for i, k in enumerate(keys) if k not in held), len(keys))

    def read(self, keys: list[int]) -> tuple[list[bool], dict[int, bytes]]:
        got: dict[int, bytes] = {}
        out = torch.empty(PAGE, dtype=torch.uint8)

        def fill(i: int, stored: Stored) -> None:
            self.pages.decode_into(stored, keys[i], out)
            got[i] = out.numpy().tobytes()

        return self.t.read(keys, fill), got

    # -- rules -----------------------------------------------------------------------------
    @rule(keys=RUNS)
    def write(self, keys: list[int]) -> None:
        before = self.held()
        fresh = {k: self.rng.randbytes(PAGE) for k in keys}

        def item(i: int) -> PutItem:
            payload = torch.frombuffer(bytearray(fresh[keys[i]]), dtype=torch.uint8)
            return (keys[i], 0, self.pages.encode(payload), self.pages.format)

        held = self.t.write(keys, item)
        assert len(held) == len(keys)
        if self.outage.down:
            # Nothing was written; only keys held before may be reported held.
            assert all(k in before for k, h in zip(keys, held, strict=True) if h)
            return
        # What is held afterwards is a leading run of what was asked, all of it held.
        n = next((i for i, h in enumerate(held) if not h), len(held))
        assert not any(held[n:]), held
        assert set(keys[:n]) <= self.held()
        for k in dict.fromkeys(keys[:n]):
            if k not in before:
                self.model[k] = fresh[k]  # a key held already is not written again

    @rule(keys=RUNS)
    def read_back(self, keys: list[int]) -> None:
        held = self.held()
        ok, got = self.read(keys)
        for i, k in enumerate(keys):
            if ok[i]:
                assert got[i] == self.model[k], f"key {k}: wrong bytes served"
        if self.outage.down:
            assert ok == [False] * len(keys)
            return
        for i, k in enumerate(keys):
            if k in self.damaged:
                assert not ok[i], f"key {k}: a damaged item was served"
            else:
                assert ok[i] == (k in held), (k, ok[i], k in held)
        for k in set(keys) & self.damaged:
            # Dropped from the bookkeeping, and a damaged file purged from the disk.
            assert k not in self.held() and not self.disk.path(k).exists()

    @rule(keys=RUNS)
    def present(self, keys: list[int]) -> None:
        # A disk tier answers from its bookkeeping alone, medium up or down.
        assert self.t.present(keys) == self.leading_held(keys)

    @rule(keys=RUNS)
    def forget(self, keys: list[int]) -> None:
        self.t.forget(keys)
        assert not set(keys) & self.held()

    @rule()
    def clear(self) -> None:
        self.t.clear()
        assert not self.held()

    @precondition(lambda self: self.tier is not None and bool(self.held() - self.damaged))
    @rule(data=st.data(), delete=st.booleans())
    def damage_a_file(self, data: st.DataObject, delete: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.held() - self.damaged)))
        path = self.disk.path(key)
        if delete:
            path.unlink()
        else:
            blob = bytearray(path.read_bytes())
            blob[data.draw(st.integers(min_value=0, max_value=len(blob) - 1))] ^= 0xFF
            path.write_bytes(bytes(blob))
        self.damaged.add(key)

    @rule(down=st.booleans())
    def set_outage(self, down: bool) -> None:
        self.outage.down = down

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def bookkeeping_holds(self) -> None:
        if self.tier is None:
            return
        m = self.t.offload_manager
        m.check()
        assert len(m) <= self.t.capacity
        # Nothing stays reserved or pinned between calls.
        assert all(m.is_ready(k) and not m.is_pinned(k) for k in m.ready_keys())
        assert len(m.ready_keys()) == len(m)

    @invariant()
    def every_held_key_is_on_disk(self) -> None:
        if self.tier is None:
            return
        self.damaged &= self.held()  # a dropped key's damage no longer matters
        for k in self.held() - self.damaged:
            assert self.disk.path(k).is_file(), f"key {k} held but its file is gone"


SyncTierMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestSyncTier = SyncTierMachine.TestCase
