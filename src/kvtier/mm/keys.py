"""Content keys of encoder outputs: everything an output depends on, hashed to 128 bits.

An encoder output (an image's vision-tower features, an audio clip's
embeddings) is a function of the encoder and of the item. Its key is a
128-bit digest over, each field length-prefixed so no two field lists
collide:

* the key format version (:data:`MM_KEY_VERSION`);
* the model id and its revision (a weights fingerprint, a commit, a LoRA
  id): new weights give new keys, so an old output is never served again;
* the encoder id (one model may have several towers) and the modality;
* the processor parameters that change the output (size, crop,
  normalisation, sampling rate, ...), in canonical JSON;
* the tenant salt (tenants never share or probe each other's entries);
* the item: its **original encoded bytes** (the PNG file, not the decoded
  pixels), plus its shape and dtype when it is a raw array; or, when the
  caller names the item itself (vLLM's ``multi_modal_uuids``), that id, still
  under the model and encoder above.

Hashing the encoded bytes means re-encoding a file (PNG to JPEG, or the same
PNG saved with another compression level) gives a different item and a
different key, although the decoded pixels may be equal: the cache never
decodes to decide identity. Two raw arrays with the same bytes but a
different shape (30x150 and 150x30) are different items.

The digest is SHA-256 truncated to 128 bits by default (collision resistant:
a tenant cannot craft an image that is served another's features); with a
``secret``, keyed BLAKE2b; ``xxh3_128`` is much faster where every caller is
trusted. Keys never use Python's ``hash()``, so they are the same in every
process and on every machine, which is what lets a second process (or a
restarted one) hit on disk or in Redis.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

from kvtier.errors import BadRequestError, ConfigError

#: The format of encoder-output keys; bump on any change that alters a key.
MM_KEY_VERSION = 1
#: The digests an :class:`ItemKeyer` can use.
KEY_ALGORITHMS = ("sha256", "blake2b", "xxh3_128")
#: The modalities items may name (free text is refused: a typo would split the cache).
MODALITIES = ("image", "audio", "video", "embedding")


def _canonical_params(params: Mapping[str, Any]) -> str:
    """Canonical JSON of processor parameters: sorted keys, no spaces, no NaN."""
    try:
        return json.dumps(
            params, sort_keys=True, separators=(",", ":"), allow_nan=False, default=_json_value
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"encoder parameters must be JSON data (numbers, strings, lists, dicts): {exc}"
        ) from None


def _json_value(value: object) -> object:
    # Tuples and sets of plain values are common in processor configs.
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON data")


@dataclass(frozen=True)
class EncoderSpec:
    """Who produced an output: model and revision, encoder, modality, processor parameters.

    ``params`` holds only the parameters that change the output; build it
    with :meth:`make`, which canonicalises a mapping.
    """

    model_id: str
    encoder_id: str
    modality: str
    revision: str = ""
    #: Canonical JSON of the output-changing processor parameters.
    params: str = "{}"

    def __post_init__(self) -> None:
        for name in ("model_id", "encoder_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"an encoder's {name} must be a non-empty string, got {value!r}")
        if self.modality not in MODALITIES:
            raise ConfigError(
                f"unknown modality {self.modality!r}: use one of {', '.join(MODALITIES)}"
            )
        if not isinstance(self.revision, str):
            raise ConfigError(f"an encoder's revision must be a string, got {self.revision!r}")

    @classmethod
    def make(
        cls,
        model_id: str,
        encoder_id: str,
        modality: str,
        *,
        revision: str = "",
        params: Mapping[str, Any] | None = None,
    ) -> EncoderSpec:
        return cls(model_id, encoder_id, modality, revision, _canonical_params(params or {}))


@dataclass(frozen=True, eq=False)
class MediaItem:
    """One input item as the client sent it.

    ``data`` is the original encoded bytes (a PNG file, a WAV file) or, for a
    raw array, its bytes with ``shape`` and ``dtype`` set. ``uuid`` is a
    caller-supplied identity that replaces hashing ``data`` (still namespaced
    by the encoder). ``decoded`` carries whatever the server decoded (a PIL
    image) for the encoder to use on a miss; it is never part of the key.
    """

    modality: str
    data: bytes = b""
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    uuid: str | None = None
    decoded: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise BadRequestError(
                f"unknown modality {self.modality!r}: use one of {', '.join(MODALITIES)}"
            )
        if not isinstance(self.data, (bytes, bytearray, memoryview)):
            raise BadRequestError(f"an item's data must be bytes, got {type(self.data).__name__}")
        if self.uuid is None and not len(self.data):
            raise BadRequestError("an item needs its bytes (or a uuid naming it)")
        if (self.shape is None) != (self.dtype is None):
            raise BadRequestError("a raw-array item needs both its shape and its dtype")
        if self.shape is not None:
            if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape):
                raise BadRequestError(
                    f"an item's shape must be non-negative ints, got {self.shape}"
                )
            if self.uuid is None and self.dtype is not None:
                itemsize = _itemsize(self.dtype)
                if itemsize is not None and math.prod(self.shape) * itemsize != len(self.data):
                    raise BadRequestError(
                        f"a raw {self.dtype} array of shape {list(self.shape)} takes "
                        f"{math.prod(self.shape) * itemsize} bytes, got {len(self.data)}"
                    )

    @classmethod
    def from_array(cls, modality: str, array: Any, *, decoded: Any = None) -> MediaItem:
        """A raw array (numpy, or a CPU torch tensor) as an item: its bytes, shape and dtype."""
        import numpy as np

        if not isinstance(array, np.ndarray) and hasattr(array, "numpy"):
            array = array.numpy()  # a CPU torch tensor
        arr = np.ascontiguousarray(array)
        return cls(
            modality,
            arr.tobytes(),
            shape=tuple(int(d) for d in arr.shape),
            dtype=str(arr.dtype),
            decoded=decoded,
        )


def _itemsize(dtype: str) -> int | None:
    try:
        import numpy as np

        return int(np.dtype(dtype).itemsize)
    except (ImportError, TypeError):
        return None


def _field(out: bytearray, value: bytes | str) -> None:
    data = value.encode("utf-8") if isinstance(value, str) else value
    out += len(data).to_bytes(8, "little")
    out += data


class _Hasher(Protocol):
    """The incremental digest objects of :data:`KEY_ALGORITHMS` share this much."""

    def update(self, data: bytes | bytearray | memoryview) -> None: ...

    def digest(self) -> bytes: ...


def _hasher_factory(algorithm: str, secret: bytes | None) -> Callable[[], _Hasher]:
    if secret is not None and algorithm != "blake2b":
        raise ConfigError("a key secret needs algorithm='blake2b' (keyed hashing)")
    if algorithm == "sha256":
        return hashlib.sha256
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128
    if algorithm == "blake2b":
        key = secret or b""
        if len(key) > 64:
            raise ConfigError("a blake2b key secret must be at most 64 bytes")
        return lambda: hashlib.blake2b(digest_size=16, key=key)
    raise ConfigError(
        f"unknown key algorithm {algorithm!r}; choose one of {', '.join(KEY_ALGORITHMS)}"
    )


class ItemKeyer:
    """Computes item keys under one tenant salt and hash algorithm (see the module docs)."""

    __slots__ = ("_new", "algorithm", "tenant_salt")

    def __init__(
        self, tenant_salt: str = "", algorithm: str = "sha256", secret: bytes | None = None
    ) -> None:
        if not isinstance(tenant_salt, str):
            raise ConfigError(f"a tenant salt must be a string, got {tenant_salt!r}")
        self.tenant_salt = tenant_salt
        self.algorithm = algorithm
        self._new = _hasher_factory(algorithm, secret)

    def salted(self, salt: str) -> ItemKeyer:
        """This keyer with ``salt`` appended to its tenant salt (same algorithm and secret)."""
        if not isinstance(salt, str):
            raise ConfigError(f"a tenant salt must be a string, got {salt!r}")
        out = ItemKeyer.__new__(ItemKeyer)
        out.tenant_salt = f"{self.tenant_salt}\x1f{salt}"
        out.algorithm = self.algorithm
        out._new = self._new
        return out

    def _finish(self, head: bytearray, data: bytes | bytearray | memoryview = b"") -> int:
        h = self._new()
        h.update(head)
        if len(data):
            h.update(data)  # hashed in place: a large file is never copied
        return int.from_bytes(h.digest()[:16], "little")

    def _head(self, spec: EncoderSpec) -> bytearray:
        out = bytearray(b"kvtier-mm/%d" % MM_KEY_VERSION)
        for value in (
            spec.model_id,
            spec.revision,
            spec.encoder_id,
            spec.modality,
            spec.params,
            self.tenant_salt,
        ):
            _field(out, value)
        return out

    def key(self, item: MediaItem, spec: EncoderSpec) -> int:
        """The key of ``spec``'s output for ``item``."""
        if item.modality != spec.modality:
            raise BadRequestError(
                f"a {item.modality} item cannot go through the {spec.modality} encoder "
                f"{spec.encoder_id!r}"
            )
        if item.uuid is not None:
            return self.id_key(item.uuid, spec)
        out = self._head(spec)
        _field(out, "bytes")
        _field(out, ",".join(map(str, item.shape)) if item.shape is not None else "-")
        _field(out, item.dtype or "-")
        # The (possibly large) bytes go last, length-prefixed like every field.
        out += len(item.data).to_bytes(8, "little")
        return self._finish(out, item.data)

    def id_key(self, item_id: str, spec: EncoderSpec) -> int:
        """The key of an item the caller names (vLLM's uuid, its ``mm_hash``), under ``spec``."""
        if not isinstance(item_id, str) or not item_id:
            raise BadRequestError(f"an item id must be a non-empty string, got {item_id!r}")
        out = self._head(spec)
        _field(out, "id")
        _field(out, item_id)
        return self._finish(out)
