"""SGLang's own host KV pools (HiCache L2), allocated on the CPU for storage-backend tests.

SGLang builds a host pool from the device pool's buffers; here the "device"
buffers are CPU tensors of the same shapes, which is all the host pool reads
from them at construction. The pools are SGLang's real classes, with their
own page layouts, ``alloc`` / ``free``, flat data pages and the buffer
metadata the zero-copy storage interface uses.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

# SGLang's model configs import torchvision at import time; without it (its PyPI
# wheels link CUDA) an import-only stand-in lets the pools import (see stubs/).
if importlib.util.find_spec("torchvision") is None:
    sys.path.append(str(Path(__file__).with_name("stubs")))

from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

CPU = torch.device("cpu")
#: The host memory the pools are booked against (they take a few KiB). SGLang
#: otherwise checks the machine's free memory less a reserve of several GiB,
#: which a busy test machine does not always have.
BUDGET = 64 << 20


def _ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_host_pool(
    page_size: int = 4,
    layout: str = "page_first",
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 8,
    device_tokens: int = 64,
    dtype: torch.dtype = torch.float16,
) -> Any:
    """An ``MHATokenToKVPoolHost`` four times the size of a ``device_tokens`` device pool."""
    k = tuple(torch.zeros(device_tokens + page_size, heads, head_dim, dtype=dtype)
              for _ in range(layers))
    v = tuple(torch.zeros_like(t) for t in k)
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=CPU,
    )
    with host_memory_budget_scope(BUDGET):
        return MHATokenToKVPoolHost(
            info, host_to_device_ratio=4.0, host_size=0, page_size=page_size, layout=layout,
            pin_memory=False, device="cpu", device_capacity_tokens=device_tokens,
            start_layer=0, end_layer=layers,
        )


def mla_host_pool(
    page_size: int = 4,
    layout: str = "page_first",
    *,
    layers: int = 2,
    kv_lora_rank: int = 16,
    rope_dim: int = 8,
    device_tokens: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """An ``MLATokenToKVPoolHost`` (one latent row per token and layer)."""
    dim = kv_lora_rank + rope_dim
    bufs = tuple(torch.zeros(device_tokens + page_size, 1, dim, dtype=dtype)
                 for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(layers)),
        device_layer_num=layers, page_size=page_size, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim, kv_cache_dim=dim, dtype=dtype, device=CPU,
    )
    with host_memory_budget_scope(BUDGET):
        return MLATokenToKVPoolHost(
            info, host_to_device_ratio=4.0, host_size=0, page_size=page_size, layout=layout,
            pin_memory=False, device="cpu", device_capacity_tokens=device_tokens,
            start_layer=0, end_layer=layers, target_layer_num=layers,
        )
