"""Models whose attention kvtier does not implement are refused before any weight is read.

kvtier's blocks hold K/V per KV head, read by full causal or sliding-window
attention (or a latent per token for DeepSeek's MLA, and the convolution
input per token for LFM2's short convolutions). A model whose attention
kvtier does not implement, or whose family the conformance sweep found
answering differently (``tests/test_families.py``), would answer differently
from the model itself through them (as would a feature its family was not swept with), so
every entry point (probing a model directory, loading it, building an engine
or a ``KvTierCache`` from a loaded model, ``kvtier serve --model DIR``)
refuses such a model with a ``ConfigError`` naming its attention type. The
families that are admitted are checked here the other way round: tiny
random models of each, with and without a sliding window that binds, give
the tokens Hugging Face's own greedy decoding gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from tiny_model import solo_greedy, tiny_tokenizer  # noqa: E402

from kvtier.cli import main  # noqa: E402
from kvtier.conformance.tiny import MLA_FIELDS  # noqa: E402
from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.engine.model import load_model, probe_model  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.layers.support import SUPPORTED_MODEL_TYPES, check_supported  # noqa: E402

_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


#: Small gated delta-net (linear attention) layers around one attention layer.
_DELTA_NET: dict[str, Any] = {
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
_SHARED_EXPERTS: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}


def _config(cls_name: str, **fields: Any) -> Any:
    cls = getattr(transformers, cls_name)
    return cls(vocab_size=len(tiny_tokenizer()), **{**_SMALL, **fields})


#: Multi-head latent attention with a query LoRA, and a few routed experts.
_MLA = MLA_FIELDS


#: (config class, extra fields, words the refusal must contain)
UNSUPPORTED = [
    (
        "Gemma3TextConfig",
        {"sliding_window": 32, "head_dim": 16, "use_bidirectional_attention": True},
        "bidirectional attention",
    ),
    ("Gemma3Config", {}, "image tokens"),
    ("Llama4Config", {}, "chunked local attention in an image-text form"),
    ("Qwen3_5MoeConfig", {}, "linear attention"),
    (
        "DeepseekV32Config",
        {
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
        },
        "sparse attention",
    ),
    ("MiniCPM3Config", {"kv_lora_rank": 16, "q_lora_rank": 32}, "multi-head latent attention"),
    # Llama swept as full attention: sliding layers are a switch the sweep did not exercise.
    ("LlamaConfig", {"sliding_window": 8, "layer_types": ["sliding_attention"] * 3}, "sliding"),
    ("BloomConfig", {}, "does not serve exactly"),
]


def _ids(case: tuple[str, dict[str, Any], str]) -> str:
    return case[0].removesuffix("Config")


@pytest.fixture(params=UNSUPPORTED, ids=_ids)
def unsupported(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Any, str]:
    cls_name, fields, needle = request.param
    if not hasattr(transformers, cls_name):
        pytest.fail(f"transformers {transformers.__version__} has no {cls_name}")
    if cls_name == "GPT2Config":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100)
    elif cls_name == "Llama4Config":  # Llama 4's image-text form around its text model
        config = transformers.Llama4Config(
            text_config={**_SMALL, "head_dim": 16, "attention_chunk_size": 8},
            vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2},
        )
    elif cls_name == "Gemma3Config":  # a vision-language model around a Gemma 3 text model
        config = transformers.Gemma3Config(
            text_config={**_SMALL, "head_dim": 16, "sliding_window": 32},
            vision_config={
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            },
        )
    else:
        config = _config(cls_name, **fields)
    # Only the config is saved: if anything tried to read weights it would
    # fail with a different error, so a refusal here happened before them.
    config.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    return tmp_path, config, needle


def test_probe_refuses_before_weights(unsupported: tuple[Path, Any, str]) -> None:
    path, _, needle = unsupported
    with pytest.raises(ConfigError, match=needle) as info:
        probe_model(path)
    assert str(path) in str(info.value)


def test_load_model_refuses_before_weights(unsupported: tuple[Path, Any, str]) -> None:
    path, _, needle = unsupported
    with pytest.raises(ConfigError, match=needle) as info:
        load_model(path)
    assert "cannot load" not in str(info.value)  # never reached from_pretrained


def test_serve_refuses_with_one_line(
    unsupported: tuple[Path, Any, str], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _, needle = unsupported
    code = main(["serve", "--model", str(path), "--port", "0", "--pressure", "off"])
    out, err = capsys.readouterr()
    assert code == 1
    assert err.startswith("kvtier: error: ") and needle in err, err
    assert "Traceback" not in err and "kvtier: loading" not in out


@pytest.mark.parametrize(
    "cls_name",
    ["Gemma3TextConfig", "DeepseekV32Config", "BloomConfig"],
)
def test_an_engine_refuses_a_loaded_model(cls_name: str) -> None:
    """A model already in memory (no files to probe) is refused when the engine is built."""
    fields = next(f for c, f, _ in UNSUPPORTED if c == cls_name)
    config = _config(cls_name, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"not supported|does not serve exactly"):
        Engine(model, tiny_tokenizer(), model_id="refused", num_blocks=64, block_size=4)


def test_an_engine_refuses_a_gemma3_vision_language_model() -> None:
    """Its decoder alone would pass: the wrapper's image attention is what rules it out."""
    config = transformers.Gemma3Config(
        text_config={**_SMALL, "vocab_size": len(tiny_tokenizer()), "head_dim": 16},
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
    )
    model = transformers.Gemma3ForConditionalGeneration(config)
    with pytest.raises(ConfigError, match="image tokens"):
        Engine(model, tiny_tokenizer(), model_id="refused", num_blocks=64, block_size=4)


