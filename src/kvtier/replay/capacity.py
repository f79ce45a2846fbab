"""Cache sizes on the command line: blocks, tokens or a share of the trace's unique blocks.

* ``2048``, ``2k``: blocks (``k``/``M``/``G`` are binary: 1024, 1024², 1024³);
* ``65536t``, ``64kt``, ``1Mt``: tokens, rounded down to whole blocks;
* ``5%``, ``0.5%``: a share of the trace's distinct block keys, so one
  command line sizes caches sensibly for traces of any length.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from kvtier.errors import ConfigError

CapacityKind = Literal["blocks", "tokens", "percent"]

_MULTIPLIERS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_NUMBER = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([kmg]?)\s*(t?)$", re.IGNORECASE)
_PERCENT = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*%$")


@dataclass(frozen=True, slots=True)
class Capacity:
    """A parsed capacity; :meth:`blocks` resolves it for one trace."""

    text: str
    kind: CapacityKind
    #: Blocks, tokens or percent, by ``kind``.
    value: float

    def blocks(self, block_size: int, unique_blocks: int) -> int:
        """The capacity in blocks for a trace with this block size and unique block count."""
        if self.kind == "blocks":
            return int(self.value)
        if self.kind == "tokens":
            n = int(self.value) // block_size
            if n < 1:
                raise ConfigError(
                    f"capacity {self.text!r} is less than one block of {block_size} tokens"
                )
            return n
        # At least one block, however small the share, so every run is a real cache.
        return max(1, round(self.value / 100.0 * unique_blocks))


def parse_capacity(text: str) -> Capacity:
    """Parse ``2048``, ``2k``, ``65536t``, ``64kt`` or ``5%``; raise ConfigError otherwise."""
    s = text.strip()
    m = _PERCENT.match(s)
    if m:
        pct = float(m.group(1))
        if pct <= 0:
            raise ConfigError(f"capacity {text!r} must be a positive percentage")
        return Capacity(text, "percent", pct)
    m = _NUMBER.match(s)
    if not m:
        raise ConfigError(
            f"cannot parse capacity {text!r}: use blocks (2048, 2k), tokens with a 't' "
            "suffix (65536t, 64kt, 1Mt) or a percentage of the trace's unique blocks (5%)"
        )
    value = float(m.group(1)) * _MULTIPLIERS[m.group(2).lower()]
    kind: CapacityKind = "tokens" if m.group(3) else "blocks"
    if not math.isfinite(value) or value != int(value):
        raise ConfigError(f"capacity {text!r} must be a whole number of {kind}")
    if value < 1:
        raise ConfigError(f"capacity {text!r} must be at least 1 {kind[:-1]}")
    return Capacity(text, kind, value)
