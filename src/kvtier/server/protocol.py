"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

:class:`ChatCompletionRequest` is the body of ``POST /v1/chat/completions``
and :class:`CompletionRequest` that of ``POST /v1/completions``. They accept
what the official OpenAI clients send; fields kvtier does not know are
ignored, and fields it knows but cannot honour (``n`` > 1, ``echo``,
``best_of`` > 1, ``suffix``, non-text message parts) raise
:class:`~kvtier.errors.BadRequestError` from the ``to_*`` helpers, which the
server reports as HTTP 400. Sampling values are checked by
:class:`~kvtier.engine.sampling.SamplingParams` itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvtier.errors import BadRequestError

#: OpenAI's default ``max_tokens`` for ``/v1/completions``.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class _Body(BaseModel):
    """A request-body model that ignores unknown fields."""

    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: str | None = None


class ChatMessage(_Body):
    """One chat message: a role and its content (a string or a list of text parts)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        """The content as one string; raises for parts other than text."""
        content = self.content
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        pieces: list[str] = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise BadRequestError(
                    f"only text content parts are supported, got a part of type {part.type!r}",
                    param=f"messages[{index}].content[{j}]",
                )
            pieces.append(part.text)
        return "".join(pieces)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return (
            self.streaming
            and self.stream_options is not None
            and (self.stream_options.include_usage)
        )

    def check_n(self) -> None:
        if self.n is not None and self.n != 1:
            raise BadRequestError(
                f"n must be 1 (kvtier generates one choice per request), got {self.n}", param="n"
            )

    def sampling_kwargs(self, defaults: Mapping[str, float] | None = None) -> dict[str, Any]:
        """Keyword arguments for ``SamplingParams`` (besides ``max_tokens``).

        ``defaults`` fills ``temperature`` and ``top_p`` when the request
        leaves them out (the served model's recommended values); without
        them, OpenAI's defaults of 1.0 apply.
        """
        defaults = defaults or {}
        stop: tuple[str, ...]
        if self.stop is None:
            stop = ()
        elif isinstance(self.stop, str):
            stop = (self.stop,)
        else:
            stop = tuple(self.stop)
        return {
            "temperature": defaults.get("temperature", 1.0)
            if self.temperature is None
            else self.temperature,
            "top_p": defaults.get("top_p", 1.0) if self.top_p is None else self.top_p,
            "stop": stop,
            "seed": self.seed,
        }


class ChatCompletionRequest(_Sampling):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``; None: up to the context."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_messages(self) -> list[dict[str, Any]]:
        """The messages as plain dicts for the chat template; checks what kvtier supports."""
        self.check_n()
        if not self.messages:
            raise BadRequestError("messages must be a non-empty list", param="messages")
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            if not m.role:
                raise BadRequestError(
                    "a message role must be non-empty", param=f"messages[{i}].role"
                )
            # "developer" is OpenAI's newer name for the system role.
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text(i)})
        return out


class CompletionRequest(_Sampling):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def requested_max_tokens(self) -> int:
        if self.max_tokens is None:
            return DEFAULT_COMPLETION_MAX_TOKENS
        return self.max_tokens

    def check_supported(self) -> None:
        self.check_n()
        if self.echo:
            raise BadRequestError("echo is not supported", param="echo")
        if self.best_of is not None and self.best_of != 1:
            raise BadRequestError("best_of must be 1", param="best_of")
        if self.suffix:
            raise BadRequestError("suffix is not supported", param="suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or a list of token ids (a batch of one is unwrapped)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise BadRequestError("prompt must not be empty", param="prompt")
        first = p[0]
        if isinstance(first, int):
            return [int(t) for t in p if isinstance(t, int)]
        if len(p) != 1:
            raise BadRequestError(
                f"only one prompt per request is supported, got {len(p)}", param="prompt"
            )
        if isinstance(first, str):
            return first
        return list(first)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
