"""The reference engine: a Hugging Face causal LM generating through kvtier blocks.

:class:`Engine` owns a model, its tokenizer, a :class:`~kvtier.KVCacheManager`
and the :class:`~kvtier.storage.KVBlockStorage` behind it. Requests are added
with :meth:`Engine.add_request` and advanced by :meth:`Engine.step`, which
admits waiting requests (reusing their longest cached prefix and computing
only the rest of the prompt) and then decodes one token for every running
request, round-robin, one sequence per forward pass. A finished request's
blocks stay cached for the next request that shares its prefix.

A request that cannot get blocks waits; a running request that runs out of
blocks mid-generation is preempted (its computed blocks stay cached) and
resumes later by recomputing only what was evicted. Every request records
its time to first token, decode speed and cached-token count. A request for
``n`` choices computes its prompt once and forks it ``n - 1`` times
(copy-on-write blocks); each choice then samples on its own.

With ``pressure`` set, a controller samples memory in the background and
the manager consults its mode: PRESSURE and above keep a share of the pool
empty by evicting (demoting, with tiers) in the policy's order, and EMERGENCY
holds new requests back (up to ``max_wait``) or refuses them.

The engine is single-threaded: :class:`~kvtier.engine.worker.EngineWorker`
runs it on a thread of its own for concurrent callers.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    check_min_request,
    plan_cache,
)
from kvtier.engine.detok import IncrementalDetokenizer
from kvtier.engine.hf_cache import KvTierCache, layout_for_model
from kvtier.engine.sampling import Sampler, SamplingParams, TokenLogprob
from kvtier.errors import (
    AdmissionRejectedError,
    BadRequestError,
    ConfigError,
    KvTierError,
    OutOfBlocksError,
)
from kvtier.keys import Namespace
from kvtier.manager import KVCacheManager
from kvtier.obs.metrics import Histogram
from kvtier.offload.chain import SwappedRequest, Tier, TierChain
from kvtier.offload.config import TierSpec
from kvtier.policy.base import EvictionPolicy
from kvtier.pressure.config import PressureSpec
from kvtier.pressure.controller import PressureController
from kvtier.storage import KVBlockStorage

log = logging.getLogger(__name__)

#: Buckets of the time-to-first-token histogram, in seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class RequestMetrics:
    """Timings and token counts of one request (``time.perf_counter`` seconds)."""

    arrival_time: float
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival (queueing included)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Generated tokens per second after the first one."""
        if self.first_token_time is None or self.finish_time is None or self.completion_tokens < 2:
            return None
        span = self.finish_time - self.first_token_time
        return (self.completion_tokens - 1) / span if span > 0 else None

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": self.ttft,
            "queue_s": self.queue_time,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "preemptions": self.preemptions,
        }


@dataclass(frozen=True)
class RequestOutput:
    """What a step produced for one choice of a request: new text and ids, and whether it ended.

    ``finish_reason`` is ``"stop"`` (EOS or a stop string), ``"length"``
    (max_tokens or the context limit), ``"abort"`` (cancelled), ``"rejected"``
    (memory pressure refused it before it started) or ``"error"`` (``error``
    says why). ``index`` is the choice (0 .. n-1); ``logprobs`` has one entry
    per token in ``token_ids`` when the request asked for them.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(eq=False)
class _Request:
    """One sequence: a request, or one of its ``n`` choices."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    #: The choice this sequence generates (0 .. n-1); choice 0 carries the request's id.
    index: int = 0
    #: The id of the sequence in the manager (``request_id`` plus ``#index`` for forks).
    seq_id: str = ""
    #: True once the prompt was forked into the other choices (or n == 1).
    forked: bool = False
    generated: list[int] = field(default_factory=list)
    cache: KvTierCache | None = None
    #: The last sampled token, not yet run through the model.
    pending: int | None = None
    cancelled: bool = False
    admissions: int = 0
    #: Where a preempted request's blocks went (with tiers configured).
    swapped: SwappedRequest | None = None
    #: When memory pressure first held this request back (``time.monotonic``).
    delayed_since: float | None = None


