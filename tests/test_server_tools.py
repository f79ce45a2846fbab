"""Tool calling in the chat endpoint: validation, rendering, parsing, and constrained calls.

A real uvicorn server runs a tiny random model whose chat template knows no
tools, so the Hermes fallback renders them. Its answers are noise, except
where the tool choice constrains decoding: then every answer must be a
well-formed call whose arguments follow the tool's schema.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from serving import Server, serving  # noqa: E402
from tiny_model import tiny_llama_config, tiny_tokenizer  # noqa: E402

from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.engine.sampling import Sampler  # noqa: E402
from kvtier.errors import BadRequestError  # noqa: E402
from kvtier.server.grammar import MAX_FORCED_CALLS  # noqa: E402
from kvtier.server.tools import (  # noqa: E402
    StreamEvent,
    ToolCallStream,
    hermes_call_text,
    parse_tool_calls,
    render_tool_chat,
    template_knows_tools,
    tool_request,
)

MODEL = "tiny-chat"
#: The Hermes system prompt alone is ~1000 characters: more than the usual tiny context.
CONTEXT = 4096

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city.",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a zone.",
            "parameters": TIME_SCHEMA,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def tiny_long_engine() -> Engine:
    """The tiny random model with room for the tools' system prompt."""
    import torch
    from transformers import LlamaForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tok, max_position_embeddings=CONTEXT)).eval()
    return Engine(model, tok, model_id="tiny", num_blocks=1024, block_size=16)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serving(tiny_long_engine(), MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return server.client()


def check_arguments(name: str, arguments: str) -> dict[str, Any]:
    """The call's arguments, checked against its tool's schema."""
    args = json.loads(arguments)
    schema = SCHEMAS[name]
    try:
        import jsonschema
    except ImportError:  # the checks the schemas above need, by hand
        assert set(args) == set(schema["required"])
        for key, prop in schema["properties"].items():
            kind = {"string": str, "integer": int, "boolean": bool}[prop["type"]]
            assert isinstance(args[key], kind)
            assert "enum" not in prop or args[key] in prop["enum"]
    else:
        jsonschema.validate(args, schema)
    return dict(args)


def _post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)


# -- validation ----------------------------------------------------------------------------

