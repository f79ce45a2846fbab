"""The tier chain over real tensors: demote on eviction, promote on hit, faults, restart, swap."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvtier import KVCacheManager
from kvtier.engine import KvTierCache
from kvtier.layout import KVLayout
from kvtier.offload.chain import Tier, TierChain
from kvtier.offload.disk import DiskStore
from kvtier.offload.host import HostStore
from kvtier.storage import KVBlockStorage

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype="float32")


def device(num_blocks: int = 8) -> tuple[KVBlockStorage, KVCacheManager]:
    return KVBlockStorage(LAYOUT, num_blocks), KVCacheManager(num_blocks, BS)


def compute(
    storage: KVBlockStorage, mgr: KVCacheManager, rid: str, tokens: list[int], seed: int
) -> torch.Tensor:
    """Stand in for a forward pass: fill the request's blocks with data; end it."""
    alloc = mgr.allocate(rid, tokens)
    blocks = alloc.block_table.blocks
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn((len(blocks), *storage.block_shape), generator=gen)
    storage.import_blocks(blocks, data)
    mgr.free(rid)
    return data


def prompt(base: int, n_blocks: int) -> list[int]:
    """``n_blocks`` full blocks plus one token, so every full block can be reused."""
    return [base + i for i in range(n_blocks * BS + 1)]


def chain_of(storage: KVBlockStorage, mgr: KVCacheManager, *tiers: Tier, **kw: object) -> TierChain:
    return TierChain(storage, mgr, list(tiers), **kw)  # type: ignore[arg-type]


def test_write_back_demotes_evicted_blocks_and_promotes_them_bit_exact() -> None:
    storage, mgr = device(8)
    chain = chain_of(storage, mgr, Tier(HostStore(), 16))
    a = prompt(1000, 4)
    data_a = compute(storage, mgr, "a", a, seed=1)
    # Two more requests need the whole pool: a's blocks are evicted to host.
    compute(storage, mgr, "b", prompt(2000, 4), seed=2)
    compute(storage, mgr, "c", prompt(3000, 4), seed=3)
    assert mgr.pool.lookup(mgr.hasher.chain(a)) == []
    st = chain.stats()["host"]
    assert st["stored_blocks"] >= 4 and st["used_blocks"] >= 4
    cache = KvTierCache(storage, mgr, "a2", a, tiers=chain)
    assert cache.num_cached_tokens == 16 and cache.num_loaded_tokens == 16
    got = storage.export_blocks(cache.block_table.blocks[:4])
    assert torch.equal(got, data_a[:4])
    cache.release()
    chain.check()
    mgr.check()
    chain.close()


def test_deferred_demotions_copy_nothing_inside_allocate_and_lose_nothing() -> None:
    storage, mgr = device(5)
    chain = chain_of(storage, mgr, Tier(HostStore(), 16))
    chain.defer_demotions = True
    a = prompt(1000, 4)
    data_a = compute(storage, mgr, "a", a, seed=1)
    # b's allocate evicts a's blocks: they are queued, not copied, and the tier is empty.
    alloc = mgr.allocate("b", prompt(2000, 4))
    assert chain.demotions_pending == 4
    assert chain.stats()["host"]["stored_blocks"] == 0
    # The owner demotes before the blocks are written (here: before b's "forward pass").
    assert chain.demote_pending() == 4 and chain.demotions_pending == 0
    gen = torch.Generator().manual_seed(2)
    blocks = alloc.block_table.blocks
    storage.import_blocks(blocks, torch.randn((len(blocks), *storage.block_shape), generator=gen))
    mgr.free("b")
    assert chain.stats()["host"]["stored_blocks"] == 4
    cache = KvTierCache(storage, mgr, "a2", a, tiers=chain)
    assert cache.num_loaded_tokens == 16
    assert torch.equal(storage.export_blocks(cache.block_table.blocks[:4]), data_a[:4])
    cache.release()
    chain.check()
    mgr.check()
    chain.close()