def test_a_config_without_model_type_is_refused() -> None:
    fields = {"num_hidden_layers": 2, "num_attention_heads": 4}
    with pytest.raises(ConfigError, match="model_type"):
        check_supported(fields.get)


def test_a_window_longer_than_the_context_never_binds() -> None:
    """A window on a family served as full attention only passes if it hides nothing."""
    fields = {"model_type": "llama", "sliding_window": 4096, "max_position_embeddings": 4096}
    check_supported(fields.get)
    fields["max_position_embeddings"] = 32768
    with pytest.raises(ConfigError, match="sliding-window attention"):
        check_supported(fields.get)
    # Mistral's window is applied, so a binding one is served too.
    check_supported({**fields, "model_type": "mistral", "num_hidden_layers": 2}.get)


def test_sliding_layers_are_refused_outside_the_checked_families() -> None:
    fields = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    with pytest.raises(ConfigError, match="sliding-window attention"):
        check_supported(fields.get)
    check_supported({**fields, "model_type": "gemma3_text"}.get)
    with pytest.raises(ConfigError, match="sliding_window"):
        check_supported({**fields, "model_type": "gemma3_text", "sliding_window": None}.get)


def test_the_default_gguf_model_is_supported() -> None:
    from needs import need_default_model

    need_default_model()
    info = probe_model(None)
    assert info.num_layers == 30


