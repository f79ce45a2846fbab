"""Whether an engine keeps some layers' share of blocks apart, and how many slots it gives them.

Two kinds of layer need their share of a block only near where a request
reads: a sliding-window layer (Gemma 3, Mistral, Qwen2/Qwen3 with
``use_sliding_window``) the last window of positions, and a
linear-attention or Mamba layer (Qwen3-Next, Qwen3.5, Bamba, Granite 4,
Nemotron-H, Jamba) the checkpoint of its state at the block before its
first new token. Such a model is served from
:class:`~kvtier.storage.windowed.WindowedKVStorage`: the other layers per
block, these per window slot, so a checkpoint is kept only for the blocks
running requests resume from and for as many cached ones as the slots
allow (the most recently used). :func:`window_plan` reads that from the
config alone; :class:`WindowPlan` sizes the slots:

- ``ratio`` slots per block of the pool (``CacheConfig.window_kv_ratio``),
  which is what lets a cached prefix be resumed from many places;
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

from kvtier.engine.attention_spec import attention_spec, chunked_layers, short_conv_layers
from kvtier.engine.state_spec import state_spec
from kvtier.layout import KVLayout, cdiv

#: What a linear-attention or Mamba layer reads of the past, as a window: the checkpoint
#: in the block holding the position before its first new token.
STATE_WINDOW = 2


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """Which layers slide, their window, and the slots per block (see the module docstring)."""

    window: int
    window_layers: tuple[int, ...]
    ratio: float

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
        return max_num_seqs * (cdiv(self.window, block_size) + 2) + cdiv(
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
    get: Callable[[str], object], ratio: float | None, max_model_len: int | None = None
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
    if get("kv_lora_rank") is not None or short_conv_layers(get) or chunked_layers(get)[0]:
        return None
    state = state_spec(get)
    if state is not None:
        if state.beside_attention:
            return None  # attention and state share every layer (Falcon-H1)
        # A state layer resumes at ``p`` from the checkpoint in the block holding ``p - 1``:
        # a "window" of two positions.
        return WindowPlan(STATE_WINDOW, state.layers, float(ratio))
    spec = attention_spec(get)
    window = spec.max_window
    if window is None:
        return None
    if max_model_len is not None and window >= max_model_len:
        return None
    return WindowPlan(window, spec.sliding_layers, float(ratio))
