"""LRB-style eviction: a model learned online picks, among sampled blocks, the least likely reused.

In the spirit of Learning Relaxed Belady (Song et al., NSDI'20), adapted to a
prefix cache of chained blocks:

* **Features.** Per key the policy remembers (for a bounded history of keys,
  resident or not) its last access time and the gaps between its last few
  accesses, its access count, its depth in the chain, how many distinct
  children it has been seen with, and, from the last request that used it
  (heard of through ``on_request``), that request's prompt length in blocks,
  how far the key sits from the prompt's end, and how much of that prompt was
  a cache hit. At prediction time the features add the key's age and the time
  since its chain's root block was last used.
* **Labels from the past only.** After every request a few keys drawn at
  random from all the keys the policy remembers (LRB's memory window,
  resident or not, seen within twice the boundary) become training samples
  with their features at that moment. A sample's label is 1 when a later
  request names its key within the *Belady boundary* ``H`` of the sampling
  time, else 0, and it is settled only once ``H`` has passed, in sampling
  order. Requests name evicted keys too, so evictions do not hide a label.
  ``H`` is ``boundary`` times the cache's turnover time (the capacity over
  the rate of block accesses in the latest requests).
* **Model.** A LightGBM binary classifier is retrained every ``retrain``
  settled labels on the latest ``window`` of them: fitted on the older four
  fifths and checked on the newest fifth. It is used only while that
  hold-out AUC reaches ``trust``; before the first model, and while the
  latest one is not trusted, the score is the key's age (a sampled LRU).
* **Eviction.** Each round samples up to ``sample`` evictable keys, chain
  leaves first (evicting a block whose child is cached would cost the child
  too), predicts, and evicts the lowest-scored ones, up to ``per_round``
  victims a round. With ``run`` the victim's ancestors that were last used
  by the same request follow it while more victims are needed: a
  conversation judged over takes its tail with it.
* **Guard.** With ``guard`` an :class:`~kvtier.policy.guard.LRUGuard`
  compares the cache with a sampled shadow LRU; while LRU would clearly do
  better, candidates are ranked by age alone (a sampled LRU).

Decisions depend only on the calls, the injected clock and a seeded random
generator, so a replay is deterministic. LightGBM is an optional
dependency: without it, asking for the policy raises a
:class:`~kvtier.errors.ConfigError` that says how to install it.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from kvtier.errors import ConfigError, InternalInvariantError
from kvtier.policy.base import PolicyBase
from kvtier.policy.guard import LRUGuard

#: How to name this policy to ``make_policy``, ``kvtier replay --policy`` and the
#: benchmarks. It is not registered by name: it needs the optional LightGBM, and
#: it measured below ``learned-reuse`` (docs/benchmarks.md, "LRB-style learning"),
#: so it stays out of ``available_policies()`` and ``--policy all``.
IMPORT_PATH = "kvtier.policy.lrb:LRBPolicy"
#: Requests over which the access rate (and so the Belady boundary) is measured.
_RATE_WINDOW = 256
#: Scored samples kept for :meth:`LRBPolicy.online_auc`.
_SCORED = 1 << 17
#: Missing values (no earlier gap, a forgotten root): a value no real feature takes.
_MISSING = -1.0
FEATURES: tuple[str, ...] = (
    "age",
    "gap1",
    "gap2",
    "gap3",
    "count",
    "depth",
    "prompt_blocks",
    "to_prompt_end",
    "children_seen",
    "root_age",
    "hit_share",
    "new_blocks",
)


class _Meta:
    """What the policy remembers about one key."""

    __slots__ = (
        "count",
        "depth",
        "gap1",
        "gap2",
        "gap3",
        "hit_share",
        "kids_seen",
        "last",
        "new_blocks",
        "parent",
        "prompt",
        "root",
        "seq",
    )

    def __init__(self, now: float, seq: int) -> None:
        self.last = now
        self.seq = seq
        self.gap1 = _MISSING
        self.gap2 = _MISSING
        self.gap3 = _MISSING
        self.count = 0
        self.depth = 0
        self.prompt = 0
        self.parent: int | None = None
        self.root: int | None = None
        self.kids_seen = 0
        self.hit_share = 0.0
        self.new_blocks = 0

    def touch(self, now: float, seq: int) -> None:
        if self.count:
            self.gap3 = self.gap2
            self.gap2 = self.gap1
            self.gap1 = now - self.last
        self.count += 1
        self.last = now
        self.seq = seq

    def as_list(self) -> list[object]:
        return [getattr(self, name) for name in self.__slots__]


class _Pool:
    """A set of keys that can be sampled uniformly in O(1): a list and each key's index."""

    __slots__ = ("at", "keys")

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.at: dict[int, int] = {}

    def add(self, key: int) -> None:
        self.at[key] = len(self.keys)
        self.keys.append(key)

    def discard(self, key: int) -> None:
        i = self.at.pop(key, -1)
        if i < 0:
            return
        last = self.keys.pop()
        if last != key:
            self.keys[i] = last
            self.at[last] = i

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.at


