"""Codecs for stored KV blocks, and the header plus checksum every stored block carries.

A block leaves the device as one tensor ``[layers, 2, block_size, heads,
head_dim]``. A codec turns it into a flat uint8 *payload* and back:

* ``raw``: the bytes as they are (lossless);
* ``int8``: symmetric int8 with one float32 scale per (layer, K/V, head),
  taken over the block's tokens and head dimension (4x smaller than fp32);
* ``fp8``: float8 e4m3 with the same per-head scales (the scale maps the
  head's largest magnitude to e4m3's largest finite value, 448).

Every stored block is ``header + payload``. The header (:data:`HEADER_SIZE`
bytes) records the format version, the block key, the storage dtype, the
block shape, the codec, the payload length and an xxh3-64 checksum of the
payload seeded with the key, and ends with a checksum of its own bytes. So a
truncated file, a flipped bit, a block read back under another key, or one
written for another model layout fails :func:`verify` with a
:class:`~kvtier.CorruptBlockError`; tiers count that and treat it as a miss.

A medium that is this process's own memory (the host tier) may store a
payload *unchecked* (:data:`FLAG_UNCHECKED` in the header, no payload
checksum): nothing outside the process writes those bytes, so a checksum
would guard them against nothing the device's own blocks are not exposed to
as well, and it costs as much as the copy. The header is still checked
(key, layout, length), and an unchecked header is accepted only from such a
medium (``in_process=True``); anywhere else it is corrupt.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import xxhash

from kvtier.errors import ConfigError, CorruptBlockError

FORMAT_VERSION = 1
_MAGIC = b"KVTB"
# magic, version, codec id, dtype id, ndim, flags, 6 dims, key (lo, hi), payload length,
# checksum. The flags byte was padding before it had a use, so older headers read as 0.
_HEAD = struct.Struct("<4sHBBBB2x6I2QQQ")
#: Header flag: the payload carries no checksum (an in-process medium stored it).
FLAG_UNCHECKED = 1
_CHECK = struct.Struct("<I")
#: Bytes of a stored block's header.
HEADER_SIZE = _HEAD.size + _CHECK.size
#: Where the header keeps the payload's length (8 bytes, little-endian): a medium
#: holding payloads in fixed-size slots reads it to hand back just the payload.
PAYLOAD_LENGTH_OFFSET = _HEAD.size - 16
_MASK64 = (1 << 64) - 1
_MASK128 = (1 << 128) - 1
#: Where the key's 16 bytes start (after magic, version, ids, ndim, flags and the dims).
_KEY_AT = struct.calcsize("<4sHBBBB2x6I")
_CODEC_AT = struct.calcsize("<4sH")
# ctypes calls release the GIL (a memoryview slice assignment holds it).
_memmove = ctypes.memmove
_ZEROS = (0,) * 6

_DTYPES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.uint8: 6,
}
_DTYPE_BY_ID = {v: k for k, v in _DTYPES.items()}
#: The dtypes a block header can name (what any medium can hold).
HEADER_DTYPES: frozenset[torch.dtype] = frozenset(_DTYPES)


def payload_checksum(key: int, payload: memoryview | bytes | bytearray) -> int:
    """xxh3-64 of ``payload`` seeded with the low 64 bits of ``key``.

    One call over the whole buffer: xxh3 runs at several times memory-copy
    speed, so the checksum costs a fraction of the copy it guards.
    """
    return int(xxhash.xxh3_64_intdigest(payload, key & _MASK64))


#: Bytes :func:`copy_checksum` copies before it hashes them: small enough that the
#: hash reads them back from this core's cache, large enough that the per-chunk
#: calls cost little next to the copy.
COPY_CHUNK = 128 << 10


def copy_checksum(key: int, src: torch.Tensor, dst: torch.Tensor) -> int:
    """Copy ``src`` into ``dst`` and return :func:`payload_checksum` of the bytes.

    Both are contiguous uint8 CPU tensors of one length. One pass: each chunk
    is hashed from ``dst`` right after it is copied, while it is still in
    cache, so the checksum costs a fraction of hashing the block from memory
    after the copy; xxh3 streamed over the chunks gives the one-shot digest,
    so stored checksums do not depend on how they were taken. What is hashed
    is what landed in ``dst``. Neither the copies nor the hashing hold the
    GIL, so background transfers keep running meanwhile.
    """
    n = int(src.numel())
    if int(dst.numel()) != n or src.dtype != torch.uint8 or dst.dtype != torch.uint8:
        raise ValueError(
            f"copy_checksum copies uint8 tensors of one length, got {src.dtype} x {n} "
            f"and {dst.dtype} x {dst.numel()}"
        )
    if not dst.is_contiguous():
        raise ValueError("copy_checksum copies into a contiguous tensor")
    if not src.is_contiguous():
        dst.copy_(src.reshape(dst.shape))
        return payload_checksum(key, as_buffer(dst))
    h = payload_hasher(key)
    if n == 0:
        return int(h.intdigest())
    out = as_buffer(dst)
    s, d = src.data_ptr(), dst.data_ptr()
    for at in range(0, n, COPY_CHUNK):
        size = min(COPY_CHUNK, n - at)
        _memmove(d + at, s + at, size)
        h.update(out[at : at + size])
    return int(h.intdigest())


def payload_hasher(key: int) -> xxhash.xxh3_64:
    """A streaming :func:`payload_checksum` of block ``key``: ``update`` it with the payload's
    bytes in order, then ``intdigest()``."""
    return xxhash.xxh3_64(seed=key & _MASK64)


#: Below this many bytes a batch's checksums are taken on the calling thread:
#: handing work to the pool costs more than it saves.
PARALLEL_MIN_BYTES = 1 << 20
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def checksum_workers() -> int:
    """Threads :func:`checksum_pool` runs: one per usable core, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def checksum_pool() -> ThreadPoolExecutor | None:
    """The shared threads that checksum large batches, or ``None`` on a single core.

    xxhash releases the GIL while it digests a large buffer, so a batch's
    blocks hash on several cores at once, and beside the copies in flight.
    """
    global _pool
    if _pool is None:
        workers = checksum_workers()
        if workers < 2:
            return None
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtier-checksum")
    return _pool


