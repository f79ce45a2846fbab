"""Running an :class:`~kvtier.engine.Engine` on its own thread for concurrent callers.

The engine (and the manager under it) is single-threaded. :class:`EngineWorker`
owns it on one background thread: callers on any thread :meth:`~EngineWorker.submit`
requests and read their outputs from a :class:`RequestHandle`, synchronously
(iterate it) or from asyncio (:meth:`RequestHandle.stream`). Concurrent
requests queue and run together in the engine's batched steps; none can see
or corrupt another's blocks, since only the worker thread touches them.

No request can stop the thread: a request the engine refuses, or that fails
in a way nobody foresaw, fails alone (its handle gets an ``"error"`` output
and the traceback is logged). A step that raises fails the requests in
flight and the loop goes on. Should the loop itself die, the worker records
why (:attr:`EngineWorker.fatal`), fails every open handle and calls
``on_fatal``, so a server can report itself unhealthy and exit for its
supervisor to restart it.

The worker keeps what its steps cost (:class:`StepStats`: time in the
step, the part in the model's forward, the time between steps) and logs it
every :data:`STEP_LOG_INTERVAL_S` seconds of work.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.request import Sequence as Seq
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import KvTierError
from kvtier.hints import Hints

log = logging.getLogger(__name__)

#: How often an idle worker polls tier stores and prefetches in flight.
BACKGROUND_POLL_S = 0.005
#: How often a busy worker logs what its steps cost (seconds).
STEP_LOG_INTERVAL_S = 10.0

T = TypeVar("T")


def _left(callback: Callable[[], None] | None) -> None:
    """Run an :meth:`EngineWorker.on_leave` callback; its failure is logged, never raised
    into the thread that noticed the request leave."""
    if callback is None:
        return
    try:
        callback()
    except Exception:
        log.exception("a request's on_leave callback raised")


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]) -> None:
    """On the event loop: hand each output to its handle's queue, in order."""
    for q, out in items:
        q.put_nowait(out)


class StepStats:
    """What the worker's engine steps cost, summed since the worker started.

    ``step_seconds`` is the time inside ``Engine.step``; ``forward_seconds``
    the part of it in the model's forward (the rest is the engine's own work:
    scheduling, attention metadata, sampling, detokenizing; on an
    accelerator, work the forward queued without waiting counts there too).
    ``gap_seconds`` is the time between consecutive steps while requests
    were in flight: handing outputs to the server, taking new requests, and
    waiting for the interpreter lock the server's threads hold.
    """

    __slots__ = ("forward_seconds", "gap_seconds", "sequences", "step_seconds", "steps")

    def __init__(self) -> None:
        self.steps = 0
        self.sequences = 0
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        self.gap_seconds = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {s: getattr(self, s) for s in self.__slots__}

    def since(self, before: StepStats) -> str:
        """One log line on the steps after ``before`` (an earlier copy)."""
        n = self.steps - before.steps
        step = (self.step_seconds - before.step_seconds) / n
        forward = (self.forward_seconds - before.forward_seconds) / n
        gap = (self.gap_seconds - before.gap_seconds) / n
        seqs = (self.sequences - before.sequences) / n
        return (
            f"{n} steps of {seqs:.1f} sequences on average: {1e3 * step:.1f} ms a step, "
            f"{1e3 * forward:.1f} ms of it in the model's forward and {1e3 * (step - forward):.1f} "
            f"ms ({100 * (step - forward) / step if step else 0.0:.1f}%) in the engine; "
            f"{1e3 * gap:.1f} ms between steps"
        )

    def copy(self) -> StepStats:
        other = StepStats()
        for name in self.__slots__:
            setattr(other, name, getattr(self, name))
        return other


