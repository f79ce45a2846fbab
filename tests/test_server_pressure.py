"""The server under memory pressure: HTTP 503 in EMERGENCY, as docs/pressure.md promises.

The real FastAPI app over a real engine thread and the tiny model, driven
in process through Starlette's test client; a scripted monitor moves the
pressure ladder, and each reading is taken by hand so every mode is certain
when a request arrives.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from needs import need_module

need_module("torch")
need_module("transformers")
testclient = need_module("fastapi.testclient")

from tiny_model import tiny_engine  # noqa: E402

from kvtier import Ladder, Mode, ModeActions, PressureController, ScriptedMonitor  # noqa: E402
from kvtier.engine import EngineWorker  # noqa: E402
from kvtier.pressure import DEFAULT_ACTIONS  # noqa: E402
from kvtier.server import create_app  # noqa: E402

MODEL = "tiny-pressure"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}


class Served:
    def __init__(self, client: Any, ctrl: PressureController, mon: ScriptedMonitor) -> None:
        self.client = client
        self.ctrl = ctrl
        self.mon = mon

    def reading(self, fraction: float) -> Mode:
        self.mon.set(fraction)
        return self.ctrl.sample()


def _serve(emergency: str, max_wait: float) -> Iterator[Served]:
    actions = {**DEFAULT_ACTIONS, Mode.EMERGENCY: ModeActions(admission=emergency)}  # type: ignore[arg-type]
    mon = ScriptedMonitor(0.0)
    ladder = Ladder.from_fractions((0.5, 0.8, 0.9, 0.97), 0.05, actions)
    # A long interval: the readings of a test are the ones it takes itself.
    ctrl = PressureController(mon, ladder, interval=3600.0, max_wait=max_wait)
    engine = tiny_engine(num_blocks=64, block_size=4, pressure=ctrl)
    worker = EngineWorker(engine).start()
    try:
        app = create_app(worker, served_model_name=MODEL)
        with testclient.TestClient(app, raise_server_exceptions=False) as client:
            yield Served(client, ctrl, mon)
    finally:
        worker.stop()
        engine.close()


@pytest.fixture()
def rejecting() -> Iterator[Served]:
    yield from _serve("reject", max_wait=30.0)


@pytest.fixture()
def delaying() -> Iterator[Served]:
    yield from _serve("delay", max_wait=0.0)


def _assert_503(response: Any, *needles: str) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error"
    for needle in needles:
        assert needle in error["message"], error["message"]


ENDPOINTS = [("chat/completions", CHAT), ("completions", COMPLETION)]


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
def test_emergency_refuses_new_requests_with_503(
    rejecting: Served, path: str, body: dict[str, Any]
) -> None:
    client = rejecting.client
    assert client.post(f"/v1/{path}", json=body).status_code == 200  # RELAXED serves
    assert rejecting.reading(0.99) is Mode.EMERGENCY
    _assert_503(client.post(f"/v1/{path}", json=body), "EMERGENCY", "refuses")
    metrics = client.get("/metrics").text
    assert 'kvtier_requests_finished_total{reason="rejected"} 1' in metrics
    assert 'kvtier_pressure_mode{mode="EMERGENCY"} 1' in metrics
    # The mode falls back: the same request is served again.
    assert rejecting.reading(0.2) is not Mode.EMERGENCY
    reply = client.post(f"/v1/{path}", json=body)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3


def test_a_delaying_emergency_answers_503_once_max_wait_is_spent(delaying: Served) -> None:
    assert delaying.reading(0.99) is Mode.EMERGENCY
    _assert_503(delaying.client.post("/v1/chat/completions", json=CHAT), "EMERGENCY", "delays")
    stats = delaying.client.get("/v1/cache/stats").json()
    assert stats["pressure"]["mode"] == "EMERGENCY" and stats["pressure"]["rejected"] >= 1
