"""Tier admission: which blocks the device evicts are worth writing to a lower tier.

A write-back tier receives every block the device evicts, but most of them
are never read back: the write costs bandwidth (and, for flash, wear) and
pushes out blocks that would have been. A :class:`TierAdmission` sees each
batch of evicted blocks, with each block's parent key and size, and says
which to write. Two rules:

* ``write-all`` (:class:`WriteAll`, the default): every block, today's
  behaviour;
* ``predicted`` (:class:`PredictedReuse`): a block is written when its
  predicted chance of a tier hit, per byte written, reaches a threshold.
  The device's eviction policy describes each block (any object with
  ``reuse_probability(key, horizon)`` and optionally ``was_reused(key)``, as
  :class:`~kvtier.policy.learned.LearnedReusePolicy` has): its learned
  probability of reuse within the tier's expected residency (the tier's
  capacity over the rate it is written at) and whether it was used again
  since it was computed. Blocks fall in cells by the two, and each cell's
  chance of a tier hit is learned online from outcomes (see the class).
  A block the policy knows nothing about is written.

Chains: a block is never written when its parent, evicted in the same
batch, is not written (the device holds no child without its parent, so a
parent outside the batch is still on the device). A tier therefore never
gains a block whose prefix exists neither on the device nor in what it
writes. A parent skipped later, after its child was written, leaves that
child on the tier; lookups stop at the first key no level holds, so such a
child is only ever read after its parent has been recomputed on the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar, Protocol

from kvtier.errors import ConfigError

#: The admission rules by name.
ADMISSIONS: tuple[str, ...] = ("write-all", "predicted")


class ReusePredictor(Protocol):
    """What :class:`PredictedReuse` asks of the device's eviction policy."""

    def reuse_probability(self, key: int, horizon: float) -> float | None: ...


class TierAdmission:
    """Decides which evicted blocks a tier stores; the base writes every one."""

    name: ClassVar[str] = "write-all"

    def __init__(self) -> None:
        #: Blocks offered, written and skipped, and the bytes written.
        self.offered = 0
        self.written = 0
        self.skipped = 0
        self.bytes_written = 0

    def decide(
        self,
        keys: Sequence[int],
        parents: Sequence[int | None],
        sizes: Sequence[int],
        now: float,
    ) -> list[bool]:
        """For each evicted block (children before parents), whether to write it.

        ``parents[i]`` is the parent key of ``keys[i]`` (``None`` for a chain's
        first block); ``sizes[i]`` its bytes on the tier; ``now`` the clock.
        """
        n = len(keys)
        if len(parents) != n or len(sizes) != n:
            raise ConfigError(
                f"tier admission got {n} keys, {len(parents)} parents and {len(sizes)} sizes"
            )
        out = [True] * n
        self._count(out, sizes)
        return out

    def _count(self, out: Sequence[bool], sizes: Sequence[int]) -> None:
        self.offered += len(out)
        for ok, size in zip(out, sizes, strict=True):
            if ok:
                self.written += 1
                self.bytes_written += size
            else:
                self.skipped += 1

    # Feedback from the tier; the write-all rule needs none.
    def stored(self, keys: Sequence[int], now: float) -> None:
        """``keys`` were written to the tier (after :meth:`decide` said so)."""

    def hit(self, keys: Sequence[int]) -> None:
        """A lookup found ``keys`` on the tier."""

    def missed(self, key: int) -> None:
        """A lookup stopped at ``key``, which the tier does not hold."""

    def left(self, keys: Sequence[int]) -> None:
        """The tier evicted or dropped ``keys``."""


class WriteAll(TierAdmission):
    """Every evicted block is written (the chain's behaviour without admission)."""


#: Upper edges of the bins of the policy's reuse probability a cell is kept for.
_P_EDGES: tuple[float, ...] = (0.05, 0.1, 0.2)
_CELLS = 2 * (len(_P_EDGES) + 1)


