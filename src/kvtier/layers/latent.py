"""Multi-head latent attention (DeepSeek V2/V3, GLM-4 MoE Lite) served from kvtier's blocks.

An MLA layer caches one compressed latent per token (and one shared rotary
key) instead of per-head K/V; the blocks hold exactly that, so a block of an
MLA model is as small as the model's own cache.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvtier.layers.base import mix_in
from kvtier.layers.batch import BatchMeta, batch_of
from kvtier.layers.registry import LayerKind, register


class LatentAttention:
    """Multi-head latent attention (DeepSeek V3) whose blocks hold the compressed latent.

    Mixed into the model's attention class by :func:`store_latents`. In a batched
    pass, the per-token latent (``kv_nope``, the no-rope part compressed to
    ``kv_lora_rank`` values) and the shared rotary key (``k_rot``) are written
    to the blocks as one head's K and V (``k_rot`` zero-padded), every row of
    the batch's view is read back, and the model's own ``expand_kv``
    decompresses them; :func:`~kvtier.engine.paged.paged_attention` then attends over those rows.
    Outside a batch nothing changes.
    """

    _kvtier_meta: BatchMeta | None = None
    _kvtier_gathered = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._kvtier_meta = batch_of(self, kwargs)  # type: ignore[arg-type]
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._kvtier_meta = None

    def expand_kv(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> Any:
        meta = self._kvtier_meta
        if meta is None:
            return super().expand_kv(kv_nope, k_rot)  # type: ignore[misc]
        storage = meta.storage
        layer = int(self.layer_idx)  # type: ignore[attr-defined]
        width = storage.layout.head_dim
        rank, rope = kv_nope.shape[-1], k_rot.shape[-1]
        # [1, 1, T, d] -> [T, 1, width]
        latent = F.pad(kv_nope, (0, width - rank))[0].transpose(0, 1)
        rot = F.pad(k_rot, (0, width - rope))[0].transpose(0, 1)
        storage.write_rows(layer, meta.new_rows, latent, rot)
        k, v = storage.read_rows(layer, meta.kv_rows)  # [rows, 1, width]
        self._kvtier_gathered = True
        return super().expand_kv(  # type: ignore[misc]
            k[..., :rank].transpose(0, 1).unsqueeze(0), v[..., :rope].transpose(0, 1).unsqueeze(0)
        )


def store_latents(model: Any) -> int:
    """Give every MLA attention module of ``model`` the latent-storing behaviour; how many."""
    found = 0
    for module in model.modules():
        if hasattr(module, "expand_kv") and hasattr(module, "kv_b_proj"):
            mix_in(module, LatentAttention)
            found += 1
    return found


register(LayerKind("latent", store_latents))
