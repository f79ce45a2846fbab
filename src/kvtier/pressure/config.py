"""PressureSpec: the pressure settings an engine or the CLI turns into a controller."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.pressure.controller import PressureController
from kvtier.pressure.detect import MONITOR_NAMES, make_monitor
from kvtier.pressure.ladder import DEFAULT_ACTIONS, DEFAULT_THRESHOLDS, Admission, Ladder, Mode


@dataclass(frozen=True)
class PressureSpec:
    """Which monitor to watch and how the ladder reacts.

    ``thresholds`` are the NORMAL, PRESSURE, CRITICAL and EMERGENCY enter
    fractions; ``emergency`` is what EMERGENCY does with new requests
    (``delay``: they wait, up to ``max_wait`` seconds, for a lower mode;
    ``reject``: they fail at once).
    """

    monitor: str = "auto"
    interval: float = 0.05
    thresholds: tuple[float, float, float, float] = tuple(  # type: ignore[assignment]
        DEFAULT_THRESHOLDS[m] for m in list(Mode)[1:]
    )
    hysteresis: float = 0.05
    emergency: Admission = "delay"
    max_wait: float = 30.0
    device_index: int = 0

    def __post_init__(self) -> None:
        if self.monitor not in MONITOR_NAMES:
            raise ConfigError(
                f"unknown memory monitor {self.monitor!r}; choose one of {', '.join(MONITOR_NAMES)}"
            )
        self.ladder()  # validates thresholds, hysteresis and the emergency action
        if not self.interval > 0 or not self.max_wait >= 0:
            raise ConfigError(
                f"interval must be positive and max_wait non-negative seconds, got "
                f"{self.interval} and {self.max_wait}"
            )

    def ladder(self) -> Ladder:
        actions = dict(DEFAULT_ACTIONS)
        actions[Mode.EMERGENCY] = dataclasses.replace(
            actions[Mode.EMERGENCY], admission=self.emergency
        )
        return Ladder.from_fractions(self.thresholds, self.hysteresis, actions)

    def build(self, pool: Any = None, bytes_per_block: int = 1) -> PressureController:
        """A controller (not yet sampling) watching this spec's monitor."""
        monitor = make_monitor(
            self.monitor, pool=pool, device_index=self.device_index, bytes_per_block=bytes_per_block
        )
        return PressureController(
            monitor, self.ladder(), interval=self.interval, max_wait=self.max_wait
        )
