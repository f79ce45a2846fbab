"""``kvtier serve``'s parsed flags as configuration: the engine's, the server's, the tiers'.

:func:`engine_config` builds the :class:`~kvtier.engine.config.EngineConfig`
(every check lives there); :func:`server_limits` and :func:`image_limits`
the server's request limits.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvtier.errors import ConfigError

# -- configuration ------------------------------------------------------------------------


def _tier_specs(args: argparse.Namespace) -> list[Any]:
    """The tiers the flags ask for, fastest first (``--tier`` URLs, then the older flags)."""
    from kvtier.offload.config import TierSpec

    specs: list[Any] = [TierSpec.from_url(url, policy=args.policy) for url in args.tier or ()]
    if args.host_tier:
        specs.append(TierSpec("host", args.host_tier, codec=args.host_codec, policy=args.policy))
    if args.disk_tier:
        specs.append(
            TierSpec(
                "disk",
                args.disk_tier_size,
                codec=args.disk_codec,
                policy=args.policy,
                location=os.path.expanduser(args.disk_tier),
            )
        )
    if args.redis_url:
        specs.append(
            TierSpec(
                "redis+cluster" if args.redis_cluster else "redis",
                args.redis_tier_size,
                codec=args.redis_codec,
                policy=args.policy,
                location=args.redis_url,
            )
        )
    return specs


def _pressure_spec(args: argparse.Namespace) -> Any:
    """The pressure settings the flags ask for (``None``: off)."""
    if args.pressure == "off":
        return None
    from kvtier.pressure.config import PressureSpec

    extra = {} if args.pressure_thresholds is None else {"thresholds": args.pressure_thresholds}
    return PressureSpec(
        monitor=args.pressure,
        interval=args.pressure_interval,
        hysteresis=args.pressure_hysteresis,
        emergency=args.pressure_emergency,
        max_wait=args.pressure_max_wait,
        **extra,
    )


def state_block_size(config: Any) -> tuple[Any, str | None]:
    """``config`` with the block size a hybrid model's states need, and a banner line.

    Used when ``--block-size`` is not given: for a model with linear-attention
    or Mamba layers, the smallest multiple of 16 at which a block's share of
    such a layer holds the layer's state (nothing widened); 16 otherwise.
    """
    import dataclasses

    from kvtier.engine.model import probe_model
    from kvtier.layers.state_spec import state_block_size as smallest
    from kvtier.layout import DTYPE_BYTES

    default = dataclasses.replace(config, cache=dataclasses.replace(config.cache, block_size=16))
    info = probe_model(config.model, model_id=config.model_id)
    if info.state is None:
        return default, None
    itemsize = DTYPE_BYTES[config.dtype]
    size = smallest(info.state, info.head_dim, info.num_kv_heads, itemsize)
    cache = dataclasses.replace(config.cache, block_size=size)
    line = (
        f"block size {size} tokens: a block keeps one checkpoint of each of the model's "
        f"{len(info.state.layers)} linear-attention layers' states "
        f"({info.state.nbytes(itemsize) / 2**20:.2f} MiB each), and at this size it takes "
        "no more room than the attention layers' K/V of its tokens (--block-size overrides)"
    )
    return dataclasses.replace(config, cache=cache), line


def engine_config(args: argparse.Namespace) -> Any:
    """The :class:`~kvtier.engine.config.EngineConfig` the flags describe."""
    from kvtier.engine.config import CacheConfig, EngineConfig, PrefetchConfig, SchedulerConfig

    sampling: dict[str, float] = {}
    if args.default_temperature is not None:
        sampling["temperature"] = args.default_temperature
    if args.default_top_p is not None:
        sampling["top_p"] = args.default_top_p
    return EngineConfig(
        model=os.path.expanduser(args.model) if args.model else None,
        dtype=args.dtype,
        device=args.device,
        cache=CacheConfig(
            block_size=args.block_size or 16,
            kv_cache_bytes=args.kv_cache_memory,
            num_blocks=args.num_blocks,
            policy=args.policy,
            prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
            window_kv_ratio=args.window_kv_ratio,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        ),
        tiers=tuple(_tier_specs(args)),
        write_mode=args.write_mode,
        tier_admission=args.tier_admission,
        tier_layer_loads=args.tier_layer_loads,
        tier_recheck_interval_s=args.tier_recheck_interval,
        pressure=_pressure_spec(args),
        sampling_defaults=sampling or None,
        kv_events=args.kv_events,
        encoder_cache=_encoder_cache_spec(args),
        prefetch=PrefetchConfig(
            lookahead=args.prefetch_lookahead,
            max_bytes=args.prefetch_memory,
            session_lead_s=args.prefetch_session_lead,
        ),
    )


def _encoder_cache_spec(args: argparse.Namespace) -> Any:
    from kvtier.mm.config import EncoderCacheSpec
    from kvtier.offload.config import TierSpec

    return EncoderCacheSpec(
        size_bytes=args.encoder_cache_size,
        max_entries=args.encoder_cache_entries,
        policy=args.encoder_cache_policy,
        tiers=tuple(TierSpec.from_url(url) for url in args.encoder_cache_tier or ()),
        tenant_salt=args.encoder_cache_salt,
    )


def image_limits(args: argparse.Namespace) -> Any:
    from kvtier.mm.images import ImageLimits

    return ImageLimits(
        max_images=args.max_images_per_request,
        max_bytes=args.max_image_bytes,
        max_pixels=args.max_image_pixels,
        allowed_dir=args.allowed_local_media_path,
    )


def pd_role(args: argparse.Namespace, config: Any) -> str:
    """``--role`` checked against the tiers and prefix caching (before the model loads)."""
    from kvtier.offload.registry import make_medium
    from kvtier.offload.tier import write_mode_of
    from kvtier.server.disagg import check_role

    role = str(getattr(args, "role", "both"))
    shared = through = False
    for spec in config.tiers:
        medium = make_medium(spec.medium, spec.location, dict(spec.options))
        try:
            if medium.caps.shared:
                shared = True
                # --write-mode overrides every tier's own write= setting.
                mode = config.write_mode or spec.write_mode
                through = through or write_mode_of(mode, "write_through") == "write_through"
        finally:
            medium.close()
    return check_role(
        role, shared_tier=shared, writes_through=through, prefix_caching=config.cache.prefix_caching
    )


def server_limits(args: argparse.Namespace) -> Any:
    from kvtier.server.limits import ServerLimits
    from kvtier.server.tenant_limits import build_tenant_limits

    if args.default_max_tokens < 0:
        raise ConfigError(
            f"--default-max-tokens must be 0 (no cap: up to the context) or a positive number "
            f"of tokens, got {args.default_max_tokens}"
        )
    return ServerLimits(
        max_body_bytes=args.max_request_bytes,
        max_prompt_chars=args.max_prompt_chars,
        max_messages=args.max_messages,
        max_queued=args.max_queued_requests,
        body_timeout_s=args.request_timeout,
        default_max_tokens=args.default_max_tokens,
        tenants=build_tenant_limits(
            args.tenant_max_requests, args.tenant_max_kv_fraction, args.tenant_limit or ()
        ),
    )


def default_max_tokens_line(limits: Any, max_model_len: int) -> str:
    """What a request that sends no ``max_tokens`` gets, for the startup banner."""
    from kvtier.server.protocol import DEFAULT_COMPLETION_MAX_TOKENS

    cap = limits.default_max_tokens
    if not cap:
        return (
            "requests without max_tokens: chat completions run up to the context "
            f"({max_model_len} tokens with the prompt; --default-max-tokens 0), "
            f"/v1/completions OpenAI's {DEFAULT_COMPLETION_MAX_TOKENS}"
        )
    if cap < DEFAULT_COMPLETION_MAX_TOKENS:
        return f"requests without max_tokens: at most {cap} tokens (--default-max-tokens)"
    return (
        f"requests without max_tokens: at most {cap} tokens (--default-max-tokens; "
        f"/v1/completions keeps OpenAI's {DEFAULT_COMPLETION_MAX_TOKENS})"
    )
