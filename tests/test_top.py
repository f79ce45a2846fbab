"""``kvtier top``: one snapshot of a real server, and the error for a server that is not there.

The tiny random model is served by uvicorn on a loopback port; ``kvtier top
--once`` prints its plain-text view, whose numbers must be the ones
``/v1/cache/stats`` reports for the same (idle) server.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from serving import MODEL, Server, serving  # noqa: E402
from tiny_model import tiny_engine  # noqa: E402

from kvtier.cli import main  # noqa: E402
from kvtier.cli.top import base_url  # noqa: E402
from kvtier.offload.chain import Tier  # noqa: E402
from kvtier.offload.host import HostStore  # noqa: E402
from kvtier.pressure import PressureSpec  # noqa: E402

NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    engine = tiny_engine(
        num_blocks=NUM_BLOCKS,
        block_size=4,
        tiers=[Tier(HostStore(), 64)],
        pressure=PressureSpec(monitor="pool"),
    )
    with serving(engine) as s:
        client = s.client()
        for text in ("the same question, asked twice over", "the same question, asked twice over"):
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": text}],
                max_tokens=4,
                temperature=0,
            )
        yield s
    engine.close()


def view(text: str) -> dict[tuple[str, str], str]:
    """``kvtier top --once`` output as (section, name) -> value."""
    out: dict[tuple[str, str], str] = {}
    section = ""
    for line in text.splitlines()[1:]:
        if not line.strip():
            continue
        if not line.startswith("  "):
            section = line.strip()
            continue
        name, value = line[2:26].strip(), line[26:].strip()
        out[(section, name)] = value
    return out


def test_once_shows_what_the_cache_stats_report(server: Server, capsys: Any) -> None:
    assert main(["top", server.base, "--once", "--interval", "0.2"]) == 0
    out = capsys.readouterr().out
    stats = httpx.get(f"{server.v1}/cache/stats", timeout=30).json()
    engine = stats["engine"]
    shown = view(out)
    assert out.splitlines()[0] == f"kvtier top  {server.base}  model {MODEL}  policy lru"
    assert shown[("requests", "running")] == str(engine["running"]) == "0"
    assert shown[("requests", "waiting")] == str(engine["waiting"]) == "0"
    assert shown[("requests", "accepted")] == str(engine["requests_added"]) == "2"
    assert shown[("requests", "finished")] == str(sum(engine["finished"].values()))
    assert shown[("tokens", "prompt tokens")] == str(engine["prompt_tokens"])
    assert shown[("tokens", "generation tokens")] == str(engine["generation_tokens"])
    # Idle between the two scrapes: every rate is zero.
    assert shown[("tokens", "generation tokens/s")] == "0.0/s"
    assert shown[("KV blocks", "evictions/s")] == "0.0/s"
    assert shown[("prefix cache", "hit ratio")] == f"{100 * stats['hit_ratio']:.1f}%"
    assert float(shown[("prefix cache", "hit ratio")].rstrip("%")) > 0
    assert shown[("prefix cache", "hit tokens")] == str(stats["hit_tokens"])
    assert shown[("prefix cache", "queried tokens")] == str(stats["queried_tokens"])
    assert shown[("KV blocks", "used")] == str(stats["used_blocks"])
    assert shown[("KV blocks", "free")] == str(stats["free_blocks"])
    assert shown[("KV blocks", "cached")] == str(stats["cached_blocks"])
    assert shown[("KV blocks", "total")] == str(stats["total_blocks"]) == str(NUM_BLOCKS)
    assert shown[("KV blocks", "evictions")] == str(stats["evictions"])
    assert shown[("memory pressure", "mode")] == stats["pressure"]["mode"]
    host = stats["tiers"]["host"]
    assert shown[("tiers", "host blocks")].startswith(
        f"{host['used_blocks']} / {host['capacity_blocks']}"
    )


def test_an_unreachable_server_is_one_line_and_exit_1(capsys: Any) -> None:
    with socket.socket() as s:  # a port nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["top", f"http://127.0.0.1:{port}", "--once"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvtier top: cannot reach http://127.0.0.1:{port}/metrics")


class _KeyedMetrics(BaseHTTPRequestHandler):
    """``/metrics`` behind ``Bearer right``: 401 without it, a minimal exposition with it."""

    seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        auth = self.headers.get("Authorization")
        self.seen.append(auth)
        if self.path != "/metrics" or auth != "Bearer right":
            self.send_response(401 if self.path == "/metrics" else 404)
            self.end_headers()
            return
        body = b"# TYPE kvtier_kv_blocks_total gauge\nkvtier_kv_blocks_total 8\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def keyed() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _KeyedMetrics)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_api_key_is_sent_as_a_bearer_token(
    keyed: str, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVTIER_API_KEY", raising=False)
    assert main(["top", keyed, "--once", "--interval", "0.01"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"kvtier top: {keyed}/metrics answered HTTP 401 Unauthorized "
        "(pass --api-key or set KVTIER_API_KEY)"
    ]
    assert main(["top", keyed, "--once", "--interval", "0.01", "--api-key", "right"]) == 0
    assert "  total                   8" in capsys.readouterr().out
    monkeypatch.setenv("KVTIER_API_KEY", "right:tenant-a")  # KEY:TENANT, as the server takes it
    assert main(["top", keyed, "--once", "--interval", "0.01"]) == 0
    assert _KeyedMetrics.seen[-1] == "Bearer right"


def test_a_url_that_is_not_a_kvtier_server_is_one_line(server: Server, capsys: Any) -> None:
    assert main(["top", f"{server.base}/health", "--once"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvtier top: ") and err.count("\n") == 1


def test_base_url_forms() -> None:
    assert base_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert base_url("http://h:1/") == "http://h:1"
    assert base_url("https://h/v1/") == "https://h"
