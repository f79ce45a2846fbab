"""Which release of an engine is installed, and refusing the ones an adapter was not tested with.

Each adapter pins the release series it is tested against (SGLang 0.5);
:func:`require_release` reads the installed
distribution's version without importing it and raises the adapter's
:class:`~kvtier.integrations.errors.IntegrationError` subclass, with a
message that says what to install, for a missing or other release. An
environment variable (``KVTIER_<ENGINE>_ALLOW_UNTESTED=1``) lets a newer
release try the adapter anyway.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

from kvtier.integrations.errors import IntegrationError
from kvtier.integrations.version import parse_version


@dataclass(frozen=True, slots=True)
class Pin:
    """The release an adapter is tested against, and how to get it."""

    #: The distribution's name on PyPI (``sglang``).
    distribution: str
    #: The exact release the tests run against (``0.5.23``).
    tested: str
    #: How to install it, said to whoever has another release.
    install: str
    #: The environment variable that lets a newer release try the adapter.
    allow_env: str

    @property
    def series(self) -> tuple[int, int]:
        release = parse_version(self.tested)
        assert release is not None
        return release[0], release[1]


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, without importing it."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def require_release(
    pin: Pin, error: type[IntegrationError], *, version: str | None = None
) -> str:
    """The installed version (or ``version``) when it is in the pinned series; else ``error``.

    A newer release passes when ``pin.allow_env`` is set to ``1``.
    """
    text = installed_version(pin.distribution) if version is None else version
    series = f"{pin.series[0]}.{pin.series[1]}"
    if text is None:
        raise error(
            f"{pin.distribution} is not installed. kvtier's adapter is tested with "
            f"{pin.distribution} {pin.tested}: {pin.install}"
        )
    release = parse_version(text)
    if release is not None and release[:2] == pin.series:
        return text
    allowed = os.environ.get(pin.allow_env, "").strip().lower() in ("1", "true", "yes")
    if release is not None and release[:2] > pin.series and allowed:
        return text
    raise error(
        f"{pin.distribution} {text} is not supported: kvtier's adapter is tested with "
        f"{pin.distribution} {pin.tested} (the {series} series). {pin.install}, or set "
        f"{pin.allow_env}=1 to try the adapter with a newer release"
    )
