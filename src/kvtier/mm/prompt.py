"""A request's images in the engine: placeholders in the prompt, content keys, features once.

:func:`build_chat_prompt` turns chat messages whose content holds images
into token ids: the model's chat template places one image token per image,
and each is expanded into the image's placeholder tokens
(:meth:`~kvtier.mm.vlm.ImageTextModel.placeholder_ids`). The result is a
:class:`MultimodalPrompt`, which the engine keeps with the request:

* :attr:`~MultimodalPrompt.item_keys` (the position of each image's first
  placeholder token, and its content key) go to the KV manager, so block
  keys differ per image from the block holding that position onward;
* :meth:`~MultimodalPrompt.write_features` fills a forward pass's input
  embeddings at the placeholder positions the pass computes. The features of
  an image are fetched the first time a pass needs them (from the encoder
  cache, which runs the encoder on a miss) and then kept until the request
  ends, so a preempted and resumed request never encodes again, and a
  request whose image blocks are all prefix-cache hits never encodes at all.
  With a cache, each image's entry stays pinned (a :class:`~kvtier.mm.cache.Lease`)
  until :meth:`~MultimodalPrompt.release`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import BadRequestError
from kvtier.keys import ItemKey
from kvtier.mm.cache import EncoderCache, Lease
from kvtier.mm.keys import ItemKeyer, MediaItem
from kvtier.mm.vlm import ImageTextModel, check_feature_rows


@dataclass(frozen=True)
class Placeholder:
    """Where one item sits in a prompt."""

    #: Position of its first placeholder token.
    offset: int
    #: Tokens its placeholder spans.
    length: int
    #: Positions its feature rows fill, in row order (the image tokens of the span).
    positions: tuple[int, ...]
    item: MediaItem
    #: Its content key (also mixed into the KV block keys).
    key: int


class MultimodalPrompt:
    """A request's items and their features (see the module docstring)."""

    def __init__(
        self,
        model: ImageTextModel,
        placeholders: Sequence[Placeholder],
        cache: EncoderCache | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.placeholders = list(placeholders)
        self._features: list[torch.Tensor | None] = [None] * len(self.placeholders)
        self._leases: list[Lease | None] = [None] * len(self.placeholders)
        #: Positions of every feature row, and the (item, row) each one is.
        self._all = sorted(
            (pos, i, row)
            for i, p in enumerate(self.placeholders)
            for row, pos in enumerate(p.positions)
        )
        self._starts = [pos for pos, _, _ in self._all]
        #: Where each item's features came from ("memory", "encoder", "tier:disk", ...).
        self.sources: list[str | None] = [None] * len(self.placeholders)

    @property
    def item_keys(self) -> tuple[ItemKey, ...]:
        return tuple((p.offset, p.key) for p in self.placeholders)

    def __len__(self) -> int:
        return len(self.placeholders)

    def _span(self, start: int, end: int) -> tuple[int, int]:
        return bisect.bisect_left(self._starts, start), bisect.bisect_left(self._starts, end)

    def needs(self, start: int, end: int) -> bool:
        """Whether positions ``start .. end-1`` hold any feature row."""
        lo, hi = self._span(start, end)
        return hi > lo

    def fetch(self, start: int, end: int) -> None:
        """Make sure the features of the items covering ``start .. end-1`` are here."""
        lo, hi = self._span(start, end)
        for i in sorted({self._all[j][1] for j in range(lo, hi)}):
            self.features(i)

    def features(self, i: int) -> torch.Tensor:
        """Item ``i``'s features, fetched (or encoded) the first time only."""
        have = self._features[i]
        if have is not None:
            return have
        p = self.placeholders[i]
        rows = len(p.positions)
        if self.cache is not None:
            lease = self.cache.acquire(
                p.item, self.model, expected=self.model.expected(rows), key=p.key
            )
            self._leases[i] = lease
            feats, self.sources[i] = lease.tensor, lease.source
        else:
            feats, self.sources[i] = self.model.encode(p.item), "encoder"
        check_feature_rows(feats, rows, f"image {i}")
        self._features[i] = feats
        return feats

    def write_features(self, embeds: torch.Tensor, flat_start: int, start: int, n: int) -> None:
        """Overwrite ``embeds[flat_start + j]`` with the feature row at position ``start + j``."""
        lo, hi = self._span(start, start + n)
        if hi <= lo:
            return
        by_item: dict[int, tuple[list[int], list[int]]] = {}
        for pos, i, row in self._all[lo:hi]:
            slots, rows = by_item.setdefault(i, ([], []))
            slots.append(flat_start + pos - start)
            rows.append(row)
        for i, (slots, rows) in by_item.items():
            feats = self.features(i)
            index = torch.tensor(slots, dtype=torch.long, device=embeds.device)
            src = feats[torch.tensor(rows, dtype=torch.long, device=feats.device)]
            embeds.index_copy_(0, index, src.to(embeds.device, embeds.dtype))

    def release(self) -> None:
        """Unpin every item's cache entry (the request ended); idempotent."""
        for lease in self._leases:
            if lease is not None:
                lease.release()
        self._features = [None] * len(self.placeholders)


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # a template raising on odd input is the caller's input
        raise BadRequestError(
            f"messages do not fit the chat template: {exc}", param="messages"
        ) from exc
    if not isinstance(text, str):
        raise BadRequestError("the chat template did not render text", param="messages")
    return text


def _as_text(messages: list[dict[str, Any]], image_token: str) -> list[dict[str, Any]]:
    """Messages with each image part written as the model's image token, content as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(
                image_token if part.get("type") == "image" else str(part.get("text", ""))
                for part in content
            )
        out.append({**m, "content": content})
    return out


def _refuse_typed_image_tokens(messages: list[dict[str, Any]], image_token: str) -> None:
    """Text that spells the image token would place an image where the client put none."""
    for m in messages:
        content = m.get("content")
        texts = [content] if isinstance(content, str) else [
            part.get("text") for part in content or () if isinstance(part, dict)
        ]
        if any(isinstance(t, str) and image_token in t for t in texts):
            raise BadRequestError(
                f"message text may not contain the model's image token {image_token!r}: send "
                "images as image_url content parts",
                param="messages",
            )


def build_chat_prompt(
    model: ImageTextModel,
    messages: list[dict[str, Any]],
    items: Sequence[MediaItem],
    *,
    cache: EncoderCache | None = None,
    keyer: ItemKeyer | None = None,
) -> tuple[list[int], MultimodalPrompt]:
    """Token ids of ``messages`` (content parts ``{"type": "image"}`` in order of ``items``).

    The chat template is first given the parts as they are (templates of
    vision-language models write the image token for them); a template that
    only takes text gets the image token written into the text instead.
    """
    tok = model.tokenizer
    n = len(items)
    _refuse_typed_image_tokens(messages, model.image_token)
    text = _render(tok, messages)
    if text.count(model.image_token) != n:
        text = _render(tok, _as_text(messages, model.image_token))
    if text.count(model.image_token) != n:
        raise BadRequestError(
            f"the model's chat template does not place the {n} images of this request "
            f"(or the text itself holds {model.image_token!r}): remove that text",
            param="messages",
        )
    ids = list(tok.encode(text, add_special_tokens=False))
    marks = [i for i, t in enumerate(ids) if t == model.image_token_id]
    if len(marks) != n:
        raise BadRequestError(
            f"the prompt holds {len(marks)} image tokens for {n} images: the text may not "
            f"contain {model.image_token!r}",
            param="messages",
        )
    keyer = keyer or (cache.keyer if cache is not None else ItemKeyer())
    out: list[int] = []
    placeholders: list[Placeholder] = []
    prev = 0
    for mark, item in zip(marks, items, strict=True):
        out.extend(ids[prev:mark])
        span = model.placeholder_ids(item)
        offset = len(out)
        positions = tuple(offset + j for j, t in enumerate(span) if t == model.image_token_id)
        placeholders.append(
            Placeholder(offset, len(span), positions, item, keyer.key(item, model.spec))
        )
        out.extend(span)
        prev = mark + 1
    out.extend(ids[prev:])
    return out, MultimodalPrompt(model, placeholders, cache)


__all__ = ["MultimodalPrompt", "Placeholder", "build_chat_prompt"]
