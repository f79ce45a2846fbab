"""Vision-language models in the reference engine: tiny random LLaVA and Idefics3 models.

Generation through kvtier must equal the plain Hugging Face model fed the
same pixels; the encoder cache must not change a single logit; block keys
must differ per image from the placeholder on.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tiny_vlm import png_bytes, tiny_idefics3, tiny_llava

from kvtier.engine import Engine, SamplingParams
from kvtier.errors import BadRequestError
from kvtier.keys import item_block_extra
from kvtier.mm.config import EncoderCacheSpec
from kvtier.mm.images import ImageLimits, decode_image
from kvtier.mm.keys import MediaItem

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)


def image(seed: int, size: tuple[int, int] = (40, 40)) -> MediaItem:
    data = png_bytes(seed, size)
    return MediaItem("image", data, decoded=decode_image(data, ImageLimits()))


def chat(text: str, n_images: int = 1) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image"}] * n_images
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def llava() -> tuple[Any, Any]:
    return tiny_llava()


def make_engine(model_tok: tuple[Any, Any], **kwargs: Any) -> Engine:
    model, tok = model_tok
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_blocks", 128)
    return Engine(model, tok, model_id="tiny-vlm", **kwargs)


def count_encodes(engine: Engine) -> list[int]:
    """Wrap the engine's vision tower so each encode is recorded."""
    assert engine.vlm is not None
    calls: list[int] = []
    inner = engine.vlm._features

    def counted(item: MediaItem) -> torch.Tensor:
        calls.append(1)
        return inner(item)

    engine.vlm._features = counted  # type: ignore[method-assign]
    return calls


def run(engine: Engine, ids: list[int], mm: Any, params: SamplingParams = GREEDY) -> Any:
    rid = engine.add_request(ids, params, mm=mm)
    tokens: list[int] = []
    logprobs: list[Any] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid and out.error is None, out.error
            tokens.extend(out.token_ids)
            logprobs.extend(out.logprobs)
    return tokens, logprobs


def hf_greedy(model: Any, ids: list[int], pixels: dict[str, torch.Tensor], n: int) -> list[int]:
    """The plain model's greedy tokens, full recomputation with the pixels each step."""
    seq = list(ids)
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq]), **pixels).logits[0, -1]
        out.append(int(torch.argmax(logits)))
        seq.append(out[-1])
    return out


def test_llava_generates_what_the_plain_model_does(llava: tuple[Any, Any]) -> None:
    engine = make_engine(llava)
    img = image(1)
    ids, mm = engine.encode_multimodal_chat(chat("describe"), [img])
    assert ids.count(engine.vlm.image_token_id) == engine.vlm.rows() == 16  # type: ignore[union-attr]
    tokens, _ = run(engine, ids, mm)
    pixels = engine.vlm.image_processor(images=[img.decoded], return_tensors="pt")  # type: ignore[union-attr]
    assert tokens == hf_greedy(llava[0], ids, {"pixel_values": pixels["pixel_values"]}, 6)
    engine.manager.check()
    engine.encoder_cache.check()  # type: ignore[union-attr]


def test_idefics3_generates_what_the_plain_model_does() -> None:
    model_tok = tiny_idefics3()
    engine = make_engine(model_tok, num_blocks=256)
    img = image(2, (70, 40))  # wider than a tile: split into tiles plus a global view
    ids, mm = engine.encode_multimodal_chat(chat("what is it"), [img])
    vlm = engine.vlm
    assert vlm is not None and vlm.grid(img) != (0, 0)
    tokens, _ = run(engine, ids, mm)
    out = vlm.image_processor(images=[[img.decoded]], return_tensors="pt")
    pixels = {"pixel_values": out["pixel_values"]}
    if "pixel_attention_mask" in out:
        pixels["pixel_attention_mask"] = out["pixel_attention_mask"]
    assert tokens == hf_greedy(model_tok[0], ids, pixels, 6)


def test_the_cache_changes_no_logit_and_images_do(llava: tuple[Any, Any]) -> None:
    cached = make_engine(llava, prefix_caching=False)
    uncached = make_engine(
        llava, prefix_caching=False, encoder_cache=EncoderCacheSpec(size_bytes=0)
    )
    assert uncached.encoder_cache is None
    calls = count_encodes(cached)
    ids, mm = cached.encode_multimodal_chat(chat("same text"), [image(1)])
    first = run(cached, ids, mm)
    ids2, mm2 = cached.encode_multimodal_chat(chat("same text"), [image(1)])
    second = run(cached, ids2, mm2)
    assert mm2.sources == ["memory"] and len(calls) == 1
    ids3, mm3 = uncached.encode_multimodal_chat(chat("same text"), [image(1)])
    plain = run(uncached, ids3, mm3)
    assert first == second == plain  # tokens and every logprob, bit for bit
    ids4, mm4 = cached.encode_multimodal_chat(chat("same text"), [image(2)])
    other = run(cached, ids4, mm4)
    assert ids4 == ids
    assert [lp.logprob for lp in other[1]] != [lp.logprob for lp in first[1]]


