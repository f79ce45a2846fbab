"""A hybrid of short convolutions and attention (LFM2) served from kvtier's blocks, exactly.

A tiny random-weight LFM2 (three short-convolution layers of 3 taps around
one attention layer, one KV head, so the slots widen to hold a convolution
layer's ``hidden_size`` features) generates through kvtier's batched engine.
Each token's convolution input lives in its block like attention K/V, so
single requests, batches with chunked prompts and preemption, a prefix hit,
a host tier round trip, a request moved between engines and ``generate``
with a ``KvTierCache`` all give the tokens of transformers' own greedy
``generate``. Underneath, a convolution
layer over any batch of sequences, contexts and block tables must equal the
model's own dense convolution over each sequence, and configs kvtier cannot
serve exactly are refused, naming what they ask for.
"""

from __future__ import annotations

import copy
from pathlib import Path
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
    check_chunked_batches_and_preemption,
    check_moved_request,
    check_prefix_hit_and_host_tier,
    check_request_mix,
    request_mixes,
    run_all,
    seeded_prompt,
    tiny_tokenizer,
)

from kvtier.engine import Engine, KvTierCache, attach, layout_for_model  # noqa: E402
from kvtier.engine.config import EngineConfig  # noqa: E402
from kvtier.engine.model import probe_model  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.layers.attention_spec import short_conv_layers  # noqa: E402
from kvtier.layers.batch import BatchMeta, SeqSlice  # noqa: E402
from kvtier.layers.conv import install_short_convs, pack  # noqa: E402
from kvtier.layers.geometry import geometry  # noqa: E402
from kvtier.layers.support import check_supported  # noqa: E402
from kvtier.layout import KVLayout, cdiv  # noqa: E402
from kvtier.manager import KVCacheManager  # noqa: E402
from kvtier.storage import KVBlockStorage  # noqa: E402

BS = 4
HIDDEN = 64
LAYER_TYPES = ["conv", "full_attention", "conv", "conv"]


def _config(tok: Any, **fields: Any) -> Any:
    return transformers.Lfm2Config(
        **{
            "vocab_size": len(tok),
            "hidden_size": HIDDEN,
            "intermediate_size": 128,
            "num_hidden_layers": len(LAYER_TYPES),
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "max_position_embeddings": 512,
            "layer_types": LAYER_TYPES,
            "conv_L_cache": 3,
            # Weights large enough that greedy tokens vary from step to step.
            "initializer_range": 0.2,
            **fields,
        }
    )


class Lfm2(TinyFamily):
    """The tiny model for engines, an untouched copy for references, and their cache."""

    def __init__(self) -> None:
        tok = tiny_tokenizer()
        super().__init__(
            transformers.Lfm2ForCausalLM, _config(tok), tok, "tiny-lfm2", BS, num_blocks=64
        )


@pytest.fixture(scope="module")
def lfm2() -> Lfm2:
    return Lfm2()


# -- geometry and support ----------------------------------------------------------------


