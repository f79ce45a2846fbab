"""Which layers of a model attend to the whole past and which to a sliding window.

Models such as Gemma 3 interleave *sliding* layers, whose query at position
``p`` sees only the keys at positions ``p - window < k <= p``, with *full*
layers that see every earlier key. :func:`attention_spec` reads that plan
from config fields alone (``layer_types``, ``sliding_window``, the older
``sliding_window_pattern``, Qwen's ``use_sliding_window`` and
``max_window_layers``), the way transformers' own config classes derive
it, so a check before any weight is read and the attention at run time agree.

The paged attention (:mod:`kvtier.engine.paged`) applies a layer's window
with :func:`first_visible`; :meth:`AttentionSpec.kv_tokens` says how many
tokens of K/V each layer can still read at a given context length, which
is what bounds the KV a sliding layer needs. :func:`short_conv_layers`
names the layers of a hybrid (LFM2) that are short convolutions rather
than attention (:mod:`kvtier.layers.conv`); :func:`chunked_layers`
the chunked local layers of Llama 4 (:mod:`kvtier.layers.local`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"
#: A short causal convolution layer (LFM2), whose state is its last few tokens' features.
CONV = "conv"
#: A chunked local attention layer (Llama 4): a query sees its own chunk of positions.
CHUNKED = "chunked_attention"

#: Gemma 3's interleave when a config names neither ``layer_types`` nor a
#: pattern: five sliding layers, then one full layer.
_GEMMA3_PATTERN = 6


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Per layer: ``None`` for full causal attention, else the sliding window in tokens."""

    windows: tuple[int | None, ...]

    def __post_init__(self) -> None:
        for i, w in enumerate(self.windows):
            if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
                raise ConfigError(
                    f"layer {i}'s sliding window must be a positive integer, got {w!r}"
                )

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, w in enumerate(self.windows) if w is not None)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, w in enumerate(self.windows) if w is None)

    @property
    def has_sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    @property
    def max_window(self) -> int | None:
        """The widest sliding window (``None``: no sliding layer)."""
        sliding = [w for w in self.windows if w is not None]
        return max(sliding) if sliding else None

    def kv_tokens(self, context: int) -> int:
        """Tokens of K/V, summed over layers, that a query at position ``context - 1`` reads.

        A full layer reads all ``context`` tokens; a sliding layer at most its window.
        """
        return sum(context if w is None else min(w, context) for w in self.windows)


def first_visible(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` attends to (``window`` None: 0)."""
    return 0 if window is None else max(0, position - window + 1)


def attention_spec(get: Callable[[str], object]) -> AttentionSpec:
    """The per-layer attention plan of a decoder config (``get`` reads a field, ``None`` if absent).

    Raises :class:`ConfigError` for a layer type that is neither full nor
    sliding attention, or a sliding layer without a positive ``sliding_window``.
    """
    layers = get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
        raise ConfigError(
            f"the model config's num_hidden_layers must be a positive integer, got {layers!r}"
        )
    window = get("sliding_window")
    if get("use_sliding_window") is False:
        # Qwen2/Qwen3 drop the window when it is switched off, whatever layer_types says.
        window = None
    types = _layer_types(get, layers, window)
    odd = sorted({str(t) for t in types if t not in (FULL, SLIDING)})
    if odd:
        raise ConfigError(
            f"layer_types has {', '.join(odd)}: only {FULL} and {SLIDING} layers have "
            "a per-layer K/V kvtier can serve"
        )
    if len(types) != layers:
        raise ConfigError(
            f"layer_types names {len(types)} layers but num_hidden_layers is {layers}: "
            "make them agree"
        )
    if SLIDING not in types:
        return AttentionSpec((None,) * layers)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ConfigError(
            f"layer_types has {SLIDING} layers but sliding_window is {window!r}"
            + (" and use_sliding_window is false" if get("use_sliding_window") is False else "")
            + ": set sliding_window to the window in tokens"
        )
    return AttentionSpec(tuple(window if t == SLIDING else None for t in types))


def short_conv_layers(get: Callable[[str], object]) -> tuple[int, ...]:
    """The layers that are short causal convolutions rather than attention (LFM2).

    LFM2 configs name them in ``layer_types`` (``"conv"``) or, in older files,
    list the attention layers in ``full_attn_idxs`` (every other layer is a
    convolution), as transformers' ``Lfm2Config`` reads them.
    """
    types = get("layer_types")
    if isinstance(types, (list, tuple)):
        return tuple(i for i, t in enumerate(types) if t == CONV)
    layers, attention = get("num_hidden_layers"), get("full_attn_idxs")
    if isinstance(layers, int) and layers > 0 and isinstance(attention, (list, tuple)):
        return tuple(i for i in range(layers) if i not in attention)
    return ()


def chunked_layers(get: Callable[[str], object]) -> tuple[tuple[int, ...], int | None]:
    """The chunked local layers of a config and their chunk size (``((), None)``: none).

    ``layer_types`` names them; a Llama 4 config without it makes every layer
    that uses rotary embeddings (``no_rope_layers`` 1) chunked when
    ``attention_chunk_size`` is set, as transformers' ``Llama4TextConfig`` does.
    """
    chunk = get("attention_chunk_size")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        return (), None
    types = get("layer_types")
    if not isinstance(types, (list, tuple)):
        rope = get("no_rope_layers")
        layers = get("num_hidden_layers")
        if not isinstance(rope, (list, tuple)):
            interval = get("no_rope_layer_interval")
            step = interval if isinstance(interval, int) and interval > 0 else 4
            count = layers if isinstance(layers, int) else 0
            rope = [int((i + 1) % step != 0) for i in range(count)]
        types = [CHUNKED if r else "full_attention" for r in rope]
    return tuple(i for i, t in enumerate(types) if t == CHUNKED), chunk


def _layer_types(get: Callable[[str], object], layers: int, window: object) -> list[object]:
    """``layer_types`` as transformers' config classes fill it in when a config omits it."""
    types = get("layer_types")
    if isinstance(types, (list, tuple)):
        return list(types)
    if not _positive(window):
        return [FULL] * layers
    pattern = get("sliding_window_pattern")
    if not _positive(pattern) and get("model_type") == "gemma3_text":
        pattern = _GEMMA3_PATTERN
    if isinstance(pattern, int) and pattern > 0:
        # Every pattern-th layer is full, the others slide (Gemma 2/3's interleave).
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    if get("use_sliding_window") is True:
        # Qwen2/Qwen3: layers from max_window_layers on slide (transformers' rule).
        first = get("max_window_layers")
        start = first if isinstance(first, int) and not isinstance(first, bool) else 0
        return [SLIDING if i >= start else FULL for i in range(layers)]
    # Mistral: a sliding_window applies to every layer.
    return [SLIDING] * layers


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
