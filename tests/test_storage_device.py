"""KVBlockStorage: K/V tensors behind the manager's block ids, on real tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
from needs import hardware_mark, need_module

torch = need_module("torch")

from kvtier import BlockTable, KVCacheManager, KVLayout  # noqa: E402
from kvtier.errors import BadRequestError, ConfigError, KvTierError  # noqa: E402
from kvtier.storage import (  # noqa: E402
    DEFAULT_LAYOUT_KIND,
    LAYOUT_KINDS,
    KVBlockStorage,
    torch_dtype,
)

KV = list[tuple[torch.Tensor, torch.Tensor]]
KINDS = list(LAYOUT_KINDS)
DTYPES = ["float32", "bfloat16", "float16"]
# Small: 3 layers, 2 KV heads, head_dim 8, 4-token blocks (1,536 bytes per fp32 block).
SMALL = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
# Big enough (64 KiB fp32 blocks) that CPU block storage copies block by block.
BIG = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")


def small(dtype: str = "float32") -> KVLayout:
    return replace(SMALL, dtype=dtype)


def kv_for(layout: KVLayout, n: int, seed: int) -> KV:
    """Random K and V of ``n`` tokens for every layer."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch_dtype(layout.dtype)
    shape = (n, layout.num_kv_heads, layout.head_dim)
    return [
        (torch.randn(shape, generator=gen).to(dt), torch.randn(shape, generator=gen).to(dt))
        for _ in range(layout.num_layers)
    ]


def fill_random_bytes(store: KVBlockStorage, seed: int) -> None:
    """Every byte of the storage random (NaN and denormal patterns included)."""
    gen = torch.Generator().manual_seed(seed)
    raw = store.tensor.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def write_all(store: KVBlockStorage, slots: object, kv: KV) -> None:
    for layer, (k, v) in enumerate(kv):
        store.write(layer, slots, k, v)  # type: ignore[arg-type]


def assert_reads(store: KVBlockStorage, table: BlockTable, kv: KV) -> None:
    for layer, (k, v) in enumerate(kv):
        got_k, got_v = store.read(layer, table)
        assert got_k.shape == k.shape and got_k.dtype == k.dtype
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


# -- construction and sizes -------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [*DTYPES, "float8_e4m3fn", "int8"])
def test_sizes_match_the_layout(kind: str, dtype: str) -> None:
    layout = small(dtype)
    store = KVBlockStorage(layout, 10, layout_kind=kind)  # type: ignore[arg-type]
    assert store.dtype == torch_dtype(dtype)
    assert store.bytes_per_block == layout.bytes_per_block
    assert store.nbytes == 10 * layout.bytes_per_block
    assert store.num_slots == 10 * layout.block_size
    assert store.block_bytes(3).numel() == layout.bytes_per_block
    assert store.device == torch.device("cpu")
    assert kind in repr(store)


def test_default_layout_kind_is_block_contiguous() -> None:
    store = KVBlockStorage(SMALL, 6)
    assert store.layout_kind == DEFAULT_LAYOUT_KIND == "block"
    assert store.tensor.shape == (6, 3, 2, 4, 2, 8)
    # One block's payload is one contiguous run of memory.
    assert store.tensor[2].is_contiguous()
    layer = KVBlockStorage(SMALL, 6, layout_kind="layer")
    assert layer.tensor.shape == (3, 2, 6, 4, 2, 8)


@pytest.mark.parametrize("num_blocks", [0, -1, True, 2.0, "4"])
def test_bad_sizes_are_config_errors(num_blocks: object) -> None:
    with pytest.raises(ConfigError, match="num_blocks"):
        KVBlockStorage(SMALL, num_blocks)  # type: ignore[arg-type]


