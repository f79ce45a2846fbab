"""The pressure controller: samples a monitor, walks the ladder, tells listeners.

Sampling runs in a daemon thread (:meth:`PressureController.start`) or as an
asyncio task (:meth:`PressureController.run`), which reads the monitor in a
worker thread so a slow driver call never stalls the event loop. Allocation
never waits on a reading: the manager only reads :attr:`mode`, a plain
attribute the sampler replaces. A monitor that raises keeps the current mode;
the error is logged (once per distinct message) and counted.

Listeners registered with :meth:`on_change` are called once per mode change,
on the sampling thread, outside the controller's lock; one that raises is
logged and counted and the others still run.

Mode changes are logged without flooding the log when the load swings across
a threshold: a change after a quiet spell is logged at once (WARNING when it
enters CRITICAL or EMERGENCY), and the changes that follow it within
``log_interval`` seconds are summarised in one line (how many, the range of
modes, the peak reading) when the interval ends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import AdmissionRejectedError, ConfigError
from kvtier.pressure.ladder import Ladder, Mode, ModeActions
from kvtier.pressure.monitor import MemoryMonitor, MemoryReading

log = logging.getLogger("kvtier.pressure")


@dataclass(frozen=True, slots=True)
class ModeChange:
    """A mode change, with the reading that caused it."""

    old: Mode
    new: Mode
    reading: MemoryReading
    time: float


@dataclass(frozen=True, slots=True)
class PressureStats:
    mode: Mode
    fraction: float
    source: str
    readings: int
    mode_changes: int
    monitor_errors: int
    callback_errors: int
    rejected: int
    last_error: str | None

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode.name,
            "fraction": self.fraction,
            "source": self.source,
            "readings": self.readings,
            "mode_changes": self.mode_changes,
            "monitor_errors": self.monitor_errors,
            "callback_errors": self.callback_errors,
            "rejected": self.rejected,
            "last_error": self.last_error,
        }


class _ModeLog:
    """Logs the first mode change of a quiet spell, then one summary per interval."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._window_start: float | None = None
        self._count = 0
        self._low: Mode | None = None
        self._high: Mode | None = None
        self._peak = 0.0

    def change(self, change: ModeChange, now: float) -> None:
        old, new, reading = change.old, change.new, change.reading
        if self._window_start is None or now - self._window_start >= self.interval:
            self.flush(now, new, force=True)
            self._window_start = now
            level = logging.WARNING if new >= Mode.CRITICAL and new > old else logging.INFO
            log.log(
                level,
                "memory pressure %s -> %s (%s at %.1f%%)%s",
                old.name,
                new.name,
                reading.source,
                100 * reading.fraction,
                " - new requests are held back or refused"
                if new is Mode.EMERGENCY
                else "",
            )
            return
        self._count += 1
        low = min(old, new)
        high = max(old, new)
        self._low = low if self._low is None else min(self._low, low)
        self._high = high if self._high is None else max(self._high, high)
        self._peak = max(self._peak, reading.fraction)

    def flush(self, now: float, mode: Mode, *, force: bool = False) -> None:
        if self._window_start is None or not self._count:
            return
        if not force and now - self._window_start < self.interval:
            return
        assert self._low is not None and self._high is not None
        level = logging.WARNING if self._high >= Mode.CRITICAL else logging.INFO
        log.log(
            level,
            "memory pressure changed mode %d more times in %.1f s, between %s and %s "
            "(peak %.1f%%); now %s. A load swinging across a threshold: widen "
            "--pressure-hysteresis if this repeats",
            self._count,
            now - self._window_start,
            self._low.name,
            self._high.name,
            100 * self._peak,
            mode.name,
        )
        self._window_start = now
        self._count = 0
        self._low = self._high = None
        self._peak = 0.0


