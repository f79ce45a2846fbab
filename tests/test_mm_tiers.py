"""Encoder outputs on lower tiers: host, disk and Redis, shared with a second process, checked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from needs import need_redis_server
from redis_servers import RedisServer, redis_server_available

from kvtier.errors import ConfigError
from kvtier.mm import EncoderCache, EncoderSpec, EncoderTier, Expected, FunctionEncoder, MediaItem
from kvtier.mm.config import EncoderCacheSpec
from kvtier.offload.config import TierSpec

SPEC = EncoderSpec.make("org/vlm", "vision", "image", revision="r1")

# A second process: encode (or fetch) item 1 through a cache on the given tier; report
# where it came from and a checksum of the tensor.
CHILD = textwrap.dedent(
    """
    import sys, zlib, torch
    from kvtier.mm import EncoderCache, EncoderSpec, FunctionEncoder, MediaItem
    spec = EncoderSpec.make("org/vlm", "vision", "image", revision="r1")
    calls = []
    def fn(item):
        calls.append(1)
        return torch.full((4, 8), 9.0)
    cache = EncoderCache(1 << 20, tiers=[sys.argv[1]])
    lease = cache.acquire(MediaItem("image", b"image-1"), FunctionEncoder(spec, fn), pin=False)
    print(lease.source, len(calls), zlib.crc32(lease.tensor.numpy().tobytes()))
    """
)


def encoder(calls: list[int] | None = None) -> FunctionEncoder:
    def fn(item: MediaItem) -> torch.Tensor:
        if calls is not None:
            calls.append(1)
        g = torch.Generator().manual_seed(zlib.crc32(bytes(item.data)))
        return torch.randn(4, 8, generator=g)

    return FunctionEncoder(SPEC, fn)


def run_child(url: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, url], capture_output=True, text=True, check=True, timeout=120
    )
    return out.stdout.split()


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().numpy().tobytes())


def test_an_evicted_output_comes_back_from_the_host_tier() -> None:
    calls: list[int] = []
    cache = EncoderCache(128, tiers=["host:1MiB"])  # memory holds one 128-byte output
    first = cache.get_or_encode(MediaItem("image", b"a"), encoder(calls))
    cache.get_or_encode(MediaItem("image", b"b"), encoder(calls))
    lease = cache.acquire(MediaItem("image", b"a"), encoder(calls), pin=False)
    assert lease.source == "tier:host" and len(calls) == 2
    assert torch.equal(lease.tensor, first)
    s = cache.stats()
    assert s.tier_hits == 1 and s.tiers["host"]["hits"] == 1
    cache.check()


def test_a_second_process_hits_on_disk(tmp_path: Path) -> None:
    url = f"disk:{tmp_path}?size=1MiB"
    assert run_child(url)[:2] == ["encoder", "1"]
    source, calls, check = run_child(url)  # a restarted process
    assert (source, calls) == ("tier:disk", "0")
    assert int(check) == zlib.crc32(torch.full((4, 8), 9.0).numpy().tobytes())


@pytest.mark.skipif(not redis_server_available(), reason="needs redis-server")
def test_a_second_process_hits_on_redis() -> None:
    need_redis_server()
    server = RedisServer().start()
    try:
        assert run_child(server.url)[:2] == ["encoder", "1"]
        assert run_child(server.url)[:2] == ["tier:redis", "0"]
        # This process, too, finds what the child stored.
        cache = EncoderCache(1 << 20, tiers=[server.url])
        lease = cache.acquire(MediaItem("image", b"image-1"), encoder(), pin=False)
        assert lease.source == "tier:redis"
        assert torch.equal(lease.tensor, torch.full((4, 8), 9.0))
        cache.close()
    finally:
        server.stop()


def disk_file(root: Path) -> Path:
    files = list(root.rglob("*.kvb"))
    assert len(files) == 1
    return files[0]


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_flipped_bit_is_a_counted_miss(tmp_path: Path, where: str) -> None:
    url = f"disk:{tmp_path}?size=1MiB"
    writer = EncoderCache(1 << 20, tiers=[url])
    good = writer.get_or_encode(MediaItem("image", b"x"), encoder())
    path = disk_file(tmp_path)
    blob = bytearray(path.read_bytes())
    blob[10 if where == "header" else len(blob) - 5] ^= 0x10
    path.write_bytes(bytes(blob))
    calls: list[int] = []
    reader = EncoderCache(1 << 20, tiers=[url])
    lease = reader.acquire(MediaItem("image", b"x"), encoder(calls), pin=False)
    assert lease.source == "encoder" and len(calls) == 1  # never served the bad blob
    assert torch.equal(lease.tensor, good)
    t = reader.stats().tiers["disk"]
    assert t["corrupt"] == 1 and t["hits"] == 0


def test_a_blob_of_another_shape_or_dtype_is_a_counted_miss(tmp_path: Path) -> None:
    url = f"disk:{tmp_path}?size=1MiB"
    EncoderCache(1 << 20, tiers=[url]).get_or_encode(MediaItem("image", b"x"), encoder())
    calls: list[int] = []
    reader = EncoderCache(1 << 20, tiers=[url])
    lease = reader.acquire(
        MediaItem("image", b"x"), encoder(calls), pin=False,
        expected=Expected((5, 8), torch.float32),
    )
    assert lease.source == "encoder" and len(calls) == 1
    assert reader.stats().tiers["disk"]["mismatched"] == 1
    other = EncoderCache(1 << 20, tiers=[url])
    lease = other.acquire(
        MediaItem("image", b"x"), encoder(calls), pin=False, expected=Expected(dtype=torch.float16)
    )
    assert lease.source == "encoder"


@pytest.mark.parametrize(
    "other_spec",
    [
        EncoderSpec.make("org/another-vlm", "vision", "image", revision="r1"),
        EncoderSpec.make("org/vlm", "vision", "image", revision="r2"),
    ],
    ids=["another model", "another revision"],
)
def test_another_model_never_reads_the_blob(tmp_path: Path, other_spec: EncoderSpec) -> None:
    url = f"disk:{tmp_path}?size=1MiB"
    EncoderCache(1 << 20, tiers=[url]).get_or_encode(MediaItem("image", b"x"), encoder())
    calls: list[int] = []
    cache = EncoderCache(1 << 20, tiers=[url])
    enc = FunctionEncoder(other_spec, lambda it: calls.append(1) or torch.zeros(4, 8))
    lease = cache.acquire(MediaItem("image", b"x"), enc, pin=False)
    assert lease.source == "encoder" and calls == [1]
    # The model that stored it reads it back from the tier, without encoding.
    again = EncoderCache(1 << 20, tiers=[url])
    mine: list[int] = []
    enc_mine = FunctionEncoder(SPEC, lambda it: mine.append(1) or torch.zeros(4, 8))
    assert again.acquire(MediaItem("image", b"x"), enc_mine, pin=False).source != "encoder"
    assert mine == []


def test_reset_frees_a_model_on_the_tiers(tmp_path: Path) -> None:
    url = f"disk:{tmp_path}?size=1MiB"
    cache = EncoderCache(1 << 20, tiers=[url])
    for i in range(3):
        cache.get_or_encode(MediaItem("image", bytes([i])), encoder())
    assert len(list(tmp_path.rglob("*.kvb"))) == 3
    assert cache.reset(model="org/vlm") == 3
    assert list(tmp_path.rglob("*.kvb")) == []
    assert cache.stats().tiers["disk"]["entries"] == 0


def test_a_tier_keeps_its_budget(tmp_path: Path) -> None:
    tier = EncoderTier.from_spec(TierSpec.from_url(f"disk:{tmp_path}?size=2000"))
    for i in range(20):
        tier.store(i + 1, torch.ones(4, 8), "m")
        assert tier.used_bytes <= 2000
    assert tier.evictions > 0
    assert len(list(tmp_path.rglob("*.kvb"))) == len(tier)


def test_a_down_redis_is_a_counted_miss() -> None:
    from redis_servers import free_port

    cache = EncoderCache(1 << 20, tiers=[f"redis://127.0.0.1:{free_port()}/0"])
    calls: list[int] = []
    out = cache.get_or_encode(MediaItem("image", b"x"), encoder(calls))
    assert out.shape == (4, 8) and calls == [1]
    assert cache.stats().tiers["redis"]["unavailable"] >= 1


def test_lossy_codecs_are_refused() -> None:
    with pytest.raises(ConfigError, match="losslessly"):
        EncoderCacheSpec(tiers=(TierSpec.from_url("host:1MiB?codec=int8"),))
