"""KvTierCache on a tiny random-weight Llama: cached-prefix logits equal from-scratch logits."""

from __future__ import annotations

import warnings

import pytest
from needs import need_module

torch = need_module("torch")
transformers = need_module("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvtier import BadRequestError, KVCacheManager, OutOfBlocksError  # noqa: E402
from kvtier.engine.hf_cache import KvTierCache, attach, layout_for_model  # noqa: E402
from kvtier.storage import KVBlockStorage  # noqa: E402

VOCAB = 97
BS = 4
ATOL = 1e-5


def _model(dtype: torch.dtype = torch.float32) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(scope="module")
def model() -> transformers.LlamaForCausalLM:
    return _model()


def _kv(model: transformers.LlamaForCausalLM, num_blocks: int = 64, **kw: object):
    dtype = next(model.parameters()).dtype
    layout = layout_for_model(model.config, BS, dtype)
    return KVBlockStorage(layout, num_blocks), KVCacheManager(num_blocks, BS, **kw)


def _scratch(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _run(model, cache: KvTierCache, ids: list[int]) -> torch.Tensor:
    """Feed ``ids`` (the uncomputed part) through ``cache``; returns their logits."""
    cache.feed(ids)
    with torch.no_grad():
        return model(torch.tensor([ids]), cache=cache).logits[0]


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


@pytest.mark.parametrize("shared", [1, 3, 4, 5, 8, 11, 12, 13])
def test_cached_prefix_logits_match_scratch(model, shared: int) -> None:
    storage, mgr = _kv(model)
    prefix = _tokens(1, shared)
    a = prefix + _tokens(2, 7)
    b = prefix + _tokens(3, 6)
    assert a[shared] != b[shared]
    with KvTierCache(storage, mgr, "a", a) as ca:
        assert ca.num_cached_tokens == 0
        torch.testing.assert_close(_run(model, ca, a), _scratch(model, a), atol=ATOL, rtol=0)
    with KvTierCache(storage, mgr, "b", b) as cb:
        # Whole blocks of the shared prefix are reused; never the last token.
        assert cb.num_cached_tokens == (shared // BS) * BS
        n = cb.num_cached_tokens
        got = _run(model, cb, b[n:])
        torch.testing.assert_close(got, _scratch(model, b)[n:], atol=ATOL, rtol=0)
    mgr.check()


@pytest.mark.parametrize("length", [4, 8, 9])
def test_identical_prompt_recomputes_only_the_last_token(model, length: int) -> None:
    storage, mgr = _kv(model)
    ids = _tokens(5, length)
    with KvTierCache(storage, mgr, "a", ids) as ca:
        _run(model, ca, ids)
    with KvTierCache(storage, mgr, "b", ids) as cb:
        assert cb.num_cached_tokens == ((length - 1) // BS) * BS
        n = cb.num_cached_tokens
        got = _run(model, cb, ids[n:])
        torch.testing.assert_close(got, _scratch(model, ids)[n:], atol=ATOL, rtol=0)


def _greedy(model, cache: KvTierCache, prompt: list[int], steps: int) -> list[int]:
    n = cache.num_cached_tokens
    logits = _run(model, cache, prompt[n:])
    out = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits = _run(model, cache, out[-1:])
        out.append(int(logits[-1].argmax()))
    return out


def test_greedy_decode_matches_hf_generate(model) -> None:
    storage, mgr = _kv(model)
    prompt = _tokens(7, 10)
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0]
    ref_new = ref[len(prompt) :].tolist()
    for rid in ("cold", "warm"):  # the second run starts from the cached prefix
        with KvTierCache(storage, mgr, rid, prompt) as cache:
            assert _greedy(model, cache, prompt, 12) == ref_new
    assert mgr.stats().hit_tokens == 8


def test_generate_with_attached_cache(model) -> None:
    storage, mgr = _kv(model)
    attach(model)
    attach(model)  # idempotent
    prompt = _tokens(8, 13)
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False)
    for rid in ("first", "second"):
        with KvTierCache(storage, mgr, rid, prompt) as cache:
            got = model.generate(
                torch.tensor([prompt]), cache=cache, max_new_tokens=9, do_sample=False
            )
            assert got.tolist() == ref.tolist()
            # generate fed every token it computed: prompt plus all but the last new one.
            assert cache.token_ids == got[0, :-1].tolist()
    assert mgr.stats().hit_tokens == 12
    # The generated continuation was published: a prompt extending it hits it all.
    longer = ref[0].tolist()
    with KvTierCache(storage, mgr, "third", longer) as cache:
        assert cache.num_cached_tokens == ((len(longer) - 1) // BS) * BS
        torch.testing.assert_close(
            _run(model, cache, longer[cache.num_cached_tokens :]),
            _scratch(model, longer)[cache.num_cached_tokens :],
            atol=ATOL,
            rtol=0,
        )


def test_attached_hook_takes_the_deprecated_keyword(model) -> None:
    """``model(..., past_key_values=cache)`` (the spelling before ``cache``) feeds the cache too."""
    storage, mgr = _kv(model)
    attach(model)
    prompt = _tokens(12, 11)
    # Built with part of the prompt: the rest reaches the cache only through the hook.
    with KvTierCache(storage, mgr, "old-spelling", prompt[:6]) as cache, torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            logits = model(torch.tensor([prompt]), past_key_values=cache).logits[0]
        assert cache.num_computed_tokens == len(prompt)
        assert cache.token_ids == prompt
        torch.testing.assert_close(logits, _scratch(model, prompt), atol=ATOL, rtol=0)


def test_fork_shares_blocks_and_copies_on_write(model) -> None:
    storage, mgr = _kv(model)
    prompt = _tokens(9, 10)  # ends inside a block: the fork shares a partial block
    with KvTierCache(storage, mgr, "parent", prompt) as parent:
        _run(model, parent, prompt)
        child = parent.fork("child")
        assert child.block_table.blocks == parent.block_table.blocks
        xa, xb = _tokens(10, 5), _tokens(11, 5)
        la = _run(model, parent, xa)
        lb = _run(model, child, xb)
        assert parent.block_table.blocks[2] != child.block_table.blocks[2]
        torch.testing.assert_close(la, _scratch(model, prompt + xa)[10:], atol=ATOL, rtol=0)
        torch.testing.assert_close(lb, _scratch(model, prompt + xb)[10:], atol=ATOL, rtol=0)
        # Interleaved decode steps of both stay independent.
        for step in range(3):
            la = _run(model, parent, [step])
            lb = _run(model, child, [step + 1])
        ta, tb = parent.token_ids, child.token_ids
        torch.testing.assert_close(la[-1], _scratch(model, ta)[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(lb[-1], _scratch(model, tb)[-1], atol=ATOL, rtol=0)
        child.release()
    assert mgr.stats().cow_copies >= 1
    mgr.check()


def test_failed_forward_is_withdrawn_not_served(model) -> None:
    storage, mgr = _kv(model)
    prompt = _tokens(12, 14)

    def boom(module, args, kwargs):
        raise RuntimeError("injected failure in layer 1")

    handle = model.model.layers[1].self_attn.register_forward_pre_hook(boom, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="injected"):  # noqa: SIM117
            with KvTierCache(storage, mgr, "a", prompt) as cache:
                _run(model, cache, prompt)
    finally:
        handle.remove()
    # Layer 0 was written, layers 1-2 never: the prompt's blocks must not hit.
    with KvTierCache(storage, mgr, "b", prompt) as cache:
        assert cache.num_cached_tokens == 0
        torch.testing.assert_close(
            _run(model, cache, prompt), _scratch(model, prompt), atol=ATOL, rtol=0
        )
    mgr.check()


def test_bfloat16_model_stores_bfloat16_blocks() -> None:
    model = _model(torch.bfloat16)
    storage, mgr = _kv(model)
    assert storage.dtype == torch.bfloat16
    prompt = _tokens(13, 9)
    with KvTierCache(storage, mgr, "a", prompt) as c:
        _run(model, c, prompt)
    with KvTierCache(storage, mgr, "b", prompt) as c:
        n = c.num_cached_tokens
        assert n == 8
        got = _run(model, c, prompt[n:])
    # Identical K/V in identical dtype: bit-exact against transformers' own cache
    # over the same split (the same operations on the same shapes).
    reference = transformers.DynamicCache()
    with torch.no_grad():
        model(torch.tensor([prompt[:n]]), cache=reference)
        split = model(torch.tensor([prompt[n:]]), cache=reference).logits[0]
    assert got.dtype == torch.bfloat16 and torch.equal(got, split)
    # Against one pass over the whole prompt the matmul shapes differ, so bf16
    # rounding may differ too: close to bf16 precision, not bit-exact by promise.
    torch.testing.assert_close(got, _scratch(model, prompt)[n:], atol=2e-2, rtol=2e-2)


def test_bad_use_is_a_typed_error() -> None:
    model = _model()  # not attach()-ed: forward passes do not feed the cache
    storage, mgr = _kv(model)
    prompt = _tokens(14, 6)
    cache = KvTierCache(storage, mgr, "a", prompt)
    with pytest.raises(BadRequestError, match="continue this cache"):
        cache.feed(_tokens(15, 6))
    with pytest.raises(BadRequestError, match=r"call kvtier\.engine\.attach"), torch.no_grad():
        model(torch.tensor([[*prompt, 1, 2]]), cache=cache)
    cache.abort()
    with pytest.raises(BadRequestError, match="released"):
        cache.feed([1])
    with pytest.raises(BadRequestError, match="batch size 2"):
        KvTierCache(storage, mgr, "b", torch.zeros(2, 3, dtype=torch.long))
    with (
        KvTierCache(storage, mgr, "c", prompt) as c,
        pytest.raises(BadRequestError, match="one sequence"),
        torch.no_grad(),
    ):
        c.feed(prompt)
        model(torch.tensor([prompt, prompt]), cache=c)
    mgr.check()
    assert len(mgr) == 0


def test_pool_exhaustion_raises_without_leaking(model) -> None:
    storage, mgr = _kv(model, num_blocks=4)
    with pytest.raises(OutOfBlocksError):
        KvTierCache(storage, mgr, "big", _tokens(16, 17))
    assert len(mgr) == 0
    mgr.check()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 14), st.integers(0, 4)),
        min_size=1,
        max_size=8,
    )
)
def test_random_request_streams_under_eviction_stay_exact(model, requests) -> None:
    """Requests share one of four prefixes over a small pool; every logit must match scratch."""
    storage, mgr = _kv(model, num_blocks=10)
    roots = [_tokens(100 + i, 16) for i in range(4)]
    for n, (root, cut, extra) in enumerate(requests):
        prompt = roots[root][:cut] + _tokens(200 + n, extra)
        with KvTierCache(storage, mgr, n, prompt) as cache:
            k = cache.num_cached_tokens
            assert cache.num_cached_tokens % BS == 0 and k < len(prompt)
            got = _run(model, cache, prompt[k:])
            want = _scratch(model, prompt)[k:]
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
            nxt = int(got[-1].argmax())
            torch.testing.assert_close(
                _run(model, cache, [nxt])[-1],
                _scratch(model, [*prompt, nxt])[-1],
                atol=ATOL,
                rtol=0,
            )
        mgr.check()


def test_a_mixed_chain_writes_through_from_the_transformers_path(model, tmp_path) -> None:
    """Host writes back and disk writes through (``"mixed"``): computed blocks reach disk at once.

    The engine decides by ``TierChain.writes_through``; ``KvTierCache`` must
    decide the same way, not only when every tier writes through.
    """
    from kvtier.offload.chain import Tier, TierChain
    from kvtier.offload.disk import DiskStore
    from kvtier.offload.host import HostStore

    storage, mgr = _kv(model)
    chain = TierChain(
        storage,
        mgr,
        [Tier(HostStore(), 16), Tier(DiskStore(tmp_path), 32, write_mode="write_through")],
    )
    assert chain.write_mode == "mixed" and chain.writes_through
    prompt = _tokens(13, 3 * BS + 1)
    with KvTierCache(storage, mgr, "mixed", prompt, tiers=chain) as cache, torch.no_grad():
        model(torch.tensor([prompt]), cache=cache)
    chain.flush()
    assert chain.stats()["disk"]["stored_blocks"] == 3
    assert chain.stats()["host"]["stored_blocks"] == 0  # write-back: only on eviction
    chain.close()
