"""Build hook: compile kvtier's hot-path modules with mypyc when possible.

The block pool, the manager, block tables and the LRU, ARC and learned-reuse
policies (with its guard) run once per block of every request; compiled by
mypyc (from the same typed source) they run about 1.5-2x faster. The token
encoder every token of a request passes through once (``kvtier._tokpack``)
is a small C extension with a pure-Python module of the same name and
behaviour beside it. Set KVTIER_PURE_PYTHON=1 to skip compilation; a machine
without a C compiler falls back to pure Python on its own.
"""

from __future__ import annotations

import gc
import os
import sys

from setuptools import Extension, setup

COMPILED = [
    "src/kvtier/pool.py",
    "src/kvtier/manager.py",
    "src/kvtier/block_table.py",
    "src/kvtier/policy/lru.py",
    "src/kvtier/policy/arc.py",
    "src/kvtier/policy/learned.py",
    "src/kvtier/policy/guard.py",
]

# optional: a compiler error leaves src/kvtier/_tokpack.py in charge.
NATIVE = Extension("kvtier._tokpack", ["src/kvtier/_tokpack.c"], optional=True)

# The commands that compile. A PEP 517 build runs setup.py once per hook
# (requirements, metadata, wheel) and mypyc's translation takes minutes, so the
# metadata hooks name the C extension only and skip the translation.
BUILDS = {"build", "build_ext", "bdist_wheel", "install", "develop", "editable_wheel"}


def translation_config() -> str:
    """A mypy configuration for mypyc's translation alone; returns its path.

    Translating needs the types of kvtier's own modules, nothing from a third
    party: the compiled modules import only the standard library and kvtier.
    Following kvtier's imports into torch, numpy and the rest, with the ASTs and
    expression types mypyc keeps for every module, made the translation take
    three minutes; skipped (their names are Any) it takes seconds and writes the
    same C, byte for byte. Type errors elsewhere are `mypy`'s to report (with
    pyproject.toml's settings, `make typecheck`), not the build's.
    """
    modules = (p.removeprefix("src/").removesuffix(".py").replace("/", ".") for p in COMPILED)
    compiled = ",".join(modules)
    path = os.path.join("build", "mypyc.ini")
    os.makedirs("build", exist_ok=True)
    with open(path, "w") as f:
        f.write(
            "[mypy]\nfollow_imports = skip\n\n"
            "[mypy-kvtier.*]\nfollow_imports = normal\nignore_errors = True\n\n"
            f"[mypy-{compiled}]\nignore_errors = False\n"
        )
    return path


def ext_modules() -> list[Extension]:
    if os.environ.get("KVTIER_PURE_PYTHON") == "1":
        return []
    if not BUILDS & set(sys.argv[1:]):
        return [NATIVE]
    try:
        from mypyc.build import mypycify

        modules = list(
            mypycify(
                [f"--config-file={translation_config()}", *COMPILED], opt_level="3", separate=False
            )
        )
    except (Exception, SystemExit) as exc:  # no mypyc, a type error, no compiler: pure Python
        print(f"kvtier: building without mypyc ({exc}); pure Python", file=sys.stderr)
        return [NATIVE]
    # mypy's graph of the imports is garbage now; the collector need not walk it again.
    gc.freeze()
    return [*modules, NATIVE]


setup(ext_modules=ext_modules())
