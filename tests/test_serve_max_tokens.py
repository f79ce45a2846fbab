"""``--default-max-tokens``: what a request that sends no ``max_tokens`` generates.

Real servers on the tiny random model, driven over HTTP: a request without
``max_tokens`` stops at the server's default (0: runs up to the context), a
request's own ``max_tokens`` wins in both directions, a negative default
stops ``kvtier serve`` before the model loads, and the README's quick-start
``curl`` commands, run as written against a ``kvtier serve`` process, come
back at once. The end-of-sequence token is banned with ``logit_bias`` where
a request must run to its limit.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from cli_launch import kvtier_cli, read_banner  # noqa: E402
from serving import MODEL, Server, serving  # noqa: E402
from tiny_model import tiny_engine  # noqa: E402

from kvtier.cli import build_parser, main  # noqa: E402
from kvtier.cli.config_file import load_config_file  # noqa: E402
from kvtier.cli.serve import DEFAULT_MAX_TOKENS, default_max_tokens_line  # noqa: E402
from kvtier.engine import DEFAULT_MODEL_ID  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.server.limits import ServerLimits  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = 5  # the servers' --default-max-tokens here
CONTEXT = 96  # the no-cap server's context: a request without max_tokens fills it


def _no_eos(eos_token_ids: frozenset[int]) -> dict[str, float]:
    """A ``logit_bias`` that keeps the model from ending its answer early."""
    return {str(t): -100 for t in eos_token_ids}


@pytest.fixture(scope="module")
def capped() -> Iterator[tuple[Server, dict[str, float]]]:
    engine = tiny_engine(num_blocks=64)
    with serving(engine, limits=ServerLimits(default_max_tokens=DEFAULT)) as s:
        yield s, _no_eos(engine.eos_token_ids)


def _chat(server: Server, bias: dict[str, float], **fields: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me everything"}],
        "temperature": 0,
        "logit_bias": bias,
        **fields,
    }
    r = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def _complete(server: Server, bias: dict[str, float], **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "once upon", "temperature": 0, "logit_bias": bias, **fields}
    r = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def test_a_chat_request_without_max_tokens_stops_at_the_default(
    capped: tuple[Server, dict[str, float]],
) -> None:
    server, bias = capped
    reply = _chat(server, bias)
    assert reply["usage"]["completion_tokens"] == DEFAULT
    assert reply["choices"][0]["finish_reason"] == "length"
    # Without the ban the model may end sooner, never later.
    assert _chat(server, {})["usage"]["completion_tokens"] <= DEFAULT
    # "max_tokens": null is no max_tokens.
    assert _chat(server, bias, max_tokens=None)["usage"]["completion_tokens"] == DEFAULT


def test_a_streamed_request_without_max_tokens_stops_at_the_default(
    capped: tuple[Server, dict[str, float]],
) -> None:
    server, bias = capped
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "stream on"}],
        "temperature": 0,
        "logit_bias": bias,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.v1}/chat/completions", json=body, timeout=60) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == DEFAULT
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "length"


def test_a_completion_without_max_tokens_gets_the_default_when_below_16(
    capped: tuple[Server, dict[str, float]],
) -> None:
    server, bias = capped
    reply = _complete(server, bias)
    assert reply["usage"]["completion_tokens"] == DEFAULT
    assert reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("asked", [2, DEFAULT + 9])
def test_an_explicit_max_tokens_overrides_the_default_both_ways(
    capped: tuple[Server, dict[str, float]], asked: int
) -> None:
    server, bias = capped
    for field in ("max_tokens", "max_completion_tokens"):
        reply = _chat(server, bias, **{field: asked})
        assert reply["usage"]["completion_tokens"] == asked, field
        assert reply["choices"][0]["finish_reason"] == "length"
    assert _complete(server, bias, max_tokens=asked)["usage"]["completion_tokens"] == asked


def test_an_explicit_max_tokens_is_still_bounded_by_the_context(
    capped: tuple[Server, dict[str, float]],
) -> None:
    server, _ = capped
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
    r = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_default_max_tokens_0_runs_up_to_the_context() -> None:
    engine = tiny_engine(num_blocks=64, max_model_len=CONTEXT)
    bias = _no_eos(engine.eos_token_ids)
    with serving(engine, limits=ServerLimits(default_max_tokens=0)) as server:
        reply = _chat(server, bias)
        usage = reply["usage"]
        assert usage["completion_tokens"] > DEFAULT
        assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
        assert reply["choices"][0]["finish_reason"] == "length"
        # /v1/completions keeps OpenAI's default of 16.
        assert _complete(server, bias)["usage"]["completion_tokens"] == 16


def test_the_default_is_capped_by_the_room_the_prompt_leaves() -> None:
    engine = tiny_engine(num_blocks=64, max_model_len=CONTEXT)
    bias = _no_eos(engine.eos_token_ids)
    with serving(engine, limits=ServerLimits(default_max_tokens=CONTEXT * 4)) as server:
        usage = _chat(server, bias)["usage"]
    # Never a 400 for a default: the completion takes what is left of the context.
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT


def test_server_limits_default_and_validation() -> None:
    assert ServerLimits().default_max_tokens == DEFAULT_MAX_TOKENS == 512
    parser, _ = build_parser()
    assert parser.parse_args(["serve"]).default_max_tokens == DEFAULT_MAX_TOKENS
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="default_max_tokens"):
            ServerLimits(default_max_tokens=bad)  # type: ignore[arg-type]
    assert ServerLimits(default_max_tokens=8).default_completion_tokens(100) == 8
    assert ServerLimits(default_max_tokens=8).default_completion_tokens(3) == 3
    assert ServerLimits(default_max_tokens=0).default_completion_tokens(100) == 100
    assert ServerLimits(default_max_tokens=0).default_completion_tokens(0) == 1


def test_the_banner_line_says_what_a_request_without_max_tokens_gets() -> None:
    line = default_max_tokens_line(ServerLimits(), 8192)
    assert "requests without max_tokens: at most 512 tokens (--default-max-tokens" in line
    assert "16" in line
    assert default_max_tokens_line(ServerLimits(default_max_tokens=5), 8192) == (
        "requests without max_tokens: at most 5 tokens (--default-max-tokens)"
    )
    off = default_max_tokens_line(ServerLimits(default_max_tokens=0), 8192)
    assert "up to the context (8192 tokens" in off and "--default-max-tokens 0" in off


# -- kvtier serve ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "how", [["--default-max-tokens", "-1"], ["--default-max-tokens=-3"], ["config"]]
)
def test_a_negative_default_fails_before_the_model_loads(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: list[str]
) -> None:
    if how == ["config"]:
        cfg = tmp_path / "serve.toml"
        cfg.write_text("[limits]\ndefault_max_tokens = -2\n")
        how = ["--config", str(cfg)]
    code = main(["serve", "--model", str(model_dir), "--port", "0", "--pressure", "off", *how])
    out, err = capsys.readouterr()
    assert code == 1
    assert err.startswith("kvtier: error: --default-max-tokens must be 0"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "kvtier: loading" not in out  # no weights were read


def test_a_non_integer_default_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--default-max-tokens", "lots"])
    assert info.value.code == 2
    assert "argument --default-max-tokens: expected an integer, got 'lots'" in (
        capsys.readouterr().err
    )


def test_the_config_file_takes_default_max_tokens(tmp_path: Path) -> None:
    _, serve = build_parser()
    cfg = tmp_path / "serve.toml"
    cfg.write_text("[limits]\ndefault-max-tokens = 7\n")
    assert load_config_file(str(cfg), serve) == {"default_max_tokens": 7}
    cfg.write_text("default_max_tokens = 'many'\n")
    with pytest.raises(ConfigError, match="default_max_tokens: expected an integer"):
        load_config_file(str(cfg), serve)


def _fenced_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.M | re.S)


def _shell_commands(block: str) -> list[list[str]]:
    """The commands of a shell snippet, each as argv: continuation lines and quotes joined."""
    commands: list[list[str]] = []
    pending = ""
    for line in block.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        if argv:
            commands.append(argv)
        pending = ""
    assert not pending, f"unterminated command: {pending!r}"
    return commands


def _quick_start_curls() -> list[list[str]]:
    """The ``curl`` commands of the README's opening section (before its first heading)."""
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("\n## ", 1)[0]
    return [
        argv
        for block in _fenced_blocks(quick_start)
        for argv in _shell_commands(block)
        if argv[0] == "curl"
    ]


