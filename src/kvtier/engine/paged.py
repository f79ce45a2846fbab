"""Attention for a batch of ragged sequences whose K/V live in kvtier blocks.

The batched engine runs one forward pass over the new tokens of every
scheduled sequence, flattened into one row of ``T`` tokens (decodes and
prefill chunks alike), each at its own position. Everything in a decoder
layer but attention is per token, so it batches as it is; attention is the
one place where sequences must not mix. :func:`paged_attention` is
registered with transformers as the attention implementation
``"kvtier_paged"``: in each layer it writes the new tokens' K/V into their
slots of the :class:`~kvtier.storage.KVBlockStorage`, gathers each
sequence's whole K/V back through its block table into a padded batch
``[B, heads, L_max, head_dim]``, and runs one ``scaled_dot_product_attention``
with a mask that keeps every query to its own sequence's past.

All writes of a layer happen before its reads, so a sequence may read blocks
another sequence of the same pass is computing (a prefix they share).
Called without batch metadata (``model(...)`` outside the engine, or with a
:class:`~kvtier.engine.KvTierCache`), the implementation is plain SDPA with
transformers' own masks: installing it changes nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.storage import KVBlockStorage

#: The attention implementation name models are switched to.
ATTN_IMPLEMENTATION = "kvtier_paged"
_registered = False


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a batched pass."""

    #: Tokens whose K/V are already in the blocks before this pass (its context start).
    start: int
    #: New tokens this pass computes for it.
    num_new: int
    #: Slots of all ``start + num_new`` tokens, in order (from its block table).
    slots: Sequence[int]


class BatchMeta:
    """Index tensors of one batched pass, built once and shared by every layer.

    K/V are gathered by token rows of the layer's contiguous row view
    (strided whole-block gathers copy far more than they read): sequence
    ``i`` reads rows for the first ``NB`` blocks of its table, padded with its
    first block, and the mask hides positions past its length.
    """

    __slots__ = (
        "B",
        "NB",
        "Q",
        "decode_only",
        "kv_rows",
        "mask",
        "new_rows",
        "q_gather",
        "q_scatter",
        "storage",
    )

    def __init__(self, storage: KVBlockStorage, seqs: Sequence[SeqSlice]) -> None:
        device = storage.device
        bs = storage.layout.block_size
        self.storage = storage
        self.B = len(seqs)
        self.Q = Q = max(s.num_new for s in seqs)
        self.NB = NB = max(-(-(s.start + s.num_new) // bs) for s in seqs)
        L = NB * bs
        #: Every sequence brings one token in order (pure decode): queries need no reshuffling.
        self.decode_only = Q == 1
        new_slots: list[int] = []
        kv_slots: list[int] = []
        q_gather: list[int] = []
        q_scatter: list[int] = []
        lengths: list[int] = []
        starts: list[int] = []
        t = 0
        for i, s in enumerate(seqs):
            n = s.start + s.num_new
            new_slots.extend(s.slots[s.start : n])
            blocks = [s.slots[p] // bs for p in range(0, n, bs)]
            blocks += [blocks[0]] * (NB - len(blocks))  # padding, masked out
            kv_slots.extend(b * bs + j for b in blocks for j in range(bs))
            if not self.decode_only:
                q_gather.extend(range(t, t + s.num_new))
                q_gather.extend([t] * (Q - s.num_new))
                q_scatter.extend(range(i * Q, i * Q + s.num_new))
            lengths.append(n)
            starts.append(s.start)
            t += s.num_new
        self.new_rows = storage.slot_rows(torch.tensor(new_slots, dtype=torch.int64))
        self.kv_rows = storage.slot_rows(torch.tensor(kv_slots, dtype=torch.int64))
        self.q_gather = torch.tensor(q_gather, dtype=torch.int64, device=device)
        self.q_scatter = torch.tensor(q_scatter, dtype=torch.int64, device=device)
        # Query j of sequence i sits at position starts[i] + j and sees keys 0 .. that position.
        qpos = torch.tensor(starts, device=device)[:, None] + torch.arange(Q, device=device)
        kpos = torch.arange(L, device=device)
        mask = kpos[None, None, :] <= qpos[:, :, None]
        # Padded query rows see key 0 only (an all-masked row would be NaN); they are dropped.
        pad = torch.arange(Q, device=device)[None, :] >= torch.tensor(
            [s.num_new for s in seqs], device=device
        )[:, None]
        mask = mask & ~pad[:, :, None]
        mask[:, :, 0] |= pad
        self.mask = mask[:, None, :, :]

    @property
    def num_tokens(self) -> int:
        return int(self.new_rows.shape[0])


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over kvtier blocks for a :class:`BatchMeta` pass (SDPA otherwise)."""
    meta: BatchMeta | None = kwargs.pop("kvtier_batch", None)
    if meta is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, _ = sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
        return out, None
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    storage = meta.storage
    # [1, heads, T, dim] -> [T, heads, dim]
    storage.write_rows(layer, meta.new_rows, key[0].transpose(0, 1), value[0].transpose(0, 1))
    k, v = storage.read_rows(layer, meta.kv_rows)  # [B * NB * block_size, kv_heads, dim]
    B, Q = meta.B, meta.Q
    kv_heads, dim = k.shape[1], k.shape[2]
    k = k.view(B, -1, kv_heads, dim).transpose(1, 2)
    v = v.view(B, -1, kv_heads, dim).transpose(1, 2)
    heads = query.shape[1]
    if meta.decode_only:  # token t is sequence t's one query
        q = query[0].transpose(0, 1).unsqueeze(2)
    else:
        q = query[0].index_select(1, meta.q_gather).view(heads, B, Q, dim).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=meta.mask, scale=scaling, enable_gqa=heads != kv_heads
    )
    # [B, heads, Q, dim] -> [B * Q, heads, dim] -> the real tokens, in pass order
    out = out.transpose(1, 2).reshape(B * Q, heads, dim)
    if not meta.decode_only:
        out = out.index_select(0, meta.q_scatter)
    return out.unsqueeze(0), None


def install(model: Any) -> None:
    """Switch ``model`` to :func:`paged_attention` (plain SDPA whenever no batch is given)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
        # Outside a batch the implementation is SDPA, so it takes SDPA's masks.
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
