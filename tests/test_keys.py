"""Block keys: chaining, namespaces, algorithms, determinism across processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import BadRequestError, BlockHasher, ConfigError, KVLayout, Namespace

NS = Namespace("test-model", KVLayout(2, 2, 8, 4, "float32"), "tenant-a")


def hasher(algorithm: str = "xxh3_128", **kw: object) -> BlockHasher:
    return BlockHasher(NS, 4, algorithm, **kw)  # type: ignore[arg-type]


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
