"""The registry of layer kinds: how each kind of model layer is switched to kvtier's blocks.

A model is served from kvtier's blocks by the paged attention (attention
layers that call transformers' attention interface) plus one *layer kind*
for each other way a layer keeps per-sequence memory: MLA's latents,
attention that attends in code of its own, short convolutions, linear
attention and Mamba states, chunked and position-scaled local attention. A
kind is one module that registers a :class:`LayerKind`; installing a model
(:func:`install_kinds`) runs every registered kind over it, and each switches
the modules it recognises and leaves the rest alone. The engine's roles
never name a kind, so a new attention feature adds a module here and
changes nothing there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.errors import KvTierError


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer and how a model's modules of that kind are switched."""

    #: A short name, unique in the registry (what :func:`install_kinds` reports).
    name: str
    #: Switches every module of the model this kind recognises (idempotent); how many.
    install: Callable[[Any], int]
    #: Whether a :class:`~kvtier.engine.KvTierCache` (``generate`` outside the engine)
    #: needs it too, not only the engine's batched passes.
    for_cache: bool = False


_KINDS: dict[str, LayerKind] = {}


def register(kind: LayerKind) -> LayerKind:
    """Add ``kind`` to the registry; kinds install in the order they register."""
    if kind.name in _KINDS and _KINDS[kind.name] != kind:
        raise KvTierError(f"a layer kind named {kind.name!r} is already registered")
    _KINDS[kind.name] = kind
    return kind


def kinds() -> tuple[LayerKind, ...]:
    """Every registered kind, in registration order."""
    return tuple(_KINDS.values())


def install_kinds(model: Any, *, for_cache: bool = False) -> dict[str, int]:
    """Run every registered kind (only those a cache needs, with ``for_cache``) over
    ``model``; how many modules each switched, for the kinds that found any."""
    found: dict[str, int] = {}
    for kind in _KINDS.values():
        if for_cache and not kind.for_cache:
            continue
        count = kind.install(model)
        if count:
            found[kind.name] = count
    return found
