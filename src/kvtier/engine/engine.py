"""The reference engine: a Hugging Face causal LM generating a batch of requests through kvtier.

:class:`Engine` owns a model, its tokenizer, a :class:`~kvtier.KVCacheManager`
and the :class:`~kvtier.storage.KVBlockStorage` behind it. Requests are added
with :meth:`Engine.add_request` and advanced by :meth:`Engine.step`. Each
step runs **one forward pass** over every scheduled sequence (continuous
batching): the next token of every running request, plus chunks of prompts
being admitted, up to ``max_num_batched_tokens`` tokens, each at its own
position; attention reads every sequence's K/V through its block table
(:mod:`kvtier.engine.paged`). Output is what each request would produce
alone.

Scheduling follows vLLM's rules: requests are admitted first come, first
served while fewer than ``max_num_seqs`` run and the token budget lasts;
decodes go first and prompts are chunked into what is left; when a running
request cannot get a block, the *newest* running request is preempted (its
computed blocks stay cached, or are swapped to the first tier) and resumes
later. A request's prefix comes from the device cache and the tiers below
it: blocks on disk or Redis load in the background while the others run,
and it joins the batch when they are in. Two requests sharing a prefix
compute it once: blocks are published as their tokens are scheduled, and a
request whose prefix another is still computing (or loading) waits a step
for it rather than computing it again. A request for ``n`` choices computes
its prompt once and forks it copy-on-write. A cancelled request frees its
blocks in the step that sees the cancel.

With ``pressure`` set, a controller samples memory in the background and
the manager consults its mode: PRESSURE and above keep a share of the pool
empty by evicting (demoting, with tiers) in the policy's order, and EMERGENCY
holds new requests back (up to ``max_wait``) or refuses them.

A vision-language model (LLaVA-style, Idefics3/SmolVLM-style) runs the same
way: a request built with :meth:`Engine.encode_multimodal_chat` carries its
images (:class:`~kvtier.mm.prompt.MultimodalPrompt`); a pass that computes
placeholder tokens feeds the decoder ``inputs_embeds`` with the images'
features written over them, fetched once per request through the encoder
cache (:class:`~kvtier.mm.cache.EncoderCache`). Its block keys carry each
image's content key from the block of its first placeholder token on. Passes
without images feed ``input_ids`` exactly as for a text-only model.

The engine is single-threaded: :class:`~kvtier.engine.worker.EngineWorker`
runs it on a thread of its own for concurrent callers.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.agents.attach import AgentSupport
from kvtier.engine.config import (
    EngineConfig,
    check_min_request,
)
from kvtier.engine.connector import KVConnector
from kvtier.engine.hf_cache import layout_for_model
from kvtier.engine.paged import install
from kvtier.engine.processor import InputProcessor, bare_chat_tokens
from kvtier.engine.queues import RequestQueues, SchedulingPolicy
from kvtier.engine.request import (
    EngineCounters,
    RequestMetrics,
    RequestOutput,
)
from kvtier.engine.request import (
    Sequence as Seq,
)
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Scheduler, SchedulerLimits
from kvtier.engine.windows import plan_with_windows, window_plan
from kvtier.errors import (
    BadRequestError,
    ConfigError,
)
from kvtier.hints import Hints
from kvtier.keys import Namespace
from kvtier.layers.state import check_exact_blocks
from kvtier.layers.state_spec import state_spec
from kvtier.layout import cache_layout
from kvtier.manager import KVCacheManager
from kvtier.mm.config import EncoderCacheSpec
from kvtier.offload.chain import TierChain
from kvtier.offload.compress import CompressionResult
from kvtier.offload.config import TierSpec
from kvtier.offload.tier import Tier
from kvtier.policy.base import EvictionPolicy
from kvtier.pressure.config import PressureSpec
from kvtier.pressure.controller import PressureController
from kvtier.storage import make_storage
from kvtier.storage.windowed import WindowedKVStorage

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineCounters", "RequestMetrics", "RequestOutput", "check_config"]

#: Tokens one step computes at most, by default: a few prompt chunks next to the decodes.

#: What _admit returns for a request whose prefix a prefetch is still loading.
_DEFERRED = -1


class Engine:
    """Generates with a Hugging Face causal LM whose KV cache lives in kvtier blocks.

    ``num_blocks`` sizes the block pool; by default it is what
    ``kv_cache_bytes`` holds. ``max_num_seqs`` bounds the requests running
    at once and ``max_num_batched_tokens`` the tokens one step computes
    (decodes first; prompts are chunked into the rest). ``prefix_caching``
    off keeps every request's blocks private and drops them when it ends.
    ``sampling_defaults`` (``temperature``, ``top_p``) are what a server
    applies to requests that leave them out. ``kv_cache_dtype`` stores the
    blocks narrower than the model computes: ``bfloat16``/``float16``, or
    ``int8``/``fp8_e4m3`` with per-head scales (quantized as they are
    written, dequantized as attention reads them); the same
    ``kv_cache_bytes`` then holds proportionally more blocks.
    ``scheduling_policy`` (:class:`~kvtier.engine.queues.SchedulingPolicy`)
    orders the waiting line; first come, first served by default.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig | None = None,
        *,
        policy: str | EvictionPolicy | None = None,
        tiers: Sequence[Tier | TierSpec] = (),
        pressure: PressureSpec | PressureController | None = None,
        image_processor: Any = None,
        encoder_cache: Any = None,
        scheduling_policy: SchedulingPolicy | None = None,
        **settings: Any,
    ) -> None:
        config = _resolve_config(config, settings, policy, tiers, pressure, encoder_cache)
        # Objects given in place of their settings: built tiers, a policy instance, a
        # pressure controller, an encoder cache (for tests and embedders).
        if not isinstance(policy, EvictionPolicy):
            policy = config.cache.policy
        built_tiers = [t for t in tiers if isinstance(t, Tier)]
        if isinstance(pressure, PressureSpec) or pressure is None:
            pressure = config.pressure
        if encoder_cache is None or isinstance(encoder_cache, EncoderCacheSpec):
            encoder_cache = config.encoder_cache
        model_id = config.model_id or "model"
        block_size = config.cache.block_size
        kv_cache_dtype = config.cache.kv_cache_dtype
        prefix_caching = config.cache.prefix_caching
        sampling_defaults = config.sampling_defaults
        write_mode = config.write_mode
        kv_events = config.kv_events
        self.tokenizer = tokenizer
        self.model_id = model_id
        param = next(model.parameters())
        self.device = param.device
        #: The model's KV geometry and dtype.
        self.model_layout = layout_for_model(model.config, block_size, param.dtype)
        #: What a device block holds (``kv_cache_dtype`` applied): it sizes the pool
        #: and names the block keys' namespace.
        self.layout = cache_layout(self.model_layout, kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        # A vision-language model's decoder settings sit in its text config.
        text_config = getattr(model.config, "text_config", None) or model.config
        model_len = int(getattr(text_config, "max_position_embeddings", 0) or 2**31)
        #: Sliding-window layers kept apart from full ones (``None``: every layer per block).
        self.window_plan = (
            window_plan(
                lambda name: getattr(text_config, name, None),
                config.cache.window_kv_ratio,
                min(model_len, config.scheduler.max_model_len or model_len),
            )
            if self.layout.dtype == self.model_layout.dtype
            else None
        )
        wplan = self.window_plan
        # max_num_seqs left unset is sized here, from the cache the plan gives.
        plan, scheduler_config, num_slots = plan_with_windows(
            self.layout, model_len, config.cache, config.scheduler, str(self.device), wplan
        )
        num_blocks = plan.num_blocks
        max_model_len = plan.max_model_len
        max_num_seqs = scheduler_config.max_num_seqs
        budget = scheduler_config.max_num_batched_tokens
        assert max_num_seqs is not None and budget is not None
        self._seqs_line = config.scheduler.describe_seqs(plan, str(self.device))
        bare = bare_chat_tokens(tokenizer)
        if bare is not None:
            check_min_request(plan, bare)
        install(model)
        self.manager = KVCacheManager(
            num_blocks,
            block_size,
            policy=policy,
            namespace=Namespace(model_id, self.layout),
        )
        if wplan is None:
            self.storage = make_storage(
                self.layout, num_blocks, self.device, compute_dtype=param.dtype
            )
        else:
            assert num_slots is not None
            self.storage = WindowedKVStorage(
                self.layout,
                num_blocks,
                window_layers=wplan.window_layers,
                window=wplan.window,
                num_slots=num_slots,
                chunk=wplan.chunk,
                device=self.device,
            )
            self.manager.set_resume_check(self.storage)
            self.manager.add_evict_listener(self.storage.on_evicted)
        built = [
            spec.build(self.storage.block_shape, self.storage.dtype, device=self.device)
            for spec in config.tiers
        ] + built_tiers
        check_exact_blocks(
            state_spec(lambda name: getattr(text_config, name, None)),
            stored_dtype=self.layout.dtype,
            model_dtype=self.model_layout.dtype,
            lossy_tiers=any(t.codec.name != "raw" for t in built),
        )
        #: The chain of tiers below the device (``None`` without tiers).
        self.tier_chain: TierChain | None = (
            TierChain(
                self.storage,
                self.manager,
                built,
                write_mode=write_mode,
                tier_admission=config.tier_admission,
                reconcile_interval_s=config.tier_recheck_interval_s,
                layer_loads=config.tier_layer_loads,
            )
            if built
            else None
        )
        if self.tier_chain is not None:
            # Evictions are demoted once per step by the connector, not inside allocate.
            self.tier_chain.defer_demotions = True
        #: The memory-pressure controller (``None`` without pressure handling).
        self.pressure: PressureController | None = None
        if pressure is not None:
            if isinstance(pressure, PressureSpec):
                pressure = pressure.build(self.manager, self.layout.bytes_per_block)
            self.pressure = pressure
            self.manager.set_pressure_gate(pressure)
            pressure.start()
        #: KV events (blocks stored / removed) published in vLLM's format (``None``: off).
        self.events: Any = None
        if kv_events is not None:
            from kvtier.events import make_event_sink

            # vLLM's default topic (empty): vllm-router matches a static source's topic
            # exactly, so events under any other topic would never reach its index.
            self.events = make_event_sink(kv_events, topic="", block_size=block_size)
            self.manager.record_events()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = budget
        self.prefix_caching = prefix_caching
        #: ``temperature`` / ``top_p`` the server uses when a request leaves them out.
        self.sampling_defaults: dict[str, float] = dict(sampling_defaults or {})
        eos_token_ids = _eos_ids(model, tokenizer)
        self.vocab_size = int(getattr(text_config, "vocab_size", 0) or 0) or None
        from kvtier.mm.engine import setup_multimodal

        #: The image-text adapter (``None`` for a text-only model) and the encoder cache.
        self.vlm, self.encoder_cache = setup_multimodal(
            model, tokenizer, model_id, image_processor, encoder_cache
        )
        self.counters = EngineCounters()
        #: Tier loads, stores, swaps and compression (:mod:`kvtier.engine.connector`).
        self.connector = KVConnector(self.manager, self.tier_chain, self.counters)
        #: Runs the forward passes and samples (:mod:`kvtier.engine.runner`).
        self.runner = ModelRunner(model, self.storage, self.vlm)
        #: Who waits, who runs, and the prefixes not computed yet (:mod:`kvtier.engine.queues`).
        self.queues = RequestQueues(scheduling_policy)
        self._ids = itertools.count()
        #: Workflows, hints on finish and prefetch (:mod:`kvtier.agents.attach`).
        self.agents = AgentSupport(self)
        limits = SchedulerLimits(max_num_seqs, budget, max_model_len)
        #: Tokenizes and checks requests once (:mod:`kvtier.engine.processor`).
        self.processor = InputProcessor(tokenizer, model_id, self.vocab_size, limits, self.vlm)
        #: Admission, batching, preemption, finishing (:mod:`kvtier.engine.scheduler`).
        self.scheduler = Scheduler(
            manager=self.manager,
            storage=self.storage,
            queues=self.queues,
            connector=self.connector,
            agents=self.agents,
            counters=self.counters,
            limits=limits,
            prefix_caching=prefix_caching,
            pressure=self.pressure,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
        )
        #: Forward passes run, and tokens they computed (for the batch-size metrics).
        self.steps = 0
        policy_name = policy if isinstance(policy, str) else getattr(policy, "name", "custom")
        #: The configuration this engine runs with, as data (defaults resolved).
        self.config = dataclasses.replace(
            config,
            model_id=model_id,
            dtype=self.model_layout.dtype,
            device=str(self.device),
            cache=dataclasses.replace(
                config.cache,
                kv_cache_bytes=num_blocks * self.layout.bytes_per_block,
                num_blocks=num_blocks,
                policy=policy_name,
            ),
            scheduler=scheduler_config,
            pressure=pressure if isinstance(pressure, PressureSpec) else None,
            sampling_defaults=dict(self.sampling_defaults),
        )
        config.check_prefetch(self.tier_chain is not None)
        prefetch = config.prefetch
        if prefetch.lookahead > 0 or prefetch.session_lead_s is not None:
            self.agents.enable_prefetch(
                prefetch.lookahead, prefetch.max_bytes, prefetch.session_lead_s
            )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that end a request (unless it sets ``ignore_eos``)."""
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.scheduler.eos_token_ids = frozenset(ids)

    @property
    def model(self) -> Any:
        """The model the runner runs (replaceable, e.g. by a wrapper that injects faults)."""
        return self.runner.model

    @model.setter
    def model(self, model: Any) -> None:
        self.runner.model = model

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, model: Any = None, tokenizer: Any = None
    ) -> Engine:
        """Build an engine from :class:`EngineConfig`; loads its model unless one is given.

        With the model loading here, the cache sizes are checked against the
        model's files first and the chat template against the cache before
        the weights are read, so a configuration that cannot serve fails in
        a second, not after the model loaded.
        """
        if model is not None:
            if tokenizer is None:
                raise ConfigError("Engine.from_config: a model needs its tokenizer too")
            return cls(model, tokenizer, config)
        from kvtier.engine.model import load_model

        loaded = load_model(
            config.model,
            dtype=config.dtype,
            device=config.device,
            model_id=config.model_id,
            check_tokenizer=lambda tok: check_config(config, tok),
            tokenizer=tokenizer,
        )
        config = dataclasses.replace(
            config,
            model_id=loaded.model_id,
            sampling_defaults=(
                config.sampling_defaults
                if config.sampling_defaults is not None
                else loaded.sampling_defaults
            ),
        )
        return cls(loaded.model, loaded.tokenizer, config, image_processor=loaded.image_processor)

    def describe(self) -> list[str]:
        """What this engine runs with, one line per part (the server's startup banner)."""
        layout = self.layout
        stats = self.manager.stats()
        stored = layout.dtype + (" with per-head scales" if layout.scaled else "")
        storage = self.storage
        lines = [
            f"model {self.model_id}: {layout.num_layers} layers, {layout.num_kv_heads} KV heads "
            f"of {layout.head_dim}, {self.model_layout.dtype} on {self.device}",
            f"KV cache: {stats.total_blocks} blocks of {layout.block_size} tokens "
            f"({storage.nbytes / 2**20:.0f} MiB, {stored}), policy "
            f"{stats.policy}, prefix caching {'on' if self.prefix_caching else 'off'}",
            f"scheduler: {self._seqs_line}, in one batch of at most "
            f"{self.max_num_batched_tokens} tokens a step, max_model_len {self.max_model_len}",
        ]
        if isinstance(storage, WindowedKVStorage):
            lines.append(
                f"sliding-window layers ({len(storage.window_layer_ids)} of {layout.num_layers}, "
                f"window {storage.window}) kept for {storage.slab.num_slots} blocks at a time "
                f"(--window-kv-ratio); full layers for every block"
            )
        d = self.sampling_defaults
        lines.append(
            "requests without temperature/top_p get "
            f"temperature {d.get('temperature', 1.0)}, top_p {d.get('top_p', 1.0)}"
        )
        if self.tier_chain is not None:
            for tier in self.tier_chain.tiers:
                fmt = tier.fmt
                size = tier.capacity * (fmt.blob_size if fmt else 0)
                lines.append(
                    f"{tier.name} tier: {tier.capacity} blocks ({size / 2**20:.0f} MiB, codec "
                    f"{tier.codec.name}, policy {tier.offload_manager.policy.name}, "
                    f"{tier.write_mode})"
                )
            admission = self.tier_chain.admission.name
            if admission != "write-all":
                lines.append(
                    f"{self.tier_chain.tiers[0].name} tier admission: {admission} (evicted "
                    "blocks are written only where the device policy predicts reuse)"
                )
        if self.pressure is not None:
            p = self.pressure
            lines.append(
                f"memory pressure from {p.monitor.name} every {p.interval:g}s; "
                f"mode {p.mode.name} at {100 * p.fraction:.1f}%"
            )
        if self.events is not None:
            lines.append(f"KV events (vLLM's format) published on {self.events.endpoint}")
        if self.vlm is not None:
            from kvtier.mm.engine import describe_multimodal

            lines.extend(describe_multimodal(self.vlm, self.encoder_cache))
        return lines

    @classmethod
    def from_pretrained(
        cls,
        spec: str | None = None,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        model_id: str | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Load the default model (or ``spec``: a directory or .gguf file) and build an engine."""
        from kvtier.engine.model import load_model

        loaded = load_model(spec, dtype=dtype, device=device, model_id=model_id)
        kwargs.setdefault("sampling_defaults", loaded.sampling_defaults)
        kwargs.setdefault("image_processor", loaded.image_processor)
        return cls(loaded.model, loaded.tokenizer, model_id=loaded.model_id, **kwargs)

    # -- prompts ------------------------------------------------------------------
    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` under the model's chat template, ready for the reply."""
        return self.processor.encode_chat(messages)

    def encode_multimodal_chat(
        self, messages: Sequence[dict[str, Any]], items: Sequence[Any]
    ) -> tuple[list[int], Any]:
        """Token ids and the :class:`~kvtier.mm.prompt.MultimodalPrompt` of a chat with images.

        ``messages`` hold content parts ``{"type": "image"}`` standing for
        ``items`` (:class:`~kvtier.mm.keys.MediaItem`), in order.
        """
        from kvtier.mm.engine import encode_multimodal_chat

        return encode_multimodal_chat(self, messages, items)

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.processor.encode_prompt(prompt)

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise :class:`BadRequestError` unless the request can ever run."""
        self.processor.check_request(prompt_ids, params)

    # -- requests ---------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        arrival_time: float | None = None,
        mm: Any = None,
        hints: Hints | dict[str, object] | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises :class:`BadRequestError` for bad input.

        ``mm`` is the request's :class:`~kvtier.mm.prompt.MultimodalPrompt`
        (from :meth:`encode_multimodal_chat`), for a prompt with images.
        ``hints`` are the agent hints of :mod:`kvtier.hints` (a mapping
        or :class:`~kvtier.agents.Hints`); unknown or malformed ones are refused.
        ``cache_salt`` (vLLM's field) is mixed into every block key of the
        request: its prefix is shared only with requests of the same salt, on
        the device and on every tier.
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = self.processor.process(
            prompt_ids,
            params or SamplingParams(),
            rid,
            arrival_time=arrival_time,
            mm=mm,
            hints=hints,
            cache_salt=cache_salt,
        )
        self.enqueue(seq)
        return rid

    def enqueue(self, seq: Seq) -> None:
        """Queue a request already checked by :attr:`processor` (``InputProcessor.process``)."""
        if seq.request_id in self.queues:
            raise BadRequestError(f"request id {seq.request_id!r} is already in the engine")
        self.queues.add(seq)
        self.agents.arrived(seq)
        self.counters.requests_added += 1
        self.counters.prompt_tokens += len(seq.prompt_ids)

    def cancel(self, request_id: str) -> None:
        """Stop a request (every choice) at the next step; its computed blocks stay cached."""
        for seq in self.queues.group(request_id):
            seq.cancelled = True

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every queued and running request with ``error`` (after a step failed).

        Each request's blocks past its computed tokens are withdrawn, so
        nothing a failed pass half wrote can be served later.
        """
        outs: list[RequestOutput] = []
        for seq in list(self.queues.all()):
            try:
                self.scheduler.finish(seq, "error", "", outs, error=error)
            except Exception:
                log.exception("could not end request %s cleanly", seq.request_id)
                seq.table = None
                self.queues.remove(seq)
                self.queues.forget(seq.request_id)
                if seq.mm is not None:
                    seq.mm.release()
                outs.append(
                    RequestOutput(
                        seq.request_id, "", [], True, "error", seq.metrics, error, index=seq.index
                    )
                )
        return outs

    def has_unfinished(self) -> bool:
        return self.queues.has_unfinished()

    def background_pending(self) -> bool:
        """Whether an idle engine still has work to poll: tier stores in flight, or prefetches.

        Between an agent's steps no request may be running; the blocks the next
        agent needs can still be on their way down to a tier, and a prefetch can
        start only once they are there. Stores finish (or fail, freeing what they
        reserved on the tier) while the server idles too, so its statistics are
        current. A caller that idles (the server's worker) calls
        :meth:`poll_background` until this is false.
        """
        if self.tier_chain is None:
            return False
        p = self.agents.prefetcher
        return (p is not None and p.busy) or self.connector.stores_pending

    def background_due_in(self) -> float | None:
        """Seconds until background work falls due on its own (a paused session coming
        within the prefetch lead of its return), for a caller that idles to call
        :meth:`poll_background` then; None when nothing is scheduled."""
        if self.tier_chain is None:
            return None
        return self.agents.next_due_in()

    def poll_background(self) -> None:
        """Finish tier stores and prefetches that completed, and start the prefetches now due."""
        if self.connector.poll():
            self.agents.poll()

    def close(self) -> None:
        """Stop pressure sampling, finish background tier writes, close the tiers' media."""
        if self.pressure is not None:
            self.pressure.close()
        self.agents.close()
        self.connector.close()
        if self.events is not None:
            self._publish_events()
            self.events.close()

    def compress_request(self, request_id: str, fraction: float = 1.0) -> CompressionResult:
        """Move a finished or waiting request's cached blocks into the device tier now.

        The request's blocks cached in the pool and held by no running
        request (the last ``fraction`` of them, leaves first) are encoded into
        the compressed device tier (``--tier device:SIZE``) and their pool
        blocks freed; a later prefix hit decodes them back. Finished requests
        are remembered for this by id (the last
        :data:`~kvtier.engine.connector.FINISHED_REQUESTS_REMEMBERED`); a running request cannot be
        compressed. Returns what moved.
        """
        self.connector.check_compressible()
        seqs = self.queues.group(request_id)
        chains: list[list[int]] | None = None
        if seqs:
            if any(self.queues.is_running(s) for s in seqs):
                raise BadRequestError(
                    f"request {request_id!r} is running: compress it once it has finished "
                    "or while it waits"
                )
            # The keys admission uses (extra and image keys included), kept on each sequence.
            chains = [list(self.scheduler.match(s, None).keys) for s in seqs]
        return self.connector.compress(request_id, chains, fraction)

    @property
    def num_waiting(self) -> int:
        return self.queues.num_waiting

    @property
    def num_running(self) -> int:
        return self.queues.num_running

    def step(self) -> list[RequestOutput]:
        """Admit what fits, then run one forward pass over every scheduled sequence."""
        self.poll_background()
        self.agents.hold_waiting(self.queues.waiting)
        plan = self.scheduler.schedule()
        outs = plan.outputs
        # The step's evictions go down a tier now, in one batch, before the pass
        # writes into their blocks (allocate only queued them).
        self.connector.demote_pending()
        if plan.batch:
            started = time.perf_counter()
            result = self.runner.execute(plan.batch)
            if result.ran:
                self.steps += 1
                # Before update advances the batch: the pass's own context lengths.
                self.connector.observe_pass(plan.batch, time.perf_counter() - started)
            self.scheduler.update(result, outs)
        else:
            self.scheduler.idle(outs)
        # Sessions a request ended (session_end) free their own blocks below the device.
        self.agents.release_ended()
        if self.events is not None:
            self._publish_events()
        return outs

    def _publish_events(self) -> None:
        """Send the step's KV events: the device's, then the tiers'."""
        events = self.events
        try:
            events.drain_device(self.manager)
            if self.tier_chain is not None:
                events.drain(self.tier_chain)
            events.flush()
        except Exception:  # a subscriber problem never stops the engine
            log.exception("publishing KV events failed")

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Run one request to completion, yielding its outputs (other queued requests run too)."""
        rid = self.add_request(prompt_ids, params, request_id)
        left = (params or SamplingParams()).n
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    left -= out.finished
                    if not left:
                        return


def check_config(config: EngineConfig, tokenizer: Any = None) -> None:
    """Check ``config`` against its model's files (and tokenizer) without loading weights.

    Raises :class:`~kvtier.errors.ConfigError` when the KV cache cannot hold
    one block, the context does not fit the cache or the model, a tier holds
    no block, or (given the tokenizer) the bare chat template does not fit.
    """
    from kvtier.engine.model import probe_model

    info = probe_model(config.model, model_id=config.model_id)
    layout = info.layout(config.cache.block_size, config.dtype)
    plan = config.plan(layout, info.max_positions)
    check_exact_blocks(
        info.state,
        stored_dtype=plan.layout.dtype,
        model_dtype=layout.dtype,
        lossy_tiers=any(spec.codec != "raw" for spec in config.tiers),
    )
    bare = None if tokenizer is None else bare_chat_tokens(tokenizer)
    if bare is not None:
        check_min_request(plan, bare)


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = (
            tokenizer.convert_tokens_to_ids(name)
            if hasattr(tokenizer, "convert_tokens_to_ids")
            else None
        )
        unk = getattr(tokenizer, "unk_token_id", None)
        if isinstance(tid, int) and tid != unk:
            ids.add(tid)
    return frozenset(ids)


def _resolve_config(
    config: EngineConfig | None,
    settings: dict[str, Any],
    policy: object,
    tiers: Sequence[object],
    pressure: object,
    encoder_cache: object,
) -> EngineConfig:
    """One :class:`EngineConfig` from a config or flat settings, plus the settings given
    as keywords in their data form (a policy name, tier specs, a pressure spec)."""
    if config is None:
        config = EngineConfig.from_settings(**settings)
    elif settings:
        raise ConfigError(
            f"give the engine's settings in its EngineConfig or as keywords, not both "
            f"(got config and {', '.join(sorted(settings))})"
        )
    changes: dict[str, Any] = {}
    if isinstance(policy, str):
        changes["cache"] = dataclasses.replace(config.cache, policy=policy)
    specs = tuple(t for t in tiers if isinstance(t, TierSpec))
    if specs:
        changes["tiers"] = config.tiers + specs
    if isinstance(pressure, PressureSpec):
        changes["pressure"] = pressure
    if isinstance(encoder_cache, EncoderCacheSpec):
        changes["encoder_cache"] = encoder_cache
    return dataclasses.replace(config, **changes) if changes else config
