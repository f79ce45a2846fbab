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
(:mod:`kvtier.engine.attention_spec`). It also gathers less: only the
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
(:mod:`kvtier.engine.own_attention`).

All writes of a layer happen before its reads, so a sequence may read blocks
another sequence of the same pass is computing (a prefix they share).
Called without batch metadata (``model(...)`` outside the engine, or with a
:class:`~kvtier.engine.KvTierCache`), the implementation is plain SDPA with
transformers' own masks: installing it changes nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.engine.attention_spec import attention_spec, first_visible
from kvtier.engine.block_layers import mix_in
from kvtier.errors import ConfigError
from kvtier.layout import cdiv
from kvtier.storage import KVBlockStorage

#: The attention implementation name models are switched to.
ATTN_IMPLEMENTATION = "kvtier_paged"
_registered = False

#: The batched pass running through an installed model, set around its forward: some
#: decoder layers (StableLM's, Nemotron's) call their attention without passing their
#: keyword arguments, the pass among them, along.
_PASS: ContextVar[BatchMeta | None] = ContextVar("kvtier_pass", default=None)


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a batched pass."""

    #: Tokens whose K/V are already in the blocks before this pass (its context start).
    start: int
    #: New tokens this pass computes for it.
    num_new: int
    #: Slots of all ``start + num_new`` tokens, in order (from its block table).
    slots: Sequence[int]


class KVView:
    """One way a layer reads the pass's K/V: the rows it gathers and the mask over them.

    Built once per pass and shared by every layer that reads this way.
    ``blocks`` is the block-id view (``NB`` block ids per sequence, padded
    with its first read block), ``rows`` the token rows of those blocks in the
    storage's per-layer row view (what one ``index_select`` per layer reads),
    and ``mask`` is ``[B, 1, Q, NB * block_size]``: query ``j`` of sequence
    ``i`` may see key ``k``.
    """

    __slots__ = ("_bias", "_window_rows", "blocks", "mask", "nb", "rows")

    def __init__(
        self, blocks: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, nb: int
    ) -> None:
        self.blocks = blocks
        self.rows = rows
        self.mask = mask
        self.nb = nb
        self._bias: torch.Tensor | None = None
        self._window_rows: torch.Tensor | None = None

    def window_rows(self, storage: KVBlockStorage) -> torch.Tensor:
        """The same tokens' rows for a layer ``storage`` keeps by window slot (built once)."""
        rows = self._window_rows
        if rows is None:
            rows = self._window_rows = storage.window_block_rows(self.blocks.tolist())
        return rows

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask in SDPA's additive form (0 where visible, -inf elsewhere) in ``dtype``.

        SDPA turns a boolean mask into exactly this tensor on every call; built
        once here, the layers of a pass share it, with results bit for bit the same.
        """
        bias = self._bias
        if bias is None or bias.dtype != dtype:
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            bias.masked_fill_(~self.mask, float("-inf"))
            self._bias = bias
        return bias


class BatchMeta:
    """Index tensors of one batched pass, built once and shared by every layer.

    K/V are gathered by token rows of the layer's contiguous row view
    (strided whole-block gathers copy far more than they read): sequence
    ``i`` reads rows for the first ``NB`` blocks of its table, padded with its
    first block, and the mask hides positions past its length.

    A sliding-window layer reads less: :meth:`window` gathers, per sequence,
    only the blocks from the one holding the first key any of its queries in
    this pass can see, with a mask that also hides keys older than the window.
    Each window's view is built once per pass, at the first layer that asks.
    """

    __slots__ = (
        "B",
        "NB",
        "Q",
        "_num_new",
        "_positions",
        "_seqs",
        "_starts",
        "_views",
        "decode_only",
        "full",
        "new_rows",
        "new_window_rows",
        "q_gather",
        "q_scatter",
        "storage",
    )

    def __init__(self, storage: KVBlockStorage, seqs: Sequence[SeqSlice]) -> None:
        device = storage.device
        self.storage = storage
        self.B = len(seqs)
        self.Q = Q = max(s.num_new for s in seqs)
        #: Every sequence brings one token in order (pure decode): queries need no reshuffling.
        self.decode_only = Q == 1
        self._seqs = seqs
        self._views: dict[int, KVView] = {}
        self._positions: torch.Tensor | None = None
        new_slots: list[int] = []
        q_gather: list[int] = []
        q_scatter: list[int] = []
        t = 0
        for i, s in enumerate(seqs):
            new_slots.extend(s.slots[s.start : s.start + s.num_new])
            if not self.decode_only:
                q_gather.extend(range(t, t + s.num_new))
                q_gather.extend([t] * (Q - s.num_new))
                q_scatter.extend(range(i * Q, i * Q + s.num_new))
            t += s.num_new
        self._starts = torch.tensor([s.start for s in seqs], device=device)
        self._num_new = torch.tensor([s.num_new for s in seqs], device=device)
        self.new_rows = storage.slot_rows(torch.tensor(new_slots, dtype=torch.int64))
        #: The new tokens' rows in layers kept by window slot (windowed storage only).
        self.new_window_rows = (
            storage.window_rows(new_slots) if storage.layout_kind == "split" else self.new_rows
        )
        self.q_gather = torch.tensor(q_gather, dtype=torch.int64, device=device)
        self.q_scatter = torch.tensor(q_scatter, dtype=torch.int64, device=device)
        #: What a full-attention layer reads: every sequence's whole context.
        self.full = self._view([0] * self.B, None)
        self.NB = self.full.nb

    @property
    def kv_rows(self) -> torch.Tensor:
        """Rows of every sequence's whole context (a full-attention layer's gather)."""
        return self.full.rows

    @property
    def kv_blocks(self) -> torch.Tensor:
        """Block ids of every sequence's whole context, ``NB`` per sequence, padded."""
        return self.full.blocks

    @property
    def mask(self) -> torch.Tensor:
        """The full-attention mask, ``[B, 1, Q, NB * block_size]``."""
        return self.full.mask

    @property
    def num_tokens(self) -> int:
        return int(self.new_rows.shape[0])

    @property
    def seqs(self) -> Sequence[SeqSlice]:
        """The pass's sequences, in the order their tokens are packed."""
        return self._seqs

    def window(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv_rows, mask)`` for a layer whose queries see the last ``window`` positions."""
        view = self.window_view(window)
        return view.rows, view.mask

    def window_view(self, window: int) -> KVView:
        """:meth:`window` as a :class:`KVView`."""
        view = self._views.get(window)
        if view is None:
            bs = self.storage.layout.block_size
            first = [first_visible(s.start, window) // bs for s in self._seqs]
            last_query = max(s.start + s.num_new - 1 for s in self._seqs)
            if not any(first) and last_query < window:
                view = self.full  # the window hides nothing in this pass
            else:
                view = self._view(first, window)
            self._views[window] = view
        return view

    def chunked(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv_rows, mask)`` for a chunked local layer: a query at ``p`` sees the keys from
        the start of its chunk of ``chunk`` positions (``p // chunk * chunk``) up to ``p``."""
        view = self.chunked_view(chunk)
        return view.rows, view.mask

    def chunked_view(self, chunk: int) -> KVView:
        """:meth:`chunked` as a :class:`KVView`."""
        key = -chunk  # windows are positive: one cache for both kinds of view
        view = self._views.get(key)
        if view is None:
            bs = self.storage.layout.block_size
            first = [s.start // chunk * chunk // bs for s in self._seqs]
            last_query = max(s.start + s.num_new - 1 for s in self._seqs)
            # When every query is in the first chunk, the chunk hides nothing.
            view = self.full if last_query < chunk else self._view(first, None, chunk)
            self._views[key] = view
        return view

    def positions(self) -> torch.Tensor:
        """The position of each new token of the pass, in pass order."""
        if self._positions is None:
            self._positions = torch.cat(
                [torch.arange(s.start, s.start + s.num_new) for s in self._seqs]
            ).to(self.storage.device)
        return self._positions

    def _view(self, first: Sequence[int], window: int | None, chunk: int | None = None) -> KVView:
        """The view when sequence ``i`` reads from its block ``first[i]`` on.

        ``NB`` blocks per sequence, padded with its first read block; the mask
        is ``[B, 1, Q, NB * block_size]``.
        """
        storage = self.storage
        device = storage.device
        bs = storage.layout.block_size
        seqs = self._seqs
        NB = max(cdiv(s.start + s.num_new, bs) - b for s, b in zip(seqs, first, strict=True))
        kv_blocks: list[int] = []
        for s, b in zip(seqs, first, strict=True):
            n = s.start + s.num_new
            blocks = [s.slots[p] // bs for p in range(b * bs, n, bs)]
            blocks += [blocks[0]] * (NB - len(blocks))  # padding, masked out
            kv_blocks.extend(blocks)
        # One slot per block in Python; the block_size slots of each are expanded by torch.
        block_ids = torch.tensor(kv_blocks, dtype=torch.int64)
        rows = storage.slot_rows((block_ids[:, None] * bs + torch.arange(bs)).flatten())
        # Query j of sequence i sits at position starts[i] + j and sees keys up to that
        # position (and, in a sliding layer, after position - window).
        qpos = self._starts[:, None] + torch.arange(self.Q, device=device)
        kpos = torch.tensor(first, device=device)[:, None] * bs + torch.arange(
            NB * bs, device=device
        )
        mask = kpos[:, None, :] <= qpos[:, :, None]
        if window is not None:
            mask &= kpos[:, None, :] > qpos[:, :, None] - window
        if chunk is not None:
            chunk_start = torch.div(qpos, chunk, rounding_mode="floor") * chunk
            mask &= kpos[:, None, :] >= chunk_start[:, :, None]
        # Padded query rows see key 0 only (an all-masked row would be NaN); they are dropped.
        pad = torch.arange(self.Q, device=device)[None, :] >= self._num_new[:, None]
        mask = mask & ~pad[:, :, None]
        mask[:, :, 0] |= pad
        return KVView(block_ids.to(device), rows, mask[:, None, :, :], NB)


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


def batch_of(module: torch.nn.Module, kwargs: dict[str, Any]) -> BatchMeta | None:
    """The batched pass an attention layer's call belongs to (``None``: not the engine's).

    The pass comes as the ``kvtier_batch`` argument, or, for a layer whose decoder layer
    did not hand it on, from the installed model's forward it runs in.
    """
    meta: BatchMeta | None = kwargs.get("kvtier_batch")
    if meta is None and isinstance(getattr(module, "layer_idx", None), int):
        meta = _PASS.get()
    return meta


def _enter_pass(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
    _PASS.set(kwargs.get("kvtier_batch"))


def _leave_pass(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
    _PASS.set(None)


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


class _LatentAttention:
    """Multi-head latent attention (DeepSeek V3) whose blocks hold the compressed latent.

    Mixed into the model's attention class by :func:`install`. In a batched
    pass, the per-token latent (``kv_nope``, the no-rope part compressed to
    ``kv_lora_rank`` values) and the shared rotary key (``k_rot``) are written
    to the blocks as one head's K and V (``k_rot`` zero-padded), every row of
    the batch's view is read back, and the model's own ``expand_kv``
    decompresses them; :func:`paged_attention` then attends over those rows.
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


def _store_latents(model: Any) -> None:
    """Give every MLA attention module of ``model`` the latent-storing behaviour."""
    for module in model.modules():
        if hasattr(module, "expand_kv") and hasattr(module, "kv_b_proj"):
            mix_in(module, _LatentAttention)


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


def install(model: Any) -> None:
    """Switch ``model`` to :func:`paged_attention` (plain SDPA whenever no batch is given).

    Short-convolution layers (LFM2) and linear-attention / Mamba layers
    (Qwen3-Next, Bamba) are switched to their block-backed forms too
    (:mod:`kvtier.engine.conv_layers`, :mod:`kvtier.engine.state_layers`).
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
    _store_latents(model)
    from kvtier.engine.own_attention import feed_caches

    feed_caches(model)
    _mark_windows(model)
    for handle in getattr(model, "_kvtier_pass_hooks", ()):
        handle.remove()
    model._kvtier_pass_hooks = (
        model.register_forward_pre_hook(_enter_pass, with_kwargs=True),
        model.register_forward_hook(_leave_pass, with_kwargs=True, always_call=True),
    )
    from kvtier.engine.conv_layers import install_short_convs
    from kvtier.engine.local_attention import install_local_attention
    from kvtier.engine.state_layers import install_state_layers

    install_short_convs(model)
    install_state_layers(model)
    install_local_attention(model)
