"""vLLM's tokenizer endpoints, so a router tokenizes a request exactly as this server does.

A router that routes on tokens (vllm-router's ``kv_aware`` and
``cache_aware`` policies, llm-d's precise prefix-cache scorer) must name a
request's blocks by the very token ids the engine will feed the model: the
chat template's output, tools rendered as the chat endpoint renders them,
no special tokens added twice. Reimplementing that outside the server is
how routers drift from their workers, so they ask the worker. This module
adds vLLM's three endpoints for that to :func:`kvtier.server.app.create_app`'s
application:

* ``POST /tokenize``: a completion prompt (``{"prompt", "add_special_tokens"}``)
  or a chat (``{"messages", "add_generation_prompt", "continue_final_message",
  "add_special_tokens", "tools", "tool_choice"}``); answers
  ``{"count", "max_model_len", "tokens"}`` and, with ``return_token_strs``,
  ``"token_strs"``. With the defaults a chat's tokens are the chat endpoint's
  prompt, token for token; the other flags change the prompt as vLLM's do.
* ``POST /detokenize``: ``{"tokens"}`` -> ``{"prompt"}``.
* ``POST /v1/chat/completions/render``: a whole chat completion request (what
  vllm-router sends before routing one) -> ``{"token_ids", ...}`` as vLLM's
  render endpoint answers (a ``GenerateRequest``), the prompt the chat endpoint
  would compute for it, by the same code.

They share the rest of the API's rules: API keys and tenants
(:class:`~kvtier.server.auth.AuthGuard` guards them like any route), the
request limits (body size, message count, prompt characters), the model
name check, and OpenAI's error body for anything refused. They take no
place in the engine's queue: tokenizing runs on a worker thread, beside the
engine, and costs no KV.

``chat_template`` and ``chat_template_kwargs`` are refused, not ignored: the
chat endpoint renders with the model's own template and no extra arguments,
so tokens rendered otherwise would not be the ones the engine computes.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError

from kvtier.errors import BadRequestError
from kvtier.server import api_errors
from kvtier.server.api_errors import APIError
from kvtier.server.protocol import ChatCompletionRequest, ChatMessage, Text, _Body
from kvtier.server.tenants import for_tenant
from kvtier.server.tools import ToolRequest, encode_tool_chat, render_tool_chat

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine
    from kvtier.server.limits import ServerLimits

TokenId = Annotated[int, Field(ge=0)]
_M = TypeVar("_M", bound=BaseModel)


class CompletionTokenizeRequest(_Body):
    """``POST /tokenize`` with a prompt (vLLM's ``TokenizeCompletionRequest``)."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTokenizeRequest(_Body):
    """``POST /tokenize`` with chat messages (vLLM's ``TokenizeChatRequest``)."""

    model: Text | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Known and refused (see the module docstring).
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's ``DetokenizeRequest``)."""

    model: Text | None = None
    tokens: list[TokenId]


def _refuse_template_options(body: ChatTokenizeRequest) -> None:
    if body.chat_template is not None:
        raise BadRequestError(
            "chat_template is not supported: this server renders chats with the model's own "
            "template, so tokens rendered with another would not be the ones it computes; "
            "leave chat_template out",
            param="chat_template",
        )
    if body.chat_template_kwargs:
        raise BadRequestError(
            "chat_template_kwargs are not supported: this server's chat completions render the "
            "template without extra arguments, so tokens rendered with them would not be the "
            "ones it computes; leave chat_template_kwargs out",
            param="chat_template_kwargs",
        )
    if body.mm_processor_kwargs:
        raise BadRequestError(
            "mm_processor_kwargs are not supported: leave them out", param="mm_processor_kwargs"
        )


def _check_flags(body: ChatTokenizeRequest) -> None:
    if body.continue_final_message and body.add_generation_prompt:
        raise BadRequestError(
            "continue_final_message and add_generation_prompt cannot both be true: "
            "set add_generation_prompt to false to continue the last message",
            param="continue_final_message",
        )
    if body.continue_final_message and (not body.messages or body.messages[-1].role != "assistant"):
        raise BadRequestError(
            "continue_final_message needs the last message to be the assistant's: "
            "end messages with an assistant message, or leave continue_final_message false",
            param="continue_final_message",
        )


def chat_prompt_ids(
    engine: Engine,
    messages: list[dict[str, Any]],
    tool_req: ToolRequest | None,
    with_tools: bool,
) -> list[int]:
    """The prompt ``POST /v1/chat/completions`` computes for a text chat: the same calls."""
    if with_tools:
        return encode_tool_chat(engine.tokenizer, messages, tool_req)
    return engine.encode_chat(messages)


def _rendered_chat_ids(
    engine: Engine,
    messages: list[dict[str, Any]],
    tool_req: ToolRequest | None,
    with_tools: bool,
    body: ChatTokenizeRequest,
) -> list[int]:
    """A chat's tokens under ``body``'s flags; the chat endpoint's prompt with the defaults."""
    default = (
        body.add_generation_prompt
        and not body.continue_final_message
        and not body.add_special_tokens
    )
    if default:
        return chat_prompt_ids(engine, messages, tool_req, with_tools)
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        raise BadRequestError(
            f"model {engine.model_id} has no chat template: tokenize a prompt instead",
            param="messages",
        )
    options = {
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
    }
    try:
        if with_tools:
            text = render_tool_chat(tokenizer, messages, tool_req, **options)
        else:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    except BadRequestError:
        raise
    except Exception as exc:  # a template raising on odd input is the caller's input
        raise BadRequestError(
            f"messages do not fit the chat template: {exc}", param="messages"
        ) from exc
    return list(tokenizer.encode(str(text), add_special_tokens=body.add_special_tokens))


def _token_strs(engine: Engine, ids: Sequence[int]) -> list[str]:
    return [str(t) for t in engine.tokenizer.convert_ids_to_tokens(list(ids))]


def register_tokenization(app: FastAPI) -> None:
    """Add ``/tokenize``, ``/detokenize`` and ``/v1/chat/completions/render`` to ``app``.

    ``app`` is :func:`~kvtier.server.app.create_app`'s: the worker, the served
    model's name and the limits are read from its ``state``.
    """
    state = app.state
    engine: Engine = state.worker.engine
    served: str = state.served_model_name
    limits: ServerLimits = state.limits
    max_chars: int = state.max_prompt_chars

    def check_model(name: str | None) -> None:
        api_errors.check_model(name, served)

    def check_chars(count: int, param: str) -> None:
        api_errors.check_chars(count, max_chars, engine.max_model_len, param)

    def check_messages(messages: Sequence[ChatMessage]) -> None:
        if len(messages) > limits.max_messages:
            raise APIError(
                400,
                f"a chat request may have at most {limits.max_messages} messages, got "
                f"{len(messages)} (the server's --max-messages)",
                param="messages",
            )
        if any(m.has_images() for m in messages):
            raise APIError(
                400,
                "messages with images are not tokenized here: their prompt holds the images' "
                "features, which only a chat completion computes; send text messages",
                param="messages",
            )

    def chat_messages(body: ChatCompletionRequest) -> tuple[list[dict[str, Any]], Any, bool]:
        """The chat endpoint's checks and inputs: messages, tool request, whether tools render."""
        check_messages(body.messages)
        tool_req = body.tool_request()
        with_tools = body.uses_tools() or tool_req is not None
        messages = body.to_messages()
        check_chars(sum(len(m["content"]) for m in messages), "messages")
        return messages, tool_req, with_tools

    def answer(ids: list[int], with_strs: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
        }
        if with_strs:
            out["token_strs"] = _token_strs(engine, ids)
        return out

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        raw = await _json_object(request)
        if "messages" in raw:
            chat = _validated(ChatTokenizeRequest, raw)
            check_model(chat.model)
            _refuse_template_options(chat)
            _check_flags(chat)
            # The chat endpoint's own body model does its message checks (roles, tool calls
            # answering earlier calls, content parts), so both refuse the same chats.
            tool_fields = ("tools", "tool_choice", "parallel_tool_calls")
            as_chat = _validated(
                ChatCompletionRequest,
                {
                    "model": served,
                    "messages": raw["messages"],
                    **{k: raw[k] for k in tool_fields if k in raw},
                },
            )
            messages, tool_req, with_tools = chat_messages(as_chat)
            ids = await asyncio.to_thread(
                _rendered_chat_ids, engine, messages, tool_req, with_tools, chat
            )
            return answer(ids, chat.return_token_strs)
        if "prompt" not in raw:
            raise BadRequestError(
                "a tokenize request has a prompt (a string) or messages (a chat)", param="prompt"
            )
        prompt = _validated(CompletionTokenizeRequest, raw)
        check_model(prompt.model)
        check_chars(len(prompt.prompt), "prompt")
        ids = await asyncio.to_thread(
            lambda: list(
                engine.tokenizer.encode(prompt.prompt, add_special_tokens=prompt.add_special_tokens)
            )
        )
        return answer(ids, prompt.return_token_strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        vocab = engine.vocab_size or 2**32
        for i, t in enumerate(body.tokens):
            if t >= vocab:
                raise BadRequestError(
                    f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab}): send token ids "
                    "this model's tokenizer produced",
                    param=f"tokens[{i}]",
                )
        text = await asyncio.to_thread(engine.tokenizer.decode, list(body.tokens))
        return {"prompt": str(text)}

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        check_model(body.model)
        messages, tool_req, with_tools = chat_messages(body)
        # The same parameter checks as a completion, so a request that would be refused
        # there is refused here too; the parameters are echoed as vLLM's render does.
        params = body.sampling_params(body.requested_max_tokens() or 1, engine.sampling_defaults)
        for_tenant(request.scope, body.cache_salt, body.agent_hints())
        ids = await asyncio.to_thread(chat_prompt_ids, engine, messages, tool_req, with_tools)
        return {
            "request_id": request.headers.get("x-request-id") or f"render-{uuid.uuid4().hex}",
            "token_ids": ids,
            "features": None,
            "sampling_params": {
                "max_tokens": body.requested_max_tokens(),
                "temperature": params.temperature,
                "top_p": params.top_p,
                "seed": params.seed,
                "n": params.n,
            },
            "model": served,
            "stream": body.streaming,
            "cache_salt": body.cache_salt,
        }


def _validated(model: type[_M], data: dict[str, Any]) -> _M:
    """``data`` as ``model``; refused as any request body is (400 naming the field)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadRequestError("the request body must be a JSON object")
    return data


__all__ = [
    "ChatTokenizeRequest",
    "CompletionTokenizeRequest",
    "DetokenizeRequest",
    "chat_prompt_ids",
    "register_tokenization",
]
