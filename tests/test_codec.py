"""Block codecs, headers and checksums: round trips, error bounds, every corruption detected."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import ConfigError, CorruptBlockError
from kvtier.offload.codec import (
    HEADER_SIZE,
    BlockHeader,
    Fp8Codec,
    Int8Codec,
    RawCodec,
    check_header,
    header_for,
    make_codec,
    make_header,
    verify,
)
from kvtier.offload.media import ItemFormat, pack_blob, split_blob

SHAPE = (3, 2, 4, 2, 8)  # layers, K/V, block_size, heads, head_dim
KEY = (0x1234_5678_9ABC_DEF0 << 64) | 0x0FED_CBA9_8765_4321


def block(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Heads with very different magnitudes: per-head scales must cope.
    x = torch.randn(SHAPE, generator=g)
    x[:, :, :, 1] *= 40.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_raw_round_trip_is_exact(dtype: torch.dtype) -> None:
    codec = RawCodec()
    b = block(dtype)
    payload = codec.encode(b)
    assert payload.numel() == codec.payload_size(SHAPE, dtype)
    header = make_header(codec, KEY, SHAPE, dtype, payload)
    assert len(header) == HEADER_SIZE
    got = verify(header, payload, KEY, SHAPE, dtype)
    assert isinstance(got, RawCodec)
    assert torch.equal(got.decode(payload, SHAPE, dtype), b)


@pytest.mark.parametrize(("codec", "rel"), [(Int8Codec(), 1 / 127), (Fp8Codec(), 1 / 16)])
def test_scaled_codecs_error_is_bounded_per_head(codec: Int8Codec | Fp8Codec, rel: float) -> None:
    b = block()
    payload = codec.encode(b)
    assert payload.numel() == codec.payload_size(SHAPE, torch.float32)
    assert payload.numel() < b.numel() * 4 / 3  # at least 3x smaller than fp32
    out = codec.decode(payload, SHAPE, torch.float32)
    amax = b.abs().amax(dim=(2, 4), keepdim=True)
    # int8: half a step of amax/127; e4m3: 3 mantissa bits, relative 2**-4 of the value
    # (plus the step near zero).
    err = (out - b).abs()
    bound = amax * rel if isinstance(codec, Int8Codec) else b.abs() * rel + amax / 448 * 2**-6
    assert bool((err <= bound + 1e-6).all()), float((err - bound).max())
    # The large head does not drown the small one: errors scale per head.
    assert float(err[:, :, :, 0].max()) < float(err[:, :, :, 1].max()) / 5


def test_scaled_codec_of_zeros() -> None:
    z = torch.zeros(SHAPE)
    for codec in (Int8Codec(), Fp8Codec()):
        assert torch.equal(codec.decode(codec.encode(z), SHAPE, torch.float32), z)


def test_header_fields_round_trip() -> None:
    payload = RawCodec().encode(block())
    h = BlockHeader.unpack(make_header(RawCodec(), KEY, SHAPE, torch.float32, payload))
    assert h.key == KEY and h.shape == SHAPE and h.dtype == torch.float32
    assert h.payload_len == payload.numel() and h.codec_id == RawCodec.codec_id


def blob_for(codec_name: str = "raw") -> tuple[ItemFormat, bytes]:
    fmt = ItemFormat(make_codec(codec_name), SHAPE, torch.float32)
    return fmt, pack_blob(fmt, KEY, fmt.codec.encode(block()))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_single_bit_flip_is_detected(data: st.DataObject) -> None:
    _fmt, blob = blob_for(data.draw(st.sampled_from(["raw", "int8", "fp8"])))
    pos = data.draw(st.integers(0, len(blob) - 1))
    bit = data.draw(st.integers(0, 7))
    bad = bytearray(blob)
    bad[pos] ^= 1 << bit
    header, payload = split_blob(bad)
    with pytest.raises(CorruptBlockError):
        verify(header, payload, KEY, SHAPE, torch.float32)


@given(cut=st.integers(0, 200))
def test_truncation_is_detected(cut: int) -> None:
    _, blob = blob_for()
    header, payload = split_blob(blob[: len(blob) - 1 - cut * 7])
    with pytest.raises(CorruptBlockError):
        verify(header, payload, KEY, SHAPE, torch.float32)


def test_wrong_key_shape_or_dtype_is_detected() -> None:
    _, blob = blob_for()
    header, payload = split_blob(blob)
    verify(header, payload, KEY, SHAPE, torch.float32)
    with pytest.raises(CorruptBlockError, match="names key"):
        verify(header, payload, KEY + 1, SHAPE, torch.float32)
    with pytest.raises(CorruptBlockError, match="expected"):
        verify(header, payload, KEY, (3, 2, 4, 2, 4), torch.float32)
    with pytest.raises(CorruptBlockError, match="expected"):
        verify(header, payload, KEY, SHAPE, torch.bfloat16)


def test_unknown_codec_name() -> None:
    with pytest.raises(ConfigError, match="unknown codec"):
        make_codec("zstd")


def fieldwise(
    header: bytes, key: int, shape: tuple[int, ...], dtype: torch.dtype, n: int
) -> object:
    """What an in-process reader must conclude, from the header's fields one by one."""
    try:
        h = BlockHeader.unpack(header)
    except CorruptBlockError:
        return "corrupt"
    codec = {0: RawCodec, Int8Codec.codec_id: Int8Codec, Fp8Codec.codec_id: Fp8Codec}.get(
        h.codec_id
    )
    if (
        h.key != key
        or h.dtype != dtype
        or h.shape != shape
        or codec is None
        or n != h.payload_len
        or n != codec().payload_size(h.shape, dtype)
    ):
        return "corrupt"
    return (h.codec_id, None if h.unchecked else h.checksum)


