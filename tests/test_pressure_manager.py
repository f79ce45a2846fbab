"""The manager under a pressure controller: admission, free-block targets, offload, threads."""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import (
    AdmissionRejectedError,
    KVCacheManager,
    Ladder,
    MemoryReading,
    Mode,
    ModeActions,
    ModeChange,
    OutOfBlocksError,
    PressureController,
    ScriptedMonitor,
)
from kvtier.pressure import DEFAULT_ACTIONS

BS = 4


def prompt(base: int, n_blocks: int, extra: int = 1) -> list[int]:
    return [base * 1000 + i for i in range(n_blocks * BS + extra)]


def gated(
    num_blocks: int, actions: dict[Mode, ModeActions] | None = None
) -> tuple[KVCacheManager, PressureController, ScriptedMonitor]:
    mgr = KVCacheManager(num_blocks, BS, policy="lru")
    mon = ScriptedMonitor(0.0)
    ladder = Ladder.from_fractions((0.5, 0.8, 0.9, 0.97), 0.05, actions or DEFAULT_ACTIONS)
    ctrl = PressureController(mon, ladder)
    mgr.set_pressure_gate(ctrl)
    return mgr, ctrl, mon


def to_mode(ctrl: PressureController, mon: ScriptedMonitor, fraction: float) -> None:
    mon.set(fraction)
    ctrl.sample()


def fill_cache(mgr: KVCacheManager, n_prompts: int, n_blocks: int) -> list[list[int]]:
    """Cache ``n_prompts`` prompts of ``n_blocks`` full blocks, oldest first; return their keys."""
    keys = []
    for p in range(n_prompts):
        tokens = prompt(p, n_blocks, extra=0)
        mgr.allocate(f"fill{p}", tokens)
        keys.append(mgr.block_keys(f"fill{p}"))
        mgr.free(f"fill{p}")
    return keys


def test_emergency_rejects_with_nothing_changed_and_recovers() -> None:
    reject = {**DEFAULT_ACTIONS, Mode.EMERGENCY: ModeActions(admission="reject")}
    mgr, ctrl, mon = gated(16, reject)
    mgr.allocate("a", prompt(1, 2))
    to_mode(ctrl, mon, 0.99)
    before = (mgr.stats(), list(mgr.pool.ref), len(mgr))
    with pytest.raises(AdmissionRejectedError, match="EMERGENCY"):
        mgr.allocate("b", prompt(1, 2))
    assert (mgr.stats(), list(mgr.pool.ref), len(mgr)) == before
    assert "b" not in mgr
    # Running requests still grow under EMERGENCY: only new ones are held back.
    mgr.extend("a", [7] * BS)
    to_mode(ctrl, mon, 0.3)
    alloc = mgr.allocate("b", prompt(1, 2))
    assert alloc.num_cached_tokens == 2 * BS  # the prefix "a" published is a hit
    mgr.check()


def test_critical_evicts_to_the_free_target_in_lru_order() -> None:
    mgr, ctrl, mon = gated(20)
    keys = fill_cache(mgr, 5, 4)  # 20 cached blocks, none empty
    assert mgr.pool.num_empty == 0
    to_mode(ctrl, mon, 0.92)  # CRITICAL: keep 10% = 2 blocks empty
    mgr.allocate("new", prompt(9, 0, extra=3))  # one block
    pool = mgr.pool
    assert pool.num_empty >= 2
    gone = [k for ks in keys for k in ks if pool.cached_block(k) is None]
    oldest = set(keys[0])
    # The least recently used prompt paid, the newest four are whole.
    assert gone and set(gone) <= oldest
    assert all(pool.cached_block(k) is not None for ks in keys[1:] for k in ks)
    assert mgr.stats().pressure_evictions == len(gone) - 1  # one went on demand
    mgr.check()


