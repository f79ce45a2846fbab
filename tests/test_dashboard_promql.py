"""Every query of the Grafana dashboard runs in a real Prometheus scraping a real server.

tests/test_dashboard.py checks that the metric names of docs/grafana/kvtier.json
exist; this runs the queries themselves. A ``prometheus`` process on loopback
scrapes a served tiny random LLaVA (a host tier and memory-pressure handling,
so that every family the dashboard reads is present) twice a second; after a
text and an image request, every panel target, with Grafana's variables
replaced as Grafana replaces them, goes through ``/api/v1/query_range``:
Prometheus must parse and evaluate each one and return some series, and the
dashboard's variable query must find the server's instance.

Needs the ``prometheus`` binary (Debian: ``apt-get install prometheus``).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from needs import missing, need_module

need_module("torch")
need_module("transformers")
need_module("uvicorn")
need_module("openai")
httpx = need_module("httpx")
PROMETHEUS = shutil.which("prometheus")
if PROMETHEUS is None:
    missing("the prometheus binary", "apt-get install prometheus (Debian), or put it on PATH")

from serving import Server, serving  # noqa: E402
from tiny_vlm import dashboard_engine, png_bytes  # noqa: E402

from kvtier.mm.images import image_data_url  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "kvtier.json"
MODEL = "tiny-vlm"
SCRAPE = "500ms"
STEP_S = 0.5
#: Grafana's built-in interval variables; $__rate_interval spans four scrapes, as
#: Grafana's own minimum for it does.
BUILTINS = {"__rate_interval": "2s", "__interval": "500ms", "__range": "30s"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<match>.+?),\s*)?(?P<label>\w+)\)$")


def substitute(expr: str, values: dict[str, str]) -> str:
    """``$name``, ``${name}`` and ``[[name]]`` replaced; an unknown variable fails."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        assert name in values, f"the dashboard uses ${name}, which nothing defines: {expr!r}"
        return values[name]

    return _VARIABLE.sub(repl, expr)


def grafana_regex(values: list[str]) -> str:
    """A multi-value variable inside a PromQL regex string, as Grafana formats it."""
    escaped = [re.sub(r"([\\^$*+?.()|{}\[\]/])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def targets(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title + refId, expr) of every panel target, rows' nested panels included."""
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            found.extend((f"{p['title']} {t['refId']}", t["expr"]) for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return found


@dataclass
class Prometheus:
    http: Any
    instance: str

    def api(self, path: str, params: Any) -> dict[str, Any]:
        # Prometheus answers a bad query with HTTP 400 and a JSON error body.
        body: dict[str, Any] = self.http.get(f"/api/v1/{path}", params=params).json()
        return body


def test_grafana_regex_escapes_as_grafana_does() -> None:
    assert grafana_regex(["127.0.0.1:80"]) == r"127\\.0\\.0\\.1:80"
    assert grafana_regex(["a:1", "b:2"]) == "(a:1|b:2)"
    assert substitute('x{i=~"$i"}[${r}]', {"i": "a", "r": "5s"}) == 'x{i=~"a"}[5s]'
    with pytest.raises(AssertionError):
        substitute("rate(x[$__nope])", BUILTINS)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    engine = dashboard_engine(MODEL)
    with serving(engine, MODEL) as srv:
        yield srv
    engine.close()


@pytest.fixture(scope="module")
def prometheus(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    assert PROMETHEUS is not None
    work = tmp_path_factory.mktemp("prometheus")
    instance = server.base.split("://", 1)[1]
    config = {
        "global": {"scrape_interval": SCRAPE},
        "scrape_configs": [
            {
                "job_name": "kvtier",
                "scrape_interval": SCRAPE,
                "scrape_timeout": SCRAPE,
                "static_configs": [{"targets": [instance]}],
            }
        ],
    }
    (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(work / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        prom = Prometheus(http, instance)
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (work / "prometheus.log").read_text()
            try:
                active = prom.api("targets", {"state": "active"})["data"]["activeTargets"]
            except (httpx.HTTPError, ValueError):  # not listening yet; "not ready" (text)
                active = []
            if active and active[0]["health"] == "up":
                break
            assert time.monotonic() < deadline, f"the scrape target is not up: {active}"
            time.sleep(0.1)
        yield prom
    finally:
        http.close()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_every_panel_query_evaluates_in_prometheus(
    dashboard: dict[str, Any], server: Server, prometheus: Prometheus
) -> None:
    start = time.time() - 2
    client = server.client()
    image = {"type": "image_url", "image_url": {"url": image_data_url(png_bytes(1), "image/png")}}
    for content in ("a plain question", [image, {"type": "text", "text": "what is this?"}]):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=3,
            temperature=0,
        )

    # The variable query, as Grafana runs it: the label's values on matching series.
    (var,) = [v for v in dashboard["templating"]["list"] if v["type"] == "query"]
    m = _LABEL_VALUES.match(var["definition"].replace(" ", ""))
    assert m, var["definition"]
    values = dict(BUILTINS)
    exprs = targets(dashboard)
    assert len(exprs) >= 20

    # Scrapes land twice a second: wait until the requests' counts are in and every
    # target has series (a failing query fails at once, below, with its error).
    deadline = time.monotonic() + 15
    while True:
        found = prometheus.api(
            f"label/{m.group('label')}/values",
            [("match[]", m.group("match")), ("start", start), ("end", time.time())],
        )
        assert found["status"] == "success", found
        if prometheus.instance in found["data"]:
            values[var["name"]] = grafana_regex(found["data"])
            end = time.time()
            answers = {
                name: prometheus.api(
                    "query_range",
                    {"query": substitute(expr, values), "start": start, "end": end, "step": STEP_S},
                )
                for name, expr in exprs
            }
            errors = {n: a.get("error") for n, a in answers.items() if a["status"] != "success"}
            assert not errors, f"Prometheus refused these queries: {errors}"
            empty = sorted(n for n, a in answers.items() if not a["data"]["result"])
            if not empty:
                break
        else:
            empty = ["the variable query found no instance"]
        assert time.monotonic() < deadline, f"no series, after 15 s of scrapes, for: {empty}"
        time.sleep(0.5)
    assert found["data"] == [prometheus.instance]
