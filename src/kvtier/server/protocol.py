"""Request bodies of the OpenAI-compatible endpoints, as strict pydantic models.

:class:`ChatCompletionRequest` is the body of ``POST /v1/chat/completions``
and :class:`CompletionRequest` that of ``POST /v1/completions``. They follow
OpenAI's schema strictly: booleans are not numbers, numbers are not strings,
roles are an enum, content is required where the schema requires it, every
number has OpenAI's range, and text must be valid Unicode (a lone surrogate
is refused, since it cannot be encoded). Fields kvtier does not know are
ignored, as OpenAI's newer fields would be, except ``kvtier``: the agent
hints extension object (:mod:`kvtier.hints`), validated strictly.
Function tools are served: ``tools``, ``tool_choice``,
``parallel_tool_calls``, assistant messages with ``tool_calls`` and ``tool``
messages are checked here and in :mod:`kvtier.server.tools`, which renders
and parses them. Fields it knows but cannot honour (the legacy
``functions`` / ``function_call`` and the ``function`` role, tools together
with images, ``response_format`` other than text, ``echo``, ``suffix``,
``best_of`` > 1, audio, content parts other than text and ``image_url``;
``image_url`` parts for a model that takes no images) are refused by name
with :class:`~kvtier.errors.BadRequestError`, which the server reports as
HTTP 400 — never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from kvtier.engine.sampling import MAX_N, MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams
from kvtier.errors import BadRequestError
from kvtier.hints import Hints, parse_hints
from kvtier.server.tools import ToolRequest, assistant_calls, tool_request

#: OpenAI's default ``max_tokens`` for ``/v1/completions``.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: ``/v1/completions`` returns at most this many alternatives per token (OpenAI's limit).
MAX_COMPLETION_LOGPROBS = 5


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # The message must not echo the text: it could not be encoded in a response either.
        raise ValueError(
            "text is not valid Unicode (it holds a lone surrogate such as \\ud800): send UTF-8 text"
        ) from None
    return text


#: A string that can be encoded (no lone surrogates).
Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Body(BaseModel):
    """A strict request-body model that ignores unknown fields."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class ImageURL(_Body):
    """An ``image_url`` part's target: a data URL (or ``file://`` where the server allows)."""

    url: Text
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(_Body):
    """One part of a message's content: ``{"type": "text", "text": ...}`` or an ``image_url``."""

    type: Text
    text: Text | None = None
    image_url: ImageURL | None = None


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(_Body):
    """One chat message: a role and its content (a string or a list of text parts)."""

    role: Role
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: Text | None = None

    def text(self, index: int) -> str:
        """The content as one string; raises for what kvtier cannot serve."""
        where = f"messages[{index}]"
        content = self._checked(where)
        if isinstance(content, str):
            return content
        pieces: list[str] = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise BadRequestError(
                    "only text content parts are supported by this model (it takes no images), "
                    f"got a part of type {part.type!r}",
                    param=f"{where}.content[{j}]",
                )
            pieces.append(part.text)
        return "".join(pieces)

    def parts(self, index: int, urls: list[tuple[str, str]]) -> str | list[dict[str, Any]]:
        """The content with each image as ``{"type": "image"}``; its URL appended to ``urls``.

        ``urls`` collects ``(url, param)`` in prompt order, for the server to load.
        """
        where = f"messages[{index}]"
        content = self._checked(where)
        if isinstance(content, str):
            return content
        out: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            param = f"{where}.content[{j}]"
            if part.type == "text" and part.text is not None:
                out.append({"type": "text", "text": part.text})
            elif part.type == "image_url" and part.image_url is not None:
                urls.append((part.image_url.url, f"{param}.image_url.url"))
                out.append({"type": "image"})
            else:
                raise BadRequestError(
                    "content parts must be text or image_url (with its url), got a part of type "
                    f"{part.type!r}",
                    param=param,
                )
        return out

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "image_url" for p in self.content)

    def uses_tools(self) -> bool:
        """Whether the message is a tool call or a tool's result."""
        return self.role == "tool" or bool(self.tool_calls)

    def _checked(self, where: str) -> str | list[ContentPart]:
        if self.role == "function":
            raise BadRequestError(
                "function messages (the legacy function calling) are not supported: send the "
                "result as a tool message with its tool_call_id",
                param=f"{where}.role",
            )
        if self.tool_calls and self.role != "assistant":
            raise BadRequestError(
                f"only assistant messages carry tool_calls, not {self.role} messages",
                param=f"{where}.tool_calls",
            )
        if self.role == "tool" and not self.tool_call_id:
            raise BadRequestError(
                f"{where}.tool_call_id is required for a tool message: the id of the call "
                "it answers",
                param=f"{where}.tool_call_id",
            )
        content = self.content
        if content is None and self.tool_calls:
            return ""  # an assistant turn that only calls tools
        if content is None:
            raise BadRequestError(
                f"{where}.content is required for a {self.role} message", param=f"{where}.content"
            )
        return content


