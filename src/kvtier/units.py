"""Memory sizes written the way people write them: ``512MiB``, ``1.5G``, ``800MB``."""

from __future__ import annotations

import re

from kvtier.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 10**3,
    "kib": 2**10,
    "m": 2**20,
    "mb": 10**6,
    "mib": 2**20,
    "g": 2**30,
    "gb": 10**9,
    "gib": 2**30,
    "t": 2**40,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_memory_size(text: str) -> int:
    """Bytes in ``512MiB``, ``1GiB``, ``1.5G``, ``800MB`` or ``1048576``; ConfigError otherwise.

    KiB/MiB/GiB/TiB (and the bare K/M/G/T) are powers of 1024, KB/MB/GB/TB powers of 1000.
    """
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"cannot parse memory size {text!r}: use a number of bytes with an optional unit, "
            "e.g. 512MiB, 1GiB, 1.5G, 800MB"
        )
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise ConfigError(f"memory size {text!r} must be at least 1 byte")
    return value
