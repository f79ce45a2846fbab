"""Prefetch: bring the blocks of agents due soon back from the tiers before their requests.

Every engine step, :class:`Prefetcher` asks which targets are due soon,
soonest first: agents due within ``lookahead`` steps of their workflows, and
paused sessions due back within a lead time of when their TTL says they
return. For each one whose prompt blocks (an agent's registered prefix, or
what the target's last request used) sit on a tier below the device, it
starts loading them in the background through the tier chain's own async
loads (:meth:`~kvtier.offload.chain.TierChain.start_load`).
The blocks are published on the device at once, marked not ready, and
installed when their reads are in; a request that needs them is passed over
by the scheduler until then, so requests that are ready run first.

Two bounds: the bytes being read at once never exceed ``max_bytes``, and a
prefetch only takes device blocks that are empty or hold blocks due *later*
than the agent it is for (the workflow policy says which; with another
policy only empty blocks are used), so it never evicts a block due sooner.
:func:`plan_prefetch` is that decision as a pure function.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError, KvTierError

if TYPE_CHECKING:
    from kvtier.offload.promote import PendingLoad

#: Bytes of blocks in flight at once, by default.
DEFAULT_PREFETCH_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class SessionTarget:
    """A paused session as a prefetch target (an agent is its ``(workflow, agent)``)."""

    session_id: str


@dataclass(frozen=True, slots=True)
class Candidate:
    """A target due soon (an agent's ``(workflow, agent)``, or a :class:`SessionTarget`)
    whose blocks a tier holds."""

    distance: int
    target: Hashable
    #: Blocks a tier could bring in (after those already on the device).
    blocks: int


@dataclass(frozen=True, slots=True)
class Grant:
    """How many blocks of a candidate to fetch now."""

    candidate: Candidate
    blocks: int


def plan_prefetch(
    candidates: Sequence[Candidate],
    *,
    bytes_per_block: int,
    budget_bytes: int,
    empty_blocks: int,
    evictable_after: Callable[[int], int],
) -> list[Grant]:
    """Which candidates to fetch and how much, soonest first, within both bounds.

    ``budget_bytes`` is what may still be in flight; ``empty_blocks`` the
    device's empty blocks; ``evictable_after(d)`` how many evictable blocks
    are due later than ``d`` steps. Grants use empty blocks first; a grant
    for an agent ``d`` steps away takes at most what is due later than ``d``
    beyond them, and blocks granted earlier are spent from both.
    """
    grants: list[Grant] = []
    budget = budget_bytes // bytes_per_block if bytes_per_block > 0 else 0
    empty = empty_blocks
    taken = 0  # evictable blocks already promised to earlier grants
    for c in sorted(candidates, key=lambda c: c.distance):
        if budget <= 0:
            break
        room = empty + max(evictable_after(c.distance) - taken, 0)
        n = min(c.blocks, budget, room)
        if n <= 0:
            continue
        grants.append(Grant(c, n))
        budget -= n
        use_empty = min(n, empty)
        empty -= use_empty
        taken += n - use_empty
    return grants


@dataclass
class _Fetch:
    request_id: str
    target: Hashable
    distance: int
    keys: list[int]
    #: Blocks of the prefix already on the device when it began (held, not loaded).
    device_blocks: int
    nbytes: int
    pending: PendingLoad


@dataclass
class PrefetchCounters:
    """What the prefetcher did; exported in the cache stats."""

    started: int = 0
    completed: int = 0
    blocks: int = 0
    bytes: int = 0
    loaded_blocks: int = 0
    #: Agents skipped because nothing due later could make room for them.
    no_room: int = 0
    #: Planning rounds that stopped at the bytes bound.
    at_budget: int = 0
    peak_bytes: int = 0


@dataclass
class Prefetcher:
    """Background prefetch for one engine (see the module docstring)."""

    engine: Any
    #: ``target -> (token ids, block keys)`` of what to fetch for a target.
    targets: Callable[[Hashable], tuple[Sequence[int], Sequence[int]] | None]
    #: ``lookahead -> [(steps, target)]`` of the targets due within it, soonest first.
    due: Callable[[int], Sequence[tuple[int, Hashable]]]
    evictable_after: Callable[[int], int]
    lookahead: int = 2
    max_bytes: int = DEFAULT_PREFETCH_BYTES
    counters: PrefetchCounters = field(default_factory=PrefetchCounters)
    _fetches: list[_Fetch] = field(default_factory=list)
    _ids: Any = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ConfigError(
                f"prefetch lookahead must be a number of steps >= 0, got {self.lookahead!r}"
            )
        if not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise ConfigError(
                f"prefetch max_bytes must be a positive integer, got {self.max_bytes!r}"
            )

    @property
    def in_flight_bytes(self) -> int:
        return sum(f.nbytes for f in self._fetches)

    @property
    def busy(self) -> bool:
        return bool(self._fetches)

    def loading(self, keys: Sequence[int]) -> bool:
        """Whether any of ``keys`` is a block a prefetch is still loading."""
        if not self._fetches:
            return False
        wanted = set(keys)
        return any(not wanted.isdisjoint(f.keys) for f in self._fetches)

    # -- each step ------------------------------------------------------------------
    def poll(self) -> None:
        """Install the loads that are in, then start what the plan allows."""
        self.finish(wait=False)
        self.start()

    def finish(self, *, wait: bool) -> int:
        """Install finished loads (with ``wait``, the oldest at least); returns how many."""
        tiers = self.engine.tier_chain
        done = 0
        for f in list(self._fetches):
            if not (wait or tiers.load_done(f.pending)):
                continue
            self._complete(f)
            done += 1
            wait = False
        return done

    def _complete(self, f: _Fetch) -> None:
        engine = self.engine
        self._fetches.remove(f)
        loaded = 0
        try:
            loaded = engine.tier_chain.finish_load(f.pending)
        finally:
            engine.queues.unready.release(f.keys)
            # Blocks that did not load are withdrawn; the rest stay cached for the agent.
            bs = engine.manager.block_size
            engine.manager.abort(f.request_id, (f.device_blocks + loaded) * bs)
        self.counters.completed += 1
        self.counters.loaded_blocks += loaded

    def start(self) -> list[Grant]:
        """Start loads for the agents due soonest, within the bounds; returns the grants."""
        engine = self.engine
        tiers = engine.tier_chain
        if tiers is None:
            return []
        manager = engine.manager
        bpb = engine.layout.bytes_per_block
        found: list[tuple[Candidate, Sequence[int], Sequence[int], int]] = []
        for distance, what in self.due(self.lookahead):
            target = self.targets(what)
            if target is None:
                continue
            tokens, keys = target
            dev = manager.device_hits(keys)
            if dev >= len(keys):
                continue
            rest = keys[dev:]
            if engine.queues.unready.any(rest):
                continue  # being computed or loaded already
            t = len(tiers.lookup(rest))
            if t:
                found.append((Candidate(distance, what, t), tokens, keys, dev))
        if not found:
            return []
        budget = self.max_bytes - self.in_flight_bytes
        grants = plan_prefetch(
            [c for c, _, _, _ in found],
            bytes_per_block=bpb,
            budget_bytes=budget,
            empty_blocks=manager.num_empty,
            evictable_after=self.evictable_after,
        )
        granted = {id(g.candidate): g.blocks for g in grants}
        if len(grants) < len(found) and budget < bpb * sum(c.blocks for c, _, _, _ in found):
            self.counters.at_budget += 1
        for c, tokens, keys, dev in found:
            n = granted.get(id(c))
            if n is None:
                self.counters.no_room += 1
                continue
            self._launch(c, tokens, keys, dev, n, bpb)
        return grants

    def _launch(
        self, c: Candidate, tokens: Sequence[int], keys: Sequence[int], dev: int, n: int, bpb: int
    ) -> None:
        engine = self.engine
        manager = engine.manager
        bs = manager.block_size
        rid = f"prefetch-{next(self._ids)}"
        upto = dev + n
        try:
            alloc = manager.allocate(rid, list(tokens[: upto * bs]), block_keys=list(keys[:upto]))
        except KvTierError:
            self.counters.no_room += 1
            return
        published = manager.block_keys(rid)
        n = min(n, len(published) - dev)
        blocks = alloc.block_table.blocks[dev : dev + n]
        pending = engine.tier_chain.start_load(list(keys[dev : dev + n]), blocks) if n > 0 else None
        if pending is None:
            manager.abort(rid, 0)
            return
        loading = list(keys[dev : dev + n])
        engine.queues.unready.hold(loading)
        nbytes = n * bpb
        self._fetches.append(_Fetch(rid, c.target, c.distance, loading, dev, nbytes, pending))
        cnt = self.counters
        cnt.started += 1
        cnt.blocks += n
        cnt.bytes += nbytes
        cnt.peak_bytes = max(cnt.peak_bytes, self.in_flight_bytes)

    def close(self) -> None:
        """Finish every load in flight (the engine is closing)."""
        while self._fetches:
            self.finish(wait=True)
