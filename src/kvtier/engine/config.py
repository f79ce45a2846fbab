"""An engine's configuration as data: the model, the cache, the tiers, pressure, the scheduler.

:class:`EngineConfig` is what ``kvtier serve`` builds from its flags (and
``--config FILE``), what :meth:`Engine.from_config <kvtier.engine.Engine.from_config>`
takes, and what :meth:`EngineConfig.plan` checks against a model's
:class:`~kvtier.engine.model.ModelInfo` before any weights load: how many
blocks the KV cache holds, the context length, and whether the tiers fit a
block. The engine sizes itself with the same :func:`plan_cache`, so the
checks a server runs at startup are the ones the engine would apply.
:func:`check_memory` refuses a model whose weights and KV cache together
exceed the memory the device has free, before the weights are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from kvtier.errors import ConfigError
from kvtier.layout import DTYPE_BYTES, KV_CACHE_DTYPES, KVLayout, cache_layout
from kvtier.mm.config import EncoderCacheSpec
from kvtier.offload.config import TierSpec
from kvtier.pressure.config import PressureSpec

if TYPE_CHECKING:
    import torch

#: Tokens the smallest useful request needs beyond its prompt (one generated token).
_MIN_COMPLETION = 1
#: Tokens one step computes at most when ``max_num_batched_tokens`` is not set.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


#: The dtypes a model's weights are served in.
MODEL_DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype a model dtype name stands for; :class:`ConfigError` if none."""
    if name not in MODEL_DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(MODEL_DTYPES)}, got {name!r}")
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


@dataclass(frozen=True)
class CacheConfig:
    """The device KV cache: block size, how many blocks, the eviction policy, the dtype."""

    block_size: int = 16
    #: Memory for KV blocks; ``num_blocks`` overrides it when set.
    kv_cache_bytes: int = 512 * 2**20
    num_blocks: int | None = None
    policy: str = "lru"
    prefix_caching: bool = True
    #: How blocks are stored: ``auto`` (the model's dtype), ``float32``, ``bfloat16``,
    #: ``float16``, or quantized with per-head scales: ``int8``, ``fp8_e4m3``.
    kv_cache_dtype: str = "auto"
    #: Models with sliding-window or linear-attention / Mamba layers: slots for those
    #: layers' share of a block, per block of the pool (``0 < ratio <= 1``; never fewer
    #: than running requests need). ``"auto"``: 0.5 for sliding windows, 0.05 for state
    #: checkpoints; ``None`` keeps every layer in every block (:mod:`kvtier.engine.windows`).
    window_kv_ratio: float | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        r = self.window_kv_ratio
        if r is not None and r != "auto" and (
            isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1
        ):
            raise ConfigError(
                f"window_kv_ratio must be a number in (0, 1], 'auto', or None to keep every "
                f"layer in every block; got {r!r}"
            )
        _positive("kv_cache_bytes", self.kv_cache_bytes)
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )


#: ``max_num_seqs`` left unset: the KV cache is divided into sequences of this many tokens
#: (a chat prompt and its reply), or of ``max_model_len`` when that is shorter.
AUTO_SEQ_TOKENS = 512
#: The fewest sequences an unset ``max_num_seqs`` gives: a smaller cache preempts instead
#: (a decode batch this small costs about what one sequence does).
AUTO_MIN_SEQS = 4
#: The most an unset ``max_num_seqs`` gives on a CPU, where each sequence of a decode
#: batch adds compute (memory bandwidth no longer dominates beyond this), and on an accelerator.
AUTO_MAX_SEQS_CPU = 32
AUTO_MAX_SEQS = 256


