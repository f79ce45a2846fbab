"""kvtier's media as the storage layer (L3) of SGLang's hierarchical cache.

SGLang's HiCache keeps KV pages on the GPU (L1) and in a host pool (L2),
and backs host pages up to a ``HiCacheStorage`` (L3), which it loads by
module path. :class:`KvTierHiCacheStorage` is that storage over any kvtier
medium, its size bounded by a kvtier policy::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang.storage",
        "class_name": "KvTierHiCacheStorage", "interface_v1": 1,
        "tier": "disk:/var/cache/kvtier?size=200GiB&policy=s3fifo"}'

``tier`` is a kvtier tier URL (:meth:`kvtier.offload.TierSpec.from_url`):
``disk:DIR``, ``redis://HOST:PORT/DB``, ``redis+cluster://...``, ``host:SIZE``
or a plug-in medium, with ``size``, ``policy`` and ``codec`` (``raw`` keeps
every byte; ``int8`` / ``fp8`` store a 16-bit KV cache in about half the
space, lossy). ``interface_v1: 1`` selects the zero-copy batch calls
(``batch_get_v1`` / ``batch_set_v1``), which read and write the host pool's
pages in place through the pool's own buffer metadata; without it SGLang
uses ``batch_get`` / ``batch_set`` on flat page copies, also served here.

Pages are named by SGLang's page hashes (a chain over the token prefix), in
a namespace of the model name, the parallel shard (TP rank and size, unless
the model's KV is replicated as with MLA; pipeline and context-parallel
ranks) and the page's byte format (host-pool layout, dtype, page size,
segment sizes, the batch interface), so engines share exactly the pages they
can use. ``batch_exists`` returns the leading run of stored pages, asking a
shared medium (Redis) about pages other engines stored; a disk tier is
scanned at start, so a restarted engine finds its pages again. Every page
is stored with kvtier's header and checksums and checked before a byte of
it reaches the host pool: a damaged or vanished page reads as a failure
(SGLang then recomputes from there) and is dropped.

Importing this module needs the tested SGLang release (see :mod:`.version`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.integrations.flat import FlatPages, key_id
from kvtier.integrations.sglang.version import require_sglang
from kvtier.integrations.sync_tier import SyncTier
from kvtier.offload.config import TierSpec
from kvtier.offload.media import PutItem, Stored

SGLANG = require_sglang()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
)

log = logging.getLogger("kvtier.sglang")

#: The module path and class name to give SGLang in the extra config.
MODULE_PATH = __name__
CLASS_NAME = "KvTierHiCacheStorage"
#: Extra-config keys SGLang itself reads (passed through, not ours to check).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
#: Extra-config keys this backend reads.
OWN_KEYS = ("tier", "retry_interval_s")


@lru_cache(maxsize=64)
def _byte_array(size: int) -> Any:
    return ctypes.c_uint8 * size


def _view(ptr: int, size: int) -> torch.Tensor:
    """``size`` bytes of host memory at ``ptr`` as a uint8 tensor, without a copy."""
    return torch.frombuffer(_byte_array(size).from_address(ptr), dtype=torch.uint8)


def storage_namespace(config: Any, page_format: dict[str, Any]) -> str:
    """This shard's namespace: the model, the parallel shard, and the page's byte format."""
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", config.model_name or "model").strip("-")
    shard: dict[str, Any] = {
        "pp": [config.pp_rank, config.pp_size],
        "cp": [config.attn_cp_rank, config.attn_cp_size],
        "dcp": [config.dcp_rank, config.dcp_size],
        "mla": bool(config.is_mla_model),
    }
    if not config.is_mla_model:  # MLA's KV is the same on every TP rank
        shard["tp"] = [config.tp_rank, config.tp_size]
    fields = json.dumps({"shard": shard, "page": page_format}, sort_keys=True)
    digest = hashlib.sha256(fields.encode()).hexdigest()[:16]
    tp = "" if config.is_mla_model else f"-tp{config.tp_rank}of{config.tp_size}"
    return f"sglang-{model[:64]}{tp}-{digest}"


class KvTierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` over a kvtier tier (see the module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise ConfigError(
                f"{CLASS_NAME} takes SGLang's HiCacheStorageConfig, got "
                f"{type(storage_config).__name__}"
            )
        extra = dict(storage_config.extra_config or {})
        url = extra.get("tier")
        if not isinstance(url, str) or not url:
            raise ConfigError(
                f"{CLASS_NAME} needs a kvtier tier URL as \"tier\" in "
                "--hicache-storage-backend-extra-config, e.g. "
                '"tier": "disk:/var/cache/kvtier?size=100GiB"'
            )
        spec = TierSpec.from_url(url)
        if spec.write_mode is not None:
            raise ConfigError(f"tier {url!r}: SGLang decides what to write; drop write=")
        retry = extra.get("retry_interval_s", 1.0)
        if not isinstance(retry, int | float) or isinstance(retry, bool) or retry < 0:
            raise ConfigError(f"retry_interval_s must be >= 0 seconds, got {retry!r}")
        self.storage_config = storage_config
        self.spec = spec
        self.retry_interval_s = float(retry)
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self.tier: SyncTier | None = None
        self.pages: FlatPages | None = None
        self._segments_per_page = 0

    # -- binding to the host pool --------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Called by SGLang with its host KV pool: fixes the page geometry and binds the medium."""
        super().register_mem_pool_host(mem_pool_host)
        page_size = int(mem_pool_host.page_size)
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page_size))
        sizes = [int(s) for s in sizes]
        if not sizes:
            raise ConfigError(f"{CLASS_NAME}: the host pool {type(mem_pool_host).__name__} "
                              "exposes no page buffers")
        self._segments_per_page = len(ptrs)
        nbytes = sum(sizes)
        dtype = mem_pool_host.dtype
        self.pages = FlatPages.make(nbytes, self.spec.codec, dtype)
        page_format = {
            "pool": type(mem_pool_host).__name__,
            "layout": str(mem_pool_host.layout),
            "dtype": str(dtype),
            "page_size": page_size,
            "segments": sizes,
            "interface": "v1" if self.interface_v1 else "flat",
        }
        self.namespace = storage_namespace(self.storage_config, page_format)
        if self.tier is not None:
            self.tier.close()
        self.tier = SyncTier(
            self.spec,
            self.namespace,
            self.spec.size_bytes // self.pages.blob_size,
            self.pages.format.payload_size,
            retry_interval_s=self.retry_interval_s,
        )
        log.info("kvtier HiCache storage: %s, %d pages of %d bytes, namespace %s",
                 self.spec.describe(), self.tier.capacity, nbytes, self.namespace)

    def _ready(self) -> tuple[SyncTier, FlatPages]:
        if self.tier is None or self.pages is None:
            raise ConfigError(
                f"{CLASS_NAME} is used before SGLang registered its host pool "
                "(register_mem_pool_host)"
            )
        return self.tier, self.pages

    def _page_segments(self, host_indices: torch.Tensor, n_pages: int) -> list[list[torch.Tensor]]:
        """Each page's buffers in the host pool, in place."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = self._segments_per_page
        if len(ptrs) != n_pages * per:
            raise ConfigError(
                f"{CLASS_NAME}: {n_pages} keys but {len(ptrs)} host buffers "
                f"({per} per page expected)"
            )
        views = [_view(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]
        return [views[i * per : (i + 1) * per] for i in range(n_pages)]

    # -- existence -------------------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        tier, _ = self._ready()
        return tier.present([key_id(k) for k in keys])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy batch interface (interface_v1) -------------------------------------------
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        tier, pages = self._ready()
        if not keys:
            return []
        segments = self._page_segments(host_indices, len(keys))
        ids = [key_id(k) for k in keys]
        scratch = torch.empty(pages.nbytes, dtype=torch.uint8)

        def fill(i: int, stored: Stored) -> None:
            pages.decode_into(stored, ids[i], scratch)  # checked before the pool sees it
            offset = 0
            for seg in segments[i]:
                n = int(seg.numel())
                seg.copy_(scratch[offset : offset + n])
                offset += n

        return tier.read(ids, fill)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        tier, pages = self._ready()
        if not keys:
            return []
        segments = self._page_segments(host_indices, len(keys))
        ids = [key_id(k) for k in keys]
        fmt = pages.format

        def item(i: int) -> PutItem:
            page = torch.cat(segments[i]) if len(segments[i]) > 1 else segments[i][0].clone()
            return ids[i], 0, pages.encode(page), fmt

        return tier.write(ids, item)

    # -- flat page copies (without interface_v1) ----------------------------------------------
    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        tier, pages = self._ready()
        if not keys:
            return []
        targets: Sequence[torch.Tensor] = target_locations or [
            self.mem_pool_host.get_dummy_flat_data_page() for _ in keys
        ]
        ids = [key_id(k) for k in keys]

        def fill(i: int, stored: Stored) -> None:
            pages.decode_into(stored, ids[i], targets[i].view(-1).view(torch.uint8))

        ok = tier.read(ids, fill)
        return [t if fine else None for t, fine in zip(targets, ok, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        tier, pages = self._ready()
        if not keys:
            return True
        ids = [key_id(k) for k in keys]
        fmt = pages.format

        def item(i: int) -> PutItem:
            flat = values[i].contiguous().view(-1).view(torch.uint8)
            return ids[i], 0, pages.encode(flat), fmt

        return all(tier.write(ids, item))

    # -- the rest ---------------------------------------------------------------------------------
    def clear(self) -> None:
        """Drop every page this engine's namespace holds (from a shared medium too)."""
        tier, _ = self._ready()
        tier.clear()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
            self.tier = None
