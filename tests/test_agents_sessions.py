"""The workflow policy's session book against a plain model of what it must say."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.agents.sessions import (
    HIGH_MARGIN,
    HIGH_Q,
    LOW_Q,
    MIN_HOLD,
    TRUST_MIN,
    TRUST_WINDOW,
    TYPICAL_Q,
    WAIT_WEIGHT,
    SessionBook,
    SessionStep,
)
from kvtier.errors import InternalInvariantError
from kvtier.hints import Hints


@dataclass
class _Model:
    """What the book should remember of one session."""

    keys: list[int] = field(default_factory=list)
    since: float = 0.0
    ttl: float | None = None
    until: float = 0.0
    hinted: bool = False
    pause: float = 0.0
    arrived: float = 0.0


class SessionBookMachine(RuleBasedStateMachine):
    """Requests of a few sessions, continuing or not, hinted or not, ending or not."""

    def __init__(self) -> None:
        super().__init__()
        self.book = SessionBook(max_sessions=3)
        self.model: dict[str, _Model] = {}
        self.order: list[str] = []  # least recently seen first
        self.now = 0.0
        self.ended = 0
        self.next_key = 0
        self.wait = 0.0

    def _touch(self, sid: str) -> _Model:
        if sid in self.order:
            self.order.remove(sid)
        self.order.append(sid)
        rec = self.model.setdefault(sid, _Model())
        while len(self.order) > 3:
            del self.model[self.order.pop(0)]
        return rec

    @rule(
        sid=st.sampled_from("abcd"),
        grow=st.integers(0, 3),
        fresh=st.sampled_from([False, False, False, True]),
        ttl=st.sampled_from([None, None, 0.0, 1.5, 10.0]),
        wait=st.sampled_from([0.0, 0.5, 3.0, 12.0]),
        end=st.sampled_from([False] * 7 + [True]),
        progress=st.sampled_from([True, True, True, False]),
    )
    def request(
        self,
        sid: str,
        grow: int,
        fresh: bool,
        ttl: float | None,
        wait: float,
        end: bool,
        progress: bool,
    ) -> None:
        self.now += wait
        old = self.model.get(sid)
        # A continuing request extends the session's chain; a fresh one starts another.
        base = [] if old is None or fresh else old.keys
        keys = base + list(range(self.next_key, self.next_key + grow + 1))
        self.next_key += grow + 1
        stretch = self.book.stretch
        step = self.book.observe(
            Hints(session_id=sid, cache_ttl_s=ttl, session_end=end or None), keys, self.now,
            progress,
        )  # fmt: skip
        if end and not progress and old is None:
            # The finish of the request that ended it: nothing recorded, nothing ended again.
            assert step == SessionStep()
            return
        rec = self._touch(sid)
        waited = progress and old is not None and old.arrived > 0.0
        if waited:
            w = max(self.now - rec.arrived, 0.0)
            self.wait = w if self.wait <= 0.0 else self.wait + WAIT_WEIGHT * (w - self.wait)
            rec.arrived = 0.0
        if end:
            assert step == SessionStep(ended=step.ended)
            assert step.ended is not None and step.ended.keys == rec.keys
            del self.model[sid]
            self.order.remove(sid)
            self.ended += 1
            return
        hinted_before = bool(rec.ttl) or rec.hinted
        if not ttl and hinted_before and progress:
            assert step.release is not None
            assert list(step.release[0]) == rec.keys and step.release[1] == rec.until
        else:
            assert step.release is None
        continued = old is not None and not fresh and len(old.keys) > 1
        if progress and continued and rec.since > 0.0 and not waited:
            pause = self.now - rec.since
            rec.pause = pause if rec.pause <= 0.0 else 0.5 * (rec.pause + pause)
        previous = rec.until
        rec.since, rec.hinted, rec.ttl, rec.keys = self.now, hinted_before, ttl, keys
        if ttl:
            # Followed while TTLs have not proved worse than the pauses seen.
            seen = self.book.pauses_for(None)
            followed = self.book.hints_trusted or seen.typical <= 0.0
            rec.until = self.now + (ttl * stretch if followed else seen.typical) + self.wait
        elif rec.pause > 0.0 and not hinted_before:
            rec.until = self.now + 2.0 * rec.pause + self.wait
        else:
            assert step.pin is None
            return
        assert step.pin is not None
        pin_keys, until, replacing = step.pin
        assert list(pin_keys) == keys and replacing == previous
        assert until == pytest.approx(rec.until)
        rec.until = until

    @rule(
        sid=st.sampled_from("abcd"),
        wait=st.sampled_from([0.0, 0.5, 3.0, 12.0]),
        end=st.sampled_from([False] * 5 + [True]),
    )
    def arrive(self, sid: str, wait: float, end: bool) -> None:
        """A request of ``sid`` is queued: a known session is held until it is served."""
        self.now += wait
        rec = self.model.get(sid)
        step = self.book.arrive(Hints(session_id=sid, session_end=end or None), self.now)
        if rec is None or not rec.keys or (rec.arrived > 0.0 and rec.until > self.now):
            assert step == SessionStep()
            return
        if rec.arrived <= 0.0 and rec.since > 0.0:
            # The pause ends when the request arrives, however long it then waits.
            pause = self.now - rec.since
            rec.pause = pause if rec.pause <= 0.0 else 0.5 * (rec.pause + pause)
        previous = rec.until
        if rec.arrived <= 0.0:
            rec.arrived = self.now
        rec.until = self.now + max(MIN_HOLD, self.wait)
        assert step.pin is not None and step.release is None and step.ended is None
        pin_keys, until, replacing = step.pin
        assert list(pin_keys) == rec.keys and replacing == previous
        assert until == pytest.approx(rec.until)
        rec.until = until

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def end_by_endpoint(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        ended = self.book.end(sid)
        assert ended is not None and ended.keys == self.model.pop(sid).keys
        self.order.remove(sid)
        self.ended += 1
        assert self.book.end(sid) is None

    @invariant()
    def agrees(self) -> None:
        assert len(self.book) == len(self.model) <= 3
        assert self.book.ended == self.ended
        assert 1.0 <= self.book.stretch <= 4.0
        assert self.book.wait == pytest.approx(self.wait)
        for sid, rec in self.model.items():
            got = self.book.get(sid)
            assert got is not None and got.keys == rec.keys and got.since == rec.since
            assert got.arrived == rec.arrived and got.pause == pytest.approx(rec.pause)
        assert self.book.live(self.now) == sum(r.until > self.now for r in self.model.values())


SessionBookMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30)
TestSessionBook = SessionBookMachine.TestCase


@given(st.lists(st.floats(0.1, 10.0), min_size=32, max_size=96))
def test_the_stretch_is_the_80th_percentile_ratio_clamped_to_one_to_four(
    pauses: list[float],
) -> None:
    book = SessionBook()
    ttl = 2.0
    keys = [1, 2, 3]
    now = 1.0
    book.observe(Hints(session_id="s", cache_ttl_s=ttl), keys, now, True)
    ratios: list[float] = []
    for pause in pauses:
        now += pause
        keys = [*keys, len(keys) + 1]
        book.observe(Hints(session_id="s", cache_ttl_s=ttl), keys, now, True)
        ratios.append(pause / ttl)
    # Re-estimated every 32 ratios, from all of them seen so far.
    seen = sorted(ratios[: 32 * (len(ratios) // 32)])
    expected = min(max(seen[int(0.8 * (len(seen) - 1))], 1.0), 4.0)
    assert book.stretch == pytest.approx(expected)


def test_a_step_without_a_session_is_an_internal_error() -> None:
    with pytest.raises(InternalInvariantError, match="session_id"):
        SessionBook().observe(Hints(cache_ttl_s=1.0), [1], 0.0, True)


def test_a_session_comes_back_when_its_request_arrives_not_when_it_is_served() -> None:
    """A busy server's queue is not its sessions' pause: the pause ends at the arrival,
    and the wait after it is learned separately, to hold the next arrivals."""
    book = SessionBook()
    h = Hints(session_id="s", cache_ttl_s=2.0)
    book.observe(h, [1, 2], 0.0, True)
    book.observe(h, [1, 2, 3], 1.0, False)  # finished at 1.0: the pause starts
    step = book.arrive(h, 3.5)  # back after 2.5 s
    rec = book.get("s")
    assert rec is not None and rec.pause == pytest.approx(2.5) and rec.arrived == 3.5
    # Nothing learned about waits yet: held for MIN_HOLD, superseding the TTL pin.
    assert step.pin == ([1, 2, 3], 3.5 + MIN_HOLD, 1.0 + 2.0)
    assert book.arrive(h, 4.0) == SessionStep()  # already waiting and held
    step = book.observe(h, [1, 2, 3, 4], 13.5, True)  # served 10 s later
    assert rec.pause == pytest.approx(2.5) and rec.arrived == 0.0
    assert book.wait == pytest.approx(10.0)
    assert step.pin == ([1, 2, 3, 4], 13.5 + 2.0 + 10.0, 3.5 + MIN_HOLD)
    book.observe(h, [1, 2, 3, 4], 14.0, False)
    # The next arrival is held for as long as requests have been waiting, and a
    # pause's pin ends that much later too (its request will wait as well).
    step = book.arrive(h, 16.0)
    assert step.pin is not None and step.pin[1] == pytest.approx(16.0 + 10.0)
    step = book.observe(h, [1, 2, 3, 4, 5], 17.0, True)  # served after 1 s this time
    wait = 10.0 + WAIT_WEIGHT * (1.0 - 10.0)
    assert book.wait == pytest.approx(wait)
    assert step.pin is not None and step.pin[1] == pytest.approx(17.0 + 2.0 + wait)


def test_a_hold_is_renewed_while_the_request_waits() -> None:
    book = SessionBook()
    h = Hints(session_id="s", cache_ttl_s=1.0)
    book.observe(h, [7], 0.0, True)
    assert book.arrive(h, 2.0).pin is not None
    # Still waiting, or cancelled and another came: once the hold has run out it is
    # renewed, and the wait counts from the first arrival.
    assert book.arrive(h, 2.5) == SessionStep()
    step = book.arrive(h, 2.0 + MIN_HOLD + 0.5)
    assert step.pin is not None and step.pin[2] == 2.0 + MIN_HOLD
    book.observe(h, [7, 8], 5.0, True)
    assert book.wait == pytest.approx(3.0)
    assert book.arrive(Hints(session_id="unknown"), 9.0) == SessionStep()
    # The last request of a session still needs its blocks: held like any other.
    step = book.arrive(Hints(session_id="s", session_end=True), 9.0)
    assert step.pin is not None and step.pin[0] == [7, 8]
    with pytest.raises(InternalInvariantError, match="session_id"):
        book.arrive(Hints(cache_ttl_s=1.0), 9.0)


def test_a_kinds_pauses_bound_its_wrong_ttls() -> None:
    """Once an agent kind has paused often enough, a TTL far outside its pauses is taken
    for a wrong hint: brought up to most of them, or down to a margin past nearly all."""
    book = SessionBook()
    now = 1.0
    pauses = [2.0, 2.5, 3.0, 3.0, 3.5, 4.0, 2.2, 2.8]
    for i, pause in enumerate(pauses):
        h = Hints(session_id=f"s{i}", agent_id="coder", cache_ttl_s=pause * 1.2)
        book.observe(h, [i, 100 + i], now, True)
        book.arrive(h, now + pause)  # back after its pause: learned per kind
        book.observe(h, [i, 100 + i, 200 + i], now + pause, True)
        now += 10.0
    kind = book.kind("coder")
    assert kind is not None and list(kind.pauses) == pytest.approx(pauses)
    ordered = sorted(kind.pauses)
    low, high = ordered[int(LOW_Q * 7)], ordered[int(HIGH_Q * 7)] * HIGH_MARGIN
    assert (kind.low, kind.high) == (low, high)

    def pinned_for(ttl: float, agent: str | None = "coder") -> float:
        step = book.observe(Hints(session_id="x", agent_id=agent, cache_ttl_s=ttl), [9], now, True)
        assert step.pin is not None
        book.end("x")
        return step.pin[1] - now - book.wait

    assert pinned_for(3.6) == pytest.approx(3.6 * book.stretch)  # within the range: as hinted
    assert pinned_for(0.3) == pytest.approx(low)  # 10x too short
    assert pinned_for(60.0) == pytest.approx(high)  # 20x too long
    assert pinned_for(60.0, "planner") == pytest.approx(60.0 * book.stretch)  # a kind unseen
    # Too few pauses of a kind bound nothing.
    few = SessionBook()
    few.observe(Hints(session_id="a", agent_id="k", cache_ttl_s=1.0), [1, 2], 1.0, True)
    few.observe(Hints(session_id="a", agent_id="k", cache_ttl_s=1.0), [1, 2, 3], 5.0, True)
    k = few.kind("k")
    assert k is not None and (k.low, k.high) == (0.0, float("inf"))


def _paused_sessions(book: SessionBook, pauses: list[float], ttls: list[float], kind: str) -> float:
    """One session per pause: hinted ``ttl``, back after ``pause``; the clock after them."""
    now = 1.0
    for i, (pause, ttl) in enumerate(zip(pauses, ttls, strict=True)):
        h = Hints(session_id=f"{kind}{i}", agent_id=kind, cache_ttl_s=ttl)
        book.observe(h, [i, 1000 + i], now, True)
        book.arrive(h, now + pause)
        book.observe(h, [i, 1000 + i, 2000 + i], now + pause, True)
        book.end(f"{kind}{i}")
        now += pause + 1.0
    return now


def _pinned_for(book: SessionBook, ttl: float, kind: str, now: float) -> float:
    step = book.observe(Hints(session_id="x", agent_id=kind, cache_ttl_s=ttl), [9], now, True)
    assert step.pin is not None
    book.end("x")
    return step.pin[1] - now - book.wait


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_ttls_off_by_random_factors_give_way_to_the_pauses_seen(seed: int) -> None:
    """TTLs wrong by 2-10x either way, for pauses that vary little: once enough hinted
    pauses are judged, a session is pinned for what most pauses of its kind last."""
    import math
    import random

    rng = random.Random(seed)
    pauses = [rng.lognormvariate(math.log(4.0), 0.35) for _ in range(TRUST_MIN + 48)]
    ttls = [p * rng.uniform(2.0, 10.0) ** rng.choice((-1, 1)) for p in pauses]
    book = SessionBook()
    now = _paused_sessions(book, pauses, ttls, "coder")
    assert not book.hints_trusted
    kind = book.kind("coder")
    assert kind is not None and kind.typical > 0.0
    ordered = sorted(kind.pauses)
    assert kind.typical == ordered[int(TYPICAL_Q * (len(ordered) - 1))]
    assert kind.median == ordered[(len(ordered) - 1) // 2]
    # Whatever the TTL says: the kind's typical pause, within its range.
    for ttl in (0.4, 4.0, 40.0):
        assert _pinned_for(book, ttl, "coder", now) == pytest.approx(kind.bound(kind.typical))
    # Hints that come right again are followed again, once they dominate the window.
    good = [rng.lognormvariate(math.log(4.0), 0.35) for _ in range(TRUST_WINDOW)]
    now = _paused_sessions(book, good, [p * 1.2 for p in good], "coder")
    assert book.hints_trusted
    assert _pinned_for(book, 5.0, "coder", now) == pytest.approx(kind.bound(5.0 * book.stretch))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_ttls_a_little_noisy_for_pauses_that_vary_widely_are_followed(seed: int) -> None:
    """An application's estimate of a tool's latency, off by up to 25%, for latencies
    that vary by 30x: far better than any typical pause, so the hints keep ranking."""
    import math
    import random

    rng = random.Random(seed)
    pauses = [rng.lognormvariate(math.log(3.0), 1.0) for _ in range(TRUST_MIN + 48)]
    ttls = [p * rng.uniform(0.8, 1.25) for p in pauses]
    book = SessionBook()
    now = _paused_sessions(book, pauses, ttls, "tool")
    assert book.hints_trusted
    assert _pinned_for(book, 2.5, "tool", now) == pytest.approx(
        book.kind("tool").bound(2.5 * book.stretch)  # type: ignore[union-attr]
    )
