"""Test-session guards, the pure-Python switch and the no-skip rule of CI.

With ``KVTIER_PURE_PYTHON=1`` the tests import kvtier's ``.py`` sources even
where mypyc-compiled modules are installed, so one environment tests both
the compiled hot paths and the pure-Python fallback.

Under pytest-xdist each worker runs torch on one thread (see below), and
``--dist loadfile`` hands out the longest files first, the model-family
sweep in several parts.

With ``KVTIER_REQUIRE_ALL=1`` (``make test``, i.e. CI) every skip fails the
run, except those :func:`needs.need_hardware` raises for hardware CI lacks:
a dependency guard that skips (``needs.py``'s or a stray ``importorskip``)
cannot let a broken install pass.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import zlib
from collections import defaultdict
from collections.abc import Generator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

# Under pytest-xdist the workers share the cores: torch's OpenMP pool of one
# thread per core in each worker makes them spin against each other (a
# model-family file ran 7x slower on 2 workers than alone). One thread per
# worker, and per server a worker starts, unless the caller chose.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
from needs import HARDWARE_SKIP, REQUIRE_ALL


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


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)


def _refuse_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Under KVTIER_REQUIRE_ALL=1, turn a skip that is not for missing hardware into a failure."""
    if not (REQUIRE_ALL and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if HARDWARE_SKIP in reason:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{reason}\nKVTIER_REQUIRE_ALL=1 (make test, CI) allows no skip but missing hardware: "
        "install what is missing (make venv, make redis-server), or guard the test with "
        "needs.need_hardware if CI can never have it"
    )


#: Rough seconds a test takes, by its mark, to order files longest first.
SECONDS_BY_MARK = {"slow": 60.0, "process": 20.0, "families": 2.0}
SECONDS_UNMARKED = 0.3

#: Files whose parametrized tests share no module state and are run in this many
#: parts at once: the conformance sweep is minutes of one core.
SPLIT_FILES = {"test_families.py": 4}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (by :data:`SECONDS_BY_MARK`): pytest-xdist hands files to
    workers in collection order, and a suite that ends on a long file keeps one worker
    busy for minutes while the other idles."""
    seconds: dict[Path, float] = defaultdict(float)
    for item in items:
        marked = [s for mark, s in SECONDS_BY_MARK.items() if item.get_closest_marker(mark)]
        seconds[item.path] += max(marked, default=SECONDS_UNMARKED)
    items.sort(key=lambda item: -seconds[item.path])  # stable: a file's order is kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` in collection order, with :data:`SPLIT_FILES` in parts."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            parts = SPLIT_FILES.get(Path(path).name)
            if parts is None or "[" not in nodeid:
                return path
            return f"{path}#{zlib.crc32(nodeid.encode()) % parts}"

    # xdist would order files by their number of tests, putting the few slowest last.
    config.option.loadscopereorder = False
    return LongestFirst(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _refuse_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _refuse_skip(report)
    return report


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama and its tokenizer saved as a model directory (``--model DIR``)."""
    from tiny_model import tiny_model_and_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def redis() -> Generator[Any, None, None]:
    """A fresh redis-server on loopback for one test (see :func:`needs.need_redis_server`)."""
    from needs import need_redis_server
    from redis_servers import RedisServer

    need_redis_server()
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()
