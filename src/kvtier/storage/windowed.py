"""KV storage that keeps some layers' share of a block only where requests read or resume.

The same storage serves every layer group that reads only a bounded stretch
of the past: sliding-window layers (their window), Llama 4's chunked local
layers (their chunk), LFM2's short convolutions (their last few inputs) and
linear-attention / Mamba layers (the state checkpoint before the first new
token); :mod:`kvtier.engine.windows` says which, and how far back they read.
Below, "sliding layers" stands for any of them.

:class:`WindowedKVStorage` splits a block's payload by layer group. The full
layers' K/V sit in one tensor indexed by block id, as in
:class:`~kvtier.storage.KVBlockStorage`; the sliding layers' K/V sit in a
second, smaller tensor indexed by *slot*, and a block has a slot only while
it may be read through a window (:class:`~kvtier.storage.window_slab.WindowSlab`
keeps that bookkeeping). At 8k tokens of context a Gemma 3 sequence then
holds its 1-in-6 full layers for every block and its sliding layers for
about one window, instead of every layer for every block.

Everything outside the forward pass sees the same block format as before:
:meth:`export_blocks` assembles ``[n, layers, 2, block_size, heads, dim]``
from both tensors, and :meth:`import_blocks` splits it again (giving each
imported block a slot while an idle or free one exists), so offload tiers,
moving requests between engines and copy-on-write work unchanged. A block
whose slot was reclaimed has no sliding K/V to export: :meth:`exportable`
says which blocks can be exported, and exporting the others raises
:class:`~kvtier.storage.window_slab.WindowDroppedError` rather than
inventing data.

The batched forward pass reads a sliding layer's rows through
:meth:`window_rows`, a full layer's through :meth:`slot_rows`;
:meth:`is_window_layer` says which is which.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.storage.device import Indices, KVBlockStorage, _Cached, torch_dtype
from kvtier.storage.window_slab import WindowDroppedError, WindowSlab, first_read_block


class WindowedKVStorage(KVBlockStorage):
    """Full layers per block, sliding layers per window slot (see the module docstring).

    ``window_layers`` are the layer indices whose K/V go to slots;
    ``num_slots`` how many blocks' worth of them the slot tensor holds;
    ``window`` the longest sliding window (what :meth:`resumable` checks).
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        *,
        window_layers: Sequence[int],
        window: int,
        num_slots: int,
        chunk: int = 0,
        device: str | torch.device = "cpu",
        validate_indices: bool = True,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if layout.scaled:
            raise ConfigError(
                "windowed storage holds float blocks; a quantized --kv-cache-dtype keeps "
                "every layer in every block"
            )
        L = layout.num_layers
        wl = sorted(set(window_layers))
        if not wl or wl[0] < 0 or wl[-1] >= L:
            raise ConfigError(
                f"window_layers must name some of the layout's {L} layers, got {window_layers!r}"
            )
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ConfigError(f"window must be a positive integer, got {window!r}")
        full = [i for i in range(L) if i not in set(wl)]
        self.slab = WindowSlab(num_blocks, min(num_slots, num_blocks))
        self.window = window
        #: Chunked local layers (Llama 4): each query reads its own chunk of this many
        #: positions (0: the layers slide by ``window``).
        self.chunk = chunk
        self.window_layer_ids: tuple[int, ...] = tuple(wl)
        self.full_layer_ids: tuple[int, ...] = tuple(full)
        # Per layer: (the part holding it, its index there).
        self._part: list[tuple[bool, int]] = [(False, 0)] * L
        for j, i in enumerate(full):
            self._part[i] = (False, j)
        for j, i in enumerate(wl):
            self._part[i] = (True, j)
        dtype = torch_dtype(layout.dtype)
        self._full: KVBlockStorage | None = (
            KVBlockStorage(
                KVLayout(
                    len(full), layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype
                ),
                num_blocks,
                device,
                validate_indices=False,
            )
            if full
            else None
        )
        self._win = KVBlockStorage(
            KVLayout(
                len(wl), layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype
            ),
            self.slab.num_slots,
            device,
            validate_indices=False,
        )
        self.layout = layout
        self.layout_kind = "split"
        self.num_blocks = num_blocks
        self.device = self._win.device
        self.dtype = dtype
        self.compute_dtype = dtype
        self.validate_indices = validate_indices
        bs = layout.block_size
        self.block_shape = (L, 2, bs, layout.num_kv_heads, layout.head_dim)
        self._token_shape = torch.Size((layout.num_kv_heads, layout.head_dim))
        self._op_dtype = self._win._op_dtype
        self._copy_per_block = False
        self._slot_cache = None
        self._id_cache = None
        self._full_idx = torch.tensor(full, dtype=torch.int64, device=self.device)
        self._win_idx = torch.tensor(wl, dtype=torch.int64, device=self.device)

    # -- sizes --------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held by both tensors."""
        return (self._full.nbytes if self._full is not None else 0) + self._win.nbytes

    @property
    def full_bytes_per_block(self) -> int:
        """Bytes of one block's full layers (held for every block)."""
        return self._full.bytes_per_block if self._full is not None else 0

    @property
    def window_bytes_per_block(self) -> int:
        """Bytes of one block's sliding layers (held only for blocks with a slot)."""
        return self._win.bytes_per_block

    def held_bytes(self, num_blocks: int, num_slots: int) -> int:
        """Bytes that ``num_blocks`` blocks with ``num_slots`` slots among them take."""
        return num_blocks * self.full_bytes_per_block + num_slots * self.window_bytes_per_block

    @property
    def tensor(self) -> torch.Tensor:
        raise ConfigError(
            "windowed storage has no single tensor: its blocks' full and sliding layers are "
            "held apart; use export_blocks"
        )

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V caches: by block id for a full layer, by slot for a sliding one."""
        window, j = self._part[self._check_layer(layer)]
        part = self._win if window else self._full
        assert part is not None
        return part.layer_cache(j)

    def __repr__(self) -> str:
        return (
            f"WindowedKVStorage({self.layout.canonical()}, num_blocks={self.num_blocks}, "
            f"window={self.window}, chunk={self.chunk}, "
            f"window_layers={len(self.window_layer_ids)}, "
            f"slots={self.slab.num_slots}, device={self.device}, nbytes={self.nbytes:,})"
        )

    # -- the forward pass ----------------------------------------------------------
    def is_window_layer(self, layer: int) -> bool:
        return self._part[layer][0]

    def _slot_rows(self, slots: Indices) -> torch.Tensor:
        cached = self._slot_cache.get(slots) if self._slot_cache is not None else None
        if cached is not None:
            return cached
        t = self._index_tensor("slots", slots, self.num_slots)
        rows = self._full._slot_rows(t) if self._full is not None else t
        if isinstance(slots, torch.Tensor):
            self._slot_cache = _Cached(slots, rows)
        return rows

    def window_rows(self, slots: Sequence[int]) -> torch.Tensor:
        """Rows of the sliding layers' row views for token ``slots`` (their blocks need slots)."""
        bs = self.layout.block_size
        slot_of = self.slab.slot_of
        mapped = []
        for s in slots:
            w = slot_of[s // bs]
            if w < 0:
                raise WindowDroppedError(
                    f"block {s // bs} has no window slot: hold it before the pass reads it"
                )
            mapped.append(w * bs + s % bs)
        return self._win._slot_rows(torch.tensor(mapped, dtype=torch.int64, device=self.device))

    def window_block_rows(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Rows of every token of ``block_ids``, in order, in the sliding layers' row views."""
        bs = self.layout.block_size
        slots = torch.tensor(self.slab.slots(block_ids), dtype=torch.int64)
        tokens = (slots[:, None] * bs + torch.arange(bs)).flatten()
        return self._win._slot_rows(tokens.to(self.device))

    def write(self, layer: int, slots: Indices, k: torch.Tensor, v: torch.Tensor) -> None:
        raise ConfigError(
            "windowed storage is written by the engine's batched pass; a KvTierCache under "
            "generate needs storage that keeps every layer in every block (make_storage)"
        )

    def read(
        self, layer: int, block_ids: object, num_tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise ConfigError(
            "windowed storage is read by the engine's batched pass; a KvTierCache under "
            "generate needs storage that keeps every layer in every block (make_storage)"
        )

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        window, j = self._part[layer]
        part = self._win if window else self._full
        assert part is not None
        part.write_rows(j, rows, k, v)

    def read_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window, j = self._part[layer]
        part = self._win if window else self._full
        assert part is not None
        return part.read_rows(j, rows)

    # -- whole blocks ----------------------------------------------------------------
    def resumable(self, block_ids: list[int]) -> int:
        """How many leading ``block_ids`` (a cached prefix) a request may resume after."""
        return self.slab.resumable(block_ids, self.window, self.layout.block_size, self.chunk)

    def on_evicted(self, keys: Sequence[int], blocks: Sequence[int]) -> None:
        """Evict listener of the block pool: evicted blocks' slots are reclaimed first."""
        self.slab.forget(blocks)

    def first_read_block(self, position: int) -> int:
        """The first block the held layers of a query at ``position`` read."""
        return first_read_block(position, self.layout.block_size, self.window, self.chunk)

    def exportable(self, block_ids: Sequence[int]) -> list[bool]:
        """Per block: whether it still keeps its sliding K/V (so :meth:`export_blocks` works)."""
        slot_of = self.slab.slot_of
        return [slot_of[b] >= 0 for b in block_ids]

    def export_partial(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, list[bool]]:
        """Every block's payload, zeros where its sliding layers were reclaimed, and which
        blocks are whole (moving a request between engines: its window is always whole)."""
        ids = list(block_ids)
        whole = self.exportable(ids)
        t = self._block_ids(ids)
        out = torch.zeros((len(ids), *self.block_shape), dtype=self._op_dtype, device=self.device)
        if self._full is not None and ids:
            out.index_copy_(1, self._full_idx, self._full._op.index_select(0, t))
        keep = [j for j, ok in enumerate(whole) if ok]
        if keep:
            slots = torch.tensor(self.slab.slots(ids[j] for j in keep), device=self.device)
            rows = torch.tensor(keep, device=self.device)[:, None]
            out[rows, self._win_idx] = self._win._op.index_select(0, slots)
        return out.view(self.dtype), whole

    def import_partial(
        self, block_ids: Sequence[int], data: torch.Tensor, whole: Sequence[bool]
    ) -> None:
        ids = list(block_ids)
        self.import_blocks(ids, data)
        for b, ok in zip(ids, whole, strict=True):
            if not ok:
                self.slab.drop(b)

    def _gather(self, ids: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            out = torch.empty(
                (ids.shape[0], *self.block_shape), dtype=self._op_dtype, device=self.device
            )
        if ids.shape[0] == 0:
            return out
        slots = torch.tensor(self.slab.slots(ids.tolist()), dtype=torch.int64, device=self.device)
        out.index_copy_(1, self._win_idx, self._win._op.index_select(0, slots))
        if self._full is not None:
            out.index_copy_(1, self._full_idx, self._full._op.index_select(0, ids))
        return out

    def _scatter(self, ids: torch.Tensor, payload: torch.Tensor) -> None:
        if ids.shape[0] == 0:
            return
        if self._full is not None:
            self._full._op.index_copy_(0, ids, payload.index_select(1, self._full_idx))
        slab = self.slab
        keep: list[int] = []
        slots: list[int] = []
        for j, b in enumerate(ids.tolist()):
            s = slab.assign(b, held=False)
            if s is None:
                slab.drop(b)  # no slot to be had: the block keeps its full layers only
            else:
                keep.append(j)
                slots.append(s)
        if keep:
            part = payload.index_select(0, torch.tensor(keep, device=self.device))
            self._win._op.index_copy_(
                0,
                torch.tensor(slots, dtype=torch.int64, device=self.device),
                part.index_select(1, self._win_idx),
            )
