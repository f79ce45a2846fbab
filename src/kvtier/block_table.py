"""Block tables: a request's logical blocks mapped to physical pool blocks.

Logical block ``i`` covers token positions ``[i * block_size, (i+1) * block_size)``
and lives in physical block ``blocks[i]``; a token's *slot* is its flat index
in the pool, ``blocks[pos // block_size] * block_size + pos % block_size``,
which is what attention kernels write keys and values to.
"""

from __future__ import annotations

from kvtier.errors import BadRequestError, ConfigError
from kvtier.layout import cdiv


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: 0 for 0, exact at multiples, +1 past them."""
    if block_size <= 0:
        raise ConfigError(f"block_size must be positive, got {block_size}")
    if num_tokens < 0:
        raise BadRequestError(f"token count must be non-negative, got {num_tokens}")
    return cdiv(num_tokens, block_size)


class BlockTable:
    """One request's logical -> physical block map and its token count."""

    __slots__ = ("block_size", "blocks", "num_tokens")

    def __init__(self, block_size: int, blocks: list[int] | None = None, num_tokens: int = 0):
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.blocks: list[int] = blocks if blocks is not None else []
        self.num_tokens = num_tokens

    def __len__(self) -> int:
        return len(self.blocks)

    def __repr__(self) -> str:
        return f"BlockTable(blocks={self.blocks}, num_tokens={self.num_tokens})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockTable):
            return NotImplemented
        return (self.block_size, self.blocks, self.num_tokens) == (
            other.block_size,
            other.blocks,
            other.num_tokens,
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def capacity(self) -> int:
        """Tokens the table's blocks can hold."""
        return len(self.blocks) * self.block_size

    @property
    def free_slots(self) -> int:
        """Unused token slots in the last block (never negative)."""
        return max(self.capacity - self.num_tokens, 0)

    def physical_block(self, logical: int) -> int:
        if not 0 <= logical < len(self.blocks):
            raise BadRequestError(
                f"logical block {logical} is outside this table's {len(self.blocks)} blocks"
            )
        return self.blocks[logical]

    def slot(self, position: int) -> int:
        """Flat slot of token ``position`` (must be within the table's capacity)."""
        if not 0 <= position < self.capacity:
            raise BadRequestError(
                f"token position {position} is outside this table's capacity {self.capacity}"
            )
        bs = self.block_size
        return self.blocks[position // bs] * bs + position % bs

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Slots of positions ``[start, end)``, e.g. the tokens one forward pass writes."""
        if not 0 <= start <= end <= self.capacity:
            raise BadRequestError(
                f"slot range [{start}, {end}) is outside this table's capacity {self.capacity}"
            )
        bs = self.block_size
        blocks = self.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def copy(self) -> BlockTable:
        return BlockTable(self.block_size, list(self.blocks), self.num_tokens)
