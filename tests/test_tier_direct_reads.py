"""Copies that hash as they go, files read straight into device blocks, reused snapshots.

Loads into device blocks in host memory take one copy per block: a host
payload is copied and hashed in one pass (``copy_checksum``), a disk file is
read straight into its device block (``DiskStore.read_into``) and verified
there. Whatever goes wrong with a file (a flipped bit, a cut, a byte too
many, a file gone, another codec's payload), the load stops at that block,
leaves none of it in the device, counts it, and what comes back is exactly
what was stored. Staged snapshots are reused only once nothing else shares
them.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_model import tiny_model_and_tokenizer

from kvtier import KVCacheManager
from kvtier.engine import Engine, SamplingParams
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.offload import codec, media, transfer
from kvtier.offload.chain import TierChain
from kvtier.offload.codec import (
    FORMAT_VERSION,
    HEADER_SIZE,
    BlockHeader,
    as_buffer,
    copy_checksum,
    make_codec,
    payload_checksum,
)
from kvtier.offload.disk import DiskStore
from kvtier.offload.media import ItemFormat, pack_blob, stage, staged_blob
from kvtier.offload.promote import DeferredRead, Reader
from kvtier.offload.tier import Tier
from kvtier.storage import KVBlockStorage

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
N = 6
BLOCK_BYTES = KVBlockStorage(LAYOUT, 1).bytes_per_block


@settings(max_examples=150, deadline=None)
@given(
    data=st.binary(max_size=3000),
    key=st.integers(0, 2**128 - 1),
    chunk=st.integers(1, 700),
)
def test_copy_checksum_is_the_one_shot_checksum_of_the_copy(
    data: bytes, key: int, chunk: int
) -> None:
    saved = codec.COPY_CHUNK
    codec.COPY_CHUNK = chunk
    try:
        src = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        dst = torch.full((len(data),), 0xA5, dtype=torch.uint8)
        assert copy_checksum(key, src, dst) == payload_checksum(key, data)
        assert bytes(as_buffer(dst)) == data
    finally:
        codec.COPY_CHUNK = saved


def test_copy_checksum_refuses_buffers_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="one length"):
        copy_checksum(1, torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8))


def test_copy_checksum_of_a_strided_source() -> None:
    src = torch.arange(200, dtype=torch.uint8)[::2]
    dst = torch.empty(100, dtype=torch.uint8)
    assert copy_checksum(3, src, dst) == payload_checksum(3, bytes(src.tolist()))
    assert torch.equal(dst, src)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.integers(0, 400),
    head=st.integers(1, 40),
    body=st.integers(1, 300),
    chunk=st.integers(1, 120),
)
def test_a_streamed_read_is_the_plain_read(size: int, head: int, body: int, chunk: int) -> None:
    data = bytes(random.Random(size).getrandbits(8) for _ in range(size))
    with tempfile.TemporaryDirectory() as tmp:
        disk = DiskStore(tmp)
        disk.bind("ns", 1)
        disk.path(5).parent.mkdir(parents=True, exist_ok=True)
        disk.path(5).write_bytes(data)
        plain = [memoryview(bytearray(n)) for n in (head, body, 1)]
        streamed = [memoryview(bytearray(n)) for n in (head, body, 1)]
        pieces: list[bytes] = []
        n_plain = disk.read_into(5, 0, plain)
        n_streamed = disk.read_into(
            5, 0, streamed, chunk=chunk, on_chunk=lambda p: pieces.append(bytes(p))
        )
        assert n_plain == n_streamed == min(size, head + body + 1)
        assert [bytes(b) for b in plain] == [bytes(b) for b in streamed]
        assert b"".join(pieces) == data[head : head + body]
        assert all(len(p) <= chunk for p in pieces)
        assert disk.read_into(6, 0, streamed) is None


@contextmanager
def pooled(on: bool) -> Iterator[None]:
    """Reads on several threads for any batch, or never."""
    saved = codec.PARALLEL_MIN_BYTES, transfer.CHUNK_BYTES
    codec.PARALLEL_MIN_BYTES = 0 if on else 1 << 62
    try:
        yield
    finally:
        codec.PARALLEL_MIN_BYTES, transfer.CHUNK_BYTES = saved


def disk_chain(
    root: str, seed: int, codec_name: str = "raw"
) -> tuple[KVBlockStorage, TierChain, Tier, DiskStore, list[int]]:
    storage = KVBlockStorage(LAYOUT, 2 * N)
    gen = torch.Generator().manual_seed(seed)
    storage.tensor[:N].copy_(torch.randn(storage.tensor[:N].shape, generator=gen))
    storage.tensor[N:].zero_()
    disk = DiskStore(root, direct_reads=True)
    tier = Tier(disk, 4 * N, codec=codec_name)
    chain = TierChain(storage, KVCacheManager(2 * N, LAYOUT.block_size), [tier])
    rng = random.Random(seed)
    keys = [rng.getrandbits(128) for _ in range(N)]
    chain.store_blocks(0, keys, list(range(N)))
    chain.flush()
    assert tier.offload_manager.lookup(keys) == N
    return storage, chain, tier, disk, keys


def damage(path: Path, how: str, bit: int) -> None:
    raw = bytearray(path.read_bytes())
    if how == "flip":
        raw[bit % (8 * len(raw)) // 8] ^= 1 << (bit % 8)
    elif how == "cut":
        del raw[bit % len(raw) :]
    elif how == "extra":
        raw.append(bit % 256)
    path.write_bytes(bytes(raw))


def test_a_disk_load_into_host_blocks_defers_its_reads() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        storage, chain, tier, disk, keys = disk_chain(tmp, 1)
        got = Reader(disk, [(k, -1) for k in keys])()
        assert isinstance(got, DeferredRead) and got.items == [(k, -1) for k in keys]
        assert chain.load(keys, list(range(N, 2 * N))) == N
        assert torch.equal(storage.tensor[N:], storage.tensor[:N])
        assert tier.counters.loaded_blocks == N
        assert tier.counters.loaded_bytes == N * BLOCK_BYTES
        assert disk.defer_reads
        chain.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    victim=st.integers(0, N - 1),
    how=st.sampled_from(["flip", "cut", "extra", "gone"]),
    bit=st.integers(0, 8 * (HEADER_SIZE + BLOCK_BYTES) - 1),
    pool=st.booleans(),
    codec_name=st.sampled_from(["raw", "int8"]),
    seed=st.integers(0, 2**16),
)
def test_a_damaged_file_is_a_miss_and_nothing_of_it_stays(
    victim: int, how: str, bit: int, pool: bool, codec_name: str, seed: int
) -> None:
    with pooled(pool), tempfile.TemporaryDirectory() as tmp:
        storage, chain, tier, disk, keys = disk_chain(tmp, seed, codec_name)
        path = disk.path(keys[victim])
        if how == "gone":
            path.unlink()
        else:
            damage(path, how, bit)
        assert chain.load(keys, list(range(N, 2 * N))) == victim
        src, dst = storage.tensor[:N], storage.tensor[N:]
        if codec_name == "raw":
            assert torch.equal(dst[:victim], src[:victim])
        else:
            assert torch.allclose(dst[:victim], src[:victim], atol=0.05)
        # Nothing of the damaged block, nor of any after it, stays in the device.
        assert not dst[victim:].view(torch.uint8).any()
        c = tier.counters
        assert (c.vanished_blocks, c.corrupt_blocks) == ((1, 0) if how == "gone" else (0, 1))
        assert c.loaded_blocks == victim
        assert tier.offload_manager.lookup(keys[victim : victim + 1]) == 0
        assert not path.exists()
        # Recomputed and stored again, the block loads like the others.
        chain.store_blocks(0, keys[victim : victim + 1], [victim])
        chain.flush()
        storage.tensor[N:].zero_()
        assert chain.load(keys, list(range(N, 2 * N))) == N
        chain.check()
        chain.close()


@pytest.mark.parametrize("other", ["int8", "fp8"])
def test_a_file_of_another_codec_still_loads(other: str) -> None:
    """A raw tier's directory may hold blocks an int8 or fp8 tier wrote (same namespace)."""
    with tempfile.TemporaryDirectory() as tmp:
        storage, chain, tier, disk, keys = disk_chain(tmp, 5)
        fmt = ItemFormat(make_codec(other), storage.block_shape, storage.dtype)
        encoded = fmt.codec.encode(storage.tensor[2])
        disk.path(keys[2]).write_bytes(pack_blob(fmt, keys[2], encoded))
        assert chain.load(keys, list(range(N, 2 * N))) == N
        src, dst = storage.tensor[:N], storage.tensor[N:]
        assert torch.equal(dst[:2], src[:2]) and torch.equal(dst[3:], src[3:])
        assert torch.allclose(dst[2], src[2], atol=0.15 * float(src[2].abs().max()))
        assert tier.counters.corrupt_blocks == 0
        chain.close()