@dataclass(frozen=True)
class SchedulerConfig:
    """How many requests run at once, how many tokens one step computes, how long one may be."""

    #: Sequences running at once; ``None``: sized from the KV cache (:meth:`resolve`).
    max_num_seqs: int | None = None
    #: Tokens one forward pass computes at most (decodes first, then prompt chunks);
    #: ``None``: 512, or ``max_num_seqs`` if that is more.
    max_num_batched_tokens: int | None = None
    #: Longest prompt + completion; ``None``: the model's context, capped by the cache.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs is not None:
            _positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
            if self.max_num_seqs is not None and self.max_num_batched_tokens < self.max_num_seqs:
                raise ConfigError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                    f"max_num_seqs ({self.max_num_seqs}): every running request decodes each step"
                )
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)

    @property
    def token_budget(self) -> int:
        """Tokens one step computes at most, the default resolved."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs or 0)

    def resolve(self, plan: CachePlan, device: str) -> SchedulerConfig:
        """This configuration with every default filled in for an engine of ``plan`` on ``device``.

        An unset ``max_num_seqs`` becomes the number of sequences of
        :data:`AUTO_SEQ_TOKENS` tokens (or ``plan.max_model_len``, if
        shorter) the KV cache holds, at least :data:`AUTO_MIN_SEQS`, at most
        :data:`AUTO_MAX_SEQS_CPU` on a CPU (:data:`AUTO_MAX_SEQS` elsewhere),
        and never more than an explicit ``max_num_batched_tokens``.
        """
        seqs = self.max_num_seqs
        if seqs is None:
            cap = AUTO_MAX_SEQS_CPU if device.split(":")[0] == "cpu" else AUTO_MAX_SEQS
            per_seq = min(AUTO_SEQ_TOKENS, plan.max_model_len)
            seqs = min(max(plan.pool_tokens // per_seq, AUTO_MIN_SEQS), cap)
            if self.max_num_batched_tokens is not None:
                seqs = min(seqs, self.max_num_batched_tokens)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, seqs)
        return SchedulerConfig(seqs, budget, plan.max_model_len)

    def describe_seqs(self, plan: CachePlan, device: str) -> str:
        """Why ``max_num_seqs`` has the value :meth:`resolve` gives it, for a startup banner."""
        seqs = self.resolve(plan, device).max_num_seqs
        if self.max_num_seqs is not None:
            return f"up to {seqs} requests at once (--max-num-seqs)"
        per_seq = min(AUTO_SEQ_TOKENS, plan.max_model_len)
        cap = AUTO_MAX_SEQS_CPU if device.split(":")[0] == "cpu" else AUTO_MAX_SEQS
        return (
            f"up to {seqs} requests at once (auto: the KV cache holds "
            f"{plan.pool_tokens // per_seq} sequences of {per_seq} tokens; at least "
            f"{AUTO_MIN_SEQS}, at most {cap} on {device}; --max-num-seqs sets it)"
        )


@dataclass(frozen=True)
class PrefetchConfig:
    """Agent prefetch: blocks of agents due within ``lookahead`` steps, and of paused
    sessions due back within ``session_lead_s`` seconds, come back from tiers."""

    #: Steps ahead an agent may be to have its blocks brought back (0: off).
    lookahead: int = 0
    #: Bytes of blocks prefetches read at once, at most.
    max_bytes: int = 64 * 2**20
    #: Seconds before a paused session is due back that its blocks come back (None: off;
    #: needs the workflow policy, which knows when sessions are due).
    session_lead_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise ConfigError(f"prefetch lookahead must be steps >= 0, got {self.lookahead!r}")
        _positive("prefetch max_bytes", self.max_bytes)
        lead = self.session_lead_s
        if lead is not None and (
            isinstance(lead, bool)
            or not isinstance(lead, int | float)
            or not 0.0 <= lead < float("inf")
        ):
            raise ConfigError(f"prefetch session_lead_s must be seconds >= 0, got {lead!r}")


@dataclass(frozen=True)
class CachePlan:
    """The sizes an engine gets for a model: blocks and context length."""

    layout: KVLayout
    num_blocks: int
    max_model_len: int

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.layout.block_size


def plan_cache(
    layout: KVLayout,
    model_positions: int,
    *,
    num_blocks: int | None,
    kv_cache_bytes: int,
    max_model_len: int | None,
    block_bytes: int | None = None,
) -> CachePlan:
    """Blocks and context length for ``layout``; raises ConfigError when they cannot work.

    ``block_bytes`` is what one block costs when it is not ``layout.bytes_per_block``
    (windowed storage: its full layers, and its share of the window slots).
    """
    if num_blocks is None:
        num_blocks = kv_cache_bytes // (block_bytes or layout.bytes_per_block)
        if num_blocks < 1:
            raise ConfigError(
                f"--kv-cache-memory of {kv_cache_bytes:,} bytes holds no KV block: one block of "
                f"{layout.block_size} tokens takes {layout.bytes_per_block:,} bytes "
                f"({layout.canonical()}); give the cache at least that much"
            )
    pool_len = num_blocks * layout.block_size
    if max_model_len is None:
        max_model_len = min(model_positions, pool_len)
    elif max_model_len > model_positions:
        raise ConfigError(
            f"max_model_len {max_model_len} exceeds the model's {model_positions} positions"
        )
    elif max_model_len > pool_len:
        raise ConfigError(
            f"max_model_len {max_model_len} exceeds the KV pool ({num_blocks} blocks of "
            f"{layout.block_size} = {pool_len} tokens): raise kv_cache_bytes or num_blocks "
            "(--kv-cache-memory, --num-blocks) or lower --max-model-len"
        )
    return CachePlan(layout, num_blocks, max_model_len)


def check_min_request(plan: CachePlan, min_prompt_tokens: int) -> None:
    """Raise unless one request of ``min_prompt_tokens`` (e.g. the bare chat template) fits."""
    need = min_prompt_tokens + _MIN_COMPLETION
    if plan.max_model_len < need:
        raise ConfigError(
            f"the engine can hold requests of at most {plan.max_model_len} tokens "
            f"({plan.num_blocks} KV blocks of {plan.layout.block_size}), but the shortest chat "
            f"request takes {need} (the chat template alone is {min_prompt_tokens} tokens): "
            "raise --kv-cache-memory or --num-blocks (or --max-model-len)"
        )


def available_memory(device: str) -> tuple[int, str] | None:
    """``(bytes free, where they are)`` on ``device``; ``None`` when unknown.

    On ``cpu`` the host's available memory (its container's, if that limit
    is lower); on CUDA the device's free memory.
    """
    kind = device.split(":")[0]
    if kind == "cpu":
        from kvtier.errors import MonitorUnavailableError
        from kvtier.pressure.host import HostMemoryMonitor

        try:
            monitor = HostMemoryMonitor()
            reading = monitor.read()
        except MonitorUnavailableError:
            return None
        where = "this container" if reading.source == "host:cgroup" else "this machine"
        return reading.total - reading.used, f"available on {where}"
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"free on {device}"
    return None


@dataclass(frozen=True)
class WeightSize:
    """How much memory a model's weights take once loaded, read without loading them."""

    parameters: int
    dtype: str
    #: Which files (or which config) said so, for messages.
    source: str

    @property
    def nbytes(self) -> int:
        return self.parameters * DTYPE_BYTES[self.dtype]


