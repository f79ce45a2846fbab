"""OpenAI-shaped response pieces: usage, failures, choices, and server-sent event streams.

A streamed completion is a series of ``data: {chunk}`` events (one choice
per chunk, tagged with its ``index``), a usage event when asked for, then
``data: [DONE]``; a request that fails sends an OpenAI error event instead
of its final chunk, and a client that goes away cancels its request.
:class:`ChoiceAccumulator` gathers a non-streamed request's choices.

A chat stream that parses tool calls (:mod:`kvtier.server.tools`) sends
text before a call as content, holds back text that may begin
``<tool_call>``, and sends each call in OpenAI's delta shape: a first delta
with the call's ``index``, ``id``, ``type``, function ``name`` and the
start of its ``arguments`` (maybe empty), then deltas with only the
``index`` and the next piece of the arguments, as they are generated. A
choice that made calls and stopped ends with ``finish_reason``
``"tool_calls"``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.engine import RequestOutput
from kvtier.engine.request import cached_by_source
from kvtier.engine.sampling import TokenLogprob
from kvtier.engine.worker import RequestHandle
from kvtier.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from kvtier.server.protocol import error_body
from kvtier.server.tools import StreamEvent, ToolCallStream


def usage_body(outs: list[RequestOutput]) -> dict[str, Any]:
    """Usage of a request from its choices' last outputs: the prompt counts once."""
    m = outs[0].metrics
    completion = sum(o.metrics.completion_tokens for o in outs)
    return {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": m.prompt_tokens + completion,
        "prompt_tokens_details": {
            "cached_tokens": m.cached_tokens,
            # kvtier's extension: where the cached tokens came from (the pool, each tier).
            "kvtier_cached_tokens_by_source": cached_by_source(m.cached_tokens, m.tier_tokens),
        },
    }


def failure_message(out: RequestOutput) -> str:
    if out.finish_reason == "abort":
        return "the request was cancelled"
    return f"generation failed: {out.error or 'unknown engine error'}"


def json_bytes(data: Any) -> bytes:
    """JSON as UTF-8; text that cannot be encoded (a lone surrogate) is escaped, never fatal."""
    try:
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(data, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data.encode() if isinstance(data, str) else json_bytes(data)
    return b"data: " + payload + b"\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: RequestOutput | None = None


class ChoiceAccumulator:
    """A request's outputs gathered per choice, for a non-streamed response."""

    def __init__(self, n: int) -> None:
        self.choices = [_Choice() for _ in range(n)]

    def add(self, out: RequestOutput) -> None:
        c = self.choices[out.index]
        c.text.append(out.text)
        c.logprobs.extend(out.logprobs)
        if out.finished:
            c.last = out

    def finals(self) -> list[RequestOutput]:
        out = [c.last for c in self.choices if c.last is not None]
        return out

    def failure(self) -> RequestOutput | None:
        """The first choice that ended other than by stop or length, if any."""
        for c in self.choices:
            if c.last is not None and c.last.finish_reason not in ("stop", "length"):
                return c.last
        return None


async def _stream_outputs(
    handle: RequestHandle,
    kind: str,
    rid: str,
    created: int,
    model: str,
    on_output: Callable[[RequestOutput], list[dict[str, Any]]],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE events for a request's outputs, a usage event, then ``[DONE]``."""
    finals: list[RequestOutput] = []
    try:
        async with contextlib.aclosing(handle.stream()) as outs:
            async for out in outs:
                if out.finished and out.finish_reason not in ("stop", "length"):
                    yield _sse(error_body(failure_message(out), type="server_error"))
                    break
                for chunk in on_output(out):
                    yield _sse(chunk)
                if out.finished:
                    finals.append(out)
            else:
                if include_usage and finals:
                    usage = _envelope(rid, kind, created, model, [])
                    usage["usage"] = usage_body(finals)
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
    handle: RequestHandle,
    rid: str,
    created: int,
    model: str,
    include_usage: bool,
    tokens: TokenText,
    *,
    tool_calls: bool = False,
    max_calls: int | None = None,
) -> AsyncIterator[bytes]:
    """SSE events of a chat completion: ``chat.completion.chunk`` objects.

    With ``tool_calls`` the text is parsed for calls (at most ``max_calls``
    per choice, ``None``: any number).
    """
    started: set[int] = set()
    parsers: dict[int, ToolCallStream] = {}

    def chunk(index: int, delta: dict[str, Any], finish: str | None, lp: Any) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        body = _envelope(rid, "chat.completion.chunk", created, model, [choice])
        if include_usage:
            body["usage"] = None
        return body

    def on_output(out: RequestOutput) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any]] = []
        i = out.index
        if i not in started:
            started.add(i)
            chunks.append(chunk(i, {"role": "assistant", "content": ""}, None, None))
        lp = chat_logprobs(tokens, list(out.logprobs)) if out.logprobs else None
        if not tool_calls:
            if out.text or lp is not None:
                chunks.append(chunk(i, {"content": out.text}, None, lp))
            if out.finished:
                chunks.append(chunk(i, {}, out.finish_reason, None))
            return chunks
        parser = parsers.setdefault(i, ToolCallStream(max_calls))
        events = parser.feed(out.text)
        if out.finished:
            events += parser.finish()
        deltas = [d for e in events for d in _event_deltas(e)]
        if lp is not None and not deltas:
            deltas.append({})
        for n, delta in enumerate(deltas):
            chunks.append(chunk(i, delta, None, lp if n == 0 else None))
        if out.finished:
            finish = out.finish_reason
            if parser.calls and finish == "stop":
                finish = "tool_calls"
            chunks.append(chunk(i, {}, finish, None))
        return chunks

    return _stream_outputs(
        handle, "chat.completion.chunk", rid, created, model, on_output, include_usage
    )


def _event_deltas(event: StreamEvent) -> list[dict[str, Any]]:
    """The delta of one parsed piece: content, a call's start, or more of its arguments."""
    if event.content is not None:
        return [{"content": event.content}] if event.content else []
    call: dict[str, Any] = {"index": event.index}
    if event.id is not None:
        call["id"] = event.id
        call["type"] = "function"
        call["function"] = {"name": event.name, "arguments": event.arguments or ""}
    elif event.arguments:
        call["function"] = {"arguments": event.arguments}
    else:
        return []
    return [{"tool_calls": [call]}]


def completion_stream(
    handle: RequestHandle,
    rid: str,
    created: int,
    model: str,
    include_usage: bool,
    tokens: TokenText,
) -> AsyncIterator[bytes]:
    """SSE events of a text completion: ``text_completion`` objects."""
    offsets: dict[int, int] = {}

    def chunk(out: RequestOutput, finish: str | None) -> dict[str, Any]:
        lp = None
        if out.logprobs:
            start = offsets.get(out.index, 0)
            lp = completion_logprobs(tokens, list(out.logprobs), start)
            offsets[out.index] = start + sum(len(t) for t in lp["tokens"])
        choice = {"index": out.index, "text": out.text, "logprobs": lp, "finish_reason": finish}
        body = _envelope(rid, "text_completion", created, model, [choice])
        if include_usage:
            body["usage"] = None
        return body

    def on_output(out: RequestOutput) -> list[dict[str, Any]]:
        if out.finished:
            return [chunk(out, out.finish_reason)]
        return [chunk(out, None)] if out.text or out.logprobs else []

    return _stream_outputs(handle, "text_completion", rid, created, model, on_output, include_usage)
