"""Choosing a policy by name in config and on the command line.

Shipped policies register under a short name; a user's own class is loaded
from an import path ``package.module:ClassName`` (or ``package.module.ClassName``).

A policy that lives with the feature it serves (the workflow policy, in
:mod:`kvtier.agents.policy`) registers itself when its module is imported;
:data:`PLUGIN_MODULES` names that module, so ``make_policy("workflow")`` works
without the caller importing it first. The name is data, not an import: the
policy layer does not import the features above it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvtier.errors import ConfigError
from kvtier.policy.base import EvictionPolicy

PolicyFactory = Callable[..., EvictionPolicy]
_METHODS = (
    "bind", "admit", "insert", "access", "pin", "unpin", "remove", "evict",
    "insert_many", "pin_many", "unpin_many", "access_many", "evict_many", "evict_for",
    "snapshot",
)
_REGISTRY: dict[str, PolicyFactory] = {}
#: Shipped policies registered by their own modules: name -> the module to import.
PLUGIN_MODULES: dict[str, str] = {"workflow": "kvtier.agents.policy"}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make ``factory`` available as ``make_policy(name)``."""
    key = name.lower()
    if key in _REGISTRY and _REGISTRY[key] is not factory:
        raise ConfigError(f"a policy named {name!r} is already registered")
    _REGISTRY[key] = factory


def available_policies() -> list[str]:
    return sorted({*_REGISTRY, *PLUGIN_MODULES})


def _registered(key: str) -> PolicyFactory | None:
    """The factory registered as ``key``, importing its plug-in module if it has one."""
    factory = _REGISTRY.get(key)
    if factory is None and key in PLUGIN_MODULES:
        module_name = PLUGIN_MODULES[key]
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"cannot import policy module {module_name!r}: {exc}") from exc
        factory = _REGISTRY.get(key)
        if factory is None:
            raise ConfigError(f"module {module_name!r} did not register the policy {key!r}")
    return factory


def _load_by_path(path: str) -> PolicyFactory:
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            f"unknown policy {path!r}: use one of {available_policies()} "
            "or an import path like 'mypkg.policies:MyPolicy'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import policy module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ConfigError(f"module {module_name!r} has no policy class {attr!r}")
    return factory  # type: ignore[no-any-return]


def make_policy(name: str, **kwargs: Any) -> EvictionPolicy:
    """A new policy instance for a registered name or an import path."""
    factory = _registered(name.lower()) or _load_by_path(name)
    try:
        policy = factory(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"policy {name!r} rejected its arguments {kwargs}: {exc}") from exc
    missing = [m for m in _METHODS if not callable(getattr(policy, m, None))]
    if missing:
        raise ConfigError(
            f"policy {name!r} does not implement the EvictionPolicy protocol "
            f"(missing {', '.join(missing)}); subclass kvtier.PolicyBase for the batch forms"
        )
    return policy