def _forget_pool() -> None:
    # A forked child has none of the parent's threads: it starts a pool of its own.
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def as_buffer(payload: torch.Tensor) -> memoryview:
    """A uint8 tensor's bytes as a memoryview: without a copy on the CPU, copied from a GPU."""
    if payload.device.type != "cpu":
        payload = payload.cpu()
    return memoryview(payload.numpy()).cast("B")  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What :func:`verify` checks before a stored block is decoded."""

    key: int
    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload_len: int
    checksum: int
    version: int = FORMAT_VERSION
    flags: int = 0

    @property
    def unchecked(self) -> bool:
        """Whether the payload was stored without a checksum (an in-process medium)."""
        return bool(self.flags & FLAG_UNCHECKED)

    def pack(self) -> bytes:
        dims = list(self.shape) + [0] * (6 - len(self.shape))
        head = _HEAD.pack(
            _MAGIC,
            self.version,
            self.codec_id,
            _DTYPES[self.dtype],
            len(self.shape),
            self.flags,
            *dims,
            self.key & _MASK64,
            (self.key >> 64) & _MASK64,
            self.payload_len,
            self.checksum,
        )
        return head + _CHECK.pack(xxhash.xxh32_intdigest(head))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> BlockHeader:
        """Parse and self-check a header; :class:`CorruptBlockError` if it is damaged."""
        if len(data) < HEADER_SIZE:
            raise CorruptBlockError(f"stored block is {len(data)} bytes, shorter than a header")
        head = bytes(data[: _HEAD.size])
        (check,) = _CHECK.unpack_from(data, _HEAD.size)
        if xxhash.xxh32_intdigest(head) != check:
            raise CorruptBlockError("stored block header fails its checksum")
        magic, version, codec_id, dtype_id, ndim, flags, *rest = _HEAD.unpack(head)
        if magic != _MAGIC:
            raise CorruptBlockError("stored block does not start with the kvtier magic")
        if version != FORMAT_VERSION:
            raise CorruptBlockError(
                f"stored block has format version {version}; this kvtier reads {FORMAT_VERSION}"
            )
        dims, (lo, hi, payload_len, checksum) = rest[:6], rest[6:]
        if dtype_id not in _DTYPE_BY_ID or not 0 < ndim <= 6:
            raise CorruptBlockError("stored block header names an unknown dtype or shape")
        return cls(
            key=lo | (hi << 64),
            codec_id=codec_id,
            dtype=_DTYPE_BY_ID[dtype_id],
            shape=tuple(dims[:ndim]),
            payload_len=payload_len,
            checksum=checksum,
            version=version,
            flags=flags,
        )


class Codec(Protocol):
    """Turns a block tensor into a uint8 payload and back."""

    name: ClassVar[str]
    codec_id: ClassVar[int]

    def payload_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int: ...

    def encode(self, block: torch.Tensor) -> torch.Tensor: ...

    def decode(
        self, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor: ...


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class RawCodec:
    """The block's bytes unchanged; decoding returns a view of the payload."""

    name: ClassVar[str] = "raw"
    codec_id: ClassVar[int] = 0

    def payload_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return _numel(shape) * dtype.itemsize

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        return block.contiguous().view(-1).view(torch.uint8)

    def decode(
        self, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        return payload.view(dtype).view(shape)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload.view(out.dtype).view(out.shape))


