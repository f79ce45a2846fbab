"""The typed errors of the engine integrations.

They are :class:`~kvtier.errors.KvTierError` s and also ``ImportError`` s, so
code that already guards an optional import with ``except ImportError`` keeps
working.
"""

from __future__ import annotations

from kvtier.errors import KvTierError


class IntegrationError(KvTierError, ImportError):
    """An integration cannot be used in this environment."""


class UnsupportedVllmError(IntegrationError):
    """vLLM is missing, or its version has no adapter here.

    ``version`` is the installed version (``None`` when vLLM is not installed).
    """

    def __init__(self, message: str, *, version: str | None = None) -> None:
        super().__init__(message)
        self.version = version


class MissingDependencyError(IntegrationError):
    """A package an integration needs (pyzmq, msgspec) is not installed."""


class UnsupportedReleaseError(IntegrationError):
    """An engine (SGLang) is missing, or of a release its adapter is not tested with;
    the message says which release to install."""
