"""The pressure ladder: five modes, enter thresholds, hysteresis and per-mode actions.

A reading's fraction moves the mode *up* at once to the highest mode whose
enter threshold it reaches (a spike goes straight from NORMAL to EMERGENCY),
and *down* one mode at a time while it is below the current mode's exit
threshold (enter minus ``hysteresis``). A fraction oscillating around one
threshold by less than the hysteresis therefore changes the mode at most once.
The ladder is pure: :meth:`Ladder.next_mode` maps (mode, fraction) to a mode,
and only readings call it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal

from kvtier.errors import ConfigError

Admission = Literal["accept", "delay", "reject"]
_ADMISSIONS = ("accept", "delay", "reject")


class Mode(IntEnum):
    RELAXED = 0
    NORMAL = 1
    PRESSURE = 2
    CRITICAL = 3
    EMERGENCY = 4


@dataclass(frozen=True, slots=True)
class ModeActions:
    """What a mode does.

    ``free_target``: share of the pool to keep empty, reached by evicting in
    the policy's order after each allocation; ``offload``: evicted blocks are
    written to the next tier before they are freed (when tiers exist);
    ``admission``: new requests are accepted, delayed (a bounded wait for a
    lower mode, then rejected) or rejected at once.
    """

    free_target: float = 0.0
    offload: bool = False
    admission: Admission = "accept"

    def __post_init__(self) -> None:
        if not 0.0 <= self.free_target < 1.0:
            raise ConfigError(f"free_target must be within [0, 1), got {self.free_target}")
        if self.admission not in _ADMISSIONS:
            raise ConfigError(
                f"admission must be one of {', '.join(_ADMISSIONS)}, got {self.admission!r}"
            )

    def target_blocks(self, num_blocks: int) -> int:
        return math.ceil(self.free_target * num_blocks)


#: Enter thresholds of the modes above RELAXED (fractions of memory in use).
DEFAULT_THRESHOLDS: dict[Mode, float] = {
    Mode.NORMAL: 0.50,
    Mode.PRESSURE: 0.80,
    Mode.CRITICAL: 0.90,
    Mode.EMERGENCY: 0.97,
}

DEFAULT_ACTIONS: dict[Mode, ModeActions] = {
    Mode.RELAXED: ModeActions(),
    Mode.NORMAL: ModeActions(),
    Mode.PRESSURE: ModeActions(free_target=0.05, offload=True),
    Mode.CRITICAL: ModeActions(free_target=0.10, offload=True),
    Mode.EMERGENCY: ModeActions(free_target=0.10, offload=True, admission="delay"),
}


@dataclass(frozen=True)
class Ladder:
    """Thresholds, hysteresis and actions; validated on construction."""

    thresholds: Mapping[Mode, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    hysteresis: float = 0.05
    actions: Mapping[Mode, ModeActions] = field(default_factory=lambda: dict(DEFAULT_ACTIONS))

    def __post_init__(self) -> None:
        missing = [m.name for m in Mode if m is not Mode.RELAXED and m not in self.thresholds]
        if missing:
            raise ConfigError(f"thresholds lack an enter fraction for {', '.join(missing)}")
        previous = 0.0
        for mode in list(Mode)[1:]:
            t = self.thresholds[mode]
            if not previous < t <= 1.0:
                raise ConfigError(
                    f"the {mode.name} threshold {t} must be above the previous one ({previous}) "
                    "and at most 1: thresholds rise from NORMAL to EMERGENCY"
                )
            previous = t
        if not 0.0 <= self.hysteresis < self.thresholds[Mode.NORMAL]:
            raise ConfigError(
                f"hysteresis must be within [0, {self.thresholds[Mode.NORMAL]}) "
                f"(the NORMAL threshold), got {self.hysteresis}"
            )
        missing = [m.name for m in Mode if m not in self.actions]
        if missing:
            raise ConfigError(f"actions lack an entry for {', '.join(missing)}")

    @classmethod
    def from_fractions(
        cls,
        fractions: tuple[float, float, float, float],
        hysteresis: float = 0.05,
        actions: Mapping[Mode, ModeActions] | None = None,
    ) -> Ladder:
        """A ladder from the NORMAL, PRESSURE, CRITICAL and EMERGENCY enter fractions."""
        if len(fractions) != 4:
            raise ConfigError(f"give four thresholds (NORMAL..EMERGENCY), got {len(fractions)}")
        thresholds = dict(zip(list(Mode)[1:], fractions, strict=True))
        return cls(thresholds, hysteresis, dict(actions or DEFAULT_ACTIONS))

    def enter(self, mode: Mode) -> float:
        return 0.0 if mode is Mode.RELAXED else self.thresholds[mode]

    def exit(self, mode: Mode) -> float:
        """Below this fraction the mode steps down one."""
        return self.enter(mode) - self.hysteresis

    def next_mode(self, mode: Mode, fraction: float) -> Mode:
        """The mode after a reading of ``fraction`` in ``mode``."""
        up = mode
        for m in reversed(list(Mode)[mode + 1 :]):
            if fraction >= self.thresholds[m]:
                up = m
                break
        if up is not mode:
            return up
        while mode is not Mode.RELAXED and fraction < self.exit(mode):
            mode = Mode(mode - 1)
        return mode