def test_relaxed_and_no_gate_evict_only_on_demand() -> None:
    for gate in (True, False):
        mgr = KVCacheManager(20, BS, policy="lru")
        if gate:
            mgr.set_pressure_gate(PressureController(ScriptedMonitor(0.1)))
        fill_cache(mgr, 5, 4)
        mgr.allocate("new", prompt(9, 0, extra=3))
        assert mgr.pool.num_empty == 0  # exactly the one block it needed was evicted
        assert mgr.stats().evictions == 1 and mgr.stats().pressure_evictions == 0


@pytest.mark.parametrize("offload", [True, False])
def test_offload_sends_target_evictions_through_the_listener(offload: bool) -> None:
    actions = {**DEFAULT_ACTIONS, Mode.CRITICAL: ModeActions(free_target=0.25, offload=offload)}
    mgr, ctrl, mon = gated(16, actions)
    keys = fill_cache(mgr, 4, 4)
    announced: list[int] = []
    mgr.add_evict_listener(lambda ks, blocks: announced.extend(ks))
    to_mode(ctrl, mon, 0.92)
    mgr.gc(0)  # any allocation-side call reaches the target; gc(0) evicts nothing itself
    assert mgr.pool.num_empty >= 4
    gone = {k for ks in keys for k in ks if mgr.pool.cached_block(k) is None}
    assert len(gone) >= 4
    assert set(announced) == (gone if offload else set())


def test_target_is_best_effort_when_requests_hold_everything() -> None:
    mgr, ctrl, mon = gated(8)
    mgr.allocate("a", prompt(1, 7))  # 8 blocks held
    to_mode(ctrl, mon, 0.95)
    mgr.extend("a", [1, 2])  # fits in the partial block: no growth, no error
    assert mgr.pool.num_empty == 0 and mgr.stats().pressure_evictions == 0
    with pytest.raises(OutOfBlocksError):
        mgr.extend("a", [3] * 2 * BS)
    mgr.check()


def test_a_stuck_monitor_never_blocks_allocation() -> None:
    entered = threading.Event()
    release = threading.Event()
    returned = threading.Event()

    class Stuck:
        name = "stuck"

        def read(self) -> MemoryReading:
            entered.set()
            # Bounded: were allocation to wait for this reading, the reading
            # would end first and the check below would fail, not hang.
            release.wait(30.0)
            returned.set()
            return MemoryReading(9, 10, self.name)

        def close(self) -> None:
            release.set()

    mgr = KVCacheManager(16, BS)
    ctrl = PressureController(ScriptedMonitor(0.1), interval=0.01)
    mgr.set_pressure_gate(ctrl)
    ctrl.start()
    ctrl.monitor = Stuck()
    entered.wait()  # the sampler thread is inside read(), holding the sampling lock
    for i in range(50):
        mgr.allocate(i, prompt(i, 1))
        mgr.free(i)
    assert not returned.is_set(), "allocation waited for the stuck reading"
    assert mgr.stats().allocations == 50 and ctrl.mode is Mode.RELAXED
    release.set()
    ctrl.close()


