"""Block identity: chained, salted 128-bit hashes of full token blocks.

A block's key hashes its parent's key, its token ids and optional extra keys
(a LoRA id, the content hash of an image the block covers). The first block's
parent is the *namespace root*: a hash of the model id, the KV layout and a
tenant salt, so blocks of different models, layouts or tenants never collide.

Keys are plain ``int`` values below ``2**128``. They are computed from a
canonical byte encoding (little-endian uint32 token ids, 16-byte parent), never
from Python's ``hash()``, so they are identical across processes and machines
and two engines can share blocks through a remote tier.

Only *full* blocks get keys; a sequence's partial tail is private to it.

Keys outlive processes (disk files, shared Redis), so the key function is
versioned: :data:`KEY_FORMAT_VERSION` is part of every namespace root. Any
change that alters a key (an encoding, a hash, the root derivation) must bump
it; every key then changes, and so does the storage namespace derived from
the root, so blocks stored under the old format are never read back as
blocks of the new one. The test suite pins known-answer keys of the current
version for every algorithm, namespace and extra-key shape.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import xxhash

from kvtier._tokpack import pack_u32
from kvtier.errors import BadRequestError, ConfigError
from kvtier.layout import KVLayout

#: One extra key part: ints, strings and bytes are accepted.
ExtraKey = int | str | bytes
#: A multimodal item in a prompt: the position of its first placeholder token and
#: its content key. It is mixed into the block holding that position and every
#: block after it.
ItemKey = tuple[int, ExtraKey]

HASH_ALGORITHMS = ("xxh3_128", "sha256", "blake2b")
#: The key format (see the module docstring); 1 is the format since the first release.
KEY_FORMAT_VERSION = 1
_KEY_BYTES = 16


def _encode_extra(parts: Sequence[ExtraKey]) -> bytes:
    """Canonical, unambiguous bytes for a tuple of extra key parts."""
    out = bytearray()
    for part in parts:
        if isinstance(part, bool):
            raise BadRequestError("extra keys must be int, str or bytes, not bool")
        if isinstance(part, int):
            payload = str(part).encode()
            tag = b"i"
        elif isinstance(part, str):
            payload = part.encode("utf-8")
            tag = b"s"
        elif isinstance(part, bytes | bytearray | memoryview):
            payload = bytes(part)
            tag = b"b"
        else:
            raise BadRequestError(
                f"extra key parts must be int, str or bytes; got {type(part).__name__}"
            )
        out += tag + len(payload).to_bytes(4, "little") + payload
    return bytes(out)


def check_item_keys(items: Sequence[ItemKey]) -> tuple[ItemKey, ...]:
    """``items`` validated and sorted by position; :class:`BadRequestError` if malformed."""
    out: list[ItemKey] = []
    for entry in items:
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise BadRequestError(
                f"item keys are (position, key) pairs, got {entry!r}", param="item_keys"
            )
        pos, key = entry
        if not isinstance(pos, int) or isinstance(pos, bool) or pos < 0:
            raise BadRequestError(
                f"an item's position must be a non-negative int, got {pos!r}", param="item_keys"
            )
        _encode_extra((key,))  # raises for a part of the wrong type
        out.append((pos, key))
    out.sort(key=lambda e: e[0])
    for (a, _), (b, _) in pairwise(out):
        if a == b:
            raise BadRequestError(
                f"two items start at position {a}; each item needs its own placeholder position",
                param="item_keys",
            )
    return tuple(out)


def cache_salt_key(salt: str) -> str:
    """The extra key a request's ``cache_salt`` mixes into every one of its block keys."""
    return f"salt:{salt}"


