"""The OpenAI-compatible server, driven over HTTP by the official ``openai`` client.

A real uvicorn server runs the tiny random model on a loopback port. Every
expected answer comes from a second engine over the same weights, run alone
and greedily, so the tests check that the server returns exactly what the
engine generates: text, finish reason and token counts.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serving import Server, serving  # noqa: E402
from tiny_model import tiny_engine  # noqa: E402

from kvtier.engine import Engine, SamplingParams  # noqa: E402

MODEL = "tiny-chat"
NUM_BLOCKS = 512
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serving(tiny_engine(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=4)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return server.client()


@pytest.fixture(scope="module")
def reference() -> Engine:
    """The same weights in an engine of its own, for the expected answers."""
    return tiny_engine(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


@dataclass
class Expected:
    text: str
    finish_reason: str
    completion_tokens: int
    prompt_tokens: int


def greedy(ref: Engine, ids: list[int], max_tokens: int, stop: tuple[str, ...] = ()) -> Expected:
    outs = list(ref.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop)))
    last = outs[-1]
    assert last.finish_reason is not None
    assert last.metrics.completion_tokens == sum(len(o.token_ids) for o in outs)
    return Expected(
        "".join(o.text for o in outs), last.finish_reason, last.metrics.completion_tokens, len(ids)
    )


def chat_expected(
    ref: Engine, content: str, max_tokens: int, stop: tuple[str, ...] = ()
) -> Expected:
    return greedy(ref, ref.encode_chat([{"role": "user", "content": content}]), max_tokens, stop)


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def unique(text: str) -> str:
    """``text`` behind a random prefix, so no earlier request shares its blocks."""
    return f"{uuid.uuid4().hex[:12]} {text}"


# -- chat completions ----------------------------------------------------------------


def test_models_list_returns_the_served_name(client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_chat_completion_matches_the_engine(client: Any, reference: Engine) -> None:
    content = "Hello there, how are you?"
    want = chat_expected(reference, content, 12)
    r = client.chat.completions.create(
        model=MODEL, messages=user(content), max_tokens=12, temperature=0
    )
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert isinstance(choice.message.content, str)
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert choice.finish_reason in {"stop", "length"}
    assert r.usage.completion_tokens == want.completion_tokens
    assert r.usage.prompt_tokens == want.prompt_tokens == len(reference.encode_chat(user(content)))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if want.finish_reason == "length":
        assert want.completion_tokens == 12


def test_max_completion_tokens_and_content_parts(client: Any, reference: Engine) -> None:
    want = chat_expected(reference, "part one, part two", 5)
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "part one, "},
                    {"type": "text", "text": "part two"},
                ],
            }
        ],
        max_completion_tokens=5,
        temperature=0,
    )
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == want.completion_tokens <= 5
    assert r.usage.prompt_tokens == want.prompt_tokens


def test_chat_streaming_concatenates_to_the_same_answer(client: Any, reference: Engine) -> None:
    content = "Tell me a story about a fox."
    want = chat_expected(reference, content, 14)
    plain = client.chat.completions.create(
        model=MODEL, messages=user(content), max_tokens=14, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=user(content),
            max_tokens=14,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == plain.choices[0].message.content == want.text
    finishes = [c.choices[0].finish_reason for c in with_choices]
    assert finishes[-1] == want.finish_reason
    assert all(f is None for f in finishes[:-1])
    # The usage chunk comes last, with no choices.
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == want.completion_tokens
    assert chunks[-1].usage.prompt_tokens == want.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streaming_without_usage_sends_no_usage_chunk(client: Any, reference: Engine) -> None:
    want = chat_expected(reference, "abc", 6)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=user("abc"), max_tokens=6, temperature=0, stream=True
        )
    )
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_stream_is_server_sent_events_ending_with_done(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": user("sse"),
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.v1}/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_stop_string_cuts_the_answer_before_it(client: Any, reference: Engine) -> None:
    content = "Hello there!"
    full = chat_expected(reference, content, 24).text
    # A two-character stop whose first occurrence is at k >= 2: the answer is full[:k].
    k = next(i for i in range(2, len(full) - 1) if full.find(full[i : i + 2]) == i)
    stop = full[k : k + 2]
    r = client.chat.completions.create(
        model=MODEL, messages=user(content), max_tokens=24, temperature=0, stop=[stop]
    )
    assert r.choices[0].message.content == full[:k]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=MODEL, messages=user(content), max_tokens=24, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_repeated_request_reports_cached_tokens(client: Any, reference: Engine) -> None:
    content = unique("a prompt long enough to fill a few KV blocks of sixteen tokens each")
    first = client.chat.completions.create(
        model=MODEL, messages=user(content), max_tokens=4, temperature=0
    )
    second = client.chat.completions.create(
        model=MODEL, messages=user(content), max_tokens=4, temperature=0
    )
    n = first.usage.prompt_tokens
    assert n >= 3 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK_SIZE == 0 and cached < n
    assert cached >= (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.choices[0].message.content == first.choices[0].message.content
    assert first.choices[0].message.content == chat_expected(reference, content, 4).text


def test_concurrent_requests_get_their_own_answers(client: Any, reference: Engine) -> None:
    words = ["ab", "cat", "dog", "fish", "bird", "horse"]
    prompts = [f"request {i}: {word}" for i, word in enumerate(words)]
    want = {p: chat_expected(reference, p, 10) for p in prompts}
    assert len({w.text for w in want.values()}) > 1, "prompts should give different answers"

    def ask(i: int, prompt: str) -> tuple[str, str, int]:
        if i % 2:
            chunks = list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=user(prompt),
                    max_tokens=10,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
            return text, finish, chunks[-1].usage.completion_tokens
        r = client.chat.completions.create(
            model=MODEL, messages=user(prompt), max_tokens=10, temperature=0
        )
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, range(len(prompts)), prompts))
    for prompt, (text, finish, tokens) in zip(prompts, got, strict=True):
        w = want[prompt]
        assert (text, finish, tokens) == (w.text, w.finish_reason, w.completion_tokens), prompt


# -- completions -----------------------------------------------------------------------


def test_completion_matches_the_engine(client: Any, reference: Engine) -> None:
    prompt = "Once upon a time"
    want = greedy(reference, reference.encode_prompt(prompt), 10)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == want.completion_tokens
    # Token ids as the prompt give the same answer.
    by_ids = client.completions.create(
        model=MODEL, prompt=reference.encode_prompt(prompt), max_tokens=10, temperature=0
    )
    assert by_ids.choices[0].text == want.text


def test_completion_max_tokens_defaults_to_16(client: Any, reference: Engine) -> None:
    prompt = "zzz"
    want = greedy(reference, reference.encode_prompt(prompt), 16)
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0)
    assert r.usage.completion_tokens == want.completion_tokens
    assert r.choices[0].text == want.text
    if want.finish_reason == "length":
        assert r.usage.completion_tokens == 16


def test_completion_streaming(client: Any, reference: Engine) -> None:
    prompt = "The quick brown fox"
    want = greedy(reference, reference.encode_prompt(prompt), 9)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[prompt],
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == want.text
    assert with_choices[-1].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.completion_tokens


# -- errors ----------------------------------------------------------------------------

_CHAT_ERRORS: list[tuple[str, dict[str, Any], str | None, str | None]] = [
    # (case, request fields over a valid request, expected param, expected code)
    ("empty messages", {"messages": []}, "messages", None),
    ("negative max_tokens", {"max_tokens": -1}, "max_tokens", None),
    ("zero max_tokens", {"max_tokens": 0}, "max_tokens", None),
    ("unknown model", {"model": "gpt-4o"}, "model", "model_not_found"),
    ("over-long prompt", {"messages": user("x" * 600)}, "messages", "context_length_exceeded"),
    ("prompt + max_tokens too long", {"max_tokens": 600}, "max_tokens", "context_length_exceeded"),
    ("n above max_num_seqs", {"n": 5}, "n", None),
    ("n above 16", {"n": 17}, "n", None),
    ("seed above int64", {"seed": 2**63}, "seed", None),
    ("seed below int64", {"seed": -(2**63) - 1}, "seed", None),
    ("presence_penalty 3", {"presence_penalty": 3}, "presence_penalty", None),
    ("frequency_penalty -2.5", {"frequency_penalty": -2.5}, "frequency_penalty", None),
    ("logit_bias 101", {"logit_bias": {"5": 101}}, "logit_bias.5", None),
    ("logit_bias word key", {"logit_bias": {"hello": 1}}, "logit_bias", None),
    ("logit_bias outside vocab", {"logit_bias": {"100000": 1}}, "logit_bias", None),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs", None),
    ("top_logprobs 21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    (
        "tool_choice names no tool",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice.function.name",
        None,
    ),
    ("json mode", {"response_format": {"type": "json_object"}}, "response_format", None),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
    ("missing content", {"messages": [{"role": "user"}]}, "messages[0].content", None),
    (
        "null content",
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content",
        None,
    ),
    (
        "tool message",
        {"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]},
        "messages[0].tool_call_id",
        None,
    ),
    ("temperature 5", {"temperature": 5}, "temperature", None),
    ("top_p 0", {"top_p": 0}, "top_p", None),
    ("five stop strings", {"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    (
        "image part",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        },
        "messages[0].content[0]",
        None,
    ),
]


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [c[1:] for c in _CHAT_ERRORS],
    ids=[c[0] for c in _CHAT_ERRORS],
)
def test_bad_chat_requests_are_400(
    client: Any, fields: dict[str, Any], param: str | None, code: str | None
) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": user("hi"), "max_tokens": 4}
    kwargs.update(fields)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kwargs)
    err = info.value
    assert err.status_code == 400
    assert err.body["type"] == "invalid_request_error"
    assert err.body["param"] == param
    assert err.body["code"] == code
    assert isinstance(err.body["message"], str) and err.body["message"]
    if code == "context_length_exceeded":
        assert "maximum context length is 512 tokens" in err.body["message"]


_COMPLETION_ERRORS: list[tuple[str, dict[str, Any], str | None, str | None]] = [
    ("empty prompt", {"prompt": ""}, "prompt", None),
    ("two prompts", {"prompt": ["a", "b"]}, "prompt", None),
    ("echo", {"echo": True}, "echo", None),
    ("over-long prompt", {"prompt": "y" * 600}, "prompt", "context_length_exceeded"),
    ("token id out of range", {"prompt": [1, 2, 10_000]}, "prompt", None),
    ("unknown model", {"model": "davinci"}, "model", "model_not_found"),
]


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [c[1:] for c in _COMPLETION_ERRORS],
    ids=[c[0] for c in _COMPLETION_ERRORS],
)
def test_bad_completion_requests_are_400(
    client: Any, fields: dict[str, Any], param: str | None, code: str | None
) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    kwargs.update(fields)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"
    assert (info.value.body["param"], info.value.body["code"]) == (param, code)


def _assert_openai_error(r: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    return err


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b'{"model": "tiny-chat", "messages": [', None),
        (b"", None),
        (b"[1, 2]", None),
        (b'{"model": "tiny-chat"}', "messages"),
        (b'{"model": "tiny-chat", "messages": "hi"}', "messages"),
        (
            b'{"model": "tiny-chat", "messages": [{"role": "user", "content": 5}]}',
            "messages[0].content",
        ),
        (b'{"model": "tiny-chat", "messages": [{"content": "hi"}]}', "messages[0].role"),
        (
            b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], '
            b'"max_tokens": "many"}',
            "max_tokens",
        ),
    ],
    ids=[
        "malformed",
        "empty",
        "array",
        "no messages",
        "messages string",
        "content int",
        "no role",
        "max_tokens string",
    ],
)
def test_malformed_bodies_are_400_with_the_openai_shape(
    server: Server, content: bytes, param: str | None
) -> None:
    r = httpx.post(
        f"{server.v1}/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    _assert_openai_error(r, 400, param)


def test_unknown_fields_are_ignored(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": user("hi"),
        "max_tokens": 2,
        "temperature": 0,
        "presence_penalty": 0.5,
        "some_future_field": {"x": 1},
    }
    r = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_unknown_route_is_404(server: Server) -> None:
    r = httpx.post(f"{server.v1}/embeddings", json={"model": MODEL, "input": "x"}, timeout=30)
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"


# -- health, metrics, stats ---------------------------------------------------------------

_METRIC_LINE = re.compile(
    r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*=\"[^\"]*\",?)*\})? "
    r"(-?[0-9.]+(?:e[+-]?[0-9]+)?|[+-]Inf|NaN)$"
)

REQUIRED_METRICS = [
    "kvtier_prefix_cache_hit_tokens_total",
    "kvtier_prefix_cache_queried_tokens_total",
    "kvtier_prefix_cache_hit_ratio",
    "kvtier_kv_blocks_used",
    "kvtier_kv_blocks_free",
    "kvtier_kv_blocks_cached",
    "kvtier_kv_blocks_total",
    "kvtier_kv_evictions_total",
    "kvtier_requests_running",
    "kvtier_requests_waiting",
    "kvtier_requests_finished_total",
    "kvtier_prompt_tokens_total",
    "kvtier_generation_tokens_total",
    "kvtier_time_to_first_token_seconds_bucket",
    "kvtier_time_to_first_token_seconds_sum",
    "kvtier_time_to_first_token_seconds_count",
    "kvtier_preemptions_total",
]


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels}`` -> value; fails on any line that is not a comment or a sample."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def test_health(server: Server) -> None:
    r = httpx.get(f"{server.base}/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics(server: Server, client: Any) -> None:
    content = unique("metrics need a repeated prompt that spans more than one block")
    for _ in range(2):
        client.chat.completions.create(
            model=MODEL, messages=user(content), max_tokens=3, temperature=0
        )
    r = httpx.get(f"{server.base}/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = parse_metrics(r.text)
    names = {key.split("{")[0] for key in samples}
    assert set(REQUIRED_METRICS) <= names, set(REQUIRED_METRICS) - names
    assert samples["kvtier_prefix_cache_hit_tokens_total"] > 0
    assert (
        samples["kvtier_prefix_cache_queried_tokens_total"]
        >= samples["kvtier_prefix_cache_hit_tokens_total"]
    )
    assert 0 < samples["kvtier_prefix_cache_hit_ratio"] <= 1
    assert samples["kvtier_kv_blocks_total"] == NUM_BLOCKS
    assert samples["kvtier_kv_blocks_cached"] > 0
    assert samples["kvtier_generation_tokens_total"] >= 6
    assert samples["kvtier_prompt_tokens_total"] > samples["kvtier_prefix_cache_hit_tokens_total"]
    finished = sum(v for k, v in samples.items() if k.startswith("kvtier_requests_finished_total{"))
    assert finished >= 2
    assert samples['kvtier_requests_finished_total{reason="length"}'] >= 1
    count = samples["kvtier_time_to_first_token_seconds_count"]
    assert count >= 2
    assert samples['kvtier_time_to_first_token_seconds_bucket{le="+Inf"}'] == count


def test_cache_stats(server: Server, client: Any) -> None:
    content = unique("the cache statistics endpoint reports hits after a repeat")
    for _ in range(2):
        client.chat.completions.create(
            model=MODEL, messages=user(content), max_tokens=2, temperature=0
        )
    r = httpx.get(f"{server.v1}/cache/stats", timeout=30)
    assert r.status_code == 200
    stats = r.json()
    assert stats["hit_tokens"] > 0 and stats["queried_tokens"] >= stats["hit_tokens"]
    assert stats["total_blocks"] == NUM_BLOCKS
    assert stats["used_blocks"] + stats["free_blocks"] == NUM_BLOCKS
    assert stats["policy"] == "lru"
    # 2 layers x 2 KV heads x 16 dims x K and V x float32, per token; 16 tokens a block.
    assert stats["bytes_per_block"] == 2 * 2 * 16 * 2 * 4 * BLOCK_SIZE
    assert stats["layout"]["block_size"] == BLOCK_SIZE
    engine = stats["engine"]
    assert engine["cached_prompt_tokens"] > 0 and engine["generation_tokens"] > 0
    assert engine["requests_added"] >= 2 and engine["running"] == 0


# -- failures inside the engine, disconnects, shutdown -------------------------------------


class FaultyModel:
    """Wraps a model: ``mode`` "raise" fails every forward pass; "slow" sleeps before each
    and never picks an end-of-sequence token, so a request runs to its max_tokens."""

    def __init__(self, model: Any, eos_token_ids: frozenset[int]) -> None:
        self.model = model
        self.config = model.config
        self.eos = sorted(eos_token_ids)
        self.mode = "ok"

    def parameters(self) -> Any:
        return self.model.parameters()

    def __call__(self, **kwargs: Any) -> Any:
        if self.mode == "raise":
            raise RuntimeError("injected failure")
        out = self.model(**kwargs)
        if self.mode == "slow":
            time.sleep(0.02)
            out.logits[..., self.eos] = float("-inf")
        return out


@pytest.fixture
def faulty() -> Iterator[tuple[Server, FaultyModel]]:
    engine = tiny_engine(num_blocks=128)
    model = FaultyModel(engine.model, engine.eos_token_ids)
    engine.model = model
    with serving(engine) as s:
        yield s, model


def _finished(server: Server) -> dict[str, int]:
    stats: dict[str, int] = httpx.get(f"{server.v1}/cache/stats", timeout=30).json()["engine"][
        "finished"
    ]
    return stats


def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_engine_failure_is_a_server_error(faulty: tuple[Server, FaultyModel]) -> None:
    server, model = faulty
    client = server.client()
    model.mode = "raise"
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=4)
    assert info.value.status_code == 500
    assert info.value.body["type"] == "server_error"
    assert "injected failure" in info.value.body["message"]
    with pytest.raises(openai.APIError, match="injected failure"):
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=30) as r:
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert '"server_error"' in events[-3] and "injected failure" in events[-3]
    # The engine keeps serving after a failed request.
    model.mode = "ok"
    r2 = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2)
    assert r2.usage.completion_tokens <= 2
    assert _finished(server)["error"] == 3


def test_client_disconnect_cancels_the_request(faulty: tuple[Server, FaultyModel]) -> None:
    server, model = faulty
    model.mode = "slow"  # 400 tokens would take 8 s
    body = {"model": MODEL, "messages": user("go on"), "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.v1}/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break
    _wait_for(lambda: _finished(server).get("abort", 0) == 1)
    body["stream"] = False
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.v1}/chat/completions", json=body, timeout=0.5)
    _wait_for(lambda: _finished(server).get("abort", 0) == 2)
    stats = httpx.get(f"{server.v1}/cache/stats", timeout=30).json()
    assert stats["engine"]["running"] == 0 and stats["used_blocks"] == 0


def test_health_is_503_when_the_engine_stopped(faulty: tuple[Server, FaultyModel]) -> None:
    server, _ = faulty
    assert httpx.get(f"{server.base}/health", timeout=30).status_code == 200
    server.worker.stop()
    r = httpx.get(f"{server.base}/health", timeout=30)
    assert r.status_code == 503 and r.json()["status"] != "ok"
    r = httpx.post(
        f"{server.v1}/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    # Metrics still answer, read from the stopped engine.
    assert httpx.get(f"{server.base}/metrics", timeout=30).status_code == 200


def test_engine_sampling_defaults_apply_when_the_request_sends_none() -> None:
    engine = tiny_engine(num_blocks=64, block_size=BLOCK_SIZE)
    engine.sampling_defaults = {"temperature": 0.0}
    content = unique("defaults please")
    want = chat_expected(tiny_engine(num_blocks=64, block_size=BLOCK_SIZE), content, 10)
    with serving(engine) as s:
        r = s.client().chat.completions.create(model=MODEL, messages=user(content), max_tokens=10)
    # No temperature in the request: the engine's default (greedy) applies.
    assert r.choices[0].message.content == want.text
