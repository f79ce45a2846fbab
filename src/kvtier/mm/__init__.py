"""Multimodal inputs: the encoder-output cache, image inputs, and vision-language models.

* :mod:`~kvtier.mm.keys`: content keys (:class:`EncoderSpec`, :class:`MediaItem`,
  :class:`ItemKeyer`): what an encoder output depends on, hashed to 128 bits;
* :mod:`~kvtier.mm.cache`: :class:`EncoderCache`, outputs computed once under a
  byte budget, single-flight, pinned while in use;
* :mod:`~kvtier.mm.tiers`: :class:`EncoderTier`, outputs on host memory, disk or
  Redis, shared with other processes and checked on every read;
* :mod:`~kvtier.mm.images`: image inputs from OpenAI content parts (data URLs,
  ``file://`` under an allowed directory), with limits;
* :mod:`~kvtier.mm.vlm`: LLaVA-style and Idefics3/SmolVLM-style models in the
  reference engine; :mod:`~kvtier.mm.prompt`: a request's images, placeholders
  and features.

``kvtier.mm.keys`` needs no torch; the rest loads on first use.
"""

from __future__ import annotations

from kvtier._lazy import lazy_exports
from kvtier.mm.keys import (
    KEY_ALGORITHMS,
    MM_KEY_VERSION,
    MODALITIES,
    EncoderSpec,
    ItemKeyer,
    MediaItem,
)

__all__ = [
    "KEY_ALGORITHMS",
    "MM_KEY_VERSION",
    "MODALITIES",
    "EncoderSpec",
    "ItemKeyer",
    "MediaItem",
]

_LAZY = {
    "EncoderCache": "kvtier.mm.cache",
    "EncoderCacheStats": "kvtier.mm.cache",
    "FunctionEncoder": "kvtier.mm.cache",
    "ItemEncoder": "kvtier.mm.cache",
    "Lease": "kvtier.mm.cache",
    "EncoderTier": "kvtier.mm.tiers",
    "Expected": "kvtier.mm.tiers",
}

__getattr__, __dir__ = lazy_exports("kvtier.mm", globals(), _LAZY)
