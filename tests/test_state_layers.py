"""Hybrids of attention and linear-attention / Mamba layers served from kvtier's blocks, exactly.

Tiny random-weight Qwen3-Next (gated delta-net layers around one gated
attention layer, a mixture of experts) and Bamba (Mamba-2 layers around one
attention layer) generate through kvtier's batched engine. A state layer's
recurrent state is checkpointed in every block, so single requests, batches
with chunked prompts and preemption, a prefix hit, a host tier round trip
and a request moved between engines all give the tokens of transformers'
own greedy ``generate``; a long shared prefix is reused on the second
request; every block's checkpoint equals the state transformers' own cache
holds at the block's end (tokens alone can miss a state error: a tiny
random Mamba barely uses its state); and configs, storage dtypes and tiers
that would round a state are refused.
"""

from __future__ import annotations

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
    greedy_ignoring_eos,
    request_mixes,
    run_all,
    seeded_prompt,
    tiny_tokenizer,
)

from kvtier.engine import layout_for_model  # noqa: E402
from kvtier.engine.config import EngineConfig  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.layers.state_spec import state_spec  # noqa: E402
from kvtier.layers.support import check_supported  # noqa: E402
from kvtier.offload.host import HostStore  # noqa: E402
from kvtier.offload.tier import Tier  # noqa: E402

BS = 4


def _qwen3_next(tok: Any, **fields: Any) -> Any:
    return transformers.Qwen3NextConfig(
        **{
            "vocab_size": len(tok),
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "layer_types": ["linear_attention"] * 2 + ["full_attention", "linear_attention"],
            "max_position_embeddings": 4096,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            **fields,
        }
    )


def _qwen3_5(tok: Any, **fields: Any) -> Any:
    """Qwen3.5's text model: the same layer mix, dense MLPs, separate input projections."""
    config = _qwen3_next(tok).to_dict()
    keep = {k: config[k] for k in config if k.startswith("linear_") or k in _COMMON}
    return transformers.Qwen3_5TextConfig(**{**keep, "intermediate_size": 96, **fields})


def _qwen3_5_moe(tok: Any, **fields: Any) -> Any:
    config = _qwen3_next(tok).to_dict()
    moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    keep = {k: config[k] for k in config if k.startswith(("linear_", "shared_")) or k in moe}
    keep.update({k: config[k] for k in _COMMON})
    return transformers.Qwen3_5MoeTextConfig(**{**keep, **fields})


_COMMON = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "layer_types",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
)


def _shared_fields(tok: Any) -> dict[str, Any]:
    """The sizes every tiny family here shares (vocabulary, widths, heads, positions)."""
    config = _bamba(tok).to_dict()
    return {k: config[k] for k in _COMMON if k not in ("layer_types", "head_dim")}


def _bamba(tok: Any, **fields: Any) -> Any:
    return transformers.BambaConfig(
        **{
            "vocab_size": len(tok),
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 16,
            "attn_layer_indices": [1],
            "max_position_embeddings": 4096,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": 0,
            **fields,
        }
    )


def _granite(tok: Any, **fields: Any) -> Any:
    """Granite 4's hybrid: Bamba's Mamba-2 layers, experts and Granite's multipliers."""
    config = _bamba(tok).to_dict()
    keep = {k: config[k] for k in config if k.startswith("mamba_") or k in _COMMON}
    keep.pop("layer_types", None)
    return transformers.GraniteMoeHybridConfig(
        **{
            **keep,
            "intermediate_size": 96,
            "pad_token_id": 0,
            "layer_types": ["linear_attention", "full_attention"] + ["linear_attention"] * 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.3,
            "logits_scaling": 1.5,
            **fields,
        }
    )


def _nemotron_h(tok: Any, **fields: Any) -> Any:
    """Nemotron-H: Mamba-2, attention, expert and MLP layers, one kind per layer."""
    return transformers.NemotronHConfig(
        **{
            **_shared_fields(tok),
            "head_dim": 16,
            "intermediate_size": 96,
            "num_hidden_layers": 5,
            "layers_block_type": ["mamba", "attention", "mamba", "moe", "mlp"],
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 2,
            "chunk_size": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "n_group": 1,
            "topk_group": 1,
            "pad_token_id": 0,
            **fields,
        }
    )


def _jamba(tok: Any, **fields: Any) -> Any:
    """Jamba: Mamba-1 layers (a state per channel, no heads) around attention, experts."""
    return transformers.JambaConfig(
        **{
            **_shared_fields(tok),
            "intermediate_size": 96,
            "attn_layer_period": 4,
            "attn_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "pad_token_id": 0,
            **fields,
        }
    )


