"""The encoder-output cache: content keys, the byte budget, pins, single flight, stats, reset."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.errors import BadRequestError, ConfigError
from kvtier.mm import EncoderCache, EncoderSpec, FunctionEncoder, ItemKeyer, MediaItem

SPEC = EncoderSpec.make("org/vlm", "vision", "image", revision="r1", params={"size": 224})


def counting_encoder(
    spec: EncoderSpec = SPEC, rows: int = 4, dim: int = 8, delay: float = 0.0
) -> tuple[FunctionEncoder, list[bytes]]:
    """An encoder whose output is a function of the item's bytes; it records each call."""
    calls: list[bytes] = []

    def fn(item: MediaItem) -> torch.Tensor:
        calls.append(bytes(item.data))
        if delay:
            time.sleep(delay)
        seed = zlib.crc32(bytes(item.data))
        g = torch.Generator().manual_seed(seed)
        return torch.randn(rows, dim, generator=g)

    return FunctionEncoder(spec, fn), calls


def item(i: int) -> MediaItem:
    return MediaItem("image", f"image-{i:04d}".encode())


# -- keys ------------------------------------------------------------------------------
def test_every_field_of_the_key_matters() -> None:
    k = ItemKeyer()
    data = MediaItem("image", b"\x89PNG same bytes")
    base = k.key(data, SPEC)
    variants = [
        EncoderSpec.make("org/other", "vision", "image", revision="r1", params={"size": 224}),
        EncoderSpec.make("org/vlm", "vision", "image", revision="r2", params={"size": 224}),
        EncoderSpec.make("org/vlm", "vision-2", "image", revision="r1", params={"size": 224}),
        EncoderSpec.make("org/vlm", "vision", "image", revision="r1", params={"size": 384}),
        EncoderSpec.make("org/vlm", "vision", "image", revision="r1", params={"crop": True}),
    ]
    keys = {base} | {k.key(data, s) for s in variants}
    assert len(keys) == 1 + len(variants)
    assert ItemKeyer(tenant_salt="tenant-b").key(data, SPEC) != base
    assert k.key(MediaItem("image", b"\x89PNG other bytes"), SPEC) != base
    assert 0 <= base < 2**128 and base.bit_length() > 64
    # Parameter order does not matter: canonical JSON.
    a = EncoderSpec.make("m", "e", "audio", params={"sr": 16000, "mono": True})
    b = EncoderSpec.make("m", "e", "audio", params={"mono": True, "sr": 16000})
    assert a == b


def test_the_modality_must_match_the_encoder() -> None:
    audio = EncoderSpec.make("org/vlm", "vision", "audio")
    with pytest.raises(BadRequestError, match="cannot go through"):
        ItemKeyer().key(MediaItem("image", b"x"), audio)
    assert ItemKeyer().key(MediaItem("audio", b"x"), audio) != ItemKeyer().key(
        MediaItem("image", b"x"), SPEC
    )


def test_a_transposed_array_is_another_item() -> None:
    pixels = np.arange(30 * 150, dtype=np.uint8)
    tall = MediaItem.from_array("image", pixels.reshape(30, 150))
    wide = MediaItem.from_array("image", pixels.reshape(150, 30))
    assert tall.data == wide.data
    assert ItemKeyer().key(tall, SPEC) != ItemKeyer().key(wide, SPEC)
    with pytest.raises(BadRequestError, match="takes 4500 bytes"):
        MediaItem("image", b"\0" * 10, shape=(30, 150), dtype="uint8")


def test_reencoding_a_file_is_another_item() -> None:
    from PIL import Image

    img = Image.fromarray(np.full((8, 8, 3), 128, dtype=np.uint8))
    png, jpeg = io.BytesIO(), io.BytesIO()
    img.save(png, format="PNG")
    img.save(jpeg, format="JPEG")
    k = ItemKeyer()
    assert k.key(MediaItem("image", png.getvalue()), SPEC) != k.key(
        MediaItem("image", jpeg.getvalue()), SPEC
    )


def test_a_caller_id_is_namespaced_by_model() -> None:
    k = ItemKeyer()
    other = EncoderSpec.make("org/other", "vision", "image", revision="r1")
    named = MediaItem("image", uuid="img-1")
    assert k.key(named, SPEC) != k.key(named, other)
    assert k.key(named, SPEC) == k.id_key("img-1", SPEC)
    assert k.key(named, SPEC) != k.key(MediaItem("image", b"img-1"), SPEC)


