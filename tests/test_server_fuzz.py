"""Fuzzing the live server from its own OpenAPI schema: no 5xx, no hang, the engine lives on.

Two generators, bounded in examples and time: schemathesis draws valid and
invalid bodies from the schema the server publishes (``/openapi.json``),
with the served model's name put in half of them so the requests reach the
engine; hypothesis strategies draw valid requests with extreme values (seed
bounds, penalties, biases, logprobs, several choices, stop strings, any
Unicode text), streamed or not. Every response must be below 500 and carry
OpenAI's error body when it is an error; afterwards ``/health`` is 200, a
normal request is answered and the cache's bookkeeping checks out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serving import MODEL, Server, serving  # noqa: E402
from tiny_model import tiny_engine  # noqa: E402

from kvtier.server.limits import ServerLimits  # noqa: E402

# Bounded: a few hundred requests in all, each at most a few hundred tiny-model tokens.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    engine = tiny_engine(num_blocks=256, block_size=16, max_num_seqs=4)
    limits = ServerLimits(max_body_bytes=256 * 1024, body_timeout_s=5.0)
    with serving(engine, limits=limits) as s:
        yield s


@pytest.fixture(scope="module")
def operations(server: Server) -> list[Any]:
    schema = schemathesis.openapi.from_dict(
        httpx.get(f"{server.base}/openapi.json", timeout=10).json()
    )
    return [op.ok() for op in schema.get_all_operations()]


def _check(resp: Any, what: object) -> None:
    assert resp.status_code < 500, f"{resp.status_code} for {what!r}: {resp.text[:500]}"
    if resp.status_code >= 400:
        body = json.loads(resp.text)
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzzing_finds_no_server_error(
    server: Server, operations: list[Any], mode: str
) -> None:
    from schemathesis import GenerationMode

    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    for op in operations:
        if generation is GenerationMode.NEGATIVE and (op.method.upper() != "POST" or not op.body):
            # Nothing to get wrong in a request without a body schema (the workflow
            # endpoints read free-form JSON and check it themselves).
            continue

        @FUZZ
        @given(case=op.as_strategy(generation_mode=generation), served=st.booleans())
        def fuzz(case: Any, served: bool) -> None:
            if served and isinstance(case.body, dict):
                case.body["model"] = MODEL
            _check(case.call(base_url=server.base, timeout=60), case.body)

        fuzz()
    _still_serving(server)


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)
_sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.001, 1),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(
            st.integers(0, 120).map(str), st.floats(-100, 100), max_size=4
        ),
        "n": st.integers(1, 4),
        "stop": st.one_of(_text.filter(bool), st.lists(_text.filter(bool), max_size=4)),
        "stream": st.booleans(),
        "max_tokens": st.integers(1, 24),
    },
)


@FUZZ
@given(
    messages=st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "developer", "user", "assistant"]),
                "content": _text,
            }
        ),
        min_size=1,
        max_size=4,
    ),
    sampling=_sampling,
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)
def test_valid_chat_requests_at_the_extremes_are_served(
    server: Server, messages: list[dict[str, str]], sampling: dict[str, Any], logprobs: Any
) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, **sampling}
    if logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = logprobs
    resp = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60)
    _check(resp, body)
    if resp.status_code == 200 and not body.get("stream"):
        assert len(resp.json()["choices"]) == body.get("n", 1)


@FUZZ
@given(
    prompt=st.one_of(_text.filter(bool), st.lists(st.integers(0, 120), min_size=1, max_size=40)),
    sampling=_sampling,
    logprobs=st.one_of(st.none(), st.integers(0, 5)),
)
def test_valid_completion_requests_at_the_extremes_are_served(
    server: Server, prompt: Any, sampling: dict[str, Any], logprobs: Any
) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, **sampling}
    if logprobs is not None:
        body["logprobs"] = logprobs
    resp = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
    _check(resp, body)


def test_the_engine_survived_the_fuzzing(server: Server) -> None:
    _still_serving(server)
    server.worker.call(lambda engine: engine.manager.check())
    assert server.worker.step_errors == 0
    counters = server.worker.engine.counters
    # The fuzzing reached the engine, not only the validation in front of it.
    assert counters.requests_added >= 50, counters.requests_added
    assert counters.finished.get("error", 0) == 0, counters.finished


def _still_serving(server: Server) -> None:
    assert httpx.get(f"{server.base}/health", timeout=10).json() == {"status": "ok"}
    r = httpx.post(
        f"{server.base}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200, r.text