SUPPORTED = [
    ("LlamaConfig", {}),
    ("MistralConfig", {"sliding_window": None}),
    ("MistralConfig", {"sliding_window": 8}),
    ("Qwen2Config", {}),
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("Qwen3Config", {"head_dim": 16}),
    (
        "Qwen3Config",
        {"head_dim": 16, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "sliding_window_pattern": 2,
        },
    ),
    *(
        (
            name,
            {
                **_MLA,
                "moe_intermediate_size": 32,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
            },
        )
        for name in ("DeepseekV3Config", "DeepseekV2Config", "Glm4MoeLiteConfig")
    ),
    (
        # Two attention sublayers in each of its 2 decoder layers; zero-computation experts.
        "LongcatFlashConfig",
        {
            **_MLA,
            "num_layers": 2,
            "head_dim": 8,  # its rotary width: qk_rope_head_dim
            "moe_topk": 2,
            "zero_expert_num": 2,
            "ffn_hidden_size": 128,
            "expert_ffn_hidden_size": 32,
        },
    ),
    # Short convolutions around attention; 4 taps with biases, slots widened to hidden_size.
    (
        "Lfm2Config",
        {
            "layer_types": ["conv", "full_attention", "conv"],
            "conv_L_cache": 4,
            "conv_bias": True,
        },
    ),
    (
        "Lfm2MoeConfig",
        {
            "layer_types": ["conv", "full_attention", "conv"],
            "num_key_value_heads": 1,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_dense_layers": 1,
        },
    ),
    # Linear-attention (gated delta-net) and Mamba-2 layers around attention: state
    # checkpoints in the blocks (tests/test_state_layers.py goes further).
    ("Qwen3NextConfig", {**_DELTA_NET, **_SHARED_EXPERTS}),
    (
        "Qwen3_5TextConfig",
        {
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "head_dim": 16,
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 8,
        },
    ),
    (
        "Qwen3_5MoeTextConfig",
        {
            **_DELTA_NET,
            **_SHARED_EXPERTS,
            "layer_types": ["full_attention", "linear_attention", "linear_attention"],
        },
    ),
    # Chunked local attention layers (chunk 8) and position-scaled NoPE layers, with experts.
    (
        "Llama4TextConfig",
        {
            "head_dim": 16,
            "attention_chunk_size": 8,
            "floor_scale": 4,
            "num_local_experts": 4,
            "intermediate_size_mlp": 128,
        },
    ),
    (
        "GraniteMoeHybridConfig",
        {
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "mamba_n_heads": 4,
            "mamba_d_state": 8,
            "mamba_chunk_size": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
        },
    ),
    (
        "NemotronHConfig",
        {
            "head_dim": 16,
            "layers_block_type": ["mamba", "attention", "mlp"],
            "mamba_num_heads": 4,
            "mamba_head_dim": 32,
            "ssm_state_size": 8,
            "n_groups": 2,
            "chunk_size": 8,
        },
    ),
    (
        "JambaConfig",
        {
            "attn_layer_period": 3,
            "attn_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 8,
        },
    ),
    (
        "FalconH1Config",
        {
            "head_dim": 16,
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_state": 8,
            "mamba_chunk_size": 8,
        },
    ),
    (
        "KimiLinearConfig",
        {
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "linear_head_dim": 16,
            "linear_num_heads": 2,
            "pad_token_id": 0,
        },
    ),
    (
        "BambaConfig",
        {
            "attn_layer_indices": [2],
            "mamba_n_heads": 4,
            "mamba_d_state": 8,
            "mamba_chunk_size": 8,
            "pad_token_id": 0,
        },
    ),
]


def test_every_supported_family_is_exercised() -> None:
    covered = {_config(name, **fields).model_type for name, fields in SUPPORTED}
    assert covered <= SUPPORTED_MODEL_TYPES  # every admitted family: tests/test_families.py


@pytest.mark.parametrize(
    ("cls_name", "fields"),
    SUPPORTED,
    ids=[
        c.removesuffix("Config") + ("-window" if f.get("sliding_window") else "")
        for c, f in SUPPORTED
    ],
)
def test_supported_families_give_hf_greedy_tokens(cls_name: str, fields: dict[str, Any]) -> None:
    """Through the batched engine, twice (the second time from the cached prefix)."""
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = _config(cls_name, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompt = tok.encode("kvtier serves every layer with full attention, " * 3)
    ref = solo_greedy(model, prompt, 12)
    engine = Engine(model, tok, model_id=cls_name, num_blocks=128, block_size=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for attempt in range(2):
        outs = list(engine.generate(prompt, params, request_id=f"{cls_name}-{attempt}"))
        assert [t for o in outs for t in o.token_ids] == ref
    assert outs[-1].metrics.cached_tokens > 0
