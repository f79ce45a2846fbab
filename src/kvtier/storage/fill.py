"""Blocks filled layer by layer while a forward pass reads them.

A prefix loaded from a tier does not have to be in place whole before the
forward pass that needs it starts: the pass reads layer ``l``'s K/V only at
layer ``l``. A :class:`LayerFill` is one load in flight, its copies grouped
by layer and made in layer order, with a point per layer that says the
layer has landed; the storage's row reads and writes of a layer wait for
that point (:meth:`KVBlockStorage.begin_fill
<kvtier.storage.device.KVBlockStorage.begin_fill>`), so the first layers
compute while the later ones are still being copied.

* On a CUDA device the copies go out at once on a stream of their own, an
  event recorded after each layer; a read makes the reading stream wait for
  its layer's event (the host does not block). A copy whose two sides are
  contiguous is one ``copy_``; a layer's slice of a run of blocks is strided
  on both sides (each block holds every layer), which ``cudaMemcpy2DAsync``
  moves as one copy when the CUDA runtime library can be loaded, and
  ``copy_`` otherwise (correct, but through a staging copy). Rows bound for
  blocks that are not consecutive cross into a device buffer in one copy
  and are placed with one ``index_copy_``.
* For blocks in host memory a thread makes the copies, setting an event per
  layer; a read blocks until its layer's is set.

:meth:`LayerFill.settle` waits for every copy (the engine calls it once its
forward pass is done; anything else that reads or writes whole blocks
settles first). A fill that failed raises :class:`InternalInvariantError`
from the wait that finds it, so no layer is read half written.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtier.errors import InternalInvariantError

#: One copy, uint8: ``(dst, src, None)`` copies ``src`` into ``dst`` (the same shape);
#: ``(dst, src, rows)`` copies row ``i`` of ``src`` into row ``rows[i]`` of ``dst``
#: (``rows``: int64 on ``dst``'s device), for blocks that are not consecutive.
Copy = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class LayerFill:
    """Copies into device blocks grouped by layer (see the module docstring).

    ``copies[l]`` are layer ``l``'s copies. Nothing moves before :meth:`start`.
    """

    def __init__(self, copies: Sequence[Sequence[Copy]], device: torch.device) -> None:
        self.copies = [list(c) for c in copies]
        self.device = device
        self.num_layers = len(self.copies)
        #: Reads that found their layer not yet in place and waited (host memory only;
        #: a CUDA read never blocks the host).
        self.blocked_reads = 0
        self._started = False
        self._settled = False
        self._error: BaseException | None = None
        #: The layer whose copies failed (it and the later ones never landed).
        self._failed_at = self.num_layers
        self._waited = [False] * self.num_layers
        self._landed = [threading.Event() for _ in range(self.num_layers)]
        self._thread: threading.Thread | None = None
        self._events: list[torch.cuda.Event] = []
        #: How the CUDA copies went: one contiguous copy, one 2-D copy, or staged.
        self.copies_by_kind: dict[str, int] = {}
        # Device buffers the stream's copies still use, kept until the fill settles.
        self._buffers: list[torch.Tensor] = []

    # -- the writer's side ----------------------------------------------------------------
    def start(self) -> LayerFill:
        if self._started:
            raise InternalInvariantError("a layer fill was started twice")
        self._started = True
        if self.device.type == "cuda":
            self._start_cuda()
        else:
            self._thread = threading.Thread(target=self._run, name="kvtier-layer-fill", daemon=True)
            self._thread.start()
        return self

    def _start_cuda(self) -> None:
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        # The copies come after whatever the pass's stream queued for these blocks.
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for layer in range(self.num_layers):
                for dst, src, rows in self.copies[layer]:
                    if rows is not None:
                        # Rows scattered on the device: across in one copy, then placed.
                        staged = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                        self._buffers.append(staged)
                        kind = copy_async(staged, src, stream)
                        dst.index_copy_(0, rows, staged)
                    else:
                        kind = copy_async(dst, src, stream)
                    self.copies_by_kind[kind] = self.copies_by_kind.get(kind, 0) + 1
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                self._events.append(event)

    def _run(self) -> None:
        layer = 0
        try:
            for layer in range(self.num_layers):
                self._copy_layer(layer)
                self._landed[layer].set()
        except BaseException as exc:  # reported by the reader's wait, never lost
            self._error = exc
            self._failed_at = layer
            for event in self._landed:
                event.set()

    def _copy_layer(self, layer: int) -> None:
        for dst, src, rows in self.copies[layer]:
            if rows is None:
                dst.copy_(src)
            else:
                dst.index_copy_(0, rows, src)

    # -- the reader's side ----------------------------------------------------------------
    def wait(self, layer: int) -> None:
        """Layer ``layer`` is in place for the caller once this returns (on CUDA: for work
        the current stream queues from now on)."""
        if self._waited[layer]:
            return
        if self._events:
            torch.cuda.current_stream(self.device).wait_event(self._events[layer])
        else:
            landed = self._landed[layer]
            if not landed.is_set():
                self.blocked_reads += 1
                landed.wait()
            if layer >= self._failed_at:
                self._raise_failure()
        self._waited[layer] = True

    def settle(self) -> None:
        """Wait for every copy (the host blocks); the sources may then be reused."""
        if self._settled or not self._started:
            return
        self._settled = True
        if self._events:
            self._events[-1].synchronize()
            self._buffers.clear()
        elif self._thread is not None:
            self._thread.join()
        self._raise_failure()

    @property
    def done(self) -> bool:
        """Whether every copy has landed (never blocks)."""
        if self._events:
            return bool(self._events[-1].query())  # type: ignore[no-untyped-call]
        return self._settled or self._landed[-1].is_set()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise InternalInvariantError(
                f"a layer-by-layer load failed: {type(self._error).__name__}: {self._error}"
            ) from self._error


def copy_async(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> str:
    """``dst.copy_(src)`` on ``stream``; one 2-D copy where both sides are rows of bytes at a
    stride (a layer's slice of a run of blocks). Returns how it went: ``"1d"``, ``"2d"`` or
    ``"staged"`` (``copy_`` of a strided tensor, through a contiguous copy)."""
    if dst.is_contiguous() and src.is_contiguous():
        dst.copy_(src, non_blocking=True)
        return "1d"
    lib = _cudart()
    if lib is not None and _pitched(dst) and _pitched(src) and dst.shape == src.shape:
        rc = lib.cudaMemcpy2DAsync(
            ctypes.c_void_p(dst.data_ptr()),
            ctypes.c_size_t(dst.stride(0) * dst.element_size()),
            ctypes.c_void_p(src.data_ptr()),
            ctypes.c_size_t(src.stride(0) * src.element_size()),
            ctypes.c_size_t(dst.shape[1] * dst.element_size()),
            ctypes.c_size_t(dst.shape[0]),
            ctypes.c_int(_MEMCPY_DEFAULT),
            ctypes.c_void_p(stream.cuda_stream),
        )
        if rc == 0:
            return "2d"
    dst.copy_(src, non_blocking=True)
    return "staged"


#: ``cudaMemcpyDefault``: the direction from the pointers (unified addressing).
_MEMCPY_DEFAULT = 4


def _pitched(t: torch.Tensor) -> bool:
    """Rows of contiguous elements at a fixed stride: what one 2-D copy moves."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (``None`` when there is none to call).

    The one already in the process, found in ``/proc/self/maps``, so the copy
    runs in torch's own runtime, with its streams.
    """
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # type: ignore[no-untyped-call]
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "libcudart" in line})
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            lib.cudaMemcpy2DAsync.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None
