"""The scheduler: which sequences a step computes, and what becomes of them after the pass.

:class:`Scheduler` follows vLLM's rules. Requests are admitted first come,
first served while fewer than ``max_num_seqs`` run and the step's token
budget lasts; decodes go first and prompt chunks fill what is left. When a
running request cannot get a block, the *newest* running request is
preempted: its computed blocks stay cached, or are swapped to the first tier,
and it resumes later. A request's prefix comes from the device cache and the
tiers below it (:class:`~kvtier.engine.connector.KVConnector` loads it in the
background while others run, as much of it as loads faster than it computes,
or, where loading and computing cost about the same, loads it from its far
end while computing it from its start in chunks, until the two meet);
a request whose prefix another is still computing waits a step for it
instead of computing it again. A request for
``n`` choices computes its prompt once and forks it copy-on-write.

The scheduler meets the model runner only through data: :meth:`schedule`
returns a :class:`SchedulerOutput` (the batch and the outputs of requests
that ended while scheduling), :meth:`update` takes the runner's
:class:`~kvtier.engine.runner.RunnerOutput`. It owns the request lifecycle
(admission, growth, preemption, finishing) over the engine's
:class:`~kvtier.engine.queues.RequestQueues`; :mod:`kvtier.engine.migrate`
uses its public methods to move a request out and in.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvtier.engine.connector import KVConnector
from kvtier.engine.detok import IncrementalDetokenizer
from kvtier.engine.queues import RequestQueues
from kvtier.engine.request import EngineCounters, RequestOutput
from kvtier.engine.request import Sequence as Seq
from kvtier.engine.runner import RunnerOutput
from kvtier.engine.sampling import Sampler, TokenLogprob
from kvtier.errors import AdmissionRejectedError, OutOfBlocksError
from kvtier.keys import cache_salt_key
from kvtier.manager import KVCacheManager, PrefixMatch
from kvtier.offload.chain import TierChain
from kvtier.pressure.controller import PressureController
from kvtier.storage import KVBlockStorage
from kvtier.storage.windowed import WindowedKVStorage

if TYPE_CHECKING:
    from kvtier.agents.attach import AgentSupport

log = logging.getLogger(__name__)

#: What _admit returns for a request whose prefix a prefetch is still loading.
_DEFERRED = -1


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """How much one step may do."""

    #: Sequences running at once.
    max_num_seqs: int
    #: Tokens one forward pass computes at most (decodes first, prompt chunks in the rest).
    max_num_batched_tokens: int
    #: Tokens a sequence may reach (prompt and completion).
    max_model_len: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: what the runner computes, and what ended while planning it."""

    #: ``(sequence, new tokens)`` pairs for the forward pass, in batch order.
    batch: list[tuple[Seq, int]] = field(default_factory=list)
    #: Outputs of requests that ended while scheduling (cancelled, refused, out of blocks).
    outputs: list[RequestOutput] = field(default_factory=list)