def test_keys_are_the_same_in_another_process() -> None:
    code = (
        "from kvtier.mm import EncoderSpec, ItemKeyer, MediaItem;"
        "s = EncoderSpec.make('org/vlm', 'vision', 'image', revision='r1', params={'size': 224});"
        "print(ItemKeyer().key(MediaItem('image', b'image-0001'), s))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    assert int(out.stdout) == ItemKeyer().key(item(1), SPEC)


def test_keyer_refuses_bad_settings() -> None:
    with pytest.raises(ConfigError, match="blake2b"):
        ItemKeyer(secret=b"k")
    with pytest.raises(ConfigError, match="unknown key algorithm"):
        ItemKeyer(algorithm="md5")
    keyed = ItemKeyer(algorithm="blake2b", secret=b"server secret")
    assert keyed.key(item(1), SPEC) != ItemKeyer(algorithm="blake2b").key(item(1), SPEC)
    with pytest.raises(ConfigError, match="modality"):
        EncoderSpec.make("m", "e", "smell")


# -- the cache -------------------------------------------------------------------------
def test_a_hit_returns_the_same_tensor_without_encoding() -> None:
    cache = EncoderCache(1 << 20)
    enc, calls = counting_encoder()
    first = cache.get_or_encode(item(1), enc)
    again = cache.get_or_encode(item(1), enc)
    assert torch.equal(first, again) and len(calls) == 1
    other = cache.get_or_encode(item(2), enc)
    assert not torch.equal(first, other) and len(calls) == 2
    s = cache.stats()
    assert (s.lookups, s.hits, s.misses) == (3, 1, 2)
    assert s.bytes_held == 2 * first.nbytes
    assert s.by_modality["image"]["hits"] == 1
    assert s.encode_seconds > 0 and s.encode_seconds_saved > 0
    assert s.hit_ratio == pytest.approx(1 / 3)
    cache.check()


def test_another_encoder_or_revision_never_gets_the_output() -> None:
    cache = EncoderCache(1 << 20)
    enc, _ = counting_encoder()
    cache.get_or_encode(item(1), enc)
    new_weights = EncoderSpec.make("org/vlm", "vision", "image", revision="r2")
    enc2, calls2 = counting_encoder(new_weights)
    cache.get_or_encode(item(1), enc2)
    assert len(calls2) == 1
    another_model = EncoderSpec.make("org/another-vlm", "vision", "image", revision="r1")
    enc3, calls3 = counting_encoder(another_model)
    cache.get_or_encode(item(1), enc3)
    assert len(calls3) == 1
    assert cache.reset(model="org/vlm") == 2
    assert cache.reset(model="org/another-vlm") == 1
    assert len(cache) == 0 and cache.bytes_held == 0
    cache.check()


def test_the_budget_counts_nbytes_of_one_dimensional_outputs() -> None:
    spec = EncoderSpec.make("m", "audio-enc", "audio")
    cache = EncoderCache(1000)
    enc = FunctionEncoder(spec, lambda it: torch.zeros(100, dtype=torch.float32))  # 400 bytes
    for i in range(5):
        cache.get_or_encode(MediaItem("audio", bytes([i])), enc)
        assert cache.bytes_held <= 1000
    s = cache.stats()
    assert s.entries == 2 and s.bytes_held == 800 and s.evictions == 3
    assert s.peak_bytes <= 1000
    cache.check()


def test_a_view_is_stored_as_a_compact_copy() -> None:
    big = torch.zeros(1000, 8)
    cache = EncoderCache(1 << 16)
    enc = FunctionEncoder(SPEC, lambda it: big[:2])
    out = cache.get_or_encode(item(1), enc)
    assert out.untyped_storage().nbytes() == out.nbytes == 64


def test_an_output_larger_than_the_budget_is_returned_but_not_cached() -> None:
    cache = EncoderCache(100)
    enc, calls = counting_encoder(rows=10, dim=10)
    out = cache.get_or_encode(item(1), enc)
    assert out.shape == (10, 10)
    cache.get_or_encode(item(1), enc)
    assert len(calls) == 2
    s = cache.stats()
    assert s.oversize == 2 and s.entries == 0 and s.bytes_held == 0


def test_pinned_entries_are_never_evicted_and_a_full_pin_set_does_not_loop() -> None:
    enc, calls = counting_encoder(rows=4, dim=8)  # 128 bytes each
    cache = EncoderCache(256)
    a = cache.acquire(item(1), enc)
    b = cache.acquire(item(2), enc)
    assert a.pinned and b.pinned
    c = cache.acquire(item(3), enc)  # no room beside two pinned entries
    assert not c.pinned and c.tensor.shape == (4, 8)
    assert cache.stats().not_cached == 1
    assert len(calls) == 3 and len(cache) == 2
    assert cache.key(item(1), SPEC) in cache and cache.key(item(2), SPEC) in cache
    a.release()
    a.release()  # idempotent
    with cache.acquire(item(3), enc) as d:
        assert d.pinned
        assert cache.key(item(1), SPEC) not in cache  # the only unpinned entry went
    b.release()
    cache.check()
    assert cache.stats().pinned_entries == 0


def test_max_entries_bounds_the_count() -> None:
    enc, _ = counting_encoder()
    cache = EncoderCache(1 << 20, max_entries=3)
    for i in range(10):
        cache.get_or_encode(item(i), enc)
    assert len(cache) == 3
    cache.check()


def test_lfu_keeps_the_frequent_item_over_the_recent_ones() -> None:
    enc, calls = counting_encoder()  # 128 bytes
    cache = EncoderCache(3 * 128, policy="lfu")
    for _ in range(5):
        cache.get_or_encode(item(0), enc)
    for i in range(1, 6):
        cache.get_or_encode(item(i), enc)  # one-off items, each more recent than item 0
    calls.clear()
    cache.get_or_encode(item(0), enc)
    assert calls == []  # a true LFU kept it; an LRU would have evicted it


def test_an_encoder_failure_reaches_every_waiter_and_caches_nothing() -> None:
    started = threading.Event()
    release = threading.Event()
    calls = 0

    def fail(it: MediaItem) -> torch.Tensor:
        nonlocal calls
        calls += 1
        started.set()
        release.wait(5)
        raise RuntimeError("tower exploded")

    cache = EncoderCache(1 << 20)
    enc = FunctionEncoder(SPEC, fail)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            cache.get_or_encode(item(1), enc)
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(6)]
    threads[0].start()
    assert started.wait(5)
    for t in threads[1:]:
        t.start()
    while cache.stats().coalesced < 5:
        time.sleep(0.005)
    release.set()
    for t in threads:
        t.join(5)
    assert calls == 1 and len(errors) == 6
    assert all("tower exploded" in str(e) for e in errors)
    assert len(cache) == 0 and cache.stats().encoder_failures == 1
    ok, _ = counting_encoder()
    cache.get_or_encode(item(1), ok)  # the next request tries again
    assert len(cache) == 1