class RequestHandle:
    """The outputs of one submitted request, in order; the last has ``finished`` set."""

    def __init__(self, worker: EngineWorker, request_id: str, n: int = 1) -> None:
        self.request_id = request_id
        #: Choices the request generates; it is finished once each has finished.
        self.n = n
        self._open = n  # choices not yet finished, as the reader saw them
        #: Choices not yet finished, as the worker thread delivered them.
        self._undelivered = n
        self._worker = worker
        self._sync: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._sink: Callable[[RequestOutput], None] = self._sync.put
        self._async: asyncio.Queue[RequestOutput] | None = None
        #: The loop :meth:`bind_loop` delivers to, and the sink it installed for it.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_sink: Callable[[RequestOutput], None] | None = None
        self.finished = False

    def _deliver(self, out: RequestOutput) -> None:
        self._sink(out)

    def _take(self, out: RequestOutput) -> None:
        """Account for ``out`` on the reading side; the last choice's end finishes the handle."""
        if out.finished:
            self._open -= 1
            self.finished = self._open <= 0

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver outputs to an asyncio queue on ``loop`` (call before the first output)."""
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._async = q

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(q.put_nowait, out)

        self._sink = self._loop_sink = sink
        self._loop = loop

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._async is not None:
            raise KvTierError("this handle delivers to asyncio: use `async for` on stream()")
        while not self.finished:
            out = self._sync.get()
            self._take(out)
            yield out

    async def stream(self) -> AsyncGenerator[RequestOutput, None]:
        """The outputs, for asyncio callers (after :meth:`bind_loop`)."""
        q = self._async
        if q is None:
            raise KvTierError("call bind_loop() before stream()")
        try:
            while not self.finished:
                out = await q.get()
                self._take(out)
                yield out
        finally:
            if not self.finished:  # the consumer went away (client disconnected)
                self.cancel()

    def result(self) -> tuple[str, RequestOutput]:
        """Block until the request finishes; returns choice 0's text and its last output."""
        parts: list[str] = []
        last: RequestOutput | None = None
        for out in self:
            if out.index == 0:
                parts.append(out.text)
                if out.finished:
                    last = out
        assert last is not None
        return "".join(parts), last

    def cancel(self) -> None:
        self._worker.cancel(self.request_id)


