"""The scalar metadata of a GGUF file, read in milliseconds.

Loading a GGUF model through transformers (or ``gguf.GGUFReader``) parses
every tensor and tokenizer entry, seconds of work before a server can tell
that its KV cache is too small for the model. The header alone says the
geometry: this reader walks the key/value section, keeps the scalars and
strings, and skips arrays (the vocabulary) without decoding them. The
tensor table that follows it gives each tensor's shape, so the weights'
size is known before any of them is read.

Loading the model itself still goes through transformers, which parses the
whole file once for the config, once for the tokenizer and once for the
weights, and builds gguf's tensor-name map once per module; on SmolLM2 that
was 40 of the 45 seconds a load took. :func:`gguf_parsed_once` makes a load
parse each file once, decode its metadata (the vocabulary included) once and
build each map once.
"""

from __future__ import annotations

import copy
import functools
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from kvtier.errors import ConfigError

_MAGIC = b"GGUF"
# GGUF value type -> struct format of a scalar of that type.
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING = 8
_ARRAY = 9

Meta = dict[str, "int | float | bool | str"]


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[object, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ConfigError("truncated GGUF header")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def u32(self) -> int:
        (v,) = self.unpack("<I")
        assert isinstance(v, int)
        return v

    def u64(self) -> int:
        (v,) = self.unpack("<Q")
        assert isinstance(v, int)
        return v

    def string(self) -> str:
        n = self.u64()
        if self.pos + n > len(self.buf):
            raise ConfigError("truncated GGUF string")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.u64()  # read first: it moves pos
        self.pos += n

    def value(self, kind: int) -> int | float | bool | str | None:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem = self.u32()
            count = self.u64()
            if elem == _STRING:
                for _ in range(count):
                    self.skip_string()
            elif elem in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[elem])
            else:
                for _ in range(count):
                    self.value(elem)
            return None
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ConfigError(f"unknown GGUF value type {kind}")
        (v,) = self.unpack(fmt)
        assert isinstance(v, (int, float, bool))
        return v


def read_gguf_metadata(path: str | Path) -> Meta:
    """Scalar and string metadata of a GGUF file (arrays are skipped)."""
    meta, _ = _read(path, tensors=False)
    return meta


def gguf_parameter_count(path: str | Path) -> int:
    """How many values a GGUF file's tensors hold, from its tensor table (no tensor is read).

    A quantized tensor counts its values, not its bytes: loaded through
    transformers, every tensor is dequantized to the model's dtype.
    """
    _, count = _read(path, tensors=True)
    return count


def _read(path: str | Path, *, tensors: bool) -> tuple[Meta, int]:
    p = Path(path)
    try:
        with p.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != _MAGIC:
                raise ConfigError(f"{p} is not a GGUF file (bad magic)")
            cur = _Cursor(buf)
            cur.pos = 4
            version = cur.u32()
            if version < 2:
                raise ConfigError(f"{p}: GGUF version {version} is too old (need 2 or later)")
            tensor_count = cur.u64()
            kv_count = cur.u64()
            meta: Meta = {}
            for _ in range(kv_count):
                key = cur.string()
                value = cur.value(cur.u32())
                if value is not None:
                    meta[key] = value
            values = 0
            if tensors:
                for _ in range(tensor_count):
                    cur.skip_string()  # the tensor's name
                    elements = 1
                    for _ in range(cur.u32()):
                        elements *= cur.u64()
                    cur.u32()  # its ggml type
                    cur.u64()  # its offset in the data section
                    values += elements
            return meta, values
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"cannot read GGUF metadata from {p}: {exc}") from exc


