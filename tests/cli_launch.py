"""Running ``kvtier`` in a subprocess the way the tests import it.

conftest installs the source-only import switch when KVTIER_PURE_PYTHON=1,
so the child imports kvtier exactly as the tests do.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

_LAUNCH = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); import conftest; "
    "from kvtier.cli import main; sys.exit(main(sys.argv[1:]))"
)


def kvtier_cli(*args: str) -> list[str]:
    """The command line running ``kvtier ARGS`` in a subprocess."""
    return [sys.executable, "-c", _LAUNCH, str(Path(__file__).parent), *args]


def read_banner(proc: subprocess.Popen[str], timeout: float = 120) -> list[str]:
    """The lines a started ``kvtier serve`` prints up to and including ``kvtier: serving ...``."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"the server exited early: {''.join(lines)}"
        lines.append(line)
        if line.startswith("kvtier: serving"):
            return lines
    raise AssertionError(f"no 'kvtier: serving' line within {timeout:g}s: {''.join(lines)}")