def _falcon_h1(tok: Any, **fields: Any) -> Any:
    """Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, with its
    multipliers; a layer's share of a block keeps K/V and the state in separate columns."""
    return transformers.FalconH1Config(
        **{
            **_shared_fields(tok),
            "num_hidden_layers": 3,
            "head_dim": 16,
            "intermediate_size": 96,
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_d_state": 8,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 16,
            "attention_in_multiplier": 0.8,
            "ssm_out_multiplier": 1.3,
            "attention_out_multiplier": 0.7,
            "pad_token_id": 0,
            **fields,
        }
    )


def _kimi_linear(tok: Any, **fields: Any) -> Any:
    """Kimi Linear: Kimi delta attention (linear) layers around multi-head latent attention."""
    return transformers.KimiLinearConfig(
        **{
            **_shared_fields(tok),
            "num_key_value_heads": 4,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "linear_head_dim": 16,
            "linear_num_heads": 2,
            "linear_conv_kernel_dim": 4,
            "layer_types": ["linear_attention", "full_attention"] + ["linear_attention"] * 2,
            "pad_token_id": 0,
            **fields,
        }
    )


FAMILIES = {
    "qwen3_next": (transformers.Qwen3NextForCausalLM, _qwen3_next),
    "qwen3_5_text": (transformers.Qwen3_5ForCausalLM, _qwen3_5),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeForCausalLM, _qwen3_5_moe),
    "bamba": (transformers.BambaForCausalLM, _bamba),
    "granitemoehybrid": (transformers.GraniteMoeHybridForCausalLM, _granite),
    "nemotron_h": (transformers.NemotronHForCausalLM, _nemotron_h),
    "jamba": (transformers.JambaForCausalLM, _jamba),
    "falcon_h1": (transformers.FalconH1ForCausalLM, _falcon_h1),
    "kimi_linear": (transformers.KimiLinearForCausalLM, _kimi_linear),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> TinyFamily:
    model_class, config = FAMILIES[request.param]
    tok = tiny_tokenizer()
    return TinyFamily(model_class, config(tok), tok, f"tiny-{request.param}", BS, num_blocks=64)


def test_single_requests_give_hf_generate_tokens(family: TinyFamily) -> None:
    engine = family.engine()
    for prompt in (seeded_prompt(1, 1), seeded_prompt(2, 2), seeded_prompt(3, 11)):
        assert run_all(engine, [prompt], 10) == [family.hf_greedy(prompt, 10)]


def test_batches_with_chunks_and_preemption(family: TinyFamily) -> None:
    check_chunked_batches_and_preemption(family, max_batched_tokens=7)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(**request_mixes())
def test_any_mix_of_requests_gives_hf_generate_tokens(
    family: TinyFamily, lengths: list[int], shared: int, num_blocks: int, budget: int
) -> None:
    """Shared prefixes, chunked prompts and preemption, in whatever mix hypothesis draws."""
    check_request_mix(family, lengths, shared, num_blocks, budget)


def test_a_prefix_hit_and_a_host_tier_round_trip(family: TinyFamily) -> None:
    """Both continuations of the cached prefix resume from the sixth block's checkpoint."""
    check_prefix_hit_and_host_tier(family)


def test_choices_forked_mid_block_keep_their_states(family: TinyFamily) -> None:
    """``n`` choices share the prompt's blocks and copy its partial last block, checkpoint
    included, on write: every greedy choice gives the reference's tokens."""
    from kvtier.engine.sampling import SamplingParams

    engine = family.engine()
    for length in (9, 12):
        prompt = seeded_prompt(length, length)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=3)
        got: dict[int, list[int]] = {}
        for out in engine.generate(prompt, params):
            got.setdefault(out.index, []).extend(out.token_ids)
        assert got == {i: family.hf_greedy(prompt, 6) for i in range(3)}


def test_a_long_shared_prefix_is_reused(family: TinyFamily) -> None:
    """A second request sharing a 2,048-token prefix computes only what follows it."""
    engine = family.engine(num_blocks=1100, max_num_batched_tokens=512)
    prefix = seeded_prompt(50, 2048)
    first, second = prefix + seeded_prompt(51, 9), prefix + seeded_prompt(52, 7)
    run_all(engine, [first], 2)
    outs = list(engine.generate(second, greedy_ignoring_eos(3)))
    cached = outs[-1].metrics.cached_tokens
    assert cached == 2048
    assert [t for o in outs for t in o.token_ids] == family.hf_greedy(second, 3)


