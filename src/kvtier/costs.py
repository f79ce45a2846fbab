"""What a tier load costs and what a prefill costs, learned while the engine runs.

A prefix found on a tier below the device can be loaded or recomputed, and
which is cheaper depends on the tier (host memory moves gigabytes a second,
a remote store over a busy link a few megabytes), on how much is loaded at
once (a per-call latency is paid once per batch) and on where in the context
the tokens sit (attention makes a token at position 4,000 dearer than one
at position 100). Nothing here is configured: the numbers come from the
engine's own work.

* :class:`LoadCosts`: per tier, ``seconds = latency + bytes / bandwidth``,
  fitted to the tier's completed loads (batches of different sizes separate
  the two terms; with one size only, the latency is taken as zero).
* :class:`PrefillCosts`: per forward pass, ``seconds = overhead +
  per_token * tokens + per_pair * attention_pairs``, where a sequence that
  computes ``n`` tokens after ``c`` context tokens adds ``n`` tokens and
  ``n * (c + n / 2)`` query-key pairs. The cost of one more token at
  context length ``L`` is then ``per_token + per_pair * L``.
* :class:`CostModel`: both, and the plan (:meth:`CostModel.plan`): how many
  of a prefix's tier blocks to load (always the chain's beginning, since a
  block is useless without its parent) so that the load and the computing
  of the rest finish soonest, or none. Where loading and computing the
  prefix cost about the same, :meth:`CostModel.overlap` estimates doing both
  at once: the prefix computed from its start in chunks while its blocks
  load from its end backwards, until the two meet (as Cake does, "Compute
  or Load KV Cache? Why not both?", 2024).

Every fit weighs recent observations more (an exponential decay), so the
model follows a tier whose link gets slower or faster. Until a tier has
completed a load, or the model a forward pass, the plan loads: that is what
kvtier did before it learned anything, and it is how the first observation
comes in. This module is pure Python, with no torch and nothing of the
engine, so the replay can use it too.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.errors import BadRequestError

#: Weight each older observation keeps when a new one comes in (about the last 50 count).
DECAY = 0.98
#: Context lengths at which the per-token prefill cost is reported.
REPORT_CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)
#: Loading and computing a prefix together is considered when neither is more than
#: this many times the other: further apart, the faster one alone is about as good.
OVERLAP_RATIO = 3.0
#: Chunks the compute, and groups the load, may split a prefix into when they run
#: together: more meet closer to the ideal point but pay a pass overhead (a call
#: latency) each; :meth:`CostModel.overlap` takes the pair it estimates fastest.
OVERLAP_SPLITS = (2, 3, 4, 5, 6, 8, 10, 12, 16)
#: The overlap is chosen on its estimate with the load, or the compute, this much
#: slower than learned (the worse of the three): a meeting point that depends on
#: a group arriving just before a pass ends would fall apart on a noisy machine.
OVERLAP_MARGIN = 1.25


class _LeastSquares:
    """Decayed least squares ``y ~ x . beta`` with non-negative coefficients.

    Keeps ``X'WX`` and ``X'Wy`` only; a fit that would give a coefficient
    below zero drops that feature (it is then zero) and fits the rest again,
    so the model never predicts that more work costs less.
    """

    def __init__(self, features: int, decay: float = DECAY) -> None:
        self.k = features
        self.decay = decay
        self.xx = [[0.0] * features for _ in range(features)]
        self.xy = [0.0] * features
        self.weight = 0.0
        self.count = 0

    def add(self, x: Sequence[float], y: float) -> None:
        d = self.decay
        k = self.k
        for i in range(k):
            row = self.xx[i]
            for j in range(k):
                row[j] = row[j] * d + x[i] * x[j]
            self.xy[i] = self.xy[i] * d + x[i] * y
        self.weight = self.weight * d + 1.0
        self.count += 1

    def solve(self) -> list[float]:
        """The coefficients (all zero before any observation)."""
        active = list(range(self.k))
        while active:
            beta = _solve(
                [[self.xx[i][j] for j in active] for i in active], [self.xy[i] for i in active]
            )
            if beta is None:
                active.pop(0)  # singular: the first remaining feature cannot be told apart
                continue
            if all(b >= 0.0 for b in beta):
                out = [0.0] * self.k
                for i, b in zip(active, beta, strict=True):
                    out[i] = b
                return out
            worst = min(range(len(beta)), key=lambda i: beta[i])
            active.pop(worst)
        return [0.0] * self.k


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; ``None`` when ``a`` is (near) singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    if scale == 0.0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))
        out[r] = s / m[r][r]
    return out


@dataclass(frozen=True, slots=True)
class LoadEstimate:
    """One tier's fitted load cost."""

    #: Seconds every load call pays, whatever its size.
    latency_s: float
    #: Bytes per second once the call is under way (``inf``: too fast to see).
    bandwidth_bytes_s: float
    #: Loads observed (all time).
    loads: int

    def seconds(self, nbytes: int, calls: int = 1) -> float:
        if nbytes <= 0:
            return 0.0
        per_byte = 0.0 if math.isinf(self.bandwidth_bytes_s) else nbytes / self.bandwidth_bytes_s
        return self.latency_s * calls + per_byte


