"""The command line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from kvtier import HASH_ALGORITHMS, available_policies
from kvtier.cli import main


def test_info_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kvtier 0.1.0" in out and "lru" in out and "xxh3_128" in out


def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["policies"] == available_policies()
    assert info["hash_algorithms"] == list(HASH_ALGORITHMS)
    packages = info["optional_packages"]
    assert set(packages) >= {"torch", "transformers", "fastapi", "redis", "vllm"}
    for name, present in packages.items():
        assert present is (importlib.util.find_spec(name) is not None), name


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: kvtier" in capsys.readouterr().out


def test_console_script_runs() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "info" in res.stdout


def test_replay_with_no_trace_uses_the_bundled_sample(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "mooncake_conversation_sample.jsonl" in out
    assert "MIN*" in out and "lru" in out and "1.00%" in out and "10.00%" in out


def test_console_script_replays() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "replay", "--limit", "100", "--json"],
        capture_output=True, text=True, check=True,
    )
    assert json.loads(res.stdout)["results"][0]["policy"] == "lru"