class GatedManager(RuleBasedStateMachine):
    """Random requests while the mode moves: bookkeeping holds, rejections change nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr, self.ctrl, self.mon = gated(24)
        self.live: list[str] = []
        self.n = 0

    @rule(base=st.integers(0, 5), blocks=st.integers(0, 5), extra=st.integers(1, 3))
    def allocate(self, base: int, blocks: int, extra: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        before = (self.mgr.stats(), list(self.mgr.pool.ref))
        try:
            self.mgr.allocate(rid, prompt(base, blocks, extra))
        except AdmissionRejectedError:
            assert self.ctrl.actions.admission != "accept"
            assert (self.mgr.stats(), list(self.mgr.pool.ref)) == before
            return
        except OutOfBlocksError:
            assert (self.mgr.stats().allocation_failures, list(self.mgr.pool.ref)) == (
                before[0].allocation_failures + 1,
                before[1],
            )
            return
        assert self.ctrl.actions.admission == "accept"
        self.live.append(rid)
        self.target_reached()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 9))
    def extend(self, data: st.DataObject, n: int) -> None:
        rid = data.draw(st.sampled_from(self.live))
        try:
            self.mgr.extend(rid, list(range(n)))
        except OutOfBlocksError:
            return
        self.target_reached()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.live))
        self.live.remove(rid)
        self.mgr.free(rid)

    @rule(fraction=st.floats(0.0, 1.0))
    def reading(self, fraction: float) -> None:
        to_mode(self.ctrl, self.mon, fraction)

    def target_reached(self) -> None:
        pool = self.mgr.pool
        target = self.ctrl.actions.target_blocks(pool.num_blocks)
        assert pool.num_empty >= target or pool.num_evictable == 0

    @invariant()
    def bookkeeping(self) -> None:
        self.mgr.check()


TestGatedManager = GatedManager.TestCase
TestGatedManager.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class _SeenMonitor(ScriptedMonitor):
    """A scripted monitor that tells a writer when the sampler has read its value."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self._read = threading.Condition()
        self._reads_seen = 0

    def read(self) -> MemoryReading:
        reading = super().read()
        with self._read:
            self._reads_seen += 1
            self._read.notify_all()
        return reading

    def set_and_wait(self, fraction: float, stop: threading.Event) -> None:
        """Set ``fraction`` and wait until a later read has returned it (or ``stop``)."""
        with self._read:
            self.set(fraction)
            target = self._reads_seen + 2  # the read in flight may predate the set
            while self._reads_seen < target and not stop.is_set():
                self._read.wait(0.05)


def test_threads_allocate_while_the_monitor_flips_modes() -> None:
    """Four client threads and a flipping monitor; the manager is driven under one lock."""
    mgr = KVCacheManager(64, BS, policy="lru")
    mon = _SeenMonitor()
    ctrl = PressureController(mon, interval=0.001)
    mgr.set_pressure_gate(ctrl)
    lock = threading.Lock()
    changes: list[ModeChange] = []
    ctrl.on_change(changes.append)
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"attempts": 0, "admitted": 0, "rejected": 0, "out": 0}
    # Each client runs until it has seen both outcomes (and made 150 attempts),
    # so both are certain, however the threads happen to interleave.
    seen_admitted, seen_rejected = threading.Event(), threading.Event()

    def flipper() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            mon.set_and_wait(rng.choice([0.1, 0.6, 0.85, 0.93, 0.99]), stop)

    def client(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in itertools.count():
                if i >= 150 and seen_admitted.is_set() and seen_rejected.is_set():
                    return
                rid = f"{seed}-{i}"
                with lock:
                    counts["attempts"] += 1
                    try:
                        mgr.allocate(rid, prompt(rng.randrange(6), rng.randrange(4)))
                    except AdmissionRejectedError as exc:
                        counts["rejected"] += 1
                        seen_rejected.set()
                        assert exc.retry
                        continue
                    except OutOfBlocksError:
                        counts["out"] += 1
                        continue
                    counts["admitted"] += 1
                    seen_admitted.set()
                with lock:
                    try:
                        mgr.extend(rid, list(range(rng.randrange(1, 6))))
                    except OutOfBlocksError:
                        counts["out"] += 1
                    mgr.check()
                with lock:
                    mgr.free(rid)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
    flip = threading.Thread(target=flipper)
    with ctrl:
        flip.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        flip.join()
    assert not errors, errors
    mgr.check()
    assert len(mgr) == 0 and mgr.pool.num_used == 0
    assert counts["admitted"] + counts["rejected"] + counts["out"] == counts["attempts"] >= 600
    assert counts["admitted"] > 0 and counts["rejected"] > 0
    # Every change was heard once, in order: each starts where the last one ended.
    assert len(changes) == ctrl.mode_changes > 0
    for a, b in itertools.pairwise(changes):
        assert a.new is b.old
    assert ctrl.rejected == counts["rejected"]
    stats = dataclasses.asdict(mgr.stats())
    assert stats["allocations"] == counts["admitted"]
