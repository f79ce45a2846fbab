"""Sizes, rates and times written the way people write them: ``512MiB``, ``3MB/s``, ``20ms``."""

from __future__ import annotations

import math
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


def parse_rate(text: str) -> float:
    """Bytes a second from ``3MB/s``, ``1.5GiB/s``, ``250e6`` (``/s`` optional)."""
    body = text.strip().removesuffix("/s").removesuffix("ps")
    try:
        return float(body)
    except ValueError:
        pass
    try:
        return float(parse_memory_size(body))
    except (ConfigError, ValueError):
        raise ConfigError(
            f"a tier bandwidth is bytes a second, e.g. 3MB/s, 1.5GiB/s or 250e6; got {text!r}"
        ) from None


def parse_seconds(text: str) -> float:
    """Seconds from ``0.02``, ``20ms``, ``150us`` or ``1s``."""
    body = text.strip()
    for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if body.endswith(suffix):
            body, factor = body[: -len(suffix)], scale
            break
    else:
        factor = 1.0
    try:
        value = float(body) * factor
    except ValueError:
        raise ConfigError(f"a latency is seconds, e.g. 0.02, 20ms or 150us; got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise ConfigError(f"a latency must be >= 0 seconds, got {text!r}")
    return value
