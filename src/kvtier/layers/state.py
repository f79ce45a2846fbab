"""Linear-attention and Mamba layers served from state checkpoints in kvtier's blocks.

A hybrid model's state layer (a gated delta-net, a Mamba-2 or Mamba-1
mixer) keeps, per sequence, a convolution window and a recurrent state
instead of per-token K/V (:mod:`kvtier.layers.state_spec`). kvtier
keeps that state in the blocks: a state layer's part of a block holds the
layer's state after the block's last token so far, its raw bytes laid over
the part's K and V values. Hence the invariant every pass relies on: the
state after token ``p - 1`` of a sequence is in the block holding position
``p - 1``. A full block, published to the prefix cache under the chained
key of its tokens, carries the checkpoint at its end; a request that hits a
prefix of ``k`` blocks (hits are always whole blocks) resumes from block
``k - 1``'s checkpoint, and the prefix cache, the offload tiers, preemption
and moving a request between engines keep checkpoints with their blocks,
since to them a block is bytes. With
:class:`~kvtier.storage.windowed.WindowedKVStorage` the state layers' part
of a block lives in a checkpoint slot, kept only while a request resumes
from or writes the block and for as long as slots allow after that
(:mod:`kvtier.engine.windows`); the layers read and write it through
``window_block_rows``, which names the slot's rows there and the block's
otherwise.

In a batched pass each state layer:

* runs the pass's decodes (one new token on a sequence with a past) as one
  batch: their states are read from the blocks of their last tokens,
  stepped by the model's own code, and written to the blocks of the new
  tokens;
* runs every other sequence's new tokens in runs cut at block boundaries,
  so that the state at the end of each block can be written to it; the
  model's own code computes each run from the previous run's state.

The model's module does all the arithmetic, through a small object with
the methods of transformers' cache that such a layer calls
(:class:`_RunCache`). A layer that also has attention (Falcon-H1) keeps its
state in the slot columns after its K/V, and each side writes only its own
columns. A layer whose multi-token form always starts from a zero state
(Jamba's Mamba-1) goes on from a state one token at a time. Every state is
kept exactly (its bytes), so the storage must hold blocks in the model's own
dtype, and a tier must not quantize them; :func:`check_exact_blocks` says so before a server starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvtier.errors import ConfigError
from kvtier.layers.base import BlockBackedLayer, mix_in
from kvtier.layers.geometry import geometry
from kvtier.layers.registry import LayerKind, register
from kvtier.layers.state_spec import StateSpec, state_spec
from kvtier.storage import KVBlockStorage

if TYPE_CHECKING:
    from kvtier.layers.batch import BatchMeta


class _RunCache:
    """What a state layer asks of transformers' cache, for one run of tokens.

    ``conv`` and ``recurrent`` are the states before the run (``None`` at a
    sequence's first token, as a fresh transformers cache gives); after the
    layer's forward they are the states after it.
    """

    def __init__(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None) -> None:
        self.conv = conv
        self.recurrent = recurrent

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The run's inputs behind the kept window; the window becomes the last ``kernel``."""
        kernel = conv_kernel_size or conv_states.shape[-1]
        if self.conv is None:
            full = F.pad(conv_states, (max(0, kernel - conv_states.shape[-1]), 0))
        else:
            full = torch.cat((self.conv, conv_states), dim=-1)
        self.conv = full[..., -kernel:].contiguous()
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        self.recurrent = recurrent_states
        return recurrent_states


class _StateIO:
    """Reads and writes one state per block, as raw bytes over a layer's K and V of the block."""

    def __init__(
        self, storage: KVBlockStorage, spec: StateSpec, dtype: torch.dtype, first_column: int = 0
    ) -> None:
        lay = storage.layout
        self.storage = storage
        self.spec = spec
        self.dtype = dtype
        self.block_size = lay.block_size
        #: Where the state starts in each slot: after the layer's own K/V when it has attention.
        self.first_column = first_column
        self.width = lay.head_dim - first_column
        self.half = lay.block_size * lay.num_kv_heads * self.width  # values of K (or V)
        self.part_bytes = 2 * self.half * storage.dtype.itemsize
        self.rec_bytes = spec.recurrent_bytes
        self.conv_bytes = spec.conv_bytes(dtype.itemsize)
        if self.rec_bytes + self.conv_bytes > self.part_bytes:
            raise ConfigError(
                f"a state of {self.rec_bytes + self.conv_bytes} bytes does not fit a layer's "
                f"{self.part_bytes} bytes of a block: build the layout with "
                "kvtier.engine.layout_for_model(model.config, ...)"
            )

    def rows(self, blocks: list[int]) -> torch.Tensor:
        """Storage rows of every slot of ``blocks``, block after block."""
        # Windowed storage keeps state layers by window slot, others by block.
        return self.storage.window_block_rows(blocks)

    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv [n, C, K], recurrent [n, H, a, b])`` kept in the blocks of ``rows``."""
        k, v = self.storage.read_rows(layer, rows)
        if self.first_column:
            k, v = k[..., self.first_column :], v[..., self.first_column :]
        n = rows.shape[0] // self.block_size
        raw = torch.cat((k.reshape(n, -1), v.reshape(n, -1)), dim=1).view(torch.uint8)
        rb, cb = self.rec_bytes, self.conv_bytes
        rec = raw[:, :rb].contiguous().view(torch.float32).view(n, *self.spec.recurrent_shape)
        conv = raw[:, rb : rb + cb].contiguous().view(self.dtype)
        return conv.view(n, self.spec.conv_channels, self.spec.conv_kernel), rec

    def write(self, layer: int, rows: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor) -> None:
        """Keep the ``n`` states ``conv``/``rec`` in the blocks of ``rows``."""
        n = conv.shape[0]
        raw = torch.cat(
            (
                rec.to(torch.float32).reshape(n, -1).view(torch.uint8),
                conv.to(self.dtype).reshape(n, -1).view(torch.uint8),
            ),
            dim=1,
        )
        raw = F.pad(raw, (0, self.part_bytes - raw.shape[1])).view(self.storage.dtype)
        lay = self.storage.layout
        shape = (n * self.block_size, lay.num_kv_heads, self.width)
        k, v = raw[:, : self.half].reshape(shape), raw[:, self.half :].reshape(shape)
        if self.first_column:
            # The layer's attention keeps its K/V in the columns before: keep them.
            k_all, v_all = self.storage.read_rows(layer, rows)
            k_all[..., self.first_column :] = k
            v_all[..., self.first_column :] = v
            k, v = k_all, v_all
        self.storage.write_rows(layer, rows, k, v)


@dataclass
class _Run:
    """One sequence's tokens of a pass, cut at block boundaries."""

    #: Where its tokens start in the pass's row, and how many there are.
    offset: int
    length: int
    #: The block holding the state it starts from (``None``: it starts at position 0).
    source: int | None
    #: ``(start, end, block)`` runs: the tokens ``[start, end)`` of its new ones, and
    #: the block whose checkpoint their state becomes (``None``: a step inside a block,
    #: whose state only feeds the next step).
    cuts: list[tuple[int, int, int | None]]


