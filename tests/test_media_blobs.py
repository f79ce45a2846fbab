"""Stored blobs without extra copies: staged snapshots, in-place decoding, disk reads.

Whatever path a block takes (staged with room for its header, copied into
a new buffer, read back from a file), the bytes on the medium are the same
and every flipped bit is still caught by :func:`verify`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import CorruptBlockError
from kvtier.offload.codec import (
    HEADER_SIZE,
    Fp8Codec,
    Int8Codec,
    RawCodec,
    decode_into,
    make_codec,
    make_header,
    verify,
)
from kvtier.offload.disk import DiskStore
from kvtier.offload.media import ItemFormat, blob_view, pack_blob, split_blob, stage

SHAPE = (2, 2, 4, 3, 8)  # layers, K/V, block_size, heads, head_dim
KEY = (0xABCD << 64) | 0x1234_5678


def block(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g)
    x[:, :, :, 2] *= 300.0  # one loud head: per-head scales must cope
    return x.to(dtype)


def test_staged_and_copied_blobs_hold_the_same_bytes() -> None:
    for name in ("raw", "int8", "fp8"):
        fmt = ItemFormat(make_codec(name), SHAPE, torch.float32)
        payload = fmt.codec.encode(block(1))
        copied = bytes(blob_view(fmt, KEY, payload))
        staged_payload = stage(payload)
        staged = bytes(blob_view(fmt, KEY, staged_payload))
        assert copied == staged == pack_blob(fmt, KEY, payload)
        assert len(staged) == fmt.blob_size
        header, got = split_blob(staged)
        assert isinstance(verify(header, got, KEY, SHAPE, torch.float32), type(fmt.codec))


def test_a_stage_is_a_snapshot() -> None:
    source = block(2)
    payload = RawCodec().encode(source)
    staged = stage(payload)
    source.zero_()  # the device block is reused before the write runs
    fmt = ItemFormat(RawCodec(), SHAPE, torch.float32)
    header, got = split_blob(bytes(blob_view(fmt, KEY, staged)))
    verify(header, got, KEY, SHAPE, torch.float32)
    assert torch.equal(got.view(torch.float32).view(SHAPE), block(2))


def test_only_staged_payloads_are_written_in_place() -> None:
    # A view with bytes in front of it that are not a stage's must not be overwritten.
    backing = torch.full((HEADER_SIZE + 64,), 7, dtype=torch.uint8)
    view = backing[HEADER_SIZE:]
    fmt = ItemFormat(RawCodec(), (16,), torch.float32)
    blob = bytes(blob_view(fmt, KEY, view))
    assert bool((backing[:HEADER_SIZE] == 7).all())
    assert blob[HEADER_SIZE:] == bytes(64 * [7])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_bit_flip_in_a_staged_blob_is_caught(data: st.DataObject) -> None:
    fmt = ItemFormat(
        make_codec(data.draw(st.sampled_from(["raw", "int8", "fp8"]))), SHAPE, torch.float32
    )
    blob = bytearray(blob_view(fmt, KEY, stage(fmt.codec.encode(block(3)))))
    pos = data.draw(st.integers(0, len(blob) - 1))
    blob[pos] ^= 1 << data.draw(st.integers(0, 7))
    header, payload = split_blob(blob)
    with pytest.raises(CorruptBlockError):
        verify(header, payload, KEY, SHAPE, torch.float32)


def test_fp8_decode_matches_torch_for_every_code() -> None:
    shape = (1, 2, 16, 1, 8)  # 256 elements: every e4m3 code once
    codes = torch.arange(256, dtype=torch.uint8)
    scale = torch.tensor([1.0, 3.25], dtype=torch.float32)
    payload = torch.cat((codes, scale.view(torch.uint8)))
    want = codes.view(torch.float8_e4m3fn).float().view(shape) * scale.view(1, 2, 1, 1, 1)
    got = Fp8Codec().decode(payload, shape, torch.float32)
    nan = want.isnan()
    assert int(nan.sum()) == 2  # 0x7f and 0xff: NaN, which the encoder never writes
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))  # -0.0 stays


@settings(max_examples=40, deadline=None)
@given(
    codec=st.sampled_from([RawCodec(), Int8Codec(), Fp8Codec()]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_decode_into_equals_decode(
    codec: RawCodec | Int8Codec | Fp8Codec, dtype: torch.dtype, seed: int
) -> None:
    payload = codec.encode(block(seed, dtype))
    want = codec.decode(payload, SHAPE, dtype)
    out = torch.full(SHAPE, float("nan"), dtype=dtype)
    decode_into(codec, payload, out)
    assert torch.equal(out, want)
    if codec.codec_id != RawCodec.codec_id:
        # The widening and the scale match torch's own dequantization bit for bit.
        n = out.numel()
        q = payload[:n].view(codec.qdtype).view(SHAPE).to(torch.float32)
        ref = q * payload[n:].view(torch.float32).view(SHAPE[0], SHAPE[1], 1, SHAPE[3], 1)
        assert torch.equal(want, ref.to(dtype))


def _disk(tmp_path: Path) -> tuple[DiskStore, ItemFormat]:
    store = DiskStore(tmp_path)
    fmt = ItemFormat(RawCodec(), SHAPE, torch.float32)
    store.bind("ns", 8, fmt.payload_size)
    return store, fmt


def test_disk_round_trip_from_staged_and_plain_payloads(tmp_path: Path) -> None:
    store, fmt = _disk(tmp_path)
    a, b = RawCodec().encode(block(4)), RawCodec().encode(block(5))
    store.put([(1, 0, stage(a), fmt), (2, 1, b, fmt)])
    got = store.get([(1, 0), (2, 1), (3, 2)])
    assert got[2] is None
    for key, want in ((1, a), (2, b)):
        stored = got[key - 1]
        assert stored is not None
        header, payload = stored
        verify(header, payload, key, SHAPE, torch.float32)
        assert torch.equal(payload, want)
    assert store.path(1).read_bytes() == pack_blob(fmt, 1, a)


@pytest.mark.parametrize("size", [0, 10, HEADER_SIZE, HEADER_SIZE + 5, -1])
def test_short_disk_files_are_caught(tmp_path: Path, size: int) -> None:
    store, fmt = _disk(tmp_path)
    store.put([(9, 0, RawCodec().encode(block(6)), fmt)])
    path = store.path(9)
    raw = path.read_bytes()
    path.write_bytes(raw[:size])
    stored = store.get([(9, 0)])[0]
    assert stored is not None
    with pytest.raises(CorruptBlockError):
        verify(stored[0], stored[1], 9, SHAPE, torch.float32)


def test_header_bytes_do_not_change_with_the_buffer_type() -> None:
    payload = Int8Codec().encode(block(7))
    h = make_header(Int8Codec(), KEY, SHAPE, torch.float32, payload)
    fmt = ItemFormat(Int8Codec(), SHAPE, torch.float32)
    assert bytes(blob_view(fmt, KEY, payload))[:HEADER_SIZE] == h
