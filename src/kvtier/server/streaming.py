"""OpenAI-shaped response pieces: usage, failures, and server-sent event streams.

A streamed completion is a series of ``data: {chunk}`` events, a usage
event when asked for, then ``data: [DONE]``; a request that fails sends an
OpenAI error event instead of its final chunk, and a client that goes away
cancels its request.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvtier.engine.engine import RequestOutput
from kvtier.engine.worker import RequestHandle
from kvtier.server.protocol import error_body


def usage_body(out: RequestOutput) -> dict[str, Any]:
    m = out.metrics
    return {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": m.completion_tokens,
        "total_tokens": m.prompt_tokens + m.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": m.cached_tokens},
    }


def failure_message(out: RequestOutput) -> str:
    if out.finish_reason == "abort":
        return "the request was cancelled"
    return f"generation failed: {out.error or 'unknown engine error'}"


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _stream_outputs(
    handle: RequestHandle,
    kind: str,
    rid: str,
    created: int,
    model: str,
    on_output: Callable[[RequestOutput], list[dict[str, Any]]],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE events for a request's outputs, a usage event, then ``[DONE]``.

    A request that ends in an error sends an OpenAI error event instead of its
    final chunk. If the client disconnects, the request is cancelled.
    """
    try:
        async with contextlib.aclosing(handle.stream()) as outs:
            async for out in outs:
                if out.finished and out.finish_reason not in ("stop", "length"):
                    yield _sse(error_body(failure_message(out), type="server_error"))
                    break
                for chunk in on_output(out):
                    yield _sse(chunk)
                if out.finished and include_usage:
                    usage = _envelope(rid, kind, created, model, [])
                    usage["usage"] = usage_body(out)
                    yield _sse(usage)
        yield _sse("[DONE]")
    finally:
        if not handle.finished:
            handle.cancel()


def _envelope(
    rid: str, kind: str, created: int, model: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }


def chat_stream(
    handle: RequestHandle, rid: str, created: int, model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    """SSE events of a chat completion: ``chat.completion.chunk`` objects."""
    first = [True]

    def chunk(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        body = _envelope(rid, "chat.completion.chunk", created, model, [choice])
        if include_usage:
            body["usage"] = None
        return body

    def on_output(out: RequestOutput) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any]] = []
        if first[0]:
            first[0] = False
            chunks.append(chunk({"role": "assistant", "content": ""}, None))
        if out.text:
            chunks.append(chunk({"content": out.text}, None))
        if out.finished:
            chunks.append(chunk({}, out.finish_reason))
        return chunks

    return _stream_outputs(
        handle, "chat.completion.chunk", rid, created, model, on_output, include_usage
    )


def completion_stream(
    handle: RequestHandle, rid: str, created: int, model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    """SSE events of a text completion: ``text_completion`` objects."""

    def chunk(text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = _envelope(rid, "text_completion", created, model, [choice])
        if include_usage:
            body["usage"] = None
        return body

    def on_output(out: RequestOutput) -> list[dict[str, Any]]:
        if out.finished:
            return [chunk(out.text, out.finish_reason)]
        return [chunk(out.text, None)] if out.text else []

    return _stream_outputs(handle, "text_completion", rid, created, model, on_output, include_usage)
