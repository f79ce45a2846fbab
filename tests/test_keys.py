"""Block keys: known answers, chaining, namespaces, algorithms, determinism across processes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvtier.keys
from kvtier import (
    KEY_FORMAT_VERSION,
    BadRequestError,
    BlockHasher,
    ConfigError,
    KVLayout,
    Namespace,
)

NS = Namespace("test-model", KVLayout(2, 2, 8, 4, "float32"), "tenant-a")


def hasher(algorithm: str = "xxh3_128", **kw: object) -> BlockHasher:
    return BlockHasher(NS, 4, algorithm, **kw)  # type: ignore[arg-type]


# -- known answers -----------------------------------------------------------------------
# Keys are stored on disk and shared through Redis: a key function that changes
# silently turns every stored block into a miss, or worse. These are the keys
# of KEY_FORMAT_VERSION 1. A deliberate change of the key format bumps the
# version (see kvtier.keys) and replaces this table; an accidental one fails here.
KAT_NAMESPACES = {
    "full": Namespace("test-model", KVLayout(2, 2, 8, 4, "float32"), "tenant-a"),
    "bare": Namespace("m"),  # no layout, no tenant salt
}
# Token ids at both ends of uint32 pin their little-endian 4-byte encoding.
KAT_TOKENS = [0, 1, 2**32 - 1, 65536, 7, 300, 50_000, 2]
KAT_SHAPES: dict[str, dict[str, object]] = {
    "plain": {},
    "extra": {"extra": ("lora-1", 7, b"\x00\xff")},  # str, int and bytes parts
    "block_extra": {"block_extra": [(), (b"\x01" * 32,)]},  # an image hash in block 2 only
}
KAT_SECRETS = {"xxh3_128": None, "sha256": None, "blake2b": None, "blake2b+secret": b"secret"}

KNOWN_ANSWERS = {
    ("full", "xxh3_128"): (
        "bd4a3bdfabda389977db24ee88ea5c9f",
        {
            "plain": ("fa4e6156e5daad0e6e0ed41a16842e58", "9c954b66834b63eb6ab4d9960e0ba137"),
            "extra": ("ec87a87cb66da68d81a8da49362ea1df", "ed841fb0d1024ee81299890fe8789beb"),
            "block_extra": ("fa4e6156e5daad0e6e0ed41a16842e58", "672560fccd6fbf20a3e5f83799792bfe"),
        },
    ),
    ("full", "sha256"): (
        "33a9852e577b9548d0c2a76e6685461b",
        {
            "plain": ("b41c701c35e04e3de6b0159ad89dc025", "9fce1da3d5322d81145e2930149e1c78"),
            "extra": ("0b985202d7b23f5728940910ecdfdacf", "d1ab8524deb7e29c74e464d810798315"),
            "block_extra": ("b41c701c35e04e3de6b0159ad89dc025", "be73587bd38911768d117346271b74be"),
        },
    ),
    ("full", "blake2b"): (
        "5ad45378e972508f4e495611bdc3aeab",
        {
            "plain": ("a06b2a00a50a33dce5ae60b3e13b77ec", "a301b8aeb33c960b55d8dbf1aeb0dbde"),
            "extra": ("f69eea75ec6f2cbfa367b90c7800f2ab", "bb7290b465c202a4ba6de4d04c52d178"),
            "block_extra": ("a06b2a00a50a33dce5ae60b3e13b77ec", "624b1c381600a8ce64da20afcb83b58f"),
        },
    ),
    ("full", "blake2b+secret"): (
        "2fd48d7b67c1adab46302799598fcb8c",
        {
            "plain": ("dccedc2fa9a3b8497b4509b123df2344", "6c283baed5841ab6c4e1c4ac57ed2434"),
            "extra": ("7ff81accb2e6c922f13592d24f58e3cf", "f036148b527fa93bcf7ebf4bac919365"),
            "block_extra": ("dccedc2fa9a3b8497b4509b123df2344", "556cbc963c4cbc4b0959cf792b24b4e2"),
        },
    ),
    ("bare", "xxh3_128"): (
        "cfa6c9a6281cdd439b09b73c30a8dea0",
        {
            "plain": ("a8923101882a2cf4dc2aa783c9f66d83", "03af4f832ddaa7579199284f891ca43e"),
            "extra": ("e240a566ae1810ff0768d42336d02ab6", "085a97a3a620848ccd0337c917832ef8"),
            "block_extra": ("a8923101882a2cf4dc2aa783c9f66d83", "f2bf360515b15863496641625acfff6f"),
        },
    ),
    ("bare", "sha256"): (
        "e800cc725a42d335ae1a82605d04a866",
        {
            "plain": ("3af0e55a78ed987dd97f81390f40a1d2", "4d6b8548bc9a1d191c4a96622547285c"),
            "extra": ("8d6d463489a2bf2abd225bc3e2fb430c", "35e590ade8b77823ea220bdd9ed30809"),
            "block_extra": ("3af0e55a78ed987dd97f81390f40a1d2", "100ea000c1abe02bd19ac45665da1978"),
        },
    ),
    ("bare", "blake2b"): (
        "386ad1b6e5055225e4c478f0c7077c6c",
        {
            "plain": ("c3efb66b59fd5e144a46eac05ef6f31f", "8771c25574e9d1d4139ac3de95d4e321"),
            "extra": ("de5ac8c4b9bcf71c912ac9183e48af5c", "dd0faf070e707d3a4150b7c4b8dfd27b"),
            "block_extra": ("c3efb66b59fd5e144a46eac05ef6f31f", "1fcdc69f5de62694728e0e7537bfbdac"),
        },
    ),
    ("bare", "blake2b+secret"): (
        "79db4dd760da3bd8186c13fc5e2960d5",
        {
            "plain": ("97eb46988e352379777c92168f766c1b", "22ff960e657ff6cb351be0311edf7803"),
            "extra": ("683d08327a3696f53ae281360d2af9a1", "6a471865d2105c154cfca5afdb3660f0"),
            "block_extra": ("97eb46988e352379777c92168f766c1b", "b2d90d3f0f6396333e12de6c7cffa9d2"),
        },
    ),
}


@pytest.mark.parametrize(("namespace", "algorithm"), sorted(KNOWN_ANSWERS))
def test_known_answer_keys(namespace: str, algorithm: str) -> None:
    root, chains = KNOWN_ANSWERS[(namespace, algorithm)]
    h = BlockHasher(
        KAT_NAMESPACES[namespace], 4, algorithm.split("+")[0], secret=KAT_SECRETS[algorithm]
    )
    assert f"{h.root:032x}" == root
    for shape, kwargs in KAT_SHAPES.items():
        got = tuple(f"{k:032x}" for k in h.chain(KAT_TOKENS, **kwargs))  # type: ignore[arg-type]
        assert got == chains[shape], f"{namespace}/{algorithm}/{shape} keys changed"


def test_the_documented_format_rederived_with_hashlib() -> None:
    """sha256 keys from the format as documented, without kvtier's encoder."""
    ns = KAT_NAMESPACES["full"]
    canonical = b"kvtier-key/1\x00test-model\x00L2/H2/D8/B4/float32\x00tenant-a"
    assert ns.canonical() == canonical

    def sha(data: bytes) -> int:
        return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")

    root = sha(canonical)
    block = b"".join(t.to_bytes(4, "little") for t in KAT_TOKENS[:4])
    first = sha(root.to_bytes(16, "little") + block)
    lora = b"s" + (6).to_bytes(4, "little") + b"lora-1"
    with_lora = sha(root.to_bytes(16, "little") + block + lora)
    h = BlockHasher(ns, 4, "sha256")
    assert h.root == root
    assert h.chain(KAT_TOKENS[:4]) == [first]
    assert h.chain(KAT_TOKENS[:4], extra=("lora-1",)) == [with_lora]


