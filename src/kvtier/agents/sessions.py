"""Sessions' pauses for the workflow policy: when each session is expected back.

A session (``session_id``) sends a request, pauses (a tool call, a user
typing) and sends the next one, which continues the same chain of blocks.
:class:`SessionBook` remembers each session's last request and learns from
the pauses it sees, and for every new request says what the policy should do
with the session's TTL pins, as data (:class:`SessionStep`):

* pin the request's blocks until the session is expected back: its
  ``cache_ttl_s``, stretched by how far hinted TTLs have run short of the
  pauses seen; without a hint, twice the session's own mean pause;
* bound a hinted TTL by the pauses seen of its agent kind (``agent_id``):
  once a kind has paused :data:`KIND_MIN` times, a TTL shorter than most of
  its pauses or far longer than nearly all of them is taken for a wrong
  hint and brought within that range;
* stop following the TTLs once they have proved worse than no hint: each
  hinted pause is also predicted from the pauses seen (its kind's median,
  or every session's), and when the hints' errors spread far wider than
  that prediction's, a TTL stands for "a pause" only: the session is pinned
  for what most pauses of its kind (or of all sessions) last;
* release the pins of a session that named a TTL at every pause and now
  names none (it is not waiting on a tool, so not expected back soon);
* end a session that says so (``session_end``);
* hold a session's blocks while its next request waits to be served
  (:meth:`SessionBook.arrive`): a request that has arrived is due as soon as
  the queue before it drains, so its session's pin moves to then, an
  estimate learned from how long requests have waited (and a paused
  session's pin ends that much after its pause: it will wait too). A session returns
  when its request arrives, not when it is served, so the pauses (and the
  stretch) are learned from arrivals: a busy server's queue does not make
  its sessions' tools look slow;
* say which paused sessions are due back soon (:meth:`SessionBook.returning`),
  for a prefetch to bring their blocks back from the tiers before they
  come: a hinted session is expected back when its (stretched, bounded)
  TTL runs out, one without a hint after its own mean pause.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.errors import InternalInvariantError
from kvtier.hints import Hints

#: Sessions remembered at most (the oldest are forgotten first).
MAX_SESSIONS = 100_000
#: Pause/TTL ratios kept to learn how far hinted TTLs run short.
RATIOS = 512
#: New ratios between two re-estimates of the stretch.
_RELEARN = 32
#: Seconds a waiting request's session is held at least, past the learned wait.
MIN_HOLD = 1.0
#: Weight of the newest wait in the learned wait (an exponential mean).
WAIT_WEIGHT = 0.2
#: Pauses remembered per agent kind, and how many a kind needs before they bound TTLs.
KIND_PAUSES = 64
KIND_MIN = 8
#: Agent kinds remembered at most (the least recently seen are forgotten first).
MAX_KINDS = 1024
#: A kind's TTLs are kept within [its pauses' LOW_Q quantile, HIGH_Q quantile x HIGH_MARGIN].
LOW_Q = 0.25
HIGH_Q = 0.95
HIGH_MARGIN = 1.5
#: The quantile of the pauses seen a session is pinned for once its TTLs are not followed
#: (most sessions back within it, as the stretch does for hints).
TYPICAL_Q = 0.8
#: Hinted pauses whose errors are compared (the latest), and how many before any verdict.
TRUST_WINDOW = 64
TRUST_MIN = 16
#: TTLs stop being followed when their errors vary more than this many times those of
#: the median pause seen: hints a little noisy are still far better than a typical
#: pause (a tool's latency varies by 30x, an application's estimate of it by 2x).
TRUST_MARGIN = 2.0


@dataclass(slots=True)
class KindPauses:
    """The pauses seen of one agent kind, and the range a hinted TTL is kept within."""

    pauses: deque[float] = field(default_factory=lambda: deque(maxlen=KIND_PAUSES))
    low: float = 0.0
    high: float = math.inf
    #: The median pause, and the TYPICAL_Q quantile (0.0 until enough pauses are seen).
    median: float = 0.0
    typical: float = 0.0

    def add(self, pause: float) -> None:
        self.pauses.append(pause)
        if len(self.pauses) >= KIND_MIN:
            ordered = sorted(self.pauses)
            last = len(ordered) - 1
            self.low = ordered[int(LOW_Q * last)]
            self.high = ordered[int(HIGH_Q * last)] * HIGH_MARGIN
            self.median = ordered[last // 2]
            self.typical = ordered[int(TYPICAL_Q * last)]

    def bound(self, ttl: float) -> float:
        """``ttl`` within the kind's range (unchanged until it has seen enough pauses)."""
        return min(max(ttl, self.low), self.high)


