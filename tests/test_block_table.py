"""Block tables: ceil-division block math and slot mapping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import BadRequestError, BlockTable, ConfigError, blocks_needed, cdiv


@pytest.mark.parametrize(
    ("tokens", "block_size", "blocks"),
    [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3),
     (0, 1, 0), (5, 1, 5)],
)
def test_blocks_needed_edges(tokens: int, block_size: int, blocks: int) -> None:
    assert blocks_needed(tokens, block_size) == blocks


@given(st.integers(0, 10**6), st.integers(1, 1024))
def test_cdiv_matches_definition(a: int, b: int) -> None:
    n = cdiv(a, b)
    assert (n * b >= a and (n - 1) * b < a) or (a == 0 and n == 0)


def test_blocks_needed_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        blocks_needed(3, 0)
    with pytest.raises(BadRequestError):
        blocks_needed(-1, 4)
    with pytest.raises(ConfigError):
        BlockTable(0)


def test_slot_mapping() -> None:
    table = BlockTable(4, [7, 2, 5], num_tokens=10)
    assert table.capacity == 12 and table.free_slots == 2
    assert table.slot(0) == 28
    assert table.slot(3) == 31
    assert table.slot(4) == 8
    assert table.slot(11) == 23
    assert table.slot_mapping(2, 6) == [30, 31, 8, 9]
    assert table.slot_mapping(5, 5) == []
    assert table.physical_block(2) == 5
    with pytest.raises(BadRequestError):
        table.slot(12)
    with pytest.raises(BadRequestError):
        table.slot(-1)
    with pytest.raises(BadRequestError):
        table.slot_mapping(4, 13)
    with pytest.raises(BadRequestError):
        table.physical_block(3)


def test_copy_is_independent() -> None:
    table = BlockTable(4, [1, 2], num_tokens=5)
    other = table.copy()
    other.blocks.append(9)
    assert table.blocks == [1, 2] and table != other
    assert table == BlockTable(4, [1, 2], 5)
