"""Encoder outputs below the in-memory cache: any kvtier medium (host, disk, Redis, plug-ins).

An :class:`EncoderTier` keeps encoder outputs on one medium of
:mod:`kvtier.offload` under a byte budget, evicting with any registered
policy through the same size-aware protocol as every other cache level. Each
output is stored as one item with kvtier's block header (key, shape, dtype,
payload length, checksums), so a reader checks what it gets before using it:

* a blob whose checksum fails, that names another key (another model's
  output, since the key covers the model), or another dtype or shape than
  the reader expects is a **counted miss**: it is dropped and never served;
* a medium that cannot be reached (Redis down, disk gone) is a counted miss
  too, never an error for the request.

Media that outlive the process (disk) or that other processes write to
(Redis) are read even for keys this tier does not know: that is how a second
process, or a restarted one, hits on what another encoded. Such a key is
adopted into the budget when it is read. Files an earlier process left on a
disk tier that are never asked for again are not counted (the tier has no way
to know them without reading the whole directory); ``reset`` on the cache, or
deleting the directory, clears them.

Encoder outputs are stored raw (lossless): a quantizing codec would change
the features a model sees.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError, CorruptBlockError, OversizeError, TierUnavailableError
from kvtier.offload.codec import HEADER_DTYPES, HEADER_SIZE, BlockHeader, make_codec, verify
from kvtier.offload.config import TierSpec
from kvtier.offload.core import TierHealth, drop_items
from kvtier.offload.media import BlockStore, ItemFormat
from kvtier.offload.registry import make_medium
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.registry import make_policy

#: The medium namespace encoder outputs live under (KV blocks use their layout's).
NAMESPACE = "kvtier-encoder-outputs"
_U32 = 2**32


@dataclass(frozen=True)
class Expected:
    """What a reader expects of an output; ``None`` fields are not checked."""

    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None

    def check(self, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        """Why ``shape``/``dtype`` do not match, or ``None``."""
        if self.dtype is not None and dtype != self.dtype:
            return f"dtype {dtype}, expected {self.dtype}"
        if self.shape is not None and tuple(shape) != tuple(self.shape):
            return f"shape {list(shape)}, expected {list(self.shape)}"
        return None


def storable(tensor: torch.Tensor) -> bool:
    """Whether a medium can hold ``tensor`` under a block header (dtype, rank, dims)."""
    return (
        tensor.dtype in HEADER_DTYPES
        and 0 < tensor.dim() <= 6
        and all(0 <= d < _U32 for d in tensor.shape)
    )


class EncoderTier:
    """Encoder outputs on one medium under a byte budget (see the module docstring).

    Thread-safe: the bookkeeping is under a lock; reads go to the medium
    outside it.
    """

    def __init__(
        self,
        medium: BlockStore,
        capacity_bytes: int,
        *,
        policy: str | EvictionPolicy = "lru",
        typical_bytes: int | None = None,
        namespace: str = NAMESPACE,
    ) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(
                f"an encoder tier's size must be positive bytes, got {capacity_bytes!r}"
            )
        self.medium = medium
        self.name: str = medium.name
        self.capacity_bytes = capacity_bytes
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        typical = typical_bytes or max(capacity_bytes // 64, 1)
        self.policy.bind(capacity_bytes, min(typical, capacity_bytes))
        self._codec = make_codec("raw")
        medium.bind(namespace, max(capacity_bytes // min(typical, capacity_bytes), 1), None)
        #: Medium reads keys it does not know: another process may have written them.
        self._open_reads = medium.caps.shared or medium.caps.persistent
        self._lock = threading.Lock()
        #: Resident key -> the model it belongs to (``None``: adopted from another process).
        self._models: dict[int, str | None] = {}
        self.hits = 0
        self.misses = 0
        self.stores = 0
        self.stored_bytes = 0
        self.loaded_bytes = 0
        self.evictions = 0
        self.corrupt = 0
        self.mismatched = 0
        #: The one failure policy of every tier: counted, logged per outage.
        self.health = TierHealth(f"encoder-output {self.name}")
        self.unstorable = 0
        self.adopted = 0

    @classmethod
    def from_spec(cls, spec: TierSpec, *, typical_bytes: int | None = None) -> EncoderTier:
        """A tier from a :class:`~kvtier.offload.config.TierSpec` (a ``--tier``-style URL)."""
        if spec.codec != "raw":
            raise ConfigError(
                f"encoder-output tiers store outputs losslessly: drop codec={spec.codec} "
                f"from the {spec.medium} tier"
            )
        medium = make_medium(spec.medium, spec.location, dict(spec.options))
        return cls(medium, spec.size_bytes, policy=spec.policy, typical_bytes=typical_bytes)

    @classmethod
    def from_url(cls, url: str, *, policy: str = "lru") -> EncoderTier:
        return cls.from_spec(TierSpec.from_url(url, policy=policy))

    def __len__(self) -> int:
        return len(self.policy)

    @property
    def unavailable(self) -> int:
        """Calls that found the medium unreachable."""
        return self.health.unavailable

    @property
    def used_bytes(self) -> int:
        return self.policy.used

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    # -- reads -------------------------------------------------------------------------
    def load(
        self, key: int, model_id: str | None = None, expected: Expected | None = None
    ) -> torch.Tensor | None:
        """The output stored under ``key``, checked; ``None`` (counted) when absent or bad.

        ``model_id`` is recorded for a key another process stored, so
        :meth:`remove_model` finds it.
        """
        with self._lock:
            known = key in self.policy
            if not known and not self._open_reads:
                self.misses += 1
                return None
        try:
            stored = self.medium.get([(key, 0)])[0]
        except TierUnavailableError as exc:
            with self._lock:
                self.health.failed(exc)
                self.misses += 1
            return None
        if stored is None:
            with self._lock:
                self.misses += 1
                if known:
                    self._forget(key)  # the medium lost it (Redis evicted it, a file went)
            return None
        header, payload = stored
        try:
            head = BlockHeader.unpack(header)
            verify(header, payload, key, head.shape, head.dtype)
        except CorruptBlockError:
            self._drop_bad(key, known, mismatched=False)
            return None
        if expected is not None and expected.check(head.shape, head.dtype) is not None:
            self._drop_bad(key, known, mismatched=True)
            return None
        # A copy of its own: the medium's buffer may be shared, read-only or reused.
        tensor = self._codec.decode(payload, head.shape, head.dtype).clone()
        with self._lock:
            self.hits += 1
            self.loaded_bytes += int(payload.numel())
            if key in self.policy:
                self.policy.access(key)
            else:
                self._adopt(key, HEADER_SIZE + int(payload.numel()), model_id)
        return tensor

    def _drop_bad(self, key: int, known: bool, *, mismatched: bool) -> None:
        with self._lock:
            if mismatched:
                self.mismatched += 1
            else:
                self.corrupt += 1
            self.misses += 1
            if known:
                self._forget(key)
        self._delete([key], everywhere=True)

    def _adopt(self, key: int, size: int, model_id: str | None) -> None:
        """Track a key another process stored (under the lock); evicts for room."""
        try:
            victims = self.policy.evict_for(size)
        except OversizeError:
            return
        if victims is None:
            return
        self._evicted(victims)
        self.policy.insert(key, False, size)
        self._models[key] = model_id
        self.adopted += 1

    # -- writes ------------------------------------------------------------------------
    def store(self, key: int, tensor: torch.Tensor, model_id: str) -> bool:
        """Write ``tensor`` under ``key`` (evicting for room); whether it is stored."""
        if not storable(tensor):
            with self._lock:
                self.unstorable += 1
            return False
        cpu = tensor.detach().to("cpu").contiguous()
        fmt = ItemFormat(self._codec, tuple(cpu.shape), cpu.dtype)
        size = fmt.blob_size
        with self._lock:
            if key in self.policy:
                self.policy.access(key)
                return True
            if size > self.capacity_bytes:
                self.unstorable += 1
                return False
            if not self.policy.admit(key):
                return False
            victims = self.policy.evict_for(size)
            if victims is None:
                return False
            self._evicted(victims)
            try:
                self.medium.put([(key, 0, self._codec.encode(cpu), fmt)])
            except TierUnavailableError as exc:
                self.health.failed(exc)
                return False
            self.policy.insert(key, False, size)
            self._models[key] = model_id
            self.stores += 1
            self.stored_bytes += fmt.payload_size
        return True

    def _evicted(self, victims: list[int]) -> None:
        """Drop ``victims`` the policy chose (under the lock)."""
        if not victims:
            return
        self.evictions += len(victims)
        for key in victims:
            self._models.pop(key, None)
        self._delete(victims, everywhere=False)

    def _forget(self, key: int) -> None:
        self.policy.remove(key)
        self._models.pop(key, None)

    def _delete(self, keys: list[int], *, everywhere: bool) -> None:
        drop_items(self.medium, [(k, 0) for k in keys], self.health, everywhere=everywhere)

    # -- maintenance -------------------------------------------------------------------
    def remove_model(self, model_id: str | None) -> int:
        """Delete the outputs this tier stored for ``model_id`` (all when ``None``)."""
        with self._lock:
            keys = [k for k, m in self._models.items() if model_id is None or m == model_id]
            for key in keys:
                self._forget(key)
        self._delete(keys, everywhere=True)
        return len(keys)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "entries": len(self.policy),
                "used_bytes": self.policy.used,
                "capacity_bytes": self.capacity_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "stores": self.stores,
                "stored_bytes": self.stored_bytes,
                "loaded_bytes": self.loaded_bytes,
                "evictions": self.evictions,
                "corrupt": self.corrupt,
                "mismatched": self.mismatched,
                "unavailable": self.health.unavailable,
                "unstorable": self.unstorable,
                "adopted": self.adopted,
            }

    def close(self) -> None:
        self.medium.close()
