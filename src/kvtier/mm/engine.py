"""The reference engine's multimodal steps: setup, request checks, features into a pass.

:class:`~kvtier.engine.Engine` calls these few functions so that its own
code stays that of a text model: a pass whose sequences have no images is
untouched (``input_ids``, as before); one that computes image placeholder
tokens gets its input embeddings from :func:`input_embeddings`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import BadRequestError, ConfigError
from kvtier.mm.cache import EncoderCache
from kvtier.mm.config import EncoderCacheSpec
from kvtier.mm.keys import MediaItem
from kvtier.mm.prompt import MultimodalPrompt, build_chat_prompt
from kvtier.mm.vlm import ImageTextModel, image_text_model

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine
    from kvtier.engine.request import Sequence as Seq

log = logging.getLogger("kvtier.engine")


def setup_multimodal(
    model: Any, tokenizer: Any, model_id: str, image_processor: Any, encoder_cache: Any
) -> tuple[ImageTextModel | None, EncoderCache | None]:
    """The model's image-text adapter (``None``: text only) and its encoder cache.

    ``encoder_cache`` is an :class:`EncoderCache`, an :class:`EncoderCacheSpec`
    (size 0: no cache, every request encodes its own images), or ``None``
    for the default spec.
    """
    vlm = image_text_model(model, tokenizer, image_processor, model_id=model_id)
    if isinstance(encoder_cache, EncoderCache):
        return vlm, encoder_cache
    if encoder_cache is not None and not isinstance(encoder_cache, EncoderCacheSpec):
        raise ConfigError(
            "encoder_cache must be an EncoderCache, an EncoderCacheSpec or None, got "
            f"{type(encoder_cache).__name__}"
        )
    if vlm is None:
        return None, None
    return vlm, (encoder_cache or EncoderCacheSpec()).build()


def describe_multimodal(vlm: ImageTextModel, cache: EncoderCache | None) -> list[str]:
    """The startup banner's lines about images."""
    lines = [f"images: {vlm.family}-style vision-language model, image token {vlm.image_token!r}"]
    if cache is None:
        lines.append("encoder cache: off (each request encodes its own images)")
    else:
        tiers = ", ".join(f"{t.name} {t.capacity_bytes / 2**20:.0f} MiB" for t in cache.tiers)
        lines.append(
            f"encoder cache: {cache.capacity_bytes / 2**20:.0f} MiB, policy {cache.policy.name}"
            + (f", {cache.max_entries} entries at most" if cache.max_entries else "")
            + (f"; tiers {tiers}" if tiers else "")
        )
    return lines


def encode_multimodal_chat(
    engine: Engine, messages: Sequence[dict[str, Any]], items: Sequence[MediaItem]
) -> tuple[list[int], MultimodalPrompt]:
    if engine.vlm is None:
        raise BadRequestError(
            f"model {engine.model_id} takes no images: send text content only",
            param="messages",
        )
    if not messages:
        raise BadRequestError("messages must be a non-empty list", param="messages")
    return build_chat_prompt(engine.vlm, list(messages), items, cache=engine.encoder_cache)


def fetch_features(
    batch: list[tuple[Seq, int]],
) -> tuple[list[tuple[Seq, int]], list[tuple[Seq, str]]]:
    """Fetch the features ``batch``'s chunks need.

    Returns the chunks that can run and, apart, each sequence whose images
    failed to encode with the error (the engine ends those alone).
    """
    kept: list[tuple[Seq, int]] = []
    failed: list[tuple[Seq, str]] = []
    for seq, n in batch:
        mm = seq.mm
        if mm is not None and mm.needs(seq.computed, seq.computed + n):
            try:
                mm.fetch(seq.computed, seq.computed + n)
            except Exception as exc:
                log.exception("encoding the images of request %s failed", seq.request_id)
                failed.append((seq, f"{type(exc).__name__}: {exc}"))
                continue
        kept.append((seq, n))
    return kept, failed


def input_embeddings(
    vlm: ImageTextModel | None, batch: list[tuple[Seq, int]], input_ids: torch.Tensor
) -> torch.Tensor:
    """The pass's input embeddings: token embeddings, features over image placeholders."""
    if vlm is None:
        raise BadRequestError("a request with images reached a text-only model")
    with torch.no_grad():
        embeds = vlm.embed_tokens(input_ids)
        flat = embeds[0]
        t = 0
        for seq, n in batch:
            if seq.mm is not None:
                seq.mm.write_features(flat, t, seq.computed, n)
            t += n
    return embeds
