"""vLLM detection: which API applies, and the typed error with what to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier import ConfigError, KvTierError
from kvtier.integrations import UnsupportedVllmError
from kvtier.integrations.vllm import detect_vllm, require_vllm
from kvtier.integrations.vllm import version as vv


def fake(monkeypatch: pytest.MonkeyPatch, installed: str | None) -> None:
    monkeypatch.setattr(vv, "installed_vllm_version", lambda: installed)
    monkeypatch.delenv(vv.ALLOW_UNTESTED_ENV, raising=False)


@pytest.mark.parametrize(
    ("installed", "api", "tested"),
    [
        ("0.33.0", "cache_policy", True),
        ("0.33.2rc1.dev7+g0abc", "cache_policy", True),
        ("0.12.0", "offloading_manager", False),
        ("0.16.3", "offloading_manager", False),
        ("0.11.2", None, False),
        ("0.20.1", None, False),
        ("0.34.0", None, False),
        ("1.0.0", None, False),
        ("not-a-version", None, False),
    ],
)
def test_detect(monkeypatch: pytest.MonkeyPatch, installed: str, api: str | None,
                tested: bool) -> None:
    fake(monkeypatch, installed)
    info = detect_vllm()
    assert (info.version, info.api, info.tested) == (installed, api, tested)
    assert info.installed and info.supported == (api is not None)


def test_missing_vllm_message(monkeypatch: pytest.MonkeyPatch) -> None:
    fake(monkeypatch, None)
    assert detect_vllm().installed is False
    with pytest.raises(UnsupportedVllmError) as err:
        require_vllm("cache_policy")
    msg = str(err.value)
    assert msg.startswith("vLLM is not installed.")
    assert "0.33.x" in msg and "0.12-0.16" in msg
    assert "pip install vllm==0.33.0" in msg
    assert "pip install --no-deps vllm==0.33.0" in msg and "kvtier[vllm]" in msg
    assert err.value.version is None
    assert isinstance(err.value, KvTierError) and isinstance(err.value, ImportError)
    assert not isinstance(err.value, ConfigError)


def test_unsupported_version_message(monkeypatch: pytest.MonkeyPatch) -> None:
    fake(monkeypatch, "0.20.1")
    with pytest.raises(UnsupportedVllmError) as err:
        require_vllm()
    msg = str(err.value)
    assert msg.startswith("vLLM 0.20.1 is not supported.")
    assert "supports vLLM 0.33.x (the CachePolicy API, tested with 0.33.0)" in msg
    assert "0.12-0.16 (the older OffloadingManager API" in msg
    assert "pip install --no-deps vllm==0.33.0" in msg
    assert "KVTIER_VLLM_ALLOW_UNTESTED=1" in msg
    assert err.value.version == "0.20.1"


def test_untested_versions_can_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    fake(monkeypatch, "0.35.1")
    monkeypatch.setenv(vv.ALLOW_UNTESTED_ENV, "1")
    info = require_vllm("cache_policy")
    assert (info.api, info.tested) == ("cache_policy", False)
    # Older releases never opt in: their API is a different one.
    fake(monkeypatch, "0.11.0")
    monkeypatch.setenv(vv.ALLOW_UNTESTED_ENV, "1")
    assert detect_vllm().api is None


def test_wrong_api_for_the_installed_version(monkeypatch: pytest.MonkeyPatch) -> None:
    fake(monkeypatch, "0.14.1")
    with pytest.raises(UnsupportedVllmError, match="LegacyOffloadingManager"):
        require_vllm("cache_policy")
    assert require_vllm("offloading_manager").api == "offloading_manager"
    fake(monkeypatch, "0.33.0")
    with pytest.raises(UnsupportedVllmError, match="cache_policy_module_path"):
        require_vllm("offloading_manager")


def test_explicit_version_argument() -> None:
    assert detect_vllm("0.15.0").api == "offloading_manager"
    assert vv.parse_version("v0.33.1") == (0, 33, 1)
    assert vv.parse_version("0.33") == (0, 33, 0)
    assert vv.parse_version("x") is None


def test_adapter_import_raises_the_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake(monkeypatch, "0.20.1")
    for name in ("kvtier.integrations.vllm.cache_policy", "kvtier.integrations.vllm.spec"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(UnsupportedVllmError, match=r"vLLM 0\.20\.1 is not supported"):
        import kvtier.integrations.vllm.cache_policy  # noqa: F401


def test_package_imports_without_vllm() -> None:
    # A fresh interpreter where importing vllm fails and no vLLM is "installed".
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import conftest  # the same compiled / pure-Python choice as this run
        sys.modules["vllm"] = None  # any import of vllm now raises ImportError
        import kvtier.integrations.vllm as kv
        from kvtier.integrations.vllm import version
        version.installed_vllm_version = lambda: None
        assert kv.detect_vllm().installed is False
        try:
            kv.KvTierCachePolicy
        except kv.UnsupportedVllmError as exc:
            assert "vLLM is not installed" in str(exc), exc
        else:
            raise AssertionError("no error")
        m = kv.LegacyOffloadingManager  # needs no vLLM
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