@dataclass
class EngineCounters:
    """Engine-wide totals exported as metrics."""

    requests_added: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    #: Prompt tokens whose blocks were loaded from a tier below the device.
    loaded_prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    forward_errors: int = 0
    #: Choices started by forking a computed prompt (``n > 1``), not recomputing it.
    forked_sequences: int = 0
    #: Seconds from arrival to the end, summed over finished sequences (and their count).
    e2e_seconds: float = 0.0
    e2e_count: int = 0
    #: Requests refused by memory pressure (at once, or after waiting ``max_wait``).
    rejected: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    last: RequestMetrics | None = None


class Engine:
    """Generates with a Hugging Face causal LM whose KV cache lives in kvtier blocks.

    ``num_blocks`` sizes the block pool; by default it is what
    ``kv_cache_bytes`` holds. ``max_num_seqs`` bounds the requests running
    at once (each decodes one token per :meth:`step`). ``prefix_caching``
    off keeps every request's blocks private and drops them when it ends.
    ``sampling_defaults`` (``temperature``, ``top_p``) are what a server
    applies to requests that leave them out.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_id: str = "model",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int = 512 * 2**20,
        policy: str | EvictionPolicy = "lru",
        max_num_seqs: int = 4,
        max_model_len: int | None = None,
        prefix_caching: bool = True,
        sampling_defaults: dict[str, float] | None = None,
        tiers: Sequence[Tier | TierSpec] = (),
        write_mode: str | None = None,
        pressure: PressureSpec | PressureController | None = None,
    ) -> None:
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        param = next(model.parameters())
        self.device = param.device
        self.layout = layout_for_model(model.config, block_size, param.dtype)
        model_len = int(getattr(model.config, "max_position_embeddings", 0) or 2**31)
        plan = plan_cache(
            self.layout,
            model_len,
            num_blocks=num_blocks,
            kv_cache_bytes=kv_cache_bytes,
            max_model_len=max_model_len,
        )
        num_blocks = plan.num_blocks
        max_model_len = plan.max_model_len
        if getattr(tokenizer, "chat_template", None) is not None:
            check_min_request(plan, len(self.encode_chat([{"role": "user", "content": ""}])))
        self.storage = KVBlockStorage(self.layout, num_blocks, self.device)
        self.manager = KVCacheManager(
            num_blocks,
            block_size,
            policy=policy,
            namespace=Namespace(model_id, self.layout),
        )
        #: The tiers below the device (``None`` without tiers).
        built = [
            t.build(self.storage.block_shape, self.storage.dtype) if isinstance(t, TierSpec) else t
            for t in tiers
        ]
        self.tiers: TierChain | None = (
            TierChain(self.storage, self.manager, built, write_mode=write_mode) if built else None
        )
        #: The memory-pressure controller (``None`` without pressure handling).
        self.pressure: PressureController | None = None
        if pressure is not None:
            if isinstance(pressure, PressureSpec):
                pressure = pressure.build(self.manager.pool, self.layout.bytes_per_block)
            self.pressure = pressure
            self.manager.set_pressure_gate(pressure)
            pressure.start()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.prefix_caching = prefix_caching
        #: ``temperature`` / ``top_p`` the server uses when a request leaves them out.
        self.sampling_defaults: dict[str, float] = dict(sampling_defaults or {})
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or 0) or None
        self.counters = EngineCounters()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        #: request id -> its sequences (one per choice once forked).
        self._by_id: dict[str, list[_Request]] = {}
        self._ids = itertools.count()
        policy_name = policy if isinstance(policy, str) else getattr(policy, "name", "custom")
        #: The configuration this engine runs with, as data.
        self.config = EngineConfig(
            model_id=model_id,
            dtype=self.layout.dtype,
            device=str(self.device),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_bytes=num_blocks * self.layout.bytes_per_block,
                num_blocks=num_blocks,
                policy=policy_name,
                prefix_caching=prefix_caching,
            ),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len),
            tiers=tuple(t for t in tiers if isinstance(t, TierSpec)),
            write_mode=write_mode,
            pressure=pressure if isinstance(pressure, PressureSpec) else None,
            sampling_defaults=dict(self.sampling_defaults),
        )

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
        kwargs: dict[str, Any] = {
            "block_size": config.cache.block_size,
            "num_blocks": config.cache.num_blocks,
            "kv_cache_bytes": config.cache.kv_cache_bytes,
            "policy": config.cache.policy,
            "prefix_caching": config.cache.prefix_caching,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_model_len": config.scheduler.max_model_len,
            "tiers": config.tiers,
            "write_mode": config.write_mode,
            "pressure": config.pressure,
        }
        if config.sampling_defaults is not None:
            kwargs["sampling_defaults"] = dict(config.sampling_defaults)
        if model is not None:
            if tokenizer is None:
                raise ConfigError("Engine.from_config: a model needs its tokenizer too")
            return cls(model, tokenizer, model_id=config.model_id or "model", **kwargs)
        from kvtier.engine.model import load_model

        loaded = load_model(
            config.model,
            dtype=config.dtype,
            device=config.device,
            model_id=config.model_id,
            check_tokenizer=lambda tok: check_config(config, tok),
            tokenizer=tokenizer,
        )
        kwargs.setdefault("sampling_defaults", loaded.sampling_defaults)
        return cls(loaded.model, loaded.tokenizer, model_id=loaded.model_id, **kwargs)

    def describe(self) -> list[str]:
        """What this engine runs with, one line per part (the server's startup banner)."""
        layout = self.layout
        stats = self.manager.stats()
        lines = [
            f"model {self.model_id}: {layout.num_layers} layers, {layout.num_kv_heads} KV heads "
            f"of {layout.head_dim}, {layout.dtype} on {self.device}",
            f"KV cache: {stats.total_blocks} blocks of {layout.block_size} tokens "
            f"({stats.total_blocks * layout.bytes_per_block / 2**20:.0f} MiB), policy "
            f"{stats.policy}, prefix caching {'on' if self.prefix_caching else 'off'}",
            f"scheduler: up to {self.max_num_seqs} requests at once, "
            f"max_model_len {self.max_model_len} tokens",
        ]
        d = self.sampling_defaults
        lines.append(
            "requests without temperature/top_p get "
            f"temperature {d.get('temperature', 1.0)}, top_p {d.get('top_p', 1.0)}"
        )
        if self.tiers is not None:
            for tier in self.tiers.tiers:
                fmt = tier.fmt
                size = tier.capacity * (fmt.blob_size if fmt else 0)
                lines.append(
                    f"{tier.name} tier: {tier.capacity} blocks ({size / 2**20:.0f} MiB, codec "
                    f"{tier.codec.name}, policy {tier.manager.policy.name}, {tier.write_mode})"
                )
        if self.pressure is not None:
            p = self.pressure
            lines.append(
                f"memory pressure from {p.monitor.name} every {p.interval:g}s; "
                f"mode {p.mode.name} at {100 * p.fraction:.1f}%"
            )
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
        return cls(loaded.model, loaded.tokenizer, model_id=loaded.model_id, **kwargs)

    # -- prompts ------------------------------------------------------------------
    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` under the model's chat template, ready for the reply."""
        if not messages:
            raise BadRequestError("messages must be a non-empty list", param="messages")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise BadRequestError(
                f"model {self.model_id} has no chat template: use /v1/completions", param="messages"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template raising on odd input is the caller's input
            raise BadRequestError(
                f"messages do not fit the chat template: {exc}", param="messages"
            ) from exc
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            raise BadRequestError("prompt must be a non-empty string", param="prompt")
        return list(self.tokenizer.encode(prompt))

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise :class:`BadRequestError` unless the request can ever run."""
        n = len(prompt_ids)
        if n == 0:
            raise BadRequestError("the prompt is empty", param="messages")
        vocab = int(getattr(self.model.config, "vocab_size", 2**32))
        for t in prompt_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise BadRequestError(
                    f"prompt token id {t!r} is outside [0, {vocab})", param="prompt"
                )
        if params.n > self.max_num_seqs:
            raise BadRequestError(
                f"n={params.n} choices exceed the {self.max_num_seqs} sequences this engine "
                "runs at once (max_num_seqs): ask for fewer",
                param="n",
            )
        if self.vocab_size is not None and params.logit_bias:
            top = max(params.logit_bias)
            if top >= self.vocab_size:
                raise BadRequestError(
                    f"logit_bias names token id {top}, outside the vocabulary of "
                    f"{self.vocab_size}",
                    param="logit_bias",
                )
        if n + params.max_tokens > self.max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + params.max_tokens} tokens ({n} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens" if n < self.max_model_len else "messages",
            )

    # -- requests ---------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises :class:`BadRequestError` for bad input."""
        params = params or SamplingParams()
        ids = list(prompt_ids)
        self.check_request(ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._by_id:
            raise BadRequestError(f"request id {rid!r} is already in the engine")
        now = time.perf_counter() if arrival_time is None else arrival_time
        req = _Request(
            rid,
            ids,
            params,
            Sampler(params),
            IncrementalDetokenizer(self.tokenizer, params.stop),
            RequestMetrics(now, len(ids)),
            seq_id=rid,
            forked=params.n == 1,
        )
        self._waiting.append(req)
        self._by_id[rid] = [req]
        self.counters.requests_added += 1
        self.counters.prompt_tokens += len(ids)
        return rid

    def cancel(self, request_id: str) -> None:
        """Stop a request (every choice) at the next step; its computed blocks stay cached."""
        for req in self._by_id.get(request_id, ()):
            req.cancelled = True

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every queued and running request with ``error`` (after a step failed).

        Each request's blocks past its computed tokens are withdrawn, so
        nothing a failed pass half wrote can be served later.
        """
        outs: list[RequestOutput] = []
        for req in [*self._waiting, *self._running]:
            try:
                self._finish(req, "error", "", outs, error=error)
            except Exception:
                log.exception("could not end request %s cleanly", req.request_id)
                req.cache = None
                for q in (self._waiting, self._running):
                    if req in q:
                        q.remove(req)
                self._by_id.pop(req.request_id, None)
                outs.append(
                    RequestOutput(
                        req.request_id, "", [], True, "error", req.metrics, error, index=req.index
                    )
                )
        return outs

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def close(self) -> None:
        """Stop pressure sampling, finish background tier writes, close the tiers' media."""
        if self.pressure is not None:
            self.pressure.close()
        if self.tiers is not None:
            self.tiers.close()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def step(self) -> list[RequestOutput]:
        """Admit what fits, then decode one token for each running request."""
        outs: list[RequestOutput] = []
        if self.tiers is not None:
            self.tiers.poll()
        for req in [r for r in (*self._waiting, *self._running) if r.cancelled]:
            self._finish(req, "abort", "", outs)
        fresh = self._admit(outs)
        for req in list(self._running):
            if req in fresh:
                continue
            self._decode(req, outs)
        return outs

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Run one request to completion, yielding its outputs (other queued requests run too)."""
        rid = self.add_request(prompt_ids, params)
        left = (params or SamplingParams()).n
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    left -= out.finished
                    if not left:
                        return

    # -- scheduling internals --------------------------------------------------------------
    def _admit(self, outs: list[RequestOutput]) -> set[_Request]:
        fresh: set[_Request] = set()
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            if not req.forked and len(self._running) + req.params.n > self.max_num_seqs:
                break  # its choices start together, once there is room for all of them
            tokens = req.prompt_ids + req.generated
            extra = () if self.prefix_caching else (f"private:{req.seq_id}:{req.admissions}",)
            try:
                if req.swapped is not None and self.tiers is not None:
                    cache = KvTierCache.swap_in(
                        req.swapped,
                        self.storage,
                        self.manager,
                        self.tiers,
                        token_ids=tokens,
                        extra_keys=extra,
                    )
                else:
                    cache = KvTierCache(
                        self.storage,
                        self.manager,
                        req.seq_id,
                        tokens,
                        extra_keys=extra,
                        tiers=self.tiers,
                    )
            except OutOfBlocksError as exc:
                if self._running:
                    break  # wait for running requests to finish and free blocks
                self._waiting.popleft()
                self._finish(req, "error", "", outs, error=f"out of KV cache blocks: {exc}")
                continue
            except AdmissionRejectedError as exc:
                if self._hold_back(req, exc):
                    break
                self._waiting.popleft()
                self.counters.rejected += 1
                self._finish(req, "rejected", "", outs, error=str(exc))
                continue
            req.delayed_since = None
            self._waiting.popleft()
            now = time.perf_counter()
            m = req.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                m.cached_tokens = cache.num_cached_tokens
                self.counters.cached_prompt_tokens += cache.num_cached_tokens
            req.admissions += 1
            req.cache = cache
            req.pending = None
            req.swapped = None
            self.counters.loaded_prompt_tokens += cache.num_loaded_tokens
            self._running.append(req)
            fresh.add(req)
            self.counters.computed_prompt_tokens += len(tokens) - cache.num_cached_tokens
            self._forward(req, tokens[cache.num_cached_tokens :], outs)
            fresh.update(self._by_id.get(req.request_id, ()))  # forked choices have a token too
        return fresh

    def _hold_back(self, req: _Request, exc: AdmissionRejectedError) -> bool:
        """Whether a request refused by memory pressure waits (True) or fails.

        It waits while the mode only delays and it has waited less than
        ``max_wait``; a request that already started (preempted, resuming)
        always waits, since failing it would throw away its tokens.
        """
        ctrl = self.pressure
        max_wait = ctrl.max_wait if ctrl is not None else 0.0
        now = time.monotonic()
        if req.delayed_since is None:
            req.delayed_since = now
        waited = now - req.delayed_since
        if req.admissions == 0 and (not exc.retry or waited >= max_wait):
            return False
        if not self._running and ctrl is not None:
            # Nothing here will free memory: wait (briefly) for the sampler's next reading.
            ctrl.wait_admissible(min(ctrl.interval, max(max_wait - waited, 0.0)))
        return True

    def _decode(self, req: _Request, outs: list[RequestOutput]) -> None:
        cache = req.cache
        assert cache is not None and req.pending is not None
        try:
            cache.feed([req.pending])
        except OutOfBlocksError:
            self._preempt(req, outs)
            return
        self._forward(req, [req.pending], outs, fed=True)

    def _forward(
        self, req: _Request, ids: list[int], outs: list[RequestOutput], *, fed: bool = False
    ) -> None:
        cache = req.cache
        assert cache is not None
        try:
            if not fed:
                cache.feed(ids)
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            with torch.no_grad():
                out = self.model(
                    input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1
                )
            logits = out.logits[0, -1]
            token, logprob = req.sampler.sample(logits)
            choices = [] if req.forked else self._fork_choices(req, logits)
        except KvTierError as exc:
            self.counters.forward_errors += 1
            log.exception("request %s failed", req.request_id)
            self._finish(req, "error", "", outs, error=str(exc))
            return
        except Exception as exc:
            self.counters.forward_errors += 1
            log.exception("forward pass of request %s failed", req.request_id)
            self._finish(req, "error", "", outs, error=f"{type(exc).__name__}: {exc}")
            return
        self._on_token(req, token, logprob, outs)
        for child, child_token, child_logprob in choices:
            self._on_token(child, child_token, child_logprob, outs)

    def _fork_choices(
        self, req: _Request, logits: torch.Tensor
    ) -> list[tuple[_Request, int, TokenLogprob | None]]:
        """Start choices 1 .. n-1 of ``req`` from its computed prompt (shared blocks)."""
        req.forked = True
        cache = req.cache
        assert cache is not None
        out: list[tuple[_Request, int, TokenLogprob | None]] = []
        group = self._by_id[req.request_id]
        try:
            for i in range(1, req.params.n):
                seq_id = f"{req.request_id}#{i}"
                child = _Request(
                    req.request_id,
                    req.prompt_ids,
                    req.params,
                    Sampler(req.params, seed_offset=i),
                    IncrementalDetokenizer(self.tokenizer, req.params.stop),
                    dataclasses.replace(req.metrics),
                    index=i,
                    seq_id=seq_id,
                    forked=True,
                    admissions=1,
                )
                child.cache = cache.fork(seq_id)
                token, logprob = child.sampler.sample(logits)
                group.append(child)
                self._running.append(child)
                self.counters.forked_sequences += 1
                out.append((child, token, logprob))
        except BaseException:
            # A fork that could not start (out of blocks for a copy) undoes every choice.
            for child, _, _ in out:
                self._running.remove(child)
                group.remove(child)
                if child.cache is not None:
                    child.cache.release()
            raise
        return out

    def _on_token(
        self,
        req: _Request,
        token: int,
        logprob: TokenLogprob | None,
        outs: list[RequestOutput],
    ) -> None:
        m = req.metrics
        now = time.perf_counter()
        if m.first_token_time is None:
            m.first_token_time = now
            self.counters.ttft.observe(now - m.arrival_time)
        req.generated.append(token)
        m.completion_tokens += 1
        self.counters.generation_tokens += 1
        lp = () if logprob is None else (logprob,)
        if token in self.eos_token_ids and not req.params.ignore_eos:
            self._finish(req, "stop", req.detok.flush(), outs, token=token, logprobs=lp)
            return
        text = req.detok.add(token)
        if req.detok.stopped:
            self._finish(req, "stop", text, outs, token=token, logprobs=lp)
        elif (
            len(req.generated) >= req.params.max_tokens
            or len(req.prompt_ids) + len(req.generated) >= self.max_model_len
        ):
            self._finish(req, "length", text + req.detok.flush(), outs, token=token, logprobs=lp)
        else:
            req.pending = token
            outs.append(
                RequestOutput(
                    req.request_id, text, [token], False, None, m, index=req.index, logprobs=lp
                )
            )

    def _preempt(self, req: _Request, outs: list[RequestOutput]) -> None:
        cache = req.cache
        assert cache is not None
        if len(self._running) == 1:
            self._finish(
                req,
                "error",
                "",
                outs,
                error="out of KV cache blocks with no other request to wait for",
            )
            return
        if self.tiers is not None and self.prefix_caching:
            try:
                req.swapped = cache.swap_out()
            except KvTierError:
                log.exception("swapping out request %s failed; it will recompute", req.request_id)
                cache.release()
        else:
            cache.release()
        req.cache = None
        self._running.remove(req)
        self._waiting.appendleft(req)
        req.metrics.preemptions += 1
        self.counters.preemptions += 1

    def _finish(
        self,
        req: _Request,
        reason: str,
        text: str,
        outs: list[RequestOutput],
        *,
        token: int | None = None,
        error: str | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        cache = req.cache
        if cache is not None:
            if reason == "error":
                cache.abort()
            elif self.prefix_caching:
                cache.release()
            else:
                cache.discard()
            req.cache = None
        if req in self._running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        group = self._by_id.get(req.request_id)
        if group is not None and req in group:
            group.remove(req)
            if not group:
                del self._by_id[req.request_id]
        req.metrics.finish_time = time.perf_counter()
        c = self.counters
        c.finished[reason] = c.finished.get(reason, 0) + 1
        c.e2e_seconds += req.metrics.finish_time - req.metrics.arrival_time
        c.e2e_count += 1
        c.last = req.metrics
        outs.append(
            RequestOutput(
                req.request_id,
                text,
                [] if token is None else [token],
                True,
                reason,
                req.metrics,
                error,
                index=req.index,
                logprobs=logprobs,
            )
        )
        if not req.forked:
            # It ended before its prompt was forked: the other choices end with it.
            for i in range(1, req.params.n):
                outs.append(
                    RequestOutput(
                        req.request_id, "", [], True, reason, req.metrics, error, index=i
                    )
                )


def check_config(config: EngineConfig, tokenizer: Any = None) -> None:
    """Check ``config`` against its model's files (and tokenizer) without loading weights.

    Raises :class:`~kvtier.errors.ConfigError` when the KV cache cannot hold
    one block, the context does not fit the cache or the model, a tier holds
    no block, or (given the tokenizer) the bare chat template does not fit.
    """
    from kvtier.engine.model import probe_model

    info = probe_model(config.model, model_id=config.model_id)
    plan = config.plan(info.layout(config.cache.block_size, config.dtype), info.max_positions)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False
        )
        check_min_request(plan, len(tokenizer.encode(text, add_special_tokens=False)))


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