class LoadCosts:
    """Per tier: ``seconds = latency + bytes / bandwidth`` from its completed loads."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._fits: dict[str, _LeastSquares] = {}
        self._bytes: dict[str, int] = {}
        self._seconds: dict[str, float] = {}

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` from ``tier`` took ``seconds`` (one call, read and install)."""
        if nbytes <= 0 or not seconds >= 0.0 or math.isinf(seconds):
            return
        fit = self._fits.get(tier)
        if fit is None:
            fit = self._fits[tier] = _LeastSquares(2, self.decay)
        # Bytes in MB keep the two columns of comparable size for the solver.
        fit.add((1.0, nbytes / 1e6), seconds)
        self._bytes[tier] = self._bytes.get(tier, 0) + nbytes
        self._seconds[tier] = self._seconds.get(tier, 0.0) + seconds

    def estimate(self, tier: str) -> LoadEstimate | None:
        """The fitted cost of loading from ``tier``; ``None`` before its first load."""
        fit = self._fits.get(tier)
        if fit is None:
            return None
        latency, per_mb = fit.solve()
        if per_mb <= 0.0 and latency <= 0.0:
            # Nothing measurable (every load took no time): as fast as can be.
            return LoadEstimate(0.0, math.inf, fit.count)
        if per_mb <= 0.0:
            # Only one size seen, or a cost that does not grow with bytes: the time is
            # per call, which the bandwidth then says nothing about.
            return LoadEstimate(latency, math.inf, fit.count)
        return LoadEstimate(latency, 1e6 / per_mb, fit.count)

    def tiers(self) -> list[str]:
        return sorted(self._fits)

    def totals(self, tier: str) -> tuple[int, float]:
        """Bytes loaded from ``tier`` and the seconds that took (all time)."""
        return self._bytes.get(tier, 0), self._seconds.get(tier, 0.0)


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """The fitted forward-pass cost."""

    #: Seconds a pass pays whatever it computes.
    overhead_s: float
    #: Seconds per token computed, before attention.
    per_token_s: float
    #: Seconds per query-key pair of attention.
    per_pair_s: float
    passes: int

    def per_token_at(self, context: int) -> float:
        """Seconds one more token costs at context length ``context``."""
        return self.per_token_s + self.per_pair_s * context

    def seconds(self, start: int, end: int) -> float:
        """Seconds to compute tokens ``start .. end`` of a sequence in one pass."""
        n = end - start
        if n <= 0:
            return 0.0
        return self.overhead_s + self.per_token_s * n + self.per_pair_s * n * (start + n / 2)


