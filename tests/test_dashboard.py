"""The Grafana dashboard (docs/grafana/kvtier.json) queries only metrics a server exposes.

Every PromQL expression of the dashboard is tokenized, checked for balanced
brackets and known functions, and its metric names are collected; a real
server (the tiny random LLaVA, with a host tier and memory-pressure
handling, so that every family is present) answers a text and an image
request, and its ``/metrics`` must expose each of those names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")
httpx = pytest.importorskip("httpx")

from serving import Server, serving  # noqa: E402
from tiny_vlm import dashboard_engine, png_bytes  # noqa: E402

from kvtier.mm.images import image_data_url  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "kvtier.json"
MODEL = "tiny-vlm"

#: Grafana's variables, replaced by what they stand for before parsing.
_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$instance": ".*"}

_FUNCTIONS = {
    "abs", "avg", "avg_over_time", "clamp_min", "count", "delta", "histogram_quantile",
    "increase", "irate", "label_values", "max", "max_over_time", "min", "rate", "scalar",
    "sum", "topk", "vector",
}
_KEYWORDS = {"and", "or", "unless", "bool", "offset"}
#: Keywords followed by a parenthesised list of label names (not metrics).
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}

_TOKEN = re.compile(
    r"""(?P<ws>\s+)
    |(?P<str>"(?:[^"\\]|\\.)*")
    |(?P<matchers>\{[^{}]*\})
    |(?P<range>\[[0-9]+[smhdwy]\])
    |(?P<num>[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)
    |(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    |(?P<op>==|!=|>=|<=|[-+*/%^<>(),])
    """,
    re.VERBOSE,
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects; fails on what it cannot tokenize."""
    for var, value in _VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        assert m, f"cannot tokenize {expr[pos:]!r} in {expr!r}"
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        if kind != "ws":
            tokens.append((kind, m.group()))
    depth = 0
    for _, text in tokens:
        depth += {"(": 1, ")": -1}.get(text, 0)
        assert depth >= 0, f"unbalanced parentheses in {expr!r}"
    assert depth == 0, f"unbalanced parentheses in {expr!r}"
    names: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "ident" and text in _LABEL_LISTS:
            if nxt == "(":  # skip the label names up to the closing parenthesis
                while tokens[i][1] != ")":
                    i += 1
        elif kind == "ident" and (nxt == "(" or nxt in ("by", "without")):
            assert text in _FUNCTIONS, f"unknown function {text!r} in {expr!r}"
        elif kind == "ident" and text not in _KEYWORDS:
            names.add(text)
        elif kind == "matchers":
            assert i > 0 and tokens[i - 1][0] == "ident", f"matchers without a metric in {expr!r}"
        i += 1
    return names


def dashboard_queries(dash: dict[str, Any]) -> list[str]:
    """Every panel target's ``expr`` and every query variable's query."""
    exprs: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    return exprs


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def test_the_dashboard_is_a_grafana_10_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 38  # Grafana 10.0's
    (ds,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    uid = "${" + ds["name"] + "}"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == uid
    titles = " / ".join(p["title"] for p in panels).lower()
    for needed in ("hit ratio", "by tier", "time to first token", "tokens/s", "evicted",
                   "memory-pressure mode", "encoder-cache hits", "running / waiting"):
        assert needed in titles, needed


def test_the_query_parser_finds_metrics_not_labels_or_functions() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{instance=~"$instance"}'
        "[$__rate_interval]))) / on (instance) group_left b * scalar(sum(c_total)) > bool 0"
    )
    assert metric_names(expr) == {"a_bucket", "b", "c_total"}
    with pytest.raises(AssertionError):
        metric_names("sum(rate(x[5m])")
    with pytest.raises(AssertionError):
        metric_names("nonsense_fn(x)")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    engine = dashboard_engine(MODEL)
    with serving(engine, MODEL) as srv:
        yield srv
    engine.close()


def test_every_metric_the_dashboard_queries_is_exposed(
    dashboard: dict[str, Any], server: Server
) -> None:
    client = server.client()
    image = {"type": "image_url", "image_url": {"url": image_data_url(png_bytes(1), "image/png")}}
    for content in ("a plain question", [image, {"type": "text", "text": "what is this?"}]):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=3,
            temperature=0,
        )
    r = httpx.get(f"{server.base}/metrics", timeout=30)
    assert r.status_code == 200
    families = list(parser.text_string_to_metric_families(r.text))
    exposed = {s.name for f in families for s in f.samples}
    kinds = {f.name: f.type for f in families}
    queried: set[str] = set()
    for expr in dashboard_queries(dashboard):
        if expr.startswith("label_values("):  # a variable: label_values(METRIC, LABEL)
            queried.add(expr[len("label_values(") :].split(",")[0].strip())
        else:
            queried |= metric_names(expr)
    assert len(queried) >= 25
    for name in sorted(queried):
        assert name.startswith("kvtier_"), name
        assert name in exposed, f"the dashboard queries {name}, which /metrics does not expose"
        for suffix in ("_bucket", "_sum", "_count"):
            base = name.removesuffix(suffix)
            if base != name and base in kinds:
                assert kinds[base] == "histogram", name
    # Each histogram the dashboard reads is read through its buckets.
    assert "kvtier_time_to_first_token_seconds_bucket" in queried
