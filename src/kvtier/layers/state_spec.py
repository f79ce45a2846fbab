"""The recurrent state of a hybrid model's linear-attention and Mamba layers, from its config.

Qwen3-Next's and Qwen3.5's gated delta-net layers, the Mamba-2 layers of
Bamba, Granite 4 hybrids and Nemotron-H, and Jamba's Mamba-1 layers keep no
K/V per token. Each carries, per sequence, a fixed-size state: the last
``kernel`` inputs of a causal depthwise convolution (``channels x kernel``,
in the model's dtype) and a recurrent state (float32, as transformers keeps
it: a matrix per head, or Mamba-1's ``d_state`` values per channel). The
output at position ``p`` depends on the whole prefix only through that
state, so resuming a sequence at ``p`` needs the state exactly as it was
after token ``p - 1``.

kvtier keeps such a state in its blocks (:mod:`kvtier.layers.state`):
a state layer's part of a block holds the layer's state after the block's
last token. :func:`state_spec` says which layers those are and how many
bytes one state takes, from config fields alone, so a server sizes its
blocks before any weight is read; :func:`slot_width` is the head width a
block's slots need so that one layer's part of a block holds a state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import ConfigError

#: The ``layer_types`` value of a layer that carries a recurrent state.
LINEAR = "linear_attention"

#: Families whose state layers kvtier keeps in its blocks, by ``model_type``.
STATE_MODEL_TYPES = frozenset(
    {
        "qwen3_next",
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "bamba",
        "granitemoehybrid",
        "nemotron_h",
        "jamba",
        "falcon_h1",
        "kimi_linear",
    }
)

#: Of those, the gated delta-net families (Qwen3-Next, Qwen3.5); the others are Mamba.
_DELTA_NET_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})


def _kimi_field(get: Callable[[str], object], name: str, nested: str, default: int) -> object:
    """A Kimi Linear field, flat (a saved config) or in its checkpoint's ``linear_attn_config``."""
    value = get(name)
    sub = get("linear_attn_config")
    if value is None and isinstance(sub, dict):
        value = sub.get(nested)
    return default if value is None else value

#: The recurrent state is float32 whatever the model's dtype (transformers keeps it so).
RECURRENT_ITEMSIZE = 4


@dataclass(frozen=True)
class StateSpec:
    """One state layer's state, the same for every state layer of a model."""

    #: The layers that carry a state instead of per-token K/V.
    layers: tuple[int, ...]
    #: The convolution's input channels and the columns of it kept (transformers keeps ``kernel``).
    conv_channels: int
    conv_kernel: int
    #: The recurrent state's shape per sequence (heads and the per-head matrix, or Mamba-1's
    #: channels x state size).
    recurrent_shape: tuple[int, ...]
    #: Whether each state layer also has attention (Falcon-H1 runs both side by side in every
    #: layer): its share of a block then keeps K/V in the first ``head_dim`` columns of each
    #: slot and the state in the columns after them.
    beside_attention: bool = False
    #: Whether the layer's multi-token form starts from a given state. Jamba's Mamba-1
    #: mixer starts every multi-token run from zero (transformers only ever runs a whole
    #: prompt that way), so a run that goes on from a state steps one token at a time.
    resumable_runs: bool = True

    @property
    def recurrent_bytes(self) -> int:
        return math.prod(self.recurrent_shape) * RECURRENT_ITEMSIZE

    def conv_bytes(self, itemsize: int) -> int:
        return self.conv_channels * self.conv_kernel * itemsize

    def nbytes(self, itemsize: int) -> int:
        """Bytes of one layer's state for a model computing in ``itemsize``-byte floats."""
        return self.recurrent_bytes + self.conv_bytes(itemsize)


def _int(get: Callable[[str], object], name: str, default: int | None = None) -> int:
    value = get(name)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"model config field {name} must be a positive integer, got {value!r}")
    return value