def test_concurrent_threads_encode_once() -> None:
    enc, calls = counting_encoder(delay=0.05)
    cache = EncoderCache(1 << 20)
    results: list[torch.Tensor] = []
    barrier = threading.Barrier(8)

    def call() -> None:
        barrier.wait()
        with cache.acquire(item(7), enc) as lease:
            results.append(lease.tensor)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len(results) == 8
    assert all(torch.equal(r, results[0]) for r in results)
    s = cache.stats()
    assert s.misses == 1 and s.hits + s.coalesced == 7
    cache.check()
    assert cache.stats().pinned_entries == 0


def test_concurrent_coroutines_encode_once() -> None:
    enc, calls = counting_encoder(delay=0.05)
    cache = EncoderCache(1 << 20)

    async def main() -> list[torch.Tensor]:
        return list(await asyncio.gather(*(cache.aget_or_encode(item(3), enc) for _ in range(6))))

    outs = asyncio.run(main())
    assert len(calls) == 1 and all(torch.equal(o, outs[0]) for o in outs)
    assert cache.stats().coalesced == 5


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError, match="capacity"):
        EncoderCache(0)
    with pytest.raises(ConfigError, match="max_entries"):
        EncoderCache(10, max_entries=0)
    cache = EncoderCache(1 << 10)
    with pytest.raises(ConfigError, match=r"not a torch\.Tensor"):
        cache.get_or_encode(item(1), FunctionEncoder(SPEC, lambda it: [1, 2]))  # type: ignore[arg-type, return-value]
    assert len(cache) == 0


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(1, 64), min_size=1, max_size=40),
    st.sampled_from(["lru", "lfu", "arc", "s3fifo", "gdsf"]),
)
def test_any_policy_keeps_the_budget(sizes: list[int], policy: str) -> None:
    cache = EncoderCache(256, policy=policy)
    for i, n in enumerate(sizes):
        enc = FunctionEncoder(SPEC, lambda it, n=n: torch.zeros(n, dtype=torch.float32))
        out = cache.get_or_encode(item(i % 7 + 100 * (n % 3)), enc)
        assert out.nbytes in (4 * n, out.nbytes)
        assert cache.bytes_held <= 256
    cache.check()


class CacheMachine(RuleBasedStateMachine):
    """Random acquire / release / reset over a small budget: budget, pins and counts hold."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = EncoderCache(512, policy="lfu", max_entries=6)
        self.leases: list = []
        self.sizes: dict[int, int] = {}

    def _encoder(self, rows: int) -> FunctionEncoder:
        return FunctionEncoder(SPEC, lambda it: torch.ones(rows, 4))  # 16 bytes a row

    @rule(i=st.integers(0, 15), rows=st.integers(1, 40), pin=st.booleans())
    def acquire(self, i: int, rows: int, pin: bool) -> None:
        rows = self.sizes.setdefault(i, rows)  # one item, one output
        lease = self.cache.acquire(item(i), self._encoder(rows), pin=pin)
        assert lease.tensor.shape == (rows, 4)
        if lease.pinned:
            assert lease.key in self.cache
            self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(j=st.integers(0, 100))
    def release(self, j: int) -> None:
        self.leases.pop(j % len(self.leases)).release()

    @rule()
    def reset(self) -> None:
        self.cache.reset(model="org/vlm")
        assert len(self.cache) == 0
        for lease in self.leases:  # held outputs stay usable; releasing them unpins nothing
            assert lease.tensor.numel() > 0
            lease.release()
        self.leases.clear()

    @invariant()
    def consistent(self) -> None:
        self.cache.check()
        s = self.cache.stats()
        assert s.bytes_held <= 512 and s.peak_bytes <= 512 and s.entries <= 6
        for lease in self.leases:
            if lease.pinned:
                assert lease.key in self.cache


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