def check_memory(weights: WeightSize, kv_bytes: int, device: str, model_id: str) -> None:
    """ConfigError when ``weights`` plus ``kv_bytes`` of KV cache exceed what ``device`` has free.

    Run before the weights load, so a model that cannot fit is refused in a
    second with what to change, rather than after minutes of reading, or by
    the kernel's out-of-memory killer.
    """
    free = available_memory(device)
    if free is None:
        return
    have, where = free
    need = weights.nbytes + kv_bytes
    if need <= have:
        return

    def gib(n: int) -> str:
        return f"{n / 2**30:,.2f} GiB"

    fixes: list[str] = []
    if weights.nbytes < have:
        fixes.append(f"a --kv-cache-memory below {gib(have - weights.nbytes)}")
    if weights.dtype == "float32":
        fixes.append(f"--dtype bfloat16 (weights of {gib(weights.nbytes // 2)})")
    fixes.append("a smaller model")
    fixes.append(
        "an engine that keeps quantized weights quantized (vLLM, SGLang, llama.cpp): "
        "kvtier dequantizes a GGUF file's tensors to --dtype"
    )
    raise ConfigError(
        f"{model_id} does not fit: its weights need {gib(weights.nbytes)} "
        f"({weights.parameters:,} parameters in {weights.dtype}, from {weights.source}) and "
        f"its KV cache {gib(kv_bytes)} (--kv-cache-memory), {gib(need)} in all, but only "
        f"{gib(have)} is {where}; use {'; '.join(fixes[:-1])}; or {fixes[-1]}"
    )


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`~kvtier.engine.Engine` is built from, as plain data."""

    #: A local model directory or .gguf file; ``None``: the bundled SmolLM2-135M-Instruct.
    model: str | None = None
    #: The name the model is served under (default: from the model).
    model_id: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tiers: tuple[TierSpec, ...] = ()
    #: ``None``: each tier's own default (shared media write through, local ones write back).
    write_mode: str | None = None
    #: Which blocks the device evicts the first tier writes: ``write-all`` or
    #: ``predicted`` (by learned reuse; needs the ``learned-reuse`` device policy).
    tier_admission: str = "write-all"
    #: Land prefix loads from the host tier layer by layer, in flight while the forward
    #: pass that needs them starts (its layer ``l`` waits for layer ``l`` only).
    tier_layer_loads: bool = False
    #: Seconds between checks that each tier's medium still holds the blocks tracked on it
    #: (a restarted Redis loses them without an error); also while the server idles.
    tier_recheck_interval_s: float = 30.0
    pressure: PressureSpec | None = None
    #: ``temperature`` / ``top_p`` for requests that leave them out (``None``: the model's).
    sampling_defaults: Mapping[str, float] | None = None
    #: A ZeroMQ endpoint to publish KV events on, in vLLM's format (``None``: off).
    kv_events: str | None = None
    #: The encoder-output cache of a vision-language model (unused for text models).
    encoder_cache: EncoderCacheSpec = field(default_factory=EncoderCacheSpec)
    #: Agent prefetch from the tiers (off by default; needs a tier).
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)

    def __post_init__(self) -> None:
        from kvtier.offload.admission import ADMISSIONS
        from kvtier.offload.config import check_tier_order
        from kvtier.offload.tier import WRITE_MODES

        resolve_dtype(self.dtype)
        interval = self.tier_recheck_interval_s
        if not isinstance(interval, int | float) or not 0 < interval < float("inf"):
            raise ConfigError(
                f"tier_recheck_interval_s must be a positive number of seconds, got {interval!r}"
            )
        if self.tier_admission not in ADMISSIONS:
            raise ConfigError(
                f"tier_admission must be one of {', '.join(ADMISSIONS)}, "
                f"got {self.tier_admission!r}"
            )
        if self.write_mode is not None and self.write_mode not in WRITE_MODES:
            raise ConfigError(
                f"write_mode must be one of {', '.join(WRITE_MODES)}, got {self.write_mode!r}"
            )
        object.__setattr__(self, "tiers", tuple(self.tiers))
        check_tier_order(self.tiers)
        if self.tier_layer_loads and self.tiers and all(t.medium != "host" for t in self.tiers):
            raise ConfigError(
                "--tier-layer-loads lands loads from the host tier, and none of the tiers is "
                "one: add --tier host:SIZE or leave the flag out"
            )

    def check_prefetch(self, has_tiers: bool) -> None:
        """ConfigError when prefetch (or loads by layer) is on without a tier to bring
        blocks back from."""
        if self.tier_layer_loads and not has_tiers:
            raise ConfigError(
                "--tier-layer-loads lands loads from the host tier: add one "
                "(--tier host:SIZE) or leave the flag out"
            )
        if self.prefetch.lookahead > 0 and not has_tiers:
            raise ConfigError(
                "prefetch brings blocks back from tiers: add a tier (--tier) or turn "
                "prefetch off (--prefetch-lookahead 0)"
            )
        if self.prefetch.session_lead_s is not None:
            if not has_tiers:
                raise ConfigError(
                    "session prefetch brings blocks back from tiers: add a tier (--tier) or "
                    "leave --prefetch-session-lead out"
                )
            if self.cache.policy != "workflow":
                raise ConfigError(
                    "session prefetch needs to know when sessions are due back: serve with "
                    "--policy workflow, or leave --prefetch-session-lead out"
                )

    @classmethod
    def from_settings(cls, **settings: Any) -> EngineConfig:
        """A configuration from flat settings (``block_size=4, num_blocks=64, ...``): each
        name is the field of the table it belongs to; an unknown name is a ConfigError."""
        tables: dict[str, dict[str, Any]] = {"": {}, "cache": {}, "scheduler": {}}
        for name, value in settings.items():
            table = _SETTING_TABLE.get(name)
            if table is None:
                known = ", ".join(sorted(_SETTING_TABLE))
                raise ConfigError(f"unknown engine setting {name!r}; the settings are {known}")
            tables[table][name] = value
        top = tables[""]
        if "tiers" in top:
            top["tiers"] = tuple(top["tiers"])
        if top.get("sampling_defaults") is None:
            top.pop("sampling_defaults", None)
        return cls(
            cache=CacheConfig(**tables["cache"]),
            scheduler=SchedulerConfig(**tables["scheduler"]),
            **top,
        )

    def plan(self, layout: KVLayout, model_positions: int) -> CachePlan:
        """The cache sizes this configuration gives a model of ``layout``; ConfigError if none.

        ``layout`` is the model's (its dtype); the plan's is the one blocks are
        stored in (``cache.kv_cache_dtype``).
        """
        stored = cache_layout(layout, self.cache.kv_cache_dtype)
        plan = plan_cache(
            stored,
            model_positions,
            num_blocks=self.cache.num_blocks,
            kv_cache_bytes=self.cache.kv_cache_bytes,
            max_model_len=self.scheduler.max_model_len,
        )
        from kvtier.storage.device import torch_dtype

        for spec in self.tiers:
            spec.capacity_blocks(
                layout_block_shape(layout), torch_dtype(block_dtype(layout, stored))
            )
        return plan


def block_dtype(model: KVLayout, stored: KVLayout) -> str:
    """The dtype a block has as a tensor (what tiers store raw): the stored
    float dtype, or the model's for quantized blocks (they decode to it)."""
    return model.dtype if stored.scaled else stored.dtype


def layout_block_shape(layout: KVLayout) -> tuple[int, int, int, int, int]:
    """The shape of one exported block (what tiers store) for ``layout``."""
    return (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


#: Which table of :class:`EngineConfig` each flat setting belongs to ("": the top level).
_SETTING_TABLE: dict[str, str] = {
    **{f.name: "cache" for f in fields(CacheConfig)},
    **{f.name: "scheduler" for f in fields(SchedulerConfig)},
    **{f.name: "" for f in fields(EngineConfig) if f.name not in ("cache", "scheduler")},
}
