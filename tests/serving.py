"""A real uvicorn server over an engine, on a free loopback port, for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai
import uvicorn

from kvtier.engine import Engine, EngineWorker
from kvtier.mm.images import ImageLimits
from kvtier.server import create_app
from kvtier.server.auth import ServerAuth
from kvtier.server.limits import ServerLimits

MODEL = "tiny-chat"


@dataclass
class Server:
    base: str
    worker: EngineWorker

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    def client(self, api_key: str = "x", **kwargs: Any) -> Any:
        return openai.OpenAI(base_url=self.v1, api_key=api_key, max_retries=0, timeout=60, **kwargs)


@contextmanager
def serving(
    engine: Engine,
    name: str = MODEL,
    *,
    limits: ServerLimits | None = None,
    image_limits: ImageLimits | None = None,
    auth: ServerAuth | None = None,
    tls: dict[str, str] | None = None,
    role: str = "both",
) -> Iterator[Server]:
    """Serve ``engine`` with uvicorn on a free loopback port, in a background thread.

    ``tls`` holds uvicorn's ``ssl_certfile`` and ``ssl_keyfile``: the server speaks https.
    ``role`` is its side of prefill/decode disaggregation.
    """
    worker = EngineWorker(engine).start()
    try:
        app = create_app(
            worker, served_model_name=name, limits=limits, image_limits=image_limits, auth=auth,
            role=role,
        )  # fmt: skip
    except BaseException:
        worker.stop()
        raise
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2, **(tls or {})
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        scheme = "https" if tls else "http"
        yield Server(f"{scheme}://127.0.0.1:{port}", worker)
    finally:
        server.should_exit = True
        thread.join(15)
        worker.stop()
        sock.close()
        assert not thread.is_alive(), "the server did not shut down"


