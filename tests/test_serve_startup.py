"""``kvtier serve`` checks what is cheap before the model loads, and exits when the engine dies.

A configuration that cannot serve (a KV cache smaller than a block, a
context longer than the cache or the model, a cache too small for the chat
template, an unusable disk directory) fails with one clear line before any
weights are read; an unreachable Redis is a warning, also before the load.
A server whose engine thread dies exits with status 70 so a supervisor
restarts it. The model is the tiny random one, saved to a directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("uvicorn")

from redis_servers import free_port

from kvtier.cli import main

TESTS = Path(__file__).parent


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kv-cache-memory", "1KiB"], "holds no KV block"),
        (["--num-blocks", "4", "--max-model-len", "100"], "exceeds the KV pool"),
        (["--max-model-len", "100000"], "exceeds the model's 512 positions"),
        (["--num-blocks", "1", "--block-size", "8"], "the chat template alone is"),
        (["--tier", "host:1KiB"], "hold no block"),
        (["--tier", "disk:/proc/kvtier-cannot-write-here"], "cannot be used"),
        (["--tier", "redis://h:1/0", "--tier", "host:1MiB"], "fastest first"),
        (["--tier", "host:1MiB", "--host-tier", "1MiB"], "each medium may be given once"),
    ],
)
def test_a_configuration_that_cannot_serve_fails_before_the_model_loads(
    model_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    code = main(["serve", "--model", str(model_dir), "--port", "0", "--pressure", "off", *args])
    out, err = capsys.readouterr()
    assert code == 1
    assert needle in err, err
    assert "kvtier: loading" not in out  # no weights were read
    assert err.startswith("kvtier: error: ") and "Traceback" not in err


def test_a_config_file_sets_flags_and_flags_override_it(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "serve.toml"
    cfg.write_text(
        f'model = "{model_dir}"\nport = 0\nnum_blocks = 4\n[scheduler]\nmax-model-len = 100\n'
        '[pressure]\npressure = "off"\n'
    )
    assert main(["serve", "--config", str(cfg)]) == 1
    assert "max_model_len 100 exceeds the KV pool (4 blocks" in capsys.readouterr().err
    # The flag wins over the file: 64 tokens fit in 4 blocks of 16; the bad size stops it now.
    assert main(["serve", "--config", str(cfg), "--max-model-len", "64", "--tier", "host:1"]) == 1
    assert "hold no block" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("port = [1, 2]", "takes one value"),
        ("bogus = 1", "unknown setting 'bogus'"),
        ("no_prefix_caching = 1", "true or false"),
        ("dtype = 'int4'", "must be one of"),
        ("kv_cache_memory = 'lots'", "cannot parse memory size"),
        ("port = ", "not valid TOML"),
    ],
)
def test_bad_config_files_say_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str
) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text + "\n")
    assert main(["serve", "--config", str(cfg)]) == 1
    assert needle in capsys.readouterr().err


_LAUNCH = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); import conftest; "
    "from kvtier.cli import main; sys.exit(main(sys.argv[1:]))"
)

# The engine thread's loop breaks on its first look at the engine.
_CRASH = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); import conftest; "
    "from kvtier.engine.engine import Engine\n"
    "def broken(self): raise RuntimeError('engine loop broke')\n"
    "Engine.has_unfinished = broken\n"
    "from kvtier.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _serve(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, str(TESTS), "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _quiet(model_dir: Path, *extra: str) -> list[str]:
    """``serve`` arguments for the tiny model on any port, no pressure, warnings only."""
    quiet = ["--port", "0", "--pressure", "off", "--log-level", "warning"]
    return ["--model", str(model_dir), *quiet, *extra]


def test_a_dead_engine_thread_exits_70(model_dir: Path) -> None:
    res = _serve(_CRASH, *_quiet(model_dir))
    assert res.returncode == 70, res.stderr[-2000:]
    assert "the engine thread died (RuntimeError: engine loop broke)" in res.stderr
    assert "supervisor" in res.stderr


def test_an_unreachable_redis_is_a_warning_before_the_model_loads(model_dir: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH, str(TESTS), "serve", *_quiet(model_dir, "--tier", url)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("kvtier: loading"):
                break
    finally:
        proc.kill()
        proc.communicate()
    text = "".join(lines)
    assert "cannot reach Redis" in text and "Serving without the Redis tier" in text, text
    assert lines[-1].startswith("kvtier: loading")