def state_layers(get: Callable[[str], object]) -> tuple[int, ...]:
    """The layers of a hybrid config that carry a recurrent state (empty for other models)."""
    model_type = get("model_type")
    if model_type not in STATE_MODEL_TYPES:
        return ()
    types = get("layer_types")
    if types is None and model_type == "nemotron_h":
        types = _nemotron_types(get)
    if get("num_hidden_layers") is None and isinstance(types, (list, tuple)):
        layers = len(types)  # Nemotron-H saves no count beside its layer plan
    else:
        layers = _int(get, "num_hidden_layers")
    if types is None and model_type == "bamba":
        # Bamba names its attention layers; every other layer is Mamba-2.
        attn = get("attn_layer_indices") or []
        if not isinstance(attn, (list, tuple)):
            raise ConfigError(f"attn_layer_indices must be a list, got {attn!r}")
        types = ["full_attention" if i in attn else LINEAR for i in range(layers)]
    if types is None and model_type == "jamba":
        # One attention layer in every attn_layer_period, at attn_layer_offset; Mamba-1 elsewhere.
        period = _int(get, "attn_layer_period", 8)
        offset = get("attn_layer_offset")
        at = offset if isinstance(offset, int) else 4
        types = ["full_attention" if i % period == at else LINEAR for i in range(layers)]
    if model_type == "falcon_h1":
        types = [LINEAR] * layers  # attention and a Mamba-2 mixer in every layer
    if types is None and model_type == "kimi_linear":
        sub = get("linear_attn_config")
        if isinstance(sub, dict) and "kda_layers" in sub:
            kda = set(sub["kda_layers"])  # 1-indexed in the checkpoint
            types = [LINEAR if i + 1 in kda else "full_attention" for i in range(layers)]
        else:
            types = [LINEAR if not (i and i % 4 == 0) else "full_attention" for i in range(layers)]
    if types is None and model_type == "granitemoehybrid":
        types = [LINEAR] * layers  # transformers' default for Granite 4 hybrids
    if types is None and model_type in _DELTA_NET_TYPES:
        interval = _int(get, "full_attention_interval", 4)
        types = [LINEAR if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(types, (list, tuple)) or len(types) != layers:
        raise ConfigError(
            f"layer_types must name each of the {layers} layers, got {types!r}: fix config.json"
        )
    return tuple(i for i, t in enumerate(types) if t == LINEAR)


#: Nemotron-H's older layer names and pattern letters, as transformers maps them.
_NEMOTRON_NAMES = {
    "mamba": LINEAR,
    "attention": "full_attention",
    "M": LINEAR,
    "*": "full_attention",
}


def _nemotron_types(get: Callable[[str], object]) -> list[object] | None:
    """Nemotron-H's layer kinds from ``layers_block_type`` or ``hybrid_override_pattern``."""
    types = get("layers_block_type")
    if isinstance(types, (list, tuple)):
        return [_NEMOTRON_NAMES.get(str(t), t) for t in types]
    pattern = get("hybrid_override_pattern")
    if isinstance(pattern, str):
        # M: Mamba-2, *: attention, -: MLP, E: experts (the last two cache nothing).
        return [_NEMOTRON_NAMES.get(c, "mlp") for c in pattern]
    return None


def state_spec(get: Callable[[str], object]) -> StateSpec | None:
    """A hybrid model's per-layer state, from its config; ``None`` for a model without one."""
    layers = state_layers(get)
    if not layers:
        return None
    if get("model_type") == "kimi_linear":
        heads = _kimi_field(get, "linear_num_heads", "num_heads", 32)
        head_dim = _kimi_field(get, "linear_head_dim", "head_dim", 128)
        kernel = _kimi_field(get, "linear_conv_kernel_dim", "short_conv_kernel_size", 4)
        if not all(isinstance(v, int) and v > 0 for v in (heads, head_dim, kernel)):
            raise ConfigError(
                f"Kimi Linear's linear attention needs positive integer heads ({heads!r}), "
                f"head_dim ({head_dim!r}) and conv kernel ({kernel!r}): fix config.json"
            )
        assert isinstance(heads, int) and isinstance(head_dim, int) and isinstance(kernel, int)
        return StateSpec(
            layers,
            conv_channels=3 * heads * head_dim,
            conv_kernel=kernel,
            recurrent_shape=(heads, head_dim, head_dim),
        )
    if get("model_type") in _DELTA_NET_TYPES:
        k_heads = _int(get, "linear_num_key_heads")
        v_heads = _int(get, "linear_num_value_heads")
        k_dim = _int(get, "linear_key_head_dim")
        v_dim = _int(get, "linear_value_head_dim")
        return StateSpec(
            layers,
            conv_channels=2 * k_heads * k_dim + v_heads * v_dim,
            conv_kernel=_int(get, "linear_conv_kernel_dim"),
            recurrent_shape=(v_heads, k_dim, v_dim),
        )
    if get("model_type") == "nemotron_h":
        heads, head_dim = _int(get, "mamba_num_heads"), _int(get, "mamba_head_dim")
        d_state = _int(get, "ssm_state_size")
        cache_dtype = get("mamba_ssm_cache_dtype")
        if cache_dtype not in (None, "float32"):
            raise ConfigError(
                f"mamba_ssm_cache_dtype={cache_dtype!r}: kvtier keeps Mamba states in float32, "
                "as transformers does by default; set it to float32"
            )
        return StateSpec(
            layers,
            conv_channels=heads * head_dim + 2 * _int(get, "n_groups") * d_state,
            conv_kernel=_int(get, "conv_kernel"),
            recurrent_shape=(heads, head_dim, d_state),
        )
    if get("model_type") == "jamba":
        # Mamba-1: a state of d_state values for each of expand x hidden channels.
        channels = _int(get, "mamba_expand") * _int(get, "hidden_size")
        return StateSpec(
            layers,
            conv_channels=channels,
            conv_kernel=_int(get, "mamba_d_conv"),
            recurrent_shape=(channels, _int(get, "mamba_d_state")),
            resumable_runs=False,
        )
    hidden = _int(get, "hidden_size")
    heads = _int(get, "mamba_n_heads")
    if get("model_type") == "falcon_h1":
        inner = get("mamba_d_ssm") or _int(get, "mamba_expand") * hidden
        d_state = _int(get, "mamba_d_state")
        if not isinstance(inner, int) or inner % heads:
            raise ConfigError(f"mamba_d_ssm={inner!r} must be a multiple of mamba_n_heads")
        return StateSpec(
            layers,
            conv_channels=inner + 2 * _int(get, "mamba_n_groups") * d_state,
            conv_kernel=_int(get, "mamba_d_conv"),
            recurrent_shape=(heads, inner // heads, d_state),
            beside_attention=True,
        )
    expand = _int(get, "mamba_expand")
    d_state = _int(get, "mamba_d_state")
    given = get("mamba_d_head")
    d_head = expand * hidden // heads if given in (None, "auto") else given
    if not isinstance(d_head, int) or d_head * heads != expand * hidden:
        raise ConfigError(
            f"mamba_d_head={d_head!r} x mamba_n_heads={heads} must equal "
            f"mamba_expand x hidden_size = {expand * hidden}: fix config.json"
        )
    return StateSpec(
        layers,
        conv_channels=expand * hidden + 2 * _int(get, "mamba_n_groups") * d_state,
        conv_kernel=_int(get, "mamba_d_conv"),
        recurrent_shape=(heads, d_head, d_state),
    )


def slot_width(
    spec: StateSpec, head_dim: int, kv_heads: int, block_size: int, itemsize: int
) -> int:
    """The per-head slot width at which one layer's part of a block holds ``spec``'s state.

    A layer's part of a block is ``2 x block_size x kv_heads x width`` values
    (K and V); never narrower than the attention layers' own ``head_dim``, and
    ``head_dim`` wider when the state shares its layer with attention.
    Larger blocks need less widening: a block size at which the attention
    layers' part already holds a state wastes nothing.
    """
    per_width = 2 * block_size * kv_heads * itemsize
    state_width = -(-spec.nbytes(itemsize) // per_width)
    if spec.beside_attention:
        return head_dim + state_width  # K/V first, then the state
    return max(head_dim, state_width)


def state_block_size(
    spec: StateSpec, head_dim: int, kv_heads: int, itemsize: int, multiple: int = 16
) -> int:
    """The smallest block size (a multiple of ``multiple``) whose parts hold a state unwidened.

    At that size a block's share of an attention layer and of a state layer
    take the same bytes, so nothing is padded (vLLM sizes its attention
    blocks for hybrid models the same way). When states share their layers
    with attention, it is the size at which a state takes no more room than
    the layer's K/V of the block's tokens.
    """
    per_token = 2 * kv_heads * head_dim * itemsize
    tokens = -(-spec.nbytes(itemsize) // per_token)
    return max(multiple, -(-tokens // multiple) * multiple)