def test_a_block_of_another_format_version_is_a_miss() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        storage, chain, tier, disk, keys = disk_chain(tmp, 9)
        path = disk.path(keys[1])
        blob = path.read_bytes()
        h = BlockHeader.unpack(blob[:HEADER_SIZE])
        for version in (FORMAT_VERSION - 1, FORMAT_VERSION + 1):
            old = BlockHeader(
                h.key, h.codec_id, h.dtype, h.shape, h.payload_len, h.checksum, version
            )
            path.write_bytes(old.pack() + blob[HEADER_SIZE:])
            storage.tensor[N:].zero_()
            assert chain.load(keys, list(range(N, 2 * N))) == 1
            assert not storage.tensor[N + 1 :].any()
            chain.store_blocks(0, keys[1:2], [1])  # recomputed
            chain.flush()
            blob = path.read_bytes()
        assert tier.counters.corrupt_blocks == 2
        chain.close()


def test_staged_snapshots_carry_their_header_and_are_reused() -> None:
    fmt = ItemFormat(make_codec("raw"), (2, 2, 4, 3, 8), torch.float32)
    block = torch.randn(fmt.shape)
    payload = fmt.codec.encode(block)
    key = 0x1234 << 70
    staged = stage(payload, key, fmt)
    blob = staged_blob(fmt, key, staged)
    assert blob is not None and bytes(blob) == pack_blob(fmt, key, payload)
    assert staged_blob(fmt, key, payload) is None  # not a staged snapshot
    ptr = staged.data_ptr()
    media.drop_staging_pool()
    del blob  # its view of the buffer goes first
    del staged
    assert media._free_bytes == HEADER_SIZE + payload.numel()
    again = stage(payload, key, fmt)
    assert again.data_ptr() == ptr  # the buffer came back from the pool
    assert media._free_bytes == 0
    # A buffer some other tensor still shares is not handed out again.
    kept = again.view(-1)[:8]
    del again
    assert media._free_bytes == 0
    third = stage(payload)
    assert third.data_ptr() != ptr
    assert bytes(as_buffer(kept)) == bytes(as_buffer(payload[:8]))
    del third, kept
    media.drop_staging_pool()


