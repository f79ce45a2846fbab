"""vLLM's CPU offloading spec with the kvtier policy named in ``kv_connector_extra_config``.

vLLM 0.33's ``CPUOffloadingSpec`` reads ``eviction_policy`` and
``cache_policy_module_path`` from ``kv_connector_extra_config`` and never
passes the rest of that dict to the policy. :class:`KvTierOffloadingSpec`
is that spec, reading two more keys and pointing vLLM at
:mod:`kvtier.integrations.vllm.cache_policy`:

* ``kvtier_policy``: a kvtier policy name (``lru``, ``arc``, ``s3fifo``, ...)
  or import path; default ``lru``;
* ``kvtier_admission``: an admission filter (``tinylfu``), or absent.

Select it with ``"spec_name": "KvTierOffloadingSpec"`` and
``"spec_module_path": "kvtier.integrations.vllm.spec"``; every other key
(``cpu_bytes_to_use``, ``block_size``, ``store_threshold``, ...) means what it
means to ``CPUOffloadingSpec``. Importing this module needs vLLM 0.33.
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.cache_policy import (
    MODULE_PATH,
    cache_policy_class,
    policy_class_name,
)

# isort: split
# Imported after cache_policy, which raises UnsupportedVllmError without vLLM 0.33.
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

#: ``kv_connector_extra_config`` keys this spec reads, with their defaults.
EXTRA_CONFIG_KEYS: dict[str, Any] = {"kvtier_policy": "lru", "kvtier_admission": None}


class KvTierOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """``CPUOffloadingSpec`` whose cache policy is the kvtier policy the config names."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        extra = self.extra_config
        policy = extra.get("kvtier_policy", EXTRA_CONFIG_KEYS["kvtier_policy"])
        admission = extra.get("kvtier_admission", EXTRA_CONFIG_KEYS["kvtier_admission"])
        if not isinstance(policy, str) or not policy:
            raise ConfigError(f"kvtier_policy must be a policy name, got {policy!r}")
        if admission is not None and not isinstance(admission, str):
            raise ConfigError(
                f"kvtier_admission must be a name such as 'tinylfu', got {admission!r}"
            )
        cache_policy_class(policy, admission)  # unknown names fail here, at startup
        self.kvtier_policy: str = policy
        self.kvtier_admission: str | None = admission
        self.eviction_policy = policy_class_name(policy, admission)
        self.cache_policy_module_path = MODULE_PATH
