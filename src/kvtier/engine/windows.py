"""Whether an engine keeps some layers' share of blocks apart, and how many slots it gives them.

Three kinds of layer need their share of a block only near where a request
reads: a sliding-window layer (Gemma 3, Mistral, Qwen2/Qwen3 with
``use_sliding_window``) the last window of positions, a short convolution
(LFM2) its last ``conv_L_cache - 1`` positions, and a linear-attention or
Mamba layer (Qwen3-Next, Qwen3.5, Bamba, Granite 4, Nemotron-H, Jamba) the
checkpoint of its state at the block before its first new token. Such a model is served from
:class:`~kvtier.storage.windowed.WindowedKVStorage`: the other layers per
block, these per window slot, so a checkpoint is kept only for the blocks
running requests resume from and for as many cached ones as the slots
allow (the most recently used). :func:`window_plan` reads that from the
config alone; :class:`WindowPlan` sizes the slots:

- ``ratio`` slots per block of the pool (``CacheConfig.window_kv_ratio``;
  ``auto``: :data:`AUTO_WINDOW_RATIO` for sliding windows,
  :data:`AUTO_STATE_RATIO` for state checkpoints and convolutions), which is what lets a
  cached prefix be resumed from many places;
- never fewer than every running request's window and one step's new
  tokens need (:meth:`WindowPlan.min_slots`), so a running request never
  waits for a slot.

A block then costs ``full bytes + ratio x sliding bytes``, and the same
memory holds that many more blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvtier.engine.config import CacheConfig, CachePlan, SchedulerConfig, plan_cache
from kvtier.errors import ConfigError
from kvtier.layers.attention_spec import attention_spec, chunked_layers, short_conv_layers
from kvtier.layers.state_spec import state_spec
from kvtier.layout import KVLayout, cdiv

#: What a linear-attention or Mamba layer reads of the past, as a window: the checkpoint
#: in the block holding the position before its first new token.
STATE_WINDOW = 2
#: ``window_kv_ratio="auto"``: slots per block for sliding-window layers (a chat-length
#: request's resume window is a good part of its blocks) and for state checkpoints (one
#: checkpoint costs several blocks' attention K/V; on the Mooncake conversation trace with
#: Qwen3-Next's sizes 0.05 reused the most of 0.02-0.5: ``bench/hybrid_replay.py``).
AUTO_WINDOW_RATIO = 0.5
AUTO_STATE_RATIO = 0.05
#: LFM2's ``conv_L_cache`` when a config leaves it out (transformers' default).
DEFAULT_CONV_TAPS = 3


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """Which layers slide, their window, and the slots per block (see the module docstring)."""

    window: int
    window_layers: tuple[int, ...]
    ratio: float
    #: Chunked local layers (Llama 4): a query reads its own chunk of this many positions.
    chunk: int = 0

    def full_bytes(self, layout: KVLayout) -> int:
        """One block's full layers, in bytes."""
        per_layer = layout.bytes_per_block // layout.num_layers
        return per_layer * (layout.num_layers - len(self.window_layers))

    def window_bytes(self, layout: KVLayout) -> int:
        """One block's sliding layers, in bytes."""
        return layout.bytes_per_block // layout.num_layers * len(self.window_layers)

    def block_bytes(self, layout: KVLayout) -> int:
        """What one block of the pool costs: its full layers and its share of the slots."""
        return self.full_bytes(layout) + math.ceil(self.ratio * self.window_bytes(layout))

    def min_slots(self, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """Slots that every running request's window plus one step's new tokens can take."""
        reach = self.chunk or self.window
        return max_num_seqs * (cdiv(reach, block_size) + 2) + cdiv(
            max_num_batched_tokens, block_size
        )

    def num_slots(
        self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> int:
        """The slots for a pool of ``num_blocks``: the ratio's share, at least :meth:`min_slots`."""
        want = max(
            math.ceil(self.ratio * num_blocks),
            self.min_slots(block_size, max_num_seqs, max_num_batched_tokens),
        )
        return min(num_blocks, want)


def window_plan(
    get: Callable[[str], object],
    ratio: float | Literal["auto"] | None,
    max_model_len: int | None = None,
) -> WindowPlan | None:
    """The plan for a config read through ``get``, or ``None`` to keep every layer per block.

    ``None`` when ``ratio`` is ``None``, when no layer slides (or every window
    is at least ``max_model_len``, so nothing would ever be dropped), and
    when the model has any other kind of layer (short convolutions,
    linear-attention or Mamba states, chunked local attention, multi-head
    latent attention), whose blocks stay whole.
    """
    if ratio is None:
        return None
    if get("kv_lora_rank") is not None:
        return None
    chunked, chunk = chunked_layers(get)
    if chunked:
        # Llama 4: a chunked layer's query reads from the start of its own chunk.
        if chunk is None or (max_model_len is not None and chunk >= max_model_len):
            return None  # one chunk holds every request: nothing is ever dropped
        r = AUTO_WINDOW_RATIO if ratio == "auto" else float(ratio)
        return WindowPlan(chunk, chunked, r, chunk)
    conv = short_conv_layers(get)
    if conv:
        # A short convolution of L taps reads its new tokens' L - 1 positions before:
        # a window of L positions, resumed from one block (LFM2).
        kernel = get("conv_L_cache")
        taps = kernel if isinstance(kernel, int) and kernel > 0 else DEFAULT_CONV_TAPS
        r = AUTO_STATE_RATIO if ratio == "auto" else float(ratio)
        return WindowPlan(taps, conv, r)
    state = state_spec(get)
    if state is not None:
        if state.beside_attention:
            return None  # attention and state share every layer (Falcon-H1)
        # A state layer resumes at ``p`` from the checkpoint in the block holding ``p - 1``:
        # a "window" of two positions.
        r = AUTO_STATE_RATIO if ratio == "auto" else float(ratio)
        return WindowPlan(STATE_WINDOW, state.layers, r)
    spec = attention_spec(get)
    window = spec.max_window
    if window is None:
        return None
    if max_model_len is not None and window >= max_model_len:
        return None
    r = AUTO_WINDOW_RATIO if ratio == "auto" else float(ratio)
    return WindowPlan(window, spec.sliding_layers, r)


def plan_with_windows(
    layout: KVLayout,
    model_positions: int,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    device: str,
    plan: WindowPlan | None,
) -> tuple[CachePlan, SchedulerConfig, int | None]:
    """The cache plan, the resolved scheduler settings and the window slots (``None``: no
    windowed storage) for ``layout``.

    Blocks are what ``kv_cache_bytes`` holds at :meth:`WindowPlan.block_bytes` each;
    when the slots' floor (what running requests need) takes more than the ratio's share,
    the blocks shrink so that blocks and slots together stay within the memory.
    """
    cache_plan = plan_cache(
        layout,
        model_positions,
        num_blocks=cache.num_blocks,
        kv_cache_bytes=cache.kv_cache_bytes,
        max_model_len=scheduler.max_model_len,
        block_bytes=None if plan is None else plan.block_bytes(layout),
    )
    resolved = scheduler.resolve(cache_plan, device)
    if plan is None:
        return cache_plan, resolved, None
    bs = layout.block_size

    def slots_for(p: CachePlan, r: SchedulerConfig) -> int:
        assert r.max_num_seqs is not None and r.max_num_batched_tokens is not None
        return plan.num_slots(p.num_blocks, bs, r.max_num_seqs, r.max_num_batched_tokens)

    slots = slots_for(cache_plan, resolved)
    if cache.num_blocks is not None:
        return cache_plan, resolved, slots
    full, win = plan.full_bytes(layout), plan.window_bytes(layout)
    budget = cache.kv_cache_bytes
    if cache_plan.num_blocks * full + slots * win <= budget:
        return cache_plan, resolved, slots
    fit = (budget - slots * win) // full if full else 0
    if fit < 1:
        raise ConfigError(
            f"--kv-cache-memory of {budget:,} bytes cannot hold the {slots} window slots "
            f"({slots * win:,} bytes) that {resolved.max_num_seqs} running requests need "
            "and blocks besides: raise --kv-cache-memory, or lower --max-num-seqs or "
            "--max-num-batched-tokens"
        )
    cache_plan = plan_cache(
        layout,
        model_positions,
        num_blocks=fit,
        kv_cache_bytes=budget,
        max_model_len=scheduler.max_model_len,
    )
    resolved = scheduler.resolve(cache_plan, device)
    return cache_plan, resolved, slots_for(cache_plan, resolved)