_FN = {"name": "f", "parameters": {"type": "object", "properties": {}}}
_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_BAD: list[tuple[str, dict[str, Any], str]] = [
    ("tools not a list", {"tools": {"type": "function"}}, "tools"),
    ("tool not an object", {"tools": ["f"]}, "tools[0]"),
    ("tool type", {"tools": [{"type": "retrieval", "function": _FN}]}, "tools[0].type"),
    ("no function", {"tools": [{"type": "function"}]}, "tools[0].function"),
    (
        "no name",
        {"tools": [{"type": "function", "function": {"parameters": {}}}]},
        "tools[0].function.name",
    ),
    (
        "bad name",
        {"tools": [{"type": "function", "function": {"name": "get weather!"}}]},
        "tools[0].function.name",
    ),
    (
        "duplicate names",
        {"tools": [{"type": "function", "function": _FN}] * 2},
        "tools[1].function.name",
    ),
    (
        "parameters not an object schema",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
            ]
        },
        "tools[0].function.parameters",
    ),
    (
        "parameters a string",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
        "tools[0].function.parameters",
    ),
    (
        "description not text",
        {"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
        "tools[0].function.description",
    ),
    (
        "unknown named function",
        {
            "tools": [{"type": "function", "function": _FN}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice.function.name",
    ),
    (
        "tool_choice garbage",
        {"tools": [{"type": "function", "function": _FN}], "tool_choice": "always"},
        "tool_choice",
    ),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    (
        "tool message without id",
        {"messages": [*ASK, {"role": "tool", "content": "42"}]},
        "messages[1].tool_call_id",
    ),
    (
        "tool message answering nothing",
        {"messages": [*ASK, {"role": "tool", "content": "42", "tool_call_id": "call_9"}]},
        "messages[1].tool_call_id",
    ),
    (
        "arguments not JSON",
        {
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "call without id",
        {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
        "messages[1].tool_calls[0].id",
    ),
    (
        "user message with tool_calls",
        {"messages": [{"role": "user", "content": "hi", "tool_calls": [_CALL]}]},
        "messages[0].tool_calls",
    ),
    (
        "legacy function role",
        {"messages": [{"role": "function", "content": "1"}]},
        "messages[0].role",
    ),
    ("legacy functions", {"functions": [{"name": "f"}]}, "functions"),
    ("parallel_tool_calls not a bool", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("fields", "param"), [c[1:] for c in _BAD], ids=[c[0] for c in _BAD])
def test_malformed_tool_requests_are_400_naming_the_field(
    server: Server, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"]


def test_a_template_without_chat_support_is_refused() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = None
    req = tool_request(TOOLS, "auto", None)
    with pytest.raises(BadRequestError) as info:
        render_tool_chat(tok, ASK, req)
    assert info.value.param == "tools" and "no chat template" in str(info.value)


# -- rendering ---------------------------------------------------------------------------------


HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "days": 1, "metric": true}',
                },
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "14:05"},
]


def test_hermes_fallback_renders_tools_calls_and_results() -> None:
    from kvtier.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": HISTORY, "tools": TOOLS}
    )
    tok = tiny_tokenizer()
    assert not template_knows_tools(tok)
    text = render_tool_chat(tok, body.to_messages(), body.tool_request())
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    assert "<tools>" in system and '"name": "get_weather"' in system and "</tools>" in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 1, "metric": true}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call><|im_end|>'
    ) in text
    # Both results in one user turn, then the reply's header.
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response>\n"
        "<tool_response>\n14:05\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}"
    "TOOL {{ t['function']['name'] }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['name'] }} "
    "{{ c['function']['arguments']['zone'] | default('') }}{% endfor %}"
    "{% if m.get('tool_call_id') %} FOR {{ m['tool_call_id'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_knows_tools_renders_them_itself() -> None:
    from kvtier.server.protocol import ChatCompletionRequest

    tok = tiny_tokenizer()
    tok.chat_template = NATIVE_TEMPLATE
    assert template_knows_tools(tok)
    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": HISTORY, "tools": TOOLS}
    )
    text = render_tool_chat(tok, body.to_messages(), body.tool_request())
    assert text.startswith("<|im_start|>system\nTOOL get_weather\nTOOL get_time\n<|im_end|>")
    assert "CALL get_weather CALL get_time CET<|im_end|>" in text
    assert "sunny, 21C FOR call_a" in text and "<tools>" not in text
    # tool_choice none: the tools stay out of the prompt.
    none = tool_request(TOOLS, "none", None)
    assert "TOOL" not in render_tool_chat(tok, body.to_messages(), none)


def test_a_conversation_with_calls_and_results_runs(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=8, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 1000  # the tools' system prompt and the history


# -- constrained calls ---------------------------------------------------------------------


def forced_body() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 600,
        "temperature": 1.0,
    }


