"""Quantized device KV and the compressed device tier in the engine, on the tiny real model.

Quantized K/V change logits, so outputs are compared where they must be
equal: the batched engine against the one-request cache path with the same
writes, a request against itself when its blocks were forked, swapped or
reused, and float pools against float pools. Closeness to the float32
model on the real SmolLM2 is measured by ``bench/codec_accuracy.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_model import tiny_model_and_tokenizer  # noqa: E402

from kvtier import BadRequestError, ConfigError, KVCacheManager, UnknownRequestError  # noqa: E402
from kvtier.engine import Engine, KvTierCache, SamplingParams  # noqa: E402
from kvtier.engine.config import CacheConfig, EngineConfig  # noqa: E402
from kvtier.engine.hf_cache import layout_for_model  # noqa: E402
from kvtier.keys import Namespace  # noqa: E402
from kvtier.layout import cache_layout  # noqa: E402
from kvtier.offload.chain import Tier  # noqa: E402
from kvtier.offload.config import TierSpec  # noqa: E402
from kvtier.offload.host import HostStore  # noqa: E402
from kvtier.storage import QuantizedKVBlockStorage, make_storage  # noqa: E402

BS = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    return tiny_model_and_tokenizer()


def engine(model_tok: tuple[Any, Any], **kw: Any) -> Engine:
    model, tok = model_tok
    kw.setdefault("block_size", BS)
    kw.setdefault("num_blocks", 96)
    return Engine(model, tok, model_id="tiny", **kw)


def prompt(seed: int, n: int = 23) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 90, (n,), generator=g).tolist()


def tokens_of(eng: Engine, ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return [t for out in eng.generate(ids, params) for t in out.token_ids]


def test_the_same_memory_holds_four_times_the_blocks(model_tok: tuple[Any, Any]) -> None:
    sizes = {
        dt: engine(model_tok, num_blocks=None, kv_cache_bytes=2**20, kv_cache_dtype=dt)
        for dt in ("auto", "bfloat16", "int8", "fp8_e4m3")
    }
    blocks = {dt: e.manager.pool.num_blocks for dt, e in sizes.items()}
    assert blocks["auto"] == 2**20 // sizes["auto"].layout.bytes_per_block
    assert blocks["bfloat16"] == 2 * blocks["auto"]
    assert blocks["int8"] >= 3.5 * blocks["auto"] and blocks["int8"] >= 1.8 * blocks["bfloat16"]
    assert blocks["fp8_e4m3"] == blocks["int8"]
    q = sizes["int8"]
    assert isinstance(q.storage, QuantizedKVBlockStorage)
    assert q.storage.nbytes <= 2**20
    assert q.config.cache.kv_cache_dtype == "int8" and q.config.dtype == "float32"
    assert "int8 with per-head scales" in q.describe()[1]
    # A quantized pool's blocks live under keys of their own.
    assert q.manager.hasher.root != sizes["auto"].manager.hasher.root


def test_the_batched_engine_reads_what_the_cache_path_reads(model_tok: tuple[Any, Any]) -> None:
    """Paged attention over int8 blocks equals KvTierCache over int8 blocks, written alike."""
    model, _ = model_tok
    ids = prompt(1)
    eng = engine(model_tok, kv_cache_dtype="int8")
    got = tokens_of(eng, ids)

    layout = cache_layout(layout_for_model(model.config, BS, torch.float32), "int8")
    storage = make_storage(layout, 96)
    mgr = KVCacheManager(96, BS, namespace=Namespace("tiny", layout))
    want: list[int] = []
    with KvTierCache(storage, mgr, "r", ids) as cache, torch.no_grad():
        step = list(ids)  # the prompt in one pass, then one token per pass, as the engine
        for _ in range(GREEDY.max_tokens):
            cache.feed(step)
            logits = model(input_ids=torch.tensor([step]), cache=cache).logits
            want.append(int(logits[0, -1].argmax()))
            step = [want[-1]]
    assert got == want
    # The blocks hold the same K/V too, to within one quantization step: the two
    # paths compute K/V with different float kernels (batched against one
    # request), and which side of a rounding boundary a value lands on depends on
    # the CPU's kernels (AVX2 and AVX-512 differ), so equal bytes are not promised.
    keys = mgr.hasher.chain(ids)
    mine = mgr.pool.lookup(keys)
    theirs = eng.manager.pool.lookup(eng.manager.hasher.chain(ids))
    assert len(mine) == len(theirs) == len(ids) // BS
    for a, b in zip(mine, theirs, strict=True):
        assert_within_one_step(storage, a, eng.storage, b)


def assert_within_one_step(sa: Any, a: int, sb: Any, b: int) -> None:
    """Blocks ``a`` of ``sa`` and ``b`` of ``sb`` hold the same K/V to one quantization step.

    A scale is the absolute maximum of a head's values over ``qmax``: computed from
    the same K/V by two float paths, the scales agree to float rounding, and a
    dequantized value is off by at most one step of its head's scale.
    """
    scale_a, scale_b = sa.scales[a], sb.scales[b]  # [layers, 2, heads]
    torch.testing.assert_close(scale_a, scale_b, rtol=1e-4, atol=0)
    step = torch.maximum(scale_a, scale_b)[:, :, None, :, None]  # [layers, 2, 1, heads, 1]
    diff = (sa.export_blocks([a])[0] - sb.export_blocks([b])[0]).abs()
    assert bool((diff <= step * 1.001).all()), float((diff / step).max())


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "fp8_e4m3"])
def test_a_cached_prefix_gives_the_output_it_was_computed_with(
    model_tok: tuple[Any, Any], dtype: str
) -> None:
    eng = engine(model_tok, kv_cache_dtype=dtype)
    ids = prompt(2, n=24)  # whole blocks: the second run reuses all but the last one
    first = tokens_of(eng, ids)
    before = eng.counters.cached_prompt_tokens
    assert tokens_of(eng, ids) == first
    assert eng.counters.cached_prompt_tokens - before == 20
    eng.manager.check()


def test_forked_quantized_blocks_are_copied_with_their_scales(
    model_tok: tuple[Any, Any],
) -> None:
    """Two choices continue a shared partial block: each matches a run of its own."""
    model, _ = model_tok
    layout = cache_layout(layout_for_model(model.config, BS, torch.float32), "int8")

    def run(storage: Any, cache: KvTierCache, ids: list[int]) -> torch.Tensor:
        cache.feed(ids)
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids]), cache=cache).logits[0, -1]

    ids = prompt(3, n=10)  # ends inside a block
    storage = make_storage(layout, 64)
    mgr = KVCacheManager(64, BS)
    with KvTierCache(storage, mgr, "parent", ids) as parent:
        run(storage, parent, ids)
        child = parent.fork("child")
        la = run(storage, parent, [7, 8])
        lb = run(storage, child, [9, 10])
        assert parent.block_table.blocks[2] != child.block_table.blocks[2]
        child.release()
    assert mgr.stats().cow_copies >= 1
    for tail, got in (([7, 8], la), ([9, 10], lb)):
        alone_storage = make_storage(layout, 64)
        with KvTierCache(alone_storage, KVCacheManager(64, BS), "x", ids) as alone:
            run(alone_storage, alone, ids)
            assert torch.equal(run(alone_storage, alone, tail), got)


def test_n_choices_fork_quantized_blocks(model_tok: tuple[Any, Any]) -> None:
    eng = engine(model_tok, kv_cache_dtype="int8")
    ids = prompt(4, n=10)
    params = SamplingParams(max_tokens=6, temperature=0.0, n=2, ignore_eos=True)
    got: dict[int, list[int]] = {0: [], 1: []}
    for out in eng.generate(ids, params):
        got[out.index].extend(out.token_ids)
    assert eng.counters.forked_sequences == 1
    # Greedy choices from one prompt are the same tokens; the second read forked blocks.
    assert got[0] == got[1] == tokens_of(engine(model_tok, kv_cache_dtype="int8"), ids, GREEDY)[
        :6
    ]
    assert eng.manager.stats().cow_copies >= 1


@pytest.mark.parametrize("codec", ["int8", "raw"])
def test_preempted_quantized_requests_swap_and_resume(
    model_tok: tuple[Any, Any], codec: str
) -> None:
    ps = [prompt(13 + i) for i in range(3)]
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    roomy = engine(model_tok, kv_cache_dtype="int8", max_num_seqs=3)
    tight = engine(
        model_tok,
        kv_cache_dtype="int8",
        num_blocks=12,
        max_num_seqs=3,
        tiers=[Tier(HostStore(), 32, codec=codec)],
    )

    def run_all(eng: Engine) -> list[list[int]]:
        rids = [eng.add_request(x, p) for x in ps]
        got: dict[str, list[int]] = {r: [] for r in rids}
        while eng.has_unfinished():
            for out in eng.step():
                got[out.request_id].extend(out.token_ids)
        return [got[r] for r in rids]

    want = run_all(roomy)
    got = run_all(tight)
    assert tight.counters.preemptions > 0 and tight.counters.loaded_prompt_tokens > 0
    if codec == "int8":  # the pool's own payloads went out and came back: same bytes
        assert got == want
    else:  # decoded to float32 and quantized again on the way in
        flat = [(a, b) for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True)]
        assert sum(a == b for a, b in flat) >= 25
    tight.manager.check()
    assert tight.tier_chain is not None
    tight.tier_chain.check()
    tight.close()


def test_compress_request_moves_a_finished_request_to_the_device_tier(
    model_tok: tuple[Any, Any],
) -> None:
    eng = engine(model_tok, tiers=[TierSpec("device", 2**20, codec="int8")])
    ids = prompt(5, n=25)
    rid = "finished"
    first = [t for out in eng.generate(ids, GREEDY, request_id=rid) for t in out.token_ids]
    free_before = eng.manager.pool.num_empty
    moved = eng.compress_request(rid)
    assert moved.blocks >= 6 and moved.ratio > 3.0 and moved.seconds > 0
    assert eng.manager.pool.num_empty == free_before + moved.blocks
    st = eng.tier_chain.stats()["device"] if eng.tier_chain is not None else {}
    assert st["used_blocks"] == moved.blocks and st["compressed_requests"] == 1
    assert st["bytes_saved"] == moved.device_bytes - moved.stored_bytes
    # A hit decodes them back; the output is the float pool's (the tiny model's
    # margins are wide), and this time the prompt came from the tier.
    again = tokens_of(eng, ids)
    assert eng.counters.loaded_prompt_tokens == 24
    assert again == first
    # The hit brought its blocks back into the pool: they can go again, half at a time.
    assert eng.compress_request(rid, 0.5).blocks == moved.blocks // 2
    assert eng.compress_request(rid).blocks == moved.blocks - moved.blocks // 2
    assert eng.compress_request(rid).blocks == 0
    with pytest.raises(UnknownRequestError):
        eng.compress_request("never-seen")
    eng.add_request(ids, GREEDY, request_id="live")
    eng.step()
    with pytest.raises(BadRequestError, match="running"):
        eng.compress_request("live")
    while eng.has_unfinished():
        eng.step()
    # Finished, it is found by id; the tier already holds the blocks, which leave the pool.
    stored = eng.tier_chain.stats()["device"]["stored_blocks"] if eng.tier_chain is not None else 0
    assert eng.compress_request("live").blocks == moved.blocks
    assert eng.tier_chain is not None
    assert eng.tier_chain.stats()["device"]["stored_blocks"] == stored
    eng.manager.check()
    eng.close()
    with pytest.raises(ConfigError, match="device tier"):
        engine(model_tok).compress_request(rid)


def test_engine_config_carries_the_kv_cache_dtype(model_tok: tuple[Any, Any]) -> None:
    model, tok = model_tok
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    config = EngineConfig(cache=CacheConfig(block_size=BS, num_blocks=40, kv_cache_dtype="int8"))
    eng = Engine.from_config(config, model=model, tokenizer=tok)
    assert isinstance(eng.storage, QuantizedKVBlockStorage) and eng.kv_cache_dtype == "int8"
    layout = layout_for_model(model.config, BS, torch.float32)
    memory = EngineConfig(cache=CacheConfig(block_size=BS, kv_cache_bytes=2**20))
    plain = memory.plan(layout, 512).num_blocks
    int8 = EngineConfig(
        cache=CacheConfig(block_size=BS, kv_cache_bytes=2**20, kv_cache_dtype="int8")
    ).plan(layout, 512)
    assert int8.num_blocks >= 3.5 * plain and int8.layout.scaled
