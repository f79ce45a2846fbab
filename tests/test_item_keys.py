"""Per-item extra keys in block keys: the manager keys blocks with images as the hasher does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import BadRequestError
from kvtier.keys import item_block_extra
from kvtier.manager import KVCacheManager

BS = 4


def expected(tokens: list[int], items: list[tuple[int, int]], m: KVCacheManager) -> list[int]:
    n = len(tokens) // BS
    return m.hasher.chain(tokens, block_extra=item_block_extra(sorted(items), 0, n, BS))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=40),
    st.lists(
        st.tuples(st.integers(0, 39), st.integers(1, 2**128 - 1)),
        max_size=3,
        unique_by=lambda item: item[0],
    ),
    st.integers(1, 40),
)
def test_keys_of_blocks_filled_later_carry_the_items(
    tokens: list[int], items: list[tuple[int, int]], cut: int
) -> None:
    m = KVCacheManager(num_blocks=64, block_size=BS)
    cut = min(cut, len(tokens))
    m.allocate("r", tokens[:cut], item_keys=items)
    if cut < len(tokens):
        m.extend("r", tokens[cut:])
    assert m.block_keys("r") == expected(tokens, items, m)
    m.check()


def test_an_item_changes_keys_from_its_block_on_only() -> None:
    m = KVCacheManager(num_blocks=64, block_size=BS)
    tokens = list(range(20))
    plain = m.hasher.chain(tokens)
    a = expected(tokens, [(9, 111)], m)
    b = expected(tokens, [(9, 222)], m)
    assert a[:2] == b[:2] == plain[:2]  # blocks 0 and 1 end before position 9
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    # A request with the same image reuses every block; one with another image only the text.
    m.allocate("a", [*tokens, 0], item_keys=[(9, 111)])
    m.free("a")
    assert m.allocate("a2", [*tokens, 0], item_keys=[(9, 111)]).num_cached_tokens == 20
    assert m.allocate("b", [*tokens, 0], item_keys=[(9, 222)]).num_cached_tokens == 8


def test_malformed_item_keys_are_refused() -> None:
    m = KVCacheManager(num_blocks=8, block_size=BS)
    with pytest.raises(BadRequestError, match="position"):
        m.allocate("r", [1, 2, 3], item_keys=[(-1, 5)])
    with pytest.raises(BadRequestError, match="two items start at position 2"):
        m.allocate("r", [1, 2, 3], item_keys=[(2, 5), (2, 6)])
    with pytest.raises(BadRequestError, match="pairs"):
        m.allocate("r", [1, 2, 3], item_keys=[(1, 2, 3)])  # type: ignore[list-item]
