"""The encoder cache's configuration as data: what ``kvtier serve`` flags and engine users write."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.mm.cache import EncoderCache
from kvtier.offload.config import TierSpec

#: The encoder cache's default size.
DEFAULT_ENCODER_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class EncoderCacheSpec:
    """An :class:`~kvtier.mm.cache.EncoderCache` by size; ``size_bytes=0`` turns it off."""

    size_bytes: int = DEFAULT_ENCODER_CACHE_BYTES
    max_entries: int | None = None
    policy: str = "lru"
    #: Lower tiers, fastest first (``--encoder-cache-tier`` URLs).
    tiers: tuple[TierSpec, ...] = ()
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.size_bytes, int) or isinstance(self.size_bytes, bool) or (
            self.size_bytes < 0
        ):
            raise ConfigError(
                f"the encoder cache size must be bytes (0: off), got {self.size_bytes!r}"
            )
        if self.max_entries is not None and (
            not isinstance(self.max_entries, int) or self.max_entries < 1
        ):
            raise ConfigError(
                f"the encoder cache's entry limit must be positive, got {self.max_entries!r}"
            )
        from kvtier.policy import make_policy

        make_policy(self.policy)
        object.__setattr__(self, "tiers", tuple(self.tiers))
        for spec in self.tiers:
            if spec.codec != "raw":
                raise ConfigError(
                    f"encoder-cache tiers store outputs losslessly: drop codec={spec.codec} "
                    f"from the {spec.medium} tier"
                )

    @property
    def enabled(self) -> bool:
        return self.size_bytes > 0

    def build(self) -> EncoderCache | None:
        if not self.enabled:
            return None
        return EncoderCache(
            self.size_bytes,
            max_entries=self.max_entries,
            policy=self.policy,
            tiers=self.tiers,
            tenant_salt=self.tenant_salt,
        )
