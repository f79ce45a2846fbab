"""An import-only stand-in for torchvision, so SGLang's host pools import without it.

SGLang's model-config package imports torchvision's image transforms at
import time (for its vision models); PyPI's torchvision wheels link CUDA,
and the storage tests never touch an image. Every ``torchvision.*`` module
imports; every name in one is a placeholder that raises ``ImportError`` when
called, so a test that did need torchvision fails loudly instead of passing.
The tests' conftest puts this directory on the path only when the real
torchvision is not installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+kvtier.stub"


class _Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{self._name} needs torchvision, which is not installed")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_Finder())


def __getattr__(attr: str) -> _Missing:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Missing(f"{__name__}.{attr}")
