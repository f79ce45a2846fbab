"""Which vLLM is installed, and which of its offloading APIs kvtier adapts to.

vLLM changed its offloading interface twice over the releases kvtier knows:

* **0.12 - 0.16**: an ``OffloadingManager`` over a ``Backend`` (block hashes,
  ``BlockStatus`` reference counts, ``lookup`` returning a count). kvtier's
  :class:`~kvtier.integrations.vllm.legacy.LegacyOffloadingManager` speaks it;
  it is tested against that protocol's documented shape, not against an
  installed vLLM of that age.
* **0.33**: ``CPUOffloadingManager`` with a pluggable ``CachePolicy`` (offload
  keys, request contexts, ``LookupResult``). kvtier's
  :class:`~kvtier.integrations.vllm.cache_policy.KvTierCachePolicy` plugs into
  it and is tested against the installed vLLM 0.33.0.

Other versions are refused with :class:`UnsupportedVllmError`, whose message
says what to install. Setting ``KVTIER_VLLM_ALLOW_UNTESTED=1`` lets a newer
vLLM (or one between the two ranges) try the ``CachePolicy`` adapter anyway.

Detection reads the installed distribution's metadata and never imports vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from typing import Final, Literal

from kvtier.integrations.errors import UnsupportedVllmError
from kvtier.integrations.version import parse_version as parse_version  # re-exported

VllmApi = Literal["cache_policy", "offloading_manager"]

#: vLLM 0.33's ``CPUOffloadingManager`` + ``CachePolicy`` interface.
CACHE_POLICY_API: Final = "cache_policy"
#: vLLM 0.12 - 0.16's ``OffloadingManager`` + ``Backend`` interface.
MANAGER_API: Final = "offloading_manager"

#: The vLLM release the ``CachePolicy`` adapter is tested against, and its series.
TESTED_VLLM: Final = "0.33.0"
CACHE_POLICY_SERIES: Final = (0, 33)
#: The releases (inclusive, major.minor) with the older ``OffloadingManager`` API.
MANAGER_SERIES: Final = ((0, 12), (0, 16))
#: Set to ``1`` to let an untested vLLM try the ``CachePolicy`` adapter.
ALLOW_UNTESTED_ENV: Final = "KVTIER_VLLM_ALLOW_UNTESTED"

INSTALL_HINT: Final = (
    f"install the tested release with `pip install vllm=={TESTED_VLLM}` (on a machine "
    f"without a GPU: torch first, then `pip install --no-deps vllm=={TESTED_VLLM}` and "
    "`pip install 'kvtier[vllm]'` plus the packages docs/vllm.md lists)"
)
SUPPORTED_TEXT: Final = (
    f"kvtier's vLLM integration supports vLLM {CACHE_POLICY_SERIES[0]}."
    f"{CACHE_POLICY_SERIES[1]}.x (the CachePolicy API, tested with {TESTED_VLLM}) and "
    f"{MANAGER_SERIES[0][0]}.{MANAGER_SERIES[0][1]}-{MANAGER_SERIES[1][0]}."
    f"{MANAGER_SERIES[1][1]} (the older OffloadingManager API, through "
    "LegacyOffloadingManager, tested against the protocol only)"
)


@dataclass(frozen=True, slots=True)
class VllmInfo:
    """What :func:`detect_vllm` found."""

    #: The installed version string, ``None`` when vLLM is not installed.
    version: str | None
    #: ``(major, minor, patch)`` of ``version``, ``None`` if absent or unparsable.
    release: tuple[int, int, int] | None
    #: The offloading API that applies, ``None`` when no adapter fits.
    api: VllmApi | None
    #: Whether this series is the one the adapters are tested against.
    tested: bool

    @property
    def installed(self) -> bool:
        return self.version is not None

    @property
    def supported(self) -> bool:
        return self.api is not None


def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version, without importing vLLM."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _allow_untested() -> bool:
    return os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() in ("1", "true", "yes")


def detect_vllm(version: str | None = None) -> VllmInfo:
    """The installed vLLM (or ``version``, when given) and the API kvtier uses with it."""
    text = installed_vllm_version() if version is None else version
    if text is None:
        return VllmInfo(None, None, None, False)
    release = parse_version(text)
    if release is None:
        return VllmInfo(text, None, None, False)
    series = release[:2]
    if series == CACHE_POLICY_SERIES:
        return VllmInfo(text, release, CACHE_POLICY_API, True)
    if MANAGER_SERIES[0] <= series <= MANAGER_SERIES[1]:
        return VllmInfo(text, release, MANAGER_API, False)
    if series > MANAGER_SERIES[1] and _allow_untested():
        return VllmInfo(text, release, CACHE_POLICY_API, False)
    return VllmInfo(text, release, None, False)


def require_vllm(api: VllmApi | None = None, *, version: str | None = None) -> VllmInfo:
    """:func:`detect_vllm`, raising :class:`UnsupportedVllmError` unless ``api`` applies.

    With ``api=None`` any supported version passes.
    """
    info = detect_vllm(version)
    if info.version is None:
        raise UnsupportedVllmError(
            f"vLLM is not installed. {SUPPORTED_TEXT}; {INSTALL_HINT}.", version=None
        )
    if info.api is None:
        raise UnsupportedVllmError(
            f"vLLM {info.version} is not supported. {SUPPORTED_TEXT}; {INSTALL_HINT}, "
            f"or set {ALLOW_UNTESTED_ENV}=1 to try the CachePolicy adapter with a newer "
            "release.",
            version=info.version,
        )
    if api is not None and info.api != api:
        if api == CACHE_POLICY_API:
            hint = (
                f"vLLM {info.version} has the older OffloadingManager API: return a "
                "kvtier.integrations.vllm.LegacyOffloadingManager from your offloading "
                f"spec's get_manager(), or upgrade with `pip install --no-deps "
                f"vllm=={TESTED_VLLM}`"
            )
        else:
            hint = (
                f"vLLM {info.version} has the CachePolicy API: set eviction_policy to a "
                "kvtier policy class and cache_policy_module_path to "
                "'kvtier.integrations.vllm.cache_policy' in kv_connector_extra_config"
            )
        raise UnsupportedVllmError(f"{hint}. {SUPPORTED_TEXT}.", version=info.version)
    return info
