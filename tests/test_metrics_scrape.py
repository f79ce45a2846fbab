"""A scrape of ``/metrics`` answers while the engine is busy in a long step.

Snapshots are taken on the engine's thread between steps, and a step can
outlast a scraper's timeout (a long prefill on a CPU). A scrape then gets
the last snapshot; the one it asked for is taken after the step, for the
next scrape. With nothing taken yet, the read waits and fails past its
timeout.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")

from serving import MODEL, serving  # noqa: E402
from tiny_model import tiny_engine  # noqa: E402

from kvtier.engine import EngineWorker  # noqa: E402
from kvtier.errors import KvTierError  # noqa: E402
from kvtier.server.metrics import worker_reader  # noqa: E402


def _requests(body: str) -> float:
    for family in parser.text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == "kvtier_requests_total":
                return float(sample.value)
    raise AssertionError("kvtier_requests_total is not in the scrape")


def _block_engine(worker: EngineWorker, release: threading.Event) -> threading.Thread:
    """Hold the engine's thread, as a long step would, until ``release`` is set."""
    started = threading.Event()

    def hold(_engine: object) -> None:
        started.set()
        release.wait(60)

    thread = threading.Thread(target=worker.call, args=(hold, 90), daemon=True)
    thread.start()
    assert started.wait(30)
    return thread


def test_a_scrape_during_a_long_step_gets_the_last_snapshot() -> None:
    with serving(tiny_engine()) as srv, httpx.Client(timeout=30) as http:
        assert srv.worker is not None
        before = http.get(f"{srv.base}/metrics")
        assert before.status_code == 200
        srv.client().completions.create(model=MODEL, prompt="hello", max_tokens=2)
        release = threading.Event()
        holder = _block_engine(srv.worker, release)
        try:
            during = http.get(f"{srv.base}/metrics")
            assert holder.is_alive()  # answered while the engine was still held
            assert during.status_code == 200
            # The last snapshot, taken before the request: it is not counted yet.
            assert _requests(during.text) == _requests(before.text)
        finally:
            release.set()
            holder.join(30)
        deadline = time.monotonic() + 30
        while _requests(http.get(f"{srv.base}/metrics").text) == _requests(
            before.text
        ):
            assert time.monotonic() < deadline, "the scrape never caught up with the engine"
            time.sleep(0.05)


def test_the_first_read_with_a_held_engine_fails_past_its_timeout() -> None:
    worker = EngineWorker(tiny_engine()).start()
    release = threading.Event()
    try:
        holder = _block_engine(worker, release)
        read = worker_reader(worker, timeout=0.2, fresh_wait=0.05)
        with pytest.raises(KvTierError, match="did not answer"):
            read()
        release.set()
        holder.join(30)
        assert read().requests_added == 0  # the engine answers again: a fresh snapshot
    finally:
        release.set()
        worker.stop()
