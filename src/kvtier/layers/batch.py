"""One batched pass of the engine, as every layer of the model sees it.

The engine runs one forward pass over the new tokens of every scheduled
sequence, flattened into one row. :class:`BatchMeta` holds what a layer
needs to write those tokens' K/V to kvtier's blocks and to read each
sequence's past back: the rows each sequence's new tokens go to, and per
way of reading (the whole context, a sliding window, a chunk) a
:class:`KVView` of the rows gathered and the mask over them, each built once
per pass at the first layer that asks.

The pass reaches a layer as its ``kvtier_batch`` argument or, where a
decoder layer does not hand its keyword arguments on (StableLM's,
Nemotron's), from the forward of the installed model it runs in
(:func:`batch_of`; :func:`enter_pass` and :func:`leave_pass` are that
forward's hooks).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.layers.attention_spec import first_visible
from kvtier.layout import cdiv
from kvtier.storage import KVBlockStorage

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


def batch_of(module: torch.nn.Module, kwargs: dict[str, Any]) -> BatchMeta | None:
    """The batched pass an attention layer's call belongs to (``None``: not the engine's).

    The pass comes as the ``kvtier_batch`` argument, or, for a layer whose decoder layer
    did not hand it on, from the installed model's forward it runs in.
    """
    meta: BatchMeta | None = kwargs.get("kvtier_batch")
    if meta is None and isinstance(getattr(module, "layer_idx", None), int):
        meta = _PASS.get()
    return meta


def enter_pass(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """An installed model's forward pre-hook: the pass it was given is the one running."""
    _PASS.set(kwargs.get("kvtier_batch"))


def leave_pass(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
    """An installed model's forward hook (run on errors too): no pass is running."""
    _PASS.set(None)
