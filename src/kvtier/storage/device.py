"""KV block tensors on one device: what an engine writes and reads by block id.

:class:`KVBlockStorage` holds the keys and values of every layer for
``num_blocks`` blocks of ``layout.block_size`` tokens. Block ids and slots
are the manager's: a token at position ``p`` of a request lives at slot
``table.blocks[p // block_size] * block_size + p % block_size``.

Two memory layouts are supported (``layout_kind``):

``"block"`` (the default)
    one tensor ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``:
    a block's payload, all layers' K and V, is one contiguous run of
    ``layout.bytes_per_block`` bytes, so offloading a block is one copy.
``"layer"``
    one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``:
    each layer's K (and V) cache is contiguous, the paged layout most
    attention kernels take; a block's payload is ``2 * num_layers`` pieces.

``bench/kv_layout.py`` measures both; ``docs/benchmarks.md`` ("KV layout")
has the numbers behind the default. Whatever the layout, exported blocks
have one format, ``[n, num_layers, 2, block_size, kv_heads, head_dim]`` in
the storage dtype (or its raw bytes), so offload tiers are layout-agnostic.

Index tensors (slot mappings, block ids) are validated and converted once
per tensor: an engine that passes the same slot-mapping tensor to the writes
of all layers of a forward pass pays for the checks once. The cache keys on
the tensor object and its in-place version counter, so modifying it in place
is safe. Writes with duplicate slots leave the slot's value unspecified, as
with any scatter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, TypeAlias

import torch

from kvtier.block_table import BlockTable
from kvtier.errors import BadRequestError, ConfigError, InternalInvariantError
from kvtier.layout import KVLayout, cdiv
from kvtier.storage.fill import Copy, LayerFill

if TYPE_CHECKING:
    from kvtier.offload.codec import Codec

LayoutKind: TypeAlias = Literal["block", "layer", "split"]
LAYOUT_KINDS: tuple[LayoutKind, ...] = ("block", "layer")
#: Chosen from ``bench/kv_layout.py`` (CPU, SmolLM2-135M geometry): per-layer
#: writes and reads were no slower in the block layout (1.04-1.4x faster), and
#: exporting, importing and copying whole blocks 1.1-4.7x faster.
DEFAULT_LAYOUT_KIND: LayoutKind = "block"

#: Block ids or slots: a sequence of ints or a 1-D integer tensor.
Indices: TypeAlias = Sequence[int] | torch.Tensor

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a :class:`KVLayout` dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ConfigError(
            f"dtype {name!r} has no torch equivalent here; use one of {sorted(_TORCH_DTYPES)}"
        ) from None


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device!r} asked for CUDA, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                "use device='cpu' or install a CUDA build of torch on a machine with a GPU"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class _Cached:
    """Derived index tensors for one source tensor at one version."""

    __slots__ = ("source", "value", "version")

    def __init__(self, source: torch.Tensor, value: torch.Tensor) -> None:
        self.source = source
        self.version = source._version
        self.value = value

    def get(self, source: object) -> torch.Tensor | None:
        if source is self.source and self.source._version == self.version:
            return self.value
        return None


class KVBlockStorage:
    """K and V of every layer for ``num_blocks`` blocks, on one device.

    ``dtype`` defaults to the layout's (``"bfloat16"`` -> ``torch.bfloat16``);
    given, it must be that same dtype: the layout's dtype is part of every
    block key's namespace and sizes every tier's payloads. ``validate_indices``
    checks that slots and block ids are in range (once per index tensor; on
    CUDA each check synchronizes with the device); out-of-range indices with
    checks off are undefined behaviour on CUDA.

    Subclasses in :mod:`kvtier.storage.quant` keep blocks in fewer bytes than
    the model computes in (``compute_dtype``: what writes take and reads
    return); here both dtypes are the same.
    """

    #: The offload codec whose payload a block's raw bytes are (quantized
    #: storage), or ``None``: the raw bytes of ``dtype`` elements.
    codec: Codec | None = None
    #: A tier load landing layer by layer (:meth:`begin_fill`), or ``None``.
    _fill: LayerFill | None = None
    #: Loads that landed layer by layer, and the reads that had to wait for one.
    fills = 0
    fill_blocked_reads = 0

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        layout_kind: LayoutKind = DEFAULT_LAYOUT_KIND,
        *,
        validate_indices: bool = True,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ConfigError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if layout_kind not in LAYOUT_KINDS:
            raise ConfigError(f"layout_kind must be one of {LAYOUT_KINDS}, got {layout_kind!r}")
        expected = torch_dtype(layout.dtype)
        if dtype is None:
            dtype = expected
        elif not isinstance(dtype, torch.dtype):
            raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")
        elif dtype != expected:
            raise ConfigError(
                f"dtype {dtype} does not match the layout's dtype {layout.dtype!r}: the layout "
                "names the dtype blocks are keyed and sized by; build the storage from "
                f"dataclasses.replace(layout, dtype=...) instead"
            )
        dev = _resolve_device(device)

        L, H, D, bs = layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size
        if layout_kind == "block":
            shape = (num_blocks, L, 2, bs, H, D)
        else:
            shape = (L, 2, num_blocks, bs, H, D)
        nbytes = num_blocks * layout.bytes_per_block
        try:
            kv = torch.zeros(shape, dtype=dtype, device=dev)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cannot allocate {num_blocks} KV blocks ({nbytes:,} bytes) on {dev}: {exc}; "
                "configure fewer blocks"
            ) from None

        self.layout = layout
        self.num_blocks = num_blocks
        self.device = dev
        #: The dtype of a block as a tensor (exported, imported, stored on raw tiers).
        self.dtype = dtype
        #: The dtype of the K/V that writes take and reads return.
        self.compute_dtype = dtype
        self.layout_kind: LayoutKind = layout_kind
        self.validate_indices = validate_indices
        #: Shape of one block's payload, as exported.
        self.block_shape: tuple[int, int, int, int, int] = (L, 2, bs, H, D)
        self._token_shape = torch.Size((H, D))
        self._kv = kv
        # Copies run on a same-size integer view where torch lacks CPU kernels
        # for the dtype (float8): moving bytes does not care about their meaning.
        self._op_dtype = torch.uint8 if dtype.itemsize == 1 and dtype.is_floating_point else dtype
        op = kv.view(self._op_dtype)
        self._op = op
        #: Scatter whole blocks with one copy each rather than one index_copy_:
        #: on CPU, for blocks big enough that the Python loop costs little.
        self._copy_per_block = (
            layout_kind == "block" and dev.type == "cpu" and layout.bytes_per_block >= 1 << 15
        )
        # Per layer: K and V as [num_blocks, bs, H, D] (strided in the block layout).
        if layout_kind == "block":
            self._k_blocks = [op[:, i, 0] for i in range(L)]
            self._v_blocks = [op[:, i, 1] for i in range(L)]
            # Token rows of the whole tensor; a slot's row is
            # (slot // bs) * (L * 2 * bs) + slot % bs, shifted per layer and
            # for V by slicing the flat view, so every layer uses the same rows.
            flat = op.view(-1, H, D)
            self._k_rows = [flat[2 * bs * i :] for i in range(L)]
            self._v_rows = [flat[2 * bs * i + bs :] for i in range(L)]
        else:
            self._k_blocks = [op[i, 0] for i in range(L)]
            self._v_blocks = [op[i, 1] for i in range(L)]
            self._k_rows = [t.view(-1, H, D) for t in self._k_blocks]
            self._v_rows = [t.view(-1, H, D) for t in self._v_blocks]
        self._slot_cache: _Cached | None = None
        self._id_cache: _Cached | None = None
        #: How the fills' CUDA copies went (see :func:`~kvtier.storage.fill.copy_async`).
        self.fill_copies: dict[str, int] = {}

    # -- sizes and views --------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block's payload (all layers' K and V): ``layout.bytes_per_block``."""
        return self.layout.block_size * self._per_token_elements * self.dtype.itemsize

    @property
    def _per_token_elements(self) -> int:
        lay = self.layout
        return 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim

    @property
    def nbytes(self) -> int:
        """Bytes held by the storage tensor."""
        return self._kv.numel() * self._kv.element_size()

    @property
    def num_slots(self) -> int:
        """Token slots: ``num_blocks * block_size``."""
        return self.num_blocks * self.layout.block_size

    @property
    def tensor(self) -> torch.Tensor:
        """The storage tensor itself, in the shape of ``layout_kind`` (a load landing layer by
        layer has landed whole first)."""
        self.settle_fill()
        return self._kv

    # -- loads landing layer by layer ---------------------------------------------
    @property
    def fillable(self) -> bool:
        """Whether a load may land here layer by layer: plain K/V bytes, block by block, read
        and written only through this class's row methods (not a quantized or windowed one)."""
        return type(self) is KVBlockStorage and self.layout_kind == "block"

    def begin_fill(self, copies: Sequence[Sequence[Copy]]) -> None:
        """Start copies into this storage's blocks, ``copies[l]`` layer ``l``'s, so that a row
        read or write of layer ``l`` waits for that layer only (:class:`LayerFill`).

        Destinations are views of :meth:`fill_target`. One fill at a time: a
        previous one lands whole first.
        """
        if len(copies) != self.layout.num_layers:
            raise InternalInvariantError(
                f"a layer fill has {len(copies)} layers, the storage {self.layout.num_layers}"
            )
        self.settle_fill()
        self._fill = LayerFill(copies, self.device).start()
        self.fills += 1

    def fill_target(self) -> torch.Tensor:
        """The storage's bytes as ``[num_blocks, bytes_per_block]`` uint8, for
        :meth:`begin_fill`'s destinations (does not wait for a fill in flight)."""
        return self._kv.view(self.num_blocks, -1).view(torch.uint8)

    @property
    def filling(self) -> bool:
        """Whether a fill has begun and not been settled."""
        return self._fill is not None

    def settle_fill(self) -> None:
        """Wait until a fill in flight has landed whole (nothing to do without one)."""
        fill = self._fill
        if fill is None:
            return
        self._fill = None
        try:
            fill.settle()
        finally:
            self.fill_blocked_reads += fill.blocked_reads
            for kind, n in fill.copies_by_kind.items():
                self.fill_copies[kind] = self.fill_copies.get(kind, 0) + n

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's K and V caches, each ``[num_blocks, block_size, heads, dim]``.

        What a paged-attention kernel reads; contiguous in the layer layout,
        strided (one block's rows ``L * 2`` apart) in the block layout.
        """
        layer = self._check_layer(layer)
        if self._fill is not None:
            self._fill.wait(layer)
        return self._k_blocks[layer].view(self.dtype), self._v_blocks[layer].view(self.dtype)

    def is_window_layer(self, layer: int) -> bool:
        """Whether ``layer``'s rows come from :meth:`window_rows` (never, here: see
        :class:`~kvtier.storage.windowed.WindowedKVStorage`)."""
        return False

    def exportable(self, block_ids: Sequence[int]) -> list[bool]:
        """Per block: whether :meth:`export_blocks` can give its whole payload (always, here)."""
        return [True] * len(block_ids)

    def export_partial(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, list[bool]]:
        """:meth:`export_blocks`, with per block whether its payload is whole.

        Here every block is; a :class:`~kvtier.storage.windowed.WindowedKVStorage`
        gives zeros for the sliding layers of blocks that lost them, and
        :meth:`import_partial` on the other side keeps those blocks marked so.
        """
        return self.export_blocks(list(block_ids)), self.exportable(block_ids)

    def import_partial(
        self, block_ids: Sequence[int], data: torch.Tensor, whole: Sequence[bool]
    ) -> None:
        """:meth:`import_blocks` of what :meth:`export_partial` gave (``whole`` per block)."""
        if not all(whole):
            raise BadRequestError(
                "this storage keeps every layer of every block: it cannot take blocks whose "
                "sliding-window K/V is missing"
            )
        self.import_blocks(list(block_ids), data)

    def window_block_rows(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Rows of every token of ``block_ids`` for layers held apart by window: here, by block."""
        bs = self.layout.block_size
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        return self.slot_rows((ids[:, None] * bs + torch.arange(bs)).flatten())

    def window_rows(self, slots: Sequence[int]) -> torch.Tensor:
        """Rows of ``slots`` for layers held apart by block windows: here, :meth:`slot_rows`."""
        return self.slot_rows(torch.tensor(list(slots), dtype=torch.int64))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.layout.canonical()}, num_blocks={self.num_blocks}, "
            f"device={self.device}, layout_kind={self.layout_kind!r}, nbytes={self.nbytes:,})"
        )

    # -- validation -------------------------------------------------------------
    def _check_layer(self, layer: int) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise BadRequestError(f"layer must be an integer, got {type(layer).__name__}")
        if not 0 <= layer < self.layout.num_layers:
            raise BadRequestError(
                f"layer {layer} is out of range: the layout has {self.layout.num_layers} layers"
            )
        return layer

    def _index_tensor(self, what: str, values: Indices, limit: int) -> torch.Tensor:
        """``values`` as a 1-D int64 tensor on the storage device, range-checked."""
        if isinstance(values, torch.Tensor):
            if values.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
                raise BadRequestError(f"{what} must be an integer tensor, got {values.dtype}")
            if values.dim() != 1:
                raise BadRequestError(
                    f"{what} must be a 1-D tensor, got shape {tuple(values.shape)}"
                )
            t = values.to(device=self.device, dtype=torch.int64)
            if self.validate_indices and t.numel():
                lo, hi = int(t.min()), int(t.max())
                if lo < 0 or hi >= limit:
                    bad = lo if lo < 0 else hi
                    raise BadRequestError(f"{what} holds {bad}, outside [0, {limit})")
            return t
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise BadRequestError(
                f"{what} must be a sequence of ints or a 1-D integer tensor, "
                f"got {type(values).__name__}"
            )
        for v in values:
            if not isinstance(v, int) or isinstance(v, bool):
                raise BadRequestError(f"{what} must hold integers, got {type(v).__name__}")
            if not 0 <= v < limit:
                raise BadRequestError(f"{what} holds {v}, outside [0, {limit})")
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _block_ids(self, block_ids: Indices, what: str = "block_ids") -> torch.Tensor:
        if isinstance(block_ids, torch.Tensor):
            cached = self._id_cache.get(block_ids) if self._id_cache is not None else None
            if cached is not None:
                return cached
            ids = self._index_tensor(what, block_ids, self.num_blocks)
            self._id_cache = _Cached(block_ids, ids)
            return ids
        return self._index_tensor(what, block_ids, self.num_blocks)

    def _slot_rows(self, slots: Indices) -> torch.Tensor:
        """The row index of every slot in the per-layer row views."""
        cached = self._slot_cache.get(slots) if self._slot_cache is not None else None
        if cached is not None:
            return cached
        t = self._index_tensor("slots", slots, self.num_slots)
        if self.layout_kind == "block":
            bs = self.layout.block_size
            t = (t // bs) * (2 * bs * self.layout.num_layers) + t % bs
        if isinstance(slots, torch.Tensor):
            self._slot_cache = _Cached(slots, t)
        return t

    def _check_tokens(self, name: str, x: object, n: int | None) -> torch.Tensor:
        lay = self.layout
        if not isinstance(x, torch.Tensor):
            raise BadRequestError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[1:] != (lay.num_kv_heads, lay.head_dim):
            raise BadRequestError(
                f"{name} must be shaped [n_tokens, num_kv_heads={lay.num_kv_heads}, "
                f"head_dim={lay.head_dim}], got {list(x.shape)}"
            )
        if n is not None and x.shape[0] != n:
            raise BadRequestError(f"{name} has {x.shape[0]} tokens but k has {n}")
        if x.dtype != self.compute_dtype:
            raise BadRequestError(
                f"{name} has dtype {x.dtype} but the storage takes {self.compute_dtype}: "
                f"cast it first ({name}.to({self.compute_dtype}))"
            )
        if x.device != self.device:
            raise BadRequestError(
                f"{name} is on {x.device} but the storage is on {self.device}: "
                f"move it first ({name}.to('{self.device}'))"
            )
        return x

    # -- per-layer writes and reads --------------------------------------------
    def write(self, layer: int, slots: Indices, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one layer's K and V for ``n`` tokens at their flat slots.

        ``k`` and ``v`` are ``[n, num_kv_heads, head_dim]`` in the storage
        dtype and on its device; ``slots`` (``n`` int64 values, e.g. from
        :meth:`BlockTable.slot_mapping`) says where each token goes.
        """
        if not (type(layer) is int and 0 <= layer < self.layout.num_layers):
            self._check_layer(layer)
        dt, dev = self.compute_dtype, self.device
        if not (  # one cheap test on the hot path; the checks below say what is wrong
            isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)
            and k.dtype == dt
            and v.dtype == dt
            and k.device == dev
            and v.device == dev
            and k.dim() == 3
            and k.shape == v.shape
            and k.shape[1:] == self._token_shape
        ):
            self._check_tokens("k", k, None)
            self._check_tokens("v", v, k.shape[0])
        n = k.shape[0]
        rows = self._slot_rows(slots)
        if rows.shape[0] != n:
            raise BadRequestError(f"slots has {rows.shape[0]} entries but k and v have {n} tokens")
        if n == 0:
            return
        self.write_rows(layer, rows, k, v)

    def read(
        self, layer: int, block_ids: Indices | BlockTable, num_tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V of a request's first ``num_tokens`` tokens, in order.

        ``block_ids`` is the request's block table (a :class:`BlockTable`, whose
        ``num_tokens`` is the default, or its list of blocks); the last block
        may be partly filled. Returns two new ``[num_tokens, heads, dim]`` tensors.
        """
        layer = self._check_layer(layer)
        self.settle_fill()
        if isinstance(block_ids, BlockTable):
            if num_tokens is None:
                num_tokens = block_ids.num_tokens
            block_ids = block_ids.blocks
        if num_tokens is None:
            raise BadRequestError("num_tokens is required unless block_ids is a BlockTable")
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise BadRequestError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        bs = self.layout.block_size
        needed = cdiv(num_tokens, bs)
        ids = self._block_ids(block_ids)
        if ids.shape[0] < needed:
            raise BadRequestError(
                f"{num_tokens} tokens need {needed} blocks of {bs}, "
                f"but the block table has {ids.shape[0]}"
            )
        if ids.shape[0] > needed:
            ids = ids[:needed]
        return self._read_blocks(layer, ids, num_tokens)

    def _read_blocks(
        self, layer: int, ids: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`read` of checked block ids: the first ``num_tokens`` tokens of blocks ``ids``."""
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        k = self._k_blocks[layer].index_select(0, ids).view(-1, H, D)[:num_tokens]
        v = self._v_blocks[layer].index_select(0, ids).view(-1, H, D)[:num_tokens]
        if self._op_dtype != self.dtype:
            k, v = k.view(self.dtype), v.view(self.dtype)
        return k, v

    # -- by precomputed rows (the batched forward's hot path) -----------------------
    def slot_rows(self, slots: Indices) -> torch.Tensor:
        """Checked row indices of ``slots`` for :meth:`write_rows` and :meth:`read_rows`.

        A batched forward pass converts its slots once and reuses the rows in
        every layer; the row methods then skip all checks.
        """
        return self._slot_rows(slots).clone()

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """:meth:`write` at rows from :meth:`slot_rows`, unchecked (``k``/``v`` as for write)."""
        if self._fill is not None:
            self._fill.wait(layer)
        if self._op_dtype != self.dtype:
            k, v = k.view(self._op_dtype), v.view(self._op_dtype)
        self._k_rows[layer].index_copy_(0, rows, k)
        self._v_rows[layer].index_copy_(0, rows, v)

    def read_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V at rows from :meth:`slot_rows`: two new ``[n, heads, dim]``."""
        if self._fill is not None:
            self._fill.wait(layer)
        k = self._k_rows[layer].index_select(0, rows)
        v = self._v_rows[layer].index_select(0, rows)
        if self._op_dtype != self.dtype:
            k, v = k.view(self.dtype), v.view(self.dtype)
        return k, v

    # -- whole blocks -------------------------------------------------------------
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer's K and V) ``src -> dst``, e.g. ``Extension.copies``.

        All pairs are read before any is written, so a block may be both a
        destination and (in another pair) a source. Destinations must be distinct.
        """
        if not pairs:
            return
        self.settle_fill()
        try:
            src = [int(s) for s, _ in pairs]
            dst = [int(d) for _, d in pairs]
        except (TypeError, ValueError):
            raise BadRequestError(
                "pairs must be a sequence of (src, dst) block id pairs"
            ) from None
        if len(set(dst)) != len(dst):
            raise BadRequestError(f"copy destinations must be distinct, got {dst}")
        src_t = self._index_tensor("copy source", src, self.num_blocks)
        dst_t = self._index_tensor("copy destination", dst, self.num_blocks)
        if self._copy_per_block and not set(src).intersection(dst):
            op = self._op
            for s, d in zip(src, dst, strict=True):
                op[d].copy_(op[s])
            return
        self._scatter(dst_t, self._gather(src_t, None))

    def export_blocks(self, block_ids: Indices, out: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous copy of blocks' payloads: ``[n, layers, 2, block_size, heads, dim]``.

        The format is the same for both layout kinds. ``out`` (contiguous, that
        shape, the storage dtype) receives the copy instead of a new tensor; it
        may live on another device: from CUDA into pinned host memory the copy
        is asynchronous (synchronize the stream before reading ``out``).
        """
        ids = self._block_ids(block_ids)
        if out is not None:
            self._check_out(out, ids.shape[0])
            if out.device == self.device:
                self._gather(ids, out.view(self._op_dtype))
                return out
            out.view(self._op_dtype).copy_(self._gather(ids, None), non_blocking=out.is_pinned())
            return out
        return self._gather(ids, None).view(self.dtype)

    def _check_out(self, out: object, n: int) -> None:
        """Raise unless ``out`` can receive ``n`` exported blocks."""
        shape = (n, *self.block_shape)
        if not isinstance(out, torch.Tensor):
            raise BadRequestError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != shape or out.dtype != self.dtype or not out.is_contiguous():
            raise BadRequestError(
                f"out must be a contiguous {self.dtype} tensor of shape {list(shape)}, "
                f"got {out.dtype} {list(out.shape)}"
                + ("" if out.is_contiguous() else " (not contiguous)")
            )

    def _gather(self, ids: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Blocks ``ids`` in block-major order (op dtype), into ``out`` when given."""
        self.settle_fill()
        if out is None:
            out = torch.empty(
                (ids.shape[0], *self.block_shape), dtype=self._op_dtype, device=self.device
            )
        if self.layout_kind == "block":
            return torch.index_select(self._op, 0, ids, out=out)
        # One gather straight into block-major order: index_select writes
        # through the permuted view (measured several times faster than
        # advanced indexing of the permuted storage, or a gather then a permute).
        torch.index_select(self._op, 2, ids, out=out.permute(1, 2, 0, 3, 4, 5))
        return out

    def _scatter(self, ids: torch.Tensor, payload: torch.Tensor) -> None:
        """Write block-major ``payload`` (op dtype, on this device) into blocks ``ids``."""
        self.settle_fill()
        if self._copy_per_block:
            # On CPU, index_copy_ moves element by element; one copy_ per
            # contiguous block measured 1.4-4x faster for bf16 imports and for
            # copy-on-write, and within about 10% for 64-block fp32 imports.
            op = self._op
            for j, b in enumerate(ids.tolist()):
                op[b].copy_(payload[j])
            return
        if self.layout_kind == "block":
            self._op.index_copy_(0, ids, payload)
        else:
            self._op.index_copy_(2, ids, payload.permute(1, 2, 0, 3, 4, 5))

    def import_blocks(self, block_ids: Indices, data: torch.Tensor) -> None:
        """Write exported payloads back into blocks (the inverse of :meth:`export_blocks`).

        ``data`` is ``[n, layers, 2, block_size, heads, dim]`` in the storage
        dtype, or raw bytes: a uint8 tensor of ``n * bytes_per_block`` elements.
        It may be on another device (copied over first). Block ids must be distinct.
        """
        ids = self._block_ids(block_ids)
        n = ids.shape[0]
        if n > 1 and int(torch.unique(ids).shape[0]) != n:
            raise BadRequestError("block_ids given to import_blocks must be distinct")
        payload = self._as_payload(data, n)
        if n:
            self._scatter(ids, payload)

    def _as_payload(self, data: object, n: int) -> torch.Tensor:
        """``data`` as ``[n, *block_shape]`` in the op dtype, on the storage device."""
        if not isinstance(data, torch.Tensor):
            raise BadRequestError(f"block data must be a torch.Tensor, got {type(data).__name__}")
        shape = (n, *self.block_shape)
        if data.dtype == torch.uint8 and self.dtype != torch.uint8:
            want = n * self.bytes_per_block
            if data.numel() != want:
                raise BadRequestError(
                    f"raw block data must hold {n} x {self.bytes_per_block} = {want} bytes, "
                    f"got {data.numel()}"
                )
            data = data.contiguous().view(-1).view(self._op_dtype).view(shape)
        elif data.dtype == self.dtype:
            if tuple(data.shape) != shape:
                raise BadRequestError(
                    f"block data must be shaped {list(shape)} "
                    "[blocks, layers, 2, block_size, kv_heads, head_dim], "
                    f"got {list(data.shape)}"
                )
            data = data.view(self._op_dtype)
        else:
            raise BadRequestError(
                f"block data has dtype {data.dtype}; give the storage dtype {self.dtype} "
                "or raw bytes (torch.uint8)"
            )
        if data.device != self.device:
            data = data.to(self.device, non_blocking=data.is_pinned())
        return data

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """A copy of one block's payload as raw bytes: 1-D uint8, ``bytes_per_block`` long."""
        return self.export_blocks([block_id]).view(-1).view(torch.uint8)

    def load_block(self, block_id: int, data: torch.Tensor) -> None:
        """Write one block's payload: raw bytes (uint8) or ``[layers, 2, block_size, heads, D]``."""
        if isinstance(data, torch.Tensor) and data.dtype == self.dtype:
            if tuple(data.shape) != self.block_shape:
                raise BadRequestError(
                    f"block data must be shaped {list(self.block_shape)} "
                    f"[layers, 2, block_size, kv_heads, head_dim], got {list(data.shape)}"
                )
            data = data.unsqueeze(0)
        self.import_blocks([block_id], data)