def test_a_stage_without_its_key_gets_its_header_when_written() -> None:
    fmt = ItemFormat(make_codec("raw"), (2, 2, 4, 3, 8), torch.float32)
    payload = fmt.codec.encode(torch.randn(fmt.shape))
    staged = stage(payload)
    blob = staged_blob(fmt, 7, staged)
    assert blob is not None and bytes(blob) == pack_blob(fmt, 7, payload)
    # Asked under another key, the header is rewritten for that key.
    other = staged_blob(fmt, 8, staged)
    assert other is not None and bytes(other) == pack_blob(fmt, 8, payload)


GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.mark.parametrize("direct", [False, True], ids=["background-reads", "direct-reads"])
def test_engine_recomputes_a_block_whose_file_was_damaged(tmp_path: Path, direct: bool) -> None:
    model, tok = tiny_model_and_tokenizer()
    prompt = torch.randint(3, 60, (33,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = Engine(model, tok, model_id="tiny", block_size=4, num_blocks=64)
    expected = [t for out in reference.generate(prompt, GREEDY) for t in out.token_ids]
    disk = DiskStore(tmp_path, direct_reads=direct)
    eng = Engine(
        model,
        tok,
        model_id="tiny",
        block_size=4,
        num_blocks=64,
        tiers=[Tier(disk, 200, codec="raw")],
        write_mode="write_through",
    )

    def generate() -> list[int]:
        return [t for out in eng.generate(prompt, GREEDY) for t in out.token_ids]

    assert generate() == expected
    chain: Any = eng.tier_chain
    chain.flush()
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) >= 4
    for path in files:  # one bit of every stored block's payload
        raw = bytearray(path.read_bytes())
        raw[HEADER_SIZE + 100] ^= 0x10
        path.write_bytes(bytes(raw))
    for corrupt in (1, 2):
        eng.manager.reset_prefix_cache()
        before = eng.counters.loaded_prompt_tokens
        assert generate() == expected
        chain.flush()
        # The load stopped at the first damaged block; the engine recomputed the
        # rest and stored it again, so the next load gets one block further.
        assert chain.stats()["disk"]["corrupt_blocks"] == corrupt
        assert eng.counters.loaded_prompt_tokens - before == (corrupt - 1) * 4
    chain.close()


def test_direct_reads_are_a_disk_url_option(tmp_path: Path) -> None:
    from kvtier.offload.registry import make_medium

    assert not cast(DiskStore, make_medium("disk", str(tmp_path), {})).defer_reads
    on = make_medium("disk", str(tmp_path), {"direct_reads": "true"})
    assert cast(DiskStore, on).defer_reads
    with pytest.raises(ConfigError, match="direct_reads"):
        make_medium("disk", str(tmp_path), {"direct_reads": "maybe"})
