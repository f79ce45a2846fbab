"""kvtier: a KV-cache manager for LLM inference.

The public API: block keys (:class:`BlockHasher`, :class:`Namespace`), the
prefix index, the device block pool, eviction policies and the request-level
:class:`KVCacheManager`.
"""

from kvtier.block_table import BlockTable, blocks_needed
from kvtier.errors import (
    AdmissionRejectedError,
    BadRequestError,
    ConfigError,
    CorruptBlockError,
    DuplicateRequestError,
    InternalInvariantError,
    KvTierError,
    OutOfBlocksError,
    TierUnavailableError,
    UnknownRequestError,
)
from kvtier.index import IndexEntry, PrefixIndex, Tier
from kvtier.keys import HASH_ALGORITHMS, BlockHasher, Namespace
from kvtier.layout import KVLayout, cdiv
from kvtier.manager import Allocation, CacheStats, Extension, KVCacheManager, PressureEvent
from kvtier.policy import (
    EvictionPolicy,
    LRUPolicy,
    PolicyBase,
    available_policies,
    make_policy,
    register_policy,
)
from kvtier.pool import BlockPool

__version__ = "0.1.0"

__all__ = [
    "HASH_ALGORITHMS",
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
    "IndexEntry",
    "InternalInvariantError",
    "KVCacheManager",
    "KVLayout",
    "KvTierError",
    "LRUPolicy",
    "Namespace",
    "OutOfBlocksError",
    "PolicyBase",
    "PrefixIndex",
    "PressureEvent",
    "Tier",
    "TierUnavailableError",
    "UnknownRequestError",
    "__version__",
    "available_policies",
    "blocks_needed",
    "cdiv",
    "make_policy",
    "register_policy",
]