def _load_lightgbm() -> Any:
    try:
        import lightgbm
    except ImportError as exc:
        raise ConfigError(
            "the 'lrb' policy needs LightGBM: install it with "
            "'pip install lightgbm==4.7.0', or choose another policy such as 'learned-reuse'"
        ) from exc
    return lightgbm


class LRBPolicy(PolicyBase):
    """Evict, among sampled keys, the one a model learned online deems least likely reused.

    ``sample``: candidates per eviction round; ``per_round``: most victims
    taken from one round; ``run``: a victim's ancestors last used by the same
    request follow it; ``boundary``: the Belady boundary in turnover times;
    ``train_samples``: candidates kept as training samples per round;
    ``window``: labelled samples the model trains on; ``retrain``: new
    labels between retrainings; ``min_train``: labels before the first
    model; ``rounds``/``leaves``: the boosted trees' count and size;
    ``history``: keys remembered, as a multiple of the capacity (at least
    ``min_history``); ``trust``: the hold-out AUC a model needs to be used;
    ``guard``: fall back to recency while a shadow LRU does better;
    ``seed``: the sampling generator's seed.
    """

    name: ClassVar[str] = "lrb"

    def __init__(
        self,
        sample: int = 64,
        per_round: int = 1,
        run: bool = True,
        boundary: float = 4.0,
        train_samples: int = 16,
        window: int = 32768,
        retrain: int = 2048,
        min_train: int = 1024,
        rounds: int = 32,
        leaves: int = 31,
        history: int = 16,
        min_history: int = 4096,
        trust: float = 0.55,
        guard: bool = True,
        seed: int = 0,
    ) -> None:
        counts = {
            "sample": sample,
            "per_round": per_round,
            "train_samples": train_samples,
            "window": window,
            "retrain": retrain,
            "min_train": min_train,
            "rounds": rounds,
            "history": history,
            "min_history": min_history,
        }
        for what, value in counts.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"lrb's {what} must be a positive integer, got {value!r}")
        if not isinstance(leaves, int) or leaves < 2:
            raise ConfigError(f"lrb's leaves must be an integer of at least 2, got {leaves!r}")
        if not isinstance(trust, (int, float)) or not 0.0 <= trust <= 1.0:
            raise ConfigError(f"lrb's trust must be an AUC in [0, 1], got {trust!r}")
        if not isinstance(boundary, (int, float)) or not boundary > 0:
            raise ConfigError(f"lrb's boundary must be a positive number, got {boundary!r}")
        self._lgb = _load_lightgbm()
        super().__init__()
        self.sample = sample
        self.per_round = per_round
        self.run = bool(run)
        self.boundary = float(boundary)
        self.train_samples = train_samples
        self.window = window
        self.retrain = retrain
        self.min_train = min_train
        self.rounds = rounds
        self.leaves = leaves
        self.trust = float(trust)
        self._use_guard = bool(guard)
        self.guard: LRUGuard | None = None
        self._history = history
        self.min_history = min_history
        self._hist_limit = min_history
        self._rng = random.Random(seed)
        # Residency: resident key -> resident children; each evictable key in one pool.
        self._kids: dict[int, int] = {}
        self._par: dict[int, int] = {}
        self._pinned: set[int] = set()
        self._leaves = _Pool()
        self._inner = _Pool()
        # What is remembered about keys, and the order to forget them in.
        self._meta: dict[int, _Meta] = {}
        self._memory = _Pool()
        self._seen: deque[tuple[int, int]] = deque()
        self._seq = 0
        self._now = 0.0
        # (time, blocks) of the latest requests, and their blocks in all: the access rate.
        self._recent: deque[tuple[float, int]] = deque()
        self._recent_blocks = 0
        # Training samples: features, time, key; pending ones wait for their label.
        self._feat: dict[int, list[float]] = {}
        self._when: dict[int, float] = {}
        self._score_at: dict[int, float] = {}
        self._pending: dict[int, list[int]] = {}
        self._reused: set[int] = set()
        self._sample_key: dict[int, int] = {}
        self._open: deque[int] = deque()
        self._labelled: deque[tuple[list[float], int, float | None]] = deque()
        self._next_sample = 0
        self._since_train = 0
        self._model: Any = None
        self._model_digest = ""
        #: The latest model's AUC on the newest labels it was not fitted on.
        self.holdout_auc: float | None = None
        #: Whether that AUC reached ``trust``, so eviction uses the model.
        self.trusted = False
        #: Models trained so far.
        self.trainings = 0
        #: Eviction rounds, and those whose first victim was also the oldest candidate.
        self.rounds_done = 0
        self.rounds_like_lru = 0
        #: (score at sampling, label) of labelled samples scored by a model.
        self.scored: deque[tuple[float, int]] = deque(maxlen=_SCORED)

    def bind(self, capacity: int, typical_size: int = 1) -> None:
        super().bind(capacity, typical_size)
        self._hist_limit = max(self._history * self.key_capacity, self.min_history)
        self.guard = LRUGuard(self.key_capacity) if self._use_guard else None

    # -- what the policy hears of ---------------------------------------------------------
    @property
    def horizon(self) -> float:
        """The Belady boundary in seconds: ``boundary`` turnover times (inf before any data).

        The turnover time is the capacity over the rate of block accesses in
        the latest requests (at most :data:`_RATE_WINDOW`), so it follows load.
        """
        recent = self._recent
        if len(recent) < 2:
            return float("inf")
        span = recent[-1][0] - recent[0][0]
        if span <= 0.0:
            return float("inf")
        rate = (self._recent_blocks - recent[0][1]) / span
        return self.boundary * max(self.key_capacity, 1) / rate

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
        n = len(keys)
        if not n:
            return
        if self.guard is not None:
            self.guard.observe(keys, self._kids)
        recent = self._recent
        if len(recent) == _RATE_WINDOW:
            self._recent_blocks -= recent.popleft()[1]
        recent.append((now, n))
        self._recent_blocks += n
        self._expire_samples()
        meta = self._meta
        pending = self._pending
        seen = self._seen
        root = keys[0]
        share = num_hit / n
        fresh = n - num_hit
        parent: int | None = None
        for i, key in enumerate(keys):
            self._seq += 1
            m = meta.get(key)
            if m is None:
                m = meta[key] = _Meta(now, self._seq)
                self._memory.add(key)
            if key in pending:
                self._label(pending.pop(key), now)
            m.touch(now, self._seq)
            if m.parent != parent:
                if parent is not None:
                    pm = meta.get(parent)
                    if pm is not None:
                        pm.kids_seen += 1
                m.parent = parent
            m.depth = i
            m.prompt = n
            m.root = root
            m.hit_share = share
            m.new_blocks = fresh
            seen.append((key, self._seq))
            parent = key
        self._forget()
        self._take_samples()

    def _forget(self) -> None:
        """Drop the oldest remembered keys that are neither resident nor awaiting a label."""
        meta = self._meta
        seen = self._seen
        limit = self._hist_limit
        # At most one pass: what residency or a pending label holds is requeued, not dropped.
        budget = len(seen)
        while seen and budget and (len(meta) > limit or len(seen) > 4 * limit):
            budget -= 1
            key, seq = seen.popleft()
            m = meta.get(key)
            if m is None or m.seq != seq:
                continue  # a later access re-queued it
            if key in self._kids or key in self._pending:
                self._seq += 1
                m.seq = self._seq
                seen.append((key, self._seq))
                continue
            del meta[key]
            self._memory.discard(key)

    # -- residency ------------------------------------------------------------------------
    def _place(self, key: int) -> None:
        """Put a resident key in the pool its state calls for (none while pinned)."""
        self._leaves.discard(key)
        self._inner.discard(key)
        kids = self._kids.get(key)
        if kids is None or key in self._pinned:
            return
        (self._leaves if kids == 0 else self._inner).add(key)

    def insert(self, key: int, pinned: bool = False, size: int = 1) -> None:
        if size != 1:
            self._record_size(key, size)
        self._join(key, pinned)
        self._forget()

    def insert_many(
        self, keys: Sequence[int], pinned: bool = False, sizes: Sequence[int] | None = None
    ) -> None:
        if sizes is not None:
            self._record_sizes(keys, sizes)
        for key in keys:
            self._join(key, pinned)
        # Keys no request named (generated tokens' blocks) are remembered here, so the
        # history is trimmed here too, not only when a request arrives.
        self._forget()

    def _join(self, key: int, pinned: bool) -> None:
        m = self._meta.get(key)
        if m is None:
            # A key no request named (a generated token's block): remembered from now.
            self._seq += 1
            m = self._meta[key] = _Meta(self._now, self._seq)
            self._memory.add(key)
            m.touch(self._now, self._seq)
            self._seen.append((key, self._seq))
        self._kids[key] = 0
        if pinned:
            self._pinned.add(key)
        p = m.parent
        if p is not None and p in self._kids:
            self._par[key] = p
            self._kids[p] += 1
            self._place(p)
        self._place(key)

    def _leave(self, key: int) -> None:
        """Forget a resident key as resident (evicted or removed)."""
        self._leaves.discard(key)
        self._inner.discard(key)
        self._pinned.discard(key)
        del self._kids[key]
        p = self._par.pop(key, None)
        if p is not None and self._kids.get(p, 0) > 0:
            self._kids[p] -= 1
            if self._kids[p] == 0:
                self._place(p)
        if self._sizes:
            self._forget_size(key)

    def access(self, key: int) -> None:
        m = self._meta.get(key)
        if m is None or key not in self._kids or m.last >= self._now:
            return  # on_request already counted this request's use
        self._seq += 1
        m.touch(self._now, self._seq)
        self._seen.append((key, self._seq))

    def access_many(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.access(key)

    def pin(self, key: int) -> None:
        if key not in self._kids or key in self._pinned:
            raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
        self._pinned.add(key)
        self._place(key)

    def unpin(self, key: int) -> None:
        if key not in self._pinned:
            raise InternalInvariantError(f"unpin of key {key:#x} that is not pinned")
        self._pinned.remove(key)
        self._place(key)

    def pin_many(self, keys: Sequence[int]) -> None:
        for key in keys:
            if key not in self._kids or key in self._pinned:
                raise InternalInvariantError(f"pin of key {key:#x} that is not evictable")
        for key in keys:
            self.pin(key)

    def unpin_many(self, keys: Sequence[int]) -> None:
        if not self._pinned.issuperset(keys):
            raise InternalInvariantError("unpin of a key that is not pinned")
        for key in keys:
            self.unpin(key)

    def remove(self, key: int) -> None:
        if key in self._kids:
            self._leave(key)

    # -- learning -------------------------------------------------------------------------
    def _features(self, key: int, now: float) -> list[float]:
        m = self._meta[key]
        root = self._meta.get(m.root) if m.root is not None else None
        return [
            now - m.last,
            m.gap1,
            m.gap2,
            m.gap3,
            float(m.count),
            float(m.depth),
            float(m.prompt),
            float(m.prompt - m.depth - 1),
            float(m.kids_seen),
            _MISSING if root is None else now - root.last,
            m.hit_share,
            float(m.new_blocks),
        ]

    def _label(self, ids: list[int], now: float) -> None:
        """A request named the key of samples ``ids``: reused, if within the boundary.

        The label is settled later, in sampling order, once the boundary has
        passed for the sample: settling reuses at once would put positives
        in the training window sooner than negatives, and the model would
        learn when a sample was taken rather than what it was.
        """
        horizon = self.horizon
        for i in ids:
            t = self._when.get(i)
            if t is not None and now - t <= horizon:
                self._reused.add(i)

    def _expire_samples(self) -> None:
        """Samples the boundary has passed for are labelled: 1 if reused within it, else 0."""
        horizon = self.horizon
        open_ = self._open
        when = self._when
        while open_:
            i = open_[0]
            t = when.get(i)
            if t is None:
                open_.popleft()
                continue
            if self._now - t <= horizon:
                break
            open_.popleft()
            self._settle(i, 1 if i in self._reused else 0)

    def _settle(self, i: int, label: int) -> None:
        self._reused.discard(i)
        key = self._sample_key.pop(i)
        waiting = self._pending.get(key)
        if waiting is not None and i in waiting:
            waiting.remove(i)
            if not waiting:
                del self._pending[key]
        feats = self._feat.pop(i)
        del self._when[i]
        score = self._score_at.pop(i, None)
        self._labelled.append((feats, label, score))
        if score is not None:
            self.scored.append((score, label))
        if len(self._labelled) > self.window:
            self._labelled.popleft()
        self._since_train += 1
        if self._since_train >= (self.retrain if self._model is not None else self.min_train):
            self._train()

    def _train(self) -> None:
        self._since_train = 0
        rows = self._labelled
        labels = [y for _, y, _ in rows]
        positives = sum(labels)
        if positives == 0 or positives == len(labels):
            return  # one class only: nothing to separate yet
        lgb = self._lgb
        x = np.array([f for f, _, _ in rows], dtype=np.float64)
        y = np.array(labels, dtype=np.float64)
        params = {
            "objective": "binary",
            "num_leaves": self.leaves,
            "learning_rate": 0.1,
            "min_data_in_leaf": 20,
            "feature_fraction": 1.0,
            "num_threads": 1,
            "deterministic": True,
            "force_row_wise": True,
            "seed": 0,
            "verbose": -1,
        }
        # Fitted on the older part of the window, checked on the newest: what
        # the model would have scored had it been in use. A model that does
        # not beat chance there is not used (sampled LRU decides instead).
        cut = len(rows) - max(len(rows) // 5, 1)
        data = lgb.Dataset(
            x[:cut], label=y[:cut], feature_name=list(FEATURES), params={"verbose": -1}
        )
        model = lgb.train(params, data, num_boost_round=self.rounds)
        check = _auc([float(v) for v in model.predict(x[cut:], num_threads=1)], labels[cut:])
        self.holdout_auc = check
        self.trusted = check is not None and check >= self.trust
        self._model = model
        self._model_digest = hashlib.sha256(model.model_to_string().encode()).hexdigest()[:16]
        self.trainings += 1

    def _scores(self, rows: list[list[float]]) -> list[float]:
        """Predicted probability of reuse within the boundary; minus the age with no model."""
        if self._model is None or not self.trusted or self.recency_order:
            return [-r[0] for r in rows]
        out = self._model.predict(np.array(rows, dtype=np.float64), num_threads=1)
        return [float(v) for v in out]

    def _take_samples(self) -> None:
        """Random remembered keys become training samples, labelled later.

        Drawn from every key the policy remembers, resident or not (LRB's
        memory window), so what the model trains on does not depend on what
        it chose to keep: samples drawn from the eviction candidates would
        over-represent the keys a model wrongly keeps.
        """
        pool = self._memory
        if not pool or len(self._feat) >= 4 * self.window:
            # Without a clock that moves, no label settles: stop drawing, stay bounded.
            return
        now = self._now
        limit = 2.0 * self.horizon
        keys: list[int] = []
        for _ in range(2 * self.train_samples):
            key = pool.keys[self._rng.randrange(len(pool))]
            if now - self._meta[key].last <= limit and key not in keys:
                keys.append(key)
                if len(keys) >= self.train_samples:
                    break
        if not keys:
            return
        rows = [self._features(k, now) for k in keys]
        scores = None
        if self._model is not None:
            out = self._model.predict(np.array(rows, dtype=np.float64), num_threads=1)
            scores = [float(v) for v in out]
        for j, key in enumerate(keys):
            i = self._next_sample
            self._next_sample += 1
            self._feat[i] = rows[j]
            self._when[i] = now
            if scores is not None:
                self._score_at[i] = scores[j]
            self._pending.setdefault(key, []).append(i)
            self._sample_key[i] = key
            self._open.append(i)

    # -- eviction -------------------------------------------------------------------------
    def evict(self) -> int | None:
        out = self.evict_many(1)
        return out[0] if out else None

    def evict_many(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            pool = self._leaves if self._leaves else self._inner
            if not pool:
                break
            self._round(pool, n - len(out), out)
        return out

    def _round(self, pool: _Pool, need: int, out: list[int]) -> None:
        """Sample candidates from ``pool``, score them, evict the lowest-scored."""
        k = min(self.sample, len(pool))
        # Candidates in sampled order (the first become training samples), scored by key.
        cands = self._rng.sample(pool.keys, k) if k < len(pool) else list(pool.keys)
        now = self._now
        rows = [self._features(c, now) for c in cands]
        scores = self._scores(rows)
        ranked = sorted(range(k), key=lambda j: (scores[j], -rows[j][0], j))
        self.rounds_done += 1
        oldest = max(range(k), key=lambda j: (rows[j][0], -j))
        if ranked[0] == oldest:
            self.rounds_like_lru += 1
        take = min(need, self.per_round)
        got = 0
        for j in ranked:
            if got >= take:
                break
            key = cands[j]
            if key not in pool:
                continue  # an earlier victim's run took it
            got += self._evict_run(key, need - got, out)

    def _evict_run(self, key: int, budget: int, out: list[int]) -> int:
        """Evict ``key`` and, with ``run``, its same-request ancestors (up to ``budget``)."""
        last = self._meta[key].last
        got = 0
        while True:
            p = self._par.get(key)
            self._leave(key)
            out.append(key)
            got += 1
            if not self.run or got >= budget or p is None or p not in self._leaves:
                return got
            pm = self._meta.get(p)
            if pm is None or pm.last != last:
                return got
            key = p

    # -- introspection ----------------------------------------------------------------
    def _pinned_keys(self) -> Iterable[int]:
        return self._pinned

    def snapshot(self) -> dict[str, Any]:
        """Residency, the remembered keys, the samples, the model's digest, the generator."""
        return {
            **self._state(),
            "resident": sorted(self._kids.items()),
            "parents": sorted(self._par.items()),
            "pinned": sorted(self._pinned),
            "leaves": list(self._leaves.keys),
            "inner": list(self._inner.keys),
            "meta": sorted((k, m.as_list()) for k, m in self._meta.items()),
            "seen": list(self._seen),
            "samples": sorted(
                (i, self._sample_key[i], self._feat[i], self._when[i], self._score_at.get(i))
                for i in self._feat
            ),
            "pending": sorted((k, list(v)) for k, v in self._pending.items()),
            "open": list(self._open),
            "reused": sorted(self._reused),
            "labelled": [list(r) for r in self._labelled],
            "model": self._model_digest,
            "rng": self._rng.getstate(),
            "guard": None if self.guard is None else self.guard.snapshot(),
            "counters": [
                *(self._seq, self._now, list(self._recent), self._recent_blocks, self._next_sample),
                *(self._since_train, self.trainings, self.rounds_done, self.rounds_like_lru),
                *(self.holdout_auc, self.trusted),
                self._hist_limit,
            ],
        }

    def __len__(self) -> int:
        return len(self._kids)

    def __contains__(self, key: object) -> bool:
        return key in self._kids

    @property
    def num_evictable(self) -> int:
        return len(self._leaves) + len(self._inner)

    @property
    def recency_order(self) -> bool:
        """Whether the guard has switched eviction to (sampled) recency order."""
        return self.guard is not None and self.guard.recency

    def feature_importance(self) -> dict[str, float]:
        """The current model's total gain per feature (empty before the first model)."""
        if self._model is None:
            return {}
        gains = self._model.feature_importance(importance_type="gain")
        return {name: float(g) for name, g in zip(FEATURES, gains, strict=True)}

    def online_auc(self) -> float | None:
        """AUC of the scores the models gave samples before their labels were known."""
        return _auc([sc for sc, _ in self.scored], [y for _, y in self.scored])


def _auc(scores: Sequence[float], labels: Sequence[int]) -> float | None:
    """Area under the ROC curve (rank-sum, ties averaged); None without both classes."""
    pos = sum(1 for y in labels if y)
    neg = len(labels) - pos
    if not pos or not neg:
        return None
    order = sorted(range(len(scores)), key=scores.__getitem__)
    rank_sum = 0.0
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        avg = (i + j) / 2.0 + 1.0
        rank_sum += avg * sum(1 for t in range(i, j + 1) if labels[order[t]])
        i = j + 1
    return (rank_sum - pos * (pos + 1) / 2.0) / (pos * neg)

