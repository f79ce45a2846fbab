"""The token encoder in both forms: the C extension and the pure-Python module.

Every form must give ``array("I", ids[start:stop])``'s little-endian bytes and
refuse exactly what it refuses, with the same exception type: block keys hash
these bytes, so a form that encoded one id differently would change keys.
The C form is tested wherever it is built (next to the ``.py``), whichever
form the rest of the suite imports.
"""

from __future__ import annotations

import importlib.util
from array import array
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier

SOURCE = Path(kvtier.__file__).with_name("_tokpack.py")


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier._tokpack", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FORMS = [_load(SOURCE), *(_load(so) for so in sorted(SOURCE.parent.glob("_tokpack.*.so")))]
IDS = [f"{'C' if Path(m.__file__ or '').suffix == '.so' else 'python'}" for m in FORMS]


class Index:
    """Not an int, but an integer by ``__index__`` (as numpy's are)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def _reference(ids: Any, start: int, stop: int) -> tuple[str, bytes]:
    try:
        arr = array("I", ids[start:stop])
    except (OverflowError, TypeError) as exc:
        return type(exc).__name__, b""
    return "ok", arr.tobytes() if arr.itemsize == 4 else b""


def _run(form: ModuleType, ids: Any, start: int, stop: int) -> tuple[str, bytes]:
    try:
        return "ok", form.pack_u32(ids, start, stop)
    except (OverflowError, TypeError) as exc:
        return type(exc).__name__, b""


items = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.integers(-3, 2**32 + 3).map(Index),
    st.sampled_from([1.0, None, "7"]),
)


@pytest.mark.parametrize("form", FORMS, ids=IDS)
@settings(max_examples=300, deadline=None)
@given(ids=st.lists(items, max_size=12), data=st.data(), as_tuple=st.booleans())
def test_matches_array(
    form: ModuleType, ids: list[Any], data: st.DataObject, as_tuple: bool
) -> None:
    stop = data.draw(st.integers(0, len(ids)), label="stop")
    start = data.draw(st.integers(0, stop), label="start")
    seq = tuple(ids) if as_tuple else ids
    assert _run(form, seq, start, stop) == _reference(seq, start, stop)


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_other_sequences_and_byte_order(form: ModuleType) -> None:
    assert form.pack_u32([1, 2**32 - 1], 0, 2) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    for seq in (array("I", [5, 6, 7]), np.array([5, 6, 7]), range(5, 8)):
        assert form.pack_u32(seq, 1, 3) == array("I", [6, 7]).tobytes()
    for start, stop in ((-1, 2), (2, 1), (0, 4)):
        with pytest.raises(IndexError):
            form.pack_u32([1, 2, 3], start, stop)


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_a_long_prompt_whose_tail_holds_a_bad_id(form: ModuleType) -> None:
    """Only ``[start, stop)`` is read: an id after ``stop`` never raises."""
    ids = [*range(1000), -1]
    assert form.pack_u32(ids, 0, 1000) == array("I", range(1000)).tobytes()
    with pytest.raises(OverflowError):
        form.pack_u32(ids, 0, 1001)
