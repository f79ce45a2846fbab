"""Device KV blocks in fewer bytes than the model computes in (``--kv-cache-dtype``).

Two :class:`~kvtier.storage.KVBlockStorage` subclasses, picked by
:func:`make_storage` from a block layout and the model's dtype:

:class:`CastKVBlockStorage`
    blocks in a narrower float dtype (bfloat16 or float16 for a float32
    model): writes round K/V to it, reads widen them back.
:class:`QuantizedKVBlockStorage`
    scaled blocks (:attr:`KVLayout.scaled <kvtier.KVLayout.scaled>`): int8 or
    float8 e4m3 elements plus one float32 scale per (block, layer, K/V, KV
    head). A block's raw bytes are exactly the payload of the offload codec
    of that element type (``int8`` or ``fp8``), so a block moves to a tier of
    the same codec, and back, without being decoded and encoded again.

Quantization happens as K/V are written, dequantization as attention reads
them (``q * scale`` in float32, then the model's dtype). A block's scales
are set by the write that starts it (the one covering its first slot) and
afterwards only grow: when a later token is larger than a scale allows, the
block's earlier tokens are quantized again to the larger scale (a second
rounding of at most half a step), so no value is ever clipped. Blocks
imported whole (from a tier, or as tensors) get the codec's scales: the
largest magnitude of each head over the block's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import BadRequestError, ConfigError
from kvtier.layout import KVLayout
from kvtier.offload.codec import Fp8Codec, Int8Codec, ScaledCodec
from kvtier.storage.device import (
    DEFAULT_LAYOUT_KIND,
    Indices,
    KVBlockStorage,
    LayoutKind,
    torch_dtype,
)

#: The smallest scale: a block of zeros still divides by something finite.
_TINY = torch.finfo(torch.float32).tiny

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_compute_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in _COMPUTE_DTYPES:
        raise ConfigError(
            f"compute_dtype must be one of {', '.join(map(str, _COMPUTE_DTYPES))}, got {dtype!r}"
        )
    return dtype


class CastKVBlockStorage(KVBlockStorage):
    """Blocks in a float dtype narrower than the model's (``compute_dtype``).

    ``dtype`` is the stored one (what blocks export as, what raw tiers
    hold); writes take and reads return ``compute_dtype``.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: str | torch.device = "cpu",
        *,
        compute_dtype: torch.dtype,
        layout_kind: LayoutKind = DEFAULT_LAYOUT_KIND,
        validate_indices: bool = True,
    ) -> None:
        compute = _check_compute_dtype(compute_dtype)
        super().__init__(
            layout, num_blocks, device, layout_kind=layout_kind, validate_indices=validate_indices
        )
        if not self.dtype.is_floating_point or self.dtype.itemsize < 2:
            raise ConfigError(
                f"{layout.dtype} blocks need scales: use a scaled layout (kv_cache_dtype int8 "
                "or fp8_e4m3) instead of casting"
            )
        self.compute_dtype = compute

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super().write_rows(layer, rows, k.to(self.dtype), v.to(self.dtype))

    def read_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().read_rows(layer, rows)
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def _read_blocks(
        self, layer: int, ids: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super()._read_blocks(layer, ids, num_tokens)
        return k.to(self.compute_dtype), v.to(self.compute_dtype)


class _WritePlan:
    """Which blocks one write touches, derived once per row-index tensor."""

    __slots__ = ("blocks", "held", "held_at", "inverse", "keep")

    def __init__(self, rows: torch.Tensor, block_rows: int) -> None:
        row_blocks = torch.div(rows, block_rows, rounding_mode="floor")
        starts = rows - row_blocks * block_rows == 0
        #: The distinct blocks written, and each row's index among them.
        self.blocks, self.inverse = torch.unique(row_blocks, return_inverse=True)
        started = torch.zeros(self.blocks.shape[0], dtype=torch.bool, device=rows.device)
        started[self.inverse[starts]] = True
        #: 1.0 for blocks that already hold tokens (their scales carry over), 0.0 for
        #: blocks this write starts (whatever they held before is stale).
        self.keep = (~started).to(torch.float32)
        #: The blocks that already hold tokens, and their index in ``blocks``.
        self.held_at = (~started).nonzero().flatten()
        self.held = self.blocks.index_select(0, self.held_at)


class _Memo:
    """One derived value of one index tensor at one version (the tensor's own cache)."""

    __slots__ = ("source", "value", "version")

    def __init__(self, source: torch.Tensor, value: object) -> None:
        self.source = source
        self.version = source._version
        self.value = value

    def get(self, source: torch.Tensor) -> object | None:
        if source is self.source and source._version == self.version:
            return self.value
        return None


class QuantizedKVBlockStorage(KVBlockStorage):
    """Scaled int8 / float8 e4m3 blocks of a scaled :class:`~kvtier.KVLayout`.

    ``dtype`` and ``compute_dtype`` are the model's dtype: what writes take,
    reads return and :meth:`export_blocks` gives (dequantized);
    ``kv_dtype`` is the element type held, :attr:`codec` the offload codec
    whose payload :meth:`block_bytes` and :meth:`export_payloads` return
    and raw-byte imports take. Block layout only (``layout_kind="block"``).
    """

    codec: ScaledCodec

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: str | torch.device = "cpu",
        *,
        compute_dtype: torch.dtype = torch.float32,
        validate_indices: bool = True,
    ) -> None:
        if not isinstance(layout, KVLayout) or not layout.scaled:
            raise ConfigError(
                "QuantizedKVBlockStorage needs a scaled KVLayout (KVLayout(..., dtype='int8', "
                "scaled=True), or kvtier.layout.cache_layout(layout, 'int8'))"
            )
        compute = _check_compute_dtype(compute_dtype)
        super().__init__(
            layout, num_blocks, device, layout_kind="block", validate_indices=validate_indices
        )
        L, H = layout.num_layers, layout.num_kv_heads
        #: The element type the blocks hold.
        self.kv_dtype = self.dtype
        self.dtype = compute
        self.compute_dtype = compute
        self.codec = Int8Codec() if self.kv_dtype == torch.int8 else Fp8Codec()
        try:
            scales = torch.zeros((num_blocks, L, 2, H), dtype=torch.float32, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cannot allocate the scales of {num_blocks} KV blocks on {self.device}: {exc}; "
                "configure fewer blocks"
            ) from None
        self._scales = scales
        # Per layer: K and V scales as [num_blocks, heads] (strided views).
        self._k_scales = [scales[:, i, 0] for i in range(L)]
        self._v_scales = [scales[:, i, 1] for i in range(L)]
        #: Rows of one block in the flat row views (a slot's block is its row // this).
        self._block_rows = 2 * L * layout.block_size
        self._token_bytes = layout.bytes_per_token * layout.block_size
        self._plan_memo: _Memo | None = None
        self._blocks_memo: _Memo | None = None

    # -- sizes and views --------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block: its elements and its scales (``layout.bytes_per_block``)."""
        return self.layout.bytes_per_block

    @property
    def nbytes(self) -> int:
        """Bytes held: the element tensor and the scales."""
        return super().nbytes + self._scales.numel() * self._scales.element_size()

    @property
    def scales(self) -> torch.Tensor:
        """Every block's scales, ``[num_blocks, layers, 2, kv_heads]`` float32."""
        return self._scales

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's quantized K and V, each ``[num_blocks, block_size, heads, dim]``
        in ``kv_dtype`` (scale them with :meth:`layer_scales`)."""
        layer = self._check_layer(layer)
        return self._k_blocks[layer].view(self.kv_dtype), self._v_blocks[layer].view(self.kv_dtype)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V scales, each ``[num_blocks, kv_heads]`` float32."""
        layer = self._check_layer(layer)
        return self._k_scales[layer], self._v_scales[layer]

    # -- quantization ------------------------------------------------------------
    def _plan(self, rows: torch.Tensor) -> _WritePlan:
        memo = self._plan_memo
        plan = memo.get(rows) if memo is not None else None
        if isinstance(plan, _WritePlan):
            return plan
        plan = _WritePlan(rows, self._block_rows)
        self._plan_memo = _Memo(rows, plan)
        return plan

    def _row_blocks(self, rows: torch.Tensor) -> torch.Tensor:
        memo = self._blocks_memo
        blocks = memo.get(rows) if memo is not None else None
        if isinstance(blocks, torch.Tensor):
            return blocks
        blocks = torch.div(rows, self._block_rows, rounding_mode="floor")
        self._blocks_memo = _Memo(rows, blocks)
        return blocks

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        """Float values over their scale (a temporary: modified in place) as op-dtype elements."""
        return self.codec.quantize(scaled).view(self._op_dtype)

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Elements ``q`` (op dtype) times ``scale`` (broadcast to them), in ``dtype``."""
        x = q.view(self.kv_dtype).to(torch.float32).mul_(scale)
        return x if self.dtype == torch.float32 else x.to(self.dtype)

    def _put(
        self,
        rows_view: torch.Tensor,
        blocks_view: torch.Tensor,
        scales: torch.Tensor,
        rows: torch.Tensor,
        plan: _WritePlan,
        x: torch.Tensor,
    ) -> None:
        """Quantize ``x`` (``[n, heads, dim]``) into ``rows``, growing its blocks' scales."""
        xf = x.to(torch.float32)
        amax = xf.abs().amax(dim=2)
        grown = torch.zeros(
            (plan.blocks.shape[0], amax.shape[1]), dtype=torch.float32, device=self.device
        ).scatter_reduce_(0, plan.inverse[:, None].expand_as(amax), amax, "amax")
        old = scales.index_select(0, plan.blocks).mul_(plan.keep[:, None])
        scale = torch.maximum(old, grown.div_(self.codec.qmax)).clamp_min_(_TINY)
        if plan.held.shape[0]:
            # Tokens already in the blocks move to the new scale; where it did
            # not grow the ratio is exactly 1 and they are unchanged.
            ratio = old.index_select(0, plan.held_at) / scale.index_select(0, plan.held_at)
            held = blocks_view.index_select(0, plan.held)
            held = held.view(self.kv_dtype).to(torch.float32).mul_(ratio[:, None, :, None])
            blocks_view.index_copy_(0, plan.held, self._quantize(held))
        q = self._quantize(xf / scale.index_select(0, plan.inverse)[:, :, None])
        rows_view.index_copy_(0, rows, q)
        scales.index_copy_(0, plan.blocks, scale)

    # -- per-layer writes and reads ----------------------------------------------
    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize one layer's K and V into ``rows`` (from :meth:`slot_rows`), unchecked."""
        plan = self._plan(rows)
        self._put(self._k_rows[layer], self._k_blocks[layer], self._k_scales[layer], rows, plan, k)
        self._put(self._v_rows[layer], self._v_blocks[layer], self._v_scales[layer], rows, plan, v)

    def read_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V at ``rows``, dequantized: two new ``[n, heads, dim]``."""
        blocks = self._row_blocks(rows)
        k = self._k_rows[layer].index_select(0, rows)
        v = self._v_rows[layer].index_select(0, rows)
        ks = self._k_scales[layer].index_select(0, blocks)[:, :, None]
        vs = self._v_scales[layer].index_select(0, blocks)[:, :, None]
        return self._dequantize(k, ks), self._dequantize(v, vs)

    def _read_blocks(
        self, layer: int, ids: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        k = self._k_blocks[layer].index_select(0, ids)
        v = self._v_blocks[layer].index_select(0, ids)
        ks = self._k_scales[layer].index_select(0, ids)[:, None, :, None]
        vs = self._v_scales[layer].index_select(0, ids)[:, None, :, None]
        k = self._dequantize(k, ks).view(-1, H, D)[:num_tokens]
        v = self._dequantize(v, vs).view(-1, H, D)[:num_tokens]
        return k, v

    # -- whole blocks ---------------------------------------------------------------
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst``, scales included (copy-on-write)."""
        super().copy_blocks(pairs)
        if not pairs:
            return
        src = torch.tensor([int(s) for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([int(d) for _, d in pairs], dtype=torch.int64, device=self.device)
        self._scales.index_copy_(0, dst, self._scales.index_select(0, src))

    def export_blocks(self, block_ids: Indices, out: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks dequantized: ``[n, layers, 2, block_size, heads, dim]`` in ``dtype``.

        :meth:`export_payloads` gives them as they are held.
        """
        ids = self._block_ids(block_ids)
        if out is not None:
            self._check_out(out, ids.shape[0])
        scale = self._scales.index_select(0, ids)[:, :, :, None, :, None]
        blocks = self._dequantize(self._gather(ids, None), scale)
        if out is None:
            return blocks
        out.copy_(blocks, non_blocking=out.is_pinned())
        return out

    def export_payloads(self, block_ids: Indices) -> torch.Tensor:
        """Blocks as held: ``[n, bytes_per_block]`` uint8, each row a :attr:`codec` payload."""
        ids = self._block_ids(block_ids)
        n = ids.shape[0]
        q = self._gather(ids, None).view(n, -1).view(torch.uint8)
        s = self._scales.index_select(0, ids).view(n, -1).view(torch.uint8)
        return torch.cat((q, s), dim=1)

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """One block as held (its :attr:`codec` payload): 1-D uint8, ``bytes_per_block`` long."""
        return self.export_payloads([block_id])[0]

    def import_blocks(self, block_ids: Indices, data: torch.Tensor) -> None:
        """Write blocks: :attr:`codec` payloads (uint8, ``n * bytes_per_block``) as they are,
        or ``[n, layers, 2, block_size, heads, dim]`` tensors in ``dtype``, quantized here."""
        ids = self._block_ids(block_ids)
        n = ids.shape[0]
        if n > 1 and int(torch.unique(ids).shape[0]) != n:
            raise BadRequestError("block_ids given to import_blocks must be distinct")
        if not isinstance(data, torch.Tensor):
            raise BadRequestError(f"block data must be a torch.Tensor, got {type(data).__name__}")
        shape = (n, *self.block_shape)
        if data.dtype == torch.uint8:
            want = n * self.bytes_per_block
            if data.numel() != want:
                raise BadRequestError(
                    f"raw block data must hold {n} x {self.bytes_per_block} = {want} bytes "
                    f"({self.codec.name} payloads), got {data.numel()}"
                )
            raw = data.to(self.device).reshape(n, self.bytes_per_block)
            q = raw[:, : self._token_bytes].view(self._op_dtype).reshape(shape)
            scale = raw[:, self._token_bytes :].contiguous().view(torch.float32)
            scale = scale.view(n, *self._scales.shape[1:])
        elif data.dtype == self.dtype:
            if tuple(data.shape) != shape:
                raise BadRequestError(
                    f"block data must be shaped {list(shape)} "
                    "[blocks, layers, 2, block_size, kv_heads, head_dim], "
                    f"got {list(data.shape)}"
                )
            x = data.to(self.device, torch.float32)
            # One scale per (block, layer, K/V, head) over tokens and head_dim, as the codec.
            scale = (x.abs().amax(dim=(3, 5)) / self.codec.qmax).clamp_min_(_TINY)
            q = self._quantize(x / scale[:, :, :, None, :, None])
        else:
            raise BadRequestError(
                f"block data has dtype {data.dtype}; give {self.dtype} blocks or raw "
                f"{self.codec.name} payloads (torch.uint8)"
            )
        if n:
            self._scatter(ids, q)
            self._scales.index_copy_(0, ids, scale)


def make_storage(
    layout: KVLayout,
    num_blocks: int,
    device: str | torch.device = "cpu",
    *,
    compute_dtype: torch.dtype | None = None,
    layout_kind: LayoutKind = DEFAULT_LAYOUT_KIND,
    validate_indices: bool = True,
) -> KVBlockStorage:
    """The storage for blocks of ``layout`` written and read as ``compute_dtype``.

    ``compute_dtype`` (the model's dtype; default: the layout's own, or
    float32 for a scaled layout) picks the class: the plain
    :class:`KVBlockStorage` when it is the layout's dtype, a
    :class:`CastKVBlockStorage` for a narrower float layout, a
    :class:`QuantizedKVBlockStorage` for a scaled one.
    """
    if not isinstance(layout, KVLayout):
        raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
    if layout.scaled:
        if layout_kind != "block":
            raise ConfigError(
                "quantized (scaled) blocks are stored block-contiguous: use layout_kind='block'"
            )
        return QuantizedKVBlockStorage(
            layout,
            num_blocks,
            device,
            compute_dtype=torch.float32 if compute_dtype is None else compute_dtype,
            validate_indices=validate_indices,
        )
    stored = torch_dtype(layout.dtype)
    if compute_dtype is None or compute_dtype == stored:
        return KVBlockStorage(
            layout, num_blocks, device, layout_kind=layout_kind, validate_indices=validate_indices
        )
    return CastKVBlockStorage(
        layout,
        num_blocks,
        device,
        compute_dtype=compute_dtype,
        layout_kind=layout_kind,
        validate_indices=validate_indices,
    )
