"""Model-family layer code: every kind of layer kvtier serves from its blocks, and what
a config says about its layers.

- :mod:`~kvtier.layers.registry`: the :class:`LayerKind` registry that
  :func:`install_kinds` runs over a model.
- The kinds, each registering itself: :mod:`~kvtier.layers.latent`
  (MLA latents), :mod:`~kvtier.layers.own` (attention in code of its
  own), :mod:`~kvtier.layers.conv` (short convolutions),
  :mod:`~kvtier.layers.state` (linear attention and Mamba),
  :mod:`~kvtier.layers.local` (chunked and position-scaled attention).
- What they share: :mod:`~kvtier.layers.base` (the mixin dispatch),
  :mod:`~kvtier.layers.batch` (one batched pass).
- Read from a config alone, before any weight loads:
  :mod:`~kvtier.layers.attention_spec` (windows and layer plans),
  :mod:`~kvtier.layers.state_spec` (recurrent states),
  :mod:`~kvtier.layers.geometry` (a block's shape) and
  :mod:`~kvtier.layers.support` (exact, or refused with the reason).

Nothing here imports the engine's roles; they import this.
"""

from kvtier.layers import conv, latent, local, own, state
from kvtier.layers.registry import LayerKind, install_kinds, kinds, register

__all__ = [
    "LayerKind",
    "conv",
    "install_kinds",
    "kinds",
    "latent",
    "local",
    "own",
    "register",
    "state",
]