class _PassPlan:
    """A pass's decodes and runs, built at the first state layer and reused by the others."""

    def __init__(self, meta: BatchMeta, io: _StateIO) -> None:
        self.meta = meta
        bs = io.block_size
        stepwise = not io.spec.resumable_runs
        decode_at: list[int] = []
        decode_from: list[int] = []
        decode_to: list[int] = []
        self.runs: list[_Run] = []
        t = 0
        for s in meta.seqs:

            def block(p: int, s: Any = s) -> int:
                return int(s.slots[p]) // bs

            if s.num_new == 1 and s.start > 0:
                decode_at.append(t)
                decode_from.append(block(s.start - 1))
                decode_to.append(block(s.start))
            else:
                cuts: list[tuple[int, int, int | None]] = []
                p, end = s.start, s.start + s.num_new
                while p < end:
                    stop = min(end, (p // bs + 1) * bs)
                    if stepwise and p > 0:
                        # The layer's multi-token form starts from a zero state: go on from a
                        # state one token at a time (its recurrent form).
                        cuts.extend(
                            (q - s.start, q + 1 - s.start, None) for q in range(p, stop - 1)
                        )
                        p = stop - 1
                    cuts.append((p - s.start, stop - s.start, block(stop - 1)))
                    p = stop
                source = block(s.start - 1) if s.start > 0 else None
                self.runs.append(_Run(t, s.num_new, source, cuts))
            t += s.num_new
        device = meta.storage.device
        self.decode_at = torch.tensor(decode_at, dtype=torch.int64, device=device)
        self.decode_read = io.rows(decode_from) if decode_at else None
        self.decode_write = io.rows(decode_to) if decode_at else None
        self.sources = {r.source for r in self.runs if r.source is not None}
        self.run_read = io.rows(sorted(self.sources)) if self.sources else None
        blocks = [blk for r in self.runs for _, _, blk in r.cuts if blk is not None]
        self.run_write = io.rows(blocks) if blocks else None


class _Plan:
    """Shared by every state layer of one model: the state I/O and the current pass's plan."""

    def __init__(self, spec: StateSpec, first_column: int = 0) -> None:
        self.spec = spec
        self.first_column = first_column
        self.io: _StateIO | None = None
        self.pass_plan: _PassPlan | None = None
        #: The batched pass the model is running (set around the model's forward): some
        #: decoder layers (Jamba's) call their mixer without passing the pass along.
        self.current: BatchMeta | None = None

    def enter(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self.current = kwargs.get("kvtier_batch")

    def leave(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        self.current = None

    def for_pass(self, meta: BatchMeta, dtype: torch.dtype) -> tuple[_StateIO, _PassPlan]:
        io = self.io
        if io is None or io.storage is not meta.storage or io.dtype != dtype:
            io = self.io = _StateIO(meta.storage, self.spec, dtype, self.first_column)
        plan = self.pass_plan
        if plan is None or plan.meta is not meta:
            plan = self.pass_plan = _PassPlan(meta, io)
        return io, plan


class _BlockStateLayer(BlockBackedLayer):
    """Mixed into a model's state-layer class by :func:`install_state_layers`."""

    _kvtier_plan: _Plan

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        current = self._kvtier_plan.current
        if current is not None and kwargs.get("kvtier_batch") is None:
            kwargs["kvtier_batch"] = current
        return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)

    def _cached(
        self, hidden_states: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        raise ConfigError(
            "a KvTierCache holds per-token K/V, not the recurrent state of a linear-attention "
            "or Mamba layer: serve this model with kvtier.engine.Engine"
        )

    def _run(self, x: torch.Tensor, state: _RunCache) -> torch.Tensor:
        out: torch.Tensor = super().forward(x, cache=state, attention_mask=None)
        if state.conv is None or state.recurrent is None:
            # Older transformers releases keep these states through another cache interface.
            raise ConfigError(
                f"{type(self).__name__} did not hand its states to the cache: kvtier serves "
                "linear-attention layers with the transformers release in constraints.txt "
                "(5.24); install that one"
            )
        return out

    def _batched(self, hidden_states: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        layer = int(self.layer_idx)  # type: ignore[attr-defined]
        x = hidden_states[0]
        io, plan = self._kvtier_plan.for_pass(meta, x.dtype)
        pieces: list[tuple[torch.Tensor | int, torch.Tensor]] = []
        if plan.decode_read is not None:
            assert plan.decode_write is not None
            conv, rec = io.read(layer, plan.decode_read)
            state = _RunCache(conv, rec)
            y = self._run(x.index_select(0, plan.decode_at)[:, None, :], state)
            assert state.conv is not None and state.recurrent is not None  # checked by _run
            io.write(layer, plan.decode_write, state.conv, state.recurrent)
            pieces.append((plan.decode_at, y[:, 0, :]))
        if plan.runs:
            assert plan.run_write is not None
            starts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            if plan.run_read is not None:
                conv, rec = io.read(layer, plan.run_read)
                for i, source in enumerate(sorted(plan.sources)):
                    starts[source] = (conv[i : i + 1], rec[i : i + 1])
            convs: list[torch.Tensor] = []
            recs: list[torch.Tensor] = []
            for run in plan.runs:
                if run.source is None:
                    state = _RunCache(None, None)
                else:
                    c0, r0 = starts[run.source]
                    state = _RunCache(c0.clone(), r0.clone())
                outs = []
                last = len(run.cuts) - 1
                for i, (a, b, blk) in enumerate(run.cuts):
                    seg = x[run.offset + a : run.offset + b][None]
                    outs.append(self._run(seg, state)[0])
                    assert state.conv is not None and state.recurrent is not None  # by _run
                    if blk is None:
                        continue
                    # A one-token run steps the states in place: keep this checkpoint apart.
                    keep = i == last
                    convs.append(state.conv if keep else state.conv.clone())
                    recs.append(state.recurrent if keep else state.recurrent.clone())
                pieces.append((run.offset, torch.cat(outs) if len(outs) > 1 else outs[0]))
            io.write(layer, plan.run_write, torch.cat(convs), torch.cat(recs))
        if len(pieces) == 1 and isinstance(pieces[0][0], int):
            return pieces[0][1][None]
        first = pieces[0][1]
        out = first.new_empty((x.shape[0], first.shape[-1]))
        for where, y in pieces:
            if isinstance(where, int):
                out[where : where + y.shape[0]] = y
            else:
                out.index_copy_(0, where, y)
        return out[None]


def _is_state_layer(module: torch.nn.Module, layers: tuple[int, ...]) -> bool:
    return (
        isinstance(getattr(module, "conv1d", None), torch.nn.Conv1d)
        and (hasattr(module, "out_proj") or hasattr(module, "o_proj"))
        and getattr(module, "layer_idx", None) in layers
    )


def install_state_layers(model: Any) -> int:
    """Serve ``model``'s linear-attention / Mamba layers from kvtier's blocks; how many it has.

    Idempotent; a model without such layers is left as it is.
    """
    config = getattr(model.config, "text_config", None) or model.config
    spec = state_spec(lambda name: getattr(config, name, None))
    if spec is None:
        return 0
    found = [
        m
        for m in model.modules()
        if isinstance(m, _BlockStateLayer) or _is_state_layer(m, spec.layers)
    ]
    if len(found) != len(spec.layers):
        raise ConfigError(
            f"the config names {len(spec.layers)} linear-attention layers but the model has "
            f"{len(found)} modules kvtier recognises as such: it cannot serve this model"
        )
    first_column = 0
    if spec.beside_attention:
        # The layers' attention keeps its K/V in the first head_dim columns of each slot.
        first_column = geometry(lambda name: getattr(config, name, None))[3]
        for module in model.modules():
            if _is_attention(module) and module.layer_idx in spec.layers:
                module._kvtier_beside_state = True
    plan = _Plan(spec, first_column)
    for module in found:
        mix_in(module, _BlockStateLayer)
        module._kvtier_plan = plan
    for handle in getattr(model, "_kvtier_state_hooks", ()):
        handle.remove()
    model._kvtier_state_hooks = (
        model.register_forward_pre_hook(plan.enter, with_kwargs=True),
        model.register_forward_hook(plan.leave, with_kwargs=True, always_call=True),
    )
    return len(found)


def _is_attention(module: torch.nn.Module) -> bool:
    return (
        isinstance(getattr(module, "layer_idx", None), int)
        and hasattr(module, "k_proj")
        and hasattr(module, "v_proj")
    )


def check_exact_blocks(
    state: StateSpec | None, *, stored_dtype: str, model_dtype: str, lossy_tiers: bool
) -> None:
    """Refuse block storage or tiers that would round a hybrid model's recurrent states.

    A state is kept as raw bytes: a block cast to another dtype, or a tier
    that quantizes blocks, would turn it into garbage.
    """
    if state is None:
        return
    if stored_dtype != model_dtype:
        raise ConfigError(
            f"--kv-cache-dtype {stored_dtype} would round the recurrent states this model's "
            "linear-attention layers keep in the blocks: leave it at auto for this model"
        )
    if lossy_tiers:
        raise ConfigError(
            "a tier codec that quantizes blocks (int8, fp8) would round the recurrent states "
            "this model's linear-attention layers keep in the blocks: use the raw codec"
        )


register(LayerKind("state", install_state_layers))
