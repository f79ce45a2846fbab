"""The compressed device tier and quantized pools in the tier chain, on real tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import precondition, rule  # noqa: E402
from test_offload_manager import OffloadMachine  # noqa: E402
from test_tier_chain import compute, prompt  # noqa: E402

from kvtier import BadRequestError, ConfigError, KVCacheManager  # noqa: E402
from kvtier.engine import KvTierCache  # noqa: E402
from kvtier.layout import KVLayout, cache_layout  # noqa: E402
from kvtier.offload.chain import Tier, TierChain  # noqa: E402
from kvtier.offload.codec import HEADER_SIZE, Int8Codec, make_codec, verify  # noqa: E402
from kvtier.offload.config import TierSpec  # noqa: E402
from kvtier.offload.device_tier import DeviceStore  # noqa: E402
from kvtier.offload.host import HostStore  # noqa: E402
from kvtier.offload.media import ItemFormat  # noqa: E402
from kvtier.policy import available_policies  # noqa: E402
from kvtier.server.metrics import render, tier_families  # noqa: E402
from kvtier.storage import KVBlockStorage, QuantizedKVBlockStorage, make_storage  # noqa: E402

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype="float32")
INT8 = cache_layout(LAYOUT, "int8")


def int8_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within half an int8 step of each (block, layer, K/V, head)."""
    step = want.abs().amax(dim=(-3, -1), keepdim=True) / 127
    return bool(torch.all((got - want).abs() <= 0.5 * step + 1e-6))


# -- configuration ------------------------------------------------------------------------
def test_device_tier_urls() -> None:
    spec = TierSpec.from_url("device:2MiB")
    assert (spec.medium, spec.size_bytes, spec.codec) == ("device", 2 * 2**20, "int8")
    assert TierSpec.from_url("device:?size=1MiB&codec=fp8&policy=arc").codec == "fp8"
    assert TierSpec.from_url(spec.describe()) == spec
    with pytest.raises(ConfigError, match="compressed blocks"):
        TierSpec.from_url("device:1MiB?codec=raw")
    with pytest.raises(ConfigError, match="needs a size"):
        TierSpec.from_url("device:")
    with pytest.raises(ConfigError, match="once"):
        TierSpec.from_url("device:1MiB?size=2MiB")
    tier = spec.build((2, 2, BS, 2, 8), torch.float32, device="cpu")
    assert isinstance(tier.medium, DeviceStore) and tier.codec.name == "int8"
    # 2 MiB of int8 blocks of (2, 2, 4, 2, 8): 256 bytes and 32 of scales, plus a header each.
    assert tier.capacity == 2 * 2**20 // (256 + 32 + HEADER_SIZE)
    with pytest.raises(ConfigError, match="invalid device"):
        DeviceStore("nowhere")


# -- the compressed tier in the chain ------------------------------------------------------
def test_evicted_blocks_are_compressed_on_the_device_and_decoded_back() -> None:
    storage, mgr = KVBlockStorage(LAYOUT, 8), KVCacheManager(8, BS)
    chain = TierChain(storage, mgr, [Tier(DeviceStore(), 16, codec="int8")])
    a = prompt(1000, 4)
    data_a = compute(storage, mgr, "a", a, seed=1)
    compute(storage, mgr, "b", prompt(2000, 4), seed=2)
    compute(storage, mgr, "c", prompt(3000, 4), seed=3)
    assert mgr.pool.lookup(mgr.hasher.chain(a)) == []  # evicted from the pool ...
    st = chain.stats()["device"]
    assert st["used_blocks"] >= 4 and st["encode_seconds"] > 0  # ... into the device tier
    cache = KvTierCache(storage, mgr, "a2", a, tiers=chain)
    assert cache.num_loaded_tokens == 16
    assert int8_close(storage.export_blocks(cache.block_table.blocks[:4]), data_a[:4])
    cache.release()
    st = chain.stats()["device"]
    assert st["loaded_blocks"] == 4 and st["decode_seconds"] > 0
    assert st["compression_ratio"] == storage.bytes_per_block / (256 + 32)
    assert st["bytes_saved"] == st["used_blocks"] * (storage.bytes_per_block - 288)
    chain.check()
    mgr.check()
    chain.close()


def test_what_the_device_tier_evicts_goes_down_to_host() -> None:
    storage, mgr = KVBlockStorage(LAYOUT, 8), KVCacheManager(8, BS)
    chain = TierChain(
        storage, mgr, [Tier(DeviceStore(), 4, codec="int8"), Tier(HostStore(), 64, codec="int8")]
    )
    datas = [compute(storage, mgr, f"r{i}", prompt(1000 * (i + 1), 4), seed=i) for i in range(5)]
    st = chain.stats()
    assert st["device"]["evictions"] > 0 and st["host"]["stored_blocks"] > 0
    cache = KvTierCache(storage, mgr, "again", prompt(1000, 4), tiers=chain)
    assert cache.num_loaded_tokens == 16
    assert int8_close(storage.export_blocks(cache.block_table.blocks[:4]), datas[0][:4])
    cache.release()
    assert chain.stats()["host"]["loaded_blocks"] > 0
    chain.check()
    chain.close()


