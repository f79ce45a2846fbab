"""Encoder-output keys: known answers, and the layout re-derived without kvtier's code.

Keys name outputs on shared and persistent media (Redis, disk, vLLM's
encoder cache), so a change to how they are computed must be deliberate:
these vectors fail on any change, and :func:`reference_key` spells out the
documented layout with hashlib and xxhash alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
import xxhash

from kvtier.mm.keys import MM_KEY_VERSION, EncoderSpec, ItemKeyer, MediaItem

SPEC = EncoderSpec.make(
    "org/vlm", "vision", "image", revision="r1", params={"size": 224, "crop": [1, 2]}
)
ITEM = MediaItem("image", b"\x00\x01kvtier\xff")
ITEM_ID = "mm-hash-1"

#: (algorithm, secret) -> (bytes key under tenant "tenant-a", id key under it, bytes key
#: without a tenant), as 32 hex digits of the little-endian 128-bit key.
KNOWN_ANSWERS: dict[tuple[str, bytes | None], tuple[str, str, str]] = {
    ("sha256", None): (
        "847030ef7ccd14daa51e0697d7bc3ccb",
        "947e79c55e8b55dd9fd0eb52c016ccd6",
        "beb4ced094a5cad636fb2af43dc8c3d5",
    ),
    ("xxh3_128", None): (
        "a67c8a1697dee813dbaf4396a205398e",
        "84f3013faa597cb411ea97646409ba41",
        "452f0ebec7cdebba230ffacd29854f24",
    ),
    ("blake2b", None): (
        "0598f85ee53a6aba360b5ec35aab7ac0",
        "3cc1bdea90abe20f8b36de122b7f1788",
        "def70580b601bf52df472d52a9af1c84",
    ),
    ("blake2b", b"secret"): (
        "a2ba96ec1d9249f65ac1b999b60f4d34",
        "cc5354d32b1268a8d11a677273c89c84",
        "cfbd31acb7a36b8c2b71f9d713c3f5aa",
    ),
}


def _digest(algorithm: str, secret: bytes | None) -> Callable[[bytes], bytes]:
    if algorithm == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    if algorithm == "xxh3_128":
        return lambda data: xxhash.xxh3_128(data).digest()
    return lambda data: hashlib.blake2b(data, digest_size=16, key=secret or b"").digest()


def _field(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return len(data).to_bytes(8, "little") + data


def reference_key(algorithm: str, secret: bytes | None, tenant: str, tail: list[bytes]) -> int:
    """The documented layout: a version tag, then length-prefixed fields (model, revision,
    encoder, modality, canonical parameters, tenant salt, then the item's own fields)."""
    head = b"kvtier-mm/%d" % MM_KEY_VERSION + b"".join(
        _field(v) for v in ("org/vlm", "r1", "vision", "image", '{"crop":[1,2],"size":224}', tenant)
    )
    digest = _digest(algorithm, secret)(head + b"".join(tail))
    return int.from_bytes(digest[:16], "little")


def _bytes_tail() -> list[bytes]:
    data = bytes(ITEM.data)
    return [_field("bytes"), _field("-"), _field("-"), len(data).to_bytes(8, "little"), data]


@pytest.mark.parametrize(("algorithm", "secret"), sorted(KNOWN_ANSWERS, key=str))
def test_known_answer_encoder_keys(algorithm: str, secret: bytes | None) -> None:
    tenant_key, id_key, bare_key = KNOWN_ANSWERS[(algorithm, secret)]
    keyer = ItemKeyer("tenant-a", algorithm, secret)
    assert f"{keyer.key(ITEM, SPEC):032x}" == tenant_key
    assert f"{keyer.id_key(ITEM_ID, SPEC):032x}" == id_key
    assert f"{ItemKeyer('', algorithm, secret).key(ITEM, SPEC):032x}" == bare_key


@pytest.mark.parametrize(("algorithm", "secret"), sorted(KNOWN_ANSWERS, key=str))
def test_the_layout_re_derived_gives_the_same_keys(algorithm: str, secret: bytes | None) -> None:
    keyer = ItemKeyer("tenant-a", algorithm, secret)
    assert keyer.key(ITEM, SPEC) == reference_key(algorithm, secret, "tenant-a", _bytes_tail())
    assert keyer.id_key(ITEM_ID, SPEC) == reference_key(
        algorithm, secret, "tenant-a", [_field("id"), _field(ITEM_ID)]
    )
    assert ItemKeyer("", algorithm, secret).key(ITEM, SPEC) == reference_key(
        algorithm, secret, "", _bytes_tail()
    )
