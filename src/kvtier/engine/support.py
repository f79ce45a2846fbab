"""Which model architectures kvtier serves exactly, decided from the config alone.

kvtier stores one K and one V per KV head for every token of every layer.
Its paged attention gives each query its sequence's whole past (full causal
attention), the last ``sliding_window`` positions of it (a sliding layer,
:mod:`kvtier.engine.attention_spec`) or its own chunk of it (Llama 4's
chunked local layers, :mod:`kvtier.engine.local_attention`). That is
exactly what a plain decoder computes, Gemma 3's interleave of sliding and
full layers included. Two more kinds of layer are served from the same
per-token slots: DeepSeek V3's multi-head latent attention (MLA) from its
compressed latent (:mod:`kvtier.engine.paged`), and LFM2's short causal
convolutions from each token's convolution input
(:mod:`kvtier.engine.conv_layers`); and the linear-attention / Mamba
layers of Qwen3-Next, Qwen3.5, Kimi Linear, Bamba, Granite 4, Nemotron-H,
Falcon-H1 and Jamba from checkpoints of their recurrent state kept with the blocks
(:mod:`kvtier.engine.state_layers`). Nothing else is: other state-space
families are unchecked, attention sinks add a learned logit to every
softmax, and soft-capping bends the attention logits. Served through
kvtier's blocks, such a model would answer differently from the model
itself, without a word.

:func:`check_supported` reads only config fields (a ``config.json``, a GGUF
file's metadata or a loaded config object), so a server refuses a model it
cannot serve exactly before any weight is read. Families are admitted by an
allow-list of architectures whose attention is known to match, and even then
a config that switches on a feature kvtier does not implement is refused,
naming the attention type.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.engine.attention_spec import CHUNKED, CONV, SLIDING, attention_spec
from kvtier.engine.state_spec import LINEAR, STATE_MODEL_TYPES, state_spec
from kvtier.errors import ConfigError

#: ``model_type`` values whose every layer is full causal attention, sliding-window
#: attention, MLA or a short convolution, all kept per token in the blocks (with the
#: feature checks below): served exactly.
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma3_text",
        "deepseek_v2",
        "deepseek_v3",
        "glm4_moe_lite",
        "longcat_flash",
        "lfm2",
        "lfm2_moe",
        "llama4_text",
        *STATE_MODEL_TYPES,
    }
)

#: Of those, the families with chunked local attention layers (Llama 4), checked against the
#: model's own answers (:mod:`kvtier.engine.local_attention`).
CHUNKED_MODEL_TYPES = frozenset({"llama4_text"})

#: Of those, the families with multi-head latent attention (MLA), served with their
#: K and V decompressed per head (see :func:`kvtier.engine.model.geometry`).
MLA_MODEL_TYPES = frozenset(
    {"deepseek_v2", "deepseek_v3", "glm4_moe_lite", "kimi_linear", "longcat_flash"}
)

#: Of those, the families whose sliding-window layers have been checked
#: against the model's own answers (the others must be full attention).
SLIDING_WINDOW_MODEL_TYPES = frozenset({"gemma3_text", "mistral", "qwen2", "qwen3"})

#: Of those, the hybrids whose other layers are short causal convolutions (LFM2), served
#: from each token's convolution input in the blocks (:mod:`kvtier.engine.conv_layers`).
SHORT_CONV_MODEL_TYPES = frozenset({"lfm2", "lfm2_moe"})

#: Known families kvtier does not serve yet, by the attention type that rules them out.
_KNOWN_UNSUPPORTED = {
    "sliding-window attention in a family kvtier has not checked it for": (
        "cohere2",
        "mistral3",
        "ministral",
        "exaone4",
        "olmo3",
        "smollm3",
    ),
    "attention logit soft-capping": ("gemma2",),
    (
        "Gemma 3's image-text form, where image tokens attend to each other both ways "
        "(kvtier serves the text model, model_type gemma3_text)"
    ): ("gemma3",),
    "layers that reuse other layers' K/V (cross-layer KV sharing)": (
        "gemma3n",
        "gemma3n_text",
    ),
    "attention sinks (a learned logit in every softmax)": ("gpt_oss",),
    (
        "chunked local attention in an image-text form (kvtier serves Llama 4's text model, "
        "model_type llama4_text)"
    ): ("llama4",),
    "linear attention (a hybrid model with a recurrent state per layer)": ("minimax",),
    (
        "linear attention with image-text rotary positions (Qwen3.5's image-text form; kvtier "
        "serves its text model, model_type qwen3_5_text or qwen3_5_moe_text)"
    ): ("qwen3_5", "qwen3_5_moe"),
    "Mamba / state-space layers": (
        "mamba",
        "mamba2",
        "falcon_mamba",
        "zamba",
        "zamba2",
        "plamo2",
    ),
    "multi-head latent attention (MLA) in a family not checked for it": (
        "kimi_k2",
        "minicpm3",
        "mistral4",
        "sarvam_mla",
        "youtu",
    ),
    "sparse attention (a learned indexer picks the keys each query attends to)": (
        "deepseek_v32",
        "deepseek_v4",
        "glm_moe_dsa",
        "glm5_next",
        "mistral_large4",
    ),
}
_FAMILY_OF = {t: kind for kind, types in _KNOWN_UNSUPPORTED.items() for t in types}

#: A layer type in ``layer_types`` -> the attention type a refusal names.
_LAYER_KIND = {
    "sliding_attention": "sliding-window attention",
    "chunked_attention": "chunked local attention",
    "linear_attention": "linear attention",
    "mamba": "Mamba / state-space layers",
    "conv": "short convolution layers in a family kvtier has not checked them for",
}

_ADVICE = (
    "kvtier serves decoder-only models of the families "
    f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}, built from full causal attention, "
    f"sliding-window attention ({', '.join(sorted(SLIDING_WINDOW_MODEL_TYPES))}), "
    f"chunked local attention ({', '.join(sorted(CHUNKED_MODEL_TYPES))}), "
    f"multi-head latent attention ({', '.join(sorted(MLA_MODEL_TYPES))}), short causal "
    f"convolutions ({', '.join(sorted(SHORT_CONV_MODEL_TYPES))}) and linear-attention / Mamba "
    f"layers ({', '.join(sorted(STATE_MODEL_TYPES))}); serve this model with an "
    "engine that implements its attention, or pick a supported model"
)


def check_supported(get: Callable[[str], object], *, source: str = "the model") -> None:
    """Raise :class:`ConfigError` unless kvtier computes exactly what this model computes.

    ``get`` reads a config field (``None`` when absent), as for
    :func:`kvtier.engine.model.geometry`. The check needs ``model_type``; a
    config without one is refused too, since nothing says what it is.
    """
    model_type = get("model_type")
    name = model_type if isinstance(model_type, str) and model_type else None
    if name is not None and name in _FAMILY_OF:
        raise ConfigError(
            f"{source} is a {name!r} model, which uses {_FAMILY_OF[name]}: "
            f"not supported yet. {_ADVICE}"
        )
    feature = _unsupported_feature(get, name)
    if feature is not None:
        what = f"a {name!r} model" if name else "a model"
        raise ConfigError(f"{source} is {what} configured with {feature}: not supported. {_ADVICE}")
    if name is None:
        raise ConfigError(f"{source} does not say its model_type. {_ADVICE}")
    if name not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source} is a {name!r} model, whose attention kvtier has not been checked "
            f"against: it is refused rather than risk wrong answers. {_ADVICE}"
        )


def check_wrapper(model_type: object, *, source: str = "the model") -> None:
    """Refuse an image-text wrapper whose family is known unsupported, whatever its decoder.

    A vision-language config nests its decoder's (``text_config``), which
    kvtier checks on its own; the wrapper can still attend in a way the
    decoder alone does not (Gemma 3's, Qwen3.5's image-text forms).
    """
    if isinstance(model_type, str) and model_type in _FAMILY_OF:
        raise ConfigError(
            f"{source} is a {model_type!r} model, which uses {_FAMILY_OF[model_type]}: "
            f"not supported yet. {_ADVICE}"
        )


def _unsupported_feature(get: Callable[[str], object], name: str | None) -> str | None:
    """The first config feature kvtier does not implement, described; ``None`` if none."""
    sliding_ok = name in SLIDING_WINDOW_MODEL_TYPES
    if name in SHORT_CONV_MODEL_TYPES:
        conv = _short_conv_feature(get)
        if conv is not None:
            return conv
    layer_types = get("layer_types")
    if isinstance(layer_types, (list, tuple)):
        allowed = {"full_attention", SLIDING} if sliding_ok else {"full_attention"}
        if name in SHORT_CONV_MODEL_TYPES:
            allowed.add(CONV)
        if name in STATE_MODEL_TYPES:
            allowed.add(LINEAR)
        if name == "nemotron_h":
            allowed |= {"moe", "mlp"}  # feed-forward-only layers: nothing cached
        if name == "falcon_h1":
            allowed.add("hybrid")  # attention and a Mamba-2 mixer side by side
        if name in CHUNKED_MODEL_TYPES:
            allowed.add(CHUNKED)
        odd = sorted({str(t) for t in layer_types if t not in allowed})
        if odd:
            kinds = sorted({_LAYER_KIND.get(t, f"{t!r} layers") for t in odd})
            return " and ".join(kinds) + f" (layer_types has {', '.join(odd)})"
    window = get("sliding_window")
    positions = get("max_position_embeddings")
    if sliding_ok and _positive(get("num_hidden_layers")):
        try:
            attention_spec(get)
        except ConfigError as exc:
            return f"an attention plan kvtier cannot read ({exc})"
    elif (
        _positive(window)
        and get("use_sliding_window") is not False
        # A window at least as long as the context never hides a token.
        and not (_positive(positions) and window >= positions)  # type: ignore[operator]
    ):
        return f"sliding-window attention (sliding_window={window})"
    if get("use_bidirectional_attention") is True:
        return "bidirectional attention (use_bidirectional_attention is true)"
    if name == "gemma3_text" and get("vision_config") is not None:
        return (
            "bidirectional attention over image tokens "
            "(a Gemma 3 vision-language model; its text model alone is served)"
        )
    chunk = get("attention_chunk_size")
    if _positive(chunk) and name not in CHUNKED_MODEL_TYPES:
        return f"chunked local attention (attention_chunk_size={chunk})"
    if _positive(get("kv_lora_rank")) and name not in MLA_MODEL_TYPES:
        return "multi-head latent attention (MLA: kv_lora_rank is set)"
    for field in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if get(field) not in (None, 0, 0.0):
            return f"attention logit soft-capping ({field}={get(field)})"
    if name in STATE_MODEL_TYPES:
        return _state_feature(get)
    for field in ("layers_block_type", "hybrid_override_pattern", "mamba_d_state", "ssm_cfg"):
        if get(field) is not None:
            return f"Mamba / state-space layers ({field} is set)"
    return None


def _state_feature(get: Callable[[str], object]) -> str | None:
    """What a Qwen3-Next or Bamba config asks for beyond what kvtier's state layers keep."""
    try:
        state_spec(get)
    except ConfigError as exc:
        return f"linear-attention layers kvtier cannot read ({exc})"
    return None


def _short_conv_feature(get: Callable[[str], object]) -> str | None:
    """What an LFM2 config asks for beyond what its convolution layers implement."""
    layers = get("num_hidden_layers")
    types = get("layer_types")
    if types is None and get("full_attn_idxs") is None:
        # transformers would then make every layer attention; a file that says nothing
        # (a GGUF file's metadata, say) more likely just does not say which are convolutions.
        return (
            "an unknown plan of convolution and attention layers "
            "(neither layer_types nor full_attn_idxs is set)"
        )
    if isinstance(types, (list, tuple)) and _positive(layers) and len(types) != layers:
        return f"layer_types naming {len(types)} layers for num_hidden_layers={layers}"
    kernel = get("conv_L_cache")
    if kernel is not None and not _positive(kernel):
        return f"a convolution kernel kvtier cannot read (conv_L_cache={kernel!r})"
    if not _positive(get("hidden_size")):
        return "convolution layers of unknown width (hidden_size is not set)"
    return None


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
