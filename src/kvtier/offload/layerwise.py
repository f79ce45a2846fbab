"""Tier loads that land layer by layer while the forward pass that needs them starts.

The host tier's payloads are the serving process's own memory, stored raw and
unchecked, so everything a load can check (the headers) is checked before
the first byte moves; the copies then go to the storage as a
:class:`~kvtier.storage.fill.LayerFill` (:meth:`KVBlockStorage.begin_fill
<kvtier.storage.device.KVBlockStorage.begin_fill>`), one per layer per run of
payloads back to back in the medium, and the pass's layer ``l`` waits for
layer ``l`` only. The tier chain takes this path for every batch it can
(``TierChain(layer_loads=True)``) and :func:`~kvtier.offload.promote.install`
for the rest.
"""

from __future__ import annotations

import torch

from kvtier.offload.codec import RawCodec
from kvtier.offload.promote import Installed, LoadBatch, count_stop, leading_unchecked
from kvtier.offload.tier import Tier
from kvtier.offload.transfer import follows, place, span
from kvtier.storage import KVBlockStorage
from kvtier.storage.fill import Copy


def fill_layerwise(storage: KVBlockStorage, tier: Tier, batch: LoadBatch) -> Installed | None:
    """The batch's raw payloads an in-process medium stored unchecked, landing layer by
    layer (see the module docstring); ``None`` when the batch or the storage is not of that
    kind (:func:`~kvtier.offload.promote.install` takes it then).

    Counts on ``tier.counters`` as ``install`` does; ``Installed.filled`` says
    whether copies are in flight.
    """
    fmt = tier.fmt
    assert fmt is not None
    size = fmt.payload_size
    stored = batch.stored
    if (
        not isinstance(stored, list)
        or not tier.medium.caps.in_process
        or not storage.fillable
        or fmt.codec.codec_id != RawCodec.codec_id
        or size != storage.bytes_per_block
    ):
        return None
    blocks = batch.blocks
    leading = leading_unchecked(batch.keys, stored, fmt)
    if leading.other:
        return None  # a checked or encoded item: not this path's
    srcs, stop = leading.payloads, leading.stop
    c = tier.counters
    if srcs:
        layers = storage.layout.num_layers
        width = size // layers  # a block holds each layer's K and V in turn
        target = storage.fill_target()
        copies: list[list[Copy]] = [[] for _ in range(layers)]
        where = [place(p) for p in srcs]
        start = 0
        # One copy per layer per run of payloads back to back in the medium: into a run
        # of consecutive device blocks as it is, into scattered ones row by row.
        for i in range(1, len(srcs) + 1):
            if i < len(srcs) and follows(where[i - 1], where[i]):
                continue
            n = i - start
            src = span(srcs, start, n).view(n, size)
            run = blocks[start:i]
            rows: torch.Tensor | None = None
            if run == list(range(run[0], run[0] + n)):
                dst = target[run[0] : run[0] + n]
            else:
                dst = target
                rows = torch.tensor(run, dtype=torch.int64).to(storage.device)
            for layer in range(layers):
                cut = slice(layer * width, (layer + 1) * width)
                copies[layer].append((dst[:, cut], src[:, cut], rows))
            start = i
        storage.begin_fill(copies)
        c.loaded_blocks += len(srcs)
        c.loaded_bytes += len(srcs) * size
    if stop is not None:
        count_stop(c, stop)
        stop.filled = bool(srcs)
        return stop
    return Installed(len(srcs), filled=bool(srcs))
