"""Llama 4's chunked local attention and its position-scaled NoPE layers, in batched passes.

Llama 4 interleaves *chunked* layers, whose query at position ``p`` sees only
the keys from the start of its chunk (``p // attention_chunk_size *
attention_chunk_size``) up to ``p``, with full-attention layers that use no
rotary embedding (NoPE). On those NoPE layers the model scales each query by
a factor that grows with the token's position (``attn_temperature_tuning``).

transformers computes that factor from the cache's length, assuming one
sequence whose new tokens are consecutive; kvtier's batched pass packs many
sequences' tokens into one row, so :func:`install_local_attention` has each
such module leave the scaling to :func:`~kvtier.engine.paged.paged_attention`
in a batched pass, which applies the model's own formula at each token's
real position. Chunked layers get their chunk size as ``_kvtier_chunk``; the
paged attention masks and gathers by it
(:meth:`~kvtier.engine.paged.BatchMeta.chunked`). Outside a batched pass
nothing changes.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.layers.attention_spec import chunked_layers
from kvtier.layers.base import mix_in
from kvtier.layers.registry import LayerKind, register


class _Temperature:
    """A NoPE layer's query scaling, at the tokens' real positions."""

    def __init__(self, floor_scale: float, attn_scale: float) -> None:
        self.floor_scale = floor_scale
        self.attn_scale = attn_scale

    def scale(self, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``query`` (``[1, heads, T, dim]``) scaled as the model scales it (its formula)."""
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale))
        scales = scales * self.attn_scale + 1.0
        return (query * scales.view(1, 1, -1, 1)).to(query.dtype)


class _PositionScaledAttention:
    """Mixed into a NoPE layer's attention class: a batched pass scales queries by position."""

    _kvtier_temperature: _Temperature

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("kvtier_batch") is None:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        # The paged attention applies the scaling instead, at each token's own position.
        self.attn_temperature_tuning = False
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.attn_temperature_tuning = True


def install_local_attention(model: Any) -> int:
    """Mark ``model``'s chunked layers and position-scaled NoPE layers; how many it marked."""
    config = getattr(model.config, "text_config", None) or model.config
    chunked, chunk = chunked_layers(lambda name: getattr(config, name, None))
    marked = 0
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or not hasattr(module, "q_proj"):
            continue
        if layer in chunked:
            module._kvtier_chunk = chunk
            marked += 1
        if getattr(module, "attn_temperature_tuning", False) and not getattr(
            module, "use_rope", True
        ):
            mix_in(module, _PositionScaledAttention)
            module._kvtier_temperature = _Temperature(
                float(module.floor_scale), float(module.attn_scale)
            )
            marked += 1
    return marked


register(LayerKind("local", install_local_attention))
