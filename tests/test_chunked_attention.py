"""Llama 4's chunked local attention and position-scaled NoPE layers, served exactly.

A tiny random-weight Llama 4 text model (three chunked local layers of
chunk 8 around one full-attention NoPE layer whose queries are scaled by
position, a mixture of experts) generates through kvtier's batched engine:
single requests, batches with chunked prompts and preemption, random request
mixes, a prefix hit, a host tier round trip, a request moved between engines
and ``kvtier serve``'s path give the tokens of transformers' own greedy
``generate``; without the chunk masks the tokens differ. The NoPE layer's
query scaling is checked on its own: packed with another sequence into one
row, each sequence's output equals the layer's on that sequence alone.
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
from tiny_model import (  # noqa: E402
    TinyFamily,
    check_chunked_batches_and_preemption,
    check_moved_request,
    check_prefix_hit_and_host_tier,
    check_request_mix,
    check_saved_directory_serves,
    request_mixes,
    run_all,
    seeded_prompt,
    tiny_tokenizer,
)

from kvtier.engine import layout_for_model  # noqa: E402
from kvtier.engine.paged import install  # noqa: E402
from kvtier.layers.attention_spec import chunked_layers  # noqa: E402
from kvtier.layers.batch import BatchMeta, SeqSlice  # noqa: E402
from kvtier.storage import KVBlockStorage  # noqa: E402

BS = 4
CHUNK = 8


def _config(tok: Any, **fields: Any) -> Any:
    return transformers.Llama4TextConfig(
        **{
            "vocab_size": len(tok),
            "hidden_size": 64,
            "intermediate_size": 96,
            "intermediate_size_mlp": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "attention_chunk_size": CHUNK,
            # A small floor scale makes the NoPE layer's query scaling change within tests.
            "floor_scale": 4,
            "attn_scale": 0.5,
            "max_position_embeddings": 512,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": 0,
            **fields,
        }
    )


@pytest.fixture(scope="module")
def llama4() -> TinyFamily:
    tok = tiny_tokenizer()
    return TinyFamily(transformers.Llama4ForCausalLM, _config(tok), tok, "tiny-llama4", BS)


@pytest.mark.parametrize(
    "fields",
    [{}, {"no_rope_layers": [1, 0, 1, 1]}, {"no_rope_layer_interval": 2}],
)
def test_the_chunked_layers_are_transformers_own(fields: dict[str, Any]) -> None:
    config = _config(tiny_tokenizer(), **fields)
    want = tuple(i for i, t in enumerate(config.layer_types) if t == "chunked_attention")
    as_saved = config.to_dict()
    layers, chunk = chunked_layers(as_saved.get)
    assert (layers, chunk) == (want, CHUNK)
    bare = {k: v for k, v in as_saved.items() if k != "layer_types"}
    assert chunked_layers(bare.get) == (want, CHUNK)


def test_single_requests_give_hf_generate_tokens(llama4: TinyFamily) -> None:
    engine = llama4.engine()
    for prompt in (
        seeded_prompt(1, 1),
        seeded_prompt(2, 7),
        seeded_prompt(3, 8),
        seeded_prompt(4, 23),
    ):
        assert run_all(engine, [prompt], 12) == [llama4.hf_greedy(prompt, 12)]


def test_without_the_chunks_the_answer_changes(llama4: TinyFamily) -> None:
    """Served as plain full attention, the chunked layers give other tokens."""
    prompt = seeded_prompt(4, 23)
    engine = llama4.engine()  # marks the layers, which are then widened to full attention
    chunked = [m for m in llama4.model.modules() if hasattr(m, "_kvtier_chunk")]
    assert len(chunked) == 3
    for m in chunked:
        m._kvtier_chunk = 10**6
    assert run_all(engine, [prompt], 12) != [llama4.hf_greedy(prompt, 12)]
    llama4.engine()  # marks them again, for the other tests


def test_the_nope_layer_scales_queries_at_their_own_positions(llama4: TinyFamily) -> None:
    """Two sequences packed into one row: each one's queries are scaled as transformers
    scales them when it runs alone, not by their place in the row."""
    model = copy.deepcopy(llama4.reference)
    install(model)
    nope = model.model.layers[3].self_attn
    alone = llama4.reference.model.layers[3].self_attn
    assert not nope.use_rope and nope.attn_temperature_tuning
    storage = KVBlockStorage(layout_for_model(model.config, BS, torch.float32), 16)
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(1, 10, 64, generator=g), torch.randn(1, 6, 64, generator=g)
    meta = BatchMeta(
        storage, [SeqSlice(0, 10, list(range(10))), SeqSlice(0, 6, list(range(16, 22)))]
    )

    def packed() -> torch.Tensor:
        with torch.no_grad():
            out, _ = nope(
                torch.cat([first, second], dim=1),
                position_embeddings=None,
                attention_mask=None,
                kvtier_batch=meta,
            )
        return out

    with torch.no_grad():
        want = [alone(x, position_embeddings=None, attention_mask=None)[0] for x in (first, second)]
    got = packed()
    torch.testing.assert_close(got[:, :10], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, 10:], want[1], rtol=1e-5, atol=1e-6)
    nope._kvtier_temperature.attn_scale = 0.0  # unscaled queries: another answer
    assert not torch.allclose(packed()[:, :10], want[0], atol=1e-4)


def test_batches_with_chunks_and_preemption(llama4: TinyFamily) -> None:
    check_chunked_batches_and_preemption(llama4, max_batched_tokens=7)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(**request_mixes())
def test_any_mix_of_requests_gives_hf_generate_tokens(
    llama4: TinyFamily, lengths: list[int], shared: int, num_blocks: int, budget: int
) -> None:
    check_request_mix(llama4, lengths, shared, num_blocks, budget)


def test_a_prefix_hit_and_a_host_tier_round_trip(llama4: TinyFamily) -> None:
    check_prefix_hit_and_host_tier(llama4)


@pytest.mark.parametrize("steps_before", [1, 5])
def test_a_request_moved_to_another_engine_keeps_its_tokens(
    llama4: TinyFamily, steps_before: int
) -> None:
    check_moved_request(llama4, steps_before)


def test_a_saved_directory_serves(llama4: TinyFamily, tmp_path: Path) -> None:
    """What ``kvtier serve --model DIR`` does: probe, load and serve it over HTTP."""
    info = check_saved_directory_serves(llama4, tmp_path, "hello, chunked world")
    assert info.num_layers == 4