def _chat_bodies(argv: list[str]) -> list[dict[str, Any]]:
    bodies = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-d", "--data")]
    return [json.loads(b) for b in bodies]


def test_every_documented_chat_request_sends_max_tokens() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    seen = 0
    for path in files:
        for block in _fenced_blocks(path.read_text()):
            for argv in _shell_commands(block) if "curl" in block else []:
                if argv[0] != "curl" or not any("/completions" in a for a in argv):
                    continue
                for body in _chat_bodies(argv):
                    seen += 1
                    assert "max_tokens" in body, f"{path.name}: {shlex.join(argv)}"
            for call in re.findall(r"completions\.create\((.*?)\n\)", block, flags=re.S):
                seen += 1
                assert "max_tokens" in call, f"{path.name}: {call}"
    assert seen >= 2


@pytest.fixture(scope="module")
def cli_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``kvtier serve`` on the tiny model, named as the README names the bundled model, with
    ``--default-max-tokens`` from a config file; yields its base URL (no ``/v1``)."""
    cfg = tmp_path_factory.mktemp("cfg") / "serve.toml"
    cfg.write_text(f"[limits]\ndefault_max_tokens = {DEFAULT}\n")
    proc = subprocess.Popen(
        kvtier_cli(
            "serve",
            "--config",
            str(cfg),
            "--model",
            str(model_dir),
            "--served-model-name",
            DEFAULT_MODEL_ID,
            "--port",
            "0",
            "--num-blocks",
            "64",
            "--pressure",
            "off",
            "--log-level",
            "warning",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = read_banner(proc)
        assert lines[-2] == (
            f"kvtier: requests without max_tokens: at most {DEFAULT} tokens "
            "(--default-max-tokens)\n"
        ), "".join(lines)
        url = lines[-1].split(" at ", 1)[1].split(" ", 1)[0]
        yield url.removesuffix("/v1")
    finally:
        proc.kill()
        proc.communicate()


def test_the_flag_reaches_the_server(cli_server: str) -> None:
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": "go on and on"}],
        "temperature": 0,
        "logit_bias": _no_eos(tiny_engine(num_blocks=8).eos_token_ids),
    }
    r = httpx.post(f"{cli_server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == DEFAULT
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_the_readme_quick_start_curls_answer_promptly(cli_server: str) -> None:
    commands = _quick_start_curls()
    chats = [argv for argv in commands if any("/chat/completions" in a for a in argv)]
    assert chats, "the README's quick start has no chat completion example"
    for argv in chats:
        for body in _chat_bodies(argv):
            assert body["model"] == DEFAULT_MODEL_ID  # the bundled model's served name
            assert "max_tokens" in body and body.get("temperature") == 0
    for argv in commands:
        argv = [a.replace("http://127.0.0.1:8000", cli_server) for a in argv]
        assert any(a.startswith(cli_server) for a in argv), argv
        started = time.monotonic()
        res = subprocess.run(
            [*argv, "-sS", "--max-time", "60", "-w", "\n%{http_code} %{content_type}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - started
        assert res.returncode == 0, res.stderr
        body_text, _, status = res.stdout.rpartition("\n")
        code, _, content_type = status.partition(" ")
        assert code == "200", res.stdout
        assert elapsed < 30, f"{shlex.join(argv)} took {elapsed:.1f}s"
        if "/v1/" in argv[1]:
            assert content_type.startswith("application/json"), content_type
            reply = json.loads(body_text)
            if "/chat/completions" in argv[1]:
                asked = _chat_bodies(argv)[0]["max_tokens"]
                assert reply["object"] == "chat.completion"
                assert 1 <= reply["usage"]["completion_tokens"] <= asked
                assert isinstance(reply["choices"][0]["message"]["content"], str)
