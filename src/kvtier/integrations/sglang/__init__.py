"""kvtier inside SGLang: a storage backend for its hierarchical cache (HiCache L3).

* :mod:`.storage`: :class:`KvTierHiCacheStorage`, a ``HiCacheStorage`` over
  any kvtier medium (disk, Redis, Redis Cluster, host memory, plug-ins),
  loaded with ``--hicache-storage-backend dynamic``;
* :mod:`.version`: the SGLang release it is tested against
  (:data:`TESTED_SGLANG`) and :func:`require_sglang`.

Importing this package never imports SGLang; ``KvTierHiCacheStorage`` loads
on first use and raises :class:`UnsupportedReleaseError` when SGLang is
missing or of another release. See docs/sglang.md.
"""

from __future__ import annotations

from kvtier._lazy import lazy_exports
from kvtier.integrations.errors import UnsupportedReleaseError
from kvtier.integrations.sglang.version import TESTED_SGLANG, require_sglang

__all__ = ["TESTED_SGLANG", "UnsupportedReleaseError", "require_sglang"]

_LAZY = {"KvTierHiCacheStorage": "kvtier.integrations.sglang.storage"}

__getattr__, __dir__ = lazy_exports("kvtier.integrations.sglang", globals(), _LAZY)