class Scheduler:
    """Admission, batching, preemption and the request lifecycle (see the module docstring)."""

    def __init__(
        self,
        *,
        manager: KVCacheManager,
        storage: KVBlockStorage,
        queues: RequestQueues,
        connector: KVConnector,
        agents: AgentSupport,
        counters: EngineCounters,
        limits: SchedulerLimits,
        prefix_caching: bool,
        pressure: PressureController | None,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.manager = manager
        self.storage = storage
        self.queues = queues
        self.connector = connector
        self.agents = agents
        self.counters = counters
        self.limits = limits
        self.prefix_caching = prefix_caching
        self.pressure = pressure
        self.tokenizer = tokenizer
        #: Tokens that end a request (unless it asks to ignore them).
        self.eos_token_ids = eos_token_ids

    def schedule(self) -> SchedulerOutput:
        """End cancelled requests, install arrived loads, and plan the next pass."""
        out = SchedulerOutput()
        outs = out.outputs
        for seq in [s for s in self.queues.all() if s.cancelled]:
            self.finish(seq, "abort", "", outs)
        self._finish_loads(outs, wait=False)
        self._meet_overlaps(outs)
        out.batch = self._batch(outs)
        if isinstance(self.storage, WindowedKVStorage):
            self._hold_windows(self.storage, out.batch)
        return out

    def _mark_window(self, seq: Seq, position: int, *, pin: bool = False) -> None:
        """Windowed storage: the window a request resuming at the last block boundary at or
        before ``position`` of ``seq`` reads is a likely resume point, kept longest when idle.

        Called where ``seq`` resumed from a cached prefix (a branch point), where its
        prompt ends (the same prompt again) and where it stops (its next turn). ``pin``
        also holds that window until the step's :meth:`_hold_windows`, so nothing this
        step imports or copies takes it before the sequence's first pass reads it."""
        storage = self.storage
        if not isinstance(storage, WindowedKVStorage) or seq.table is None:
            return
        end = position // storage.layout.block_size
        if end:
            first = storage.first_read_block(end * storage.layout.block_size)
            blocks = seq.table.blocks[first:end]
            storage.slab.mark_valuable(blocks)
            if pin:
                storage.slab.pin(blocks)

    def _hold_windows(self, storage: WindowedKVStorage, batch: list[tuple[Seq, int]]) -> None:
        """Hold the window slots running sequences read, and give this pass's writes slots.

        Windowed storage (:mod:`kvtier.storage.windowed`) keeps a block's
        sliding layers only while a query can see it. A sequence reads the
        blocks from its window's start up to its first new token and writes
        the blocks after; the slots it no longer sees become idle, to be
        reclaimed. A sequence whose window lost a slot (an imported prefix
        whose slot another import took) cannot run: it is preempted without
        a swap and recomputes from the part of its prefix that is whole.
        """
        # Queued evictions leave first: a block handed a slot below may be one of them,
        # and its demotion must export the K/V it had, not the new slot's.
        self.connector.demote_pending()
        slab = storage.slab
        bs = storage.layout.block_size
        in_batch = {id(seq) for seq, _ in batch}
        hold: list[int] = []
        lost: list[Seq] = []
        for seq in self.queues.running:
            if seq.table is None or seq.load is not None:
                continue
            blocks = seq.table.blocks
            start = seq.computed
            reads = blocks[storage.first_read_block(start) : -(-start // bs)]
            if id(seq) in in_batch and not all(slab.has(b) for b in reads):
                lost.append(seq)
                continue
            hold.extend(reads)
        slab.hold(hold)
        unread = {id(seq) for seq in lost}
        for seq, n in batch:
            if id(seq) in unread:
                continue
            assert seq.table is not None
            start = seq.computed
            for b in seq.table.blocks[-(-start // bs) : -(-(start + n) // bs)]:
                if slab.assign(b, held=True) is None:
                    lost.append(seq)
                    break
        for seq in lost:
            self.counters.window_recomputes += 1
            self.preempt(seq, batch, swap=False)

    def idle(self, outs: list[RequestOutput]) -> None:
        """Nothing could be scheduled: wait for a load, or for a prefetch, instead of spinning."""
        if self.connector.wait_overlap(0.05):
            return  # a compute waits for its prefix's load to reach it
        if any(s.load is not None for s in self.queues.running):
            self._finish_loads(outs, wait=True)
        elif self.queues.num_waiting:
            self.agents.wait()  # the waiting requests need blocks a prefetch is loading

    def _batch(self, outs: list[RequestOutput]) -> list[tuple[Seq, int]]:
        """The sequences this step computes and how many tokens each (see the module docstring)."""
        batch: list[tuple[Seq, int]] = []
        queues = self.queues
        decodes = sum(
            1 for s in queues.running if s.load is None and s.num_tokens - s.computed == 1
        )
        # Decodes always run; prompt chunks share what is left.
        budget = self.limits.max_num_batched_tokens - decodes
        for seq in list(queues.running):
            if not queues.is_running(seq) or seq.load is not None:
                continue  # preempted by an older sequence, or still loading
            n = seq.num_tokens - seq.computed
            if n > 1:
                n = min(n, budget)
                cap = self.connector.overlap_cap(seq)
                if cap is not None:
                    # Its prefix is loading from the end: a chunk at a time, or none while
                    # the load is about to reach it.
                    n = min(n, cap)
                if n <= 0:
                    continue
            if not self._grow(seq, seq.computed + n, batch, outs):
                continue
            batch.append((seq, n))
            if n > 1 or seq.num_tokens - seq.computed > 1:
                budget -= n
        deferred: list[Seq] = []
        while queues.num_waiting and budget > 0:
            seq = queues.waiting[0]
            group = 1 if seq.forked else seq.params.n
            if queues.num_running + group > self.limits.max_num_seqs:
                break  # a request's choices start together, once there is room for all
            got = self._admit(seq, budget, outs)
            if got is None:
                break  # it waits (for blocks, a prefix being computed, memory pressure)
            if got == _DEFERRED:
                # Its blocks are still being prefetched: requests that are ready go first.
                deferred.append(queues.pop_head())
                continue
            if got > 0:
                batch.append((seq, got))
                budget -= got
        queues.put_back(deferred)
        return batch

    def _grow(
        self, seq: Seq, upto: int, batch: list[tuple[Seq, int]], outs: list[RequestOutput]
    ) -> bool:
        """Give the manager ``seq``'s tokens up to ``upto``; preempt newer sequences for blocks.

        Returns False when ``seq`` itself had to go (it was the newest, or alone).
        """
        assert seq.table is not None
        while seq.known < upto:
            try:
                ext = self.manager.extend(seq.seq_id, seq.token_range(seq.known, upto))
            except OutOfBlocksError:
                if self.agents.drain():
                    continue  # prefetches held blocks; landed, they are evictable
                victim = self.queues.newest_running()
                if victim is seq:
                    if self.queues.num_running == 1:
                        self.finish(
                            seq,
                            "error",
                            "",
                            outs,
                            error="out of KV cache blocks with no other request to wait for",
                        )
                    else:
                        self.preempt(seq, batch)
                    return False
                self.preempt(victim, batch)
                continue
            if ext.copies:
                self.connector.demote_pending()  # a copy may land in a just-evicted block
                self.storage.copy_blocks(ext.copies)
            seq.table = ext.block_table
            seq.known = upto
            self._mark_unready(seq)
        return True

    def _admit(self, seq: Seq, budget: int, outs: list[RequestOutput]) -> int | None:
        """Allocate ``seq``'s prefix and first chunk; tokens it computes this step.

        ``None``: it stays first in the queue (no blocks, a prefix still being
        computed, pressure says wait); 0: it was admitted but loads its
        prefix first, or it ended.
        """
        tokens = seq.tokens
        n = len(tokens)
        bs = self.manager.block_size
        match = self.match(seq, self.connector.tiers)
        keys = match.keys
        device_hit, tier_hit = match.device_blocks, match.tier_blocks
        if self.queues.unready.any(keys[:device_hit]):
            if self.agents.deferred(keys[:device_hit]):
                return _DEFERRED
            return None  # another request is computing (or loading) this prefix: wait for it
        found = tier_hit
        chunk = None
        if tier_hit:
            # Load the part of the tier prefix whose load beats computing it; compute the
            # rest; or load it from its end while computing it from its start.
            tier_hit = self.connector.plan_load(seq, match, overlap=self._can_overlap(seq))
            chunk = self.connector.planned_chunk(seq)
        hit = (device_hit + tier_hit) * bs
        upto = hit + 1 if tier_hit else hit + min(n - hit, budget, chunk or budget)
        swapped = seq.swapped
        if swapped is not None and swapped.tail_key is not None:
            upto = max(upto, min(n, swapped.num_computed_tokens + 1))
        try:
            alloc = self.manager.allocate(seq.seq_id, tokens[:upto], match=match)
        except OutOfBlocksError as exc:
            if self.queues.num_running or self.agents.drain():
                return None  # wait for running requests (or prefetches) to free blocks
            self.queues.pop_head()
            self.finish(seq, "error", "", outs, error=f"out of KV cache blocks: {exc}")
            return 0
        except AdmissionRejectedError as exc:
            if self._hold_back(seq, exc):
                return None
            self.queues.pop_head()
            self.counters.rejected += 1
            self.finish(seq, "rejected", "", outs, error=str(exc))
            return 0
        self.queues.admit_head()
        seq.delayed_since = None
        seq.table = alloc.block_table
        seq.known = upto
        seq.computed = alloc.num_cached_tokens
        # A prefix it resumes from is a branch point; its window is held from now on.
        self._mark_window(seq, seq.computed, pin=True)
        seq.admit_len = n
        seq.admissions += 1
        m = seq.metrics
        first = m.first_scheduled_time is None
        if first:
            m.first_scheduled_time = time.perf_counter()
            m.cached_tokens = seq.computed
            self.counters.cached_prompt_tokens += seq.computed
        if tier_hit:
            self.connector.start_load(seq, keys[device_hit : device_hit + tier_hit], device_hit)
        elif chunk is not None:
            self.connector.start_overlap(seq, keys[device_hit : device_hit + found], device_hit)
        self._mark_unready(seq)
        if seq.load is not None:
            return 0
        self.connector.load_tail(seq)
        left = seq.known - seq.computed
        return left if left > 0 else 0

    def _can_overlap(self, seq: Seq) -> bool:
        """Whether ``seq`` may load its tier prefix while computing it: not where the
        pool keeps sliding windows (which slots a block holds is decided per pass), a
        request with images, or one resuming a swapped-out part."""
        return (
            not isinstance(self.storage, WindowedKVStorage)
            and seq.mm is None
            and seq.swapped is None
        )

    def _meet_overlaps(self, outs: list[RequestOutput]) -> None:
        """Install the loaded ends of prefixes whose compute has reached them."""
        for seq in list(self.queues.running):
            end = self.connector.overlap_meets(seq)
            if end is None or not self.queues.is_running(seq):
                continue
            if seq.known < end and not self._grow(seq, end, [], outs):
                continue  # it was preempted or ended, its load cancelled with it
            self.connector.finish_overlap(seq)
            self._mark_unready(seq)

    def match(self, seq: Seq, tiers: TierChain | None) -> PrefixMatch:
        """``seq``'s prefix match; its keys are hashed once and kept on it while it waits.

        Without prefix caching every admission gets keys of its own (nothing
        is shared), so nothing is looked up in the tiers either. The agent
        hints reach the policy with the first admission only.
        """
        tokens = seq.tokens
        private = not self.prefix_caching
        extra: tuple[str, ...] = (f"private:{seq.seq_id}:{seq.admissions}",) if private else ()
        if seq.cache_salt is not None:
            extra = (*extra, cache_salt_key(seq.cache_salt))
        tiers = None if private else tiers
        kept = seq.match
        if kept is not None and kept.num_tokens == len(tokens) and kept.extra == extra:
            if seq.admissions and kept.hints is not None:
                kept = dataclasses.replace(kept, hints=None)
            seq.match = match = self.manager.rematch(kept, tiers)
            return match
        items = seq.mm.item_keys if seq.mm is not None else ()
        hints = None if seq.admissions else seq.hints
        seq.match = match = self.manager.match(
            tokens, extra_keys=extra, item_keys=items, hints=hints, tiers=tiers
        )
        return match

    def _finish_loads(self, outs: list[RequestOutput], *, wait: bool) -> None:
        """Install the prefix loads that are in (with ``wait``, the oldest at least)."""
        for seq in list(self.queues.running):
            if seq.load is None or (not wait and not self.connector.load_done(seq)):
                continue
            self.complete_load(seq)
            wait = False

    def complete_load(self, seq: Seq) -> None:
        self.connector.complete_load(seq)
        self._mark_unready(seq)

    def _mark_unready(self, seq: Seq) -> None:
        """Track the keys ``seq`` published whose blocks are not computed (or loaded) yet."""
        unready = self.queues.unready
        unready.release(seq.unready)
        bs = self.manager.block_size
        if seq.table is None or seq.known // bs <= seq.computed // bs:
            seq.unready = []
            return
        keys = self.manager.block_keys(seq.seq_id)
        seq.unready = keys[seq.computed // bs : seq.known // bs]
        unready.hold(seq.unready)

    def _hold_back(self, seq: Seq, exc: AdmissionRejectedError) -> bool:
        """Whether a request refused by memory pressure waits (True) or fails.

        It waits while the mode only delays and it has waited less than
        ``max_wait``; a request that already started (preempted, resuming)
        always waits, since failing it would throw away its tokens.
        """
        ctrl = self.pressure
        max_wait = ctrl.max_wait if ctrl is not None else 0.0
        now = time.monotonic()
        if seq.delayed_since is None:
            seq.delayed_since = now
        waited = now - seq.delayed_since
        if seq.admissions == 0 and (not exc.retry or waited >= max_wait):
            return False
        if not self.queues.num_running and ctrl is not None:
            # Nothing here will free memory: wait (briefly) for the sampler's next reading.
            ctrl.wait_admissible(min(ctrl.interval, max(max_wait - waited, 0.0)))
        return True

    # -- the forward pass ------------------------------------------------------------------
    def update(self, result: RunnerOutput, outs: list[RequestOutput]) -> None:
        """Apply a pass's result: advance what it computed, end what failed, emit the tokens."""
        for seq, n in result.computed:
            self._advance(seq, n)
        failed = {id(seq) for seq, _ in result.failed}
        for seq, error in result.failed:
            self.counters.forward_errors += 1
            self.finish(seq, "error", "", outs, error=error)
        for s in result.sampled:
            seq = s.seq
            if id(seq) in failed or not self.queues.is_running(seq):
                continue
            try:
                choices = [] if seq.forked else self._fork_choices(seq, s.logits)
            except Exception as exc:
                self.counters.forward_errors += 1
                log.exception("starting the choices of request %s failed", seq.request_id)
                self.finish(seq, "error", "", outs, error=f"{type(exc).__name__}: {exc}")
                continue
            self._on_token(seq, s.token, s.logprob, outs)
            for child, child_token, child_logprob in choices:
                self._on_token(child, child_token, child_logprob, outs)

    def _advance(self, seq: Seq, n: int) -> None:
        """``n`` more of ``seq``'s tokens have K/V: count them, store them through, mark them."""
        start = seq.computed
        seq.computed = start + n
        if start < seq.admit_len <= seq.computed:
            self._mark_window(seq, seq.admit_len - 1)  # where the same prompt resumes
        prompt_part = max(0, min(seq.computed, seq.admit_len) - start)
        self.counters.computed_prompt_tokens += prompt_part
        self.connector.store_computed(seq, start, seq.computed)
        if seq.unready:
            self._mark_unready(seq)

    def _fork_choices(
        self, seq: Seq, logits: torch.Tensor
    ) -> list[tuple[Seq, int, TokenLogprob | None]]:
        """Start choices 1 .. n-1 of ``seq`` from its computed prompt (shared blocks)."""
        seq.forked = True
        out: list[tuple[Seq, int, TokenLogprob | None]] = []
        try:
            for i in range(1, seq.params.n):
                child = Seq(
                    seq.request_id,
                    seq.prompt_ids,
                    seq.params,
                    Sampler(seq.params, seed_offset=i),
                    IncrementalDetokenizer(self.tokenizer, seq.params.stop),
                    dataclasses.replace(seq.metrics),
                    index=i,
                    seq_id=f"{seq.request_id}#{i}",
                    forked=True,
                    admissions=1,
                )
                child.mm = seq.mm  # a resumed choice recomputes its prompt from the same images
                child.table = self.manager.fork(seq.seq_id, child.seq_id)
                child.known, child.computed = seq.known, seq.computed
                child.admit_len = seq.admit_len
                token, logprob = child.sampler.sample(logits)
                self.queues.add_choice(child)
                self.counters.forked_sequences += 1
                out.append((child, token, logprob))
        except BaseException:
            # A choice that could not start undoes every choice started here.
            for child, _, _ in out:
                self.queues.drop_choice(child)
                self.manager.free(child.seq_id)
            raise
        return out

    def _on_token(
        self,
        seq: Seq,
        token: int,
        logprob: TokenLogprob | None,
        outs: list[RequestOutput],
    ) -> None:
        m = seq.metrics
        now = time.perf_counter()
        if m.first_token_time is None:
            m.first_token_time = now
            self.counters.ttft.observe(now - m.arrival_time)
        seq.generated.append(token)
        m.completion_tokens += 1
        self.counters.generation_tokens += 1
        lp = () if logprob is None else (logprob,)
        if token in self.eos_token_ids and not seq.params.ignore_eos:
            self.finish(seq, "stop", seq.detok.flush(), outs, token=token, logprobs=lp)
            return
        text = seq.detok.add(token)
        if seq.detok.stopped:
            self.finish(seq, "stop", text, outs, token=token, logprobs=lp)
        elif (
            len(seq.generated) >= seq.params.max_tokens
            or seq.num_tokens >= self.limits.max_model_len
        ):
            self.finish(seq, "length", text + seq.detok.flush(), outs, token=token, logprobs=lp)
        else:
            outs.append(
                RequestOutput(
                    seq.request_id, text, [token], False, None, m, index=seq.index, logprobs=lp
                )
            )

    # -- leaving the batch -----------------------------------------------------------------
    def release(self, seq: Seq, *, keep: bool) -> None:
        """Give back ``seq``'s blocks: computed ones stay cached if ``keep``, else withdrawn."""
        if seq.table is None:
            return
        self.connector.drop_load(seq)
        if keep:
            self._mark_window(seq, seq.computed)  # where it (or its next turn) resumes
        if not keep:
            self.manager.abort(seq.seq_id, seq.metrics.cached_tokens if seq.admissions == 1 else 0)
        elif seq.known > seq.computed:
            self.manager.abort(seq.seq_id, seq.computed)
        else:
            self.manager.free(seq.seq_id)
        seq.table = None
        seq.known = seq.computed = 0
        self._mark_unready(seq)

    def preempt(self, seq: Seq, batch: list[tuple[Seq, int]], *, swap: bool = True) -> None:
        """Take ``seq`` out of the running set; it resumes later from its cached blocks.

        ``swap`` lets it move its blocks to the first tier when it can.
        """
        for i, (s, _) in enumerate(batch):
            if s is seq:
                del batch[i]
                break
        self.connector.cancel_overlap(seq)
        if seq.load is not None:
            self.complete_load(seq)
        if swap and self.prefix_caching and self.connector.swap_out(seq):
            self._mark_unready(seq)
        else:
            self.release(seq, keep=self.prefix_caching)
        self.queues.preempt(seq)
        seq.metrics.preemptions += 1
        self.counters.preemptions += 1

    def finish(
        self,
        seq: Seq,
        reason: str,
        text: str,
        outs: list[RequestOutput],
        *,
        token: int | None = None,
        error: str | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        self.connector.cancel_overlap(seq)
        if seq.table is not None and reason in ("stop", "length"):
            self.agents.finished(seq)
        if seq.table is not None:
            if reason == "error":
                self.connector.drop_load(seq)
                self.manager.abort(seq.seq_id, seq.computed)
                seq.table = None
                self._mark_unready(seq)
            else:
                if self.prefix_caching:
                    self.connector.remember(seq)
                self.release(seq, keep=self.prefix_caching)
        last = self.queues.remove(seq)
        if seq.mm is not None and last:
            seq.mm.release()  # the last choice ended: its images' cache entries unpin
        m = seq.metrics
        m.finish_time = time.perf_counter()
        c = self.counters
        c.finished[reason] = c.finished.get(reason, 0) + 1
        c.e2e_seconds += m.finish_time - m.arrival_time
        c.e2e_count += 1
        c.last = m
        outs.append(
            RequestOutput(
                seq.request_id,
                text,
                [] if token is None else [token],
                True,
                reason,
                m,
                error,
                index=seq.index,
                logprobs=logprobs,
            )
        )
        if not seq.forked:
            # It ended before its prompt was forked: the other choices end with it.
            for i in range(1, seq.params.n):
                outs.append(RequestOutput(seq.request_id, "", [], True, reason, m, error, index=i))