class ScaledCodec:
    """Per-(layer, K/V, head) scaled quantization; subclasses pick the element type."""

    name: ClassVar[str] = "scaled"
    codec_id: ClassVar[int] = -1
    qdtype: ClassVar[torch.dtype] = torch.int8
    qmax: ClassVar[float] = 127.0

    def payload_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        layers, two, _, heads, _ = shape
        return _numel(shape) + 4 * layers * two * heads

    def quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        """Float values already divided by their scale, as ``qdtype`` (rounded, clamped)."""
        raise NotImplementedError

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        if block.dim() != 5:
            raise ConfigError(
                f"{self.name} codec needs blocks shaped [layers, 2, block_size, heads, dim], "
                f"got {list(block.shape)}"
            )
        x = block.float()
        # amax over the block's tokens (dim 2) and head_dim (dim 4): one scale per head.
        amax = x.abs().amax(dim=(2, 4), keepdim=True)
        scale = (amax / self.qmax).clamp_min(torch.finfo(torch.float32).tiny)
        q = self.quantize(x / scale).view(torch.uint8).reshape(-1)
        s = scale.reshape(-1).to(torch.float32).view(torch.uint8)
        return torch.cat((q, s))

    def decode(
        self, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float32, device=payload.device)
        self._dequantize(payload, out)
        return out if dtype == torch.float32 else out.to(dtype)

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        if out.dtype != torch.float32 or not out.is_contiguous():
            # Rounded once, from float32, exactly as decode() does.
            out.copy_(self.decode(payload, tuple(out.shape), out.dtype))
            return
        self._dequantize(payload, out)

    def _split(self, payload: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        layers, two, _, heads, _ = shape
        n = _numel(shape)
        return payload[:n], payload[n:].view(torch.float32).view(layers, two, 1, heads, 1)

    @staticmethod
    def _scale_on(scale: torch.Tensor, out: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        """The scales (times ``factor``) where ``out`` is, one per element of a head's row.

        Spelled out over the head dimension (a small tensor), the multiply
        broadcasts only over the tokens, in rows of heads x head_dim: twice
        as fast on the CPU as one scale per 64 elements. The products are the
        same.
        """
        scale = scale if scale.device == out.device else scale.to(out.device)
        layers, two, _, heads, dim = out.shape
        wide = scale.expand(layers, two, 1, heads, dim)
        # The multiply writes a new (contiguous) tensor: one operation, not two.
        return wide * factor if factor != 1.0 else wide.contiguous()

    def _dequantize(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """``q * scale`` into the float32 block ``out``: a widening copy, then one multiply."""
        q, scale = self._split(payload, tuple(out.shape))
        out.copy_(q.view(self.qdtype).view(out.shape))
        out.mul_(self._scale_on(scale, out))


class Int8Codec(ScaledCodec):
    """Symmetric int8 with per-head scales."""

    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = 1
    qdtype: ClassVar[torch.dtype] = torch.int8
    qmax: ClassVar[float] = 127.0

    def quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round_().clamp_(-127.0, 127.0).to(torch.int8)


class Fp8Codec(ScaledCodec):
    """float8 e4m3 with per-head scales."""

    name: ClassVar[str] = "fp8"
    codec_id: ClassVar[int] = 2
    qdtype: ClassVar[torch.dtype] = torch.float8_e4m3fn
    qmax: ClassVar[float] = 448.0

    def quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)

    def _dequantize(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        if payload.device.type != "cpu":
            super()._dequantize(payload, out)
            return
        # torch widens e4m3 one element at a time on the CPU (about 1 GB/s).
        # Moving the bits into a float16 is exact and vectorised: e4m3's sign,
        # 4 exponent and 3 mantissa bits land in float16's sign, the low
        # exponent bits and the top of the mantissa, which reads the value
        # times 2**-8 (exponent bias 15 against 7), subnormals included;
        # float16 widens to float32 in hardware, and the 2**8 rides on the scale.
        q, scale = self._split(payload, tuple(out.shape))
        bits = _scratch_int16(int(q.numel()))
        bits.copy_(q.view(torch.int8))
        # A shift left by 7, as a multiply (which torch vectorises for int16; the
        # shift it does not). The int8 sign extension sets bits 15 and 14;
        # float16 wants bit 15 only.
        bits.mul_(128).bitwise_and_(-16385)
        out.copy_(bits.view(torch.float16).view(out.shape))
        out.mul_(self._scale_on(scale, out, 256.0))


_local = threading.local()


def _scratch_int16(n: int) -> torch.Tensor:
    """``n`` int16 of this thread's scratch buffer, kept between calls (no fresh pages)."""
    buf: torch.Tensor | None = getattr(_local, "int16", None)
    if buf is None or buf.numel() < n:
        buf = _local.int16 = torch.empty(n, dtype=torch.int16)
    return buf[:n]


CODECS: dict[str, type[Codec]] = {c.name: c for c in (RawCodec, Int8Codec, Fp8Codec)}
_BY_ID: dict[int, type[Codec]] = {c.codec_id: c for c in CODECS.values()}
# The codecs keep no state: verification hands out one instance of each.
_INSTANCES: dict[int, Codec] = {i: c() for i, c in _BY_ID.items()}


def make_codec(name: str | Codec) -> Codec:
    """A codec by name (``raw``, ``int8``, ``fp8``), or the instance given."""
    if not isinstance(name, str):
        return name
    try:
        return CODECS[name]()
    except KeyError:
        raise ConfigError(
            f"unknown codec {name!r}: choose one of {', '.join(sorted(CODECS))}"
        ) from None


def make_header(
    codec: Codec, key: int, block_shape: tuple[int, ...], dtype: torch.dtype, payload: torch.Tensor
) -> bytes:
    """The packed header for ``payload`` (a CPU uint8 tensor) of block ``key``."""
    return pack_header(codec, key, block_shape, dtype, as_buffer(payload))


def pack_header(
    codec: Codec,
    key: int,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    payload: memoryview | bytes | bytearray,
) -> bytes:
    """:func:`make_header` for a payload already at hand as a buffer (no tensor round trip)."""
    return header_for(codec, key, block_shape, dtype, len(payload), payload_checksum(key, payload))


def header_for(
    codec: Codec,
    key: int,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    payload_len: int,
    checksum: int,
    *,
    unchecked: bool = False,
) -> bytes:
    """The packed header of a payload whose length and :func:`payload_checksum` are known.

    ``unchecked``: the payload is stored without a checksum (``checksum`` is
    ignored); only an in-process medium may say so (see the module docstring).
    """
    if unchecked:
        return unchecked_header(codec, key, block_shape, dtype, payload_len)
    return _pack_header(codec.codec_id, key, tuple(block_shape), dtype, payload_len, checksum, 0)


def unchecked_header(
    codec: Codec, key: int, block_shape: tuple[int, ...], dtype: torch.dtype, payload_len: int
) -> bytes:
    """:func:`header_for` an unchecked payload, from a template per layout: the one header
    an in-process medium writes for ``key``, and the one its reader expects back."""
    before, after = _unchecked_parts(codec.codec_id, tuple(block_shape), dtype, payload_len)
    head = before + (key & _MASK128).to_bytes(16, "little") + after
    return head + _CHECK.pack(xxhash.xxh32_intdigest(head))


@functools.lru_cache(maxsize=256)
def _unchecked_parts(
    codec_id: int, block_shape: tuple[int, ...], dtype: torch.dtype, payload_len: int
) -> tuple[bytes, bytes]:
    """An unchecked header's bytes before and after its key (the same for every key)."""
    head = _pack_header(codec_id, 0, block_shape, dtype, payload_len, 0, FLAG_UNCHECKED)
    return head[:_KEY_AT], head[_KEY_AT + 16 : _HEAD.size]


@functools.lru_cache(maxsize=256)
def _whole(codec_id: int, block_shape: tuple[int, ...], dtype: torch.dtype, length: int) -> bool:
    """Whether a payload of ``length`` bytes is a whole block of this codec and layout."""
    return (
        dtype in _DTYPES
        and 0 < len(block_shape) <= 6
        and length == _INSTANCES[codec_id].payload_size(block_shape, dtype)
    )


def _pack_header(
    codec_id: int,
    key: int,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    payload_len: int,
    checksum: int,
    flags: int,
) -> bytes:
    ndim = len(block_shape)
    if not 0 < ndim <= 6:
        raise ConfigError(f"a stored block has 1 to 6 dimensions, got shape {list(block_shape)}")
    head = _HEAD.pack(
        _MAGIC,
        FORMAT_VERSION,
        codec_id,
        _DTYPES[dtype],
        ndim,
        flags,
        *block_shape,
        *_ZEROS[ndim:],
        key & _MASK64,
        (key >> 64) & _MASK64,
        payload_len,
        0 if flags & FLAG_UNCHECKED else checksum,
    )
    return head + _CHECK.pack(xxhash.xxh32_intdigest(head))


def decode_into(codec: Codec, payload: torch.Tensor, out: torch.Tensor) -> None:
    """Decode ``payload`` straight into ``out`` (a block of the stored shape and dtype).

    The codecs here write the result in place, without an intermediate block;
    any other codec decodes and copies.
    """
    into = getattr(codec, "decode_into", None)
    if into is not None:
        into(payload, out)
    else:
        out.copy_(codec.decode(payload, tuple(out.shape), out.dtype))


def verify(
    header: bytes | memoryview,
    payload: torch.Tensor,
    key: int,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    in_process: bool = False,
) -> Codec:
    """Check a stored block against what the reader expects; returns its codec.

    Raises :class:`CorruptBlockError` on any mismatch: the block must then
    be dropped and recomputed, never served. ``in_process``: the block comes
    from this process's own memory, where an unchecked payload is accepted.
    """
    codec, checksum = check_header(
        header, key, block_shape, dtype, int(payload.numel()), in_process=in_process
    )
    if checksum is not None and payload_checksum(key, as_buffer(payload)) != checksum:
        raise CorruptBlockError(f"stored block {key:#x} fails its payload checksum")
    return codec


def check_header(
    header: bytes | memoryview,
    key: int,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    payload_len: int,
    *,
    in_process: bool = False,
) -> tuple[Codec, int | None]:
    """:func:`verify` without the payload's checksum: returns the codec and the checksum
    the payload must have (``None``: an unchecked payload from an ``in_process`` medium).

    For readers that hash many payloads at once (:func:`payload_checksum` on a
    pool); a payload is verified only once its checksum matched as well.
    """
    if in_process and len(header) == HEADER_SIZE and key == key & _MASK128:
        # The common case, an in-process medium's own unchecked header: equal bytes to
        # the one it would write for this key say everything the fields below check.
        codec = _INSTANCES.get(header[_CODEC_AT])
        if (
            codec is not None
            and _whole(codec.codec_id, tuple(block_shape), dtype, payload_len)
            and header == unchecked_header(codec, key, block_shape, dtype, payload_len)
        ):
            return codec, None
    h = BlockHeader.unpack(header)
    if h.unchecked and not in_process:
        # Only this process's own memory may hold unchecked payloads: one read from
        # a file or a server was written by someone who had to checksum it.
        raise CorruptBlockError(f"stored block {key:#x} has no payload checksum")
    if h.key != key:
        raise CorruptBlockError(f"stored block names key {h.key:#x}, expected {key:#x}")
    if h.dtype != dtype or h.shape != tuple(block_shape):
        raise CorruptBlockError(
            f"stored block is {h.dtype} {list(h.shape)}, expected {dtype} {list(block_shape)}"
        )
    codec = _INSTANCES.get(h.codec_id)
    if codec is None:
        raise CorruptBlockError(f"stored block names unknown codec id {h.codec_id}")
    if payload_len != h.payload_len or h.payload_len != codec.payload_size(h.shape, dtype):
        raise CorruptBlockError(
            f"stored block payload is {payload_len} bytes, header says {h.payload_len}"
        )
    return codec, None if h.unchecked else h.checksum