def forced(client: Any, **kwargs: Any) -> Any:
    """A constrained chat answer (``tool_choice`` defaults to ``"required"``)."""
    return client.chat.completions.create(**{**forced_body(), **kwargs})


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gives_calls_that_follow_their_schemas(client: Any, seed: int) -> None:
    r = forced(client, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in SCHEMAS
        check_arguments(call.function.name, call.function.arguments)


def test_parallel_calls_off_gives_exactly_one(client: Any) -> None:
    for seed in (1, 2, 3, 4):
        choice = forced(client, seed=seed, parallel_tool_calls=False).choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        check_arguments(call.function.name, call.function.arguments)


def test_parallel_forced_answers_may_hold_several_calls(client: Any) -> None:
    """Over a few seeds the random model writes one call and stops, or goes on to more."""
    counts = set()
    for seed in range(1, 9):
        choice = forced(client, seed=seed, max_tokens=1000).choices[0]
        if choice.finish_reason == "tool_calls":
            counts.add(len(choice.message.tool_calls))
            for call in choice.message.tool_calls:
                check_arguments(call.function.name, call.function.arguments)
    assert 1 in counts and max(counts) >= 2, counts


def test_a_named_function_is_the_one_called_even_greedily(client: Any) -> None:
    for temperature in (0.0, 1.0):
        for parallel in (True, False):
            r = forced(
                client,
                tool_choice={"type": "function", "function": {"name": "get_time"}},
                temperature=temperature,
                parallel_tool_calls=parallel,
                seed=7,
                n=2,
                max_tokens=1000,  # room for MAX_FORCED_CALLS calls when greedy repeats one
            )
            for choice in r.choices:
                assert choice.finish_reason == "tool_calls"
                calls = choice.message.tool_calls
                assert calls and len(calls) <= (MAX_FORCED_CALLS if parallel else 1)
                for call in calls:
                    assert call.function.name == "get_time"
                    check_arguments("get_time", call.function.arguments)


@pytest.mark.parametrize(("seed", "parallel"), [(11, True), (12, False), (13, True)])
def test_a_streamed_forced_answer_accumulates_to_the_whole_answer(
    client: Any, seed: int, parallel: bool
) -> None:
    """The client's stream helper, adding up the deltas, gets the non-streamed answer."""
    kwargs: dict[str, Any] = {"seed": seed, "parallel_tool_calls": parallel}
    whole = forced(client, **kwargs).choices[0]
    pieces: dict[int, int] = {}
    with client.chat.completions.stream(**{**forced_body(), **kwargs}) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces[event.index] = pieces.get(event.index, 0) + 1
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert not final.message.content
    streamed = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    for name, arguments in streamed:
        check_arguments(name, arguments)
    # The arguments came in many pieces, not one per call.
    assert sorted(pieces) == list(range(len(streamed)))
    assert all(n > 3 for n in pieces.values()), pieces


def test_streamed_call_deltas_have_openai_shape(client: Any) -> None:
    stream = client.chat.completions.create(
        **{
            **forced_body(),
            "seed": 11,
            "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
        }
    )
    deltas = []
    finish = None
    content = ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        deltas.extend(choice.delta.tool_calls or [])
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    first, *rest = deltas
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert len(rest) > 3
    assert all(d.index == 0 and d.id is None and d.type is None for d in rest)
    assert all(d.function.name is None and d.function.arguments for d in rest)
    check_arguments(
        "get_weather",
        (first.function.arguments or "") + "".join(d.function.arguments for d in rest),
    )


def test_the_grammar_admits_one_or_more_calls_then_the_end() -> None:
    """The compiled grammar itself, token by token (the tiny tokenizer is one char a token)."""
    from kvtier.server.grammar import ToolGrammars

    tok = tiny_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    grammars = ToolGrammars(tok, len(tok), [eos])
    one = hermes_call_text("get_time", {"zone": "UTC"})
    two = one + hermes_call_text("get_weather", {"city": "Oslo", "days": 2, "metric": False})

    def run(req: Any, text: str) -> tuple[bool, bool]:
        """Whether the grammar takes every token of ``text``, then whether it takes EOS."""
        constraint = grammars.constraint_for(req)()
        for t in tok.encode(text, add_special_tokens=False):
            try:
                constraint.accept(t)
            except RuntimeError:
                return False, False
        try:
            constraint.accept(eos)
        except RuntimeError:
            return True, False
        return True, constraint.is_terminated()

    required = tool_request(TOOLS, "required", None)
    assert run(required, one) == (True, True)
    assert run(required, two) == (True, True)
    assert run(required, two + one) == (True, True)
    assert run(required, one + "\n")[0] is False  # nothing between or after the blocks
    assert run(required, "")[1] is False  # no call: the end is refused
    assert run(required, one.replace(": ", ":"))[0] is False  # compact JSON only
    single = tool_request(TOOLS, "required", False)
    assert run(single, one) == (True, True)
    assert run(single, two)[0] is False
    named = tool_request(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    assert run(named, one + one) == (True, True)
    assert run(named, two)[0] is False
    most = one * MAX_FORCED_CALLS
    assert run(required, most) == (True, True)
    assert run(required, most + one)[0] is False  # no more calls past the cap


def test_tool_choice_none_gives_text_from_a_prompt_without_tools(client: Any) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0}
    plain = client.chat.completions.create(**kwargs)
    r = client.chat.completions.create(**kwargs, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_auto_with_noise_gives_text(client: Any) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16, temperature=0
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > 1000


class OnlyTokens:
    """A constraint allowing a fixed set of tokens, for the sampler's hook."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.seen: list[int] = []

    def mask(self, logits: Any) -> Any:
        import torch

        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[sorted(self.allowed)] = True
        return logits.masked_fill(~keep, float("-inf"))

    def accept(self, token: int) -> None:
        assert token in self.allowed
        self.seen.append(token)

    def is_terminated(self) -> bool:
        return False


@given(
    st.lists(st.floats(-5, 5), min_size=8, max_size=8),
    st.sets(st.integers(0, 7), min_size=1),
    st.sampled_from([0.0, 0.7, 1.5]),
)
@settings(max_examples=60, deadline=None)
def test_the_sampler_picks_only_allowed_tokens_and_keeps_raw_logprobs(
    row: list[float], allowed: set[int], temperature: float
) -> None:
    import torch

    logits = torch.tensor(row)
    seen: list[OnlyTokens] = []

    def factory() -> OnlyTokens:
        seen.append(OnlyTokens(allowed))
        return seen[-1]

    params = SamplingParams(temperature=temperature, seed=3, logprobs=0, constraint=factory)
    token, lp = Sampler(params).sample(logits)
    assert token in allowed and seen[0].seen == [token]
    assert lp is not None
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)
    assert torch.equal(logits, torch.tensor(row))  # the row itself is left alone
    unconstrained = Sampler(SamplingParams(temperature=0)).sample(logits)[0]
    assert unconstrained == int(torch.argmax(logits))


# -- parsing ---------------------------------------------------------------------------------

#: Strings that may hold the tags themselves.
_tagged_text = st.lists(
    st.text(max_size=6) | st.sampled_from(["<tool_call>", "</tool_call>"]), max_size=3
).map("".join)
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), _tagged_text)
_json = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_args = st.dictionaries(_tagged_text, _json, max_size=4)
_names = st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True)
_calls = st.lists(st.tuples(_names, _args), min_size=1, max_size=4)
_plain = st.text(max_size=40).filter(lambda t: "<tool_call>" not in t)
#: Pieces of calls, broken calls and JSON, to make text that is sometimes a call.
_fragments = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "\n",
        " ",
        '{"name": "f", "arguments": ',
        '{"arguments": {}, "name": "g"}',
        '"{\\"a\\": 1}"',
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        "<",
        ", ",
        '"a": 1',
        '"s": "x</tool_call>y"',
        "hi",
    ]
)
#: Blocks that open like calls, or almost, with arguments that may break anywhere.
_block_like = st.tuples(
    st.sampled_from(["", "\n", " "]),
    st.sampled_from(
        [
            '{"name": "f", "arguments": ',
            '{"name":"g","arguments":',
            '{"arguments": {}, "name": "g"}',
            '{"name": "f", "arguments": "{\\"a\\": 1}"}',
            '{"name": "',
            "nope",
            "",
        ]
    ),
    st.lists(
        _fragments | st.sampled_from(["{}", '{"a": 1}', '{"b": [1, "</tool_call>"]}']), max_size=6
    ),
    st.sampled_from(["</tool_call>", "", "}\n</tool_call>", "}}</tool_call>"]),
).map(lambda p: "<tool_call>" + p[0] + p[1] + "".join(p[2]) + p[3])
_noise = st.lists(_block_like | _fragments | st.text(max_size=3), max_size=12).map("".join)


def _cuts(text: str, points: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(p % (len(text) + 1) for p in points)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _stream(pieces: list[str], max_calls: int | None = None) -> tuple[str, list[Any], list[Any]]:
    """The content, the calls as ``(id, name, arguments)`` added up from their
    pieces, and the events of streaming ``pieces``."""
    stream = ToolCallStream(max_calls)
    events = []
    for piece in pieces:
        events += stream.feed(piece)
    events += stream.finish()
    content = "".join(e.content or "" for e in events)
    calls: list[list[str]] = []
    for e in events:
        if e.content is not None:
            continue
        if e.id is not None:
            assert e.index == len(calls) and e.name
            calls.append([e.id, e.name, ""])
        assert e.index == len(calls) - 1  # pieces belong to the latest call
        calls[-1][2] += e.arguments or ""
    assert [tuple(c) for c in calls] == [(c.id, c.name, c.arguments) for c in stream.tool_calls]
    return content, [tuple(c) for c in calls], events


@given(_plain, _calls, st.sampled_from(["\n", "", "\n\n"]))
@settings(max_examples=150, deadline=None)
def test_rendered_calls_parse_back(prefix: str, calls: list[tuple[str, Any]], sep: str) -> None:
    text = prefix + sep + sep.join(hermes_call_text(n, a) for n, a in calls)
    content, parsed = parse_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert content == (prefix.strip() or None)
    assert len({c.id for c in parsed}) == len(parsed)
    # Only the first with parallel calls off.
    _, first = parse_tool_calls(text, max_calls=1)
    assert [(c.name, json.loads(c.arguments)) for c in first] == calls[:1]


@given(st.text(max_size=200).filter(lambda t: "<tool_call>" not in t))
def test_text_without_the_tag_has_no_calls(text: str) -> None:
    assert parse_tool_calls(text) == ((text or None), [])


def test_blocks_that_are_not_calls_stay_text() -> None:
    for body in ("not json", '{"arguments": {}}', '["x"]', '{"name": "f", "arguments": 3}'):
        text = f"a <tool_call>{body}</tool_call> b"
        assert parse_tool_calls(text) == (text, [])
    content, calls = parse_tool_calls(
        'x <tool_call>nope</tool_call> <tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}'
        "</tool_call>"
    )
    assert content == "x <tool_call>nope</tool_call>"
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    # A closing tag inside an argument does not end the call.
    text = "ok " + hermes_call_text("f", {"s": "a</tool_call>b"})
    assert [(c.name, c.arguments) for c in parse_tool_calls(text)[1]] == [
        ("f", '{"s": "a</tool_call>b"}')
    ]
    _, calls_streamed, _ = _stream([text[:-3], text[-3:]])
    assert [c[1:] for c in calls_streamed] == [("f", '{"s": "a</tool_call>b"}')]


def test_a_call_opened_the_usual_way_streams_its_arguments() -> None:
    stream = ToolCallStream()
    assert stream.feed("Sure.\n<tool_call>\n") == [StreamEvent(content="Sure.")]
    assert stream.feed('{"name": "get_wea') == []  # the name is not known yet
    (head,) = stream.feed('ther", "arguments": {"city": "Pa')
    assert head.id is not None and head.id.startswith("call_") and head.index == 0
    assert (head.name, head.arguments) == ("get_weather", '{"city": "Pa')
    assert stream.feed('ris", "note": "}<tool_call>') == [
        StreamEvent(index=0, arguments='ris", "note": "}<tool_call>')
    ]
    assert stream.feed('"}}\n</tool_') == [StreamEvent(index=0, arguments='"}')]
    assert stream.feed("call>\n") == []
    assert stream.finish() == []
    (call,) = stream.tool_calls
    assert (call.id, call.name) == (head.id, "get_weather")
    assert json.loads(call.arguments) == {"city": "Paris", "note": "}<tool_call>"}


def test_a_call_cut_short_keeps_what_was_written() -> None:
    """As OpenAI's API does when a call runs out of tokens: its arguments are partial."""
    content, calls = parse_tool_calls('Hi <tool_call>{"name": "f", "arguments": {"a": [1, ')
    assert content == "Hi" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": [1, ')]
    # A tag outside a string ends broken arguments; the rest of the block is dropped.
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": </tool_call> b')
    assert content == "b" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": ')]


@given(
    _plain,
    st.lists(st.tuples(_names, _args), max_size=3),
    _plain,
    st.lists(st.integers(0, 10_000), max_size=12),
)
@settings(max_examples=150, deadline=None)
def test_streamed_parsing_agrees_with_whole_text_parsing(
    prefix: str, calls: list[tuple[str, Any]], suffix: str, points: list[int]
) -> None:
    text = prefix + "".join(hermes_call_text(n, a) for n, a in calls) + suffix
    content, streamed, _ = _stream(_cuts(text, points))
    whole_content, whole = parse_tool_calls(text)
    assert [c[1:] for c in streamed] == [(c.name, c.arguments) for c in whole]
    assert [(n, json.loads(a)) for _, n, a in streamed] == calls
    if whole:
        assert content.strip() == (whole_content or "")
    else:
        assert content == text


@given(_noise, st.lists(st.integers(0, 10_000), max_size=12), st.sampled_from([None, 1, 2]))
@settings(max_examples=300, deadline=None)
def test_any_text_parses_the_same_however_it_is_cut(
    text: str, points: list[int], max_calls: int | None
) -> None:
    content, streamed, _ = _stream(_cuts(text, points), max_calls)
    whole_content, whole, _ = _stream([text], max_calls)
    assert [c[1:] for c in streamed] == [c[1:] for c in whole]
    assert content == whole_content
    parsed_content, parsed = parse_tool_calls(text, max_calls)
    assert [(c.name, c.arguments) for c in parsed] == [c[1:] for c in whole]
    assert parsed_content == ((content.strip() if whole else content) or None)
    assert max_calls is None or len(whole) <= max_calls


@given(
    _plain,
    st.lists(st.tuples(_names, _args), max_size=3),
    st.lists(st.integers(0, 10_000), max_size=12),
)
@settings(max_examples=100, deadline=None)
def test_the_openai_client_adds_streamed_deltas_up_to_the_whole_answer(
    prefix: str, calls: list[tuple[str, Any]], points: list[int]
) -> None:
    """Deltas as the server sends them, added up by the official client's stream state."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from kvtier.server.streaming import _event_deltas

    text = prefix + "\n".join(hermes_call_text(n, a) for n, a in calls)
    stream = ToolCallStream()
    state = ChatCompletionStreamState()

    def send(delta: dict[str, Any], finish: str | None = None) -> None:
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))

    send({"role": "assistant", "content": ""})
    for piece in _cuts(text, points):
        for event in stream.feed(piece):
            for delta in _event_deltas(event):
                send(delta)
    for event in stream.finish():
        for delta in _event_deltas(event):
            send(delta)
    send({}, "tool_calls" if stream.calls else "stop")
    message = state.get_final_completion().choices[0].message
    content, whole = parse_tool_calls(text)
    got = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert got == [(c.name, c.arguments) for c in whole]
    if whole:
        assert (message.content or "").strip() == (content or "")
    else:
        assert (message.content or "") == text


def test_text_that_may_begin_a_call_is_held_back() -> None:
    stream = ToolCallStream()
    assert [e.content for e in stream.feed("Hi <tool")] == ["Hi"]
    assert [e.content for e in stream.feed("box> there")] == [" <toolbox> there"]
    (event,) = stream.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n')
    assert (event.name, event.arguments, event.index) == ("f", "{}", 0)
    assert stream.finish() == []  # the trailing newline of an answer with a call
    unfinished = ToolCallStream()
    assert unfinished.feed('<tool_call>{"name": "f"') == []
    assert [e.content for e in unfinished.finish()] == ['<tool_call>{"name": "f"']


def test_calls_past_the_limit_are_not_sent() -> None:
    text = hermes_call_text("f", {"a": 1}) + "\n" + hermes_call_text("g", {"b": 2})
    content, calls, events = _stream(list(text), max_calls=1)
    assert [c[1:] for c in calls] == [("f", '{"a": 1}')] and content == ""
    assert {e.index for e in events} == {0}