@dataclass(slots=True)
class Session:
    """One session's last pause: when it started, the TTL hinted, the pauses seen."""

    since: float = 0.0
    ttl: float | None = None
    until: float = 0.0
    #: Mean pause observed between this session's requests (0.0: none seen yet).
    pause: float = 0.0
    #: The last request's block keys, in chain order.
    keys: list[int] = field(default_factory=list)
    hinted: bool = False
    #: When the session's next request arrived, while it waits to be served (0.0: none).
    arrived: float = 0.0
    #: Its agent kind (the last ``agent_id`` it named), whose pauses bound its TTLs.
    kind: str | None = None
    #: When it is expected back from its pause (0.0: not paused, or no estimate).
    back: float = 0.0
    #: The median pause seen when its hinted pause began (0.0: none known), what its
    #: TTL is judged against.
    expected: float = 0.0


@dataclass(frozen=True, slots=True)
class SessionStep:
    """What one request of a session asks of the policy's TTL pins.

    ``release``: end the pins this session set until ``until`` on ``keys``.
    ``pin``: pin ``keys`` until ``until``, superseding the session's pin that
    ended at ``replacing``. ``ended``: the session ended; release everything
    it held.
    """

    release: tuple[Sequence[int], float] | None = None
    pin: tuple[Sequence[int], float, float] | None = None
    ended: Session | None = None


