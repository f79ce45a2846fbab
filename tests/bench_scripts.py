"""The scripts in bench/ imported as modules, for tests of what they compute."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/NAME.py`` as the module ``NAME`` (loaded once; later calls get the same one)."""
    if name in sys.modules:
        return sys.modules[name]
    # A script imports its sibling ``_common`` as a top-level module, as it does
    # when run from bench/; the directory is on sys.path only for that.
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))
