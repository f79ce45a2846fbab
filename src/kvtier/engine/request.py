"""What the engine knows about a request: its metrics, its outputs, its KV state, the totals.

:class:`RequestOutput` is what :meth:`Engine.step <kvtier.engine.Engine.step>`
returns per choice; :class:`RequestMetrics` the timings and token counts a
request records; :class:`EngineCounters` the engine-wide totals exported as
metrics. :class:`Sequence` is one sequence the scheduler runs (a request, or
one of its ``n`` choices): its tokens and sampling state, and, while it holds
blocks, how many of its tokens the manager knows and how many have K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.engine.detok import IncrementalDetokenizer
from kvtier.engine.sampling import Sampler, SamplingParams, TokenLogprob
from kvtier.obs.metrics import Histogram

if TYPE_CHECKING:
    from kvtier.block_table import BlockTable
    from kvtier.hints import Hints
    from kvtier.manager import PrefixMatch
    from kvtier.offload.promote import PendingLoad
    from kvtier.offload.swap import SwappedRequest

#: Buckets of the time-to-first-token histogram, in seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


def cached_by_source(cached: int, by_tier: dict[str, int]) -> dict[str, int]:
    """Cached prompt tokens split into the device pool's hits (``device``) and each tier's
    loads (by tier name; the compressed device tier, also named ``device``, as
    ``device_tier``)."""
    out = {"device": cached - sum(by_tier.values())}
    for name, n in sorted(by_tier.items()):
        out["device_tier" if name == "device" else name] = n
    return out


@dataclass
class RequestMetrics:
    """Timings and token counts of one request (``time.perf_counter`` seconds)."""

    arrival_time: float
    prompt_tokens: int
    #: Prompt tokens whose K/V were not computed: the device's hit plus tier loads.
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    #: Of the cached tokens, those loaded from each tier below the device (by tier name).
    tier_tokens: dict[str, int] = field(default_factory=dict)
    #: Prompt tokens a tier held that the load-or-recompute plan chose to compute.
    recomputed_tier_tokens: int = 0
    #: The plan's estimates (seconds) of what it chose and of recomputing everything
    #: (``None``: no tier hit, or no costs learned yet).
    plan_estimate_s: float | None = None
    recompute_estimate_s: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival (queueing included)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def loaded_tokens(self) -> int:
        """Prompt tokens loaded from the tiers below the device."""
        return sum(self.tier_tokens.values())

    @property
    def device_cached_tokens(self) -> int:
        """Prompt tokens found in the device's own cache."""
        return self.cached_tokens - self.loaded_tokens

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens computed (neither cached on the device nor loaded)."""
        return self.prompt_tokens - self.cached_tokens

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
            "loaded_tokens": self.loaded_tokens,
            "computed_tokens": self.computed_tokens,
            "recomputed_tier_tokens": self.recomputed_tier_tokens,
            "plan_estimate_s": self.plan_estimate_s,
            "recompute_estimate_s": self.recompute_estimate_s,
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


@dataclass
class EngineCounters:
    """Engine-wide totals exported as metrics."""

    requests_added: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    #: Prompt tokens whose blocks were loaded from a tier below the device.
    loaded_prompt_tokens: int = 0
    #: First-admission prompt tokens taken from each tier below the device (by tier name).
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    #: Prompt tokens a tier held that the load-or-recompute plan computed instead.
    recomputed_tier_tokens: int = 0
    computed_prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    #: Sequences preempted to recompute because their sliding window lost a slot
    #: (windowed storage; counted in ``preemptions`` too).
    window_recomputes: int = 0
    forward_errors: int = 0
    #: Choices started by forking a computed prompt (``n > 1``), not recomputing it.
    forked_sequences: int = 0
    #: Seconds from arrival to the end, summed over finished sequences (and their count).
    e2e_seconds: float = 0.0
    e2e_count: int = 0
    #: Requests refused by memory pressure (at once, or after waiting ``max_wait``).
    rejected: int = 0
    #: Requests that moved here from another engine, and away to another one.
    migrated_in: int = 0
    migrated_out: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    last: RequestMetrics | None = None


@dataclass(eq=False)
class Sequence:
    """One sequence: a request, or one of its ``n`` choices (see the module docstring)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    #: The choice this sequence generates (0 .. n-1); choice 0 carries the request's id.
    index: int = 0
    #: Its id in the manager (``request_id``, plus ``#index`` for forked choices).
    seq_id: str = ""
    #: True once the prompt was forked into the other choices (or n == 1).
    forked: bool = False
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    admissions: int = 0
    #: When memory pressure first held it back (``time.monotonic``).
    delayed_since: float | None = None
    #: Where a preempted sequence's blocks went (with tiers configured).
    swapped: SwappedRequest | None = None
    # -- while it holds blocks ---------------------------------------------------------
    table: BlockTable | None = None
    #: Tokens given to the manager (their blocks are allocated, full ones published).
    known: int = 0
    #: Tokens whose K/V are in the blocks.
    computed: int = 0
    #: Tokens it had when admitted (a resumed sequence recomputes what it generated).
    admit_len: int = 0
    #: Blocks coming from a tier below the device, not yet in.
    load: PendingLoad | None = None
    #: Keys it published whose blocks hold no valid K/V yet (computed or loaded later).
    unready: list[int] = field(default_factory=list)
    #: Admission order: the newest running sequence is preempted first.
    order: int = 0
    #: Its images (a :class:`~kvtier.mm.prompt.MultimodalPrompt`), shared by its choices.
    mm: Any = None
    #: What the application said about the request (agent hints), if anything.
    hints: Hints | None = None
    #: Its prefix match (block keys hashed once), kept while it waits to be admitted.
    match: PrefixMatch | None = None
    #: Mixed into its block keys: only requests with the same salt share cached blocks.
    cache_salt: str | None = None

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens."""
        return self.prompt_ids + self.generated

    def token_range(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of :attr:`tokens`, without building the whole list."""
        prompt = self.prompt_ids
        n = len(prompt)
        if start >= n:
            return self.generated[start - n : end - n]
        if end <= n:
            return prompt[start:end]
        return prompt[start:] + self.generated[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def admitted(self) -> bool:
        return self.table is not None
