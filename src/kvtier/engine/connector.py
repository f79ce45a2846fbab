"""The engine's KV connector: a request's K/V between the device blocks and the tiers below.

:class:`KVConnector` is the engine's one user of the
:class:`~kvtier.offload.chain.TierChain`: it starts and installs prefix loads
from the tiers, stores computed blocks on write-through tiers, swaps a
preempted request out and its partial last block back in, compresses a
request's cached blocks into the device tier, and keeps the tiers' background
work moving. Without tiers every method is a no-op, so the scheduler never
asks whether tiers exist. It changes a sequence's own fields (its pending
load, its computed tokens) and the engine's counters, never the queues.

It also decides, per request, whether a prefix a tier holds is worth loading
(:meth:`KVConnector.plan_load`): a :class:`~kvtier.costs.CostModel` learns
each tier's load latency and bandwidth from the loads the chain completes
and the model's prefill cost from the engine's forward passes, and the
request loads the beginning of its tier prefix whose load beats computing
it, and computes the rest (all of it when the tier is slower than the model).
Where loading and computing the tier prefix cost about the same (within
:data:`~kvtier.costs.OVERLAP_RATIO`), it does both at once, as Cake does
("Compute or Load KV Cache? Why not both?", 2024): a thread reads the prefix's
blocks from its far end backwards into host memory
(:class:`~kvtier.offload.backward.BackwardLoad`) while the scheduler computes
the prefix from its start in chunks no longer than what is still missing;
once the compute reaches the loaded run (:meth:`KVConnector.overlap_meets`),
the load stops and the blocks the compute did not reach are verified and
installed (:meth:`KVConnector.finish_overlap`), the same bytes a whole load
would have brought. A block missing or failing its checks ends the loaded
run there, and the compute goes further.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.costs import CostModel, LoadPlan, OverlapPlan
from kvtier.engine.request import EngineCounters
from kvtier.engine.request import Sequence as Seq
from kvtier.errors import ConfigError, KvTierError, UnknownRequestError
from kvtier.manager import KVCacheManager, PrefixMatch
from kvtier.offload.backward import BackwardLoad
from kvtier.offload.chain import TierChain
from kvtier.offload.compress import CompressionResult

log = logging.getLogger(__name__)

#: Finished requests whose block keys :meth:`KVConnector.compress` can still find.
FINISHED_REQUESTS_REMEMBERED = 256


@dataclass(slots=True)
class _Overlap:
    """A request computing its tier prefix while the prefix loads from its end."""

    load: BackwardLoad
    #: The request's block index of the first tier block (its device hit, in blocks).
    first: int
    #: Tier blocks the plan found (the load covers its first ``len(load.items)``).
    tier_blocks: int
    #: Tokens a pass computes at most while the load runs.
    chunk_tokens: int
    #: Token position where the loaded run started at the last check.
    boundary: int
    #: The tier's name and what one block weighs on it (for the cost model).
    tier: str
    block_bytes: int
    #: Whether the last step left the compute waiting for the load.
    waiting: bool = False


class KVConnector:
    """Tier loads, stores, swaps and compression for one engine (see the module docstring)."""

    def __init__(
        self,
        manager: KVCacheManager,
        tiers: TierChain | None,
        counters: EngineCounters,
        costs: CostModel | None = None,
    ) -> None:
        self.manager = manager
        #: The chain of tiers below the device (``None``: none configured).
        self.tiers = tiers
        self.counters = counters
        #: What loads and prefills cost here, learned as the engine runs.
        self.costs = costs if costs is not None else CostModel()
        #: Load every tier block a request finds, whatever the costs say: a decode
        #: instance of a prefill/decode pair, whose prefill side computed the prompt so
        #: that this one spends its compute on decoding.
        self.load_all = False
        if tiers is not None:
            tiers.on_load = self._observe_load
        #: Block keys of recently finished requests (request id -> one chain per choice).
        self._finished_keys: collections.OrderedDict[str, list[list[int]]] = (
            collections.OrderedDict()
        )
        #: Overlapped plans chosen at admission, by sequence id, not started yet.
        self._planned: dict[str, OverlapPlan] = {}
        #: Overlapped loads running, by sequence id.
        self._overlaps: dict[str, _Overlap] = {}
        #: Loads that met their compute while a read was in flight: unpinned once it ends.
        self._retiring: list[BackwardLoad] = []

    # -- costs and the load-or-recompute plan ------------------------------------------
    def _observe_load(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
        self.costs.observe_load(tier, nbytes, seconds)

    def observe_pass(self, batch: Sequence[tuple[Seq, int]], seconds: float) -> None:
        """A forward pass computed ``batch`` (before the scheduler advanced it) in ``seconds``.

        Only passes with a prompt chunk teach the prefill cost: decode-only
        passes say little about what a long prompt costs, and would outweigh
        the passes that do.
        """
        chunks = [(seq.computed, n) for seq, n in batch]
        if any(n > 1 for _, n in chunks):
            self.costs.observe_pass(chunks, seconds)

    def plan_load(self, seq: Seq, match: PrefixMatch, *, overlap: bool = False) -> int:
        """How many of ``match``'s tier blocks ``seq`` loads (the rest it computes).

        The loaded part is always the beginning of the tier prefix (a block is
        no use without its parent). Without learned costs it loads them all.
        With ``overlap`` (the scheduler can run one) and a prefix one tier
        serves whose load and compute cost about the same, it may return 0
        and plan to load and compute together instead (:meth:`planned_chunk`
        then says so). The choice goes into the request's metrics and a debug
        log line.
        """
        self._planned.pop(seq.seq_id, None)
        tiers = self.tiers
        t = match.tier_blocks
        if tiers is None or t == 0:
            return 0
        if self.load_all:
            return t
        bs = self.manager.block_size
        names = [tiers.tiers[i].name for i in match.tier_plan]
        sizes = []
        for i in match.tier_plan:
            fmt = tiers.tiers[i].fmt
            sizes.append(fmt.blob_size if fmt is not None else 0)
        cached = match.device_blocks * bs
        plan = self.costs.plan(
            cached_tokens=cached,
            prompt_tokens=seq.num_tokens,
            block_size=bs,
            tier_plan=names,
            block_bytes=sizes,
        )
        k = plan.load_blocks
        if overlap and self._plan_overlap(seq, match, cached, names, sizes, plan):
            return 0
        if seq.admissions == 0:
            m = seq.metrics
            m.recomputed_tier_tokens = (t - k) * bs
            m.plan_estimate_s = plan.estimate_s
            m.recompute_estimate_s = plan.recompute_s
            self.counters.recomputed_tier_tokens += (t - k) * bs
        log.debug(
            "request %s: %d tokens cached on the device, %d of %d on tiers loaded, %d computed "
            "(estimates: plan %s s, recompute %s s, load all %s s)",
            seq.seq_id,
            cached,
            k * bs,
            t * bs,
            seq.num_tokens - cached - k * bs,
            _seconds(plan.estimate_s),
            _seconds(plan.recompute_s),
            _seconds(plan.load_all_s),
        )
        return k

    def _plan_overlap(
        self,
        seq: Seq,
        match: PrefixMatch,
        cached: int,
        names: list[str],
        sizes: list[int],
        plan: LoadPlan,
    ) -> bool:
        """Whether ``seq`` loads and computes its tier prefix together (see the module
        docstring); if so, the plan is kept for :meth:`start_overlap` and reported."""
        t = match.tier_blocks
        sequential_s = plan.estimate_s
        if sequential_s is None or seq.admissions != 0 or len(set(names)) != 1 or not sizes[0]:
            return False
        tiers = self.tiers
        assert tiers is not None
        if not tiers.tiers[match.tier_plan[0]].medium.caps.background:
            return False  # memory copies: nothing to gain from a thread
        bs = self.manager.block_size
        ov = self.costs.overlap(
            cached_tokens=cached,
            prompt_tokens=seq.num_tokens,
            block_size=bs,
            tier=names[0],
            tier_blocks=t,
            block_bytes=sizes[0],
        )
        if ov is None or ov.estimate_s >= sequential_s:
            return False
        self._planned[seq.seq_id] = ov
        self.costs.count_overlap()
        m = seq.metrics
        m.recomputed_tier_tokens = t * bs  # until the meeting point says what loaded
        m.plan_estimate_s = ov.estimate_s
        m.recompute_estimate_s = plan.recompute_s
        self.counters.recomputed_tier_tokens += t * bs
        log.debug(
            "request %s: %d tokens cached on the device, %d on tiers loaded from the end "
            "while computed from the start, meeting after about %d computed (%d-token "
            "passes, %d blocks a read; estimates: together %s s, sequential plan %s s, "
            "load all %s s, compute all %s s)",
            seq.seq_id,
            cached,
            t * bs,
            ov.meet_blocks * bs,
            ov.chunk_tokens,
            ov.group_blocks,
            _seconds(ov.estimate_s),
            _seconds(sequential_s),
            _seconds(ov.load_s),
            _seconds(ov.compute_s),
        )
        return True

    # -- load and compute together -------------------------------------------------------
    def planned_chunk(self, seq: Seq) -> int | None:
        """Tokens ``seq``'s first pass computes under a planned overlap; ``None``: none planned."""
        ov = self._planned.get(seq.seq_id)
        return None if ov is None else ov.chunk_tokens

    def start_overlap(self, seq: Seq, keys: Sequence[int], first: int) -> bool:
        """Start the planned backward load of ``keys`` (``seq``'s tier prefix from block
        ``first`` on); False when no tier serves them all now (it computes them)."""
        ov = self._planned.pop(seq.seq_id, None)
        if ov is None or self.tiers is None:
            return False
        load = self.tiers.start_backward_load(keys, ov.group_blocks)
        if load is None:
            return False
        bs = self.manager.block_size
        tier = self.tiers.tiers[load.tier]
        self._overlaps[seq.seq_id] = _Overlap(
            load,
            first,
            len(keys),
            ov.chunk_tokens,
            (first + len(load.items)) * bs,
            tier.name,
            tier.fmt.blob_size if tier.fmt is not None else 0,
        )
        return True

    def overlapping(self, seq: Seq) -> bool:
        return seq.seq_id in self._overlaps

    def loaded_run(self, seq: Seq) -> int | None:
        """Where ``seq``'s loaded run starts, in blocks of its tier prefix (``None``: it
        loads nothing from the end)."""
        ov = self._overlaps.get(seq.seq_id)
        return None if ov is None else ov.load.lowest

    @property
    def backward_loads(self) -> int:
        """Backward loads whose thread or pins are still held (running, or ending)."""
        return len(self._overlaps) + len(self._retiring)

    def overlap_cap(self, seq: Seq) -> int | None:
        """The most tokens ``seq``'s next pass computes (``None``: no overlap): a chunk,
        never into the loaded run as :meth:`overlap_meets` last saw it; 0 when the load
        should reach the compute before that pass would end (it waits a step)."""
        ov = self._overlaps.get(seq.seq_id)
        if ov is None:
            return None
        load = ov.load
        n = max(1, min(ov.chunk_tokens, ov.boundary - seq.computed))
        if not load.done:
            n = self.costs.overlap_step(
                tier=ov.tier,
                computed=seq.computed,
                boundary=ov.boundary,
                block_size=self.manager.block_size,
                chunk_tokens=n,
                group_blocks=load.group,
                block_bytes=ov.block_bytes,
                in_call_s=time.perf_counter() - load.call_started,
            )
        ov.waiting = n == 0
        return n

    def wait_overlap(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` s) for a load some request's compute waits for to move;
        False when none waits."""
        bs = self.manager.block_size
        for ov in self._overlaps.values():
            if ov.waiting:
                ov.load.wait_below(ov.boundary // bs - ov.first, timeout)
                return True
        return False

    def overlap_meets(self, seq: Seq) -> int | None:
        """Where ``seq``'s loaded prefix ends, if its compute has reached the loaded run
        (then grow it there and call :meth:`finish_overlap`); else ``None``."""
        ov = self._overlaps.get(seq.seq_id)
        if ov is None:
            return None
        bs = self.manager.block_size
        ov.boundary = (ov.first + ov.load.lowest) * bs
        if seq.computed < ov.boundary:
            return None
        return (ov.first + len(ov.load.items)) * bs

    def finish_overlap(self, seq: Seq) -> int:
        """Stop ``seq``'s backward load and install the loaded blocks its compute has not
        reached (verified); returns the tokens that adds to its computed ones.

        ``seq`` holds device blocks up to where :meth:`overlap_meets` said.
        """
        ov = self._overlaps.pop(seq.seq_id)
        tiers = self.tiers
        assert tiers is not None and seq.table is not None
        load = ov.load
        load.stop()
        bs = self.manager.block_size
        # A pass cut short by the step's budget can leave the compute inside a block:
        # that block is loaded whole (the same K/V, the tier's bytes).
        start = seq.computed // bs
        end = ov.first + len(load.items)
        before = seq.computed
        if ov.boundary // bs <= start < end:
            got = tiers.install_backward(load, start - ov.first, seq.table.blocks[start:end])
            if got:
                seq.computed = max(seq.computed, (start + got) * bs)
        loaded = seq.computed - before
        self._retire(load)
        self.counters.loaded_prompt_tokens += loaded
        if seq.admissions == 1 and not seq.generated:
            m = seq.metrics
            m.cached_tokens += loaded
            m.recomputed_tier_tokens = max(0, ov.tier_blocks * bs - loaded)
            self.counters.cached_prompt_tokens += loaded
            self.counters.recomputed_tier_tokens -= loaded
            if loaded:
                name = tiers.tiers[load.tier].name
                m.tier_tokens[name] = m.tier_tokens.get(name, 0) + loaded
                by_tier = self.counters.tier_hit_tokens
                by_tier[name] = by_tier.get(name, 0) + loaded
        log.debug(
            "request %s: load and compute met at token %d: %d tokens loaded from the end, "
            "%d of the prefix computed",
            seq.seq_id,
            before,
            loaded,
            before - ov.first * bs,
        )
        return loaded

    def cancel_overlap(self, seq: Seq) -> None:
        """End ``seq``'s planned or running overlap (an abort, a preemption): its thread
        is waited for and the tier's pins released; nothing is installed."""
        self._planned.pop(seq.seq_id, None)
        ov = self._overlaps.pop(seq.seq_id, None)
        if ov is not None:
            ov.load.join()
            self._retire(ov.load)

    def _retire(self, load: BackwardLoad) -> None:
        if load.done:
            assert self.tiers is not None
            self.tiers.release_backward(load)
        else:
            self._retiring.append(load)  # its read in flight ends on its own; see poll

    def _release_retired(self, *, wait: bool = False) -> None:
        if not self._retiring:
            return
        assert self.tiers is not None
        left = []
        for load in self._retiring:
            if wait:
                load.join()
            if load.done:
                self.tiers.release_backward(load)
            else:
                left.append(load)
        self._retiring = left

    # -- prefix loads ------------------------------------------------------------------
    def start_load(self, seq: Seq, keys: Sequence[int], first: int) -> None:
        """Load ``keys`` from the tiers into ``seq``'s blocks from block ``first`` on."""
        assert self.tiers is not None and seq.table is not None
        blocks = seq.table.blocks[first : first + len(keys)]
        seq.load = self.tiers.start_load(list(keys), blocks)

    def load_done(self, seq: Seq) -> bool:
        """Whether ``seq``'s pending load has arrived (install it with :meth:`complete_load`)."""
        return seq.load is not None and self.tiers is not None and self.tiers.load_done(seq.load)

    def complete_load(self, seq: Seq) -> None:
        """Install ``seq``'s pending load (waiting for it): its tokens count as computed."""
        tiers = self.tiers
        assert tiers is not None and seq.load is not None and seq.table is not None
        pending, seq.load = seq.load, None
        bs = self.manager.block_size
        loaded = tiers.finish_load(pending) * bs
        seq.computed += loaded
        self.counters.loaded_prompt_tokens += loaded
        if seq.admissions == 1 and not seq.generated:
            m = seq.metrics
            m.cached_tokens += loaded
            self.counters.cached_prompt_tokens += loaded
            by_tier = self.counters.tier_hit_tokens
            for name, blocks in pending.loaded_by_tier.items():
                m.tier_tokens[name] = m.tier_tokens.get(name, 0) + blocks * bs
                by_tier[name] = by_tier.get(name, 0) + blocks * bs
        self.load_tail(seq)

    def drop_load(self, seq: Seq) -> None:
        """Give up ``seq``'s pending load (or overlap): the tiers' pins on what it read are
        released."""
        self.cancel_overlap(seq)
        if seq.load is not None:
            assert self.tiers is not None
            self.tiers.finish_load(seq.load)
            seq.load = None

    def load_tail(self, seq: Seq) -> None:
        """Bring a swapped-out sequence's partial last block back from its tier."""
        swapped, seq.swapped = seq.swapped, None
        if swapped is None or swapped.tail_key is None or self.tiers is None:
            return
        bs = self.manager.block_size
        n = swapped.num_computed_tokens
        full = n // bs
        assert seq.table is not None
        if (
            n % bs
            and seq.computed == full * bs
            and seq.known > n
            and self.tiers.load_tail(swapped, seq.table.blocks[full])
        ):
            seq.computed = n
            self.counters.loaded_prompt_tokens += n - full * bs

    # -- stores ------------------------------------------------------------------------
    def store_computed(self, seq: Seq, start: int, end: int) -> None:
        """Tokens ``start .. end`` of ``seq`` are computed: write-through tiers store them."""
        tiers = self.tiers
        bs = self.manager.block_size
        first, last = start // bs, end // bs
        if tiers is not None and tiers.writes_through and last > first:
            assert seq.table is not None
            keys = self.manager.block_keys(seq.seq_id)[first:last]
            tiers.store_computed(keys, seq.table.blocks[first : first + len(keys)])

    def swap_out(self, seq: Seq) -> bool:
        """Move a preempted sequence's computed blocks to the first tier; False if it cannot.

        On success the sequence holds no blocks any more (``seq.swapped`` says
        where they went); on failure it still holds them and the caller
        releases them (the request recomputes).
        """
        if self.tiers is None or seq.known != seq.computed or seq.computed == 0:
            return False
        assert seq.table is not None
        bs = self.manager.block_size
        if not all(self.tiers.storage.exportable(seq.table.blocks[: -(-seq.computed // bs)])):
            return False  # some sliding-window K/V was reclaimed: it cannot be stored whole
        try:
            seq.swapped = self.tiers.swap_out(seq.seq_id, seq.tokens, seq.computed)
        except KvTierError:
            log.exception("swapping out request %s failed; it will recompute", seq.seq_id)
            return False
        seq.table = None
        seq.known = seq.computed = 0
        return True

    # -- compression ---------------------------------------------------------------------
    def remember(self, seq: Seq) -> None:
        """Keep a finishing sequence's block keys, so :meth:`compress` can find them by id."""
        if seq.table is None:
            return
        keys = self.manager.block_keys(seq.seq_id)
        chains = self._finished_keys.setdefault(seq.request_id, [])
        self._finished_keys.move_to_end(seq.request_id)
        chains.append(keys)
        while len(self._finished_keys) > FINISHED_REQUESTS_REMEMBERED:
            self._finished_keys.popitem(last=False)

    def check_compressible(self) -> TierChain:
        """The tier chain, if it has a compressed device tier; else :class:`ConfigError`."""
        if self.tiers is None or self.tiers.device_tier() is None:
            raise ConfigError(
                "compressing a request's blocks needs a compressed device tier: "
                "add --tier device:SIZE (TierSpec('device', size, codec='int8'))"
            )
        return self.tiers

    def compress(
        self, request_id: str, chains: Sequence[Sequence[int]] | None, fraction: float
    ) -> CompressionResult:
        """Move the cached blocks of ``chains`` to the device tier (``None``: a finished one's).

        Each chain is a request's block keys in order.
        """
        tiers = self.check_compressible()
        if chains is None:
            found = self._finished_keys.get(request_id)
            if found is None:
                raise UnknownRequestError(
                    f"request {request_id!r} is neither in the engine nor among the "
                    f"{FINISHED_REQUESTS_REMEMBERED} most recently finished"
                )
            chains = found
        total = CompressionResult(0, 0, 0, 0.0)
        for keys in chains:
            total = total + tiers.compress(keys, fraction)
        return total

    # -- background work ----------------------------------------------------------------
    def demote_pending(self) -> int:
        """Copy the step's device evictions down a tier (before anything rewrites them)."""
        return self.tiers.demote_pending() if self.tiers is not None else 0

    @property
    def stores_pending(self) -> bool:
        return self.tiers is not None and (self.tiers.stores_pending or bool(self._retiring))

    def poll(self) -> bool:
        """Finish the tier stores that completed (and unpin ended backward loads); False
        without tiers."""
        if self.tiers is None:
            return False
        self._release_retired()
        self.tiers.poll()
        return True

    def close(self) -> None:
        """Stop backward loads, finish background tier writes and close the tiers' media."""
        if self.tiers is not None:
            for ov in list(self._overlaps.values()):
                ov.load.join()
                self._retire(ov.load)
            self._overlaps.clear()
            self._planned.clear()
            self._release_retired(wait=True)
            self.tiers.close()


def _seconds(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.4f}"
