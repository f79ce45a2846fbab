"""The SGLang release kvtier's hierarchical-cache backend is tested against.

Detection reads the installed distribution's metadata and never imports
SGLang. Other releases are refused with
:class:`~kvtier.integrations.errors.UnsupportedReleaseError`;
``KVTIER_SGLANG_ALLOW_UNTESTED=1`` lets a newer one try.
"""

from __future__ import annotations

from typing import Final

from kvtier.integrations.errors import UnsupportedReleaseError
from kvtier.integrations.release import Pin, require_release

#: The SGLang release the backend is tested against.
TESTED_SGLANG: Final = "0.5.23"

SGLANG: Final = Pin(
    distribution="sglang",
    tested=TESTED_SGLANG,
    install=(
        f"install it with `pip install sglang=={TESTED_SGLANG}` (on a machine without a GPU, "
        f"for tests: torch first, then `pip install --no-deps sglang=={TESTED_SGLANG}` and "
        "`pip install 'kvtier[sglang]'`)"
    ),
    allow_env="KVTIER_SGLANG_ALLOW_UNTESTED",
)


def require_sglang(version: str | None = None) -> str:
    """The installed SGLang version; :class:`UnsupportedReleaseError` unless it is tested."""
    return require_release(SGLANG, UnsupportedReleaseError, version=version)
