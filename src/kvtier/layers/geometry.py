"""A KV block's shape for a decoder config: layers, heads, K/V heads and each head's width.

Read from the config's fields alone (a config object, ``config.json`` or GGUF
metadata agree through one getter), so a model's memory can be planned, and
the model refused, before its weights load.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.errors import ConfigError
from kvtier.layers.attention_spec import short_conv_layers


def geometry(get: Callable[[str], object]) -> tuple[int, int, int, int]:
    """``(layers, attention heads, KV heads, head dim)`` from a decoder config's fields.

    ``get`` reads a field (``None`` when absent); shared by config objects,
    ``config.json`` and GGUF metadata so all three agree. The head dim is the
    width of a block's per-head slot: the latent's for MLA, and for a model
    with short convolutions at least what holds ``hidden_size`` values per
    token over K and V.
    """

    def num(name: str) -> int | None:
        value = get(name)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(
                f"model config field {name} must be a positive integer, got {value!r}"
            )
        return value

    layers = num("num_hidden_layers")
    if layers is None and get("model_type") == "longcat_flash":
        # LongCat-Flash's config.json counts its decoder layers, each holding two
        # attention sublayers (two caches); transformers derives num_hidden_layers.
        decoder_layers = num("num_layers")
        layers = None if decoder_layers is None else 2 * decoder_layers
    heads = num("num_attention_heads")
    hidden = num("hidden_size")
    if layers is None or heads is None:
        raise ConfigError(
            "the model config lacks num_hidden_layers / num_attention_heads: "
            "kvtier serves decoder-only transformers"
        )
    kv_heads = num("num_key_value_heads") or heads
    if get("multi_query") is True and not get("new_decoder_architecture"):
        # Multi-query attention (GPT-BigCode / StarCoder 1): one K/V head for every query
        # head, whatever num_key_value_heads says (the model reads only multi_query).
        kv_heads = 1
    head_dim = num("head_dim")
    if get("kv_lora_rank") is not None:
        # Multi-head latent attention: a block holds each token's compressed latent as one
        # "head" of K and its shared rotary key as V, both kv_lora_rank wide (the model
        # decompresses them per head as it attends), as transformers' own cache does.
        rank, rope = num("kv_lora_rank"), num("qk_rope_head_dim")
        if rank is None or rope is None:
            raise ConfigError("an MLA config needs kv_lora_rank and qk_rope_head_dim")
        return layers, heads, 1, max(rank, rope)
    if head_dim is None:
        if hidden is None:
            raise ConfigError("the model config has neither head_dim nor hidden_size")
        head_dim = hidden // heads
    if short_conv_layers(get):
        # A short-convolution layer (LFM2) stores each token's hidden_size conv input
        # split over its K and V slots, so a slot must hold hidden_size values: the
        # head width grows to fit, and attention layers zero-pad their K/V to it.
        if hidden is None:
            raise ConfigError("a config with convolution layers needs hidden_size")
        head_dim = max(head_dim, -(-hidden // (2 * kv_heads)))
    return layers, heads, kv_heads, head_dim
