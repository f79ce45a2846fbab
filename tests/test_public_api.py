"""The package's public names: every name in ``kvtier.__all__`` resolves, the lazy ones included.

``import kvtier`` stays light (no torch), and a name listed in ``__all__``
that does not import would break ``from kvtier import *`` for everyone.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvtier


def test_all_is_unique_and_public() -> None:
    names = kvtier.__all__
    assert len(names) == len(set(names))
    assert all(not n.startswith("_") or n == "__version__" for n in names)


@pytest.mark.parametrize("name", sorted(kvtier.__all__))
def test_every_public_name_resolves(name: str) -> None:
    pytest.importorskip("torch")
    assert getattr(kvtier, name) is not None


def test_the_engine_roles_are_public() -> None:
    for name in ("Engine", "EngineConfig", "InputProcessor", "Scheduler", "ModelRunner",
                 "KVConnector", "RequestQueues", "TierChain", "LearnedReusePolicy"):
        assert name in kvtier.__all__


def test_importing_kvtier_loads_no_torch() -> None:
    code = "import sys, kvtier; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