class StreamOptions(_Body):
    include_usage: bool = False


Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
MaxTokens = Annotated[int, Field(ge=1)]
Choices = Annotated[int, Field(ge=1, le=MAX_N)]
Stop = Text | Annotated[list[Text], Field(max_length=4)]


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: Text
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Choices | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[Text, Bias] | None = None
    user: Text | None = None
    #: vLLM's extension: prefix caching is shared only among requests with the same salt
    #: (and the same tenant: :mod:`kvtier.server.tenants`).
    cache_salt: Text | None = None
    #: kvtier's extension: agent hints (clients send it with ``extra_body``).
    kvtier: dict[str, Any] | None = None
    #: vLLM's prefill/decode hand-over fields (:mod:`kvtier.server.disagg`), sent by P/D routers.
    kv_transfer_params: dict[str, Any] | None = None

    def agent_hints(self) -> Hints | None:
        """The request's ``kvtier`` hints, validated (unknown or malformed ones: 400)."""
        return parse_hints(self.kvtier, where="kvtier")

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

    def _logprobs(self) -> int | None:
        return None

    def sampling_params(
        self, max_tokens: int, defaults: Mapping[str, float] | None = None
    ) -> SamplingParams:
        """The request's :class:`SamplingParams`.

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
        bias: dict[int, float] = {}
        for token, value in (self.logit_bias or {}).items():
            if not token.isdigit() or len(token) > 12:
                raise BadRequestError(
                    f"logit_bias keys must be token ids written as decimal strings, got {token!r}",
                    param="logit_bias",
                )
            bias[int(token)] = value
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.get("temperature", 1.0)
            if self.temperature is None
            else self.temperature,
            top_p=defaults.get("top_p", 1.0) if self.top_p is None else self.top_p,
            stop=stop,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=bias,
            logprobs=self._logprobs(),
            n=self.n or 1,
        )


class ChatCompletionRequest(_Sampling):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Checked by kvtier.server.tools (OpenAI's shapes, with errors naming the field).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Known and refused.
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: list[Text] | None = None
    prediction: Any = None
    web_search_options: Any = None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``; None: the server's
        default (``--default-max-tokens``, at most the context left after the prompt)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        """Refuse, by name, what the request asks for that kvtier cannot do."""
        if self.functions:
            raise BadRequestError(
                "functions (the legacy function calling) are not supported: send them as tools",
                param="functions",
            )
        if self.function_call not in (None, "none"):
            raise BadRequestError(
                "function_call (the legacy function calling) is not supported: use tool_choice",
                param="function_call",
            )
        fmt = self.response_format
        if fmt is not None and not (isinstance(fmt, dict) and fmt == {"type": "text"}):
            raise BadRequestError(
                "response_format is not supported: only plain text is generated "
                "(no JSON mode or structured output)",
                param="response_format",
            )
        if self.audio is not None:
            raise BadRequestError("audio output is not supported", param="audio")
        if self.modalities is not None and list(self.modalities) != ["text"]:
            raise BadRequestError(
                "output modalities other than text are not supported", param="modalities"
            )
        if self.prediction is not None:
            raise BadRequestError("predicted outputs are not supported", param="prediction")
        if self.web_search_options is not None:
            raise BadRequestError("web search is not supported", param="web_search_options")

    def tool_request(self) -> ToolRequest | None:
        """The request's tools and tool choice, checked (``None``: it sends neither)."""
        return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def uses_tools(self) -> bool:
        """Whether the request offers tools or its messages hold tool calls or results."""
        return self.tools is not None or any(m.uses_tools() for m in self.messages)

    def to_messages(self) -> list[dict[str, Any]]:
        """The messages as plain dicts for the chat template; checks what kvtier supports.

        An assistant message's ``tool_calls`` keep their ids and carry their
        arguments as a dict; a ``tool`` message keeps its ``tool_call_id``,
        which must answer a call made earlier in the conversation.
        """
        self.check_supported()
        if not self.messages:
            raise BadRequestError("messages must be a non-empty list", param="messages")
        out: list[dict[str, Any]] = []
        call_ids: set[str] = set()
        for i, m in enumerate(self.messages):
            # "developer" is OpenAI's newer name for the system role.
            role = "system" if m.role == "developer" else m.role
            entry: dict[str, Any] = {"role": role, "content": m.text(i)}
            if m.tool_calls:
                entry["tool_calls"] = assistant_calls(m.tool_calls, f"messages[{i}]")
                call_ids.update(c["id"] for c in entry["tool_calls"])
            if role == "tool":
                if m.tool_call_id not in call_ids:
                    raise BadRequestError(
                        f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no tool call "
                        "made by an earlier assistant message",
                        param=f"messages[{i}].tool_call_id",
                    )
                entry["tool_call_id"] = m.tool_call_id
                if m.name is not None:
                    entry["name"] = m.name
            out.append(entry)
        return out

    def has_images(self) -> bool:
        """Whether any message holds an ``image_url`` part."""
        return any(m.has_images() for m in self.messages)

    def to_multimodal_messages(self) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        """Messages whose images are ``{"type": "image"}`` parts, and the images' URLs in order."""
        self.check_supported()
        if not self.messages:
            raise BadRequestError("messages must be a non-empty list", param="messages")
        urls: list[tuple[str, str]] = []
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.parts(i, urls)})
        return out, urls


class CompletionRequest(_Sampling):
    """The body of ``POST /v1/completions``."""

    prompt: (
        Text
        | list[Text]
        | list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
    )
    max_tokens: MaxTokens | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool | None = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: Text | None = None

    def requested_max_tokens(self) -> int:
        if self.max_tokens is None:
            return DEFAULT_COMPLETION_MAX_TOKENS
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        if self.echo:
            raise BadRequestError("echo is not supported", param="echo")
        if self.best_of is not None and self.best_of != 1:
            raise BadRequestError("best_of must be 1 (use n for several choices)", param="best_of")
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
            return [t for t in p if isinstance(t, int)]
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