def test_the_key_format_version_is_in_every_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 1 is today's format; a new version moves every key and storage namespace."""
    assert KEY_FORMAT_VERSION == 1
    for ns in KAT_NAMESPACES.values():
        assert ns.canonical().startswith(b"kvtier-key/1\x00")
    today = {a: BlockHasher(NS, 4, a) for a in ("xxh3_128", "sha256")}
    monkeypatch.setattr(kvtier.keys, "KEY_FORMAT_VERSION", 2)
    for algorithm, old in today.items():
        new = BlockHasher(NS, 4, algorithm)
        assert new.root != old.root
        assert not set(new.chain(KAT_TOKENS)) & set(old.chain(KAT_TOKENS))


def test_only_full_blocks_get_keys() -> None:
    h = hasher()
    assert h.chain([]) == []
    assert h.chain([1, 2, 3]) == []
    assert len(h.chain(list(range(4)))) == 1
    assert len(h.chain(list(range(7)))) == 1
    assert len(h.chain(list(range(8)))) == 2


def test_keys_are_128_bit_and_chained() -> None:
    h = hasher()
    keys = h.chain(list(range(12)))
    assert all(0 <= k < 2**128 for k in keys)
    assert len(set(keys)) == 3
    assert keys[0] == h.block_key(h.root, [0, 1, 2, 3])
    assert keys[1] == h.block_key(keys[0], [4, 5, 6, 7])
    # The same block under a different parent is a different key.
    assert h.chain([4, 5, 6, 7])[0] != keys[1]


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=40),
    st.lists(st.integers(0, 50_000), max_size=20),
)
def test_shared_prefix_shares_leading_keys(prefix: list[int], suffix: list[int]) -> None:
    h = hasher()
    a = h.chain(prefix + suffix)
    b = h.chain(prefix)
    assert a[: len(b)] == b
    # Chaining from a parent gives the same keys as hashing the whole sequence.
    cut = (len(prefix) // 4) * 4
    head = h.chain(prefix[:cut])
    tail = h.chain((prefix + suffix)[cut:], parent=head[-1] if head else None)
    assert head + tail == a


def test_namespace_separates_models_layouts_and_tenants() -> None:
    tokens = list(range(8))
    base = BlockHasher(NS, 4).chain(tokens)
    others = [
        Namespace("other-model", NS.layout, NS.tenant_salt),
        Namespace(NS.model_id, KVLayout(2, 2, 8, 4, "bfloat16"), NS.tenant_salt),
        Namespace(NS.model_id, NS.layout, "tenant-b"),
    ]
    for ns in others:
        assert not set(BlockHasher(ns, 4).chain(tokens)) & set(base)


def test_extra_keys_change_keys() -> None:
    h = hasher()
    tokens = list(range(8))
    plain = h.chain(tokens)
    lora = h.chain(tokens, extra=("lora-1",))
    assert not set(plain) & set(lora)
    image = h.chain(tokens, block_extra=[(), (b"\x01" * 32,)])
    assert image[0] == plain[0] and image[1] != plain[1]
    # Unambiguous encoding: ("ab",) differs from ("a", "b") and from the int 1 vs "1".
    assert h.chain(tokens, extra=("ab",)) != h.chain(tokens, extra=("a", "b"))
    assert h.chain(tokens, extra=(1,)) != h.chain(tokens, extra=("1",))


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_algorithms_differ_and_are_stable(algorithm: str) -> None:
    h1, h2 = hasher(algorithm), hasher(algorithm)
    assert h1.chain(list(range(8))) == h2.chain(list(range(8)))
    other = "sha256" if algorithm == "xxh3_128" else "xxh3_128"
    assert h1.chain(list(range(8))) != hasher(other).chain(list(range(8)))


def test_keyed_blake2b_depends_on_the_secret() -> None:
    a = hasher("blake2b", secret=b"s1").chain(list(range(4)))
    b = hasher("blake2b", secret=b"s2").chain(list(range(4)))
    assert a != b
    assert a == hasher("blake2b", secret=b"s1").chain(list(range(4)))


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        BlockHasher(NS, 0)
    with pytest.raises(ConfigError, match="disagrees"):
        BlockHasher(NS, 8)
    with pytest.raises(ConfigError, match="unknown hash algorithm"):
        BlockHasher(NS, 4, "md5")
    with pytest.raises(ConfigError, match="blake2b"):
        BlockHasher(NS, 4, "xxh3_128", secret=b"x")
    with pytest.raises(ConfigError):
        KVLayout(0, 1, 1, 1)
    with pytest.raises(ConfigError, match="dtype"):
        KVLayout(1, 1, 1, 1, "float64")


def test_bad_tokens_are_rejected() -> None:
    h = hasher()
    with pytest.raises(BadRequestError, match="token ids"):
        h.chain([0, 1, -2, 3])
    with pytest.raises(BadRequestError, match="token ids"):
        h.chain([0, 1, 2**32, 3])
    with pytest.raises(BadRequestError, match="exactly 4"):
        h.block_key(h.root, [1, 2])
    with pytest.raises(BadRequestError, match="extra key"):
        h.chain(list(range(4)), extra=(1.5,))  # type: ignore[arg-type]
    with pytest.raises(BadRequestError, match="block_extra"):
        h.chain(list(range(8)), block_extra=[()])


def test_layout_sizes_use_kv_heads() -> None:
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16")
    assert layout.bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert layout.bytes_per_block == layout.bytes_per_token * 16


_CHILD = """
import json, sys
from kvtier import BlockHasher, KVLayout, Namespace
ns = Namespace("m", KVLayout(2, 2, 8, 4, "float16"), "salt")
out = {a: [str(k) for k in BlockHasher(ns, 4, a, secret=b"k" if a == "blake2b" else None)
           .chain(list(range(40)), extra=("lora",))]
       for a in ("xxh3_128", "sha256", "blake2b")}
print(json.dumps(out))
"""


def test_keys_are_identical_across_interpreters() -> None:
    """Two fresh interpreters with different hash seeds compute the same keys."""
    outs = []
    for seed in ("1", "2"):
        res = subprocess.run(
            [sys.executable, "-c", _CHILD],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        )
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
    assert len(outs[0]["xxh3_128"]) == 10