class EngineWorker:
    """Owns an engine on a background thread; thread-safe submit and cancel."""

    def __init__(
        self,
        engine: Engine,
        *,
        name: str = "kvtier-engine",
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        #: Why the worker thread died (``None`` while it runs or after a clean stop).
        self.fatal: BaseException | None = None
        self._on_fatal = on_fatal
        self._cv = threading.Condition()
        self._background_failed = False
        self._inbox: list[tuple[Seq, RequestHandle]] = []
        self._cancels: list[str] = []
        self._handles: dict[str, RequestHandle] = {}
        self._calls: list[Callable[[Engine], None]] = []
        #: Requests that moved to another engine: how to cancel them there.
        self._moved: dict[str, Callable[[], None]] = {}
        #: What to call once a request leaves this worker (:meth:`on_leave`).
        self._on_leave: dict[str, Callable[[], None]] = {}
        self._stop = False
        self._ids = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.step_errors = 0
        #: What the steps cost (written by the worker thread only).
        self.step_stats = StepStats()

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
        return self._thread.is_alive() and self.fatal is None

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished (queued or running)."""
        with self._cv:
            return len(self._handles)

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        mm: Any = None,
        hints: Hints | Mapping[str, object] | None = None,
        cache_salt: str | None = None,
    ) -> RequestHandle:
        """Queue a request. Bad input raises :class:`BadRequestError` here, in the caller.

        ``mm`` is the prompt's images (:meth:`Engine.encode_multimodal_chat`);
        ``cache_salt`` limits prefix sharing to requests with the same salt.
        """
        with self._cv:
            if self._stop or self.fatal is not None:
                raise KvTierError("the engine worker is stopped")
            self._ids += 1
            rid = f"req-{self._ids}"
        # Checked and built here, in the caller's thread: the processor reads
        # configuration only, and the engine thread just queues the result.
        seq = self.engine.processor.process(
            prompt_ids,
            params,
            rid,
            arrival_time=time.perf_counter(),
            mm=mm,
            hints=hints,
            cache_salt=cache_salt,
            hints_field="kvtier",
        )
        with self._cv:
            if self._stop or self.fatal is not None:
                raise KvTierError("the engine worker is stopped")
            handle = RequestHandle(self, rid, params.n)
            if loop is not None:
                handle.bind_loop(loop)
            self._handles[rid] = handle
            self._inbox.append((seq, handle))
            self._cv.notify()
        return handle

    def cancel(self, request_id: str) -> None:
        with self._cv:
            moved = self._moved.get(request_id)
            if moved is None:
                self._cancels.append(request_id)
                self._cv.notify()
        if moved is not None:
            moved()

    # -- requests that move between engines (kvtier.engine.migrate) ---------------------
    def open_handle(
        self,
        n: int = 1,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        sink: Callable[[RequestOutput], None] | None = None,
    ) -> RequestHandle:
        """A handle under a fresh id for a request that arrives by other means than submit.

        ``sink`` receives its outputs instead of the handle's own queue.
        """
        with self._cv:
            if self._stop or self.fatal is not None:
                raise KvTierError("the engine worker is stopped")
            self._ids += 1
            handle = RequestHandle(self, f"req-{self._ids}", n)
            if loop is not None:
                handle.bind_loop(loop)
            if sink is not None:
                handle._sink = sink
            self._handles[handle.request_id] = handle
        return handle

    def close_handle(self, handle: RequestHandle) -> None:
        """Forget a handle :meth:`open_handle` gave whose request never started."""
        with self._cv:
            self._handles.pop(handle.request_id, None)
            left = self._on_leave.pop(handle.request_id, None)
        _left(left)

    def forward(self, request_id: str, cancel: Callable[[], None]) -> None:
        """``request_id`` now runs elsewhere: :meth:`cancel` calls ``cancel`` instead."""
        with self._cv:
            self._moved[request_id] = cancel
            left = self._on_leave.pop(request_id, None)
        _left(left)

    def on_leave(self, request_id: str, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once when ``request_id`` leaves this worker, on whichever
        thread that happens: its last output handed out (finished, cancelled or failed),
        its handle closed, or the request moved to another engine (:meth:`forward`). At once
        when it already left. A later registration for the same request replaces the earlier.
        """
        with self._cv:
            if request_id in self._handles and request_id not in self._moved:
                self._on_leave[request_id] = callback
                return
        _left(callback)

    def blocks_held(
        self, request_ids: Collection[str], timeout: float | None = 30.0
    ) -> tuple[int, int]:
        """The distinct device KV blocks the queued choices of ``request_ids`` hold (a block
        two of them share counts once), and the device pool's block count; read between
        steps on the worker thread (see :meth:`call` for ``timeout``)."""
        wanted = tuple(request_ids)

        def read(engine: Engine) -> tuple[int, int]:
            manager = engine.manager
            blocks: set[int] = set()
            for rid in wanted:
                for seq in engine.queues.group(rid):
                    if seq.seq_id in manager:
                        blocks.update(manager.held_blocks(seq.seq_id))
            return len(blocks), manager.num_blocks

        return self.call(read, timeout)

    def deliver(self, outs: Sequence[RequestOutput]) -> None:
        """Hand outputs produced elsewhere (by a moved request) to their handles; any thread."""
        for out in outs:
            if out.finished:
                with self._cv:
                    self._moved.pop(out.request_id, None)
        self._dispatch(list(outs))

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
        try:
            self._serve()
        except BaseException as exc:  # the loop itself broke: nothing may hang on it
            self.fatal = exc
            log.critical("the engine thread died; failing every request", exc_info=exc)
            self._shutdown(f"the engine failed: {type(exc).__name__}: {exc}")
            if self._on_fatal is not None:
                try:
                    self._on_fatal(exc)
                except Exception:
                    log.exception("the engine's on_fatal callback raised")
            return
        self._shutdown("the engine is shutting down")

    def _serve(self) -> None:
        engine = self.engine
        runner = engine.runner
        stats = self.step_stats
        logged, logged_at = stats.copy(), time.perf_counter()
        last_end: float | None = None  # when the previous step ended, while busy
        while True:
            with self._cv:
                while not (
                    self._stop
                    or self._inbox
                    or self._cancels
                    or self._calls
                    or engine.has_unfinished()
                ):
                    if self._background_failed:
                        self._cv.wait()
                        continue
                    if engine.background_pending():
                        # Idle, but tier stores or prefetches are in flight: keep them
                        # moving so the next agent's blocks are back before its request.
                        self._cv.wait(BACKGROUND_POLL_S)
                    else:
                        # Nothing in flight: sleep until a paused session's prefetch is
                        # due (if one is), or until something arrives.
                        due = engine.background_due_in()
                        if due is None:
                            self._cv.wait()
                            continue
                        if due > 0.0 and self._cv.wait(due):
                            continue  # woken by work: look at it first
                    try:
                        engine.poll_background()
                    except Exception:  # never the worker's end; requests still poll it
                        self._background_failed = True
                        log.exception("idle background polling failed; it stops until restart")
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                calls, self._calls = self._calls, []
            for task in calls:
                task(engine)
            for seq, handle in inbox:
                try:
                    engine.enqueue(seq)
                except KvTierError as exc:
                    self._fail(handle, str(exc))
                except Exception as exc:  # a bug, but this request's alone
                    log.exception("adding request %s failed", handle.request_id)
                    self._fail(handle, f"{type(exc).__name__}: {exc}")
            for rid in cancels:
                engine.cancel(rid)
            if not engine.has_unfinished():
                last_end = None
                continue
            forward, passes = runner.forward_seconds, runner.pass_sequences
            started = time.perf_counter()
            if last_end is None and started - logged_at >= STEP_LOG_INTERVAL_S:
                logged, logged_at = stats.copy(), started  # a busy spell starts after idling
            try:
                outs = engine.step()
            except Exception as exc:
                self.step_errors += 1
                log.exception("engine step failed; failing the requests in flight")
                outs = engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            ended = time.perf_counter()
            stats.steps += 1
            stats.sequences += runner.pass_sequences - passes
            stats.step_seconds += ended - started
            stats.forward_seconds += runner.forward_seconds - forward
            if last_end is not None:
                stats.gap_seconds += started - last_end
            last_end = ended
            self._dispatch(outs)
            if ended - logged_at >= STEP_LOG_INTERVAL_S:
                if stats.steps > logged.steps:
                    log.info("engine: %s", stats.since(logged))
                logged, logged_at = stats.copy(), ended

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        # A step's outputs for asyncio handles reach each event loop in one wake-up, not
        # one per stream: with many streams the wake-ups cost the loop more than the tokens.
        batches: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]
        ] = {}
        for out in outs:
            target = self._handles.get(out.request_id)
            if target is None:
                continue
            if out.finished:
                target._undelivered -= 1
                if target._undelivered <= 0:
                    with self._cv:
                        self._handles.pop(out.request_id, None)
                        left = self._on_leave.pop(out.request_id, None)
                    _left(left)
            loop, q = target._loop, target._async
            if loop is not None and q is not None and target._sink is target._loop_sink:
                batches.setdefault(loop, []).append((q, out))
            else:
                target._deliver(out)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail(self, handle: RequestHandle, message: str) -> None:
        from kvtier.engine.engine import RequestMetrics

        with self._cv:
            self._handles.pop(handle.request_id, None)
            left = self._on_leave.pop(handle.request_id, None)
        _left(left)
        for i in range(handle.n):
            handle._deliver(
                RequestOutput(
                    handle.request_id,
                    "",
                    [],
                    True,
                    "error",
                    RequestMetrics(0.0, 0),
                    message,
                    index=i,
                )
            )

    def _shutdown(self, message: str) -> None:
        with self._cv:
            self._stop = True
            calls, self._calls = self._calls, []
            inbox, self._inbox = self._inbox, []
            handles = list(self._handles.values())
        for task in calls:
            task(self.engine)
        for _, handle in inbox:
            self._fail(handle, message)
        for handle in handles:
            self._fail(handle, message)