class PressureController:
    """Turns readings of ``monitor`` into a :class:`Mode` and its :class:`ModeActions`."""

    def __init__(
        self,
        monitor: MemoryMonitor,
        ladder: Ladder | None = None,
        *,
        interval: float = 0.05,
        max_wait: float = 30.0,
        history: int = 1024,
        log_interval: float = 10.0,
    ) -> None:
        if not interval > 0:
            raise ConfigError(f"interval must be positive seconds, got {interval}")
        if not max_wait >= 0:
            raise ConfigError(f"max_wait must be non-negative seconds, got {max_wait}")
        self.monitor = monitor
        self.ladder = ladder or Ladder()
        self.interval = interval
        #: How long a caller that honours ``delay`` holds a new request back at most.
        self.max_wait = max_wait
        #: The current mode; replaced (never mutated) by the sampler.
        self.mode = Mode.RELAXED
        self.fraction = 0.0
        self.readings = 0
        self.mode_changes = 0
        self.monitor_errors = 0
        self.callback_errors = 0
        self.rejected = 0
        self.last_error: str | None = None
        #: The latest mode changes, oldest first.
        self.timeline: deque[ModeChange] = deque(maxlen=history)
        self._listeners: list[Callable[[ModeChange], None]] = []
        self._changed = threading.Condition()
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mode_log = _ModeLog(log_interval)

    # -- reading ----------------------------------------------------------------------
    @property
    def actions(self) -> ModeActions:
        return self.ladder.actions[self.mode]

    def on_change(self, callback: Callable[[ModeChange], None]) -> None:
        """Call ``callback(change)`` on every mode change (on the sampling thread)."""
        self._listeners.append(callback)

    def sample(self) -> Mode:
        """Take one reading and move along the ladder; returns the mode after it."""
        with self._sample_lock:  # the thread and a direct caller must not interleave
            try:
                reading = self.monitor.read()
            except Exception as exc:
                self.monitor_errors += 1
                message = f"{type(exc).__name__}: {exc}"
                if message != self.last_error:
                    log.warning(
                        "memory monitor %s failed (%s); the mode stays %s",
                        self.monitor.name,
                        message,
                        self.mode.name,
                    )
                self.last_error = message
                return self.mode
            self.readings += 1
            self.fraction = reading.fraction
            old = self.mode
            new = self.ladder.next_mode(old, reading.fraction)
            now = time.monotonic()
            if new is old:
                self._mode_log.flush(now, old)
                return old
            change = ModeChange(old, new, reading, now)
            with self._changed:
                self.mode = new
                self.mode_changes += 1
                self.timeline.append(change)
                self._changed.notify_all()
            self._mode_log.change(change, now)
            for callback in list(self._listeners):
                try:
                    callback(change)
                except Exception:
                    self.callback_errors += 1
                    log.exception("pressure listener %r raised on %s", callback, new.name)
            return new

    # -- admission ----------------------------------------------------------------------
    def check_admission(self) -> None:
        """Raise :class:`AdmissionRejectedError` unless the mode accepts new requests.

        Never blocks. ``error.retry`` says whether the mode delays (try again
        soon) rather than refuses.
        """
        mode = self.mode
        admission = self.ladder.actions[mode].admission
        if admission == "accept":
            return
        self.rejected += 1
        raise _rejection(mode, self.fraction, admission == "delay")

    def wait_admissible(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a mode that accepts; whether one came."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.ladder.actions[self.mode].admission != "accept":
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def admit(self, timeout: float = 0.0) -> None:
        """Wait up to ``timeout`` seconds in a delaying mode, then check admission."""
        if self.ladder.actions[self.mode].admission == "delay" and timeout > 0:
            self.wait_admissible(timeout)
        self.check_admission()

    # -- sampling loops ----------------------------------------------------------------
    def start(self) -> PressureController:
        """Sample every ``interval`` seconds in a daemon thread (first reading at once)."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="kvtier-pressure", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._thread = None

    def close(self) -> None:
        self.stop()
        try:
            self.monitor.close()
        except Exception:
            log.exception("closing memory monitor %s failed", self.monitor.name)

    async def run(self) -> None:
        """Sample every ``interval`` seconds until cancelled (asyncio users)."""
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.interval)

    def __enter__(self) -> PressureController:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> PressureStats:
        return PressureStats(
            mode=self.mode,
            fraction=self.fraction,
            source=self.monitor.name,
            readings=self.readings,
            mode_changes=self.mode_changes,
            monitor_errors=self.monitor_errors,
            callback_errors=self.callback_errors,
            rejected=self.rejected,
            last_error=self.last_error,
        )


def _rejection(mode: Mode, fraction: float, retry: bool) -> AdmissionRejectedError:
    what = "delays" if retry else "refuses"
    return AdmissionRejectedError(
        f"memory pressure is {mode.name} ({100 * fraction:.1f}% in use), which {what} new "
        "requests; retry when running requests finish, or raise the EMERGENCY threshold",
        mode=mode.name,
        retry=retry,
    )
