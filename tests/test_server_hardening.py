"""The server under hostile and careless clients, over real HTTP on a loopback port.

No request may stop the engine thread; every refusal is a 4xx with OpenAI's
error body; limits refuse oversize, slow and excess requests before they
cost anything; the OpenAI fields the server accepts are honoured (logprobs,
n, penalties, logit_bias, seed) or refused by name.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serving import MODEL, Server, serving  # noqa: E402
from tiny_model import tiny_engine  # noqa: E402

from kvtier.engine import Engine, EngineWorker  # noqa: E402
from kvtier.server.limits import ServerLimits  # noqa: E402

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serving(tiny_engine(num_blocks=256, block_size=16, max_num_seqs=4)) as s:
        yield s


def _post(server: Server, path: str, body: Any = None, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(
        f"{server.base}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()  # always valid JSON, whatever the input held
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return dict(body["error"])


def _healthy_and_answering(server: Server) -> None:
    assert httpx.get(f"{server.base}/health", timeout=10).json() == {"status": "ok"}
    ok = _post(server, "/v1/chat/completions", {**CHAT, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


# -- nothing a client sends stops the engine ------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1, 10**30])
def test_out_of_range_seed_is_400_and_the_engine_keeps_serving(server: Server, seed: int) -> None:
    err = _error(
        _post(server, "/v1/chat/completions", {**CHAT, "temperature": 0.7, "seed": seed}), 400
    )
    assert err["param"] == "seed"
    _healthy_and_answering(server)


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_seeds_at_the_bounds_are_served(server: Server, seed: int) -> None:
    r = _post(server, "/v1/chat/completions", {**CHAT, "temperature": 0.7, "seed": seed})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
        b'{"model": "tiny-chat", "messages": [{"role": "\\ud800", "content": "hi"}]}',
        b'{"model": "tiny-chat", "messages": [{"role": "user", "content": [{"type": "text", '
        b'"text": "\\udfff"}]}]}',
        b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi", '
        b'"name": "\\ud800"}]}',
        b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
        b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], '
        b'"stop": "\\ud800"}',
    ],
)
def test_lone_surrogates_are_400_with_a_valid_body(server: Server, raw: bytes) -> None:
    err = _error(_post(server, "/v1/chat/completions", raw=raw), 400)
    assert err["type"] == "invalid_request_error"
    _healthy_and_answering(server)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny-chat", "prompt": "\\ud800 x"}',
        b'{"model": "tiny-chat", "prompt": ["\\udc00"]}',
        b'{"model": "\\ud800", "prompt": "x"}',
    ],
)
def test_lone_surrogates_in_completions_are_400(server: Server, raw: bytes) -> None:
    _error(_post(server, "/v1/completions", raw=raw), 400)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": "0.5"}, "temperature"),
        ({"n": 1.0}, "n"),
        ({"logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_types_are_strict(server: Server, fields: dict[str, Any], param: str) -> None:
    err = _error(_post(server, "/v1/chat/completions", {**CHAT, **fields}), 400)
    assert err["param"] == param


def test_non_finite_numbers_are_400(server: Server) -> None:
    raw = b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], ' \
        b'"temperature": NaN}'
    assert _error(_post(server, "/v1/chat/completions", raw=raw), 400)["param"] == "temperature"


def test_a_request_that_fails_unexpectedly_fails_alone(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.worker.engine
    real = engine.enqueue

    def broken(seq: Any) -> None:
        if seq.params.max_tokens == 7:
            raise RuntimeError("an unforeseen bug")
        real(seq)

    monkeypatch.setattr(engine, "enqueue", broken)
    err = _error(_post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 7}), 500)
    assert "RuntimeError: an unforeseen bug" in err["message"]
    _healthy_and_answering(server)


def test_a_step_that_raises_fails_the_requests_in_flight_and_serving_goes_on(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.worker.engine
    real = engine.step
    calls = {"n": 0}

    def step_once_broken() -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("step blew up")
        return real()

    monkeypatch.setattr(engine, "step", step_once_broken)
    err = _error(_post(server, "/v1/chat/completions", CHAT), 500)
    assert "step blew up" in err["message"]
    monkeypatch.setattr(engine, "step", real)
    _healthy_and_answering(server)
    engine.manager.check()


def test_a_dead_engine_thread_is_unhealthy_fails_everyone_and_reports_it() -> None:
    engine = tiny_engine(num_blocks=64, block_size=16)
    fatal: list[BaseException] = []
    worker = EngineWorker(engine, on_fatal=fatal.append)

    def broken() -> bool:
        raise RuntimeError("the loop itself broke")

    engine.has_unfinished = broken  # type: ignore[method-assign]
    from kvtier.server import create_app

    app = create_app(worker, served_model_name=MODEL)
    from starlette.testclient import TestClient

    with TestClient(app) as client:
        worker.start()
        handle = None
        deadline = time.monotonic() + 30
        while worker.fatal is None and time.monotonic() < deadline:
            try:
                handle = worker.submit([5, 6, 7], _params())
            except Exception:
                break
            time.sleep(0.01)
        worker._thread.join(30)  # the loop is over: every failure was delivered
        assert worker.fatal is not None and isinstance(fatal[0], RuntimeError)
        if handle is not None:  # a request caught in the crash failed; it did not hang
            _, last = handle.result()
            assert last.finish_reason == "error"
        health = client.get("/health")
        assert health.status_code == 503 and "the loop itself broke" in health.json()["engine"]
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503
    worker.stop()


def _params() -> Any:
    from kvtier.engine import SamplingParams

    return SamplingParams(max_tokens=2, temperature=0)


# -- limits ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited() -> Iterator[Server]:
    limits = ServerLimits(
        max_body_bytes=64 * 1024,
        max_prompt_chars=2_000,
        max_messages=8,
        max_queued=0,
        body_timeout_s=0.5,
    )
    engine = tiny_engine(num_blocks=256, block_size=16, max_num_seqs=1)
    with serving(engine, limits=limits) as s:
        yield s


def test_an_oversize_body_is_413_before_it_is_read(limited: Server) -> None:
    prompt = "x" * (200 * 1024)
    err = _error(_post(limited, "/v1/completions", {"model": MODEL, "prompt": prompt}), 413)
    assert err["code"] == "request_too_large" and "65,536 bytes" in err["message"]


def test_an_oversize_chunked_body_is_413(limited: Server) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny-chat", "prompt": "'
        for _ in range(100):
            yield b"y" * 1024
        yield b'"}'

    r = httpx.post(
        f"{limited.base}/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    _error(r, 413)


def test_a_body_that_never_arrives_is_408(limited: Server) -> None:
    host, port = limited.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"model\": "
        )
        data = b""
        while b"\r\n\r\n" not in data:
            part = sock.recv(4096)
            if not part:
                break
            data += part
    assert data.startswith(b"HTTP/1.1 408"), data[:100]


def test_a_long_prompt_is_refused_before_tokenizing(
    limited: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = limited.worker.engine
    calls: list[int] = []
    real = engine.encode_prompt
    monkeypatch.setattr(engine, "encode_prompt", lambda p: calls.append(1) or real(p))
    err = _error(_post(limited, "/v1/completions", {"model": MODEL, "prompt": "z" * 2_001}), 400)
    assert err["code"] == "context_length_exceeded" and "2,001 characters" in err["message"]
    chat = {**CHAT, "messages": [{"role": "user", "content": "z" * 1_500}] * 2}
    _error(_post(limited, "/v1/chat/completions", chat), 400)
    assert calls == []


def test_too_many_messages_is_400(limited: Server) -> None:
    chat = {**CHAT, "messages": [{"role": "user", "content": "m"}] * 9}
    err = _error(_post(limited, "/v1/chat/completions", chat), 400)
    assert err["param"] == "messages" and "at most 8 messages" in err["message"]


def test_a_full_queue_is_429_with_retry_after(limited: Server) -> None:
    client = limited.client()
    started = threading.Event()
    done = threading.Event()

    def hold() -> None:
        stream = client.completions.create(
            model=MODEL, prompt="busy", max_tokens=400, temperature=0, stream=True
        )
        for _ in stream:
            started.set()
        done.set()

    engine = limited.worker.engine
    eos = engine.eos_token_ids
    # No end-of-sequence token: the random model cannot end the long request early,
    # so it surely holds the one slot when the next request arrives.
    engine.eos_token_ids = frozenset()
    try:
        t = threading.Thread(target=hold, daemon=True)
        t.start()
        assert started.wait(30)
        r = _post(limited, "/v1/chat/completions", CHAT)
        assert not done.is_set()
        err = _error(r, 429)
        assert err["code"] == "rate_limit_exceeded"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        t.join(60)
        assert done.is_set()
    finally:
        engine.eos_token_ids = eos
    assert _post(limited, "/v1/chat/completions", CHAT).status_code == 200


def test_derived_prompt_limit_is_context_times_the_longest_token() -> None:
    engine = tiny_engine(num_blocks=64, block_size=16)
    from kvtier.server import create_app

    app = create_app(EngineWorker(engine), served_model_name=MODEL)
    longest = max(len(t) for t in engine.tokenizer.get_vocab())
    assert app.state.max_prompt_chars == engine.max_model_len * longest


# -- the OpenAI surface is honoured ------------------------------------------------------------


def _full_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_chat_logprobs_match_a_full_forward_pass(server: Server) -> None:
    engine = server.worker.engine
    messages = [{"role": "user", "content": "logprobs over http"}]
    r = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert "".join(c.token for c in content) == text
    ids = engine.encode_chat(messages)
    generated = [engine.tokenizer.convert_tokens_to_ids(c.token) for c in content]
    ref = _full_logprobs(engine, ids + generated)
    for i, c in enumerate(content):
        row = ref[len(ids) - 1 + i]
        assert c.logprob == pytest.approx(float(row[generated[i]]), abs=1e-4)
        assert bytes(c.bytes) == c.token.encode()
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True
        )
    streamed = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    got = [
        e for chunk in streamed for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content
    ]
    assert [(e.token, round(e.logprob, 5)) for e in got] == [
        (e.token, round(e.logprob, 5)) for e in content
    ]


def test_completion_logprobs_have_offsets(server: Server) -> None:
    r = server.client().completions.create(
        model=MODEL, prompt="offsets", max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)


def test_n_choices_over_http(server: Server) -> None:
    client = server.client()
    before = httpx.get(f"{server.base}/v1/cache/stats", timeout=10).json()["engine"]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "three ways"}],
        max_tokens=6,
        temperature=1.0,
        seed=5,
        n=3,
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    after = httpx.get(f"{server.base}/v1/cache/stats", timeout=10).json()["engine"]
    assert after["forked_sequences"] - before["forked_sequences"] == 2
    prompt = r.usage.prompt_tokens
    assert after["computed_prompt_tokens"] - before["computed_prompt_tokens"] <= prompt
    # One token per character with the tiny tokenizer, plus the EOS of a "stop".
    assert r.usage.completion_tokens == sum(
        len(c.message.content or "") + (c.finish_reason == "stop") for c in r.choices
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "three ways"}],
            max_tokens=6,
            temperature=1.0,
            seed=5,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2}
    # Seeded: the stream produced the same three texts as the plain request.
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_penalties_bias_and_seed_reach_the_engine(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "aaaa aaaa aaaa"}]

    def say(**kw: Any) -> str:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **kw)
        return r.choices[0].message.content or ""

    plain = say(temperature=0)
    assert say(temperature=0, frequency_penalty=2.0) != plain
    q = server.worker.engine.tokenizer.convert_tokens_to_ids("Q")
    assert say(temperature=0, logit_bias={str(q): 100}) == "Q" * 8
    assert say(temperature=1.5, seed=3) == say(temperature=1.5, seed=3)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ],
)
def test_unsupported_features_are_refused_by_name(
    server: Server, fields: dict[str, Any], param: str
) -> None:
    err = _error(_post(server, "/v1/chat/completions", {**CHAT, **fields}), 400)
    assert err["param"] == param and "not supported" in err["message"]


def test_plain_text_response_format_is_accepted(server: Server) -> None:
    r = _post(server, "/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}})
    assert r.status_code == 200


# -- a shared tier shares -----------------------------------------------------------------------


def test_two_servers_on_one_redis_share_a_prompt_at_once() -> None:
    from needs import need_redis_server
    from redis_servers import RedisServer

    need_redis_server()
    from kvtier.offload.config import TierSpec

    content = "a long shared question " * 12
    with RedisServer() as redis:
        # Default write mode: Redis is shared, so it writes through.
        tier = TierSpec("redis", 64 * 2**20, location=redis.url)
        a = tiny_engine(num_blocks=128, block_size=8, tiers=[tier])
        b = tiny_engine(num_blocks=128, block_size=8, tiers=[tier])
        assert a.tier_chain is not None and a.tier_chain.write_mode == "write_through"
        with serving(a) as sa, serving(b) as sb:
            messages = [{"role": "user", "content": content}]
            first = sa.client().chat.completions.create(
                model=MODEL, messages=messages, max_tokens=3, temperature=0
            )
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            sa.worker.call(lambda e: e.tier_chain.flush())  # A's background stores are done
            second = sb.client().chat.completions.create(
                model=MODEL, messages=messages, max_tokens=3, temperature=0
            )
            prompt = second.usage.prompt_tokens
            cached = second.usage.prompt_tokens_details.cached_tokens
            assert cached == (prompt - 1) // 8 * 8 > 0  # every full block but the last token's
            assert second.choices[0].message.content == first.choices[0].message.content
            stats = httpx.get(f"{sb.base}/v1/cache/stats", timeout=10).json()
            assert stats["engine"]["loaded_prompt_tokens"] == cached