def test_bad_construction_arguments() -> None:
    with pytest.raises(ConfigError, match="layout_kind"):
        KVBlockStorage(SMALL, 4, layout_kind="heads")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="does not match the layout's dtype"):
        KVBlockStorage(SMALL, 4, dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"torch\.dtype"):
        KVBlockStorage(SMALL, 4, dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="KVLayout"):
        KVBlockStorage((3, 2, 8, 4), 4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="invalid device"):
        KVBlockStorage(SMALL, 4, device="not-a-device")
    # The explicit dtype is accepted when it is the layout's own.
    assert KVBlockStorage(small("bfloat16"), 4, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="no torch equivalent"):
        torch_dtype("float64")


@hardware_mark(not torch.cuda.is_available(), "a CUDA device is here (this checks its absence)")
def test_cuda_without_a_gpu_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match=r"CUDA.*torch\.cuda\.is_available\(\) is False"):
        KVBlockStorage(SMALL, 4, device="cuda")
    with pytest.raises(ConfigError):
        KVBlockStorage(SMALL, 4, device=torch.device("cuda", 0))


# -- write / read -------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_then_read_through_a_block_table(kind: str, dtype: str) -> None:
    layout = small(dtype)
    store = KVBlockStorage(layout, 16, layout_kind=kind)  # type: ignore[arg-type]
    fill_random_bytes(store, 1)  # stale data everywhere: reads must not see it
    # 10 tokens in blocks 7, 2, 11: the last block holds 2 of its 4 slots.
    table = BlockTable(4, [7, 2, 11], 10)
    kv = kv_for(layout, 10, seed=2)
    write_all(store, torch.tensor(table.slot_mapping(0, 10)), kv)
    assert_reads(store, table, kv)
    for layer, (k, v) in enumerate(kv):
        # The same through a list, a tensor and an int32 tensor of block ids,
        # and for a prefix that ends inside a block.
        as_int32 = torch.tensor([7, 2, 11], dtype=torch.int32)
        for ids in ([7, 2, 11], torch.tensor([7, 2, 11]), as_int32):
            got_k, got_v = store.read(layer, ids, 10)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
        got_k, got_v = store.read(layer, [7, 2, 11], 5)
        assert torch.equal(got_k, k[:5]) and torch.equal(got_v, v[:5])
        # Extra blocks past the tokens are ignored; zero tokens read empty.
        got_k, _ = store.read(layer, [7, 2, 11, 0], 10)
        assert torch.equal(got_k, k)
        empty_k, empty_v = store.read(layer, [], 0)
        assert empty_k.shape == (0, 2, 8) and empty_v.shape == (0, 2, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_appends_token_by_token(kind: str) -> None:
    store = KVBlockStorage(SMALL, 8, layout_kind=kind)  # type: ignore[arg-type]
    table = BlockTable(4, [5, 1, 6], 0)
    kv = kv_for(SMALL, 11, seed=3)
    for pos in range(11):
        table.num_tokens = pos + 1
        slots = torch.tensor([table.slot(pos)])
        for layer, (k, v) in enumerate(kv):
            store.write(layer, slots, k[pos : pos + 1], v[pos : pos + 1])
    assert_reads(store, table, kv)


@pytest.mark.parametrize("kind", KINDS)
def test_batched_decode_writes_land_in_each_sequence(kind: str) -> None:
    store = KVBlockStorage(SMALL, 12, layout_kind=kind)  # type: ignore[arg-type]
    tables = [BlockTable(4, [3, 9], 6), BlockTable(4, [0], 2), BlockTable(4, [4, 8, 10], 9)]
    history = [kv_for(SMALL, t.num_tokens, seed=10 + i) for i, t in enumerate(tables)]
    for table, kv in zip(tables, history, strict=True):
        write_all(store, table.slot_mapping(0, table.num_tokens), kv)
    # One decode step: one new token per sequence, one write per layer.
    step = kv_for(SMALL, 3, seed=20)
    slots = torch.tensor([t.slot(t.num_tokens) for t in tables])
    write_all(store, slots, step)
    for i, (table, kv) in enumerate(zip(tables, history, strict=True)):
        table.num_tokens += 1
        want = [
            (torch.cat([k, sk[i : i + 1]]), torch.cat([v, sv[i : i + 1]]))
            for (k, v), (sk, sv) in zip(kv, step, strict=True)
        ]
        assert_reads(store, table, want)


@pytest.mark.parametrize("kind", KINDS)
def test_index_tensors_modified_in_place_are_not_served_stale(kind: str) -> None:
    store = KVBlockStorage(SMALL, 8, layout_kind=kind)  # type: ignore[arg-type]
    slots = torch.tensor([0, 1, 2, 3])
    kv = kv_for(SMALL, 4, seed=4)
    write_all(store, slots, kv)
    slots.add_(4)  # now block 1
    kv2 = kv_for(SMALL, 4, seed=5)
    write_all(store, slots, kv2)
    ids = torch.tensor([0])
    assert torch.equal(store.read(0, ids, 4)[0], kv[0][0])
    ids.fill_(1)
    assert torch.equal(store.read(0, ids, 4)[0], kv2[0][0])


@pytest.mark.parametrize("kind", KINDS)
def test_unchecked_indices_still_round_trip(kind: str) -> None:
    store = KVBlockStorage(SMALL, 8, layout_kind=kind, validate_indices=False)  # type: ignore[arg-type]
    table = BlockTable(4, [3, 6], 7)
    kv = kv_for(SMALL, 7, seed=21)
    write_all(store, torch.tensor(table.slot_mapping(0, 7)), kv)
    assert_reads(store, table, kv)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_cache_views_are_the_paged_caches(kind: str) -> None:
    store = KVBlockStorage(SMALL, 6, layout_kind=kind)  # type: ignore[arg-type]
    kv = kv_for(SMALL, 4, seed=6)
    write_all(store, [8, 9, 10, 11], kv)  # block 2
    for layer, (k, v) in enumerate(kv):
        k_cache, v_cache = store.layer_cache(layer)
        assert k_cache.shape == (6, 4, 2, 8)
        assert torch.equal(k_cache[2], k) and torch.equal(v_cache[2], v)
    assert store.layer_cache(0)[0].is_contiguous() == (kind == "layer")


def test_reads_are_copies() -> None:
    store = KVBlockStorage(SMALL, 4)
    kv = kv_for(SMALL, 4, seed=7)
    write_all(store, [0, 1, 2, 3], kv)
    k, _ = store.read(0, [0], 4)
    k.zero_()
    assert torch.equal(store.read(0, [0], 4)[0], kv[0][0])


# -- whole blocks: copy-on-write, export / import -----------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", [SMALL, BIG], ids=["small", "big"])
def test_copy_blocks_copies_every_layer(kind: str, layout: KVLayout) -> None:
    store = KVBlockStorage(layout, 10, layout_kind=kind)  # type: ignore[arg-type]
    assert store._copy_per_block == (kind == "block" and layout is BIG)
    fill_random_bytes(store, 8)
    before = store.export_blocks(list(range(10))).clone()
    store.copy_blocks([(1, 4), (2, 5), (1, 9)])
    after = store.export_blocks(list(range(10)))
    for src, dst in [(1, 4), (2, 5), (1, 9)]:
        assert torch.equal(after[dst].view(torch.uint8), before[src].view(torch.uint8))
    for b in (0, 1, 2, 3, 6, 7, 8):
        assert torch.equal(after[b].view(torch.uint8), before[b].view(torch.uint8))
    # All sources are read before any destination is written: a swap works.
    store.copy_blocks([(4, 5), (5, 4)])
    swapped = store.export_blocks([4, 5]).view(torch.uint8)
    assert torch.equal(swapped[0], before[2].view(torch.uint8))
    assert torch.equal(swapped[1], before[1].view(torch.uint8))
    store.copy_blocks([])  # nothing to do


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [*DTYPES, "float8_e4m3fn"])
def test_export_import_round_trip_preserves_bytes(kind: str, dtype: str) -> None:
    layout = small(dtype)
    src = KVBlockStorage(layout, 8, layout_kind=kind)  # type: ignore[arg-type]
    fill_random_bytes(src, 9)
    ids = [6, 0, 3]
    exported = src.export_blocks(ids)
    assert exported.shape == (3, *src.block_shape) and exported.dtype == src.dtype
    assert exported.is_contiguous()
    raw = exported.view(-1).view(torch.uint8)
    # Into both layout kinds, from the dtype tensor and from raw bytes.
    for other in KINDS:
        dst = KVBlockStorage(layout, 8, layout_kind=other)  # type: ignore[arg-type]
        dst.import_blocks([1, 2, 7], exported)
        assert torch.equal(dst.export_blocks([1, 2, 7]).view(-1).view(torch.uint8), raw)
        dst2 = KVBlockStorage(layout, 8, layout_kind=other)  # type: ignore[arg-type]
        dst2.import_blocks(torch.tensor([7, 1, 2]), raw.clone())
        for i, b in enumerate([7, 1, 2]):
            assert torch.equal(dst2.block_bytes(b), src.block_bytes(ids[i]))
    # One block at a time, as raw bytes or shaped.
    dst = KVBlockStorage(layout, 8, layout_kind=kind)  # type: ignore[arg-type]
    for b in ids:
        dst.load_block(b, src.block_bytes(b))
        assert torch.equal(dst.block_bytes(b), src.block_bytes(b))
    dst.load_block(5, src.export_blocks([3])[0])
    assert torch.equal(dst.block_bytes(5), src.block_bytes(3))
    # Into a caller's staging buffer.
    out = torch.empty_like(exported)
    assert src.export_blocks(ids, out=out) is out
    assert torch.equal(out.view(-1).view(torch.uint8), raw)


