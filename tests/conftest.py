"""Test-session guards and the pure-Python switch.

With ``KVTIER_PURE_PYTHON=1`` the tests import kvtier's ``.py`` sources even
where mypyc-compiled modules are installed, so one environment tests both
the compiled hot paths and the pure-Python fallback.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest


class _SourceOnlyFinder(importlib.machinery.PathFinder):
    """Finds ``kvtier`` modules from their source files, never a compiled extension."""

    @classmethod
    def find_spec(
        cls,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "kvtier" and not fullname.startswith("kvtier."):
            return None
        spec = super().find_spec(fullname, path, target)
        if spec is None or not (spec.origin or "").endswith(".so"):
            return spec
        source = Path(spec.origin or "").with_name(fullname.rsplit(".", 1)[-1] + ".py")
        return importlib.util.spec_from_file_location(fullname, source)


if os.environ.get("KVTIER_PURE_PYTHON") == "1":
    sys.meta_path.insert(0, _SourceOnlyFinder())

import kvtier  # noqa: E402


def _stale_extensions() -> list[str]:
    """Compiled modules older than their source: tests would run old code."""
    root = Path(kvtier.__file__).parent
    stale = []
    for so in root.rglob("*.so"):
        source = so.with_name(so.name.split(".", 1)[0] + ".py")
        if source.exists() and source.stat().st_mtime > so.stat().st_mtime:
            stale.append(str(source.relative_to(root)))
    return stale


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("KVTIER_PURE_PYTHON") == "1":
        return
    stale = _stale_extensions()
    if stale:
        raise pytest.UsageError(
            f"compiled kvtier modules are older than their source ({', '.join(stale)}): "
            "rebuild with `pip install -e .` (or `make venv`), or run with KVTIER_PURE_PYTHON=1"
        )


def pytest_report_header(config: pytest.Config) -> str:
    import kvtier.pool

    compiled = str(kvtier.pool.__file__).endswith(".so")
    return f"kvtier hot paths: {'compiled (mypyc)' if compiled else 'pure Python'}"
