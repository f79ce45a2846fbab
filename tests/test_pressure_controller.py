"""The pressure controller: readings drive modes, callbacks, admission, failures, sampling."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from kvtier import (
    AdmissionRejectedError,
    ConfigError,
    Ladder,
    Mode,
    ModeActions,
    ModeChange,
    PressureController,
    ScriptedMonitor,
)
from kvtier.pressure import DEFAULT_ACTIONS


def controller(
    *script: float | BaseException, **kw: object
) -> tuple[PressureController, ScriptedMonitor]:
    mon = ScriptedMonitor(0.0, script=script)
    return PressureController(mon, **kw), mon  # type: ignore[arg-type]


def test_modes_change_only_on_readings() -> None:
    ctrl, mon = controller()
    mon.set(0.95)
    time.sleep(0.05)
    assert ctrl.mode is Mode.RELAXED  # no reading yet, no change
    assert ctrl.sample() is Mode.CRITICAL
    assert ctrl.mode is Mode.CRITICAL and ctrl.fraction == pytest.approx(0.95)
    assert ctrl.actions == DEFAULT_ACTIONS[Mode.CRITICAL]


def test_callbacks_fire_once_per_change_with_the_reading() -> None:
    ctrl, _ = controller(0.3, 0.55, 0.56, 0.6, 0.85, 0.82, 0.99, 0.99, 0.5, 0.2, 0.2)
    seen: list[ModeChange] = []
    ctrl.on_change(seen.append)
    for _ in range(11):
        ctrl.sample()
    assert [(c.old, c.new) for c in seen] == [
        (Mode.RELAXED, Mode.NORMAL),
        (Mode.NORMAL, Mode.PRESSURE),
        (Mode.PRESSURE, Mode.EMERGENCY),
        (Mode.EMERGENCY, Mode.NORMAL),
        (Mode.NORMAL, Mode.RELAXED),
    ]
    assert [c.reading.fraction for c in seen] == pytest.approx([0.55, 0.85, 0.99, 0.5, 0.2])
    assert ctrl.mode_changes == 5 and list(ctrl.timeline) == seen
    assert ctrl.readings == 11


def test_emergency_rejects_and_recovers() -> None:
    ladder = Ladder.from_fractions(
        (0.5, 0.8, 0.9, 0.97),
        actions={**DEFAULT_ACTIONS, Mode.EMERGENCY: ModeActions(admission="reject")},
    )
    ctrl, mon = controller(ladder=ladder)
    ctrl.check_admission()  # RELAXED accepts
    mon.set(0.98)
    ctrl.sample()
    with pytest.raises(AdmissionRejectedError, match=r"EMERGENCY .*98\.0% in use.*refuses") as info:
        ctrl.check_admission()
    assert info.value.mode == "EMERGENCY" and info.value.retry is False
    mon.set(0.93)  # above EMERGENCY's exit (0.92): still refusing
    ctrl.sample()
    with pytest.raises(AdmissionRejectedError):
        ctrl.admit(timeout=1.0)  # reject never waits
    mon.set(0.5)
    ctrl.sample()
    assert ctrl.mode is Mode.NORMAL
    ctrl.check_admission()
    assert ctrl.rejected == 2


def test_delay_waits_for_a_lower_mode_then_admits() -> None:
    ctrl, mon = controller()
    mon.set(0.99)
    ctrl.sample()
    with pytest.raises(AdmissionRejectedError) as info:
        ctrl.check_admission()
    assert info.value.retry is True
    timer = threading.Timer(0.1, lambda: (mon.set(0.2), ctrl.sample()))
    timer.start()
    started = time.monotonic()
    ctrl.admit(timeout=10.0)  # released by the mode change, long before the timeout
    assert time.monotonic() - started < 5.0
    assert ctrl.mode is Mode.RELAXED
    timer.join()


def test_delay_gives_up_after_the_bound() -> None:
    ctrl, mon = controller()
    mon.set(0.99)
    ctrl.sample()
    assert ctrl.wait_admissible(0.05) is False
    with pytest.raises(AdmissionRejectedError):
        ctrl.admit(timeout=0.05)


def test_a_raising_monitor_is_isolated_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    boom = OSError("NVML: GPU is lost")
    ctrl, _ = controller(0.85, boom, boom, ValueError("bad"), 0.1)
    ctrl.sample()
    assert ctrl.mode is Mode.PRESSURE
    with caplog.at_level(logging.WARNING, logger="kvtier.pressure"):
        for _ in range(3):
            assert ctrl.sample() is Mode.PRESSURE  # a failed reading changes nothing
    assert ctrl.monitor_errors == 3
    assert ctrl.last_error == "ValueError: bad"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # the repeated error is logged once
    assert "GPU is lost" in warnings[0] and "stays PRESSURE" in warnings[0]
    ctrl.sample()
    assert ctrl.mode is Mode.RELAXED
    stats = ctrl.stats().as_dict()
    assert stats["monitor_errors"] == 3 and stats["mode"] == "RELAXED"


def test_a_raising_callback_does_not_stop_the_others() -> None:
    ctrl, _ = controller(0.6, 0.1)
    heard: list[Mode] = []

    def bad(change: ModeChange) -> None:
        raise RuntimeError("listener bug")

    ctrl.on_change(bad)
    ctrl.on_change(lambda c: heard.append(c.new))
    ctrl.sample()
    ctrl.sample()
    assert heard == [Mode.NORMAL, Mode.RELAXED]
    assert ctrl.callback_errors == 2


def test_background_thread_samples_and_stops() -> None:
    ctrl, mon = controller(interval=0.01)
    changed = threading.Event()
    ctrl.on_change(lambda c: changed.set() if c.new is Mode.CRITICAL else None)
    with ctrl:
        assert ctrl.readings >= 1  # the first reading is taken at start
        mon.set(0.91)
        assert changed.wait(5.0)
        assert ctrl.mode is Mode.CRITICAL
        assert threading.current_thread() is not None
    n = ctrl.readings
    time.sleep(0.05)
    assert ctrl.readings == n  # stopped


def test_asyncio_task_samples_without_blocking_the_loop() -> None:
    ctrl, mon = controller(interval=0.01)
    mon.set(0.81)

    async def main() -> tuple[Mode, int]:
        task = asyncio.create_task(ctrl.run())
        ticks = 0
        for _ in range(50):
            await asyncio.sleep(0.002)
            ticks += 1
            if ctrl.mode is Mode.PRESSURE:
                break
        task.cancel()
        return ctrl.mode, ticks

    mode, ticks = asyncio.run(main())
    assert mode is Mode.PRESSURE and ticks >= 1


def test_bad_interval() -> None:
    with pytest.raises(ConfigError, match="interval"):
        PressureController(ScriptedMonitor(), interval=0)