def test_a_tier_load_demotes_queued_evictions_first() -> None:
    storage, mgr = device(5)
    chain = chain_of(storage, mgr, Tier(HostStore(), 32))
    chain.defer_demotions = True
    a, b = prompt(1000, 4), prompt(2000, 4)

    def compute_deferred(rid: str, tokens: list[int], seed: int) -> torch.Tensor:
        """A forward pass as the engine runs it: demote what allocate evicted, then write."""
        blocks = mgr.allocate(rid, tokens).block_table.blocks
        chain.demote_pending()
        gen = torch.Generator().manual_seed(seed)
        data = torch.randn((len(blocks), *storage.block_shape), generator=gen)
        storage.import_blocks(blocks, data)
        mgr.free(rid)
        return data

    data_a = compute_deferred("a", a, seed=1)
    data_b = compute_deferred("b", b, seed=2)  # evicts a (queued, then demoted)
    # Loading a back evicts b into the queue; the load writes b's old blocks, so the
    # queued demotion of b must run before the load installs a.
    cache = KvTierCache(storage, mgr, "a2", a, tiers=chain)
    assert cache.num_loaded_tokens == 16
    assert torch.equal(storage.export_blocks(cache.block_table.blocks[:4]), data_a[:4])
    cache.release()
    chain.demote_pending()
    again = KvTierCache(storage, mgr, "b2", b, tiers=chain)
    assert again.num_cached_tokens == 16
    assert torch.equal(storage.export_blocks(again.block_table.blocks[:4]), data_b[:4])
    again.release()
    chain.close()


def test_host_evictions_cascade_to_disk(tmp_path: Path) -> None:
    storage, mgr = device(8)
    chain = chain_of(
        storage, mgr, Tier(HostStore(), 4), Tier(DiskStore(tmp_path), 64, codec="raw")
    )
    prompts = [prompt(1000 * (i + 1), 4) for i in range(5)]
    datas = [compute(storage, mgr, f"r{i}", p, seed=i) for i, p in enumerate(prompts)]
    chain.flush()
    st = chain.stats()
    assert st["host"]["evictions"] > 0 and st["disk"]["stored_blocks"] > 0
    hits = 0
    for i, p in enumerate(prompts[:3]):
        cache = KvTierCache(storage, mgr, f"again{i}", p, tiers=chain)
        n = cache.num_cached_tokens // BS
        if n:
            hits += 1
            assert torch.equal(storage.export_blocks(cache.block_table.blocks[:n]), datas[i][:n])
        cache.release()
        chain.flush()
    assert hits >= 2
    assert chain.stats()["disk"]["loaded_blocks"] > 0
    chain.check()
    chain.close()


def test_write_through_int8_disk_is_close_and_stored_at_once(tmp_path: Path) -> None:
    storage, mgr = device(16)
    chain = chain_of(
        storage, mgr, Tier(DiskStore(tmp_path), 32, codec="int8"), write_mode="write_through"
    )
    a = prompt(10, 3)
    alloc = mgr.allocate("a", a)
    blocks = alloc.block_table.blocks[:3]
    data = torch.randn((3, *storage.block_shape))
    storage.import_blocks(blocks, data)
    chain.store_computed(mgr.block_keys("a")[:3], blocks)
    chain.flush()
    assert chain.stats()["disk"]["stored_blocks"] == 3
    assert len(list(tmp_path.rglob("*.kvb"))) == 3
    mgr.free("a")
    mgr.reset_prefix_cache()
    cache = KvTierCache(storage, mgr, "a2", a, tiers=chain)
    assert cache.num_loaded_tokens == 12
    got = storage.export_blocks(cache.block_table.blocks[:3])
    amax = data.abs().amax()
    assert float((got - data).abs().max()) <= float(amax) / 127 + 1e-6
    cache.release()
    chain.close()


