"""Batched host/disk tier copies with pooled checksums: a flipped bit a checksum guards is a miss.

A tier chain stores real blocks, one bit of one stored item (header or
payload, in host memory or in its disk file) is flipped, and the load must
stop at that block: the blocks before it come back bit-exact, the damaged
one is counted corrupt and dropped, and nothing of it (or of the blocks
after it) reaches the device.

The host tier of a chain stores its payloads unchecked (the slots are the
process's own memory, as exposed as the device's blocks; docs/tiers.md,
"Stored blocks"): there a flipped header bit is still a miss, and a flipped
payload bit comes back as it is, exactly as a flipped bit in a device block
would be read. A host tier asked for checksums (``checksums=True``), and
the disk tier, miss on every flipped bit; a header that says "unchecked"
is refused from any medium outside the process. Each case runs with the checksums on the
calling thread and on the checksum pool (small chunks, so a batch spans
several pool tasks and copies), and with the tier's slots in ascending and
in descending order (one copy per run of blocks, or one per block). With a
GPU the host cases run on CUDA storage and pinned host rows too, where the
copies are asynchronous and each batch waits for them once. The unchecked
host cases run again with the loads landing layer by layer
(``layer_loads``): the same blocks land, the same block stops the load.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from needs import hardware_mark

from kvtier import KVCacheManager
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.offload import codec, transfer
from kvtier.offload.chain import TierChain
from kvtier.offload.codec import HEADER_SIZE
from kvtier.offload.disk import DiskStore
from kvtier.offload.host import HostStore
from kvtier.offload.media import ItemFormat
from kvtier.offload.tier import Tier
from kvtier.storage import KVBlockStorage

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
N = 6
BLOCK_BYTES = KVBlockStorage(LAYOUT, 1).bytes_per_block
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=hardware_mark(torch.cuda.is_available(), "no CUDA device")),
]


@contextmanager
def pooled(on: bool) -> Iterator[None]:
    """Checksums on the pool for any batch, in chunks of about two blocks (or never)."""
    saved = codec.PARALLEL_MIN_BYTES, transfer.CHUNK_BYTES
    codec.PARALLEL_MIN_BYTES = 0 if on else 1 << 62
    transfer.CHUNK_BYTES = 2 * BLOCK_BYTES if on else saved[1]
    try:
        yield
    finally:
        codec.PARALLEL_MIN_BYTES, transfer.CHUNK_BYTES = saved


def stored_chain(
    medium: HostStore | DiskStore,
    descending: bool,
    seed: int,
    device: str = "cpu",
    checksums: bool | None = None,
    layer_loads: bool = False,
) -> tuple[KVBlockStorage, TierChain, Tier, list[int]]:
    storage = KVBlockStorage(LAYOUT, 2 * N, device=device)
    gen = torch.Generator().manual_seed(seed)
    storage.tensor[:N].copy_(torch.randn(storage.tensor[:N].shape, generator=gen))
    storage.tensor[N:].zero_()
    mgr = KVCacheManager(2 * N, LAYOUT.block_size)
    tier = Tier(medium, N, codec="raw", checksums=checksums)
    chain = TierChain(storage, mgr, [tier], write_mode="write_through", layer_loads=layer_loads)
    rng = random.Random(seed)
    if descending:
        # A store and a removal first: the free slots then come back in reverse.
        warm = [rng.getrandbits(128) for _ in range(N)]
        chain.store_blocks(0, warm, list(range(N)))
        chain.flush()
        tier.offload_manager.remove(warm)
    keys = [rng.getrandbits(128) for _ in range(N)]
    chain.store_blocks(0, keys, list(range(N)))
    chain.flush()
    assert tier.offload_manager.lookup(keys) == N
    return storage, chain, tier, keys


def flip_host(host: HostStore, slot: int, bit: int) -> None:
    header = host._headers[slot]
    assert header is not None
    if bit < 8 * len(header):
        raw = bytearray(header)
        raw[bit // 8] ^= 1 << (bit % 8)
        host._headers[slot] = bytes(raw)
    else:
        at = bit - 8 * len(header)
        host.row(slot)[at // 8] ^= 1 << (at % 8)


def flip_file(path: Path, bit: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(raw))


def check_load(
    storage: KVBlockStorage, chain: TierChain, tier: Tier, keys: list[int], victim: int
) -> None:
    loaded = chain.load(keys, list(range(N, 2 * N)))
    assert loaded == victim
    src, dst = storage.tensor[:N], storage.tensor[N:]
    assert torch.equal(dst[:victim], src[:victim])
    # Nothing of the damaged block, nor of any after it, reached the device.
    assert not dst[victim:].view(torch.uint8).any()
    assert tier.counters.corrupt_blocks == 1
    assert tier.offload_manager.lookup(keys[victim : victim + 1]) == 0
    assert tier.offload_manager.lookup(keys[:victim]) == victim
    chain.check()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    victim=st.integers(0, N - 1),
    bit=st.integers(0, 8 * (HEADER_SIZE + BLOCK_BYTES) - 1),
    descending=st.booleans(),
    pool=st.booleans(),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("device", DEVICES)
def test_a_flipped_bit_in_a_checksummed_host_item_is_a_miss(
    device: str, victim: int, bit: int, descending: bool, pool: bool, seed: int
) -> None:
    with pooled(pool):
        host = HostStore(pin_memory=device == "cuda")
        storage, chain, tier, keys = stored_chain(host, descending, seed, device, checksums=True)
        slot = tier.offload_manager.prepare_load([keys[victim]])[0]
        tier.offload_manager.complete_load([keys[victim]])
        flip_host(host, slot, bit)
        check_load(storage, chain, tier, keys, victim)
        chain.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    victim=st.integers(0, N - 1),
    bit=st.integers(0, 8 * (HEADER_SIZE + BLOCK_BYTES) - 1),
    descending=st.booleans(),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("layer_loads", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_an_unchecked_host_item_misses_on_its_header_and_reads_its_payload_as_it_is(
    device: str, layer_loads: bool, victim: int, bit: int, descending: bool, seed: int
) -> None:
    host = HostStore(pin_memory=device == "cuda")
    storage, chain, tier, keys = stored_chain(
        host, descending, seed, device, layer_loads=layer_loads
    )
    assert not tier.checksums and not host.checksums  # the chain's default for host memory
    slot = tier.offload_manager.prepare_load([keys[victim]])[0]
    tier.offload_manager.complete_load([keys[victim]])
    flip_host(host, slot, bit)
    if bit < 8 * HEADER_SIZE:
        # The header (key, layout, length, its own checksum) still guards the slot.
        check_load(storage, chain, tier, keys, victim)
        assert storage.fills == (1 if layer_loads and victim else 0)
    else:
        # The payload is the process's own memory, read like a device block: as it is.
        assert chain.load(keys, list(range(N, 2 * N))) == N
        src, dst = storage.tensor[:N], storage.tensor[N:]
        diff = (src.view(torch.uint8) != dst.view(torch.uint8)).view(N, -1).sum(dim=1)
        assert diff.tolist() == [1 if i == victim else 0 for i in range(N)]
        assert tier.counters.corrupt_blocks == 0
        assert storage.fills == (1 if layer_loads else 0)
    chain.close()


def test_an_unchecked_header_is_refused_from_a_disk_file(tmp_path: Path) -> None:
    # A file claiming it needs no checksum is corrupt: only this process's memory may say so.
    disk = DiskStore(tmp_path)
    storage, chain, tier, keys = stored_chain(disk, False, 7)
    path = disk.path(keys[2])
    raw = path.read_bytes()
    fmt = tier.fmt
    assert fmt is not None
    header = codec.header_for(
        fmt.codec, keys[2], fmt.shape, fmt.dtype, len(raw) - HEADER_SIZE, 0, unchecked=True
    )
    path.write_bytes(header + raw[HEADER_SIZE:])
    check_load(storage, chain, tier, keys, 2)
    chain.close()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.sampled_from([8, 16, 16]), min_size=1, max_size=6),
    slots=st.permutations(range(6)),
    ascending=st.booleans(),
)
def test_unchecked_items_shorter_than_their_slot_come_back_as_stored(
    lengths: list[int], slots: list[int], ascending: bool
) -> None:
    # Runs of one copy may join whole slots only: an item shorter than its slot ends one.
    host = HostStore(checksums=False)
    host.bind("short", 6, 16)
    source = torch.arange(16 * len(lengths), dtype=torch.uint8)
    chosen = sorted(slots[: len(lengths)]) if ascending else slots[: len(lengths)]
    items = []
    at = 0
    for i, (n, slot) in enumerate(zip(lengths, chosen, strict=False)):
        fmt = ItemFormat(codec.RawCodec(), (n,), torch.uint8)
        items.append((1000 + i, slot, source[at : at + n], fmt))
        at += n
    host.put(items)
    got = host.get([(k, s) for k, s, _, _ in items])
    for (key, _, payload, fmt), stored in zip(items, got, strict=True):
        assert stored is not None
        header, data = stored
        assert torch.equal(data, payload)
        codec.check_header(header, key, fmt.shape, fmt.dtype, int(data.numel()), in_process=True)


def test_only_an_in_process_medium_stores_unchecked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        Tier(DiskStore(tmp_path), 4, checksums=False)
    assert Tier(DiskStore(tmp_path), 4).checksums
    assert not Tier(HostStore(), 4).checksums
    assert Tier(HostStore(), 4, checksums=True).checksums


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    victim=st.integers(0, N - 1),
    bit=st.integers(0, 8 * (HEADER_SIZE + BLOCK_BYTES) - 1),
    pool=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_flipped_bit_in_a_disk_file_is_a_miss(
    victim: int, bit: int, pool: bool, seed: int
) -> None:
    with pooled(pool), tempfile.TemporaryDirectory() as tmp:
        disk = DiskStore(tmp)
        storage, chain, tier, keys = stored_chain(disk, False, seed)
        flip_file(disk.path(keys[victim]), bit)
        check_load(storage, chain, tier, keys, victim)
        chain.close()


@settings(max_examples=30, deadline=None)
@given(
    descending=st.booleans(),
    pool=st.booleans(),
    seed=st.integers(0, 2**16),
    checksums=st.booleans(),
    layer_loads=st.booleans(),
)
@pytest.mark.parametrize("device", DEVICES)
def test_undamaged_batches_load_bit_exact(
    device: str, descending: bool, pool: bool, seed: int, checksums: bool, layer_loads: bool
) -> None:
    with pooled(pool):
        host = HostStore(pin_memory=device == "cuda")
        storage, chain, tier, keys = stored_chain(
            host, descending, seed, device, checksums, layer_loads=layer_loads
        )
        assert chain.load(keys, list(range(N, 2 * N))) == N
        assert torch.equal(storage.tensor[N:], storage.tensor[:N])
        assert tier.counters.corrupt_blocks == 0
        # Only unchecked payloads land layer by layer (a checked one is hashed first).
        assert storage.fills == (1 if layer_loads and not checksums else 0)
        chain.close()


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 64), max_size=30),
    order=st.randoms(use_true_random=False),
    limit=st.integers(1, 200),
)
def test_runs_and_chunks_cover_the_batch_and_spans_hold_the_bytes(
    sizes: list[int], order: random.Random, limit: int
) -> None:
    # Pieces of one buffer, some in place, some swapped: runs join only neighbours.
    base = torch.arange(sum(sizes), dtype=torch.int64).to(torch.uint8)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = [base[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
    if len(pieces) > 1 and order.random() < 0.5:
        i, j = sorted(order.sample(range(len(pieces)), 2))
        pieces[i], pieces[j] = pieces[j], pieces[i]
    for start, count in transfer.chunks([int(p.numel()) for p in pieces], limit):
        group = pieces[start : start + count]
        assert count == 1 or sum(int(p.numel()) for p in group) <= limit
        covered = 0
        for s, c in transfer.runs(group):
            assert s == covered
            covered += c
            assert torch.equal(transfer.span(group, s, c), torch.cat(group[s : s + c]))
        assert covered == count
    flat = [(s, c) for s, c in transfer.chunks([int(p.numel()) for p in pieces], limit)]
    assert sum(c for _, c in flat) == len(pieces)
