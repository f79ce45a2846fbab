"""The shape of a KV block: what one cached block holds and how big it is.

A layout names the model's KV geometry (layers, KV heads, head size, dtype)
and the block size in tokens. It is part of a block key's namespace, so two
engines only share blocks when their layouts match, and it sizes the block
payloads of every storage tier.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError

#: Bytes per element of the dtypes a KV cache is stored in.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "int8": 1,
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

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"KVLayout.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}"
            )

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def canonical(self) -> str:
        """A stable text form, used in block-key namespaces."""
        return (
            f"L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}"
            f"/B{self.block_size}/{self.dtype}"
        )
