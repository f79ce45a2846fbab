"""Which model architectures kvtier serves exactly, decided from the config alone.

kvtier stores one K and one V per KV head for every token of every layer.
Its paged attention gives each query its sequence's whole past (full causal
attention), the last ``sliding_window`` positions of it (a sliding layer,
:mod:`kvtier.layers.attention_spec`) or its own chunk of it (Llama 4's
chunked local layers, :mod:`kvtier.layers.local`). That is
exactly what a plain decoder computes, Gemma 3's interleave of sliding and
full layers included. Two more kinds of layer are served from the same
per-token slots: DeepSeek V3's multi-head latent attention (MLA) from its
compressed latent (:mod:`kvtier.engine.paged`), and LFM2's short causal
convolutions from each token's convolution input
(:mod:`kvtier.layers.conv`); and the linear-attention / Mamba
layers of Qwen3-Next, Qwen3.5, Kimi Linear, Bamba, Granite 4, Nemotron-H,
Falcon-H1 and Jamba from checkpoints of their recurrent state kept with the blocks
(:mod:`kvtier.layers.state`). Nothing else is: other state-space
families are unchecked, attention sinks add a learned logit to every
softmax, soft-capping bends the attention logits, and ALiBi biases (BLOOM,
MPT, Falcon's ``alibi`` form) are added by attention code of the model's
own. Served through kvtier's blocks, such a model would answer differently
from the model itself, without a word.

:func:`check_supported` reads only config fields (a ``config.json``, a GGUF
file's metadata or a loaded config object), so a server refuses a model it
cannot serve exactly before any weight is read. Families are admitted by
evidence: ``families.json`` beside this module is the record of the
conformance sweep (:mod:`kvtier.conformance`, ``python bench/families.py
--write``), which served a tiny model of every decoder family of the
installed transformers through the engine and compared each token with
transformers' own greedy ``generate``. A family is admitted when its record
says ``exact``, and then only for configs within the features its tiny model
exercised (:func:`config_features`): a switch the sweep did not try, or an
attention feature kvtier does not implement, is refused, naming it and what
to use instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any

from kvtier.errors import ConfigError
from kvtier.layers.attention_spec import (
    CHUNKED,
    CONV,
    FULL,
    SLIDING,
    attention_spec,
    chunked_layers,
    short_conv_layers,
)
from kvtier.layers.state_spec import LINEAR, STATE_MODEL_TYPES, state_spec

#: The conformance sweep's record (``families.json``): per ``model_type``, its outcome,
#: the config features an exact run exercised, or the reason it is refused.
_RECORD_FILE = "families.json"


def _load_record() -> dict[str, Any]:
    try:
        text = resources.files("kvtier.layers").joinpath(_RECORD_FILE).read_text()
    except FileNotFoundError:
        return {"families": {}}
    record = json.loads(text)
    return record if isinstance(record, dict) else {"families": {}}


RECORD: dict[str, Any] = _load_record()
_FAMILIES: dict[str, dict[str, Any]] = RECORD.get("families", {})

#: ``model_type`` values the conformance sweep found exact: admitted (within their features).
SUPPORTED_MODEL_TYPES = frozenset(t for t, e in _FAMILIES.items() if e.get("outcome") == "exact")

#: Families being tried by the conformance sweep, admitted whatever their record says.
_ON_TRIAL: set[str] = set()

#: Of those, the families with chunked local attention layers (Llama 4), checked against the
#: model's own answers (:mod:`kvtier.layers.local`).
CHUNKED_MODEL_TYPES = frozenset({"llama4_text"})

#: Of those, the families with multi-head latent attention (MLA), served with their
#: K and V decompressed per head (see :func:`kvtier.layers.geometry.geometry`).
MLA_MODEL_TYPES = frozenset(
    {"deepseek_v2", "deepseek_v3", "glm4_moe_lite", "kimi_linear", "longcat_flash"}
)

#: Of those, the hybrids whose other layers are short causal convolutions (LFM2), served
#: from each token's convolution input in the blocks (:mod:`kvtier.layers.conv`).
SHORT_CONV_MODEL_TYPES = frozenset({"lfm2", "lfm2_moe"})

#: Known families kvtier does not serve yet, by the attention type that rules them out.
_KNOWN_UNSUPPORTED = {
    (
        "an image-text wrapper (kvtier serves the text model inside it, model_type mistral "
        "or ministral)"
    ): ("mistral3",),
    (
        "Gemma 3's image-text form, where image tokens attend to each other both ways "
        "(kvtier serves the text model, model_type gemma3_text)"
    ): ("gemma3",),
    "layers that reuse other layers' K/V (cross-layer KV sharing)": (
        "gemma3n",
        "gemma3n_text",
    ),
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
    "Instead: serve this model with an engine that implements it (vLLM and SGLang serve "
    "most transformers families), or pick a model of a family kvtier serves exactly "
    f"({len(SUPPORTED_MODEL_TYPES)} of them, listed in docs/models.md)"
)

#: Config features :func:`config_features` names, as a refusal describes them.
FEATURES = {
    "sliding": "sliding-window attention",
    "chunked": "chunked local attention",
    "mla": "multi-head latent attention (MLA)",
    "conv": "short convolution layers",
    "linear": "linear-attention / Mamba layers",
    "softcap": "attention logit soft-capping",
}


@contextmanager
def on_trial(model_type: str) -> Iterator[None]:
    """Admit ``model_type`` whatever its record says, while the conformance sweep tries it.

    Features kvtier does not implement are still refused.
    """
    _ON_TRIAL.add(model_type)
    try:
        yield
    finally:
        _ON_TRIAL.discard(model_type)


def config_features(get: Callable[[str], object]) -> set[str]:
    """The features of :data:`FEATURES` a config switches on (full attention: none)."""
    found: set[str] = set()
    types = get("layer_types")
    names = {str(t) for t in types} if isinstance(types, (list, tuple)) else set()
    if names <= {FULL, SLIDING} and _positive(get("num_hidden_layers")):
        try:
            if attention_spec(get).has_sliding and not _window_covers_context(get):
                found.add("sliding")
        except ConfigError:
            found.add("sliding")  # an unreadable plan: never within an exercised one
    elif names <= {FULL, SLIDING}:
        # No layer count to derive a plan for: any window that can bind counts.
        if (
            _positive(get("sliding_window"))
            and get("use_sliding_window") is not False
            and not _window_covers_context(get)
        ) or SLIDING in names:
            found.add("sliding")
    elif SLIDING in names:
        found.add("sliding")
    if chunked_layers(get)[0] or CHUNKED in names:
        found.add("chunked")
    if _positive(get("kv_lora_rank")):
        found.add("mla")
    if CONV in names or short_conv_layers(get):
        found.add("conv")
    if names & {LINEAR, "mamba", "hybrid"} or any(get(f) is not None for f in _STATE_FIELDS):
        found.add("linear")
    if any(get(f) not in (None, 0, 0.0) for f in _SOFTCAP_FIELDS):
        found.add("softcap")
    return found


_SOFTCAP_FIELDS = ("attn_logit_softcapping", "attention_logit_softcapping")
_STATE_FIELDS = ("layers_block_type", "hybrid_override_pattern", "mamba_d_state")


def _window_covers_context(get: Callable[[str], object]) -> bool:
    """A window at least as long as the context never hides a token."""
    window, positions = get("sliding_window"), get("max_position_embeddings")
    return _positive(window) and _positive(positions) and window >= positions  # type: ignore[operator]


def unsupported_reason(get: Callable[[str], object]) -> str | None:
    """Why kvtier cannot serve this config whatever the sweep found (``None``: it might).

    The attention features kvtier does not implement, by family or by config
    field: what the conformance sweep refuses without running a model.
    """
    model_type = get("model_type")
    name = model_type if isinstance(model_type, str) and model_type else None
    if name is not None and name in _FAMILY_OF:
        return f"uses {_FAMILY_OF[name]}"
    feature = _unsupported_feature(get, name)
    return None if feature is None else f"is configured with {feature}"


def check_supported(get: Callable[[str], object], *, source: str = "the model") -> None:
    """Raise :class:`ConfigError` unless kvtier computes exactly what this model computes.

    ``get`` reads a config field (``None`` when absent), as for
    :func:`kvtier.layers.geometry.geometry`. The check needs ``model_type``; a
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
    if name in _ON_TRIAL:
        return
    entry = _FAMILIES.get(name)
    if entry is None:
        raise ConfigError(
            f"{source} is a {name!r} model, a family kvtier's conformance sweep has not run "
            f"(its record is for transformers {RECORD.get('transformers', '?')}; "
            "`python bench/families.py --write` reruns it on the installed one): refused "
            f"rather than risk wrong answers. {_ADVICE}"
        )
    if entry.get("outcome") != "exact":
        raise ConfigError(
            f"{source} is a {name!r} model, which kvtier does not serve exactly: "
            f"{entry.get('reason') or entry.get('outcome')}. {_ADVICE}"
        )
    missing = sorted(config_features(get) - set(entry.get("features", ())))
    if missing:
        raise ConfigError(
            f"{source} is a {name!r} model configured with "
            f"{' and '.join(FEATURES[m] for m in missing)}, which kvtier's conformance sweep "
            f"has not checked for {name!r} models (it checked "
            f"{', '.join(FEATURES[f] for f in entry.get('features', ())) or 'full attention'}"
            f"): refused rather than risk wrong answers. {_ADVICE}"
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
    if name in SHORT_CONV_MODEL_TYPES:
        conv = _short_conv_feature(get)
        if conv is not None:
            return conv
    layer_types = get("layer_types")
    if isinstance(layer_types, (list, tuple)):
        allowed = {FULL, SLIDING}
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
    plain = not isinstance(layer_types, (list, tuple)) or set(layer_types) <= {FULL, SLIDING}
    if plain and _positive(get("num_hidden_layers")) and name not in STATE_MODEL_TYPES:
        try:
            attention_spec(get)
        except ConfigError as exc:
            return f"an attention plan kvtier cannot read ({exc})"
    if get("alibi") is True:
        # Falcon's ALiBi form: biases built from a per-sequence mask, added in its own code.
        return "ALiBi position biases (alibi is true)"
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
