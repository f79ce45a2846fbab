"""Short causal convolution layers (LFM2) served from kvtier's blocks.

LFM2 interleaves attention layers with *short convolutions*: a layer
projects each token to ``B``, ``C`` and ``x`` (``hidden_size`` values each),
runs a causal depthwise convolution of ``conv_L_cache`` taps over ``B * x``
and outputs ``out_proj(C * conv(B * x))``. The convolution at position ``p``
reads ``B * x`` at positions ``p - L + 1 .. p`` and nothing older, so its
whole "state" is a sliding window of per-token features, not a recurrence.

kvtier stores each token's ``B * x`` in that layer's slot of the token's
block, split over the slot's K (the first ``kv_heads * head_dim`` values)
and V (the rest, zero-padded); :func:`kvtier.layers.geometry.geometry` widens
the slot until it holds ``hidden_size`` values. A convolution layer then
works like a sliding-window attention layer of window ``L``: it writes its
new tokens' features into their slots and reads the ``L - 1`` positions
before them back through the block table. Because everything a sequence
needs lives in blocks keyed by its token prefix, prefix caching,
preemption, offload tiers and migration serve these layers unchanged.

:func:`install_short_convs` (a registered layer kind)
gives every such module of a model this behaviour for the engine's batched
passes (a ``kvtier_batch`` argument) and for a
:class:`~kvtier.engine.KvTierCache`; any other call runs the model's own code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvtier.errors import ConfigError
from kvtier.layers.base import BlockBackedLayer, BlockCache, mix_in
from kvtier.layers.registry import LayerKind, register
from kvtier.storage import KVBlockStorage

if TYPE_CHECKING:
    from kvtier.layers.batch import BatchMeta


class _ConvWindow:
    """One batched pass's conv-window indices, built at the first conv layer and reused.

    The tokens a pass reads are, per sequence, the ``L - 1`` positions before
    its new tokens and the new tokens themselves (``ext_rows``, with
    ``ext_valid`` false for positions before the sequence's start), one
    sequence after another; token ``t``'s window is
    ``ext[first[t] .. first[t] + L - 1]``.
    """

    __slots__ = ("ext_rows", "ext_valid", "first", "kernel", "meta")

    def __init__(self, meta: BatchMeta, kernel: int) -> None:
        self.meta = meta
        self.kernel = kernel
        hist = kernel - 1
        slots: list[int] = []
        valid: list[bool] = []
        starts: list[int] = []
        for s in meta.seqs:
            lo = max(0, s.start - hist)
            missing = hist - (s.start - lo)
            own = s.slots[lo : s.start + s.num_new]
            # Positions before 0 read a real slot (its value is masked out).
            slots.extend([own[0]] * missing)
            slots.extend(own)
            valid.extend([False] * missing)
            valid.extend([True] * len(own))
            base = len(slots) - len(own) - missing
            starts.extend(range(base, base + s.num_new))
        device = meta.storage.device
        # Windowed storage keeps convolution layers by window slot (the rows of a plain
        # storage otherwise).
        self.ext_rows = meta.storage.window_rows(slots)
        self.ext_valid = torch.tensor(valid, dtype=torch.bool, device=device)
        self.first = torch.tensor(starts, dtype=torch.int64, device=device)


class _Plan:
    """Shared by every convolution layer of one model: the current pass's window."""

    __slots__ = ("window",)

    def __init__(self) -> None:
        self.window: _ConvWindow | None = None

    def for_pass(self, meta: BatchMeta, kernel: int) -> _ConvWindow:
        w = self.window
        if w is None or w.meta is not meta or w.kernel != kernel:
            w = self.window = _ConvWindow(meta, kernel)
        return w


def pack(storage: KVBlockStorage, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, hidden]`` features as a slot's K and V, each ``[n, kv_heads, head_dim]``."""
    lay = storage.layout
    half = lay.num_kv_heads * lay.head_dim
    n, hidden = features.shape
    if hidden > 2 * half:
        raise ConfigError(
            f"a convolution layer's {hidden} features per token do not fit a KV slot of "
            f"2 x {lay.num_kv_heads} x {lay.head_dim}: build the layout with "
            "kvtier.engine.layout_for_model(model.config, ...)"
        )
    flat = F.pad(features, (0, 2 * half - hidden))
    shape = (n, lay.num_kv_heads, lay.head_dim)
    return flat[:, :half].reshape(shape), flat[:, half:].reshape(shape)


def unpack(k: torch.Tensor, v: torch.Tensor, hidden: int) -> torch.Tensor:
    """The ``[n, hidden]`` features :func:`pack` stored as ``k`` and ``v``."""
    n = k.shape[0]
    return torch.cat((k.reshape(n, -1), v.reshape(n, -1)), dim=1)[:, :hidden]


class _BlockShortConv(BlockBackedLayer):
    """Mixed into a model's short-convolution class by :func:`install_short_convs`."""

    _kvtier_plan: _Plan

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(C, B * x)`` of a ``[1, T, hidden]`` row, each ``[T, hidden]``."""
        bcx = self.in_proj(hidden_states[0])  # type: ignore[attr-defined]
        b, c, x = bcx.chunk(3, dim=-1)
        return c, b * x

    def _convolve(
        self, c: torch.Tensor, ext: torch.Tensor, first: torch.Tensor | None
    ) -> torch.Tensor:
        """``out_proj(C * conv)`` for the new tokens, from the ``[E, hidden]`` run ``ext``.

        The model's own depthwise ``conv1d`` runs once over the whole run, every
        sequence's ``L - 1`` earlier positions and new tokens one after another,
        as transformers runs it over one sequence; token ``t`` takes the output
        of the window starting at ``first[t]`` (``None``: every output, in
        order). Windows straddling two sequences are computed and dropped.
        """
        conv: torch.nn.Conv1d = self.conv  # type: ignore[attr-defined]
        hidden = ext.shape[-1]
        y = F.conv1d(ext.t()[None].to(conv.weight.dtype), conv.weight, conv.bias, groups=hidden)
        y = y[0] if first is None else y[0].index_select(1, first)
        out_proj: torch.nn.Module = self.out_proj  # type: ignore[attr-defined]
        result: torch.Tensor = out_proj(c * y.t().to(c.dtype))
        return result.unsqueeze(0)

    def _batched(self, hidden_states: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        storage = meta.storage
        layer = int(self.layer_idx)  # type: ignore[attr-defined]
        kernel = int(self.conv_kernel_size)  # type: ignore[attr-defined]
        c, bx = self._project(hidden_states)
        k, v = pack(storage, bx)
        storage.write_rows(layer, meta.new_window_rows, k, v)
        w = self._kvtier_plan.for_pass(meta, kernel)
        k, v = storage.read_rows(layer, w.ext_rows)
        ext = unpack(k, v, bx.shape[-1]).masked_fill(~w.ext_valid[:, None], 0)
        return self._convolve(c, ext, w.first)

    def _cached(
        self, hidden_states: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        if attention_mask is not None and attention_mask.dim() == 2:
            # Padding positions feed the convolution zeros, as in the model's own forward.
            hidden_states = hidden_states * attention_mask[:, -hidden_states.shape[1] :, None]
        storage: KVBlockStorage = cache.storage
        layer = int(self.layer_idx)  # type: ignore[attr-defined]
        kernel = int(self.conv_kernel_size)  # type: ignore[attr-defined]
        c, bx = self._project(hidden_states)
        n, hidden = bx.shape
        k, v = pack(storage, bx)
        # The cache writes the new tokens and returns the layer's whole past, [1, H, len, D].
        k_all, v_all = cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], layer)
        past = unpack(k_all[0].transpose(0, 1), v_all[0].transpose(0, 1), hidden)
        ext = F.pad(past[-(n + kernel - 1) :], (0, 0, max(0, n + kernel - 1 - past.shape[0]), 0))
        return self._convolve(c, ext, None)


class _WidenedCache:
    """A :class:`~kvtier.engine.KvTierCache` seen by an attention layer narrower than its slots.

    The cache stores K/V at the slots' width; this view zero-pads what the
    layer writes and cuts what it reads back to the layer's own width, as
    the batched paged attention does.
    """

    def __init__(self, cache: Any, width: int) -> None:
        self._cache = cache
        self._width = width

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_dim, v_dim = key_states.shape[-1], value_states.shape[-1]
        width = self._width
        k, v = self._cache.update(
            F.pad(key_states, (0, width - k_dim)),
            F.pad(value_states, (0, width - v_dim)),
            layer_idx,
            **kwargs,
        )
        return k[..., :k_dim], v[..., :v_dim]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


class _NarrowAttention:
    """Mixed into the attention class of a model with convolution layers.

    Its K/V are narrower than the slots widened for the convolutions; under
    a :class:`~kvtier.engine.KvTierCache` it sees the cache through
    :class:`_WidenedCache`. Everything else runs the model's own code.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache")
        if isinstance(cache, BlockCache):
            width = cache.storage.layout.head_dim
            if int(self.head_dim) < width:  # type: ignore[attr-defined]
                kwargs["cache"] = _WidenedCache(cache, width)
        return super().forward(*args, **kwargs)  # type: ignore[misc]


def is_short_conv(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an LFM2-style short convolution (in_proj, conv, out_proj)."""
    return (
        type(module).__name__.endswith("ShortConv")
        and isinstance(getattr(module, "conv", None), torch.nn.Conv1d)
        and isinstance(getattr(module, "in_proj", None), torch.nn.Linear)
        and hasattr(module, "out_proj")
        and isinstance(getattr(module, "conv_kernel_size", None), int)
        and isinstance(getattr(module, "layer_idx", None), int)
    )


def _is_attention(module: torch.nn.Module) -> bool:
    return (
        type(module).__name__.endswith("Attention")
        and isinstance(getattr(module, "head_dim", None), int)
        and isinstance(getattr(module, "layer_idx", None), int)
        and hasattr(module, "k_proj")
    )


def install_short_convs(model: Any) -> int:
    """Serve ``model``'s short convolutions from kvtier's blocks; returns how many it has.

    Each convolution module gets the block-backed forward; in a model that
    has any, the attention modules also learn to pad their K/V to the
    widened slots under a :class:`~kvtier.engine.KvTierCache`. Idempotent;
    a model without convolutions is left as it is.
    """
    convs = [m for m in model.modules() if isinstance(m, _BlockShortConv) or is_short_conv(m)]
    if not convs:
        return 0
    plan = _Plan()  # one per model: its conv layers share each pass's window indices
    for module in convs:
        mix_in(module, _BlockShortConv)
        module._kvtier_plan = plan
    for module in model.modules():
        if _is_attention(module):
            mix_in(module, _NarrowAttention)
    return len(convs)


register(LayerKind("short-conv", install_short_convs, for_cache=True))