@pytest.mark.parametrize("kind", KINDS)
def test_exports_are_layout_independent(kind: str) -> None:
    """The same writes give byte-identical exports whichever layout stores them."""
    stores = {k: KVBlockStorage(SMALL, 6, layout_kind=k) for k in KINDS}  # type: ignore[misc]
    kv = kv_for(SMALL, 7, seed=11)
    for s in stores.values():
        write_all(s, [20, 21, 22, 23, 4, 5, 6], kv)
    ref = stores["block"].export_blocks([5, 1])
    assert torch.equal(stores[kind].export_blocks([5, 1]), ref)
    # The format: [block, layer, K/V, token, head, dim].
    assert torch.equal(ref[0, 2, 1, 3], kv[2][1][3])
    assert torch.equal(ref[1, 0, 0, 2], kv[0][0][6])


@pytest.mark.parametrize("layout", [SMALL, BIG], ids=["small", "big"])
def test_layouts_agree_under_a_random_op_sequence(layout: KVLayout) -> None:
    gen = torch.Generator().manual_seed(12)
    nb, bs = 12, layout.block_size
    stores = [KVBlockStorage(layout, nb, layout_kind=k) for k in KINDS]  # type: ignore[misc]
    for step in range(40):
        op = step % 4
        if op == 0:
            n = int(torch.randint(1, 3 * bs, (1,), generator=gen))
            slots = torch.randperm(nb * bs, generator=gen)[:n]
            kv = kv_for(layout, n, seed=100 + step)
            for s in stores:
                write_all(s, slots, kv)
        elif op == 1:
            perm = torch.randperm(nb, generator=gen).tolist()
            pairs = list(zip(perm[:3], perm[3:6], strict=True))
            for s in stores:
                s.copy_blocks(pairs)
        elif op == 2:
            ids = torch.randperm(nb, generator=gen)[:4]
            data = stores[0].export_blocks(torch.randperm(nb, generator=gen)[:4])
            for s in stores:
                s.import_blocks(ids, data)
        else:
            ids = torch.randperm(nb, generator=gen)[:5].tolist()
            n = 5 * bs - 3
            reads = [[s.read(layer, ids, n) for layer in range(layout.num_layers)] for s in stores]
            for (k0, v0), (k1, v1) in zip(reads[0], reads[1], strict=True):
                assert torch.equal(k0, k1) and torch.equal(v0, v1)
    everything = list(range(nb))
    assert torch.equal(stores[0].export_blocks(everything), stores[1].export_blocks(everything))


