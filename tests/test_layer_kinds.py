"""The layer-kind registry: a kind is one module that registers itself, and installing a
model runs every kind over it, each switching only the modules it recognises."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import torch

from kvtier.conformance.tiny import causal_lm_class, char_tokenizer, tiny_config
from kvtier.errors import KvTierError
from kvtier.layers import registry
from kvtier.layers.registry import LayerKind, install_kinds, kinds, register


def _tiny(model_type: str, **fields: Any) -> Any:
    config = tiny_config(model_type, len(char_tokenizer()), **fields)
    torch.manual_seed(0)
    return causal_lm_class(model_type)(config).eval()


def test_every_builtin_kind_is_registered_once() -> None:
    names = [k.name for k in kinds()]
    assert sorted(names) == ["latent", "local", "own-attention", "short-conv", "state"]
    assert len(set(names)) == len(names)
    # Only the convolutions keep memory a plain KvTierCache (``generate``) needs switched.
    assert [k.name for k in kinds() if k.for_cache] == ["short-conv"]


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("llama", set()),  # plain attention: the paged attention alone
        ("lfm2", {"short-conv"}),
        ("deepseek_v3", {"latent"}),
        ("falcon", {"own-attention"}),
        ("qwen3_next", {"state"}),
        ("llama4_text", {"local"}),
    ],
)
def test_installing_a_family_switches_only_its_own_kinds(
    model_type: str, expected: set[str]
) -> None:
    from kvtier.engine.paged import install

    model = _tiny(model_type)
    found = install(model)
    assert set(found) == expected
    assert all(count > 0 for count in found.values())
    # Idempotent: a second install finds the same modules and switches nothing twice.
    classes = [type(m) for m in model.modules()]
    assert install(model) == found
    assert [type(m) for m in model.modules()] == classes


def test_a_new_kind_joins_by_registering(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.engine.paged import install

    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    seen: list[int] = []

    def mark(model: Any) -> int:
        layers = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)]
        seen.extend(int(m.layer_idx) for m in layers)
        return len(layers)

    kind = register(LayerKind("marker", mark))
    model = _tiny("llama")
    found = install(model)
    assert found["marker"] == len(seen) > 0
    # A cache-only install skips a kind that did not ask for it.
    assert "marker" not in install_kinds(model, for_cache=True)
    # Registering the same kind again is a no-op; another kind under its name is refused.
    assert register(kind) is kind
    with pytest.raises(KvTierError, match="already registered"):
        register(LayerKind("marker", lambda model: 0))
