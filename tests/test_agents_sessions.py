"""The workflow policy's session book against a plain model of what it must say."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.agents.sessions import SessionBook, SessionStep
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
        if progress and continued and rec.since > 0.0:
            pause = self.now - rec.since
            rec.pause = pause if rec.pause <= 0.0 else 0.5 * (rec.pause + pause)
        previous = rec.until
        rec.since, rec.hinted, rec.ttl, rec.keys = self.now, hinted_before, ttl, keys
        if ttl:
            rec.until = self.now + ttl * stretch
        elif rec.pause > 0.0 and not hinted_before:
            rec.until = self.now + 2.0 * rec.pause
        else:
            assert step.pin is None
            return
        assert step.pin is not None
        pin_keys, until, replacing = step.pin
        assert list(pin_keys) == keys and replacing == previous
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
        for sid, rec in self.model.items():
            got = self.book.get(sid)
            assert got is not None and got.keys == rec.keys and got.since == rec.since
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
