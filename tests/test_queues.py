"""The engine's request queues against a plain model of them (a hypothesis state machine).

Every operation the scheduler, migration and the prefetcher perform is
applied both to :class:`~kvtier.engine.queues.RequestQueues` and to plain
lists; after every step the two agree, every queued sequence is in exactly
one place, running sequences stay in admission order, and each request's
record holds exactly its queued choices. Unready keys are checked against
a ``Counter``.
"""

from __future__ import annotations

import collections

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.engine.detok import IncrementalDetokenizer
from kvtier.engine.queues import RequestQueues, Slot, UnreadyKeys
from kvtier.engine.request import RequestMetrics
from kvtier.engine.request import Sequence as Seq
from kvtier.engine.sampling import Sampler, SamplingParams


def _seq(request_id: str, index: int = 0) -> Seq:
    params = SamplingParams()
    return Seq(
        request_id,
        [1, 2, 3],
        params,
        Sampler(params),
        IncrementalDetokenizer(None),
        RequestMetrics(0.0, 3),
        index=index,
        seq_id=request_id if index == 0 else f"{request_id}#{index}",
    )


class QueuesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.q = RequestQueues()
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.groups: dict[str, list[Seq]] = {}
        self.detached: list[tuple[Seq, Slot]] = []
        self.unready_model: collections.Counter[int] = collections.Counter()
        self.n = 0

    def _new(self) -> Seq:
        self.n += 1
        return _seq(f"r{self.n}")

    @rule(front=st.booleans())
    def add(self, front: bool) -> None:
        seq = self._new()
        self.q.add(seq, front=front)
        if front:
            self.waiting.insert(0, seq)
        else:
            self.waiting.append(seq)
        self.groups[seq.request_id] = [seq]

    @rule()
    def add_running(self) -> None:
        seq = self._new()
        self.q.add_running(seq)
        self.running.append(seq)
        self.groups[seq.request_id] = [seq]

    @precondition(lambda self: self.waiting)
    @rule()
    def admit_head(self) -> None:
        seq = self.q.admit_head()
        assert seq is self.waiting.pop(0)
        self.running.append(seq)

    @precondition(lambda self: self.waiting)
    @rule(k=st.integers(1, 3))
    def set_aside_and_put_back(self, k: int) -> None:
        taken = [self.q.pop_head() for _ in range(min(k, len(self.waiting)))]
        assert taken == self.waiting[: len(taken)]
        self.q.put_back(taken)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.running))
        self.q.preempt(seq)
        self.running.remove(seq)
        self.waiting.insert(0, seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.running))
        group = self.groups[parent.request_id]
        child = _seq(parent.request_id, len(group))
        self.q.add_choice(child)
        group.append(child)
        self.running.append(child)
        if data.draw(st.booleans()):  # the fork failed: undone
            self.q.drop_choice(child)
            group.remove(child)
            self.running.remove(child)

    @precondition(lambda self: self.waiting or self.running)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.waiting + self.running))
        last = self.q.remove(seq)
        (self.waiting if seq in self.waiting else self.running).remove(seq)
        group = self.groups[seq.request_id]
        group.remove(seq)
        if not group:
            del self.groups[seq.request_id]
        assert last == (seq.request_id not in self.groups)

    def _movable(self) -> list[Seq]:
        """Sequences that may move: a request's only choice (as migration requires)."""
        return [s for s in self.waiting + self.running if len(self.groups[s.request_id]) == 1]

    @precondition(lambda self: self._movable())
    @rule(data=st.data())
    def detach(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self._movable()))
        slot = self.q.detach(seq)
        if seq in self.waiting:
            assert slot == Slot("waiting", self.waiting.index(seq))
            self.waiting.remove(seq)
        else:
            assert slot.where == "running"
            self.running.remove(seq)
        self.detached.append((seq, slot))
        assert seq.request_id in self.q  # still recorded until released

    @precondition(lambda self: self.detached)
    @rule(data=st.data(), back=st.booleans())
    def restore_or_release(self, data: st.DataObject, back: bool) -> None:
        seq, slot = self.detached.pop(data.draw(st.integers(0, len(self.detached) - 1)))
        if back:
            self.q.restore(seq, slot)
            if slot.where == "waiting":
                self.waiting.insert(min(slot.index, len(self.waiting)), seq)
            else:
                self.running.append(seq)
                self.running.sort(key=lambda s: s.order)
        else:
            self.q.forget(seq.request_id)
            self.groups.pop(seq.request_id, None)

    @rule(keys=st.lists(st.integers(0, 5), max_size=4), hold=st.booleans())
    def unready(self, keys: list[int], hold: bool) -> None:
        if hold:
            self.q.unready.hold(keys)
            self.unready_model.update(keys)
        else:
            self.q.unready.release(keys)
            for k in keys:
                self.unready_model[k] -= 1
                if self.unready_model[k] <= 0:
                    del self.unready_model[k]

    @invariant()
    def agrees_with_the_model(self) -> None:
        q = self.q
        assert list(q.waiting) == self.waiting
        assert list(q.running) == self.running
        orders = [s.order for s in q.running]
        assert orders == sorted(orders)  # oldest admission first
        assert q.num_waiting == len(self.waiting) and q.num_running == len(self.running)
        assert q.has_unfinished() == bool(self.waiting or self.running)
        assert list(q.all()) == self.waiting + self.running
        for rid, group in self.groups.items():
            assert list(q.group(rid)) == group
        for seq in self.waiting + self.running:
            assert q.is_waiting(seq) != q.is_running(seq)
        rows = q.snapshot()
        assert [(r.request_id, r.index, r.state) for r in rows] == [
            (s.request_id, s.index, "running") for s in self.running
        ] + [(s.request_id, s.index, "waiting") for s in self.waiting]
        assert len(q.unready) == len(self.unready_model)
        for k in range(6):
            assert (k in q.unready) == (k in self.unready_model)
        assert q.unready.any(range(6)) == bool(self.unready_model)


TestQueues = QueuesMachine.TestCase
TestQueues.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_releasing_a_key_never_held_is_harmless() -> None:
    u = UnreadyKeys()
    u.release([7])
    assert 7 not in u and len(u) == 0
    u.hold([7, 7])
    u.release([7])
    assert 7 in u
    u.release([7])
    assert 7 not in u
