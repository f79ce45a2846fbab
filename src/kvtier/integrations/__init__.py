"""Adapters that plug kvtier into other inference engines.

* :mod:`kvtier.integrations.vllm`: vLLM's CPU offloading (a ``CachePolicy``
  driven by any kvtier policy), the older ``OffloadingManager`` protocol, and
  KV events in vLLM's wire format.

Nothing here imports an engine until an adapter is used, so importing the
package never fails on a machine without that engine.
"""

from kvtier.integrations.errors import (
    IntegrationError,
    MissingDependencyError,
    UnsupportedVllmError,
)

__all__ = ["IntegrationError", "MissingDependencyError", "UnsupportedVllmError"]