def _cell(p: float, reused: bool) -> int:
    b = 0
    while b < len(_P_EDGES) and p >= _P_EDGES[b]:
        b += 1
    return b + (len(_P_EDGES) + 1 if reused else 0)


class PredictedReuse(TierAdmission):
    """Write a block when its predicted tier hits per byte written reach ``threshold``.

    The device policy gives each evicted block a reuse probability over the
    tier's expected residency and says whether the block was used again
    since it was computed; blocks fall in cells by the two. Each cell's
    chance of a tier hit is then learned from outcomes: a written block is
    hit before it leaves the tier or is not; a skipped block, remembered in
    a ghost list as long as the tier would have kept it, is asked for by a
    later lookup (it would have hit) or ages out. Cells start out written
    (``prior`` blocks of hits), so the rule begins as write-all and stops
    writing a cell once its blocks prove not worth their bytes; a skipped
    cell whose ghosts are asked for comes back. A block is written when its
    cell's hit chance, scaled to a block of ``typical_size`` bytes, reaches
    ``threshold`` (hits per typical block written).

    ``capacity_bytes`` is the tier's size. Blocks the policy does not know
    are written.
    """

    name: ClassVar[str] = "predicted"

    def __init__(
        self,
        predictor: ReusePredictor,
        capacity_bytes: int,
        typical_size: int,
        *,
        threshold: float = 0.2,
        prior: float = 64.0,
        memory: float = 4.0,
    ) -> None:
        super().__init__()
        if not callable(getattr(predictor, "reuse_probability", None)):
            raise ConfigError(
                "predicted tier admission needs a device policy that predicts reuse "
                "(reuse_probability(key, horizon)): use the learned-reuse policy"
            )
        if capacity_bytes <= 0 or typical_size <= 0:
            raise ConfigError("tier admission needs a positive tier size and block size")
        if not 0.0 < threshold <= 1.0:
            raise ConfigError(f"the admission threshold must be in (0, 1], got {threshold!r}")
        if prior <= 0.0 or memory <= 0.0:
            raise ConfigError("the admission prior and memory must be positive")
        self.predictor = predictor
        reused = getattr(predictor, "was_reused", None)
        self._reused = reused if callable(reused) else None
        self.capacity_bytes = capacity_bytes
        self.typical_size = typical_size
        self.threshold = threshold
        self._blocks = max(capacity_bytes // typical_size, 1)
        # Outcomes per cell (hits, blocks), halved when a cell's blocks pass the limit.
        self._prior = prior
        self._limit = max(memory * self._blocks / _CELLS, 2.0 * prior)
        self._hits = [prior] * _CELLS
        self._seen = [prior] * _CELLS
        #: Skipped keys and their cells, oldest first, as long as the tier would keep them.
        self._ghosts: OrderedDict[int, int] = OrderedDict()
        #: Written keys not read since, and their cells.
        self._unread: dict[int, int] = {}
        self._pending: dict[int, int] = {}
        # Bytes written and the clock span they were written over, halved together.
        self._rate_bytes = 0.0
        self._rate_since: float | None = None
        self._rate_now = 0.0
        self.unknown = 0
        self.regrets = 0
        self.wasted = 0

    @property
    def residency(self) -> float:
        """Seconds a written block is expected to stay on the tier (inf before it is known)."""
        since = self._rate_since
        span = self._rate_now - (since if since is not None else 0.0)
        if self._rate_bytes <= 0.0 or span <= 0.0:
            return float("inf")
        return self.capacity_bytes * span / self._rate_bytes

    def hit_chance(self, cell: int) -> float:
        """The learned chance that a block of ``cell`` is hit on the tier."""
        return self._hits[cell] / self._seen[cell]

    def _outcome(self, cell: int, hit: bool) -> None:
        if hit:
            self._hits[cell] += 1.0
        self._seen[cell] += 1.0
        if self._seen[cell] > self._limit:
            self._hits[cell] /= 2.0
            self._seen[cell] /= 2.0

    def decide(
        self,
        keys: Sequence[int],
        parents: Sequence[int | None],
        sizes: Sequence[int],
        now: float,
    ) -> list[bool]:
        n = len(keys)
        if len(parents) != n or len(sizes) != n:
            raise ConfigError(
                f"tier admission got {n} keys, {len(parents)} parents and {len(sizes)} sizes"
            )
        out = [True] * n
        horizon = self.residency
        decided: dict[int, bool] = {}
        ghosts = self._ghosts
        pending = self._pending
        predict = self.predictor.reuse_probability
        reused_of = self._reused
        # Parents come after their children: decide from the end.
        for i in range(n - 1, -1, -1):
            key = keys[i]
            parent = parents[i]
            ok = True
            cell = -1
            p = predict(key, horizon)
            if p is None:
                self.unknown += 1
            else:
                reused = reused_of(key) if reused_of is not None else False
                cell = _cell(p, bool(reused))
                ok = self.hit_chance(cell) * self.typical_size >= self.threshold * sizes[i]
            if parent is not None and not decided.get(parent, True):
                ok = False
            decided[key] = ok
            out[i] = ok
            if cell < 0:
                continue
            if ok:
                pending[key] = cell
            else:
                ghosts[key] = cell
                ghosts.move_to_end(key)
        while len(ghosts) > self._blocks:
            _, cell = ghosts.popitem(last=False)
            self._outcome(cell, False)
        self._count(out, sizes)
        return out

    def stored(self, keys: Sequence[int], now: float) -> None:
        if self._rate_since is None:
            self._rate_since = now
        if now > self._rate_now:
            self._rate_now = now
        self._rate_bytes += len(keys) * self.typical_size
        # Halve the window once it holds twice the tier: the estimate follows shifts.
        if self._rate_bytes > 2.0 * self.capacity_bytes:
            since = self._rate_since
            self._rate_since = since + (self._rate_now - since) / 2.0
            self._rate_bytes /= 2.0
        pending = self._pending
        unread = self._unread
        for key in keys:
            cell = pending.pop(key, -1)
            if cell >= 0:
                unread[key] = cell
        # Decisions for keys the tier already held are not followed.
        pending.clear()
        # Keys the tier dropped without telling (a medium that lost them) are forgotten.
        while len(unread) > 2 * self._blocks:
            del unread[next(iter(unread))]

    def hit(self, keys: Sequence[int]) -> None:
        unread = self._unread
        for key in keys:
            cell = unread.pop(key, -1)
            if cell >= 0:
                self._outcome(cell, True)

    def missed(self, key: int) -> None:
        cell = self._ghosts.pop(key, -1)
        if cell >= 0:
            self.regrets += 1
            self._outcome(cell, True)

    def left(self, keys: Sequence[int]) -> None:
        unread = self._unread
        for key in keys:
            cell = unread.pop(key, -1)
            if cell >= 0:
                self.wasted += 1
                self._outcome(cell, False)


def make_admission(
    name: str,
    predictor: object | None = None,
    *,
    capacity_bytes: int = 0,
    typical_size: int = 1,
    threshold: float | None = None,
) -> TierAdmission:
    """The admission rule ``name`` for a tier of ``capacity_bytes`` (see the module docs)."""
    if name == WriteAll.name:
        return WriteAll()
    if name == PredictedReuse.name:
        if predictor is None or not callable(getattr(predictor, "reuse_probability", None)):
            raise ConfigError(
                "tier admission 'predicted' needs the learned-reuse device policy "
                "(it predicts each block's reuse); use policy learned-reuse or "
                "tier admission write-all"
            )
        kwargs = {} if threshold is None else {"threshold": threshold}
        return PredictedReuse(predictor, capacity_bytes, typical_size, **kwargs)  # type: ignore[arg-type]
    raise ConfigError(f"unknown tier admission {name!r}; choose one of {', '.join(ADMISSIONS)}")
