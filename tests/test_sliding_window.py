"""Sliding-window models served through kvtier's blocks answer as the model itself does.

A tiny random Gemma 3 text model (sliding layers with a window of 8 tokens
around a full layer, blocks of 4 tokens, prompts several windows long) runs
through the batched engine: alone, batched with other lengths and chunked,
preempted by a small pool, from a cached prefix and from a host tier. Its
greedy tokens must equal Hugging Face ``generate`` on the same weights, and
differ from what the same weights give with every layer full (so the window
really is applied). Underneath, the per-layer attention plan read from a
config must match transformers' own, and the paged attention of a sliding
layer must equal a dense masked attention over ``(p - window, p]`` for any
batch of sequences while gathering only the blocks the window can reach.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: Engine code is the same compiled or not: these run in the compiled pass only.
pytestmark = pytest.mark.families

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiny_model import (  # noqa: E402
    TinyFamily,
    check_request_mix,
    greedy_ignoring_eos,
    request_mixes,
    run_all,
    seeded_prompt,
    tiny_gemma3_config,
    tiny_tokenizer,
)

from kvtier.engine import Engine, KvTierCache, attach, layout_for_model  # noqa: E402
from kvtier.engine.paged import paged_attention  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.layers.attention_spec import AttentionSpec, attention_spec  # noqa: E402
from kvtier.layers.batch import BatchMeta, SeqSlice  # noqa: E402
from kvtier.layout import KVLayout, cdiv  # noqa: E402
from kvtier.manager import KVCacheManager  # noqa: E402
from kvtier.offload.chain import Tier  # noqa: E402
from kvtier.offload.host import HostStore  # noqa: E402
from kvtier.storage import KVBlockStorage  # noqa: E402

WINDOW = 8
BS = 4
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _gemma_config(tok: Any, layer_types: list[str] = LAYER_TYPES) -> Any:
    return tiny_gemma3_config(tok, layer_types, WINDOW)


class Gemma(TinyFamily):
    """The tiny model for the engine, an untouched copy for references, and their cache."""

    def __init__(self) -> None:
        tok = tiny_tokenizer()
        config = _gemma_config(tok)
        super().__init__(transformers.Gemma3ForCausalLM, config, tok, "tiny-gemma3", BS, 128)


@pytest.fixture(scope="module")
def gemma() -> Gemma:
    return Gemma()


def _run(
    engine: Engine, prompt: list[int], n: int, rid: str | None = None
) -> tuple[list[int], Any]:
    outs = list(engine.generate(prompt, greedy_ignoring_eos(n), request_id=rid))
    return [t for o in outs for t in o.token_ids], outs[-1]


# -- the attention plan --------------------------------------------------------------------


def _from_object(config: Any) -> Callable[[str], object]:
    return lambda name: getattr(config, name, None)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: transformers.Gemma3TextConfig(num_hidden_layers=7, sliding_window_pattern=3),
            [4096, 4096, None, 4096, 4096, None, 4096],
        ),
        (lambda: transformers.Gemma3TextConfig(num_hidden_layers=7), [4096] * 5 + [None, 4096]),
        (
            lambda: transformers.Qwen2Config(
                num_hidden_layers=5, use_sliding_window=True, sliding_window=16, max_window_layers=2
            ),
            [None, None, 16, 16, 16],
        ),
        (
            lambda: transformers.Qwen3Config(
                num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1
            ),
            [None, 16, 16],
        ),
        (lambda: transformers.Qwen2Config(num_hidden_layers=3), [None, None, None]),
        (lambda: transformers.MistralConfig(num_hidden_layers=2, sliding_window=32), [32, 32]),
        (
            lambda: transformers.MistralConfig(num_hidden_layers=2, sliding_window=None),
            [None, None],
        ),
        (lambda: transformers.LlamaConfig(num_hidden_layers=2), [None, None]),
    ],
)
def test_the_plan_matches_transformers(make: Callable[[], Any], expected: list[int | None]) -> None:
    """Read from the config object, and from its saved JSON without ``layer_types``."""
    config = make()
    assert attention_spec(_from_object(config)).windows == tuple(expected)
    saved = config.to_dict()
    if getattr(config, "_sliding_window_pattern", None) is not None:
        saved["sliding_window_pattern"] = config._sliding_window_pattern
    saved.pop("layer_types", None)  # older config.json files do not have it
    assert attention_spec(saved.get).windows == tuple(expected)


def test_a_sliding_layer_without_a_window_is_refused() -> None:
    fields = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(ConfigError, match="sliding_window"):
        attention_spec(fields.get)
    fields["layer_types"] = ["chunked_attention", "full_attention"]
    with pytest.raises(ConfigError, match="chunked_attention"):
        attention_spec({**fields, "sliding_window": 4}.get)


def test_kv_tokens_are_bounded_by_the_window() -> None:
    spec = AttentionSpec((8, 8, None, 8))
    assert spec.sliding_layers == (0, 1, 3) and spec.full_layers == (2,)
    assert spec.kv_tokens(4) == 16
    assert spec.kv_tokens(1000) == 1000 + 3 * 8


# -- paged attention of a sliding layer --------------------------------------------------------


class _Layer(torch.nn.Module):
    layer_idx = 0


HEADS, KV_HEADS, DIM = 4, 2, 8


def _dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int | None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention of queries at ``start ..`` over keys ``0 ..`` with the window (or the
    chunk of a chunked local layer) as a loop."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=0)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=0)
    out = []
    for j in range(q.shape[1]):
        p = start + j
        lo = 0 if window is None else max(0, p - window + 1)
        if chunk is not None:
            lo = p // chunk * chunk
        w = torch.softmax(q[:, j : j + 1] @ k[:, lo : p + 1].transpose(1, 2) * DIM**-0.5, dim=-1)
        out.append(w @ v[:, lo : p + 1])
    return torch.cat(out, dim=1)  # [heads, n, dim]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seqs=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 9)), min_size=1, max_size=4),
    window=st.one_of(st.none(), st.integers(1, 20)),
    chunk=st.one_of(st.none(), st.integers(1, 20)),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_keeps_each_query_to_its_window(
    seqs: list[tuple[int, int]], window: int | None, chunk: int | None, seed: int
) -> None:
    """Sliding layers see their window; chunked local layers (Llama 4) their own chunk."""
    if chunk is not None:
        window = None  # a layer is one or the other
    g = torch.Generator().manual_seed(seed)
    layout = KVLayout(1, KV_HEADS, DIM, BS, "float32")
    storage = KVBlockStorage(layout, 64)
    free = torch.randperm(64, generator=g).tolist()
    slices, past = [], []
    for start, n in seqs:
        blocks = [free.pop() for _ in range(cdiv(start + n, BS))]
        slots = [blocks[p // BS] * BS + p % BS for p in range(start + n)]
        k = torch.randn(start, KV_HEADS, DIM, generator=g)
        v = torch.randn(start, KV_HEADS, DIM, generator=g)
        if start:
            rows = storage.slot_rows(torch.tensor(slots[:start]))
            storage.write_rows(0, rows, k, v)
        slices.append(SeqSlice(start, n, slots))
        past.append((k, v))
    total = sum(n for _, n in seqs)
    q = torch.randn(1, HEADS, total, DIM, generator=g)
    k_new = torch.randn(1, KV_HEADS, total, DIM, generator=g)
    v_new = torch.randn(1, KV_HEADS, total, DIM, generator=g)
    meta = BatchMeta(storage, slices)
    layer = _Layer()
    if chunk is not None:
        layer._kvtier_chunk = chunk
    out, _ = paged_attention(
        layer, q, k_new, v_new, None, scaling=DIM**-0.5, sliding_window=window, kvtier_batch=meta
    )
    t = 0
    for (start, n), (k, v) in zip(seqs, past, strict=True):
        keys = torch.cat([k, k_new[0, :, t : t + n].transpose(0, 1)]).transpose(0, 1)
        values = torch.cat([v, v_new[0, :, t : t + n].transpose(0, 1)]).transpose(0, 1)
        want = _dense(q[0, :, t : t + n], keys, values, start, window, chunk)
        torch.testing.assert_close(out[0, t : t + n].transpose(0, 1), want, rtol=1e-4, atol=1e-5)
        t += n
    if window is not None:
        # A sliding layer gathers at most the blocks its window reaches, whatever the context.
        rows, _ = meta.window(window)
        reach = cdiv(max(n for _, n in seqs) + window - 1, BS) + 1
        assert rows.numel() <= len(seqs) * reach * BS
        assert rows.numel() <= meta.kv_rows.numel()
    if chunk is not None:
        # A chunked layer gathers from the block of its earliest query's chunk start on.
        rows, _ = meta.chunked(chunk)
        assert rows.numel() <= meta.kv_rows.numel()


def test_a_long_decode_reads_one_window_not_the_past() -> None:
    layout = KVLayout(1, KV_HEADS, DIM, BS, "float32")
    storage = KVBlockStorage(layout, 64)
    slots = list(range(200))
    meta = BatchMeta(storage, [SeqSlice(199, 1, slots)])
    rows, mask = meta.window(WINDOW)
    assert meta.kv_rows.numel() == 200
    assert rows.numel() == 2 * BS  # positions 192..199: blocks 48 and 49 only
    assert int(mask.sum()) == WINDOW


# -- the engine --------------------------------------------------------------------------------


def test_single_requests_give_hf_generate_tokens(gemma: Gemma) -> None:
    engine = gemma.engine()
    prompts = [seeded_prompt(1, 5), seeded_prompt(2, 23), seeded_prompt(3, 41)]
    for i, prompt in enumerate(prompts):
        got, _ = _run(engine, prompt, 10, rid=f"solo-{i}")
        assert got == gemma.hf_greedy(prompt, 10)
    engine.manager.check()


def test_the_window_changes_the_answer(gemma: Gemma) -> None:
    """Guard on the test model: with every layer full the same weights answer differently."""
    full = transformers.Gemma3ForCausalLM(_gemma_config(gemma.tok, ["full_attention"] * 4))
    full.load_state_dict(gemma.reference.state_dict())
    full.generation_config.eos_token_id = None
    prompt = seeded_prompt(3, 41)
    with torch.no_grad():
        out = full.eval().generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
    assert out[0, len(prompt) :].tolist() != gemma.hf_greedy(prompt, 10)


def test_a_repeated_prompt_computes_only_its_tail(gemma: Gemma) -> None:
    engine = gemma.engine()
    prompt = seeded_prompt(4, 38)  # nine full blocks and two tokens: about five windows
    first, _ = _run(engine, prompt, 8, rid="cold")
    computed = engine.counters.computed_prompt_tokens
    assert computed == len(prompt)
    second, last = _run(engine, prompt, 8, rid="warm")
    assert first == second == gemma.hf_greedy(prompt, 8)
    assert last.metrics.cached_tokens == 36
    assert engine.counters.computed_prompt_tokens - computed == len(prompt) - 36


def test_batched_requests_of_different_lengths(gemma: Gemma) -> None:
    # A small token budget chunks the prompts; decodes and prefill chunks share passes.
    engine = gemma.engine(max_num_seqs=4, max_num_batched_tokens=12)
    shared = seeded_prompt(5, 13)
    prompts = [
        seeded_prompt(6, 3),
        shared + seeded_prompt(7, 20),
        seeded_prompt(8, 31),
        shared + seeded_prompt(9, 6),
    ]
    got = run_all(engine, prompts, 9)
    assert got == [gemma.hf_greedy(p, 9) for p in prompts]
    engine.manager.check()
    assert engine.manager.stats().used_blocks == 0


def test_preempted_requests_resume_with_the_same_tokens(gemma: Gemma) -> None:
    # 14 blocks of 4: three requests growing to 8 blocks each cannot all stay.
    engine = gemma.engine(num_blocks=14, max_num_seqs=3)
    prompts = [seeded_prompt(10, 19), seeded_prompt(11, 17), seeded_prompt(12, 21)]
    got = run_all(engine, prompts, 11)
    assert engine.counters.preemptions > 0
    assert got == [gemma.hf_greedy(p, 11) for p in prompts]
    engine.manager.check()


def test_prefixes_come_back_from_a_host_tier(gemma: Gemma) -> None:
    engine = gemma.engine(num_blocks=16, tiers=[Tier(HostStore(), 64)])
    prompts = [seeded_prompt(20 + i, 29) for i in range(4)]
    for _round in range(2):
        for i, prompt in enumerate(prompts):
            got, _ = _run(engine, prompt, 6, rid=f"tier-{_round}-{i}")
            assert got == gemma.hf_greedy(prompt, 6)
    # The small device pool had evicted the first prompts; the host tier had them.
    assert engine.counters.loaded_prompt_tokens > 0
    assert engine.tier_chain is not None
    engine.tier_chain.check()
    engine.manager.check()
    engine.close()


def test_a_kvtier_cache_under_hf_generate(gemma: Gemma) -> None:
    """``model.generate(cache=KvTierCache(...))``: transformers' own masks, kvtier's blocks."""
    model = copy.deepcopy(gemma.reference)
    attach(model)
    layout = layout_for_model(model.config, BS, torch.float32)
    storage, manager = KVBlockStorage(layout, 64), KVCacheManager(64, BS)
    prompt = seeded_prompt(30, 27)
    for rid in ("cold", "warm"):
        with KvTierCache(storage, manager, rid, prompt) as cache:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]), cache=cache, max_new_tokens=8, do_sample=False
                )
            assert out[0, len(prompt) :].tolist() == gemma.hf_greedy(prompt, 8)
    assert cache.num_cached_tokens == 24


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(**request_mixes())
def test_any_mix_of_requests_gives_hf_generate_tokens(
    gemma: Gemma, lengths: list[int], shared: int, num_blocks: int, budget: int
) -> None:
    """Shared prefixes, chunked prompts and preemption, in whatever mix hypothesis draws."""
    check_request_mix(gemma, lengths, shared, num_blocks, budget)
