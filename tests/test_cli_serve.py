"""``kvtier serve``: options, errors, and a real server process on a tiny model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cli_launch import kvtier_cli, read_banner

from kvtier.cli import main, parse_memory_size
from kvtier.errors import ConfigError


def _cli(*args: str) -> list[str]:
    return kvtier_cli(*args)


def test_serve_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--dtype",
        "--device",
        "--block-size",
        "--kv-cache-memory",
        "--num-blocks",
        "--policy",
        "--max-num-seqs",
        "--max-model-len",
        "--default-max-tokens",
        "--no-prefix-caching",
        "--log-level",
        "--host-tier",
        "--disk-tier",
        "--redis-url",
        "--redis-cluster",
        "--write-mode",
        "--disk-codec",
        "--pressure",
        "--pressure-thresholds",
        "--pressure-emergency",
        "--pressure-max-wait",
    ):
        assert option in out, option
    assert "examples:" in out and "kvtier serve --port" in out


def test_serve_is_listed_in_the_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "serve" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kv-cache-memory", "abc"], "cannot parse memory size 'abc'"),
        (["--kv-cache-memory", "0"], "at least 1 byte"),
        (["--port", "70000"], "port number"),
        (["--block-size", "0"], "positive integer"),
        (["--max-num-seqs", "two"], "positive integer"),
        (["--policy", "nope"], "unknown policy"),
        (["--dtype", "int4"], "invalid choice"),
        (["--default-temperature", "3"], "temperature in [0, 2]"),
        (["--default-top-p", "0"], "top_p in (0, 1]"),
        (["--pressure", "gpu"], "invalid choice"),
        (["--pressure-thresholds", "0.5,0.9,0.8,0.97"], "CRITICAL threshold 0.8 must be above"),
        (["--pressure-thresholds", "0.5,0.9"], "four rising fractions"),
        (["--pressure-interval", "0"], "number of seconds in (0, 60]"),
    ],
)
def test_bad_options_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert f"argument {args[0]}" in err
    assert "Traceback" not in err


def test_missing_model_exits_1_and_says_what_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "/nonexistent/model.gguf"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: --model '/nonexistent/model.gguf' does not exist")
    assert "Hugging Face model directory or a .gguf file" in err
    assert len(err.strip().splitlines()) == 1


def test_missing_model_in_a_subprocess_has_no_traceback() -> None:
    res = subprocess.run(
        _cli("serve", "--model", "/nonexistent"), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 1
    assert "does not exist" in res.stderr and "Traceback" not in res.stderr


def test_a_directory_without_a_model_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("uvicorn")
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 1
    assert "has no config.json" in capsys.readouterr().err


def test_a_port_in_use_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("uvicorn")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(tmp_path), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("1GiB", 2**30),
        ("1.5G", 3 * 2**29),
        ("800MB", 800 * 10**6),
        ("64 KiB", 64 * 1024),
        ("1048576", 2**20),
        ("2kb", 2000),
    ],
)
def test_parse_memory_size(text: str, expected: int) -> None:
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "", "-1GiB", "12XB", "0", "1.2.3G", "GiB"])
def test_parse_memory_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="memory size"):
        parse_memory_size(text)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT")
def test_serve_runs_a_server_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from tiny_model import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    proc = subprocess.Popen(
        _cli(
            "serve",
            "--model",
            str(tmp_path),
            "--served-model-name",
            "tiny",
            "--port",
            "0",
            "--num-blocks",
            "64",
            "--policy",
            "arc",
            "--host-tier",
            "1MiB",
            "--disk-tier",
            str(tmp_path / "disk"),
            "--disk-codec",
            "int8",
            "--write-mode",
            "write_through",
            "--pressure",
            "pool",
            "--pressure-thresholds",
            "0.4,0.6,0.8,0.95",
            "--log-level",
            "warning",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = read_banner(proc)
        # Checked before the model loads: the cache's size for this model.
        assert "64 KV blocks of 16 tokens" in lines[0] and "context 512 tokens" in lines[0]
        assert lines[1].startswith("kvtier: loading " + str(tmp_path))
        assert "64 blocks of 16 tokens" in "".join(lines) and "policy arc" in "".join(lines)
        assert any(ln.startswith("kvtier: host tier:") for ln in lines)
        assert any(ln.startswith("kvtier: disk tier:") and "codec int8" in ln for ln in lines)
        assert any(ln.startswith("kvtier: memory pressure from pool every 0.05s") for ln in lines)
        serving = lines[-1]
        assert "OpenAI-compatible" in serving
        url = serving.split(" at ", 1)[1].split(" ", 1)[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert f"curl {url}/models" in serving
        assert [m["id"] for m in _get(f"{url}/models")["data"]] == ["tiny"]
        reply = _post(
            f"{url}/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert reply["usage"]["completion_tokens"] <= 3
        tiers = _get(f"{url}/cache/stats")["tiers"]
        assert set(tiers) == {"host", "disk"}
        # Write-through: the prompt's full blocks went to host memory at once.
        assert tiers["host"]["stored_blocks"] > 0
        pressure = _get(f"{url}/cache/stats")["pressure"]
        assert pressure["source"] == "pool" and pressure["mode"] == "RELAXED"
        assert pressure["readings"] >= 1 and pressure["monitor_errors"] == 0
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as resp:
            assert 'kvtier_pressure_mode{mode="RELAXED"} 1' in resp.read().decode()
        assert _get(url.removesuffix("/v1") + "/health") == {"status": "ok"}
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "kvtier: server stopped" in out
    assert "Traceback" not in err
