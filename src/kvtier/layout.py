"""The shape of a KV block: what one cached block holds and how big it is.

A layout names the model's KV geometry (layers, KV heads, head size, dtype)
and the block size in tokens. It is part of a block key's namespace, so two
engines only share blocks when their layouts match, and it sizes the block
payloads of every storage tier.

A *scaled* layout holds quantized blocks: int8 or float8 e4m3 elements plus
one float32 scale per (layer, K/V, KV head) of each block, stored with it
(the payload of the int8 and fp8 offload codecs). :func:`cache_layout` turns a
model's layout into the one a ``--kv-cache-dtype`` stores.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtier.errors import ConfigError

#: Bytes per element of the dtypes a KV cache is stored in.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "int8": 1,
}

#: Element dtypes a scaled (quantized) layout may hold.
SCALED_DTYPES: tuple[str, ...] = ("int8", "float8_e4m3fn")
#: Bytes of one per-head scale of a scaled layout (float32).
SCALE_BYTES = 4

#: What ``--kv-cache-dtype`` takes, and the layout dtype each stores (``auto``: the model's).
KV_CACHE_DTYPES: dict[str, tuple[str, bool] | None] = {
    "auto": None,
    "float32": ("float32", False),
    "bfloat16": ("bfloat16", False),
    "float16": ("float16", False),
    "int8": ("int8", True),
    "fp8_e4m3": ("float8_e4m3fn", True),
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``: ``cdiv(0, b) == 0``."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of one KV block.

    ``num_kv_heads`` is the number of *key/value* heads (grouped-query attention
    has fewer of them than query heads); sizing by query heads overstates memory.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float16"
    #: Quantized blocks: ``dtype`` elements plus one float32 scale per
    #: (layer, K/V, KV head) of each block (``dtype`` int8 or float8_e4m3fn).
    scaled: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"KVLayout.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}"
            )
        if not isinstance(self.scaled, bool):
            raise ConfigError(f"KVLayout.scaled must be a bool, got {self.scaled!r}")
        if self.scaled and self.dtype not in SCALED_DTYPES:
            raise ConfigError(
                f"a scaled KVLayout holds {' or '.join(SCALED_DTYPES)} elements, "
                f"not {self.dtype!r}"
            )

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token (a scaled block's scales not included)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def scale_bytes_per_block(self) -> int:
        """Bytes of one block's scales: ``4 * 2 * layers * kv_heads`` when scaled, else 0."""
        return SCALE_BYTES * 2 * self.num_layers * self.num_kv_heads if self.scaled else 0

    @property
    def bytes_per_block(self) -> int:
        """One block's payload: its elements, and its scales when scaled."""
        return self.bytes_per_token * self.block_size + self.scale_bytes_per_block

    def canonical(self) -> str:
        """A stable text form, used in block-key namespaces."""
        return (
            f"L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}"
            f"/B{self.block_size}/{self.dtype}" + ("+head_scales" if self.scaled else "")
        )


def cache_layout(layout: KVLayout, kv_cache_dtype: str) -> KVLayout:
    """The layout device blocks take when the model's ``layout`` is stored as ``kv_cache_dtype``.

    ``auto`` keeps the model's dtype; ``bfloat16``/``float16``/``float32`` store
    that float dtype; ``int8`` and ``fp8_e4m3`` store scaled (quantized) blocks.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    stored = KV_CACHE_DTYPES[kv_cache_dtype]
    if stored is None:
        return layout
    dtype, scaled = stored
    return replace(layout, dtype=dtype, scaled=scaled)
