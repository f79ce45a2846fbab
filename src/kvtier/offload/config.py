"""Tier configuration by size: what ``kvtier serve`` flags and engine users write.

A :class:`TierSpec` names a medium, how many bytes it may use, its codec
and policy; :meth:`TierSpec.build` turns it into a :class:`~kvtier.offload.chain.Tier`
once the block geometry is known (the engine knows it after loading the
model), sizing the tier in blocks of that codec's stored size.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.errors import ConfigError, TierUnavailableError
from kvtier.offload.chain import Tier
from kvtier.offload.codec import HEADER_SIZE, make_codec
from kvtier.offload.media import BlockStore

MEDIA = ("host", "disk", "redis", "device")
#: Codecs a device tier may use: it exists to hold blocks smaller than the pool does.
DEVICE_CODECS = ("int8", "fp8")


@dataclass(frozen=True)
class TierSpec:
    """One tier by size (see the module docstring)."""

    medium: str
    size_bytes: int
    codec: str = "raw"
    policy: str = "lru"
    #: Directory of the disk tier.
    path: str | None = None
    #: URL of the Redis tier (any node's URL for a cluster).
    url: str | None = None
    cluster: bool = False
    #: ``"write_back"``, ``"write_through"``, or ``None``: through for Redis, back otherwise.
    write_mode: str | None = None

    def __post_init__(self) -> None:
        if self.medium not in MEDIA:
            raise ConfigError(f"tier medium must be one of {', '.join(MEDIA)}, got {self.medium!r}")
        if not isinstance(self.size_bytes, int) or self.size_bytes <= 0:
            raise ConfigError(f"the {self.medium} tier's size must be positive bytes")
        make_codec(self.codec)  # validates the name
        from kvtier.policy import make_policy

        make_policy(self.policy)  # a registered name or an import path
        if self.medium == "disk" and not self.path:
            raise ConfigError("the disk tier needs a directory (path)")
        if self.medium == "redis" and not self.url:
            raise ConfigError("the Redis tier needs a URL such as redis://127.0.0.1:6379/0")
        if self.medium == "device" and self.codec not in DEVICE_CODECS:
            raise ConfigError(
                f"the device tier holds compressed blocks: give it codec "
                f"{' or '.join(DEVICE_CODECS)}, not {self.codec!r}"
            )

    @classmethod
    def from_url(cls, url: str, *, policy: str = "lru") -> TierSpec:
        """A tier written as a URL, as ``kvtier serve --tier`` takes it.

        ``host:4GiB`` (or ``host:?size=4GiB``), ``disk:/var/cache/kvtier?size=100GiB&codec=int8``,
        ``redis://host:6379/0?size=16GiB``, ``redis+cluster://a:7000,b:7001``,
        ``device:1GiB?codec=int8`` (compressed blocks in the device's own memory,
        above host memory). Query settings: ``size`` (bytes with a unit; required
        for host and device, 16GiB otherwise), ``codec`` (raw, int8, fp8; the
        device tier's is int8 unless fp8 is given), ``policy`` (any registered
        policy), ``write`` (``back`` or ``through``).
        """
        from urllib.parse import parse_qsl

        from kvtier.units import parse_memory_size

        text = url.strip()
        base, _, query = text.partition("?")
        try:
            settings = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
        except ValueError:
            raise ConfigError(f"tier {url!r}: cannot parse the settings after '?'") from None
        unknown = set(settings) - {"size", "codec", "policy", "write"}
        if unknown:
            raise ConfigError(
                f"tier {url!r}: unknown setting(s) {', '.join(sorted(unknown))}; "
                "use size, codec, policy, write"
            )
        write = settings.get("write")
        if write is not None and write not in ("back", "through"):
            raise ConfigError(f"tier {url!r}: write must be back or through, got {write!r}")
        medium_name = base.partition(":")[0]
        codec = settings.get("codec", "int8" if medium_name == "device" else "raw")
        policy = settings.get("policy", policy)
        write_mode = None if write is None else f"write_{write}"
        size = settings.get("size")
        default_size = 16 * 2**30
        if base.startswith(("redis://", "rediss://", "unix://", "redis+cluster://")):
            cluster = base.startswith("redis+cluster://")
            target = base
            if cluster:
                # Any node of the cluster finds the others.
                target = "redis://" + base.removeprefix("redis+cluster://").split(",")[0]
            return cls(
                "redis",
                parse_memory_size(size) if size else default_size,
                codec,
                policy,
                url=target,
                cluster=cluster,
                write_mode=write_mode,
            )
        medium, sep, rest = base.partition(":")
        if not sep or medium not in ("host", "disk", "device"):
            raise ConfigError(
                f"tier {url!r} names no medium: write host:SIZE, device:SIZE, "
                "disk:DIR[?size=...], redis://HOST:PORT/DB or redis+cluster://HOST:PORT,..."
            )
        if medium in ("host", "device"):
            if rest and size:
                raise ConfigError(f"tier {url!r}: give the {medium} tier's size once")
            if not rest and not size:
                raise ConfigError(
                    f"tier {url!r}: the {medium} tier needs a size, e.g. {medium}:4GiB"
                )
            nbytes = parse_memory_size(rest or size or "")
            return cls(medium, nbytes, codec, policy, write_mode=write_mode)
        if not rest:
            raise ConfigError(
                f"tier {url!r}: the disk tier needs a directory, e.g. disk:/var/cache/kvtier"
            )
        return cls(
            "disk",
            parse_memory_size(size) if size else default_size,
            codec,
            policy,
            path=os.path.expanduser(rest),
            write_mode=write_mode,
        )

    def describe(self) -> str:
        """The tier as a URL (the form ``from_url`` reads)."""
        where = {
            "host": "host:",
            "device": "device:",
            "disk": f"disk:{self.path}",
            "redis": f"redis+cluster://{(self.url or '').removeprefix('redis://')}"
            if self.cluster
            else str(self.url),
        }[self.medium]
        parts = [f"size={self.size_bytes}", f"codec={self.codec}", f"policy={self.policy}"]
        if self.write_mode is not None:
            parts.append("write=" + self.write_mode.removeprefix("write_"))
        return f"{where}?{'&'.join(parts)}"

    def probe(self, timeout_s: float = 2.0) -> str | None:
        """Check the medium is usable now, before anything is loaded.

        Raises :class:`ConfigError` for what can never work (a disk directory
        that cannot be created or written); returns a warning for what may
        recover by itself (Redis not answering yet), ``None`` when all is well.
        """
        if self.medium == "disk":

            assert self.path is not None
            root = Path(self.path)
            try:
                root.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=root, prefix=".kvtier-probe-"):
                    pass
            except OSError as exc:
                raise ConfigError(
                    f"the disk tier directory {root} cannot be used ({exc}): create it, make it "
                    f"writable by user {os.getuid()}, or pick another with --tier disk:DIR"
                ) from None
            return None
        if self.medium == "redis":
            from kvtier.offload.redis_store import RedisStore

            store = RedisStore(self.url, cluster=self.cluster, socket_timeout_s=timeout_s)
            try:
                store.ping()
            except TierUnavailableError as exc:
                return (
                    f"{exc}. Serving without the Redis tier until it answers (it is retried "
                    "every second); start Redis or fix the URL"
                )
            finally:
                store.close()
        return None

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
        """The tier for blocks of ``block_shape`` and ``dtype`` (``device``: the pool's)."""
        store: BlockStore
        if self.medium == "host":
            from kvtier.offload.host import HostStore

            store = HostStore()
        elif self.medium == "device":
            from kvtier.offload.device_tier import DeviceStore

            store = DeviceStore(device)
        elif self.medium == "disk":
            from kvtier.offload.disk import DiskStore

            assert self.path is not None
            store = DiskStore(self.path)
        else:
            from kvtier.offload.redis_store import RedisStore

            store = RedisStore(self.url, cluster=self.cluster)
        cap = self.capacity_blocks(block_shape, dtype)
        return Tier(store, cap, policy=self.policy, codec=self.codec, write_mode=self.write_mode)
