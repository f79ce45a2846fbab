"""vLLM's tokenizer endpoints of ``kvtier serve``: the tokens the engine really computes.

A router that names a request's blocks by token ids (vllm-router's
``kv_aware``) asks a worker for them: ``POST /tokenize`` or ``POST
/v1/chat/completions/render``. Each test serves a fresh tiny engine (blocks
of one token, so every prompt token is a block of its own) that records its
KV events, asks an endpoint for a chat's tokens, then sends the same chat as
a completion and reads from the events the tokens the engine stored: they
must be the endpoint's, token for token, with and without tools, and with a
template that renders tools itself. The rest checks vLLM's request and
response shapes, the flags, the errors and the API keys.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serving import Server, serving  # noqa: E402
from tiny_model import tiny_llama_config, tiny_tokenizer  # noqa: E402

from kvtier.engine import Engine  # noqa: E402
from kvtier.events import BlocksStored  # noqa: E402
from kvtier.server.auth import ApiKey, ServerAuth  # noqa: E402
from kvtier.server.logprobs import TokenText  # noqa: E402

MODEL = "tiny-chat"
#: The Hermes system prompt alone is ~1000 characters: more than the usual tiny context.
CONTEXT = 4096

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    }
]
ASK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What time is it in Paris?"},
]
HISTORY: list[dict[str, Any]] = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "14:05"},
]
#: A template that renders the tools and calls itself (not the Hermes fallback).
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}"
    "TOOL {{ t['function']['name'] }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['name'] }}{% endfor %}"
    "{% if m.get('tool_call_id') %} FOR {{ m['tool_call_id'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_engine(template: str | None = None) -> Engine:
    """The tiny random model, one token a block, its KV events kept in memory."""
    import torch
    from transformers import LlamaForCausalLM

    tok = tiny_tokenizer()
    if template is not None:
        tok.chat_template = template
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tok, max_position_embeddings=CONTEXT)).eval()
    return Engine(
        model, tok, model_id="tiny", num_blocks=4096, block_size=1, kv_events="memory://tokens"
    )


@contextmanager
def fresh_server(template: str | None = None, **kwargs: Any) -> Iterator[Server]:
    with serving(tiny_engine(template), MODEL, **kwargs) as s:
        yield s


def post(server: Server, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.base}{path}", json=body, timeout=60, **kwargs)


def stored_tokens(server: Server) -> list[int]:
    """Every token the engine stored in a device block, in the order it stored them.

    On a fresh engine the first request's blocks are all new, so this starts
    with exactly the prompt it computed (one token a block).
    """
    engine = server.worker.engine
    sink = engine.events
    out: list[int] = []
    for batch in [*sink.batches, sink.pending]:
        for event in batch:
            if isinstance(event, BlocksStored) and event.medium == "device":
                out.extend(event.token_ids)
    return out


def computed_prompt(server: Server, body: dict[str, Any]) -> tuple[list[int], int]:
    """The prompt the engine computed for a chat ``body`` and the prompt size it reported."""
    resp = post(server, "/v1/chat/completions", {**body, "max_tokens": 1, "temperature": 0})
    assert resp.status_code == 200, resp.text
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]
    # The step's events are flushed when the step ends; the answer may come first.
    server.worker.call(lambda engine: None)
    return stored_tokens(server)[:prompt_tokens], prompt_tokens


CHATS: list[tuple[str, str | None, dict[str, Any]]] = [
    ("plain chat", None, {"messages": ASK}),
    ("tools offered (Hermes)", None, {"messages": ASK, "tools": TOOLS}),
    ("tool calls and results (Hermes)", None, {"messages": HISTORY, "tools": TOOLS}),
    ("earlier tool calls, no tools offered", None, {"messages": HISTORY}),
    ("forced tool choice", None, {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}),
    ("tools offered (the template's own)", NATIVE_TEMPLATE, {"messages": HISTORY, "tools": TOOLS}),
]


@pytest.mark.parametrize(("template", "chat"), [c[1:] for c in CHATS], ids=[c[0] for c in CHATS])
def test_tokenize_gives_the_tokens_the_engine_computes(
    template: str | None, chat: dict[str, Any]
) -> None:
    with fresh_server(template) as server:
        resp = post(server, "/tokenize", {"model": MODEL, **chat})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert set(body) == {"count", "max_model_len", "tokens"}
        assert body["count"] == len(body["tokens"]) > 0
        assert body["max_model_len"] == server.worker.engine.max_model_len
        computed, prompt_tokens = computed_prompt(server, {"model": MODEL, **chat})
        assert prompt_tokens == body["count"]
        assert computed == body["tokens"]


@pytest.mark.parametrize(("template", "chat"), [c[1:] for c in CHATS], ids=[c[0] for c in CHATS])
def test_render_gives_the_prompt_the_chat_endpoint_computes(
    template: str | None, chat: dict[str, Any]
) -> None:
    with fresh_server(template) as server:
        # What vllm-router sends: the whole chat completion request, extra fields and all.
        request = {
            "model": MODEL,
            **chat,
            "max_tokens": 5,
            "stream": False,
            "no_stop_trim": False,
            "skip_special_tokens": True,
        }
        resp = post(server, "/v1/chat/completions/render", request)
        assert resp.status_code == 200, resp.text
        rendered = resp.json()
        assert rendered["model"] == MODEL and rendered["features"] is None
        assert rendered["sampling_params"]["max_tokens"] == 5
        computed, _ = computed_prompt(server, {"model": MODEL, **chat})
        assert rendered["token_ids"] == computed


def test_a_prompt_is_tokenized_as_a_completion_computes_it() -> None:
    with fresh_server() as server:
        prompt = "Once upon a time"
        resp = post(server, "/tokenize", {"model": MODEL, "prompt": prompt})
        assert resp.status_code == 200, resp.text
        tokens = resp.json()["tokens"]
        done = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert done.status_code == 200, done.text
        server.worker.call(lambda engine: None)
        assert done.json()["usage"]["prompt_tokens"] == len(tokens)
        assert stored_tokens(server)[: len(tokens)] == tokens


# -- shapes and flags ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with fresh_server() as s:
        yield s


def test_the_model_field_is_optional_and_checked(server: Server) -> None:
    without = post(server, "/tokenize", {"prompt": "abc"})
    assert without.status_code == 200
    assert (
        without.json()["tokens"]
        == post(server, "/tokenize", {"model": MODEL, "prompt": "abc"}).json()["tokens"]
    )
    wrong = post(server, "/tokenize", {"model": "gpt-4", "prompt": "abc"})
    assert wrong.status_code == 400
    assert wrong.json()["error"]["code"] == "model_not_found"
    assert post(server, "/detokenize", {"model": "gpt-4", "tokens": [5]}).status_code == 400


def test_token_strs_and_detokenize_round_trip(server: Server) -> None:
    tok = server.worker.engine.tokenizer
    text = "Hello, world!"
    resp = post(
        server,
        "/tokenize",
        {"prompt": text, "add_special_tokens": False, "return_token_strs": True},
    )
    body = resp.json()
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    assert "".join(body["token_strs"]) == text  # a character tokenizer: one token a character
    back = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_add_special_tokens_is_the_tokenizers(server: Server) -> None:
    tok = server.worker.engine.tokenizer
    for flag in (True, False):
        resp = post(server, "/tokenize", {"prompt": "abc", "add_special_tokens": flag})
        assert resp.json()["tokens"] == tok.encode("abc", add_special_tokens=flag)


def test_chat_flags_change_the_prompt_as_the_template_says(server: Server) -> None:
    tok = server.worker.engine.tokenizer

    def tokens(**flags: Any) -> list[int]:
        resp = post(server, "/tokenize", {"messages": ASK, **flags})
        assert resp.status_code == 200, resp.text
        return list(resp.json()["tokens"])

    with_prompt = tokens()
    without = tokens(add_generation_prompt=False)
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert with_prompt == without + header
    partial = [*ASK, {"role": "assistant", "content": "It is"}]
    resp = post(
        server,
        "/tokenize",
        {"messages": partial, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert resp.status_code == 200, resp.text
    text = tok.decode(resp.json()["tokens"])
    assert text.endswith("<|im_start|>assistant\nIt is")  # left open for the model to go on
    special = tokens(add_special_tokens=True)
    assert special == tok.encode(tok.decode(with_prompt), add_special_tokens=True)


BAD: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("neither prompt nor messages", "/tokenize", {"model": MODEL}, "prompt"),
    ("prompt not a string", "/tokenize", {"prompt": 7}, "prompt"),
    ("add_special_tokens not a bool", "/tokenize", {"prompt": "a", "add_special_tokens": 1},
     "add_special_tokens"),
    ("messages not a list", "/tokenize", {"messages": "hi"}, "messages"),
    ("unknown role", "/tokenize", {"messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role"),
    ("continue and generation prompt", "/tokenize",
     {"messages": ASK, "continue_final_message": True}, "continue_final_message"),
    ("continue a user message", "/tokenize",
     {"messages": ASK, "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
    ("chat_template", "/tokenize", {"messages": ASK, "chat_template": "{{ x }}"},
     "chat_template"),
    ("chat_template_kwargs", "/tokenize",
     {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}},
     "chat_template_kwargs"),
    ("a tool result answering no call", "/tokenize",
     {"messages": [*ASK, {"role": "tool", "tool_call_id": "x", "content": "1"}]},
     "messages[2].tool_call_id"),
    ("a malformed tool", "/tokenize", {"messages": ASK, "tools": [{"type": "retrieval"}]},
     "tools[0].type"),
    ("an image", "/tokenize",
     {"messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]},
     "messages"),
    ("not JSON", "/tokenize", "{", None),
    ("not an object", "/tokenize", [1, 2], None),
    ("token out of the vocabulary", "/detokenize", {"tokens": [10**6]}, "tokens[0]"),
    ("negative token", "/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("tokens missing", "/detokenize", {}, "tokens"),
    ("render: bad temperature", "/v1/chat/completions/render",
     {"model": MODEL, "messages": ASK, "temperature": 9}, "temperature"),
    ("render: no messages", "/v1/chat/completions/render", {"model": MODEL, "messages": []},
     "messages"),
    ("render: wrong model", "/v1/chat/completions/render", {"model": "x", "messages": ASK},
     "model"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(
    server: Server, path: str, body: Any, param: str | None
) -> None:
    if isinstance(body, str):
        resp = httpx.post(
            f"{server.base}{path}",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
    else:
        resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"]


def test_a_prompt_longer_than_any_context_is_refused_before_tokenizing(server: Server) -> None:
    engine = server.worker.engine
    # The server's own bound: no prompt longer fits the context, whatever its tokens.
    limit = engine.max_model_len * TokenText(engine.tokenizer).longest_token_chars()
    resp = post(server, "/tokenize", {"prompt": "a" * (limit + 1)})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_the_endpoints_need_an_api_key_like_the_others() -> None:
    auth = ServerAuth((ApiKey("sk-tokenize-test", "team"),))
    with fresh_server(auth=auth) as server:
        for path, body in (
            ("/tokenize", {"prompt": "abc"}),
            ("/detokenize", {"tokens": [5]}),
            ("/v1/chat/completions/render", {"model": MODEL, "messages": ASK}),
        ):
            refused = post(server, path, body)
            assert refused.status_code == 401, (path, refused.text)
            assert refused.json()["error"]["code"] == "invalid_api_key"
            ok = post(server, path, body, headers={"Authorization": "Bearer sk-tokenize-test"})
            assert ok.status_code == 200, (path, ok.text)