def test_compress_moves_the_tail_of_a_chain_and_frees_the_pool() -> None:
    storage, mgr = KVBlockStorage(LAYOUT, 16), KVCacheManager(16, BS)
    chain = TierChain(storage, mgr, [Tier(DeviceStore(), 32, codec="int8")])
    a = prompt(1000, 6)
    data = compute(storage, mgr, "a", a, seed=4)
    keys = mgr.hasher.chain(a)
    free = mgr.pool.num_empty
    half = chain.compress(keys, 0.5)
    assert half.blocks == 3 and half.device_bytes == 3 * storage.bytes_per_block
    assert half.stored_bytes == 3 * 288 and half.ratio == storage.bytes_per_block / 288
    assert len(mgr.pool.lookup(keys)) == 3 and mgr.pool.num_empty == free + 3
    st = chain.stats()["device"]
    assert st["compressed_requests"] == 1 and st["used_blocks"] == 3
    rest = chain.compress(keys)
    assert rest.blocks == 3 and mgr.pool.lookup(keys) == []
    assert (half + rest).blocks == 6
    assert chain.compress(keys).blocks == 0  # nothing left on the device
    cache = KvTierCache(storage, mgr, "a2", a, tiers=chain)
    assert cache.num_cached_tokens == 24 and cache.num_loaded_tokens == 24
    assert int8_close(storage.export_blocks(cache.block_table.blocks[:6]), data[:6])
    # A running request's blocks stay: its whole chain is held.
    assert chain.compress(keys).blocks == 0
    cache.release()
    mgr.check()
    chain.check()
    chain.close()


def test_compress_takes_cached_descendants_along() -> None:
    storage, mgr = KVBlockStorage(LAYOUT, 16), KVCacheManager(16, BS)
    chain = TierChain(storage, mgr, [Tier(DeviceStore(), 32, codec="int8")])
    base = prompt(1000, 2)[:-1]
    compute(storage, mgr, "a", [*base, 5, 6, 7, 8, 9], seed=1)
    compute(storage, mgr, "b", [*base, 1, 2, 3, 4, 9], seed=2)  # a sibling branch
    moved = chain.compress(mgr.hasher.chain(base[:BS]), 1.0)
    assert moved.blocks == 4  # the shared two and both branches' third block
    assert mgr.pool.num_cached == 0
    mgr.check()
    chain.check()
    chain.close()


def test_compress_errors() -> None:
    storage, mgr = KVBlockStorage(LAYOUT, 8), KVCacheManager(8, BS)
    chain = TierChain(storage, mgr, [Tier(HostStore(), 8)])
    assert chain.device_tier() is None
    with pytest.raises(ConfigError, match="device tier"):
        chain.compress([1, 2])
    with pytest.raises(BadRequestError, match="fraction"):
        chain.compress([1], 0.0)
    with pytest.raises(BadRequestError, match="does not exist"):
        chain.compress([1], tier=3)
    assert chain.compress([1, 2], tier=0).blocks == 0  # any tier can be named
    chain.close()


# -- quantized pools keep their codec --------------------------------------------------------
def test_a_quantized_pool_offloads_its_payloads_as_they_are() -> None:
    storage, mgr = make_storage(INT8, 8), KVCacheManager(8, BS)
    assert isinstance(storage, QuantizedKVBlockStorage)
    host = HostStore()
    chain = TierChain(storage, mgr, [Tier(host, 16, codec="int8")])
    a = prompt(1000, 4)
    compute(storage, mgr, "a", a, seed=1)
    blocks = mgr.pool.lookup(mgr.hasher.chain(a))
    held = [storage.block_bytes(b) for b in blocks]
    compute(storage, mgr, "b", prompt(2000, 4), seed=2)
    compute(storage, mgr, "c", prompt(3000, 4), seed=3)
    tier = chain.tiers[0]
    for key, payload in zip(mgr.hasher.chain(a), held, strict=True):
        # The pool's own bytes: not decoded and encoded again on the way down.
        assert torch.equal(host.row(tier.offload_manager.slot_of(key)), payload)
    assert chain.stats()["host"]["compression_ratio"] == 1.0
    cache = KvTierCache(storage, mgr, "a2", a, tiers=chain)
    assert cache.num_loaded_tokens == 16
    for b, payload in zip(cache.block_table.blocks[:4], held, strict=True):
        assert torch.equal(storage.block_bytes(b), payload)  # and back, bit for bit
    cache.release()
    assert chain.stats()["host"]["decode_seconds"] == 0.0
    chain.close()


