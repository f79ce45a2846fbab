"""The dispatch shared by model layers whose per-sequence memory kvtier keeps in its blocks.

Short convolutions (:mod:`kvtier.layers.conv`) and linear-attention /
Mamba layers (:mod:`kvtier.layers.state`) are served by mixing a
class into the model's own module class (:func:`mix_in`). The mixed-in
``forward`` takes the engine's batched pass (a ``kvtier_batch`` argument)
to ``_batched`` and a :class:`BlockCache` (a :class:`~kvtier.engine.KvTierCache`)
to ``_cached``;
any other call runs the model's own code unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvtier.layers.batch import BatchMeta
    from kvtier.storage import KVBlockStorage


class BlockCache:
    """What a cache whose K/V live in kvtier's blocks is (:class:`~kvtier.engine.KvTierCache`):
    the layers test for this base, so they need not import the cache itself."""

    #: The blocks the cache's K/V live in.
    storage: KVBlockStorage


class BlockBackedLayer:
    """Base of the mixins: where a call goes, by what it carries."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        meta: BatchMeta | None = kwargs.get("kvtier_batch")
        if meta is not None:
            return self._batched(hidden_states, meta)
        if isinstance(cache, BlockCache):
            return self._cached(hidden_states, cache, attention_mask)
        return super().forward(  # type: ignore[misc]
            hidden_states, cache=cache, attention_mask=attention_mask, **kwargs
        )

    def _batched(self, hidden_states: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        raise NotImplementedError

    def _cached(
        self, hidden_states: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError


_CLASSES: dict[tuple[type, type], type] = {}


def mix_in(module: torch.nn.Module, mixin: type) -> None:
    """Give ``module`` the behaviour of ``mixin`` ahead of its own class (idempotent)."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    mixed = _CLASSES.get((cls, mixin))
    if mixed is None:
        mixed = _CLASSES[cls, mixin] = type(f"KvTier{cls.__name__}", (mixin, cls), {})
    module.__class__ = mixed