# -- with the manager: slot mappings, prefix reuse, copy-on-write ----------------------
@pytest.mark.parametrize("kind", KINDS)
def test_prefix_reuse_through_the_manager(kind: str) -> None:
    """A second request sharing a cached prefix reads the first request's K/V for it."""
    layout = small("bfloat16")
    bs = layout.block_size
    manager = KVCacheManager(num_blocks=16, block_size=bs)
    store = KVBlockStorage(layout, 16, layout_kind=kind)  # type: ignore[arg-type]
    fill_random_bytes(store, 13)

    prompt_a = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    alloc_a = manager.allocate("a", prompt_a)
    assert alloc_a.num_cached_tokens == 0
    kv_a = kv_for(layout, len(prompt_a), seed=14)
    slots_a = torch.tensor(alloc_a.block_table.slot_mapping(0, len(prompt_a)))
    write_all(store, slots_a, kv_a)
    assert_reads(store, alloc_a.block_table, kv_a)

    # b shares a's first 8 tokens (two full blocks), then diverges.
    prompt_b = [*prompt_a[:8], 7, 8, 9, 10, 11]
    alloc_b = manager.allocate("b", prompt_b)
    assert alloc_b.num_cached_tokens == 2 * bs
    assert alloc_b.block_table.blocks[:2] == alloc_a.block_table.blocks[:2]
    start = alloc_b.num_cached_tokens
    kv_b = kv_for(layout, len(prompt_b) - start, seed=15)  # only the uncached tokens
    slots_b = torch.tensor(alloc_b.block_table.slot_mapping(start, len(prompt_b)))
    write_all(store, slots_b, kv_b)
    for layer in range(layout.num_layers):
        k, v = store.read(layer, alloc_b.block_table)
        assert k.shape[0] == len(prompt_b)
        # The prefix comes from a's writes, the rest from b's.
        assert torch.equal(k[:start], kv_a[layer][0][:start])
        assert torch.equal(v[:start], kv_a[layer][1][:start])
        assert torch.equal(k[start:], kv_b[layer][0]) and torch.equal(v[start:], kv_b[layer][1])
    # b's writes did not touch a.
    assert_reads(store, manager.block_table("a"), kv_a)

    # a ends; its published blocks stay cached for a third request.
    manager.free("a")
    alloc_c = manager.allocate("c", [*prompt_a[:8], 42])
    assert alloc_c.num_cached_tokens == 2 * bs
    k, _ = store.read(1, alloc_c.block_table.blocks, 8)
    assert torch.equal(k, kv_a[1][0][:8])
    manager.check()


