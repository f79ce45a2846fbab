"""Media by name, and items of any shape: adding a medium is one module and one registration.

``tests/dict_medium.py`` defines a medium outside kvtier; a tier URL that
names its module imports and registers it, and it then serves a tier chain
and an engine like the built-in media do. Every built-in medium stores items
of different shapes and dtypes side by side (encoder outputs beside KV
blocks), each read back verified against its own header.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from needs import need_module, need_redis_server

torch = need_module("torch")

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.offload.codec import make_codec, verify  # noqa: E402
from kvtier.offload.config import TierSpec  # noqa: E402
from kvtier.offload.media import BlockStore, ItemFormat  # noqa: E402
from kvtier.offload.registry import available_media, make_medium  # noqa: E402

TESTS = Path(__file__).parent


def test_an_out_of_tree_medium_loads_by_module_and_serves_an_engine() -> None:
    sys.modules.pop("dict_medium", None)
    spec = TierSpec.from_url("dict:shelf-a?size=4MiB&module=dict_medium")
    assert spec.medium == "dict" and spec.location == "shelf-a"
    assert "dict" in available_media()
    from tiny_model import solo_greedy, tiny_model_and_tokenizer

    from kvtier.engine import Engine, SamplingParams

    model, tok = tiny_model_and_tokenizer()
    kw = {"model_id": "tiny", "block_size": 4, "num_blocks": 64}
    a = Engine(model, tok, tiers=[spec], **kw)
    assert a.tiers is not None and a.tiers.write_mode == "write_through"  # shared medium
    prompt = list(range(5, 5 + 33))
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = [t for o in a.generate(prompt, p) for t in o.token_ids]
    a.tiers.flush()
    b = Engine(model, tok, tiers=[TierSpec.from_url("dict:shelf-a?size=4MiB")], **kw)
    second = [t for o in b.generate(prompt, p) for t in o.token_ids]
    assert first == second == solo_greedy(model, prompt, 4)
    assert b.counters.loaded_prompt_tokens == 32  # every full block came from the shelf
    a.close()
    b.close()


def test_unknown_media_options_and_modules_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="registered media are"):
        TierSpec("floppy", 2**20)
    with pytest.raises(ConfigError, match="names no registered medium"):
        TierSpec.from_url("floppy:/a?size=1MiB")
    with pytest.raises(ConfigError, match="no option colour"):
        TierSpec.from_url("disk:/tmp/x?colour=red")
    with pytest.raises(ConfigError, match="cannot import the medium module"):
        TierSpec.from_url("dict:x?module=no_such_medium_module")
    with pytest.raises(ConfigError, match="needs a directory"):
        TierSpec("disk", 2**20)
    with pytest.raises(ConfigError, match="fsync must be true or false"):
        TierSpec.from_url("disk:/tmp/x?fsync=maybe")


def test_tier_urls_round_trip() -> None:
    for url in (
        "host:4GiB",
        "disk:/var/cache/kvtier?size=100GiB&codec=int8&write=through&fsync=true",
        "redis://10.0.0.5:6379/0?ttl=3600",
        "redis+cluster://10.0.0.5:7000,10.0.0.6:7001?size=1GiB",
    ):
        spec = TierSpec.from_url(url)
        assert TierSpec.from_url(spec.describe()) == spec, url


SHAPES = [((2, 3, 4), torch.float32), ((7,), torch.bfloat16), ((1, 5, 2, 2), torch.float16)]


def _items_of_any_shape(store: BlockStore) -> None:
    codec = make_codec("raw")
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen).to(dtype) for shape, dtype in SHAPES]
    fmts = [ItemFormat(codec, shape, dtype) for shape, dtype in SHAPES]
    store.bind("any-shape", 8, None)
    store.put(
        [
            (100 + i, i, codec.encode(t), f)
            for i, (t, f) in enumerate(zip(tensors, fmts, strict=True))
        ]
    )
    got = store.get([(100 + i, i) for i in range(len(SHAPES))])
    for i, (stored, t, f) in enumerate(zip(got, tensors, fmts, strict=True)):
        assert stored is not None
        header, payload = stored
        decoded = verify(header, payload, 100 + i, f.shape, f.dtype).decode(
            payload, f.shape, f.dtype
        )
        assert torch.equal(decoded, t)
    store.close()


def test_host_memory_holds_items_of_any_shape() -> None:
    _items_of_any_shape(make_medium("host", ""))


def test_a_directory_holds_items_of_any_shape(tmp_path: Path) -> None:
    _items_of_any_shape(make_medium("disk", str(tmp_path)))


def test_redis_holds_items_of_any_shape() -> None:
    need_redis_server()
    need_module("redis", "install the redis extra")
    from redis_servers import RedisServer

    with RedisServer() as server:
        _items_of_any_shape(make_medium("redis", server.url))


def test_an_out_of_tree_medium_holds_items_of_any_shape() -> None:
    import dict_medium  # noqa: F401  (registers "dict")

    _items_of_any_shape(make_medium("dict", "shapes"))


def test_fixed_slot_host_memory_refuses_an_item_too_large() -> None:
    store = make_medium("host", "")
    codec = make_codec("raw")
    store.bind("ns", 2, 16)
    big = torch.zeros(8)  # 32 bytes
    with pytest.raises(ConfigError, match="does not fit"):
        store.put([(1, 0, codec.encode(big), ItemFormat(codec, (8,), torch.float32))])