def file_identity(path: str | os.PathLike[str]) -> tuple[str, int, int]:
    """A file as a cache key: its real path, modification time and size (a file written
    again is another file)."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_mtime_ns, st.st_size


@contextmanager
def gguf_parsed_once(enabled: bool = True) -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` parses each (unchanged) file once,
    ``gguf.get_tensor_name_map`` builds each architecture's map once, and transformers'
    metadata-only ``load_gguf_checkpoint(path)`` (its config and tokenizer, every value
    decoded: seconds for a 49k-token vocabulary) runs once per file, each caller getting
    a copy of its own; all are as before after it. Their results are only read by
    transformers' loader, so sharing them changes nothing it computes. Without the
    ``gguf`` package, or with ``enabled`` false (the model is no GGUF file: nothing to
    share, and transformers' GGUF modules are not worth importing), the block runs as it is.
    """
    try:
        if not enabled:
            raise ImportError
        import gguf
    except ImportError:
        yield
        return
    reader_class = gguf.GGUFReader
    if getattr(reader_class, "_kvtier_shared", False):
        yield  # inside another such block (serve's checks around a load): already shared
        return
    plain_reader = _plain_array_reader(reader_class)
    name_map = gguf.get_tensor_name_map
    readers: dict[tuple[str, int, int], Any] = {}

    def reader(path: str | os.PathLike[str], mode: Literal["r", "r+", "c"] = "r") -> Any:
        if mode != "r":
            return reader_class(path, mode)
        key = file_identity(path)
        parsed = readers.get(key)
        if parsed is None:
            parsed = readers[key] = plain_reader(path, mode)
        return parsed

    reader._kvtier_shared = True  # type: ignore[attr-defined]
    loader_module, load = _transformers_loader()
    parsed_metadata: dict[tuple[str, int, int], Any] = {}

    def load_checkpoint(path: Any, return_tensors: bool = False, *args: Any, **kw: Any) -> Any:
        if return_tensors or args or kw:
            return load(path, return_tensors, *args, **kw)
        key = file_identity(path)
        if key not in parsed_metadata:
            parsed_metadata[key] = load(path, False)
        return fresh_copy(parsed_metadata[key])

    # transformers imports these from their modules at each call, so the modules are patched.
    setattr(gguf, "GGUFReader", reader)  # noqa: B010
    setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(name_map))  # noqa: B010
    if loader_module is not None:
        setattr(loader_module, "load_gguf_checkpoint", load_checkpoint)  # noqa: B010
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", reader_class)  # noqa: B010
        setattr(gguf, "get_tensor_name_map", name_map)  # noqa: B010
        if loader_module is not None:
            setattr(loader_module, "load_gguf_checkpoint", load)  # noqa: B010


#: Values a copy may share: they cannot change in place.
_IMMUTABLE = (str, int, float, bool, bytes, type(None))


def fresh_copy(value: Any) -> Any:
    """``copy.deepcopy(value)``, with lists of immutable values copied at C speed.

    Decoded GGUF metadata is mostly a few lists of 49,000 strings or numbers (the
    vocabulary, its scores and types, the merges), which ``deepcopy`` visits one
    element at a time (a second per copy for SmolLM2); their elements can be shared.
    """
    if isinstance(value, dict):
        return {k: fresh_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        if all(type(v) in _IMMUTABLE for v in value):
            return value.copy()
        return [fresh_copy(v) for v in value]
    return copy.deepcopy(value)


def _plain_array_reader(reader_class: Any) -> Any:
    """``gguf.GGUFReader`` reading through a plain ndarray view of its memory map.

    The reader slices its ``numpy.memmap`` once per value, twice per string: about
    250,000 slices for SmolLM2's vocabulary and merges. A memmap slice runs Python
    code (``memmap.__getitem__`` and ``__array_finalize__``) where an ndarray slice
    does not, which made parsing the file take 6 seconds instead of 2. The view maps
    the same memory, so every field and tensor holds the same bytes; it is used for
    read-only readers, where the memmap's own methods (``flush``) have nothing to do.
    """
    import numpy as np

    class PlainArrayReader(reader_class):  # type: ignore[misc]
        @property
        def data(self) -> Any:
            return self._plain_data

        @data.setter
        def data(self, value: Any) -> None:
            self._plain_data = value.view(np.ndarray)

    return PlainArrayReader


def _transformers_loader() -> tuple[Any, Any]:
    """transformers' GGUF loader module and its ``load_gguf_checkpoint``, or ``(None, None)``."""
    try:
        from transformers import modeling_gguf_pytorch_utils as module
    except ImportError:
        return None, None
    return module, module.load_gguf_checkpoint
