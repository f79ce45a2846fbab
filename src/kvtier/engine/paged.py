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
with a mask that keeps every query to its own sequence's past. What a layer
gathers and its mask (a :class:`KVView`: block ids, token rows, the mask and
its additive form) are built once per pass by :class:`BatchMeta`, so a layer
only copies K/V and attends.

A sliding-window layer (the model passes its ``sliding_window``, as it does
to transformers' own attention functions) sees only the keys at positions
``p - window < k <= p`` for a query at ``p``, transformers' convention
(:mod:`kvtier.layers.attention_spec`). It also gathers less: only the
blocks from the first one holding a key it can see, so a long context costs
such a layer about one window of K/V per query, not the whole past. With
:class:`~kvtier.storage.windowed.WindowedKVStorage` a sliding layer's K/V
lives in window slots rather than in the blocks, and the layer writes and
reads it through the slot rows (:attr:`BatchMeta.new_window_rows`,
:meth:`KVView.window_rows`).

The pass reaches a layer as its ``kvtier_batch`` argument or, where a
decoder layer does not hand its keyword arguments on (StableLM's,
Nemotron's), from the forward of the installed model it runs in
(:func:`batch_of`). A layer that passes no ``sliding_window`` (Qwen2-MoE's,
PhiMoE's slide through their masks alone) takes its window from the
config's layer plan. Falcon's attention does its own attending rather than
calling the attention interface; in a batch it is handed a cache that keeps
its K/V in the blocks and a mask over what that cache returns
(:mod:`kvtier.layers.own`).

All writes of a layer happen before its reads, so a sequence may read blocks
another sequence of the same pass is computing (a prefix they share).
Called without batch metadata (``model(...)`` outside the engine, or with a
:class:`~kvtier.engine.KvTierCache`), the implementation is plain SDPA with
transformers' own masks: installing it changes nothing else.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvtier.errors import ConfigError
from kvtier.layers import install_kinds
from kvtier.layers.attention_spec import attention_spec
from kvtier.layers.batch import batch_of, enter_pass, leave_pass

#: The attention implementation name models are switched to.
ATTN_IMPLEMENTATION = "kvtier_paged"
_registered = False

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
    meta = batch_of(module, kwargs)
    kwargs.pop("kvtier_batch", None)
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if meta is None and (softcap is not None or sinks is not None):
        # transformers' SDPA path has neither: attend as the model's eager attention does.
        bias = _additive_mask(attention_mask, query, key)
        out = attend_eager(query, key, value, bias, scaling, softcap, sinks)
        return out.transpose(1, 2).contiguous(), None
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
    if getattr(module, "_kvtier_gathered", False):
        # MLA: the blocks hold the latent, and the model has already expanded every
        # row of the batch's view (``kv_rows`` order) into these K and V.
        setattr(module, "_kvtier_gathered", False)  # noqa: B010 (an nn.Module attribute)
        view = meta.full
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    else:
        # [1, heads, T, dim] -> [T, heads, dim]
        new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        width = storage.layout.head_dim
        dims = (key.shape[-1], value.shape[-1])
        narrow = dims if min(dims) < width else None
        if narrow is not None and getattr(module, "_kvtier_beside_state", False):
            # The layer's recurrent state sits in the columns after its K/V (Falcon-H1).
            old_k, old_v = storage.read_rows(layer, meta.new_rows)
            old_k[..., : narrow[0]] = new_k
            old_v[..., : narrow[1]] = new_v
            new_k, new_v = old_k, old_v
        elif narrow is not None:
            # Slots widened for a model's convolution layers (LFM2): zero-pad, cut on read.
            new_k = F.pad(new_k, (0, width - narrow[0]))
            new_v = F.pad(new_v, (0, width - narrow[1]))
        windowed = storage.is_window_layer(layer)
        storage.write_rows(layer, meta.new_window_rows if windowed else meta.new_rows, new_k, new_v)
        # The model passes each layer's window (None for full attention), as it does to
        # transformers' own attention functions. Some (Qwen2-MoE, PhiMoE) pass none and
        # slide through the mask they build instead, which a batch replaces: their layer
        # plan, read from the config at install, says which layers slide.
        if "sliding_window" in kwargs:
            window = kwargs["sliding_window"]
        else:
            window = getattr(module, "_kvtier_window", None)
        chunk = getattr(module, "_kvtier_chunk", None)
        if isinstance(window, int) and window > 0:
            view = meta.window_view(window)
        elif chunk is not None:
            view = meta.chunked_view(chunk)
        else:
            view = meta.full
        rows = view.window_rows(storage) if windowed else view.rows
        k, v = storage.read_rows(layer, rows)  # [B * blocks * block_size, kv_heads, dim]
        if narrow is not None:
            k, v = k[..., : narrow[0]], v[..., : narrow[1]]
    temperature = getattr(module, "_kvtier_temperature", None)
    if temperature is not None:
        query = temperature.scale(query, meta.positions())
    B, Q = meta.B, meta.Q
    kv_heads, dim, v_dim = k.shape[1], k.shape[2], v.shape[2]
    k = k.reshape(B, -1, kv_heads, dim).transpose(1, 2)
    v = v.reshape(B, -1, kv_heads, v_dim).transpose(1, 2)
    heads = query.shape[1]
    # The mask's additive form, built once per pass: SDPA would convert it in every layer.
    bias = view.bias(query.dtype)
    if meta.decode_only:  # token t is sequence t's one query
        q = query[0].transpose(0, 1).unsqueeze(2)
    else:
        q = query[0].index_select(1, meta.q_gather).view(heads, B, Q, dim).transpose(0, 1)
    if softcap is not None or sinks is not None:
        out = attend_eager(q, k, v, bias, scaling, softcap, sinks)
    else:
        # Each query head stays its own row (``enable_gqa``), as in transformers' attention:
        # folding a K/V head's query heads into its rows costs less but rounds differently.
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, scale=scaling, enable_gqa=heads != kv_heads
        )
    # [B, heads, Q, dim] -> [B * Q, heads, dim] -> the real tokens, in pass order
    out = out.transpose(1, 2).reshape(B * Q, heads, v_dim)
    if not meta.decode_only:
        out = out.index_select(0, meta.q_scatter)
    return out.unsqueeze(0), None


def attend_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float | None,
    softcap: object,
    sinks: object,
) -> torch.Tensor:
    """Attention written out, for the logit changes SDPA has no argument for.

    ``q`` is ``[B, heads, Q, dim]``, ``k``/``v`` ``[B, kv_heads, K, dim]`` (each
    K/V head repeated for its query heads here), ``bias`` additive ``[B, 1, Q, K]``;
    ``scale`` ``None`` is ``dim ** -0.5``. ``softcap`` bends
    each logit to ``softcap * tanh(logit / softcap)`` before the mask (Gemma 2);
    ``sinks`` is one learned logit per head that joins every softmax and is then
    dropped, so a query may attend to nothing (GPT-OSS). The order of operations
    is transformers' eager attention's for those models, so the results round alike.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        cap = float(softcap)  # type: ignore[arg-type]
        scores = torch.tanh(scores / cap) * cap
    scores = scores + bias
    if isinstance(sinks, torch.Tensor):
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], -1)
        combined = torch.cat([scores, sink.to(scores.dtype)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.to(v.dtype), v)


def _additive_mask(
    mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor
) -> torch.Tensor:
    """A transformers attention mask (SDPA's boolean form, additive, or ``None`` for
    causal) as an additive ``[B or 1, 1, Q, K]`` tensor in the query's dtype."""
    q_len, k_len = query.shape[2], key.shape[2]
    if mask is None:
        # Causal, the queries being the last ``q_len`` positions of the keys.
        qpos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
        mask = (torch.arange(k_len, device=query.device)[None, :] <= qpos)[None, None]
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        return bias.masked_fill_(~mask, float("-inf"))
    return mask[..., :k_len].to(query.dtype)


def _mark_windows(model: Any) -> None:
    """Give each attention layer of ``model`` its window from the config's layer plan."""
    config = getattr(model.config, "text_config", None) or model.config
    try:
        spec = attention_spec(lambda name: getattr(config, name, None))
    except ConfigError:
        return  # a plan with other kinds of layers (hybrids), whose models pass windows
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and 0 <= layer < spec.num_layers:
            module._kvtier_window = spec.windows[layer]


def install(model: Any) -> dict[str, int]:
    """Switch ``model`` to :func:`paged_attention` (plain SDPA whenever no batch is given).

    Every registered layer kind (:mod:`kvtier.layers`) then switches the
    modules it recognises: MLA latents, attention that attends in code of its
    own, short convolutions, linear-attention / Mamba layers, chunked and
    position-scaled local attention. Returns how many modules each kind found.
    """
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
    _mark_windows(model)
    for handle in getattr(model, "_kvtier_pass_hooks", ()):
        handle.remove()
    model._kvtier_pass_hooks = (
        model.register_forward_pre_hook(enter_pass, with_kwargs=True),
        model.register_forward_hook(leave_pass, with_kwargs=True, always_call=True),
    )
    return install_kinds(model)