@pytest.mark.parametrize("steps_before", [1, 5])
def test_a_request_moved_to_another_engine_keeps_its_tokens(
    family: TinyFamily, steps_before: int
) -> None:
    """Mid-prefill or mid-decode: the blocks carry the state checkpoints with the K/V."""
    check_moved_request(family, steps_before)


def test_the_state_size_read_from_the_config_is_what_the_model_keeps(
    family: TinyFamily,
) -> None:
    """The bytes kvtier reserves per state equal the states transformers' own cache holds."""
    config = family.reference.config
    spec = state_spec(lambda name: getattr(config, name, None))
    assert spec is not None
    with torch.no_grad():
        out = family.reference.generate(
            torch.tensor([seeded_prompt(60, 9)]),
            max_new_tokens=2,
            do_sample=False,
            return_dict_in_generate=True,
        )
    held = [
        (layer.conv_states[0], layer.recurrent_states[0])
        for layer in out.past_key_values.layers
        if getattr(layer, "conv_states", None) and layer.conv_states[0] is not None
    ]
    assert len(held) == len(spec.layers)
    for conv, rec in held:
        assert tuple(conv.shape[1:]) == (spec.conv_channels, spec.conv_kernel)
        assert tuple(rec.shape[1:]) == spec.recurrent_shape
        assert conv.nbytes + rec.nbytes == spec.nbytes(4)
    # Each state layer's part of a block holds one state (after the layer's own K/V when it
    # has attention too): blocks of 4 tokens widen the slots just enough.
    layout = layout_for_model(config, BS, torch.float32)
    columns = layout.head_dim - (config.head_dim if spec.beside_attention else 0)
    part = 2 * BS * layout.num_kv_heads * columns * 4
    assert part >= spec.nbytes(4) > part - 2 * BS * layout.num_kv_heads * 4


@pytest.mark.parametrize(
    "fields",
    [
        {"layers_block_type": ["mamba", "attention", "mamba", "moe", "mlp"]},
        {"hybrid_override_pattern": "M*ME-"},
    ],
)
def test_nemotron_h_layer_plans_in_every_form_are_read(fields: dict[str, Any]) -> None:
    saved = {**_nemotron_h(tiny_tokenizer()).to_dict(), **fields}
    saved.pop("layer_types", None)
    if "hybrid_override_pattern" in fields:
        saved.pop("layers_block_type", None)
    spec = state_spec(saved.get)
    assert spec is not None and spec.layers == (0, 2)
    check_supported(saved.get)
    with pytest.raises(ConfigError, match="float32"):
        state_spec({**saved, "mamba_ssm_cache_dtype": "bfloat16"}.get)


def test_quantized_blocks_or_tiers_are_refused(family: TinyFamily) -> None:
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        family.engine(kv_cache_dtype="bfloat16")
    with pytest.raises(ConfigError, match="raw codec"):
        family.engine(tiers=[Tier(HostStore(), 64, codec="int8")])


@pytest.mark.parametrize(
    ("name", "fields", "needle"),
    [
        ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
        ("qwen3_next", {"layer_types": ["mamba"] * 4}, "mamba"),
        ("bamba", {"mamba_d_head": 7}, "mamba_d_head"),
    ],
)
def test_configs_kvtier_cannot_serve_are_refused(
    name: str, fields: dict[str, Any], needle: str
) -> None:
    config = {**FAMILIES[name][1](tiny_tokenizer()).to_dict(), **fields}
    with pytest.raises(ConfigError, match=needle):
        check_supported(config.get)


def test_a_saved_directory_serves(family: TinyFamily, tmp_path: Path) -> None:
    """What ``kvtier serve --model DIR`` does: probe, load and serve it over HTTP."""
    info = check_saved_directory_serves(family, tmp_path, "hello")
    assert info.state is not None
    config = family.reference.config
    assert info.layout(16, "float32") == layout_for_model(config, 16, torch.float32)


