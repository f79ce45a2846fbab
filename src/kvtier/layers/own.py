"""Attention modules that attend in code of their own, fed kvtier's blocks in a batch.

Falcon's attention never calls transformers' attention interface, which
kvtier's paged attention implements: it updates its cache and attends over
what the cache returns, with the model's mask. In a batched pass such a
layer is handed a :class:`PassCache`, whose ``update`` writes to and gathers
from kvtier's blocks, and the mask over what it gathered; outside a batch
nothing changes. :func:`feed_caches` is its registered layer kind.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.layers.base import mix_in
from kvtier.layers.batch import BatchMeta, batch_of
from kvtier.layers.registry import LayerKind, register


class PassCache:
    """What a :class:`CacheFedAttention` layer takes for its cache in a batched pass.

    ``update`` writes the pass's new K/V (``[1, heads, T, dim]``) to the blocks and
    returns every sequence's gathered K/V laid end to end along one key axis
    (``[1, heads, B * NB * block_size, dim]``), which :meth:`bias` masks so that each
    query sees its own sequence's past only.
    """

    def __init__(self, meta: BatchMeta) -> None:
        self.meta = meta

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        storage = self.meta.storage
        # Falcon's newer layout hands K/V repeated for every query head of a K/V head:
        # the blocks hold each K/V head once.
        group = key.shape[1] // storage.layout.num_kv_heads
        new_k, new_v = key[0, ::group].transpose(0, 1), value[0, ::group].transpose(0, 1)
        storage.write_rows(layer_idx, self.meta.new_rows, new_k, new_v)
        k, v = storage.read_rows(layer_idx, self.meta.full.rows)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return k, v

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive ``[1, 1, T, B * NB * block_size]`` mask over :meth:`update`'s keys."""
        meta = self.meta
        view = meta.full
        keys = view.mask.shape[-1]
        rows = view.mask[:, 0].reshape(meta.B * meta.Q, keys)  # [B * Q, keys]
        if meta.decode_only:
            seq = torch.arange(meta.B, device=rows.device)
        else:
            rows = rows.index_select(0, meta.q_scatter)
            seq = torch.div(meta.q_scatter, meta.Q, rounding_mode="floor")
        tokens = rows.shape[0]
        mask = torch.zeros((tokens, meta.B, keys), dtype=torch.bool, device=rows.device)
        mask[torch.arange(tokens, device=rows.device), seq] = rows
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        bias.masked_fill_(~mask, float("-inf"))
        return bias.view(1, 1, tokens, meta.B * keys)


class CacheFedAttention:
    """Mixed into an attention class that attends in code of its own (Falcon's), not
    through transformers' attention interface, by :func:`install`.

    In a batched pass the layer gets a :class:`PassCache` for its cache and that
    cache's mask for its attention mask, and runs its own code over them; outside a
    batch nothing changes.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        meta = batch_of(self, kwargs)  # type: ignore[arg-type]
        if meta is None:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        if kwargs.get("alibi") is not None:
            raise ConfigError("ALiBi position biases are not served from kvtier's blocks")
        cache = PassCache(meta)
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        kwargs["layer_past"] = cache
        kwargs["attention_mask"] = cache.bias(hidden.dtype)
        return super().forward(*args, **kwargs)  # type: ignore[misc]


def feed_caches(model: Any) -> int:
    """Give every attention module of ``model`` that bypasses the attention interface
    (Falcon's) the :class:`CacheFedAttention` behaviour; how many."""
    try:
        from transformers.models.falcon.modeling_falcon import FalconAttention
    except ImportError:  # a transformers release without Falcon
        return 0
    found = 0
    for module in model.modules():
        # Its subclasses (flash attention) attend without the mask: only this one is fed.
        if type(module) is FalconAttention:
            mix_in(module, CacheFedAttention)
        found += isinstance(module, CacheFedAttention)
    return found


register(LayerKind("own-attention", feed_caches))
