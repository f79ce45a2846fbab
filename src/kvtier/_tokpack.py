"""Token ids to little-endian uint32 bytes: the one per-token pass of hashing and storing.

Block keys hash the tokens' uint32 encoding, and a request keeps its partial
tail as uint32 too, so every token a request brings is converted once. This
is the pure-Python form; ``_tokpack.c`` builds a C extension of the same
name and behaviour that reads a list's or tuple's ints in place (no slice,
no per-item reference counting), which the import prefers when it is built.

Both accept exactly what ``array("I", ...)`` accepts (ints and objects with
``__index__`` in ``[0, 2**32)``) and raise what it raises: ``OverflowError``
for an id out of range, ``TypeError`` for one that is not an integer.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence


def pack_u32(token_ids: Sequence[int], start: int, stop: int) -> bytes:
    """``token_ids[start:stop]`` as little-endian uint32 bytes (``0 <= start <= stop <= len``)."""
    n = len(token_ids)
    if not 0 <= start <= stop <= n:
        raise IndexError("pack_u32 needs 0 <= start <= stop <= len")
    if start == 0 and stop < n:
        # A long prompt's full blocks: one pass over the whole sequence, with
        # no copy of its list, and the partial tail cut after; the slice is
        # converted only when that fails, so an id past ``stop`` never raises.
        try:
            arr = array("I", token_ids)
        except (OverflowError, TypeError):
            arr = array("I", token_ids[:stop])
        else:
            del arr[stop:]
    else:
        arr = array("I", token_ids if stop - start == n else token_ids[start:stop])
    if sys.byteorder == "big":  # pragma: no cover - exercised only on big-endian hosts
        arr.byteswap()
    return arr.tobytes()
