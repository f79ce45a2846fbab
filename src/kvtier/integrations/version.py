"""Release numbers of the engines kvtier adapts to, read the same way for every engine."""

from __future__ import annotations

import re

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a version such as ``0.33.0`` or ``0.14.1rc2.dev3+g1``."""
    m = _VERSION_RE.match(text)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