class SessionBook:
    """Every session's last request and pause, and the stretch learned from them."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._ratios: deque[float] = deque(maxlen=RATIOS)
        self._new_ratios = 0
        #: By how much a hinted TTL is stretched: most sessions come back within it.
        self.stretch = 1.0
        self.ended = 0
        #: Mean seconds between a session's request arriving and its being served.
        self.wait = 0.0
        self._kinds: OrderedDict[str, KindPauses] = OrderedDict()
        #: Every session's pauses, for sessions whose kind has paused too rarely.
        self._all = KindPauses()
        #: Of the latest hinted pauses: pause - TTL, and pause - the median pause seen
        #: then (seconds).
        self._hint_errors: deque[float] = deque(maxlen=TRUST_WINDOW)
        self._median_errors: deque[float] = deque(maxlen=TRUST_WINDOW)
        #: Whether TTLs are followed (False once they have proved worse than no hint).
        self.hints_trusted = True
        #: Whether :meth:`returning` is asked (a prefetch is on); only then are returns
        #: kept in order.
        self.expect_returns = False
        #: ``(back, session)`` of paused sessions, soonest first; an entry whose
        #: ``back`` is no longer its session's is stale and skipped.
        self._returns: list[tuple[float, str]] = []
        #: Sessions within the lead of their return: session -> back.
        self._soon: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def observe(self, h: Hints, keys: Sequence[int], now: float, progress: bool) -> SessionStep:
        """A request of session ``h.session_id`` using ``keys`` at ``now``.

        ``progress`` is False for the call made when a request finishes,
        which pins its generated blocks too but says nothing of a pause.
        """
        sid = h.session_id
        if sid is None:
            raise InternalInvariantError("a session step needs a request with a session_id")
        sessions = self._sessions
        rec = sessions.get(sid)
        if rec is None and h.session_end and not progress:
            # The finish of the request that ended it (the same hints again): it ended
            # when the request came, so there is nothing to record nor to end twice.
            return SessionStep()
        if rec is None:
            rec = sessions[sid] = Session()
            while len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
        else:
            sessions.move_to_end(sid)
            n = len(rec.keys) - 1  # a grown prompt may change the old partial tail block
            if progress and rec.arrived > 0.0:
                # Its arrival said when it came back (arrive); this is when it is served.
                w = max(now - rec.arrived, 0.0)
                self.wait = w if self.wait <= 0.0 else self.wait + WAIT_WEIGHT * (w - self.wait)
                rec.arrived = 0.0
            elif progress and rec.since > 0.0 and n > 0 and list(keys[:n]) == rec.keys[:n]:
                # Only a request that continues the session's chain says when it came
                # back (a session id that lies about the conversation teaches nothing).
                self._paused(rec, now)
        if h.session_end:
            ended = self.end(sid)
            return SessionStep(ended=ended)
        hinted_before = bool(rec.ttl) or rec.hinted
        release = None
        if not h.cache_ttl_s and hinted_before and progress:
            release = (rec.keys, rec.until)
        rec.since = now
        rec.hinted = hinted_before
        rec.ttl = h.cache_ttl_s
        rec.keys = list(keys)
        if h.agent_id is not None:
            rec.kind = h.agent_id
        previous = rec.until
        rec.back = 0.0
        # Due when it is served: back after its pause, then as long as requests wait.
        if h.cache_ttl_s:
            seen = self.pauses_for(rec.kind)
            rec.expected = seen.median
            if self.hints_trusted or seen.typical <= 0.0:
                ttl = h.cache_ttl_s * self.stretch
            else:
                ttl = seen.typical
            if seen is not self._all:
                ttl = seen.bound(ttl)  # a kind that has paused too rarely bounds nothing
            rec.until = now + ttl + self.wait
            self._expect(sid, rec, now + ttl)
        elif rec.pause > 0.0 and not hinted_before:
            rec.until = now + 2.0 * rec.pause + self.wait  # no hint: its own pauses so far
            self._expect(sid, rec, now + rec.pause)
        else:
            return SessionStep(release=release)
        return SessionStep(release=release, pin=(rec.keys, rec.until, previous))

    def arrive(self, h: Hints, now: float) -> SessionStep:
        """A request of session ``h.session_id`` arrived at ``now``, to be served later.

        The session is back: its pause is learned now, and the blocks of its
        last request are pinned until it is likely served (the learned mean
        wait, at least :data:`MIN_HOLD`), superseding its TTL pin: due sooner
        than any session still paused, which will wait its turn too. Called
        again while the request still waits, once that hold has run out, it
        holds the blocks as long again. The request's own step
        (:meth:`observe`, once it is served) then pins as usual (a request
        that ends the session ends it then: it still needs the session's
        blocks). Nothing for a session not seen before, or one waiting and
        held.
        """
        sid = h.session_id
        if sid is None:
            raise InternalInvariantError("an arrival needs a request with a session_id")
        rec = self._sessions.get(sid)
        if rec is None or not rec.keys:
            return SessionStep()
        if rec.arrived > 0.0:
            if rec.until > now:
                return SessionStep()
            # Still waiting (a hold is renewed while its request waits), or a request
            # that waited was cancelled and another came: the wait counts from the first.
        else:
            if rec.since > 0.0:
                self._paused(rec, now)
            rec.arrived = now
        rec.back = 0.0  # it is back: nothing to prefetch for it
        previous = rec.until
        rec.until = now + max(MIN_HOLD, self.wait)
        return SessionStep(pin=(rec.keys, rec.until, previous))

    def _paused(self, rec: Session, now: float) -> None:
        """``rec``'s session came back at ``now``: learn its pause (and the stretch)."""
        pause = now - rec.since
        if rec.ttl:
            self._learn(pause / rec.ttl)
            if rec.expected > 0.0:
                self._judge(pause, rec.ttl, rec.expected)
        self._all.add(pause)
        rec.pause = pause if rec.pause <= 0.0 else 0.5 * (rec.pause + pause)
        if rec.kind is not None:
            kinds = self._kinds
            kind = kinds.get(rec.kind)
            if kind is None:
                kind = kinds[rec.kind] = KindPauses()
                while len(kinds) > MAX_KINDS:
                    kinds.popitem(last=False)
            else:
                kinds.move_to_end(rec.kind)
            kind.add(pause)

    def _expect(self, sid: str, rec: Session, back: float) -> None:
        rec.back = back
        if not self.expect_returns:
            return
        returns = self._returns
        heapq.heappush(returns, (back, sid))
        if len(returns) > 4 * len(self._sessions) + 1024:  # mostly stale: keep the live ones
            live = self._sessions
            returns[:] = [(b, s) for b, s in returns if (r := live.get(s)) and r.back == b]
            heapq.heapify(returns)

    def returning(self, now: float, lead: float) -> list[str]:
        """Paused sessions expected back within ``lead`` seconds of ``now``, or overdue
        while their pins still hold, soonest first (with :attr:`expect_returns` on).

        A session leaves the list when its next request arrives, when it
        pauses again with another estimate, when its pins end, and when it
        ends. Changes nothing but the bookkeeping of that order.
        """
        sessions = self._sessions
        returns, soon = self._returns, self._soon
        while returns and returns[0][0] - lead <= now:
            back, sid = heapq.heappop(returns)
            rec = sessions.get(sid)
            if rec is not None and rec.back == back:
                soon[sid] = back
        due: list[tuple[float, str]] = []
        for sid, back in list(soon.items()):
            rec = sessions.get(sid)
            if rec is None or rec.back != back or rec.until <= now:
                del soon[sid]
            else:
                due.append((back, sid))
        due.sort()
        return [sid for _, sid in due]

    def next_return(self) -> float | None:
        """When the paused session expected back soonest is expected (None: none is)."""
        sessions, returns = self._sessions, self._returns
        while returns:
            back, sid = returns[0]
            rec = sessions.get(sid)
            if rec is not None and rec.back == back:
                return back
            heapq.heappop(returns)
        return None

    def kind(self, agent_id: str) -> KindPauses | None:
        """The pauses seen of agent kind ``agent_id``, if any."""
        return self._kinds.get(agent_id)

    def pauses_for(self, agent_id: str | None) -> KindPauses:
        """The pauses a session of kind ``agent_id`` is predicted from: its kind's once
        it has paused :data:`KIND_MIN` times, else every session's."""
        kind = self._kinds.get(agent_id) if agent_id is not None else None
        return kind if kind is not None and len(kind.pauses) >= KIND_MIN else self._all

    def end(self, session_id: str) -> Session | None:
        """Forget the session; its record, or None if it is unknown."""
        rec = self._sessions.pop(session_id, None)
        if rec is not None:
            self.ended += 1
        return rec

    def live(self, now: float) -> int:
        """Sessions pinned until later than ``now``."""
        return sum(1 for r in self._sessions.values() if r.until > now)

    def _judge(self, pause: float, ttl: float, expected: float) -> None:
        """Weigh a hinted pause's TTL against the median pause seen when it began.

        The spread of the errors, in seconds, is what matters: it says how well
        each orders returns in time. A TTL off by a steady amount or factor
        is corrected by the stretch; one off by a random factor is not.
        """
        hint_errors, median_errors = self._hint_errors, self._median_errors
        hint_errors.append(pause - ttl)
        median_errors.append(pause - expected)
        if len(hint_errors) >= TRUST_MIN:
            self.hints_trusted = _spread(hint_errors) <= TRUST_MARGIN * _spread(median_errors)

    def _learn(self, ratio: float) -> None:
        self._ratios.append(ratio)
        self._new_ratios += 1
        if self._new_ratios >= _RELEARN:
            self._new_ratios = 0
            ordered = sorted(self._ratios)
            # Most sessions back within their pin, never less than the hint, at most 4x it.
            self.stretch = min(max(ordered[int(0.8 * (len(ordered) - 1))], 1.0), 4.0)


def _spread(values: Sequence[float]) -> float:
    """The variance of ``values`` (at least two)."""
    n = len(values)
    mean = math.fsum(values) / n
    return math.fsum((v - mean) ** 2 for v in values) / n