def item_block_extra(
    items: Sequence[ItemKey], first_block: int, num_blocks: int, block_size: int
) -> list[tuple[ExtraKey, ...]] | None:
    """Per-block extra keys for blocks ``first_block ..`` of a prompt holding ``items``.

    Block ``b`` gets the key of every item whose first placeholder token is
    at a position before the block's end: the block holding that token and
    every later block. So the same text with another image never shares a
    block from the placeholder on, and the same image at the same place does.
    ``None`` when there are no items (the keys are then those of plain text).
    """
    if not items:
        return None
    out: list[tuple[ExtraKey, ...]] = []
    for b in range(first_block, first_block + num_blocks):
        end = (b + 1) * block_size
        out.append(tuple(key for pos, key in items if pos < end))
    return out


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Little-endian uint32 encoding of token ids; rejects ids outside [0, 2**32)."""
    return _encode_tokens(token_ids, None)


def _encode_tokens(token_ids: Sequence[int], stop: int | None) -> bytes:
    """:func:`tokens_to_bytes` of ``token_ids[:stop]`` (all of them for ``None``).

    Lists and tuples (what callers pass) go through :func:`pack_u32`, which
    reads them in place; anything else through ``array``.
    """
    try:
        if isinstance(token_ids, (list, tuple)):
            return pack_u32(token_ids, 0, len(token_ids) if stop is None else stop)
        arr = array("I", token_ids if stop is None else token_ids[:stop])
    except OverflowError as exc:
        raise BadRequestError(
            "token ids must be integers in [0, 2**32); a negative or huge id was given"
        ) from exc
    except TypeError as exc:
        raise BadRequestError(f"token ids must be integers: {exc}") from exc
    if arr.itemsize != 4:  # pragma: no cover - no mainstream platform has this
        arr = array("L", token_ids if stop is None else token_ids[:stop])
    if sys.byteorder == "big":  # pragma: no cover - exercised only on big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def _digest_fn(algorithm: str, secret: bytes | None) -> Callable[[bytes], int]:
    if algorithm == "xxh3_128":
        if secret is not None:
            raise ConfigError("a hash secret needs algorithm='blake2b' (keyed hashing)")
        xxh: Callable[[bytes], int] = xxhash.xxh3_128_intdigest
        return xxh
    if algorithm == "sha256":
        if secret is not None:
            raise ConfigError("a hash secret needs algorithm='blake2b' (keyed hashing)")

        def sha(data: bytes) -> int:
            return int.from_bytes(hashlib.sha256(data).digest()[:_KEY_BYTES], "little")

        return sha
    if algorithm == "blake2b":
        key = secret or b""
        if len(key) > 64:
            raise ConfigError("blake2b hash secret must be at most 64 bytes")

        def blake(data: bytes) -> int:
            return int.from_bytes(
                hashlib.blake2b(data, digest_size=_KEY_BYTES, key=key).digest(), "little"
            )

        return blake
    raise ConfigError(f"unknown hash algorithm {algorithm!r}; choose one of {HASH_ALGORITHMS}")


@dataclass(frozen=True, slots=True)
class Namespace:
    """What a key space is private to: a model, a KV layout and a tenant."""

    model_id: str
    layout: KVLayout | None = None
    tenant_salt: str = ""

    def canonical(self) -> bytes:
        """The bytes the namespace root hashes: format version, model, layout, tenant."""
        layout = self.layout.canonical() if self.layout is not None else "-"
        tag = b"kvtier-key/%d" % KEY_FORMAT_VERSION
        return b"\0".join((tag, self.model_id.encode(), layout.encode(), self.tenant_salt.encode()))


class BlockHasher:
    """Computes chained block keys for one namespace and block size.

    ``algorithm`` is ``"xxh3_128"`` (default, fast), ``"sha256"`` (collision
    resistant) or ``"blake2b"`` with a ``secret`` (keyed: tenants that do not
    know the secret cannot forge or probe keys).
    """

    __slots__ = ("_digest", "algorithm", "block_size", "namespace", "root")

    def __init__(
        self,
        namespace: Namespace,
        block_size: int,
        algorithm: str = "xxh3_128",
        secret: bytes | None = None,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        if namespace.layout is not None and namespace.layout.block_size != block_size:
            raise ConfigError(
                f"block_size {block_size} disagrees with the namespace layout's "
                f"block_size {namespace.layout.block_size}"
            )
        self.namespace = namespace
        self.block_size = block_size
        self.algorithm = algorithm
        self._digest = _digest_fn(algorithm, secret)
        self.root: int = self._digest(namespace.canonical())

    def block_key(
        self, parent: int, token_ids: Sequence[int], extra: Sequence[ExtraKey] = ()
    ) -> int:
        """Key of one full block whose parent key is ``parent``."""
        if len(token_ids) != self.block_size:
            raise BadRequestError(
                f"a block key needs exactly {self.block_size} tokens, got {len(token_ids)}"
            )
        extra_bytes = _encode_extra(extra) if extra else b""
        return self._digest(
            parent.to_bytes(_KEY_BYTES, "little") + tokens_to_bytes(token_ids) + extra_bytes
        )

    def chain(
        self,
        token_ids: Sequence[int],
        parent: int | None = None,
        extra: Sequence[ExtraKey] = (),
        block_extra: Sequence[Sequence[ExtraKey]] | None = None,
    ) -> list[int]:
        """Keys of every full block of ``token_ids``, chained from ``parent``.

        ``parent`` defaults to the namespace root. ``extra`` is mixed into every
        block (a LoRA id); ``block_extra[i]`` only into block ``i`` (the hash of
        an image that block covers). The partial tail gets no key.
        """
        bs = self.block_size
        n_full = len(token_ids) // bs
        if n_full == 0:
            return []
        if block_extra is not None and len(block_extra) < n_full:
            raise BadRequestError(
                f"block_extra has {len(block_extra)} entries but there are {n_full} full blocks"
            )
        data = _encode_tokens(token_ids, n_full * bs)
        common = _encode_extra(extra) if extra else b""
        digest = self._digest
        key = self.root if parent is None else parent
        step = bs * 4
        keys: list[int] = []
        for i in range(n_full):
            tail = common
            if block_extra is not None and block_extra[i]:
                tail = common + _encode_extra(block_extra[i])
            block = data[i * step : (i + 1) * step]
            key = digest(key.to_bytes(_KEY_BYTES, "little") + block + tail)
            keys.append(key)
        return keys
