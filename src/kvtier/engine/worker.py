"""Running an :class:`~kvtier.engine.Engine` on its own thread for concurrent callers.

The engine (and the manager under it) is single-threaded. :class:`EngineWorker`
owns it on one background thread: callers on any thread :meth:`~EngineWorker.submit`
requests and read their outputs from a :class:`RequestHandle`, synchronously
(iterate it) or from asyncio (:meth:`RequestHandle.stream`). Concurrent
requests queue and are interleaved by the engine's round-robin steps; none
can see or corrupt another's blocks, since only the worker thread touches them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any, TypeVar

from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import KvTierError

log = logging.getLogger(__name__)

T = TypeVar("T")


class RequestHandle:
    """The outputs of one submitted request, in order; the last has ``finished`` set."""

    def __init__(self, worker: EngineWorker, request_id: str) -> None:
        self.request_id = request_id
        self._worker = worker
        self._sync: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._sink: Callable[[RequestOutput], None] = self._sync.put
        self._async: asyncio.Queue[RequestOutput] | None = None
        self.finished = False

    def _deliver(self, out: RequestOutput) -> None:
        self._sink(out)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver outputs to an asyncio queue on ``loop`` (call before the first output)."""
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._async = q

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(q.put_nowait, out)

        self._sink = sink

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._async is not None:
            raise KvTierError("this handle delivers to asyncio: use `async for` on stream()")
        while not self.finished:
            out = self._sync.get()
            self.finished = out.finished
            yield out

    async def stream(self) -> AsyncGenerator[RequestOutput, None]:
        """The outputs, for asyncio callers (after :meth:`bind_loop`)."""
        q = self._async
        if q is None:
            raise KvTierError("call bind_loop() before stream()")
        try:
            while not self.finished:
                out = await q.get()
                self.finished = out.finished
                yield out
        finally:
            if not self.finished:  # the consumer went away (client disconnected)
                self.cancel()

    def result(self) -> tuple[str, RequestOutput]:
        """Block until the request finishes; returns all its text and the last output."""
        parts: list[str] = []
        last: RequestOutput | None = None
        for out in self:
            parts.append(out.text)
            last = out
        assert last is not None
        return "".join(parts), last

    def cancel(self) -> None:
        self._worker.cancel(self.request_id)


class EngineWorker:
    """Owns an engine on a background thread; thread-safe submit and cancel."""

    def __init__(self, engine: Engine, *, name: str = "kvtier-engine") -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[tuple[list[int], SamplingParams, RequestHandle, float]] = []
        self._cancels: list[str] = []
        self._handles: dict[str, RequestHandle] = {}
        self._calls: list[Callable[[Engine], None]] = []
        self._stop = False
        self._ids = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.step_errors = 0

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> EngineWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestHandle:
        """Queue a request. Bad input raises :class:`BadRequestError` here, in the caller."""
        ids = list(prompt_ids)
        self.engine.check_request(ids, params)  # reads configuration only: thread-safe
        with self._cv:
            if self._stop:
                raise KvTierError("the engine worker is stopped")
            self._ids += 1
            handle = RequestHandle(self, f"req-{self._ids}")
            if loop is not None:
                handle.bind_loop(loop)
            self._handles[handle.request_id] = handle
            self._inbox.append((ids, params, handle, time.perf_counter()))
            self._cv.notify()
        return handle

    def cancel(self, request_id: str) -> None:
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify()

    def call(self, fn: Callable[[Engine], T], timeout: float | None = 30.0) -> T:
        """Run ``fn(engine)`` between steps on the worker thread; returns its result.

        Raises :class:`KvTierError` if the worker is stopped or ``fn`` has not
        run within ``timeout`` seconds.
        """
        done = threading.Event()
        box: list[Any] = []

        def task(engine: Engine) -> None:
            try:
                box.append((True, fn(engine)))
            except BaseException as exc:
                box.append((False, exc))
            done.set()

        with self._cv:
            if self._stop or not self._thread.is_alive():
                raise KvTierError("the engine worker is stopped")
            self._calls.append(task)
            self._cv.notify()
        if not done.wait(timeout):
            raise KvTierError(f"the engine worker did not answer within {timeout} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not (
                    self._stop
                    or self._inbox
                    or self._cancels
                    or self._calls
                    or engine.has_unfinished()
                ):
                    self._cv.wait()
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                calls, self._calls = self._calls, []
            for task in calls:
                task(engine)
            for ids, params, handle, arrival in inbox:
                try:
                    engine.add_request(ids, params, handle.request_id, arrival_time=arrival)
                except KvTierError as exc:
                    self._fail(handle, str(exc))
            for rid in cancels:
                engine.cancel(rid)
            if not engine.has_unfinished():
                continue
            try:
                outs = engine.step()
            except Exception:
                self.step_errors += 1
                log.exception("engine step failed")
                outs = []
            for out in outs:
                target = self._handles.get(out.request_id)
                if target is None:
                    continue
                if out.finished:
                    del self._handles[out.request_id]
                target._deliver(out)
        self._shutdown()

    def _fail(self, handle: RequestHandle, message: str) -> None:
        from kvtier.engine.engine import RequestMetrics

        self._handles.pop(handle.request_id, None)
        handle._deliver(
            RequestOutput(handle.request_id, "", [], True, "error", RequestMetrics(0.0, 0), message)
        )

    def _shutdown(self) -> None:
        with self._cv:
            calls, self._calls = self._calls, []
        for task in calls:
            task(self.engine)
        for handle in list(self._handles.values()):
            self._fail(handle, "the engine is shutting down")
        self._handles.clear()
