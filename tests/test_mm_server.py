"""Image chat over the OpenAI-compatible server, from the official ``openai`` client.

A tiny random LLaVA served in-process (and once by ``kvtier serve --model DIR``
from a saved directory): image_url parts with data URLs are answered, repeated
images hit the encoder cache, and every bad image is a 400 that says why.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_launch import kvtier_cli, read_banner
from serving import serving
from tiny_vlm import png_bytes, tiny_llava

from kvtier.engine import Engine
from kvtier.mm.images import ImageLimits, image_data_url

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

MODEL = "tiny-vlm"


def image_part(data: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": image_data_url(data, mime)}}


def ask(client: Any, *parts: dict[str, Any], text: str = "what is this?") -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        max_tokens=4,
        temperature=0,
    )


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png_bytes(5))
    return root


@pytest.fixture(scope="module")
def server(media_dir: Path) -> Iterator[Any]:
    model, tok = tiny_llava()
    engine = Engine(model, tok, model_id=MODEL, num_blocks=256, block_size=4)
    limits = ImageLimits(max_images=2, max_bytes=20_000, allowed_dir=str(media_dir))
    with serving(engine, MODEL, image_limits=limits) as srv:
        yield srv


def test_an_image_chat_is_answered_and_a_repeat_hits_the_cache(server: Any) -> None:
    client = server.client()
    first = ask(client, image_part(png_bytes(1)))
    assert first.choices[0].message.content is not None
    assert first.usage.prompt_tokens > 16  # the image's 16 placeholder tokens are in the prompt
    again = ask(client, image_part(png_bytes(1)), text="and now?")
    assert again.choices[0].message.content is not None
    stats = client.get("/cache/stats", cast_to=object)["encoder_cache"]
    assert stats["misses"] == 1 and stats["hits"] == 1
    assert stats["by_modality"]["image"]["hits"] == 1


def test_metrics_report_the_encoder_cache(server: Any) -> None:
    import urllib.request

    ask(server.client(), image_part(png_bytes(3)))
    with urllib.request.urlopen(f"{server.base}/metrics", timeout=30) as r:
        text = r.read().decode()
    assert 'kvtier_encoder_cache_misses_total{modality="image"}' in text
    assert "kvtier_encoder_cache_bytes " in text


def test_two_images_and_a_file_url(server: Any, media_dir: Path) -> None:
    client = server.client()
    cat = {"type": "image_url", "image_url": {"url": (media_dir / "cat.png").as_uri()}}
    reply = ask(client, image_part(png_bytes(1)), cat)
    assert reply.usage.prompt_tokens > 32


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "never fetches images from the network"),
        ("data:image/png;base64,iVBORw0KGgo=", "cannot be decoded"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:text/plain;base64,aGk=", "image/* type"),
        ("ftp://x/y.png", "unsupported image URL scheme"),
        ("file:///etc/passwd", "not a file under the allowed media directory"),
    ],
)
def test_bad_images_are_400s_that_say_why(server: Any, url: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(server.client(), {"type": "image_url", "image_url": {"url": url}})
    assert message in str(info.value)


def test_too_many_or_too_large_images_are_400s(server: Any) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="at most 2 per request"):
        ask(client, *[image_part(png_bytes(i)) for i in range(3)])
    big = png_bytes(9, (200, 200))  # about 120 kB of random pixels, over 20,000 bytes
    with pytest.raises(openai.BadRequestError, match="larger than 20,000 bytes"):
        ask(client, image_part(big))


def test_a_text_model_refuses_images() -> None:
    from tiny_model import tiny_engine

    with (
        serving(tiny_engine(), "tiny-chat") as srv,
        pytest.raises(openai.BadRequestError, match="takes no images"),
    ):
        srv.client().chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": [image_part(png_bytes(1))]}],
            max_tokens=2,
        )


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT")
def test_kvtier_serve_runs_a_saved_vision_language_model(tmp_path: Path) -> None:
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    model, tok = tiny_llava()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    LlavaImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(tmp_path)
    proc = subprocess.Popen(
        kvtier_cli(
            "serve", "--model", str(tmp_path), "--served-model-name", MODEL, "--port", "0",
            "--num-blocks", "128", "--encoder-cache-size", "1MiB",
            "--encoder-cache-tier", f"disk:{tmp_path / 'enc'}?size=1MiB", "--log-level", "warning",
        ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = read_banner(proc)
        text = "".join(lines)
        assert "llava-style vision-language model" in text and "encoder cache: 1 MiB" in text
        url = lines[-1].split(" at ", 1)[1].split(" ", 1)[0]
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        reply = ask(client, image_part(png_bytes(1)))
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert list((tmp_path / "enc").rglob("*.kvb"))  # written through to the disk tier
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_image_data_url_round_trips() -> None:
    data = png_bytes(1)
    assert base64.b64decode(image_data_url(data).split(",", 1)[1]) == data


def test_serve_flags_become_the_encoder_cache_and_image_limits(tmp_path: Path) -> None:
    from kvtier.cli import build_parser
    from kvtier.cli.serve import engine_config, image_limits

    parser, _ = build_parser()
    args = parser.parse_args([
        "serve", "--encoder-cache-size", "2MiB", "--encoder-cache-policy", "lfu",
        "--encoder-cache-tier", f"disk:{tmp_path}?size=1MiB", "--encoder-cache-entries", "9",
        "--max-images-per-request", "3", "--allowed-local-media-path", str(tmp_path),
    ])
    spec = engine_config(args).encoder_cache
    assert (spec.size_bytes, spec.policy, spec.max_entries) == (2 * 2**20, "lfu", 9)
    assert spec.tiers[0].medium == "disk"
    limits = image_limits(args)
    assert limits.max_images == 3 and limits.allowed_dir == str(tmp_path.resolve())
    off = engine_config(parser.parse_args(["serve", "--encoder-cache-size", "0"]))
    assert not off.encoder_cache.enabled and off.encoder_cache.build() is None
