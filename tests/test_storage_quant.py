"""Quantized and cast KV block storage on real tensors: error bounds, scales, whole-block moves."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier import BlockHasher, KVLayout, Namespace  # noqa: E402
from kvtier.errors import BadRequestError, ConfigError  # noqa: E402
from kvtier.layout import cache_layout  # noqa: E402
from kvtier.offload.codec import Fp8Codec, Int8Codec  # noqa: E402
from kvtier.storage import (  # noqa: E402
    CastKVBlockStorage,
    KVBlockStorage,
    QuantizedKVBlockStorage,
    make_storage,
)

# 2 layers, 2 KV heads, head_dim 8, 4-token blocks.
FLOAT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
BS = FLOAT.block_size
QUANT = {"int8": cache_layout(FLOAT, "int8"), "fp8_e4m3": cache_layout(FLOAT, "fp8_e4m3")}
SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")


def tokens(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, FLOAT.num_kv_heads, FLOAT.head_dim), generator=gen) * scale


def rounding_bound(kind: str, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest error of one rounding of ``x`` with per-head ``scale`` (``[n, heads, 1]``)."""
    if kind == "int8":
        return 0.5 * scale
    # e4m3: 3 mantissa bits (half a step is 2**-4 of the value), subnormals below 2**-6.
    return x.abs() * 2.0**-4 + scale * 2.0**-10


# -- layouts and sizes ------------------------------------------------------------------
def test_scaled_layouts_hold_four_times_the_float32_blocks() -> None:
    f32 = SMOLLM2.bytes_per_block
    bf16 = cache_layout(SMOLLM2, "bfloat16").bytes_per_block
    int8 = cache_layout(SMOLLM2, "int8")
    assert f32 == 737_280 and bf16 == 368_640
    assert int8.bytes_per_block == 30 * 2 * 16 * 3 * 64 + 4 * 30 * 2 * 3
    assert f32 / int8.bytes_per_block >= 3.5 and bf16 / int8.bytes_per_block >= 1.8
    assert cache_layout(SMOLLM2, "fp8_e4m3").bytes_per_block == int8.bytes_per_block
    assert cache_layout(SMOLLM2, "auto") is SMOLLM2


def test_scaled_layouts_name_their_own_key_namespace() -> None:
    names = {
        cache_layout(FLOAT, d).canonical() for d in ("auto", "bfloat16", "int8", "fp8_e4m3")
    }
    assert len(names) == 4
    raw_int8 = replace(FLOAT, dtype="int8")  # unscaled int8 elements: another namespace again
    assert raw_int8.canonical() not in names
    chains = {
        BlockHasher(Namespace("m", cache_layout(FLOAT, d)), BS).chain(list(range(8)))[0]
        for d in ("auto", "int8")
    }
    assert len(chains) == 2


