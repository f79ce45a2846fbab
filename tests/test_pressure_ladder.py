"""The pressure ladder: every threshold boundary, hysteresis, no flapping, validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import ConfigError, Ladder, Mode, ModeActions

LADDER = Ladder()  # NORMAL 0.50, PRESSURE 0.80, CRITICAL 0.90, EMERGENCY 0.97, hysteresis 0.05


@pytest.mark.parametrize(
    ("fraction", "mode"),
    [
        (0.0, Mode.RELAXED),
        (0.4999, Mode.RELAXED),
        (0.50, Mode.NORMAL),
        (0.7999, Mode.NORMAL),
        (0.80, Mode.PRESSURE),
        (0.8999, Mode.PRESSURE),
        (0.90, Mode.CRITICAL),
        (0.9699, Mode.CRITICAL),
        (0.97, Mode.EMERGENCY),
        (1.0, Mode.EMERGENCY),
    ],
)
def test_each_enter_boundary_from_relaxed(fraction: float, mode: Mode) -> None:
    assert LADDER.next_mode(Mode.RELAXED, fraction) is mode


@pytest.mark.parametrize(
    ("start", "fraction", "mode"),
    [
        # Exit thresholds are enter - 0.05: at or above them the mode holds.
        (Mode.EMERGENCY, 0.92, Mode.EMERGENCY),
        (Mode.EMERGENCY, 0.9199, Mode.CRITICAL),
        (Mode.CRITICAL, 0.85, Mode.CRITICAL),
        (Mode.CRITICAL, 0.8499, Mode.PRESSURE),
        (Mode.PRESSURE, 0.75, Mode.PRESSURE),
        (Mode.PRESSURE, 0.7499, Mode.NORMAL),
        (Mode.NORMAL, 0.45, Mode.NORMAL),
        (Mode.NORMAL, 0.4499, Mode.RELAXED),
        # A deep drop falls through several modes in one reading.
        (Mode.EMERGENCY, 0.10, Mode.RELAXED),
        (Mode.EMERGENCY, 0.60, Mode.NORMAL),
        # A spike climbs straight to the highest mode it reaches.
        (Mode.NORMAL, 0.99, Mode.EMERGENCY),
        (Mode.PRESSURE, 0.91, Mode.CRITICAL),
    ],
)
def test_exit_boundaries_and_jumps(start: Mode, fraction: float, mode: Mode) -> None:
    assert LADDER.next_mode(start, fraction) is mode


def walk(ladder: Ladder, fractions: list[float]) -> list[Mode]:
    mode = Mode.RELAXED
    out = []
    for f in fractions:
        mode = ladder.next_mode(mode, f)
        out.append(mode)
    return out


def changes(modes: list[Mode]) -> int:
    return sum(a is not b for a, b in zip([Mode.RELAXED, *modes], modes, strict=False))


def test_oscillation_around_a_threshold_changes_the_mode_once() -> None:
    # 0.79 <-> 0.81 around PRESSURE's 0.80, a swing smaller than the hysteresis.
    readings = [0.79, 0.81] * 50
    modes = walk(LADDER, readings)
    assert modes[0] is Mode.NORMAL
    assert set(modes[1:]) == {Mode.PRESSURE}
    assert changes(modes) == 2  # RELAXED -> NORMAL, NORMAL -> PRESSURE; never back


def test_without_hysteresis_the_same_readings_flap() -> None:
    flappy = Ladder(hysteresis=0.0)
    assert changes(walk(flappy, [0.79, 0.81] * 50)) == 100


@given(
    centre=st.sampled_from([0.50, 0.80, 0.90, 0.97]),
    swings=st.lists(st.floats(-0.0249, 0.0249), min_size=1, max_size=200),
)
def test_readings_within_the_hysteresis_band_change_the_mode_at_most_once(
    centre: float, swings: list[float]
) -> None:
    start = LADDER.next_mode(Mode.RELAXED, centre - 0.03)  # the mode just below ``centre``
    modes = []
    mode = start
    for s in swings:
        mode = LADDER.next_mode(mode, min(centre + s, 1.0))
        modes.append(mode)
    assert changes([start, *modes]) - changes([start]) <= 1


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=100))
def test_the_mode_is_always_between_the_exit_and_enter_bands(fractions: list[float]) -> None:
    mode = Mode.RELAXED
    for f in fractions:
        mode = LADDER.next_mode(mode, f)
        # The mode's own band holds f (up to the hysteresis below it)...
        assert f >= LADDER.exit(mode) or mode is Mode.RELAXED
        # ...and no higher mode's enter threshold is reached.
        if mode is not Mode.EMERGENCY:
            assert f < LADDER.enter(Mode(mode + 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"thresholds": {Mode.NORMAL: 0.5, Mode.PRESSURE: 0.8, Mode.CRITICAL: 0.9}}, "EMERGENCY"),
        (
            {
                "thresholds": {
                    Mode.NORMAL: 0.5,
                    Mode.PRESSURE: 0.4,
                    Mode.CRITICAL: 0.9,
                    Mode.EMERGENCY: 0.97,
                }
            },
            "PRESSURE threshold 0.4 must be above",
        ),
        (
            {
                "thresholds": {
                    Mode.NORMAL: 0.5,
                    Mode.PRESSURE: 0.8,
                    Mode.CRITICAL: 0.9,
                    Mode.EMERGENCY: 1.2,
                }
            },
            "at most 1",
        ),
        ({"hysteresis": 0.6}, "hysteresis"),
        ({"hysteresis": -0.1}, "hysteresis"),
        ({"actions": {Mode.RELAXED: ModeActions()}}, "actions lack"),
    ],
)
def test_bad_ladders_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Ladder(**kwargs)  # type: ignore[arg-type]


def test_bad_actions_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="free_target"):
        ModeActions(free_target=1.0)
    with pytest.raises(ConfigError, match="admission must be one of"):
        ModeActions(admission="maybe")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="four thresholds"):
        Ladder.from_fractions((0.5, 0.8, 0.9))  # type: ignore[arg-type]


def test_from_fractions_and_targets() -> None:
    ladder = Ladder.from_fractions((0.2, 0.4, 0.6, 0.8), hysteresis=0.1)
    assert ladder.next_mode(Mode.RELAXED, 0.65) is Mode.CRITICAL
    assert ladder.next_mode(Mode.CRITICAL, 0.51) is Mode.CRITICAL
    assert ladder.next_mode(Mode.CRITICAL, 0.49) is Mode.PRESSURE
    assert ModeActions(free_target=0.1).target_blocks(95) == 10  # rounded up
    defaults = Ladder().actions
    assert defaults[Mode.CRITICAL].offload and defaults[Mode.CRITICAL].free_target > 0
    assert defaults[Mode.EMERGENCY].admission != "accept"
    assert all(defaults[m].admission == "accept" for m in Mode if m is not Mode.EMERGENCY)