def test_block_keys_differ_per_image_from_the_placeholder_on(llava: tuple[Any, Any]) -> None:
    engine = make_engine(llava)
    bs = engine.manager.block_size
    ids, mm_a = engine.encode_multimodal_chat(chat("text after the image"), [image(1)])
    _, mm_b = engine.encode_multimodal_chat(chat("text after the image"), [image(2)])
    _, mm_a2 = engine.encode_multimodal_chat(chat("text after the image"), [image(1)])
    n = len(ids) // bs
    chain = engine.manager.hasher.chain

    def keys(mm: Any) -> list[int]:
        return chain(ids, block_extra=item_block_extra(mm.item_keys, 0, n, bs))

    a, b, a2 = keys(mm_a), keys(mm_b), keys(mm_a2)
    first = mm_a.placeholders[0].offset // bs  # the block of the first placeholder token
    assert first > 0
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))
    assert a == a2
    # Through the engine: the same image reuses the KV blocks, another reuses only the text.
    run(engine, ids, mm_a)
    rid = engine.add_request(ids, GREEDY, mm=mm_a2)
    engine.step()
    cached_same = engine.queues.group(rid)[0].metrics.cached_tokens
    while engine.has_unfinished():
        engine.step()
    rid = engine.add_request(ids, GREEDY, mm=mm_b)
    engine.step()
    cached_other = engine.queues.group(rid)[0].metrics.cached_tokens
    while engine.has_unfinished():
        engine.step()
    assert cached_same == (len(ids) - 1) // bs * bs
    assert cached_other == first * bs


def test_a_preempted_request_encodes_its_images_once(llava: tuple[Any, Any]) -> None:
    # 20 blocks of 4 tokens: three image prompts of ~30 tokens cannot all stay resident.
    # No encoder cache: the request itself keeps its features across preemption.
    engine = make_engine(
        llava, num_blocks=20, max_num_seqs=3, prefix_caching=False,
        encoder_cache=EncoderCacheSpec(size_bytes=0),
    )
    calls = count_encodes(engine)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reqs = [engine.encode_multimodal_chat(chat(f"r{i}"), [image(10 + i)]) for i in range(3)]
    solo = [run(engine, ids, mm, params)[0] for ids, mm in reqs]
    calls.clear()
    reqs = [engine.encode_multimodal_chat(chat(f"r{i}"), [image(10 + i)]) for i in range(3)]
    rids = [engine.add_request(ids, params, mm=mm) for ids, mm in reqs]
    got: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            got[out.request_id].extend(out.token_ids)
    assert engine.counters.preemptions > 0
    assert len(calls) == 3  # once per image although requests were recomputed
    assert [got[r] for r in rids] == solo
    engine.manager.check()


def test_bad_multimodal_requests_are_refused(llava: tuple[Any, Any]) -> None:
    engine = make_engine(llava)
    with pytest.raises(BadRequestError, match="may not contain"):
        engine.encode_multimodal_chat(
            [{"role": "user", "content": "<image> typed by hand"}], [image(1)]
        )
    ids, mm = engine.encode_multimodal_chat(chat("x"), [image(1)])
    bad = list(ids)
    bad[mm.placeholders[0].positions[0]] = 40
    with pytest.raises(BadRequestError, match="placeholders"):
        engine.add_request(bad, GREEDY, mm=mm)


def test_a_request_with_images_does_not_move(llava: tuple[Any, Any]) -> None:
    from kvtier.engine.migrate import migrate
    from kvtier.errors import MigrationError

    src, dst = make_engine(llava), make_engine(llava)
    ids, mm = src.encode_multimodal_chat(chat("stay"), [image(1)])
    rid = src.add_request(ids, GREEDY, mm=mm)
    src.step()
    with pytest.raises(MigrationError, match="carries images"):
        migrate(src, dst, rid)
    while src.has_unfinished():
        src.step()


def test_compress_request_finds_a_waiting_image_requests_blocks(llava: tuple[Any, Any]) -> None:
    """The keys compress_request looks up are the ones admission uses: image keys included."""
    from kvtier.offload.config import TierSpec

    engine = make_engine(llava, tiers=[TierSpec("device", 2**20, codec="int8")])
    bs = engine.manager.block_size
    ids, mm = engine.encode_multimodal_chat(chat("compress what the image made"), [image(1)])
    run(engine, ids, mm)  # its prompt's blocks stay cached
    ids2, mm2 = engine.encode_multimodal_chat(chat("compress what the image made"), [image(1)])
    rid = engine.add_request(ids2, GREEDY, mm=mm2)  # waiting: never stepped
    n_full = len(ids2) // bs
    first = mm2.placeholders[0].offset // bs
    assert 0 < first < n_full // 2
    # The first request cached its prompt and all but its last generated token.
    cached = (len(ids) + GREEDY.max_tokens - 1) // bs
    # Half of the waiting request's chain (and every block below it) moves: the
    # chain is all of its prompt's blocks, the image's included, so the moved
    # half starts past the image; keyed without the image it would be the
    # text before the image, and the half would start inside that text.
    moved = engine.compress_request(rid, 0.5)
    assert moved.blocks == cached - (n_full - math.ceil(n_full / 2))
    while engine.has_unfinished():
        engine.step()
    engine.manager.check()
    engine.close()
