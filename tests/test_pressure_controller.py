"""The pressure controller: readings drive modes, callbacks, admission, failures, sampling.

Threads and the event loop are synchronised on events and conditions, never
on sleeps: every wait here ends because something happened, and a test that
waits for something that never comes fails on pytest's timeout.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from kvtier import (
    AdmissionRejectedError,
    ConfigError,
    Ladder,
    MemoryReading,
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
    # Nothing samples (no thread, no task): the new value is not seen yet.
    assert ctrl.mode is Mode.RELAXED and ctrl.readings == 0 and mon.reads == 0
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
    waiting = threading.Event()
    outcome: list[BaseException | None] = []

    def client() -> None:
        waiting.set()
        try:
            # Far longer than pytest's timeout: only the mode change can end this wait.
            ctrl.admit(timeout=3600.0)
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=client)
    thread.start()
    waiting.wait()
    assert not outcome, "admit returned while the mode still delays"
    mon.set(0.2)
    ctrl.sample()  # the change notifies the waiting client
    thread.join()
    assert outcome == [None] and ctrl.mode is Mode.RELAXED


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
    heard_on: list[threading.Thread] = []

    def listener(change: ModeChange) -> None:
        heard_on.append(threading.current_thread())
        changed.set()

    ctrl.on_change(listener)
    with ctrl:
        assert ctrl.readings >= 1 and ctrl.mode is Mode.RELAXED  # the first reading, at start
        sampler = ctrl._thread
        assert sampler is not None and sampler.is_alive()
        mon.set(0.91)
        changed.wait()
        assert ctrl.mode is Mode.CRITICAL
        assert heard_on == [sampler], "the change was heard on the sampling thread"
    assert not sampler.is_alive() and ctrl._thread is None, "close() stopped the sampler"
    n = ctrl.readings
    mon.set(0.1)
    assert ctrl.readings == n and ctrl.mode is Mode.CRITICAL, "nothing samples any more"


class _HandshakeMonitor:
    """Its first read waits for the event loop to answer: possible only off the loop."""

    name = "handshake"

    def __init__(self, loop: asyncio.AbstractEventLoop, reading: asyncio.Event) -> None:
        self.loop = loop
        self.reading = reading
        self.answered = threading.Event()
        self.threads: list[threading.Thread] = []

    def read(self) -> MemoryReading:
        self.threads.append(threading.current_thread())
        if len(self.threads) == 1:
            self.loop.call_soon_threadsafe(self.reading.set)
            # In a worker thread the loop is free to answer at once. On the loop's
            # own thread nothing can answer: the wait runs out, the reading lands
            # before the loop looks, and the test's checks fail.
            self.answered.wait(30.0)
        return MemoryReading(81, 100, self.name)

    def close(self) -> None:
        self.answered.set()


def test_asyncio_task_samples_without_blocking_the_loop() -> None:
    async def main() -> tuple[PressureController, _HandshakeMonitor]:
        mon = _HandshakeMonitor(asyncio.get_running_loop(), asyncio.Event())
        ctrl = PressureController(mon, interval=0.01)
        changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        ctrl.on_change(lambda c: loop.call_soon_threadsafe(changed.set))
        task = asyncio.create_task(ctrl.run())
        await mon.reading.wait()  # the loop runs while the monitor is mid-read
        assert ctrl.mode is Mode.RELAXED
        mon.answered.set()
        await changed.wait()
        task.cancel()
        return ctrl, mon

    ctrl, mon = asyncio.run(main())
    assert ctrl.mode is Mode.PRESSURE
    assert threading.main_thread() not in mon.threads, "the monitor was read on the loop"


def test_bad_interval() -> None:
    with pytest.raises(ConfigError, match="interval"):
        PressureController(ScriptedMonitor(), interval=0)
