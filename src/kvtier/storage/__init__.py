"""Tensor storage for KV blocks: the K and V payloads behind the manager's block ids.

The bookkeeping side of kvtier (:class:`~kvtier.KVCacheManager`, the block
pool) holds no tensors. This package holds them: :class:`KVBlockStorage`
keeps every layer's keys and values for a fixed number of blocks on one
device, writes a forward pass's K/V at the slots of a block table, reads a
request's K/V back through its block table, copies blocks for
copy-on-write, and exports and imports whole blocks for offload tiers.
:mod:`kvtier.storage.quant` holds blocks in fewer bytes than the model
computes in: a narrower float dtype, or int8 / float8 with per-head scales.

This package needs PyTorch (the ``torch`` extra); ``import kvtier`` alone
does not import it.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "kvtier.storage needs PyTorch, which is not installed: install the CPU build "
        "with `pip install torch==2.13.0` (or a CUDA build for GPUs), then "
        "`pip install 'kvtier[torch]'`"
    ) from exc

from kvtier.storage.device import (
    DEFAULT_LAYOUT_KIND,
    LAYOUT_KINDS,
    KVBlockStorage,
    LayoutKind,
    torch_dtype,
)
from kvtier.storage.quant import CastKVBlockStorage, QuantizedKVBlockStorage, make_storage

__all__ = [
    "DEFAULT_LAYOUT_KIND",
    "LAYOUT_KINDS",
    "CastKVBlockStorage",
    "KVBlockStorage",
    "LayoutKind",
    "QuantizedKVBlockStorage",
    "make_storage",
    "torch_dtype",
]