def test_a_slot_widens_to_hold_a_convolution_layers_features(lfm2: Lfm2) -> None:
    layout = layout_for_model(lfm2.model.config, BS, torch.float32)
    # Attention K/V is 1 head of 16; a conv layer stores 64 features per token over K and V.
    assert (layout.num_kv_heads, layout.head_dim) == (1, 32)
    fields = lfm2.model.config.to_dict()
    assert geometry(fields.get) == (4, 4, 1, 32)
    assert short_conv_layers(fields.get) == (0, 2, 3)
    # Older config files list the attention layers instead of naming every layer.
    old = {k: v for k, v in fields.items() if k != "layer_types"} | {"full_attn_idxs": [1]}
    assert short_conv_layers(old.get) == (0, 2, 3)
    check_supported(old.get)
    # Four KV heads already hold 2 x 4 x 16 = 128 >= 64 values: nothing widens.
    wide = {**fields, "num_key_value_heads": 4}
    assert geometry(wide.get) == (4, 4, 4, 16)
    assert layout.bytes_per_block == KVLayout(4, 1, 32, BS, "float32").bytes_per_block


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"layer_types": None, "full_attn_idxs": None}, "neither layer_types nor full_attn_idxs"),
        (
            {"layer_types": ["conv", "sliding_attention", "conv", "conv"]},
            "sliding-window attention",
        ),
        ({"layer_types": ["conv", "linear_attention", "conv", "conv"]}, "linear attention"),
        ({"layer_types": ["conv", "full_attention"]}, "layer_types naming 2 layers"),
        ({"conv_L_cache": 0}, "conv_L_cache=0"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_lfm2_configs_kvtier_cannot_serve_are_refused(
    lfm2: Lfm2, fields: dict[str, Any], needle: str
) -> None:
    config = {**lfm2.model.config.to_dict(), **fields}
    with pytest.raises(ConfigError, match=needle):
        check_supported(config.get)


@pytest.mark.parametrize("model_type", ["qwen3_5", "zamba2", "falcon_mamba", "plamo2"])
def test_recurrent_hybrids_stay_refused(model_type: str) -> None:
    fields = {"model_type": model_type, "num_hidden_layers": 2, "num_attention_heads": 4}
    with pytest.raises(ConfigError, match=r"linear attention|Mamba"):
        check_supported(fields.get)


# -- a convolution layer over blocks --------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seqs=st.lists(st.tuples(st.integers(0, 14), st.integers(1, 7)), min_size=1, max_size=4),
    kernel=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_a_conv_layer_equals_the_dense_convolution_of_each_sequence(
    seqs: list[tuple[int, int]], kernel: int, seed: int
) -> None:
    """Each new token sees exactly its sequence's last ``kernel`` positions, read from blocks."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    config = _config(tok, conv_L_cache=kernel, conv_bias=bool(seed % 2))
    conv = transformers.models.lfm2.modeling_lfm2.Lfm2ShortConv(config, 0).eval()
    dense = copy.deepcopy(conv)
    holder = torch.nn.ModuleList([conv])
    assert install_short_convs(holder) == 1
    layout = layout_for_model(config, BS, torch.float32)
    storage = KVBlockStorage(layout, 64)
    free = torch.randperm(64, generator=g).tolist()
    slices, inputs = [], []
    for start, n in seqs:
        blocks = [free.pop() for _ in range(cdiv(start + n, BS))]
        slots = [blocks[p // BS] * BS + p % BS for p in range(start + n)]
        x = torch.randn(1, start + n, HIDDEN, generator=g)
        if start:  # the context's conv inputs, as an earlier pass would have stored them
            with torch.no_grad():
                b, _, xx = conv.in_proj(x[0, :start]).chunk(3, dim=-1)
            k, v = pack(storage, b * xx)
            storage.write_rows(0, storage.slot_rows(torch.tensor(slots[:start])), k, v)
        slices.append(SeqSlice(start, n, slots))
        inputs.append(x)
    packed = torch.cat([x[:, start:] for x, (start, _) in zip(inputs, seqs, strict=True)], dim=1)
    meta = BatchMeta(storage, slices)
    with torch.no_grad():
        out = conv(packed, kvtier_batch=meta)
        t = 0
        for x, (start, n) in zip(inputs, seqs, strict=True):
            want = dense(x)[:, start:]
            torch.testing.assert_close(out[:, t : t + n], want, rtol=1e-4, atol=1e-5)
            t += n


# -- whole models, token for token ------------------------------------------------------------


def test_single_requests_give_hf_generate_tokens(lfm2: Lfm2) -> None:
    engine = lfm2.engine()
    for seed, length in ((1, 1), (2, 2), (3, 9), (4, 27)):
        prompt = seeded_prompt(seed, length)
        assert run_all(engine, [prompt], 10) == [lfm2.hf_greedy(prompt, 10)]
    engine.manager.check()


def test_batches_with_chunks_and_preemption(lfm2: Lfm2) -> None:
    check_chunked_batches_and_preemption(lfm2, max_batched_tokens=7)


def test_a_prefix_hit_and_a_host_tier_round_trip(lfm2: Lfm2) -> None:
    """The continued prefix's first new token reads its conv window from cached blocks."""
    check_prefix_hit_and_host_tier(lfm2)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(**request_mixes())
def test_any_mix_of_requests_gives_hf_generate_tokens(
    lfm2: Lfm2, lengths: list[int], shared: int, num_blocks: int, budget: int
) -> None:
    """Shared prefixes, chunked prompts and preemption, in whatever mix hypothesis draws."""
    check_request_mix(lfm2, lengths, shared, num_blocks, budget)


@pytest.mark.parametrize("steps_before", [1, 5])
def test_a_request_moved_to_another_engine_keeps_its_tokens(lfm2: Lfm2, steps_before: int) -> None:
    """Mid-prefill or mid-decode: the blocks carry the convolution inputs with the K/V."""
    check_moved_request(lfm2, steps_before)


def test_a_kvtier_cache_under_hf_generate(lfm2: Lfm2) -> None:
    model = copy.deepcopy(lfm2.reference)
    install_short_convs(model)
    attach(model)
    layout = layout_for_model(model.config, BS, torch.float32)
    storage, manager = KVBlockStorage(layout, 64), KVCacheManager(64, BS)
    prompt = seeded_prompt(32, 27)
    for rid in ("cold", "warm"):
        with KvTierCache(storage, manager, rid, prompt) as cache, torch.no_grad():
            out = model.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=8)
        assert out[0, len(prompt) :].tolist() == lfm2.hf_greedy(prompt, 8)
    assert cache.num_cached_tokens == 24


def test_a_saved_lfm2_directory_serves(lfm2: Lfm2, tmp_path: Path) -> None:
    """What ``kvtier serve --model DIR`` does: probe, load and serve it over HTTP."""
    from serving import serving

    lfm2.reference.save_pretrained(tmp_path)
    lfm2.tok.save_pretrained(tmp_path)
    info = probe_model(tmp_path)
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (4, 1, 32)
    engine = Engine.from_config(EngineConfig(model=str(tmp_path)))
    with serving(engine, "tiny-lfm2") as srv:
        reply = srv.client().completions.create(
            model="tiny-lfm2", prompt="hello", max_tokens=5, temperature=0.0
        )
    prompt = lfm2.tok.encode("hello")
    assert reply.choices[0].text == lfm2.tok.decode(lfm2.hf_greedy(prompt, 5))