@pytest.mark.parametrize("kind", KINDS)
def test_fork_and_copy_on_write_through_the_manager(kind: str) -> None:
    layout = BIG
    bs = layout.block_size
    manager = KVCacheManager(num_blocks=8, block_size=bs)
    store = KVBlockStorage(layout, 8, layout_kind=kind)  # type: ignore[arg-type]
    prompt = list(range(bs + 5))  # one full block and a partial one
    alloc = manager.allocate("p", prompt)
    kv = kv_for(layout, len(prompt), seed=16)
    write_all(store, alloc.block_table.slot_mapping(0, len(prompt)), kv)

    manager.fork("p", "q")
    ext = manager.extend("q", [999])  # writes into the shared partial block: CoW
    assert len(ext.copies) == 1
    store.copy_blocks(ext.copies)
    new = kv_for(layout, 1, seed=17)
    pos = len(prompt)
    write_all(store, [ext.block_table.slot(pos)], new)

    want_q = [
        (torch.cat([k, nk]), torch.cat([v, nv])) for (k, v), (nk, nv) in zip(kv, new, strict=True)
    ]
    assert_reads(store, ext.block_table, want_q)
    assert_reads(store, manager.block_table("p"), kv)  # the original is untouched
    manager.check()


# -- errors -------------------------------------------------------------------------
def test_write_rejects_bad_input_with_helpful_messages() -> None:
    store = KVBlockStorage(SMALL, 4)
    k = torch.zeros(2, 2, 8)
    slots = torch.tensor([0, 1])
    cases: list[tuple[dict[str, object], str]] = [
        ({"k": torch.zeros(2, 16)}, r"k must be shaped \[n_tokens, num_kv_heads=2, head_dim=8\]"),
        ({"v": torch.zeros(2, 3, 8)}, r"v must be shaped .*got \[2, 3, 8\]"),
        ({"v": torch.zeros(3, 2, 8)}, "v has 3 tokens but k has 2"),
        ({"k": torch.zeros(2, 2, 8, dtype=torch.float16)}, r"k has dtype torch.float16 .*cast it"),
        ({"v": torch.zeros(2, 2, 8, device="meta")}, "v is on meta but the storage is on cpu"),
        ({"k": [[0.0]]}, "k must be a torch.Tensor"),
        ({"slots": torch.tensor([0, 1, 2])}, "slots has 3 entries but k and v have 2 tokens"),
        ({"slots": torch.tensor([0, 16])}, r"slots holds 16, outside \[0, 16\)"),
        ({"slots": torch.tensor([-1, 0])}, r"slots holds -1, outside"),
        ({"slots": [0, 99]}, r"slots holds 99, outside"),
        ({"slots": [0, 1.0]}, "slots must hold integers"),
        ({"slots": torch.tensor([0.0, 1.0])}, "slots must be an integer tensor"),
        ({"slots": torch.tensor([[0, 1]])}, "slots must be a 1-D tensor"),
        ({"slots": "01"}, "slots must be a sequence of ints"),
        ({"layer": 3}, "layer 3 is out of range: the layout has 3 layers"),
        ({"layer": -1}, "layer -1 is out of range"),
        ({"layer": True}, "layer must be an integer"),
    ]
    for override, message in cases:
        args: dict[str, object] = {"layer": 0, "slots": slots, "k": k, "v": k, **override}
        with pytest.raises(BadRequestError, match=message):
            store.write(**args)  # type: ignore[arg-type]
    # Nothing was written by the rejected calls.
    assert not store.tensor.any()
    # Errors are kvtier's typed errors, and ValueErrors.
    with pytest.raises(KvTierError):
        store.write(0, slots, torch.zeros(2, 2, 7), k)
    with pytest.raises(ValueError):
        store.write(0, slots, torch.zeros(2, 2, 7), k)
    store.write(0, torch.tensor([], dtype=torch.int64), torch.zeros(0, 2, 8), torch.zeros(0, 2, 8))


