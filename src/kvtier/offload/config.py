"""Tier configuration by size: what ``kvtier serve`` flags and engine users write.

A :class:`TierSpec` names a registered medium (:mod:`kvtier.offload.registry`),
where it is, how many bytes it may use, its codec, policy and write mode;
:meth:`TierSpec.build` turns it into a :class:`~kvtier.offload.chain.Tier`
once the block geometry is known (the engine knows it after loading the
model), sizing the tier in blocks of that codec's stored size. Tiers are
usually written as URLs (:meth:`TierSpec.from_url`):

* ``device:1GiB`` - compressed (int8 or fp8) blocks in the device's own memory,
  a tier above host memory (its codec defaults to int8);
* ``host:4GiB`` - host memory;
* ``disk:/var/cache/kvtier?size=100GiB&codec=int8`` - a directory;
* ``redis://10.0.0.5:6379/0`` (``rediss://``, ``unix://``) - a Redis server;
* ``redis+cluster://10.0.0.5:7000,10.0.0.6:7001`` - a Redis Cluster;
* ``NAME:LOCATION?...`` - any other registered medium; ``module=pkg.mod``
  imports an out-of-tree medium's module first.

Settings after ``?``: ``size`` (bytes with a unit; required for host and
device, 16GiB otherwise), ``codec`` (raw, int8, fp8), ``policy`` (any registered policy),
``write`` (``back`` or ``through``) and ``module``; anything else is the
medium's own option (``fsync`` for disk, ``ttl``, ``prefix`` and
``delete_on_evict`` for Redis).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl

import torch

from kvtier.errors import ConfigError
from kvtier.offload.codec import HEADER_SIZE, make_codec
from kvtier.offload.registry import (
    import_medium_module,
    make_medium,
    medium_for_scheme,
    probe_medium,
)
from kvtier.offload.tier import Tier
from kvtier.units import parse_memory_size

_TIER_SETTINGS = frozenset({"size", "codec", "policy", "write", "module"})
_DEFAULT_SIZE = 16 * 2**30
#: Media sized by the memory they take rather than a place: ``NAME:SIZE``.
_SIZED = ("host", "device")
#: Codecs a device tier may use: it exists to hold blocks smaller than the pool does.
DEVICE_CODECS = ("int8", "fp8")


@dataclass(frozen=True)
class TierSpec:
    """One tier by size (see the module docstring)."""

    #: A registered medium: ``host``, ``disk``, ``redis``, ``redis+cluster``, ...
    medium: str
    size_bytes: int
    codec: str = "raw"
    policy: str = "lru"
    #: Where the medium is: a directory, a Redis URL, or nothing (host memory).
    location: str = ""
    #: The medium's own options, ``(name, value)`` pairs.
    options: tuple[tuple[str, str], ...] = ()
    #: ``"write_back"``, ``"write_through"``, or ``None``: through for shared media.
    write_mode: str | None = None

    def __post_init__(self) -> None:
        # Built once and closed: an unknown medium, a missing directory or an
        # unknown option is an error here, not when the engine starts.
        make_medium(self.medium, self.location, dict(self.options)).close()
        if not isinstance(self.size_bytes, int) or self.size_bytes <= 0:
            raise ConfigError(f"the {self.medium} tier's size must be positive bytes")
        make_codec(self.codec)  # validates the name
        from kvtier.policy import make_policy

        make_policy(self.policy)  # a registered name or an import path
        object.__setattr__(self, "options", tuple((str(k), str(v)) for k, v in self.options))
        if self.medium == "device" and self.codec not in DEVICE_CODECS:
            raise ConfigError(
                f"the device tier holds compressed blocks: give it codec "
                f"{' or '.join(DEVICE_CODECS)}, not {self.codec!r}"
            )

    @classmethod
    def from_url(cls, url: str, *, policy: str = "lru") -> TierSpec:
        """A tier written as a URL (see the module docstring)."""
        base, _, query = url.strip().partition("?")
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
        except ValueError:
            raise ConfigError(f"tier {url!r}: cannot parse the settings after '?'") from None
        settings = {k: v for k, v in pairs if k in _TIER_SETTINGS}
        options = tuple((k, v) for k, v in pairs if k not in _TIER_SETTINGS)
        if "module" in settings:
            import_medium_module(settings["module"])
        write = settings.get("write")
        if write is not None and write not in ("back", "through"):
            raise ConfigError(f"tier {url!r}: write must be back or through, got {write!r}")
        scheme, sep, rest = base.partition("://")
        if sep:
            medium = medium_for_scheme(scheme)
            location = rest
            if medium in ("redis",):
                location = base  # redis-py takes the whole URL
            elif medium == "redis+cluster":
                # Any node of the cluster finds the others.
                location = "redis://" + rest.split(",")[0]
        else:
            scheme, sep, rest = base.partition(":")
            medium = medium_for_scheme(scheme) if sep else None
            location = rest
        if medium is None:
            raise ConfigError(
                f"tier {url!r} names no registered medium: write host:SIZE, "
                "disk:DIR[?size=...], redis://HOST:PORT/DB, redis+cluster://HOST:PORT,... "
                "or NAME:LOCATION?module=pkg.mod for an out-of-tree medium"
            )
        size = settings.get("size")
        if medium in _SIZED:
            if location and size:
                raise ConfigError(f"tier {url!r}: give the {medium} tier's size once")
            if not location and not size:
                raise ConfigError(
                    f"tier {url!r}: the {medium} tier needs a size, e.g. {medium}:4GiB"
                )
            size, location = location or size, ""
        elif medium == "disk" and not location:
            raise ConfigError(
                f"tier {url!r}: the disk tier needs a directory, e.g. disk:/var/cache/kvtier"
            )
        if medium == "disk":
            location = os.path.expanduser(location)
        return cls(
            medium,
            parse_memory_size(size) if size else _DEFAULT_SIZE,
            settings.get("codec", "int8" if medium == "device" else "raw"),
            settings.get("policy", policy),
            location=location,
            options=options,
            write_mode=None if write is None else f"write_{write}",
        )

    def describe(self) -> str:
        """The tier as a URL (the form ``from_url`` reads)."""
        if self.medium == "redis":
            where = self.location
        elif self.medium == "redis+cluster":
            where = "redis+cluster://" + self.location.removeprefix("redis://")
        elif self.medium in _SIZED:
            where = f"{self.medium}:"
        else:
            where = f"{self.medium}:{self.location}"
        parts = [f"size={self.size_bytes}", f"codec={self.codec}", f"policy={self.policy}"]
        if self.write_mode is not None:
            parts.append("write=" + self.write_mode.removeprefix("write_"))
        parts += [f"{k}={v}" for k, v in self.options]
        return f"{where}?{'&'.join(parts)}"

    def probe(self, timeout_s: float = 2.0) -> str | None:
        """Check the medium is usable now, before anything is loaded.

        Raises :class:`ConfigError` for what can never work (a disk directory
        that cannot be created or written); returns a warning for what may
        recover by itself (Redis not answering yet), ``None`` when all is well.
        """
        return probe_medium(self.medium, self.location, dict(self.options), timeout_s)

    def capacity_blocks(self, block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        blob = HEADER_SIZE + make_codec(self.codec).payload_size(block_shape, dtype)
        n = self.size_bytes // blob
        if n < 1:
            raise ConfigError(
                f"the {self.medium} tier's {self.size_bytes:,} bytes hold no block of "
                f"{blob:,} bytes: give it more room"
            )
        return n

    def build(
        self,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        device: str | torch.device = "cpu",
    ) -> Tier:
        """The tier for blocks of ``block_shape`` and ``dtype`` (``device``: the pool's).

        The ``device`` medium lives on the pool's device unless its location names one.
        """
        location = self.location
        if self.medium == "device" and not location:
            location = str(device)
        store = make_medium(self.medium, location, dict(self.options))
        cap = self.capacity_blocks(block_shape, dtype)
        return Tier(store, cap, policy=self.policy, codec=self.codec, write_mode=self.write_mode)


#: The built-in media's speed order (fastest first); other media may go anywhere.
_SPEED_ORDER = {"device": 0, "host": 1, "disk": 2, "redis": 3, "redis+cluster": 3}


def check_tier_order(specs: Sequence[TierSpec]) -> None:
    """ConfigError unless each medium is given once and the built-in ones go fastest first."""
    media = [s.medium for s in specs]
    if len(set(media)) != len(media):
        raise ConfigError(f"each medium may be given once; got tiers {', '.join(media)}")
    known = [m for m in media if m in _SPEED_ORDER]
    if known != sorted(known, key=_SPEED_ORDER.__getitem__):
        raise ConfigError(
            f"tiers must go fastest first (device, host, disk, redis); got {', '.join(media)}"
        )