@settings(max_examples=400, deadline=None)
@given(
    codec_name=st.sampled_from(["raw", "int8", "fp8"]),
    key=st.integers(0, 2**128 - 1),
    other_key=st.none() | st.integers(0, 2**129),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    stored_dtype=st.none() | st.sampled_from([torch.float32, torch.float16]),
    length_off=st.sampled_from([0, 0, 0, -1, 1]),
    written_off=st.sampled_from([0, 0, 1]),
    flip=st.none() | st.integers(0, 8 * HEADER_SIZE - 1),
    unchecked=st.booleans(),
)
def test_an_in_process_header_check_concludes_what_the_fields_say(
    codec_name: str,
    key: int,
    other_key: int | None,
    dtype: torch.dtype,
    stored_dtype: torch.dtype | None,
    length_off: int,
    written_off: int,
    flip: int | None,
    unchecked: bool,
) -> None:
    # The reader's fast comparison with the header it would write must agree with
    # reading every field, for headers of this key or another, damaged or not.
    codec = make_codec(codec_name)
    written_as = stored_dtype or dtype
    n = codec.payload_size(SHAPE, written_as) + written_off
    raw = bytearray(header_for(codec, key, SHAPE, written_as, n, 0xABC, unchecked=unchecked))
    if flip is not None:
        raw[flip // 8] ^= 1 << (flip % 8)
    header = bytes(raw)
    want_key = key if other_key is None else other_key
    length = codec.payload_size(SHAPE, dtype) + length_off
    expected = fieldwise(header, want_key, SHAPE, dtype, length)
    try:
        got_codec, checksum = check_header(header, want_key, SHAPE, dtype, length, in_process=True)
        got: object = (got_codec.codec_id, checksum)
    except CorruptBlockError:
        got = "corrupt"
    assert got == expected
    if (flip, other_key, stored_dtype, length_off, written_off) == (None, None, None, 0, 0):
        assert got == (codec.codec_id, None if unchecked else 0xABC)
