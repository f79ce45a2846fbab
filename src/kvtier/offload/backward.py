"""A tier load read back to front on a thread of its own, for load and compute together.

When a tier gives back a prefix about as fast as the model computes it,
neither loading it all nor computing it all is best: the engine computes the
prefix from its start while :class:`BackwardLoad` reads its blocks from the
far end towards the start (the block keys follow from the tokens, so the
order of reading is free), and the two meet in the middle. The reads land in
host memory here, unverified; :meth:`TierChain.install_backward
<kvtier.offload.chain.TierChain.install_backward>` checks each payload as
any load does and writes the ones the compute did not reach into the
request's device blocks.

What was read is always a run that ends at the prefix's last block
(:attr:`BackwardLoad.lowest` is where it starts): a block missing from the
medium or a failed read ends the load, since nothing before a hole can
join the run, and the compute then simply goes further.
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.offload.media import BlockStore, Stored

log = logging.getLogger("kvtier.offload")


class BackwardLoad:
    """Reads ``items`` (``(key, slot)``, in the prefix's order) from the last one back.

    Each medium call reads ``group`` items (a per-call latency is paid once
    per group). The thread stops after the call in flight when
    :meth:`stop` is called; :meth:`join` waits for it.
    """

    def __init__(
        self, medium: BlockStore, tier: int, items: list[tuple[int, int]], group: int
    ) -> None:
        self.medium = medium
        #: Index of the tier in its chain.
        self.tier = tier
        self.items = items
        self.group = max(1, group)
        #: Payloads read, by index into ``items`` (the run ``lowest ..`` the end).
        self.fetched: dict[int, Stored] = {}
        #: ``(blocks, seconds)`` per medium call that read all it asked for.
        self.reads: list[tuple[int, float]] = []
        #: Keys a failed check dropped from the tier (their pins went with them).
        self.dropped: set[int] = set()
        #: Why reading ended early (a medium error), if it did.
        self.error: BaseException | None = None
        self._lowest = len(items)
        #: When the medium call in flight began (``perf_counter``).
        self.call_started = time.perf_counter()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvtier-backward-load", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def lowest(self) -> int:
        """Index of the first item of the run read so far (``len(items)``: none yet)."""
        with self._lock:
            return self._lowest

    @property
    def done(self) -> bool:
        """Whether the thread has ended (all read, stopped, or a hole or error met)."""
        return self._done.is_set()

    def stop(self) -> None:
        """Ask the thread to end after the medium call in flight (never blocks)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Stop and wait for the thread; whether it ended."""
        self._stop.set()
        if self.thread.ident is not None:
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def wait_below(self, lowest: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the run to start before ``lowest`` (or the
        thread to end); whether it did."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._lowest < lowest or self._done.is_set(), timeout
            )

    def take(self, start: int) -> list[Stored]:
        """The payloads read for ``start`` .. the end (``start >= lowest``)."""
        with self._lock:
            assert start >= self._lowest
            return [self.fetched[i] for i in range(start, len(self.items))]

    def _run(self) -> None:
        hi = len(self.items)
        try:
            while hi > 0 and not self._stop.is_set():
                lo = max(0, hi - self.group)
                started = self.call_started = time.perf_counter()
                try:
                    got = self.medium.get(self.items[lo:hi])
                except Exception as exc:  # a failed read is a miss: the compute goes further
                    self.error = exc
                    return
                seconds = time.perf_counter() - started
                run: list[Stored] = []
                for item in reversed(got):
                    if item is None:
                        break
                    run.append(item)
                with self._changed:
                    for j, item in enumerate(run):
                        self.fetched[hi - 1 - j] = item
                    self._lowest = hi - len(run)
                    self._changed.notify_all()
                if len(run) == hi - lo:
                    self.reads.append((len(run), seconds))
                else:
                    return  # a hole: nothing before it can be used
                hi = lo
        except Exception:  # the load is only an optimisation: the compute covers anything lost
            log.exception("a backward tier load failed; the prefix is computed instead")
        finally:
            with self._changed:
                self._done.set()
                self._changed.notify_all()