def _disk_chain(
    tmp_path: Path, num_blocks: int = 16
) -> tuple[KVBlockStorage, KVCacheManager, TierChain]:
    storage, mgr = device(num_blocks)
    chain = chain_of(storage, mgr, Tier(DiskStore(tmp_path), 32), write_mode="write_through")
    return storage, mgr, chain


def _store_prompt(
    storage: KVBlockStorage, mgr: KVCacheManager, chain: TierChain, toks: list[int]
) -> torch.Tensor:
    alloc = mgr.allocate("w", toks)
    n = len(toks) // BS
    blocks = alloc.block_table.blocks[:n]
    data = torch.randn((n, *storage.block_shape))
    storage.import_blocks(blocks, data)
    chain.store_computed(mgr.block_keys("w")[:n], blocks)
    chain.flush()
    mgr.free("w")
    mgr.reset_prefix_cache()
    return data


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete", "garbage"])
def test_damaged_disk_block_is_a_counted_miss(tmp_path: Path, damage: str) -> None:
    storage, mgr, chain = _disk_chain(tmp_path)
    toks = prompt(500, 4)
    data = _store_prompt(storage, mgr, chain, toks)
    keys = mgr.hasher.chain(toks)
    victim = chain.tiers[0].medium.path(keys[2])  # type: ignore[attr-defined]
    raw = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(raw[: len(raw) // 2])
    elif damage == "bitflip":
        raw[len(raw) - 100] ^= 0x10
        victim.write_bytes(raw)
    elif damage == "delete":
        victim.unlink()
    else:
        victim.write_bytes(os.urandom(len(raw)))
    cache = KvTierCache(storage, mgr, "x", toks, tiers=chain)
    # Blocks 0 and 1 load; block 2 is bad, so it and block 3 are computed instead.
    assert cache.num_loaded_tokens == 2 * BS
    assert torch.equal(storage.export_blocks(cache.block_table.blocks[:2]), data[:2])
    st = chain.stats()["disk"]
    if damage == "delete":
        assert st["vanished_blocks"] == 1
    else:
        assert st["corrupt_blocks"] == 1
    assert st["used_blocks"] == 3  # the bad block is dropped from the tier
    assert not victim.exists()
    cache.release()
    chain.check()
    chain.close()


def test_restart_on_the_same_directory_finds_blocks(tmp_path: Path) -> None:
    storage, mgr, chain = _disk_chain(tmp_path)
    toks = prompt(700, 5)
    data = _store_prompt(storage, mgr, chain, toks)
    chain.close()
    # A crash mid-write leaves a temporary file; the next start removes it.
    stray = next(tmp_path.rglob("*.kvb")).with_suffix(".kvb.tmp999")
    stray.write_bytes(b"partial")
    # A new "process": new device, manager and chain on the same directory.
    storage2, mgr2 = device(16)
    chain2 = chain_of(storage2, mgr2, Tier(DiskStore(tmp_path), 32))
    assert chain2.stats()["disk"]["adopted_blocks"] == 5
    assert not stray.exists()
    cache = KvTierCache(storage2, mgr2, "again", toks, tiers=chain2)
    assert cache.num_loaded_tokens == 5 * BS
    assert torch.equal(storage2.export_blocks(cache.block_table.blocks[:5]), data)
    cache.release()
    chain2.close()


def test_restart_with_more_files_than_capacity_adopts_the_newest(tmp_path: Path) -> None:
    storage, mgr, chain = _disk_chain(tmp_path)
    old, new = prompt(800, 5), prompt(900, 5)
    _store_prompt(storage, mgr, chain, old)
    data_new = _store_prompt(storage, mgr, chain, new)
    chain.close()
    disk: DiskStore = chain.tiers[0].medium  # type: ignore[assignment]
    # Ten files on disk; make the age order certain (same-flush writes can share an mtime).
    for age, toks in ((1000, old), (2000, new)):
        for key in mgr.hasher.chain(toks):
            os.utime(disk.path(key), (age, age))
    # Restart with room for five blocks: the five newest files are adopted, no more.
    storage2, mgr2 = device(16)
    chain2 = chain_of(storage2, mgr2, Tier(DiskStore(tmp_path), 5))
    tier = chain2.tiers[0]
    assert tier.counters.adopted_blocks == 5 == len(tier.offload_manager)
    assert sorted(tier.offload_manager.ready_keys()) == sorted(mgr2.hasher.chain(new))
    chain2.check()
    cache = KvTierCache(storage2, mgr2, "new", new, tiers=chain2)
    assert cache.num_loaded_tokens == 5 * BS
    assert torch.equal(storage2.export_blocks(cache.block_table.blocks[:5]), data_new)
    cache.release()
    cache = KvTierCache(storage2, mgr2, "old", old, tiers=chain2)
    assert cache.num_loaded_tokens == 0, "a block beyond the capacity was not adopted"
    cache.release()
    chain2.check()
    mgr2.check()
    chain2.close()


def test_a_full_tier_drops_demotions_without_breaking_eviction() -> None:
    storage, mgr = device(4)
    chain = chain_of(storage, mgr, Tier(HostStore(), 2))
    for i in range(6):
        compute(storage, mgr, f"r{i}", prompt(100 * (i + 1), 3), seed=i)
    st = chain.stats()["host"]
    device_evictions = mgr.stats().evictions + mgr.stats().cascade_evictions
    assert device_evictions >= 6 * 3 - 4
    # Every block the device evicted was offered to the tier once: stored or dropped.
    assert st["stored_blocks"] + st["dropped_blocks"] == device_evictions
    assert st["stored_blocks"] > 0 and st["dropped_blocks"] > 0
    assert st["used_blocks"] == st["capacity_blocks"] == 2
    # What the full tier stored beyond its two slots pushed older blocks out.
    assert st["evictions"] == st["stored_blocks"] - st["used_blocks"]
    mgr.check()
    chain.check()
    chain.close()


def test_swap_out_and_in_restores_every_computed_token() -> None:
    storage, mgr = device(12)
    chain = chain_of(storage, mgr, Tier(HostStore(), 16))
    toks = [*prompt(40, 2), 7, 8]  # 2 full blocks + 3 tail tokens
    alloc = mgr.allocate("s", toks)
    blocks = alloc.block_table.blocks
    data = torch.randn((len(blocks), *storage.block_shape))
    storage.import_blocks(blocks, data)
    cache = KvTierCache.__new__(KvTierCache)
    cache._init(storage, mgr, "s", list(toks), alloc.block_table, len(toks))
    cache._tiers = chain
    free_before = mgr.pool.num_empty
    swapped = cache.swap_out()
    assert "s" not in mgr
    assert mgr.pool.num_empty == free_before + len(blocks)  # gone from the device
    assert swapped.tail_key is not None and swapped.num_computed_tokens == len(toks)
    back = KvTierCache.swap_in(swapped, storage, mgr, chain, token_ids=[*toks, 9])
    assert back.num_computed_tokens == len(toks)
    got = storage.export_blocks(back.block_table.blocks[:3])
    # Whole blocks for the full ones; the tail's computed slots for the last.
    assert torch.equal(got[:2], data[:2])
    assert torch.equal(got[2, :, :, :3], data[2, :, :, :3])
    back.release()
    mgr.check()
    chain.check()
    chain.close()


def test_events_report_stores_and_removals() -> None:
    storage, mgr = device(4)
    chain = chain_of(storage, mgr, Tier(HostStore(), 3))
    for i in range(4):
        compute(storage, mgr, f"r{i}", prompt(100 * (i + 1), 2), seed=i)
    events = chain.take_events()
    stored = [k for e in events if not e.removed for k in e.keys]
    removed = [k for e in events if e.removed for k in e.keys]
    assert stored and removed and all(e.medium == "host" for e in events)
    assert set(stored) - set(removed) == set(chain.tiers[0].offload_manager.ready_keys())
    chain.close()
