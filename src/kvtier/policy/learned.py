"""Learned reuse: eviction that learns online which newly computed blocks will be reused.

Generic policies rank blocks by recency or frequency, but on chat traffic the
reuse that matters is a conversation's next turn, which comes minutes later,
after recency has long pushed its blocks out. Whether a next turn comes, and
when, depends on what kind of request produced the blocks. This policy
learns that from the requests it serves, online, starting from nothing:

* **Request classes.** ``on_request(keys, num_hit, now)`` (called by the
  owner once per request) puts the request in a class by two features of its
  chain, measured against a bounded history of chains seen before: how many
  of its blocks are new (log2 buckets 0, 1, 2-3, 4-7, 8-15, 16+) and its turn
  (1 + the turn of the request whose whole chain it extends; log2 buckets 1,
  2-3, 4-7, 8+). A block belongs to the last request that used it.
* **Reuse hazards per class and age.** The history counts, per class, the
  blocks that reached each age bin (log2 bins of seconds, 1/4 s to 2.3 h)
  unused, and how many of those a later request used in that bin: a
  Kaplan-Meier estimate of the reuse hazard that does not depend on what the
  cache kept (evicted blocks are still followed). Each class's estimate is
  shrunk toward a proportional-hazards fit (one age curve times a factor per
  turn bucket and per new-blocks bucket), so sparse classes borrow strength;
  the counts are halved periodically, so the estimates follow shifts.
* **Value.** A block of age ``a`` is worth its best achievable hit density:
  the most expected hits per block-second it can earn if kept up to some
  further horizon, maximised over the horizon (a Gittins index for keeping a
  block, as LHD's hit density is for a fixed lifetime). A table of values per
  class and age bin is recomputed every few dozen requests.
* **Eviction.** Victims come from the lowest-valued (class, age bin) cell,
  oldest request first, and within a request its chain's tail first, so a
  partly evicted chain keeps a usable prefix. Requests move through the age
  bins on a timing wheel, so eviction never scans the cache.
* **Guard.** An :class:`~kvtier.policy.guard.LRUGuard` compares the cache
  with a sampled shadow LRU; when LRU would clearly do better, victims are
  taken in recency order (least recently used request first) until a later
  probe shows the learned order winning again.

Admission needs no separate rule in the device pool: a request's new blocks
compete with every resident block from the next allocation on, and the ones
worth least go first (ending their chain, since they go tail first). With no
``on_request`` calls (an owner that does not send them) every key is in one
class, and victims go oldest insert or use first.

Keys the owner inserts that the current request did not name (generated
tokens) join the current request's chain. Time only moves with ``now``.

The learned tables also answer, read-only, for a lower tier deciding what
to write (:mod:`kvtier.offload.admission`): :meth:`~LearnedReusePolicy.predicted_reuse`,
:meth:`~LearnedReusePolicy.reuse_probability` and
:meth:`~LearnedReusePolicy.was_reused`, for resident keys and keys the history
still remembers (a block just evicted). Asking changes no decision.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.policy.base import PolicyBase
from kvtier.policy.guard import LRUGuard

#: Lower edges of the age bins in seconds: [0, 1/4), [1/4, 1/2), ... [8192, inf).
_EDGES: tuple[float, ...] = (0.0, *(2.0**k for k in range(-2, 14)))
_B = len(_EDGES)
#: Where each bin ends (the open last bin is costed as if it ended at twice its start).
_ENDS: tuple[float, ...] = (*_EDGES[1:], 2.0 * _EDGES[-1])
_MID: tuple[float, ...] = tuple((lo + hi) / 2.0 for lo, hi in zip(_EDGES, _ENDS, strict=True))
_TURNS = 4  # turn 1, 2-3, 4-7, 8+
_NEWS = 6  # new blocks 0, 1, 2-3, 4-7, 8-15, 16+
#: The class of keys no request named (owners that do not call on_request).
LOOSE = _TURNS * _NEWS
_CLASSES = LOOSE + 1
#: A class's value table is recomputed when a hazard moved by more than this share.
_RETABLE = 0.02
#: Per age bin, what orders equal values older bin first (see _rebuild).
_NUDGE: tuple[float, ...] = tuple(b * 1e-300 for b in range(_B))


def request_class(turn: int, new_blocks: int) -> int:
    """The class index of a request at ``turn`` adding ``new_blocks`` unseen blocks."""
    t = min(max(turn, 1).bit_length() - 1, _TURNS - 1)
    return t * _NEWS + min(max(new_blocks, 0).bit_length(), _NEWS - 1)


def age_bin(age: float) -> int:
    """The age bin of ``age`` seconds."""
    return bisect_right(_EDGES, age) - 1 if age >= 0.0 else 0


def hit_density(hazard: Sequence[float]) -> list[float]:
    """Per age bin, the best hits per block-second over any further horizon.

    ``hazard[b]`` is the probability that a block alive at the start of bin
    ``b`` is used within it. With ``F``/``G`` the running sums of the use
    probability (and of it times the bin's midpoint) and ``S`` the survival,
    keeping a block from the start ``a`` of bin ``b`` to the end of bin ``e``
    earns ``F[e] - F[b-1]`` hits at a cost of ``G[e] - G[b-1] - a (F[e] -
    F[b-1]) + S[e+1] (end_e - a)`` block-seconds (the survival to ``a``
    cancels).
    """
    n = len(hazard)
    mid = _MID
    surv = 1.0
    # F and G to the end of each bin (F[b-1] and G[b-1] are the previous entries).
    f_end = [0.0] * n
    g_end = [0.0] * n
    after = [0.0] * n  # survival past each bin
    f = g = 0.0
    for b in range(n):
        q = surv * hazard[b]
        f = f + q
        g = g + q * mid[b]
        f_end[b] = f
        g_end[b] = g
        surv -= q
        after[b] = surv
    ends = _ENDS
    edges = _EDGES
    out = [0.0] * n
    f0 = g0 = 0.0
    for b in range(n):
        a = edges[b]
        best = 0.0
        for e in range(b, n):
            p = f_end[e] - f0
            if p <= 0.0:
                continue
            cost = g_end[e] - g0 - a * p + after[e] * (ends[e] - a)
            if cost > 0.0 and p > best * cost:
                best = p / cost
        out[b] = best
        f0 = f_end[b]
        g0 = g_end[b]
    return out


class _Rec:
    """One request's chain: history for learning, and the resident keys it owns."""

    __slots__ = (
        "alive",
        "bin",
        "cls",
        "evictable",
        "hist",
        "keys",
        "live",
        "matched",
        "parked",
        "queued",
        "res",
        "stack",
        "time",
        "turn",
    )

    def __init__(self, cls: int, time: float, turn: int, keys: list[int]) -> None:
        self.cls = cls
        self.time = time
        self.turn = turn
        #: The chain, in order (empty for records outside the history).
        self.keys = keys
        #: History keys still owned and not used again yet (the learning weight).
        self.alive = len(keys)
        self.hist = bool(keys)
        #: Resident keys owned, and how many of them are unpinned.
        self.res = 0
        self.evictable = 0
        #: Owned resident keys, chain order: eviction pops the tail. Entries
        #: for keys that moved on are stale and skipped.
        self.stack: list[int] = []
        #: Keys popped from the stack while pinned.
        self.parked: list[int] | None = None
        #: Current age bin.
        self.bin = 0
        #: On the timing wheel (or in the last bin): may take more keys.
        self.live = True
        #: In the recency queue.
        self.queued = False
        #: Leading keys of the chain that were in the history when it came (used again).
        self.matched = 0


@mypyc_attr(allow_interpreted_subclasses=True)
class LearnedReusePolicy(PolicyBase):
    """Evict the blocks least likely to be reused soon, as learned per request class.

    ``history`` sizes the chain history in keys, as a multiple of the
    capacity (at least ``min_history`` keys); ``prior`` is the weight, in blocks, of the
    proportional-hazards fit in each class's estimate; ``refresh`` is how
    many requests pass between recomputations of the value table; ``guard``
    turns the sampled-LRU guard on (see the module docs).
    """

    name: ClassVar[str] = "learned-reuse"

    def __init__(
        self,
        history: int = 16,
        prior: float = 1024.0,
        refresh: int = 64,
        guard: bool = True,
        min_history: int = 4096,
    ) -> None:
        if not isinstance(history, int) or history < 1:
            raise ConfigError(f"history must be at least 1 (times the capacity), got {history!r}")
        if not prior > 0:
            raise ConfigError(f"prior must be positive, got {prior!r}")
        if not isinstance(refresh, int) or refresh < 1:
            raise ConfigError(f"refresh must be at least 1 request, got {refresh!r}")
        if not isinstance(min_history, int) or min_history < 1:
            raise ConfigError(f"min_history must be at least 1 key, got {min_history!r}")
        super().__init__()
        #: History kept: at least this many keys, whatever the capacity.
        self.min_history = min_history
        self._history = history
        self._prior = float(prior)
        self._refresh = refresh
        self._use_guard = guard
        self.guard: LRUGuard | None = None
        self._hist_limit = self.min_history
        # Residency.
        self._res: dict[int, _Rec] = {}
        self._pinned: set[int] = set()
        self._n_evictable = 0
        self._cells: list[dict[_Rec, None]] = [{} for _ in range(_CLASSES * _B)]
        self._by_time: deque[_Rec] = deque()
        self._holding = 0  # records with resident keys
        # History and learning.
        self._hist: dict[int, _Rec] = {}
        self._records: deque[_Rec] = deque()
        self._chained = 0  # keys in the remembered chains' lists
        self._wheel: list[deque[_Rec]] = [deque() for _ in range(_B - 1)]
        self._wake = float("inf")
        self._hits: list[list[float]] = [[0.0] * _B for _ in range(_CLASSES)]
        self._risk: list[list[float]] = [[0.0] * _B for _ in range(_CLASSES)]
        self._turn_factor = [1.0] * _TURNS
        self._new_factor = [1.0] * _NEWS
        self._value: list[list[float]] = [[0.0] * _B for _ in range(_CLASSES)]
        self._hazard: list[list[float]] = [[-1.0] * _B for _ in range(_CLASSES)]
        self._order: list[int] = []
        #: Each cell's position in ``_order``, and a position no occupied cell is below.
        self._rank: list[int] = list(range(_CLASSES * _B))
        self._low = 0
        self._now = 0.0
        self._ctx: _Rec | None = None
        self._stale = 0
        self._since_decay = 0
        #: Requests heard of through on_request.
        self.requests = 0
        self._rebuild()

    def bind(self, capacity: int, typical_size: int = 1) -> None:
        super().bind(capacity, typical_size)
        keys = self.key_capacity
        self._hist_limit = max(self._history * keys, self.min_history)
        self.guard = LRUGuard(keys) if self._use_guard else None

    # -- the request ----------------------------------------------------------------------
    def on_request(
        self,
        keys: Sequence[int],
        num_hit: int,
        now: float,
        hints: Mapping[str, object] | None = None,
    ) -> None:
        if now > self._now:
            self._now = now
        now = self._now
        if now >= self._wake:
            self._advance(now)
        n = len(keys)
        if not n:
            return
        guard = self.guard
        if guard is not None:
            guard.observe(keys, self._res)
        hist = self._hist
        m = 0
        while m < n and keys[m] in hist:
            m += 1
        turn = 1
        if m:
            deepest = keys[m - 1]
            prev = hist[deepest]
            # Extending a whole earlier chain is its next turn; branching off
            # the middle of one (a shared system prompt) starts a new one.
            if prev.keys and prev.keys[-1] == deepest:
                turn = prev.turn + 1
        cls = request_class(turn, n - m)
        rec = _Rec(cls, now, turn, list(keys))
        rec.matched = m
        self._credit(keys, m, rec)
        self._adopt(keys, m, rec)
        self._wheel[0].append(rec)
        wake = now + _EDGES[1]
        if wake < self._wake:
            self._wake = wake
        self._risk[cls][0] += n
        self._records.append(rec)
        self._chained += n
        self._ctx = rec
        self._since_decay += n
        if len(hist) > self._hist_limit or self._chained > 2 * self._hist_limit:
            self._expire()
        if self._since_decay >= self._hist_limit:
            self._decay()
        self.requests += 1
        self._stale += 1
        if self._stale >= self._refresh:
            self._rebuild()

    def _credit(self, keys: Sequence[int], m: int, rec: _Rec) -> None:
        """Count the use of the matched prefix; every key now belongs to ``rec``."""
        hist = self._hist
        hits = self._hits
        get = hist.get
        owner: _Rec | None = None
        count = 0
        for i in range(m):
            key = keys[i]
            old = get(key)
            hist[key] = rec
            if old is not owner:
                if owner is not None and count:
                    _used(owner, count, hits)
                owner = old
                count = 0
            count += 1
        # Past the matched prefix nothing counts as a use: the run of the prefix's
        # last owner ends at the first key it does not own.
        for i in range(m, len(keys)):
            key = keys[i]
            old = get(key)
            hist[key] = rec
            if count and old is not owner:
                if owner is not None:
                    _used(owner, count, hits)
                count = 0
            if old is not None and old.alive > 0:
                old.alive -= 1  # seen again past a gap: no longer its to lose
        if owner is not None and count:
            _used(owner, count, hits)

    def _adopt(self, keys: Sequence[int], m: int, rec: _Rec) -> None:
        """Resident keys of the request's matched prefix move to its record (a use)."""
        res = self._res
        pinned = self._pinned
        cells = self._cells
        stack = rec.stack
        for i in range(m):
            key = keys[i]
            old = res.get(key)
            if old is None or old is rec:
                continue
            old.res -= 1
            if key not in pinned:
                old.evictable -= 1
                rec.evictable += 1
            if old.res == 0:
                del cells[old.cls * _B + old.bin][old]
                self._holding -= 1
            res[key] = rec
            stack.append(key)
        if stack:
            rec.res = len(stack)
            idx = rec.cls * _B
            cells[idx][rec] = None
            if self._rank[idx] < self._low:
                self._low = self._rank[idx]
            self._holding += 1
            rec.queued = True
            self._by_time.append(rec)

    # -- time --------------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        """Move records whose age crossed bin edges into the bin of their age.

        Oldest bins first, so each bin's queue stays in time order: a record
        that jumps several bins lands behind the older ones already there.
        """
        wheel = self._wheel
        risk = self._risk
        cells = self._cells
        rank = self._rank
        low = self._low
        last = _B - 1
        for b in range(last - 1, -1, -1):
            q = wheel[b]
            limit = now - _EDGES[b + 1]
            while q and q[0].time <= limit:
                r = q.popleft()
                res = r.res
                alive = r.alive
                if not res and not alive:
                    r.live = False
                    continue
                age = now - r.time
                nb = bisect_right(_EDGES, age) - 1 if age >= 0.0 else 0  # age_bin, inline
                if res:
                    base = r.cls * _B
                    del cells[base + b][r]
                    cells[base + nb][r] = None
                    if rank[base + nb] < low:
                        low = rank[base + nb]
                if alive:
                    row = risk[r.cls]
                    for x in range(b + 1, nb + 1):
                        row[x] += alive
                r.bin = nb
                if nb < last:
                    wheel[nb].append(r)
        wake = float("inf")
        for b in range(last):
            q = wheel[b]
            if q:
                t = q[0].time + _EDGES[b + 1]
                if t < wake:
                    wake = t
        self._wake = wake
        self._low = low

    def _expire(self) -> None:
        """Forget the oldest chains until the history fits (resident keys stay known).

        Both the keys remembered and the chains' key lists are bounded: a
        workload that repeats one prompt adds no keys but a chain a request.
        """
        hist = self._hist
        res = self._res
        records = self._records
        limit = self._hist_limit
        while (len(hist) > limit or self._chained > 2 * limit) and records:
            r = records.popleft()
            for key in r.keys:
                if hist.get(key) is r and key not in res:
                    del hist[key]
            self._chained -= len(r.keys)
            r.keys = []
            r.alive = 0
            r.hist = False

    def _decay(self) -> None:
        self._since_decay = 0
        for row in (*self._hits, *self._risk):
            for b in range(_B):
                row[b] *= 0.5

    # -- the value table -----------------------------------------------------------------
    def _fit(self) -> list[float]:
        """One warm-started pass of the proportional-hazards fit; returns its age curve."""
        hits = self._hits
        risk = self._risk
        tf = self._turn_factor
        nf = self._new_factor
        n_fit = _TURNS * _NEWS
        factor = [tf[c // _NEWS] * nf[c % _NEWS] for c in range(n_fit)]
        base = [0.0] * _B
        for b in range(_B):
            h = 0.0
            r = 0.0
            for c in range(n_fit):
                h += hits[c][b]
                r += risk[c][b] * factor[c]
            base[b] = h / r if r > 0.0 else 0.0
        used = [0.0] * n_fit
        exposure = [0.0] * n_fit
        for c in range(n_fit):
            hc = hits[c]
            rc = risk[c]
            u = 0.0
            e = 0.0
            for b in range(_B):
                u += hc[b]
                e += rc[b] * base[b]
            used[c] = u
            exposure[c] = e
        for t in range(_TURNS):
            row = [t * _NEWS + n for n in range(_NEWS)]
            tf[t] = _rate(row, used, exposure, [nf[c % _NEWS] for c in row])
        for n in range(_NEWS):
            col = [t * _NEWS + n for t in range(_TURNS)]
            nf[n] = _rate(col, used, exposure, [tf[c // _NEWS] for c in col])
        return base

    def _rebuild(self) -> None:
        """Recompute the value of every (class, age bin) cell from the hazards."""
        self._stale = 0
        hits = self._hits
        risk = self._risk
        k = self._prior
        base = self._fit()
        # Sums over the classes, each bin's in class order (as a loop per bin adds them).
        h_tot = [0.0] * _B
        r_tot = [0.0] * _B
        for c in range(_CLASSES):
            hc = hits[c]
            rc = risk[c]
            for b in range(_B):
                h_tot[b] += hc[b]
                r_tot[b] += rc[b]
        pooled = [0.0] * _B
        for b in range(_B):
            r = r_tot[b]
            pooled[b] = h_tot[b] / r if r > 0.0 else 0.0
        values = self._value
        tf = self._turn_factor
        nf = self._new_factor
        retable = _RETABLE
        for c in range(_CLASSES):
            f = tf[c // _NEWS] * nf[c % _NEWS] if c < LOOSE else 1.0
            prior = base if c < LOOSE else pooled
            hc = hits[c]
            rc = risk[c]
            old = self._hazard[c]
            hazard = [0.0] * _B
            # The table is the costly part: skip classes whose hazards barely moved.
            moved = False
            for b in range(_B):
                # min(1.0, v) as a comparison: the same value, no call.
                v = prior[b] * f
                x = (hc[b] + k * (v if v < 1.0 else 1.0)) / (rc[b] + k)
                if not x < 1.0:
                    x = 1.0
                hazard[b] = x
                if not moved:
                    y = old[b]
                    if abs(x - y) > retable * y:
                        moved = True
            if moved:
                self._hazard[c] = hazard
                values[c] = hit_density(hazard)
        # Lowest value first; among equals the older bin first (least recently
        # used): the bin's nudge is far below any value that is not zero.
        keys: list[float] = []
        nudge = _NUDGE
        for c in range(_CLASSES):
            row = values[c]
            for b in range(_B):
                keys.append(row[b] - nudge[b])
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self._order = order
        rank = self._rank
        for pos, cell in enumerate(order):
            rank[cell] = pos
        self._low = 0

    # -- owners' transitions ------------------------------------------------------------
    def _record_for(self, key: int) -> _Rec | None:
        """The request record a newly resident key joins, or ``None`` for a loose one."""
        r = self._hist.get(key)
        if r is not None and r.live:
            return r
        ctx = self._ctx
        if ctx is not None and ctx.live and ctx.hist:
            # Not named by the request (generated tokens): the chain grows.
            ctx.keys.append(key)
            self._chained += 1
            ctx.alive += 1
            self._hist[key] = ctx
            self._risk[ctx.cls][ctx.bin] += 1
            return ctx
        return None

    def _loose(self, cls: int) -> _Rec:
        """A record for keys used outside any request the policy heard of.

        Its keys go oldest first in the order the owner gave them (as LRU
        would), so callers push them in reverse.
        """
        r = _Rec(cls, self._now, 0, [])
        self._wheel[0].append(r)
        wake = self._now + _EDGES[1]
        if wake < self._wake:
            self._wake = wake
        return r

    def _hold(self, r: _Rec) -> None:
        """``r`` got its first resident key."""
        idx = r.cls * _B + r.bin
        self._cells[idx][r] = None
        if self._rank[idx] < self._low:
            self._low = self._rank[idx]
        self._holding += 1
        if not r.queued:
            r.queued = True
            self._by_time.append(r)

    def _release(self, r: _Rec) -> None:
        """``r`` lost its last resident key."""
        del self._cells[r.cls * _B + r.bin][r]
        self._holding -= 1

    def _join(self, key: int, r: _Rec, pinned: bool) -> None:
        self._res[key] = r
        r.stack.append(key)
        r.res += 1
        if r.res == 1:
            self._hold(r)
        if not pinned:
            r.evictable += 1
            self._n_evictable += 1

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        if pinned:
            self._pinned.add(key)
        r = self._record_for(key)
        self._join(key, r if r is not None else self._loose(LOOSE), pinned)

    def insert_many(
        self, keys: Sequence[int], pinned: bool = False, sizes: Sequence[int] | None = None
    ) -> None:
        if sizes is not None:
            self._check_sizes(keys, sizes)
            for key, s in zip(keys, sizes, strict=True):
                self.insert(key, pinned, s)
            return
        if pinned:
            self._pinned.update(keys)
        hist = self._hist
        res = self._res
        loose: list[int] = []
        for key in keys:
            r = hist.get(key)
            if r is None or not r.live:
                r = self._record_for(key)
                if r is None:
                    loose.append(key)
                    continue
            res[key] = r
            r.stack.append(key)
            r.res += 1
            if r.res == 1:
                self._hold(r)
            if not pinned:
                r.evictable += 1
        if not pinned:
            self._n_evictable += len(keys) - len(loose)
        if loose:
            rec = self._loose(LOOSE)
            for key in reversed(loose):
                self._join(key, rec, pinned)

    def access(self, key: int) -> None:
        # access_many for one key, without building a tuple on every hit.
        r = self._res.get(key)
        if r is None or r is self._ctx:
            return
        self._move(key, r, self._loose(r.cls))

    def access_many(self, keys: Sequence[int]) -> None:
        res = self._res
        ctx = self._ctx
        fresh: _Rec | None = None
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            r = res.get(key)
            if r is None or r is ctx:
                continue
            # A use outside the current request: the key starts a new age.
            if fresh is None:
                fresh = self._loose(r.cls)
            self._move(key, r, fresh)

    def _move(self, key: int, old: _Rec, new: _Rec) -> None:
        pinned = key in self._pinned
        old.res -= 1
        if not pinned:
            old.evictable -= 1
            self._n_evictable -= 1
        if old.res == 0:
            self._release(old)
        self._join(key, new, pinned)

    def pin(self, key: int) -> None:
        r = self._res.get(key)
        if r is None or key in self._pinned:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
        self._pinned.add(key)
        r.evictable -= 1
        self._n_evictable -= 1

    def unpin(self, key: int) -> None:
        if key not in self._pinned:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned")
        self._pinned.remove(key)
        self._res[key].evictable += 1
        self._n_evictable += 1

    def pin_many(self, keys: Sequence[int]) -> None:
        res = self._res
        pinned = self._pinned
        for key in keys:
            if key not in res or key in pinned:
                raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
        pinned.update(keys)
        for key in keys:
            res[key].evictable -= 1
        self._n_evictable -= len(keys)

    def unpin_many(self, keys: Sequence[int]) -> None:
        pinned = self._pinned
        if not pinned.issuperset(keys):
            raise InternalInvariantError("unpin of a key that is not pinned")
        pinned.difference_update(keys)
        res = self._res
        for key in keys:
            res[key].evictable += 1
        self._n_evictable += len(keys)

    def remove(self, key: int) -> None:
        r = self._res.pop(key, None)
        if r is None:
            return
        r.res -= 1
        if key in self._pinned:
            self._pinned.remove(key)
        else:
            r.evictable -= 1
            self._n_evictable -= 1
        if r.res == 0:
            self._release(r)
        if not r.hist and self._hist.get(key) is r:
            del self._hist[key]
        if self._sizes:
            self._forget_size(key)

    # -- eviction -----------------------------------------------------------------------
    def evict(self) -> int | None:
        out = self.evict_many(1)
        return out[0] if out else None

    def evict_many(self, n: int) -> list[int]:
        out: list[int] = []
        if n <= 0 or not self._n_evictable:
            return out
        if self.guard is not None and self.guard.recency:
            self._evict_oldest(n, out)
            return out
        cells = self._cells
        order = self._order
        # Cells below the mark are empty: start there, and move the mark up.
        first = True
        for pos in range(self._low, len(order)):
            bag = cells[order[pos]]
            if not bag:
                if first:
                    self._low = pos + 1
                continue
            first = False
            while bag:
                r: _Rec | None = None
                for x in bag:
                    if x.evictable:
                        r = x
                        break
                if r is None:
                    break
                self._take(r, n - len(out), out)
                if len(out) >= n:
                    return out
        return out

    def _evict_oldest(self, n: int, out: list[int]) -> None:
        """Recency order: the request used longest ago first."""
        q = self._by_time
        while len(out) < n and q:
            head = q[0]
            if not head.res:
                q.popleft()
                head.queued = False
                continue
            r: _Rec | None = head
            if not head.evictable:
                r = next((x for x in islice(q, 1, None) if x.evictable), None)
            if r is None:
                break
            self._take(r, n - len(out), out)
        if len(q) > 2 * self._holding + 64:
            keep: deque[_Rec] = deque()
            for r in q:
                if r.res:
                    keep.append(r)
                else:
                    r.queued = False
            self._by_time = keep

    def _take(self, r: _Rec, need: int, out: list[int]) -> None:
        """Evict up to ``need`` of ``r``'s unpinned keys, chain tail first."""
        stack = r.stack
        res = self._res
        pinned = self._pinned
        hist = self._hist
        forgotten = not r.hist  # its chain was forgotten while its keys were resident
        left = r.evictable
        got = 0
        while got < need and left:
            if not stack:
                parked = r.parked
                if not parked:
                    r.evictable = left
                    raise InternalInvariantError("a record counts evictable keys it does not hold")
                parked.reverse()
                r.stack = stack = parked
                r.parked = None
            key = stack.pop()
            if res.get(key) is not r:
                continue
            if key in pinned:
                if r.parked is None:
                    r.parked = []
                r.parked.append(key)
                continue
            del res[key]
            if forgotten and hist.get(key) is r:
                del hist[key]
            out.append(key)
            got += 1
            left -= 1
        r.evictable = left
        if got:
            r.res -= got
            self._n_evictable -= got
            if self._sizes:
                for k in out[len(out) - got :]:
                    self._forget_size(k)
            if r.res == 0:
                self._release(r)

    # -- introspection ----------------------------------------------------------------
    def _pinned_keys(self) -> Iterable[int]:
        return self._pinned

    def snapshot(self) -> dict[str, Any]:
        """Residency, history, the learned tables and the guard, as plain data."""
        ids: dict[int, int] = {}

        def rec(r: _Rec) -> int:
            return ids.setdefault(id(r), len(ids))

        records: dict[int, list[object]] = {}
        for r in [*self._records, *self._res.values(), *self._by_time]:
            parked = None if r.parked is None else list(r.parked)
            fields: list[object] = [r.cls, r.time, r.turn, list(r.keys), r.alive, r.hist]
            fields += [r.res, r.evictable, list(r.stack), parked, r.bin, r.live, r.queued]
            records[rec(r)] = fields
        guard = self.guard
        return {
            **self._state(),
            "records": sorted(records.items()),
            "order": [rec(r) for r in self._records],
            "by_time": [rec(r) for r in self._by_time],
            "resident": sorted((k, rec(r)) for k, r in self._res.items()),
            "history": sorted((k, rec(r)) for k, r in self._hist.items()),
            "pinned": sorted(self._pinned),
            "evictable": self._n_evictable,
            "cells": [[rec(r) for r in cell] for cell in self._cells],
            "wheel": [[rec(r) for r in w] for w in self._wheel],
            "tables": (self._hits, self._risk, self._value, self._hazard, self._order),
            "factors": (self._turn_factor, self._new_factor),
            "counters": [
                *(self._hist_limit, self._chained, self._wake, self._holding, self._low),
                *(self._now, self._stale, self._since_decay, self.requests),
                None if self._ctx is None else rec(self._ctx),
            ],
            "guard": None if guard is None else guard.snapshot(),
        }

    def __len__(self) -> int:
        return len(self._res)

    def __contains__(self, key: object) -> bool:
        return key in self._res

    @property
    def num_evictable(self) -> int:
        return self._n_evictable

    @property
    def history_size(self) -> int:
        """Keys the chain history remembers (bounded by ``history`` times the capacity)."""
        return len(self._hist)

    @property
    def history_limit(self) -> int:
        return self._hist_limit

    @property
    def history_chains(self) -> tuple[int, int]:
        """Chains (requests) remembered, and the keys their lists hold (at most twice the limit)."""
        return len(self._records), self._chained

    @property
    def recency_order(self) -> bool:
        """Whether the guard has switched eviction to recency order."""
        return self.guard is not None and self.guard.recency

    def value(self, cls: int, age: float) -> float:
        """The current value (hits per block-second) of a class ``cls`` block ``age`` s old."""
        return self._value[cls][age_bin(age)]

    def class_of(self, key: int) -> int | None:
        """The class of the request a resident key belongs to, or ``None``."""
        r = self._res.get(key)
        return None if r is None else r.cls

    def _record_of(self, key: int) -> _Rec | None:
        """The record ``key`` belongs to: resident, or remembered by the history."""
        r = self._res.get(key)
        return r if r is not None else self._hist.get(key)

    def predicted_reuse(self, key: int) -> float | None:
        """The value eviction gives ``key`` now (hits per block-second), or ``None``.

        Answers for resident keys and for keys the history still remembers
        (a block just evicted, for a lower tier deciding whether to keep it);
        ``None`` for keys it has never seen or has forgotten.
        """
        r = self._record_of(key)
        if r is None:
            return None
        return self._value[r.cls][age_bin(self._now - r.time)]

    def was_reused(self, key: int) -> bool | None:
        """Whether ``key`` was used again after the request that computed it, or ``None``.

        True when its latest request found it in the history (a prefix match)
        or it was used outside any request; ``None`` for unknown keys.
        """
        r = self._record_of(key)
        if r is None:
            return None
        if r.turn == 0:
            return True  # a record of uses outside the requests
        keys = r.keys
        if not r.hist:
            return None  # its chain was forgotten
        return any(keys[i] == key for i in range(min(r.matched, len(keys))))

    def reuse_probability(self, key: int, horizon: float) -> float | None:
        """The learned probability that ``key`` is used within the next ``horizon`` seconds.

        From the same hazards the eviction values come from: the key's
        class, at its current age, over the age bins the horizon spans (a
        bin partly covered counts for the covered share of its hazard).
        ``None`` when the key is unknown (see :meth:`predicted_reuse`).
        """
        r = self._record_of(key)
        if r is None:
            return None
        hazard = self._hazard[r.cls]
        age = self._now - r.time
        if age < 0.0:
            age = 0.0
        end = age + (horizon if horizon > 0.0 else 0.0)
        surv = 1.0
        b = age_bin(age)
        last = _B - 1
        while b <= last and surv > 0.0:
            lo = _EDGES[b]
            hi = _ENDS[b]
            start = age if age > lo else lo
            stop = end if end < hi else hi
            if stop > start:
                h = hazard[b]
                if h >= 1.0:
                    return 1.0
                surv *= (1.0 - h) ** ((stop - start) / (hi - lo))
            if end <= hi:
                break
            b += 1
        return 1.0 - surv


def _used(owner: _Rec, count: int, hits: list[list[float]]) -> None:
    """``count`` of ``owner``'s keys were used again, in its current age bin."""
    if owner.hist and owner.alive > 0:
        c = count if count < owner.alive else owner.alive
        hits[owner.cls][owner.bin] += c
        owner.alive -= c


def _rate(
    classes: list[int], used: list[float], exposure: list[float], other: list[float]
) -> float:
    """One level's factor: its uses over its expected uses given the other factor.

    A half-count on both sides keeps a level with no data at factor 1.
    """
    o = e = 0.5
    for c, f in zip(classes, other, strict=True):
        o += used[c]
        e += exposure[c] * f
    return o / e
