"""Routing requests across several ``kvtier serve`` instances by the KV blocks each caches.

:mod:`kvtier.routing.index` builds, from the instances' KV events, which
token prefixes each instance holds; :mod:`kvtier.routing.events` reads those
events off ZeroMQ; :mod:`kvtier.routing.proxy` is the OpenAI-compatible
proxy ``kvtier route`` runs. Nothing here imports torch or the engine:
the router needs the model's tokenizer only (which transformers may read
with torch loaded).
"""

from __future__ import annotations

from kvtier.routing.index import InstanceIndex, PrefixIndex, block_hashes

__all__ = ["InstanceIndex", "PrefixIndex", "block_hashes"]