def test_serve_refuses_rounded_states_before_loading_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the config is saved: the refusal comes before anything reads weights."""
    from kvtier.cli import main

    tok = tiny_tokenizer()
    _qwen3_next(tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    argv = ["serve", "--model", str(tmp_path), "--port", "0", "--pressure", "off"]
    assert main([*argv, "--kv-cache-dtype", "int8"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and "recurrent states" in err, err


def test_a_kvtier_cache_under_generate_is_refused(family: TinyFamily) -> None:
    import copy

    from kvtier.engine import KvTierCache, attach
    from kvtier.engine.paged import install
    from kvtier.manager import KVCacheManager
    from kvtier.storage import KVBlockStorage

    model = copy.deepcopy(family.reference)
    install(model)
    attach(model)
    layout = layout_for_model(model.config, BS, torch.float32)
    storage, manager = KVBlockStorage(layout, 64), KVCacheManager(64, BS)
    prompt = seeded_prompt(32, 9)
    with (
        KvTierCache(storage, manager, "r", prompt) as cache,
        torch.no_grad(),
        pytest.raises(ConfigError, match="recurrent state"),
    ):
        model.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=2)


def test_serve_picks_a_block_size_that_holds_a_state_unwidened(tmp_path: Path) -> None:
    from kvtier.cli.serve_config import state_block_size
    from kvtier.layers.state_spec import state_block_size as smallest

    tok = tiny_tokenizer()
    config = _qwen3_next(tok, linear_key_head_dim=16, linear_value_head_dim=16)
    config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    # 4 x 16 x 16 float32 + 128 channels x 4 columns float32 = 6,144 bytes; a token of an
    # attention layer takes 2 x 2 heads x 16 x 4 = 256: 24 tokens, so blocks of 32.
    chosen, line = state_block_size(EngineConfig(model=str(tmp_path)))
    assert chosen.cache.block_size == 32 and line is not None and "32 tokens" in line
    assert layout_for_model(config, 32, torch.float32).head_dim == 16  # nothing widened
    assert layout_for_model(config, 16, torch.float32).head_dim == 24
    # Qwen3-Next-80B-A3B's own sizes, in bfloat16: 2 MiB + 64 KiB per state.
    real = transformers.Qwen3NextConfig()
    spec = state_spec(lambda name: getattr(real, name, None))
    assert spec is not None and spec.nbytes(2) == 2 * 2**20 + 64 * 2**10
    assert smallest(spec, real.head_dim, real.num_key_value_heads, 2) == 1056
    llama = tmp_path / "llama"
    transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4
    ).save_pretrained(llama)
    tok.save_pretrained(llama)
    chosen, line = state_block_size(EngineConfig(model=str(llama)))
    assert chosen.cache.block_size == 16 and line is None


def checkpoints_and_states(
    reference: Any, device: str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(kvtier's conv, transformers' conv, kvtier's recurrent, transformers' recurrent)``
    for every state layer at the end of each block of a 14-token prompt computed in two
    passes (the second going on from the state the first left mid-block)."""
    import copy

    from kvtier.engine.paged import install
    from kvtier.layers.batch import BatchMeta, SeqSlice
    from kvtier.layers.state import _StateIO
    from kvtier.storage import KVBlockStorage

    model = copy.deepcopy(reference).to(device)
    install(model)
    config = model.config
    spec = state_spec(lambda name: getattr(config, name, None))
    assert spec is not None
    storage = KVBlockStorage(layout_for_model(config, BS, torch.float32), 8, device)
    prompt = seeded_prompt(70, 3 * BS + 2)
    for start, end in ((0, 2 * BS + 2), (2 * BS + 2, len(prompt))):
        meta = BatchMeta(storage, [SeqSlice(start, end - start, list(range(end)))])
        with torch.no_grad():
            model(
                input_ids=torch.tensor([prompt[start:end]], device=device),
                position_ids=torch.arange(start, end, device=device)[None],
                attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
                use_cache=False,
                logits_to_keep=1,
                kvtier_batch=meta,
            )
    first = next(iter(m for m in model.modules() if hasattr(m, "_kvtier_plan")))
    io = _StateIO(storage, spec, torch.float32, first._kvtier_plan.first_column)
    pairs = []
    for block in range(4):
        end = min((block + 1) * BS, len(prompt))
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt[:end]], device=device), use_cache=True)
        held = [
            layer
            for layer in out.past_key_values.layers
            if getattr(layer, "conv_states", None) and layer.conv_states[0] is not None
        ]
        for layer_idx, layer in zip(spec.layers, held, strict=True):
            conv, rec = io.read(layer_idx, io.rows([block]))
            pairs.append((conv[0], layer.conv_states[0][0], rec[0], layer.recurrent_states[0][0]))
    return pairs


def test_every_block_holds_the_models_own_state_at_its_end(family: TinyFamily) -> None:
    """The checkpoint in each block equals the state transformers' own cache holds after
    the block's last token (tokens alone can miss a state error in a tiny random model)."""
    for conv, want_conv, rec, want_rec in checkpoints_and_states(family.reference):
        torch.testing.assert_close(conv, want_conv, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(rec, want_rec, rtol=1e-4, atol=1e-5)
