"""``kvtier serve`` as a user runs it: the console script, its default model, the openai client.

One real process on a free port with no model argument (so the bundled
SmolLM2-135M-Instruct GGUF), asked one question through the official
``openai`` client, then stopped with Ctrl-C. Slow: loading the model takes
about half a minute.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from needs import missing, need_default_model, need_module

need_default_model()
openai = need_module("openai")

pytestmark = pytest.mark.slow


def _console_script() -> Path:
    script = Path(sys.executable).with_name("kvtier")
    if not script.is_file():
        missing("the kvtier console script", "run `make venv` (pip install -e .)")
    return script


def test_kvtier_serve_answers_one_question_with_its_default_model() -> None:
    proc = subprocess.Popen(
        [str(_console_script()), "serve", "--port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        url = None
        while url is None:
            line = proc.stdout.readline()  # blocks until the server says something
            assert line, f"kvtier serve exited before serving: {''.join(seen)}"
            seen.append(line)
            found = re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+/v1)", line)
            url = found.group(1) if found else None
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        (model,) = [m.id for m in client.models.list().data]
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=30,
            temperature=0,
        )
        choice = reply.choices[0]
        assert "Paris" in (choice.message.content or "")
        assert choice.finish_reason in ("stop", "length")
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 30
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate()
        assert proc.returncode == 0, err
        assert "kvtier: server stopped" in out and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