def test_layout_and_cache_dtype_errors() -> None:
    with pytest.raises(ConfigError, match="scaled"):
        KVLayout(2, 2, 8, 4, "float32", scaled=True)
    with pytest.raises(ConfigError, match="scaled must be a bool"):
        KVLayout(2, 2, 8, 4, "int8", scaled=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        cache_layout(FLOAT, "int4")


def test_make_storage_picks_the_class_by_layout_and_model_dtype() -> None:
    assert type(make_storage(FLOAT, 4)) is KVBlockStorage
    assert type(make_storage(FLOAT, 4, compute_dtype=torch.float32)) is KVBlockStorage
    cast = make_storage(cache_layout(FLOAT, "bfloat16"), 4, compute_dtype=torch.float32)
    assert isinstance(cast, CastKVBlockStorage)
    assert cast.dtype == torch.bfloat16 and cast.compute_dtype == torch.float32
    q = make_storage(QUANT["int8"], 4)
    assert isinstance(q, QuantizedKVBlockStorage)
    assert q.dtype == q.compute_dtype == torch.float32 and q.kv_dtype == torch.int8
    assert q.codec.name == "int8"
    assert make_storage(QUANT["fp8_e4m3"], 4).codec.name == "fp8"  # type: ignore[union-attr]
    assert q.bytes_per_block == QUANT["int8"].bytes_per_block
    assert q.nbytes == 4 * QUANT["int8"].bytes_per_block
    assert "QuantizedKVBlockStorage" in repr(q)
    with pytest.raises(ConfigError, match="block-contiguous"):
        make_storage(QUANT["int8"], 4, layout_kind="layer")
    with pytest.raises(ConfigError, match="need scales"):
        make_storage(replace(FLOAT, dtype="int8"), 4, compute_dtype=torch.float32)
    with pytest.raises(ConfigError, match="compute_dtype"):
        make_storage(QUANT["int8"], 4, compute_dtype=torch.int32)
    with pytest.raises(ConfigError, match="scaled KVLayout"):
        QuantizedKVBlockStorage(FLOAT, 4)


# -- writes and reads ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_a_block_written_at_once_is_the_codec_payload(kind: str) -> None:
    q = make_storage(QUANT[kind], 6)
    ref = KVBlockStorage(FLOAT, 6)
    codec = Int8Codec() if kind == "int8" else Fp8Codec()
    slots = list(range(BS * 2, BS * 5))  # blocks 2, 3, 4 written whole in one pass
    for layer in range(FLOAT.num_layers):
        k, v = tokens(len(slots), layer), tokens(len(slots), 10 + layer, scale=3.0)
        q.write(layer, slots, k, v)
        ref.write(layer, slots, k, v)
    for b in (2, 3, 4):
        assert torch.equal(q.block_bytes(b), codec.encode(ref.export_blocks([b])[0]))


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_reads_are_the_writes_within_one_rounding(kind: str) -> None:
    q = make_storage(QUANT[kind], 8)
    assert isinstance(q, QuantizedKVBlockStorage)
    slots = list(range(BS, BS + 11))  # blocks 1, 2 and part of 3
    kv = [(tokens(11, 2 * i), tokens(11, 2 * i + 1)) for i in range(FLOAT.num_layers)]
    for layer, (k, v) in enumerate(kv):
        q.write(layer, torch.tensor(slots), k, v)
    for layer, (k, v) in enumerate(kv):
        got_k, got_v = q.read(layer, [1, 2, 3], 11)
        assert got_k.dtype == torch.float32 and got_k.shape == k.shape
        ks, vs = q.layer_scales(layer)
        row_scale_k = ks[torch.tensor(slots) // BS][:, :, None]
        row_scale_v = vs[torch.tensor(slots) // BS][:, :, None]
        assert torch.all((got_k - k).abs() <= rounding_bound(kind, k, row_scale_k) + 1e-7)
        assert torch.all((got_v - v).abs() <= rounding_bound(kind, v, row_scale_v) + 1e-7)
        # The batched path's rows read the same values.
        rows = q.slot_rows(slots)
        rk, rv = q.read_rows(layer, rows)
        assert torch.equal(rk, got_k) and torch.equal(rv, got_v)


def test_scales_grow_so_nothing_is_clipped() -> None:
    q = make_storage(QUANT["int8"], 4)
    assert isinstance(q, QuantizedKVBlockStorage)
    # Token by token into block 1, each larger than the last: every write grows the scale.
    xs = [tokens(1, i, scale=float(4**i)) for i in range(BS)]
    for i, x in enumerate(xs):
        for layer in range(FLOAT.num_layers):
            q.write(layer, [BS + i], x, -x)
    want = torch.cat(xs)
    k, v = q.read(0, [1], BS)
    scale = q.layer_scales(0)[0][1]
    assert torch.allclose(scale, want.abs().amax(dim=(0, 2)) / 127)
    # Each token was rounded once per later growth of the scale, at most half a step each.
    steps = torch.tensor([BS - i for i in range(BS)], dtype=torch.float32)[:, None, None]
    assert torch.all((k - want).abs() <= 0.5 * scale[None, :, None] * steps + 1e-6)
    assert torch.all((v + want).abs() <= 0.5 * scale[None, :, None] * steps + 1e-6)


def test_a_reused_block_starts_with_fresh_scales() -> None:
    q = make_storage(QUANT["int8"], 4)
    for layer in range(FLOAT.num_layers):
        q.write(layer, list(range(BS)), tokens(BS, 1, scale=1000.0), tokens(BS, 2, scale=1000.0))
    small = tokens(2, 3, scale=0.01)
    for layer in range(FLOAT.num_layers):
        q.write(layer, [0, 1], small, small)  # block 0 again, from its first slot
    k, _ = q.read(0, [0], 2)
    assert torch.all((k - small).abs() <= small.abs().amax() / 254 + 1e-9)


def test_wrong_inputs_are_bad_requests() -> None:
    q = make_storage(QUANT["int8"], 4)
    with pytest.raises(BadRequestError, match=r"takes torch\.float32"):
        q.write(0, [0], tokens(1, 0).to(torch.bfloat16), tokens(1, 0).to(torch.bfloat16))
    with pytest.raises(BadRequestError, match="outside"):
        q.write(0, [99], tokens(1, 0), tokens(1, 0))
    with pytest.raises(BadRequestError, match="raw block data"):
        q.import_blocks([0], torch.zeros(7, dtype=torch.uint8))
    with pytest.raises(BadRequestError, match="dtype"):
        q.import_blocks([0], torch.zeros((1, *q.block_shape), dtype=torch.float64))
    with pytest.raises(BadRequestError, match="shaped"):
        q.import_blocks([0], torch.zeros((1, 3), dtype=torch.float32))
    with pytest.raises(BadRequestError, match="distinct"):
        q.import_blocks([1, 1], torch.zeros((2, *q.block_shape)))


# -- whole blocks ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_payloads_round_trip_bit_exact_and_tensors_quantize_like_the_codec(kind: str) -> None:
    q = make_storage(QUANT[kind], 6)
    assert isinstance(q, QuantizedKVBlockStorage)
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randn((2, *q.block_shape), generator=gen) * 7
    q.import_blocks([1, 4], blocks)
    for i, b in enumerate((1, 4)):
        assert torch.equal(q.block_bytes(b), q.codec.encode(blocks[i]))
    payloads = q.export_payloads([1, 4])
    assert payloads.shape == (2, q.bytes_per_block) and payloads.dtype == torch.uint8
    other = make_storage(QUANT[kind], 6)
    other.import_blocks([0, 2], payloads.reshape(-1))
    assert torch.equal(other.export_payloads([0, 2]), payloads)
    assert torch.equal(other.export_blocks([0, 2]), q.export_blocks([1, 4]))
    other.load_block(3, q.block_bytes(1))
    assert torch.equal(other.block_bytes(3), payloads[0])
    # Dequantized exports decode like the codec, into ``out`` too.
    decoded = q.codec.decode(payloads[1], q.block_shape, torch.float32)
    assert torch.equal(q.export_blocks([4])[0], decoded)
    out = torch.empty((1, *q.block_shape))
    assert q.export_blocks([4], out=out) is out and torch.equal(out[0], decoded)
    with pytest.raises(BadRequestError, match="out must be"):
        q.export_blocks([4], out=torch.empty(3))
    k_view, _ = q.layer_cache(0)
    assert k_view.dtype == q.kv_dtype and k_view.shape == (6, BS, 2, 8)


def test_copy_on_write_copies_the_scales() -> None:
    q = make_storage(QUANT["int8"], 6)
    x = tokens(3, 7, scale=5.0)
    for layer in range(FLOAT.num_layers):
        q.write(layer, [8, 9, 10], x, x)  # block 2, partly filled
    before = q.block_bytes(2)
    q.copy_blocks([(2, 5)])
    assert torch.equal(q.block_bytes(5), before)
    y = tokens(1, 8, scale=0.5)
    for layer in range(FLOAT.num_layers):
        q.write(layer, [5 * BS + 3], y, y)  # the copy grows on its own
    assert torch.equal(q.block_bytes(2), before)
    k, _ = q.read(0, [5], 4)
    k2, _ = q.read(0, [2], 3)
    assert torch.equal(k[:3], k2) and torch.allclose(k[3], y[0], atol=5.0 * 4 / 254)


def test_cast_storage_rounds_to_its_dtype_and_reads_back_the_model_dtype() -> None:
    layout = cache_layout(FLOAT, "bfloat16")
    s = make_storage(layout, 4, compute_dtype=torch.float32)
    x = tokens(6, 3)
    for layer in range(FLOAT.num_layers):
        s.write(layer, list(range(6)), x, -x)
    k, v = s.read(1, [0, 1], 6)
    assert k.dtype == torch.float32 and torch.equal(k, x.to(torch.bfloat16).float())
    rk, rv = s.read_rows(1, s.slot_rows(list(range(6))))
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert s.export_blocks([0]).dtype == torch.bfloat16
    assert s.bytes_per_block == FLOAT.bytes_per_block // 2


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(["int8", "fp8_e4m3"]),
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    scales=st.lists(st.floats(1e-3, 1e3), min_size=6, max_size=6),
)
def test_any_chunking_reads_within_the_bound(
    kind: str, chunks: list[int], scales: list[float]
) -> None:
    """However a sequence's tokens arrive, reads stay within the scale growth's roundings."""
    q = make_storage(QUANT[kind], 12)
    assert isinstance(q, QuantizedKVBlockStorage)
    written: list[torch.Tensor] = []
    pos = 0
    for i, n in enumerate(chunks):
        x = tokens(n, i, scale=scales[i])
        for layer in range(FLOAT.num_layers):
            q.write(layer, list(range(pos, pos + n)), x, x)
        written.append(x)
        pos += n
    want = torch.cat(written)
    k, v = q.read(1, list(range(q.num_blocks)), pos)
    assert torch.equal(k, v)
    row_scale = q.layer_scales(1)[0][torch.arange(pos) // BS][:, :, None]
    # At most one rounding per write into the block, each bounded at the final scale.
    bound = rounding_bound(kind, want, row_scale) * (len(chunks) + 1)
    assert torch.all((k - want).abs() <= bound + 1e-6)


# -- a stateful check of the scale bookkeeping -------------------------------------------
class QuantMachine(RuleBasedStateMachine):
    """Sequences fill blocks token run by token run; blocks are copied, exported, reused.

    The model keeps every block's float content and how many roundings each
    token has had; reads must stay within those roundings and no scale may
    ever be below what its block's largest value needs (nothing clipped).
    """

    @initialize(kind=st.sampled_from(["int8", "fp8_e4m3"]))
    def setup(self, kind: str) -> None:
        self.kind = kind
        self.q = make_storage(QUANT[kind], 6)
        assert isinstance(self.q, QuantizedKVBlockStorage)
        #: block -> its tokens (float values written) and roundings per token
        self.content: dict[int, list[torch.Tensor]] = {}
        self.rounds: dict[int, list[int]] = {}
        self.seed = 0

    def _x(self, n: int, scale: float) -> torch.Tensor:
        self.seed += 1
        return tokens(n, self.seed, scale=scale)

    @rule(block=st.integers(0, 5), n=st.integers(1, BS), scale=st.floats(1e-2, 1e2))
    def start(self, block: int, n: int, scale: float) -> None:
        x = self._x(n, scale)
        for layer in range(FLOAT.num_layers):
            self.q.write(layer, list(range(block * BS, block * BS + n)), x, -x)
        self.content[block] = list(x)
        self.rounds[block] = [1] * n

    @precondition(lambda self: any(len(c) < BS for c in self.content.values()))
    @rule(data=st.data(), scale=st.floats(1e-2, 1e2))
    def append(self, data: st.DataObject, scale: float) -> None:
        open_blocks = sorted(b for b, c in self.content.items() if len(c) < BS)
        block = data.draw(st.sampled_from(open_blocks))
        have = len(self.content[block])
        n = data.draw(st.integers(1, BS - have))
        x = self._x(n, scale)
        for layer in range(FLOAT.num_layers):
            self.q.write(layer, list(range(block * BS + have, block * BS + have + n)), x, -x)
        self.rounds[block] = [r + 1 for r in self.rounds[block]] + [1] * n
        self.content[block].extend(x)

    @precondition(lambda self: bool(self.content))
    @rule(data=st.data(), dst=st.integers(0, 5))
    def copy(self, data: st.DataObject, dst: int) -> None:
        src = data.draw(st.sampled_from(sorted(self.content)))
        if src == dst:
            return
        self.q.copy_blocks([(src, dst)])
        self.content[dst] = list(self.content[src])
        self.rounds[dst] = list(self.rounds[src])

    @precondition(lambda self: bool(self.content))
    @rule(data=st.data(), dst=st.integers(0, 5))
    def move_through_payload(self, data: st.DataObject, dst: int) -> None:
        src = data.draw(st.sampled_from(sorted(self.content)))
        self.q.import_blocks([dst], self.q.block_bytes(src).clone())
        self.content[dst] = list(self.content[src])
        self.rounds[dst] = list(self.rounds[src])

    @invariant()
    def reads_within_bounds(self) -> None:
        if not hasattr(self, "q"):
            return
        for block, values in self.content.items():
            want = torch.stack(values)
            k, v = self.q.read(0, [block], len(values))
            ks, vs = self.q.layer_scales(0)
            scale = ks[block][None, :, None]
            amax = want.abs().amax(dim=(0, 2))
            qmax = self.q.codec.qmax
            assert torch.all(ks[block] * qmax >= amax * (1 - 1e-6)), "a value was clipped"
            assert torch.all(vs[block] * qmax >= amax * (1 - 1e-6)), "a value was clipped"
            rounds = torch.tensor(self.rounds[block], dtype=torch.float32)[:, None, None]
            bound = rounding_bound(self.kind, want, scale) * rounds + 1e-6
            assert torch.all((k - want).abs() <= bound)
            assert torch.all((v + want).abs() <= bound)


TestQuantMachine = QuantMachine.TestCase
TestQuantMachine.settings = settings(max_examples=40, stateful_step_count=20, deadline=None)