@pytest.mark.parametrize("codec", ["raw", "fp8"])
def test_a_quantized_pool_under_another_codec_decodes_first(codec: str) -> None:
    storage, mgr = make_storage(INT8, 8), KVCacheManager(8, BS)
    chain = TierChain(storage, mgr, [Tier(HostStore(), 16, codec=codec)])
    assert chain.tiers[0].fmt is not None and chain.tiers[0].fmt.dtype == torch.float32
    a = prompt(1000, 4)
    compute(storage, mgr, "a", a, seed=1)
    before = storage.export_blocks(mgr.pool.lookup(mgr.hasher.chain(a)))
    compute(storage, mgr, "b", prompt(2000, 4), seed=2)
    compute(storage, mgr, "c", prompt(3000, 4), seed=3)
    cache = KvTierCache(storage, mgr, "a2", a, tiers=chain)
    assert cache.num_loaded_tokens == 16
    after = storage.export_blocks(cache.block_table.blocks[:4])
    if codec == "raw":  # float32 of the dequantized values: quantized again to the same
        assert torch.allclose(after, before, rtol=1e-6, atol=0)
    else:
        assert torch.allclose(after, before, rtol=0.07, atol=before.abs().max() * 2**-9)
    cache.release()
    chain.close()


def test_swap_of_a_quantized_request_keeps_its_bytes() -> None:
    storage, mgr = make_storage(INT8, 8), KVCacheManager(8, BS)
    chain = TierChain(storage, mgr, [Tier(HostStore(), 16, codec="int8")])
    tokens = [*prompt(1000, 2)[:-1], 7, 8]  # two full blocks and a partial one
    alloc = mgr.allocate("r", tokens)
    blocks = alloc.block_table.blocks
    gen = torch.Generator().manual_seed(9)
    x = torch.randn((len(tokens), 2, 8), generator=gen)
    slots = alloc.block_table.slot_mapping(0, len(tokens))
    for layer in range(2):
        storage.write(layer, slots, x, -x)
    held = [storage.block_bytes(b) for b in blocks]
    swapped = chain.swap_out("r", tokens, len(tokens))
    assert mgr.pool.num_empty == 8
    cache = KvTierCache.swap_in(swapped, storage, mgr, chain)
    assert cache.num_computed_tokens == len(tokens)
    for b, payload in zip(cache.block_table.blocks, held, strict=True):
        assert torch.equal(storage.block_bytes(b), payload)
    cache.release()
    chain.close()


def test_tier_metrics_report_compression() -> None:
    storage, mgr = KVBlockStorage(LAYOUT, 8), KVCacheManager(8, BS)
    chain = TierChain(storage, mgr, [Tier(DeviceStore(), 16, codec="int8")])
    compute(storage, mgr, "a", prompt(1000, 4), seed=1)
    chain.compress(mgr.hasher.chain(prompt(1000, 4)))
    text = render(tier_families(chain.stats()))
    assert f'kvtier_tier_bytes_saved{{tier="device"}} {4 * (1024 - 288)}' in text
    assert 'kvtier_tier_compressed_requests_total{tier="device"} 1' in text
    assert 'kvtier_tier_compression_ratio{tier="device"} ' in text
    assert 'kvtier_tier_codec_seconds_total{direction="encode",tier="device"} ' in text
    chain.close()


# -- the offloading-manager state machine, with payloads in the device medium -----------
class DeviceMediumMachine(OffloadMachine):
    """:class:`OffloadMachine` with a real device medium behind the manager.

    Every completed store puts an encoded block into the medium at the slot
    the manager gave it; every load reads the slots it is given and must get
    back, verified, exactly the block stored under that key.
    """

    def _bind(self) -> None:
        shape = (2, 2, BS, 2, 8)
        self.fmt = ItemFormat(make_codec("int8"), shape, torch.float32)
        self.store = DeviceStore()
        self.store.bind("test", self.capacity, self.fmt.payload_size)
        self.payloads: dict[int, torch.Tensor] = {}

    def _payload(self, key: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(key)
        return Int8Codec().encode(torch.randn(self.fmt.shape, generator=gen))

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        if not hasattr(self, "store"):
            self._bind()
        keys = data.draw(st.lists(st.sampled_from(sorted(self.pending)), min_size=1, unique=True))
        if success:
            items = [(k, self.m.slot_of(k), self._payload(k), self.fmt) for k in keys]
            self.store.put(items)
            for k, _, p, _ in items:
                self.payloads[k] = p
        self.m.complete_store(keys, success)
        for k in keys:
            self.pending.discard(k)
            if success:
                self.ready.add(k)

    @precondition(lambda self: bool(self.ready))
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3))
        slots = self.m.prepare_load(keys)
        got = self.store.get(list(zip(keys, slots, strict=True)))
        for key, stored in zip(keys, got, strict=True):
            assert stored is not None
            header, payload = stored
            verify(header, payload, key, self.fmt.shape, torch.float32)
            assert torch.equal(payload, self.payloads[key])
        for k in keys:
            self.loads[k] = self.loads.get(k, 0) + 1


@pytest.mark.parametrize("policy", available_policies())
def test_device_tier_state_machine(policy: str) -> None:
    machine = type(f"DeviceMediumMachine_{policy}", (DeviceMediumMachine,), {"policy_name": policy})
    machine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
    machine.TestCase().runTest()
