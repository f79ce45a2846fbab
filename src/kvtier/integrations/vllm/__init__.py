"""kvtier inside vLLM: eviction policies, the older manager API, and KV events.

* :mod:`.cache_policy`: :class:`KvTierCachePolicy`, a ``CachePolicy`` for
  vLLM 0.33's ``CPUOffloadingManager`` that lets any kvtier policy choose the
  victims (``eviction_policy: "kvtier:s3fifo"``,
  ``cache_policy_module_path: "kvtier.integrations.vllm.cache_policy"``);
* :mod:`.connector`: :class:`KvTierConnector`, vLLM 0.33's offloading
  connector whose scheduler side tells a request-aware kvtier policy about
  each request and its hints (sessions, TTL pins, session end, workflow
  steps), with predicted admission into the CPU tier
  (``"kv_connector": "KvTierConnector"``,
  ``"kv_connector_module_path": "kvtier.integrations.vllm.connector"``);
* :mod:`.spec`: :class:`KvTierOffloadingSpec`, vLLM's CPU offloading spec
  reading ``kvtier_policy`` / ``kvtier_admission`` from
  ``kv_connector_extra_config``;
* :mod:`.legacy`: :class:`LegacyOffloadingManager`, kvtier's offloading
  manager behind the ``OffloadingManager`` API of vLLM 0.12 - 0.16;
* :mod:`.events`: :class:`KvEventPublisher`, kvtier's KV events in vLLM's
  schema and ZeroMQ framing;
* :mod:`.version`: :func:`detect_vllm` / :func:`require_vllm`.

Importing this package never imports vLLM. The names that need it
(``KvTierCachePolicy``, ``cache_policy_class``, ``KvTierOffloadingSpec``,
``KvTierConnector``) load
on first use and raise :class:`UnsupportedVllmError` when vLLM is missing or
of a version without an adapter; ``KvEventPublisher`` needs pyzmq and msgspec
only. See docs/vllm.md.
"""

from __future__ import annotations

from kvtier._lazy import lazy_exports
from kvtier.integrations.errors import MissingDependencyError, UnsupportedVllmError
from kvtier.integrations.vllm.legacy import (
    LegacyBackend,
    LegacyOffloadingEvent,
    LegacyOffloadingManager,
    LegacyPrepareStoreOutput,
)
from kvtier.integrations.vllm.version import (
    CACHE_POLICY_API,
    MANAGER_API,
    TESTED_VLLM,
    VllmInfo,
    detect_vllm,
    require_vllm,
)

__all__ = [
    "CACHE_POLICY_API",
    "MANAGER_API",
    "TESTED_VLLM",
    "LegacyBackend",
    "LegacyOffloadingEvent",
    "LegacyOffloadingManager",
    "LegacyPrepareStoreOutput",
    "MissingDependencyError",
    "UnsupportedVllmError",
    "VllmInfo",
    "detect_vllm",
    "require_vllm",
]

#: Names whose modules import vLLM (or pyzmq and msgspec), loaded when first used
#: (kept out of ``__all__``, like kvtier's other lazy names).
_LAZY = {
    "KvTierCachePolicy": "kvtier.integrations.vllm.cache_policy",
    "cache_policy_class": "kvtier.integrations.vllm.cache_policy",
    "KvTierOffloadingSpec": "kvtier.integrations.vllm.spec",
    "KvEventPublisher": "kvtier.integrations.vllm.events",
    "KvTierConnector": "kvtier.integrations.vllm.connector",
}

__getattr__, __dir__ = lazy_exports("kvtier.integrations.vllm", globals(), _LAZY)
