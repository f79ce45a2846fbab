"""Argument converters shared by the ``kvtier`` commands: sizes, counts, ports, fractions.

Each parser raises :class:`~kvtier.errors.ConfigError` on bad text; :func:`arg`
wraps one as an argparse ``type`` so the error becomes a usage message.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvtier.errors import ConfigError
from kvtier.policy import make_policy
from kvtier.units import parse_memory_size

__all__ = [
    "arg",
    "float_in",
    "int_at_least",
    "non_negative_int",
    "parse_memory_size",
    "policy_name",
    "port",
    "positive_int",
    "thresholds",
]


def arg(parse: Callable[[str], object], what: str) -> Callable[[str], object]:
    """An argparse ``type`` that turns a ConfigError (or ValueError) into a usage error."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except (ConfigError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = what
    return convert


def int_at_least(low: int, what: str) -> Callable[[str], int]:
    """A parser of an integer of at least ``low`` (``what`` names it in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise ConfigError(f"expected a {what}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1, "positive integer")
non_negative_int = int_at_least(0, "non-negative integer")


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"expected a port number in [0, 65535], got {text!r}") from None
    if not 0 <= value <= 65535:
        raise ConfigError(f"expected a port number in [0, 65535], got {text!r}")
    return value


def float_in(
    what: str, low: float, high: float, *, open_low: bool = False
) -> Callable[[str], float]:
    """A parser of a number in ``[low, high]`` (``(low, high]`` when ``open_low``)."""
    bounds = f"{'(' if open_low else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not ((low < value) if open_low else (low <= value)) or not value <= high:
            raise ConfigError(f"expected a {what} in {bounds}, got {text!r}")
        return value

    return parse


def window_ratio(text: str) -> float | str | None:
    """``--window-kv-ratio``: a number in (0, 1], ``auto`` or ``off``."""
    word = text.strip().lower()
    if word == "off":
        return None
    if word == "auto":
        return "auto"
    return float_in("window slots per block ratio (or auto, off)", 0.0, 1.0, open_low=True)(
        text
    )


def policy_name(text: str) -> str:
    make_policy(text)  # raises ConfigError for an unknown name or import path
    return text


def thresholds(text: str) -> tuple[float, float, float, float]:
    """Four rising fractions ``N,P,C,E`` for the pressure ladder."""
    from kvtier.pressure.ladder import Ladder

    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 4:
        raise ConfigError(
            f"expected four rising fractions N,P,C,E in (0, 1], e.g. 0.5,0.8,0.9,0.97; got {text!r}"
        )
    fractions = (values[0], values[1], values[2], values[3])
    Ladder.from_fractions(fractions, hysteresis=0.0)  # rising, within (0, 1]
    return fractions