def test_read_and_block_operations_reject_bad_ids() -> None:
    store = KVBlockStorage(SMALL, 4)
    with pytest.raises(BadRequestError, match=r"block_ids holds 4, outside \[0, 4\)"):
        store.read(0, [0, 4], 8)
    with pytest.raises(BadRequestError, match=r"block_ids holds -2"):
        store.read(0, torch.tensor([-2]), 1)
    with pytest.raises(BadRequestError, match="9 tokens need 3 blocks of 4, but the block table"):
        store.read(0, [0, 1], 9)
    with pytest.raises(BadRequestError, match="num_tokens is required"):
        store.read(0, [0, 1])
    with pytest.raises(BadRequestError, match="num_tokens must be a non-negative integer"):
        store.read(0, [0, 1], -1)
    with pytest.raises(BadRequestError, match="layer 5 is out of range"):
        store.read(5, [0], 1)
    with pytest.raises(BadRequestError, match="copy destinations must be distinct"):
        store.copy_blocks([(0, 1), (2, 1)])
    with pytest.raises(BadRequestError, match=r"copy source holds 7"):
        store.copy_blocks([(7, 1)])
    with pytest.raises(BadRequestError, match=r"copy destination holds 4"):
        store.copy_blocks([(0, 4)])
    with pytest.raises(BadRequestError, match=r"\(src, dst\) block id pairs"):
        store.copy_blocks([(0, 1, 2)])  # type: ignore[list-item]
    with pytest.raises(BadRequestError, match="block_ids holds 9"):
        store.export_blocks([9])
    with pytest.raises(BadRequestError, match="block_ids holds 4"):
        store.block_bytes(4)

    data = store.export_blocks([0, 1])
    with pytest.raises(BadRequestError, match="must be distinct"):
        store.import_blocks([2, 2], data)
    with pytest.raises(BadRequestError, match=r"block data must be shaped \[2, 3, 2, 4, 2, 8\]"):
        store.import_blocks([2, 3], data[:1])
    with pytest.raises(BadRequestError, match=r"raw block data must hold 2 x 1536 = 3072 bytes"):
        store.import_blocks([2, 3], torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(BadRequestError, match=r"give the storage dtype torch\.float32 or raw"):
        store.import_blocks([2, 3], data.to(torch.float16))
    with pytest.raises(BadRequestError, match=r"must be a torch\.Tensor"):
        store.import_blocks([2, 3], b"\x00" * 3072)  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match=r"block data must be shaped \[3, 2, 4, 2, 8\]"):
        store.load_block(1, data)
    with pytest.raises(BadRequestError, match=r"out must be a contiguous torch\.float32 tensor"):
        store.export_blocks([0, 1], out=torch.empty(1, *store.block_shape))
    with pytest.raises(BadRequestError, match="not contiguous"):
        store.export_blocks([0], out=torch.empty(1, 3, 2, 4, 2, 16)[..., ::2])
    # Raw bytes need not be contiguous.
    fill_random_bytes(store, 19)
    raw = torch.stack([store.block_bytes(0), torch.zeros(1536, dtype=torch.uint8)], dim=1)
    store.import_blocks([3], raw[:, 0])
    assert torch.equal(store.block_bytes(3), store.block_bytes(0))