class PrefillCosts:
    """The model's forward-pass cost from its own passes (see the module docstring)."""

    def __init__(self, decay: float = DECAY) -> None:
        self._fit = _LeastSquares(3, decay)
        self._cached: PrefillEstimate | None = None

    def observe(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        """A pass computed ``chunks`` (``(context before, new tokens)`` per sequence)."""
        tokens = sum(n for _, n in chunks)
        if tokens <= 0 or not seconds >= 0.0 or math.isinf(seconds):
            return
        pairs = sum(n * (c + n / 2) for c, n in chunks)
        # Thousands of tokens and millions of pairs: columns of comparable size.
        self._fit.add((1.0, tokens / 1e3, pairs / 1e6), seconds)
        self._cached = None

    def estimate(self) -> PrefillEstimate | None:
        """The fitted cost; ``None`` before the first pass."""
        if self._fit.count == 0:
            return None
        if self._cached is None:
            overhead, per_k, per_m = self._fit.solve()
            self._cached = PrefillEstimate(overhead, per_k / 1e3, per_m / 1e6, self._fit.count)
        return self._cached


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What to do with a prefix's tier blocks: load the first ``load_blocks``, compute the rest."""

    #: Tier blocks to load (the chain's first ones); 0: recompute them all.
    load_blocks: int
    #: Tier blocks found (the most that could be loaded).
    tier_blocks: int
    #: Estimated seconds of the plan (load, then compute what is left of the prompt).
    estimate_s: float | None
    #: Estimated seconds of recomputing everything after the device hit.
    recompute_s: float | None
    #: Estimated seconds of loading every tier block, then computing the rest.
    load_all_s: float | None

    @property
    def learned(self) -> bool:
        """Whether the estimates came from observations (else the plan loads everything)."""
        return self.estimate_s is not None


@dataclass(frozen=True, slots=True)
class OverlapPlan:
    """Loading a prefix's tier blocks from its end while computing it from its start."""

    #: Estimated seconds: until the two meet, then the rest of the prompt computed (the
    #: worse of the learned costs and of either side :data:`OVERLAP_MARGIN` slower).
    estimate_s: float
    #: Estimated seconds of loading every tier block alone (one call).
    load_s: float
    #: Estimated seconds of computing every tier block alone (one pass).
    compute_s: float
    #: Tier blocks the compute is expected to cover before the meeting point.
    meet_blocks: int
    #: Tokens the compute takes per pass while the load runs.
    chunk_tokens: int
    #: Blocks the load reads per medium call.
    group_blocks: int


def best_load(
    cached_tokens: int,
    prompt_tokens: int,
    block_size: int,
    tier_plan: Sequence[str],
    block_bytes: Sequence[int],
    prefill: PrefillEstimate,
    loads: Mapping[str, LoadEstimate],
) -> tuple[int, list[float]]:
    """The number of tier blocks to load that finishes a prompt soonest, and the estimate
    for each choice (``totals[k]``: load the first ``k`` of ``tier_plan``'s blocks, then
    compute the rest of the prompt in one pass).

    A load pays each tier's latency once per run of blocks on that tier, and every
    block's bytes; ties go to loading more (it spares the compute the other
    requests share). The rule :meth:`CostModel.plan` applies with learned costs,
    and the replay with given ones.
    """
    load_s = [0.0]
    per_byte = 0.0
    latency = 0.0
    for i, name in enumerate(tier_plan):
        est = loads[name]
        if i == 0 or tier_plan[i - 1] != name:
            latency += est.latency_s
        if not math.isinf(est.bandwidth_bytes_s):
            per_byte += block_bytes[i] / est.bandwidth_bytes_s
        load_s.append(latency + per_byte)
    best_k, best = 0, math.inf
    totals = []
    for k in range(len(tier_plan) + 1):
        total = load_s[k] + prefill.seconds(cached_tokens + k * block_size, prompt_tokens)
        totals.append(total)
        if total <= best:
            best_k, best = k, total
    return best_k, totals


class CostModel:
    """Tier load costs and prefill costs, and the plan they give (see the module docstring).

    Thread-safe: the engine observes on its thread, the stats endpoints read
    from theirs.
    """

    def __init__(self, decay: float = DECAY) -> None:
        if not 0.0 < decay <= 1.0:
            raise BadRequestError(f"a cost model's decay is in (0, 1], got {decay!r}")
        self.loads = LoadCosts(decay)
        self.prefill = PrefillCosts(decay)
        self._lock = threading.Lock()
        #: Plans made: loaded every tier block, some of them, none.
        self.plans = {"load_all": 0, "load_part": 0, "recompute": 0}
        #: Plans that loaded and computed a prefix together (:meth:`overlap`), counted
        #: apart from :attr:`plans`, which the sequential plan counted already.
        self.overlaps = 0

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.loads.observe(tier, nbytes, seconds)

    def observe_pass(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        with self._lock:
            self.prefill.observe(chunks, seconds)

    def plan(
        self,
        *,
        cached_tokens: int,
        prompt_tokens: int,
        block_size: int,
        tier_plan: Sequence[str],
        block_bytes: int | Sequence[int],
    ) -> LoadPlan:
        """How many of the prefix's tier blocks to load.

        ``cached_tokens`` are on the device already; ``tier_plan`` names the
        tier serving each following block, in order; ``block_bytes`` is what
        one block weighs on each tier (one number for all, or one per block).
        Loading ``k`` blocks costs their tiers' latency (once per run of one
        tier) and bytes; computing costs the prompt's tokens from
        ``cached_tokens + k * block_size`` on, in one pass. The ``k`` with the
        smallest sum wins (ties go to loading more: it spares the compute the
        other requests share). Unknown costs plan to load everything.
        """
        if cached_tokens < 0 or prompt_tokens <= cached_tokens or block_size <= 0:
            raise BadRequestError(
                f"a load plan needs 0 <= cached ({cached_tokens}) < prompt ({prompt_tokens}) "
                f"tokens and a positive block size ({block_size})"
            )
        t = len(tier_plan)
        if cached_tokens + t * block_size >= prompt_tokens:
            raise BadRequestError(
                f"{t} tier blocks after {cached_tokens} cached tokens reach past the "
                f"{prompt_tokens}-token prompt's last token, which is always computed"
            )
        sizes = [block_bytes] * t if isinstance(block_bytes, int) else list(block_bytes)
        if len(sizes) != t:
            raise BadRequestError(f"{len(sizes)} block sizes for {t} tier blocks")
        with self._lock:
            prefill = self.prefill.estimate()
            estimates = {name: self.loads.estimate(name) for name in set(tier_plan)}
        loads = {name: e for name, e in estimates.items() if e is not None}
        if t == 0 or prefill is None or len(loads) < len(estimates):
            if t:
                self._count(t, t)
            return LoadPlan(t, t, None, None, None)
        best_k, totals = best_load(
            cached_tokens, prompt_tokens, block_size, tier_plan, sizes, prefill, loads
        )
        best = totals[best_k]
        self._count(best_k, t)
        return LoadPlan(best_k, t, best, totals[0], totals[t])

    def overlap(
        self,
        *,
        cached_tokens: int,
        prompt_tokens: int,
        block_size: int,
        tier: str,
        tier_blocks: int,
        block_bytes: int,
        max_ratio: float = OVERLAP_RATIO,
    ) -> OverlapPlan | None:
        """Estimate computing ``tier_blocks`` blocks after ``cached_tokens`` from their start
        while ``tier`` loads them from their end; ``None`` when the costs are unknown or
        loading and computing them differ by more than ``max_ratio``.

        The compute goes a pass per chunk (each paying the pass overhead),
        the load a call per group of blocks (each paying the latency). Before
        each pass the compute looks at what has loaded: it waits for the load
        when that would reach it before the pass ended (:meth:`overlap_step`),
        and otherwise stops the pass where the loaded run starts; the two meet
        once the compute reaches the loaded run.
        Of the chunk and group sizes :data:`OVERLAP_SPLITS` gives, the pair
        with the smallest estimate wins, each estimated as the worst of the
        learned costs and of the load or the compute :data:`OVERLAP_MARGIN`
        slower.
        """
        t = tier_blocks
        if t < 2 or block_size <= 0 or cached_tokens + t * block_size >= prompt_tokens:
            return None
        with self._lock:
            prefill = self.prefill.estimate()
            load = self.loads.estimate(tier)
        if prefill is None or load is None:
            return None
        end = cached_tokens + t * block_size
        load_s = load.seconds(t * block_bytes)
        compute_s = prefill.seconds(cached_tokens, end)
        if load_s <= 0.0 or compute_s <= 0.0:
            return None
        if not 1.0 / max_ratio <= load_s / compute_s <= max_ratio:
            return None
        sizes = sorted({max(1, -(-t // n)) for n in OVERLAP_SPLITS if n <= t})
        # Seconds of each pass, by (start block, blocks): the same ones recur across sizes.
        passes: dict[tuple[int, int], float] = {}

        def pass_s(pos: int, n: int) -> float:
            got = passes.get((pos, n))
            if got is None:
                got = passes[(pos, n)] = prefill.seconds(
                    cached_tokens + pos * block_size, cached_tokens + (pos + n) * block_size
                )
            return got

        def meet(step: int, group: int, load_x: float, compute_x: float) -> tuple[float, int]:
            # When each group (from the end) arrives, and where the loaded run then starts.
            arrivals: list[tuple[float, int]] = []
            clock, hi = 0.0, t
            while hi > 0:
                lo = max(0, hi - group)
                clock += load.seconds((hi - lo) * block_bytes) * load_x
                arrivals.append((clock, lo))
                hi = lo
            now, pos, lowest, i = 0.0, 0, t, 0
            while True:
                while i < len(arrivals) and arrivals[i][0] <= now:
                    lowest = arrivals[i][1]
                    i += 1
                if pos >= lowest:
                    return now, pos
                n = min(step, lowest - pos)
                took = pass_s(pos, n) * compute_x
                reach = next(at for at, lo in arrivals if lo <= pos)
                if reach - now <= took:
                    now = reach  # the load gets here before the pass would end: wait for it
                    continue
                now += took
                pos += n

        rest = prefill.seconds(end, prompt_tokens)
        best: OverlapPlan | None = None
        for step in sizes:
            for group in sizes:
                worst, meet_at = 0.0, 0
                for load_x, compute_x in (
                    (1.0, 1.0),
                    (OVERLAP_MARGIN, 1.0),
                    (1.0, OVERLAP_MARGIN),
                ):
                    at, pos = meet(step, group, load_x, compute_x)
                    if load_x == compute_x == 1.0:
                        meet_at = pos
                    worst = max(worst, at)
                estimate = worst + rest
                if best is None or estimate < best.estimate_s:
                    best = OverlapPlan(
                        estimate, load_s, compute_s, meet_at, step * block_size, group
                    )
        return best

    def overlap_step(
        self,
        *,
        tier: str,
        computed: int,
        boundary: int,
        block_size: int,
        chunk_tokens: int,
        group_blocks: int,
        block_bytes: int,
        in_call_s: float,
    ) -> int:
        """Tokens a request loading and computing its prefix together computes next, from
        ``computed`` on, its load's run starting at token ``boundary``; 0: it waits a step
        for the load, which (its call in flight for ``in_call_s`` seconds) is estimated to
        reach ``computed`` before such a pass would end."""
        n = max(0, min(chunk_tokens, boundary - computed))
        with self._lock:
            prefill = self.prefill.estimate()
            load = self.loads.estimate(tier)
        if n == 0 or prefill is None or load is None:
            return n
        took = prefill.seconds(computed, computed + n)
        blocks = boundary // block_size - computed // block_size
        groups = -(-blocks // max(1, group_blocks))
        reach = groups * load.seconds(group_blocks * block_bytes) - in_call_s
        return 0 if reach <= took else n

    def count_overlap(self) -> None:
        with self._lock:
            self.overlaps += 1

    def _count(self, k: int, t: int) -> None:
        key = "load_all" if k == t else ("recompute" if k == 0 else "load_part")
        with self._lock:
            self.plans[key] += 1

    def stats(self) -> dict[str, object]:
        """The fitted costs as plain JSON data (what ``/v1/cache/stats`` shows)."""
        with self._lock:
            tiers: dict[str, object] = {}
            for name in self.loads.tiers():
                est = self.loads.estimate(name)
                assert est is not None
                nbytes, seconds = self.loads.totals(name)
                tiers[name] = {
                    "loads": est.loads,
                    "latency_s": est.latency_s,
                    "bandwidth_bytes_per_s": (
                        None if math.isinf(est.bandwidth_bytes_s) else est.bandwidth_bytes_s
                    ),
                    "loaded_bytes": nbytes,
                    "load_seconds": seconds,
                }
            pre = self.prefill.estimate()
            prefill: dict[str, object] | None = None
            if pre is not None:
                prefill = {
                    "passes": pre.passes,
                    "overhead_s": pre.overhead_s,
                    "per_token_s": pre.per_token_s,
                    "per_pair_s": pre.per_pair_s,
                    "per_token_s_at_context": {
                        str(c): pre.per_token_at(c) for c in REPORT_CONTEXTS
                    },
                }
            return {
                "tiers": tiers,
                "prefill": prefill,
                "plans": dict(self.plans),
                "overlap_plans": self.overlaps,
            }
