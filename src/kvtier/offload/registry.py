"""Storage media by name: how a tier URL becomes a medium.

A medium is registered once with :func:`register_medium`: a name (the URL
scheme, ``host`` in ``host:4GiB``), optional extra URL schemes it answers to
(``redis``, ``rediss``, ``unix`` for Redis), a factory taking the URL's
location and its options, and optionally a probe that checks the medium
before anything loads. :func:`make_medium` builds one; ``kvtier serve
--tier URL`` and :meth:`TierSpec.from_url <kvtier.offload.config.TierSpec.from_url>`
go through it. A medium defined outside kvtier registers itself when its
module is imported; a tier URL can name that module (``?module=pkg.media``)
so the server imports it first. Adding a medium is one module with the
class and its registration line::

    register_medium("s3", lambda location, options: S3Store(location, **options))

The built-in media: ``device`` (compressed blocks in the device's memory),
``host`` (memory), ``disk`` (a directory),
``redis`` (a server: ``redis://``, ``rediss://``, ``unix://``),
``redis+cluster`` (a Redis Cluster), ``mooncake`` (a Mooncake Store pool:
``mooncake://MASTER_HOST:PORT``) and ``throttled`` (items in this process
behind a paced link: ``throttled:NAME?latency_ms=20&mb_s=3``, to see how a
slow tier behaves).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.offload.media import BlockStore

#: ``factory(location, options)``: a new, unbound medium.
MediumFactory = Callable[[str, Mapping[str, str]], BlockStore]
#: ``probe(location, options, timeout_s)``: a warning, ``None``, or raise ConfigError.
MediumProbe = Callable[[str, Mapping[str, str], float], "str | None"]


@dataclass(frozen=True)
class _Entry:
    factory: MediumFactory
    probe: MediumProbe | None
    schemes: tuple[str, ...]


_MEDIA: dict[str, _Entry] = {}
_SCHEMES: dict[str, str] = {}


def register_medium(
    name: str,
    factory: MediumFactory,
    *,
    schemes: tuple[str, ...] = (),
    probe: MediumProbe | None = None,
) -> None:
    """Make ``name`` (and the URL ``schemes``) build a medium with ``factory``.

    Registering a name again replaces it (a plugin may override a built-in).
    """
    if not name or not isinstance(name, str) or any(c in name for c in ":/?&="):
        raise ConfigError(f"a medium name must be a plain word, got {name!r}")
    _MEDIA[name] = _Entry(factory, probe, tuple(schemes))
    for scheme in (name, *schemes):
        _SCHEMES[scheme] = name


def available_media() -> list[str]:
    """The registered media names, sorted."""
    _builtins()
    return sorted(_MEDIA)


def medium_for_scheme(scheme: str) -> str | None:
    """The medium a URL scheme names, or ``None``."""
    _builtins()
    return _SCHEMES.get(scheme)


def import_medium_module(module: str) -> None:
    """Import an out-of-tree medium's module (it registers itself)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"cannot import the medium module {module!r} ({exc}): install it, or fix module="
        ) from None


def _entry(name: str) -> _Entry:
    _builtins()
    entry = _MEDIA.get(name)
    if entry is None:
        raise ConfigError(
            f"unknown storage medium {name!r}: registered media are "
            f"{', '.join(sorted(_MEDIA))} (an out-of-tree one loads with ?module=pkg.mod)"
        )
    return entry


def make_medium(name: str, location: str, options: Mapping[str, str] | None = None) -> BlockStore:
    """A new medium ``name`` at ``location`` (a path, a URL, or empty) with ``options``."""
    return _entry(name).factory(location, dict(options or {}))


def probe_medium(
    name: str, location: str, options: Mapping[str, str] | None = None, timeout_s: float = 2.0
) -> str | None:
    """Check a medium before use: a warning, ``None``, or :class:`ConfigError`."""
    probe = _entry(name).probe
    return None if probe is None else probe(location, dict(options or {}), timeout_s)


# -- the built-in media ---------------------------------------------------------------------


def _no_options(medium: str, options: Mapping[str, str], allowed: tuple[str, ...] = ()) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        known = f"; it takes {', '.join(allowed)}" if allowed else "; it takes none"
        raise ConfigError(f"the {medium} medium has no option {', '.join(unknown)}{known}")


def _flag(medium: str, name: str, value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"the {medium} medium's {name} must be true or false, got {value!r}")


def _host(location: str, options: Mapping[str, str]) -> BlockStore:
    from kvtier.offload.host import HostStore

    _no_options("host", options, ("pin",))
    pin = options.get("pin")
    return HostStore(pin_memory=None if pin is None else _flag("host", "pin", pin))


def _device(location: str, options: Mapping[str, str]) -> BlockStore:
    from kvtier.offload.device_tier import DeviceStore

    _no_options("device", options)
    return DeviceStore(location or "cpu")


def _disk(location: str, options: Mapping[str, str]) -> BlockStore:
    from kvtier.offload.disk import DiskStore

    _no_options("disk", options, ("fsync", "direct_reads"))
    if not location:
        raise ConfigError("the disk medium needs a directory, e.g. disk:/var/cache/kvtier")
    return DiskStore(
        location,
        fsync=_flag("disk", "fsync", options.get("fsync", "false")),
        direct_reads=_flag("disk", "direct_reads", options.get("direct_reads", "false")),
    )


def _disk_probe(location: str, options: Mapping[str, str], timeout_s: float) -> str | None:
    import os
    import tempfile
    from pathlib import Path

    root = Path(location)
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


def _redis_store(location: str, options: Mapping[str, str], cluster: bool) -> BlockStore:
    from kvtier.offload.redis_store import RedisStore

    medium = "redis+cluster" if cluster else "redis"
    _no_options(medium, options, ("ttl", "prefix", "delete_on_evict"))
    ttl = options.get("ttl")
    try:
        ttl_s = None if ttl is None else int(ttl)
    except ValueError:
        raise ConfigError(f"the {medium} medium's ttl must be whole seconds, got {ttl!r}") from None
    return RedisStore(
        location,
        cluster=cluster,
        ttl_s=ttl_s,
        key_prefix=options.get("prefix", "kvtier"),
        delete_on_evict=_flag(medium, "delete_on_evict", options.get("delete_on_evict", "false")),
    )


def _redis_probe(cluster: bool) -> MediumProbe:
    def probe(location: str, options: Mapping[str, str], timeout_s: float) -> str | None:
        from kvtier.errors import TierUnavailableError
        from kvtier.offload.redis_store import RedisStore

        store = RedisStore(location, cluster=cluster, socket_timeout_s=timeout_s)
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

    return probe


_loaded = False


def _builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from kvtier.offload.mooncake_store import make_mooncake_store, probe_mooncake
    from kvtier.offload.throttled import make_throttled_store

    for name, entry in (
        ("host", _Entry(_host, None, ())),
        ("device", _Entry(_device, None, ())),
        ("disk", _Entry(_disk, _disk_probe, ())),
        (
            "redis",
            _Entry(
                lambda loc, opts: _redis_store(loc, opts, False),
                _redis_probe(False),
                ("rediss", "unix"),
            ),
        ),
        (
            "redis+cluster",
            _Entry(lambda loc, opts: _redis_store(loc, opts, True), _redis_probe(True), ()),
        ),
        ("mooncake", _Entry(make_mooncake_store, probe_mooncake, ())),
        ("throttled", _Entry(make_throttled_store, None, ())),
    ):
        if name not in _MEDIA:  # a plugin registered first keeps its override
            _MEDIA[name] = entry
            for scheme in (name, *entry.schemes):
                _SCHEMES.setdefault(scheme, name)
