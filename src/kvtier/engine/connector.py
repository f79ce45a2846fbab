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
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

from kvtier.costs import CostModel
from kvtier.engine.request import EngineCounters
from kvtier.engine.request import Sequence as Seq
from kvtier.errors import ConfigError, KvTierError, UnknownRequestError
from kvtier.manager import KVCacheManager, PrefixMatch
from kvtier.offload.chain import TierChain
from kvtier.offload.compress import CompressionResult

log = logging.getLogger(__name__)

#: Finished requests whose block keys :meth:`KVConnector.compress` can still find.
FINISHED_REQUESTS_REMEMBERED = 256


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

    def plan_load(self, seq: Seq, match: PrefixMatch) -> int:
        """How many of ``match``'s tier blocks ``seq`` loads (the rest it computes).

        The loaded part is always the beginning of the tier prefix (a block is
        no use without its parent). Without learned costs it loads them all.
        The choice goes into the request's metrics and a debug log line.
        """
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
        """Give up ``seq``'s pending load: the tiers' pins on what it read are released."""
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
        return self.tiers is not None and self.tiers.stores_pending

    def poll(self) -> bool:
        """Finish the tier stores that completed; False without tiers."""
        if self.tiers is None:
            return False
        self.tiers.poll()
        return True

    def close(self) -> None:
        """Finish background tier writes and close the tiers' media."""
        if self.tiers is not None:
            self.tiers.close()


def _seconds(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.4f}"
