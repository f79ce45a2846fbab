"""The engine's request queues: who waits, who runs, in which order, which prefixes are unready.

:class:`RequestQueues` is the one owner of that state. The engine's
scheduling step, request migration (:mod:`kvtier.engine.migrate`), the
server's admin view and the agents' prefetcher all go through its methods,
so the invariants hold in one place: every queued sequence is in exactly one
of ``waiting`` and ``running``; each request id maps to the sequences of its
choices while any is queued; running sequences keep their admission order
(the newest is preempted first).

:class:`UnreadyKeys` counts, per block key, the owners of blocks that are
published but hold no valid K/V yet (being computed, or loaded from a
tier). A request whose prefix is unready waits for it instead of computing
it a second time.
"""

from __future__ import annotations

import collections
import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvtier.engine.request import Sequence as Seq

Where = Literal["waiting", "running"]


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """One queued sequence, as data (what ``/admin/requests`` lists)."""

    request_id: str
    index: int
    state: Where
    prompt_tokens: int
    generated_tokens: int
    computed_tokens: int


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a detached sequence was, so :meth:`RequestQueues.restore` can put it back."""

    where: Where
    #: Its place in the waiting queue (0 for a running sequence: running ones keep
    #: their admission order instead).
    index: int


class SchedulingPolicy(Protocol):
    """Where a new request joins the waiting line (a preempted one always goes first).

    The scheduler admits from the head of the line; a policy decides the
    order by placing each arrival. One class in one file is a new policy:
    pass an instance as ``Engine(..., scheduling_policy=...)``.
    """

    name: str

    def place(self, waiting: Sequence[Seq], seq: Seq) -> int:
        """The index in ``waiting`` (0 = next to run) at which ``seq`` joins."""
        ...


class FirstComeFirstServed:
    """Arrivals join the end of the line: vLLM's default."""

    name = "fcfs"

    def place(self, waiting: Sequence[Seq], seq: Seq) -> int:
        return len(waiting)