# -- torch stays optional -----------------------------------------------------------------
def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
    )


def test_import_kvtier_does_not_import_torch() -> None:
    done = _run("import sys, kvtier; print('torch' in sys.modules)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_missing_torch_gives_an_install_hint() -> None:
    done = _run(
        "import sys; sys.modules['torch'] = None\n"
        "import kvtier\n"
        "try:\n"
        "    import kvtier.storage\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "pip install torch==2.13.0" in done.stdout


# -- CUDA (runs where a GPU is available) ---------------------------------------------------
@hardware_mark(torch.cuda.is_available(), "no CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_round_trip_and_offload_to_host(kind: str) -> None:
    layout = small("bfloat16")
    store = KVBlockStorage(layout, 8, device="cuda", layout_kind=kind)  # type: ignore[arg-type]
    assert store.device.type == "cuda" and store.tensor.is_cuda
    table = BlockTable(4, [6, 1, 3], 10)
    kv = [(k.cuda(), v.cuda()) for k, v in kv_for(layout, 10, seed=18)]
    write_all(store, torch.tensor(table.slot_mapping(0, 10)), kv)  # host slots are moved over
    assert_reads(store, table, kv)
    host = torch.empty((3, *store.block_shape), dtype=store.dtype).pin_memory()
    store.export_blocks([6, 1, 3], out=host)
    torch.cuda.synchronize()
    store.import_blocks([0, 2, 4], host)
    store.copy_blocks([(0, 5)])
    assert_reads(store, BlockTable(4, [5, 2, 4], 10), kv)
    with pytest.raises(BadRequestError, match="is on cpu but the storage is on cuda"):
        store.write(0, [0], torch.zeros(1, 2, 8, dtype=torch.bfloat16), kv[0][0][:1])
