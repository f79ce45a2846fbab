"""The request hints, under their earlier name: see :mod:`kvtier.hints`."""

from kvtier.hints import (
    HINT_NAMES,
    MAX_ID_CHARS,
    MAX_TTL_S,
    REUSE_VALUES,
    Hints,
    Reuse,
    parse_hints,
)

__all__ = [
    "HINT_NAMES",
    "MAX_ID_CHARS",
    "MAX_TTL_S",
    "REUSE_VALUES",
    "Hints",
    "Reuse",
    "parse_hints",
]