class UnreadyKeys:
    """Block keys published before their K/V are in, with how many owners each."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: collections.Counter[int] = collections.Counter()

    def hold(self, keys: Iterable[int]) -> None:
        """Mark ``keys`` unready (once more each)."""
        self._count.update(keys)

    def release(self, keys: Iterable[int]) -> None:
        """Take back one hold on each of ``keys``; a key with none left is ready."""
        count = self._count
        for key in keys:
            left = count[key] - 1
            if left > 0:
                count[key] = left
            else:
                del count[key]

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def any(self, keys: Iterable[int]) -> bool:
        """Whether any of ``keys`` is unready."""
        count = self._count
        return any(k in count for k in keys)

    def __len__(self) -> int:
        return len(self._count)


class RequestQueues:
    """The waiting queue, the running set and the sequences of each request (module docstring)."""

    def __init__(self, policy: SchedulingPolicy | None = None) -> None:
        #: Where arrivals join the line.
        self.policy: SchedulingPolicy = policy or FirstComeFirstServed()
        self._waiting: deque[Seq] = deque()
        #: Admitted sequences (computing, or loading their prefix), oldest first.
        self._running: list[Seq] = []
        #: request id -> its sequences (one per choice once forked).
        self._groups: dict[str, list[Seq]] = {}
        self._order = itertools.count()
        #: Published keys whose blocks hold no valid K/V yet.
        self.unready = UnreadyKeys()

    # -- reading ----------------------------------------------------------------------
    @property
    def waiting(self) -> Sequence[Seq]:
        """The waiting sequences, first in line first (read only: change them through methods)."""
        return self._waiting

    @property
    def running(self) -> Sequence[Seq]:
        """The running sequences, oldest admission first (read only)."""
        return self._running

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._groups

    def group(self, request_id: str) -> tuple[Seq, ...]:
        """The queued sequences of ``request_id`` (empty when it is not here)."""
        return tuple(self._groups.get(request_id, ()))

    def is_running(self, seq: Seq) -> bool:
        return seq in self._running

    def is_waiting(self, seq: Seq) -> bool:
        return seq in self._waiting

    def all(self) -> Iterator[Seq]:
        """Every queued sequence, waiting ones first."""
        yield from list(self._waiting)
        yield from list(self._running)

    def snapshot(self) -> list[QueuedRequest]:
        """Every queued sequence as data, running ones first."""
        rows: list[QueuedRequest] = []
        for state, seqs in (("running", self._running), ("waiting", self._waiting)):
            for seq in seqs:
                rows.append(
                    QueuedRequest(
                        seq.request_id,
                        seq.index,
                        "running" if state == "running" else "waiting",
                        len(seq.prompt_ids),
                        len(seq.generated),
                        seq.computed,
                    )
                )
        return rows

    # -- arriving and leaving ------------------------------------------------------------
    def add(self, seq: Seq, *, front: bool = False) -> None:
        """Queue a new request's sequence where the policy places it (first with ``front``)."""
        waiting = self._waiting
        if front:
            waiting.appendleft(seq)
        else:
            at = self.policy.place(waiting, seq)
            if at >= len(waiting):
                waiting.append(seq)
            else:
                waiting.insert(max(at, 0), seq)
        self._groups[seq.request_id] = [seq]

    def add_running(self, seq: Seq) -> None:
        """A request that arrives already holding its blocks (moved here with its KV)."""
        seq.order = next(self._order)
        self._running.append(seq)
        self._groups[seq.request_id] = [seq]

    def remove(self, seq: Seq) -> bool:
        """Take ``seq`` out for good; True when it was the last queued choice of its request."""
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        group = self._groups.get(seq.request_id)
        if group is not None and seq in group:
            group.remove(seq)
            if not group:
                del self._groups[seq.request_id]
        return seq.request_id not in self._groups

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s record (its sequences left through :meth:`detach`)."""
        self._groups.pop(request_id, None)

    # -- the scheduling step ---------------------------------------------------------------
    def head(self) -> Seq | None:
        return self._waiting[0] if self._waiting else None

    def pop_head(self) -> Seq:
        """Take the first waiting sequence out of line (admitted, ended or set aside)."""
        return self._waiting.popleft()

    def admit_head(self) -> Seq:
        """The first waiting sequence starts running, newest in admission order."""
        seq = self._waiting.popleft()
        seq.order = next(self._order)
        self._running.append(seq)
        return seq

    def put_back(self, seqs: Sequence[Seq]) -> None:
        """Sequences set aside from the head of the line go back to it, in their order."""
        self._waiting.extendleft(reversed(seqs))

    def newest_running(self) -> Seq:
        return self._running[-1]

    def preempt(self, seq: Seq) -> None:
        """A running sequence goes back to the head of the line."""
        self._running.remove(seq)
        self._waiting.appendleft(seq)

    def add_choice(self, child: Seq) -> None:
        """A forked choice joins its request, running."""
        child.order = next(self._order)
        self._groups[child.request_id].append(child)
        self._running.append(child)

    def drop_choice(self, child: Seq) -> None:
        """Undo :meth:`add_choice` (the fork that made it failed)."""
        self._running.remove(child)
        self._groups[child.request_id].remove(child)

    # -- moving a request elsewhere -------------------------------------------------------
    def detach(self, seq: Seq) -> Slot:
        """Take ``seq`` out of line or out of the running set; its request stays recorded."""
        if seq in self._waiting:
            index = list(self._waiting).index(seq)
            self._waiting.remove(seq)
            return Slot("waiting", index)
        self._running.remove(seq)
        return Slot("running", 0)

    def restore(self, seq: Seq, slot: Slot) -> None:
        """Put a detached sequence back where :meth:`detach` found it."""
        if slot.where == "waiting":
            self._waiting.insert(min(slot.index, len(self._waiting)), seq)
            return
        running = self._running
        at = len(running)
        for i, other in enumerate(running):
            if other.order > seq.order:
                at = i
                break
        running.insert(at, seq)
