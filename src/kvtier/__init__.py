"""kvtier: a KV-cache manager for LLM inference.

The public API: block keys (:class:`BlockHasher`, :class:`Namespace`), the
device block pool, eviction and admission policies, the
request-level :class:`KVCacheManager`, memory-pressure control
(:mod:`kvtier.pressure`), trace replay (:mod:`kvtier.replay`), and one
manager over several devices' pools (:mod:`kvtier.placement`).

The parts that need PyTorch and transformers load on first use, so ``import
kvtier`` stays light: ``kvtier.KVBlockStorage`` (:mod:`kvtier.storage`),
``kvtier.KvTierCache``, ``kvtier.Engine``, ``kvtier.EngineWorker``,
``kvtier.SamplingParams`` (:mod:`kvtier.engine`) and ``kvtier.create_app``
(:mod:`kvtier.server`).
"""

from kvtier._lazy import lazy_exports
from kvtier.block_table import BlockTable, blocks_needed
from kvtier.errors import (
    AdmissionRejectedError,
    BadRequestError,
    ConfigError,
    CorruptBlockError,
    DuplicateRequestError,
    InternalInvariantError,
    KvTierError,
    MigrationError,
    MonitorUnavailableError,
    OutOfBlocksError,
    OversizeError,
    TierUnavailableError,
    UnknownRequestError,
)
from kvtier.integrations.errors import (
    IntegrationError,
    MissingDependencyError,
    UnsupportedVllmError,
)
from kvtier.keys import HASH_ALGORITHMS, KEY_FORMAT_VERSION, BlockHasher, Namespace
from kvtier.layout import KV_CACHE_DTYPES, KVLayout, cache_layout, cdiv
from kvtier.manager import Allocation, CacheStats, Extension, KVCacheManager, PressureEvent
from kvtier.offload import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from kvtier.placement import DevicePool, Growth, Move, MultiDeviceManager, Placement
from kvtier.policy import (
    AdmissionFilter,
    Admitted,
    ARCPolicy,
    EvictionPolicy,
    FIFOPolicy,
    GDSFPolicy,
    HybridPolicy,
    LFUPolicy,
    LRUPolicy,
    PolicyBase,
    S3FIFOPolicy,
    SIEVEPolicy,
    TinyLFUAdmission,
    available_policies,
    make_admission,
    make_policy,
    register_policy,
)
from kvtier.pool import BlockPool
from kvtier.pressure import (
    HostMemoryMonitor,
    Ladder,
    MemoryMonitor,
    MemoryReading,
    Mode,
    ModeActions,
    ModeChange,
    PoolMonitor,
    PressureController,
    PressureSpec,
    ScriptedMonitor,
    detect_monitor,
    make_monitor,
)
from kvtier.replay import (
    Capacity,
    ClusterConfig,
    Trace,
    TraceRequest,
    belady_min,
    load_sample_trace,
    load_trace,
    parse_capacity,
    simulate,
    simulate_cluster,
)

__version__ = "0.1.0"

__all__ = [
    "HASH_ALGORITHMS",
    "KEY_FORMAT_VERSION",
    "ARCPolicy",
    "AdmissionFilter",
    "Admitted",
    "Capacity",
    "FIFOPolicy",
    "GDSFPolicy",
    "HybridPolicy",
    "LFUPolicy",
    "S3FIFOPolicy",
    "SIEVEPolicy",
    "TinyLFUAdmission",
    "Trace",
    "TraceRequest",
    "belady_min",
    "load_sample_trace",
    "load_trace",
    "make_admission",
    "parse_capacity",
    "simulate",
    "ClusterConfig",
    "simulate_cluster",
    "DevicePool",
    "Growth",
    "MigrationError",
    "Move",
    "MultiDeviceManager",
    "Placement",
    "AdmissionRejectedError",
    "Allocation",
    "BadRequestError",
    "BlockHasher",
    "BlockPool",
    "BlockTable",
    "CacheStats",
    "ConfigError",
    "CorruptBlockError",
    "DuplicateRequestError",
    "EvictionPolicy",
    "Extension",
    "InternalInvariantError",
    "KVCacheManager",
    "KVLayout",
    "KV_CACHE_DTYPES",
    "cache_layout",
    "KvTierError",
    "LRUPolicy",
    "Namespace",
    "OutOfBlocksError",
    "OversizeError",
    "PolicyBase",
    "PressureEvent",
    "HostMemoryMonitor",
    "Ladder",
    "MemoryMonitor",
    "MemoryReading",
    "Mode",
    "ModeActions",
    "ModeChange",
    "MonitorUnavailableError",
    "PoolMonitor",
    "PressureController",
    "PressureSpec",
    "ScriptedMonitor",
    "detect_monitor",
    "make_monitor",
    "IntegrationError",
    "MissingDependencyError",
    "UnsupportedVllmError",
    "TierUnavailableError",
    "UnknownRequestError",
    "__version__",
    "available_policies",
    "blocks_needed",
    "cdiv",
    "make_policy",
    "register_policy",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
]

#: Re-exports that import torch (and transformers, fastapi) when first used.
_LAZY = {
    "KVBlockStorage": "kvtier.storage",
    "QuantizedKVBlockStorage": "kvtier.storage",
    "CastKVBlockStorage": "kvtier.storage",
    "make_storage": "kvtier.storage",
    "DeviceStore": "kvtier.offload.device_tier",
    "CompressionResult": "kvtier.offload.chain",
    "KvTierCache": "kvtier.engine",
    "Engine": "kvtier.engine",
    "EngineWorker": "kvtier.engine",
    "SamplingParams": "kvtier.engine",
    "migrate": "kvtier.engine.migrate",
    "migrate_between": "kvtier.engine.migrate",
    "create_app": "kvtier.server",
    "Tier": "kvtier.offload.chain",
    "TierChain": "kvtier.offload.chain",
    "SwappedRequest": "kvtier.offload.chain",
    "TierSpec": "kvtier.offload.config",
    "HostStore": "kvtier.offload.host",
    "DiskStore": "kvtier.offload.disk",
    "RedisStore": "kvtier.offload.redis_store",
    "TransferEngine": "kvtier.offload.transfer",
    "register_medium": "kvtier.offload.registry",
    "available_media": "kvtier.offload.registry",
    "detect_vllm": "kvtier.integrations.vllm.version",
    "LegacyOffloadingManager": "kvtier.integrations.vllm.legacy",
    "KvEventPublisher": "kvtier.integrations.vllm.events",
    "KvtierCachePolicy": "kvtier.integrations.vllm.cache_policy",
}

__getattr__, __dir__ = lazy_exports("kvtier", globals(), _LAZY)
