"""Tool calling for ``/v1/chat/completions``: tool specs, prompt rendering, and parsing calls.

A request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are
checked here into a :class:`ToolRequest` (a malformed one is a
:class:`~kvtier.errors.BadRequestError` naming the field). The prompt is
rendered by :func:`encode_tool_chat`:

* a model whose chat template mentions ``tools`` gets them through the
  template (``apply_chat_template(messages, tools=...)``), with prior
  ``tool_calls`` and ``tool`` messages passed as Hugging Face templates
  expect them;
* any other model (SmolLM2-135M-Instruct among them: its template ignores
  tools) gets the Hermes convention written by kvtier: the tool specs go
  into the system prompt between ``<tools>`` and ``</tools>``, with the
  instruction to answer ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
  earlier assistant calls are rendered as such blocks and tool results as
  ``<tool_response>`` blocks in a user message.

With ``tool_choice`` ``"none"`` the tools are left out of the prompt and
the answer is plain text. Otherwise the generated text is parsed for
Hermes ``<tool_call>`` blocks into OpenAI ``tool_calls`` by
:class:`ToolCallStream`, which streams a call's arguments as they are
written; :func:`parse_tool_calls` is the same parser over a whole answer,
so streamed and whole answers agree. A block that is not a call stays in
the content as text, and an argument string may hold ``</tool_call>``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.errors import BadRequestError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

#: OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
#: A template that mentions ``tools`` as a variable renders them itself.
_TEMPLATE_TOOLS = re.compile(r"\btools\b")

ChoiceMode = Literal["auto", "none", "required", "function"]


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolSpec:
    """One function tool: its name, description and JSON schema of arguments."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's ``{"type": "function", "function": {...}}``."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters)
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice``: a mode, and the function's name when the mode is ``function``."""

    mode: ChoiceMode
    name: str | None = None


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, checked: what to render, parse and constrain."""

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    parallel: bool

    @property
    def parses(self) -> bool:
        """Whether the answer is parsed for tool calls."""
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def constrained(self) -> bool:
        """Whether decoding must produce a call (``required`` or a named function)."""
        return self.parses and self.choice.mode in ("required", "function")

    @property
    def max_calls(self) -> int | None:
        """Most calls returned per answer (``None``: any number)."""
        return None if self.parallel else 1

    def called_tools(self) -> tuple[ToolSpec, ...]:
        """The tools a constrained answer may call."""
        if self.choice.mode == "function":
            return tuple(t for t in self.tools if t.name == self.choice.name)
        return self.tools


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# -- request checks -----------------------------------------------------------------------


def _check_schema(schema: Any, where: str) -> Mapping[str, Any]:
    if schema is None:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise BadRequestError(
            f"{where} must be a JSON schema object, got {type(schema).__name__}", param=where
        )
    kind = schema.get("type", "object")
    if kind != "object":
        raise BadRequestError(
            f'{where} must describe an object (type "object"), got type {kind!r}', param=where
        )
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise BadRequestError(
            f"{where}.properties must map argument names to JSON schemas",
            param=f"{where}.properties",
        )
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise BadRequestError(
            f"{where}.required must be a list of argument names", param=f"{where}.required"
        )
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise BadRequestError(f"{where} is not plain JSON: {exc}", param=where) from None
    return schema


def parse_tools(raw: Sequence[Any] | None) -> tuple[ToolSpec, ...]:
    """``tools`` checked into specs: function tools with unique, valid names."""
    if raw is None:
        return ()
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise BadRequestError(f"{where} must be an object", param=where)
        if item.get("type") != "function":
            raise BadRequestError(
                f'{where}.type must be "function" (the only tool type served), '
                f"got {item.get('type')!r}",
                param=f"{where}.type",
            )
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise BadRequestError(
                f"{where}.function must be an object with name, description and parameters",
                param=f"{where}.function",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise BadRequestError(
                f"{where}.function.name must be 1 to 64 letters, digits, underscores or "
                f"dashes, got {name!r}",
                param=f"{where}.function.name",
            )
        if name in seen:
            raise BadRequestError(
                f"{where}.function.name {name!r} is used by an earlier tool: names must be unique",
                param=f"{where}.function.name",
            )
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise BadRequestError(
                f"{where}.function.description must be a string",
                param=f"{where}.function.description",
            )
        params = _check_schema(fn.get("parameters"), f"{where}.function.parameters")
        specs.append(ToolSpec(name, desc, params))
    return tuple(specs)


def parse_tool_choice(raw: Any, tools: Sequence[ToolSpec]) -> ToolChoice:
    """``tool_choice`` checked against ``tools`` (default: ``auto``, or ``none`` without tools)."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("auto", "none", "required"):
        mode: ChoiceMode = raw
        if mode == "required" and not tools:
            raise BadRequestError(
                'tool_choice "required" needs tools: send the functions in tools',
                param="tool_choice",
            )
        return ToolChoice(mode)
    if isinstance(raw, dict) and raw.get("type") == "function":
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise BadRequestError(
                "tool_choice.function.name must name one of the tools",
                param="tool_choice.function.name",
            )
        if name not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools) or "none sent"
            raise BadRequestError(
                f"tool_choice names function {name!r}, which is not in tools ({known})",
                param="tool_choice.function.name",
            )
        return ToolChoice("function", name)
    raise BadRequestError(
        'tool_choice must be "auto", "none", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def tool_request(raw_tools: Any, raw_choice: Any, parallel: bool | None) -> ToolRequest | None:
    """The request's tool settings, checked; ``None`` when it sends no tools and no choice."""
    if raw_tools is None and raw_choice is None:
        return None
    if raw_tools is not None and not isinstance(raw_tools, list):
        raise BadRequestError("tools must be a list of function tools", param="tools")
    tools = parse_tools(raw_tools)
    choice = parse_tool_choice(raw_choice, tools)
    return ToolRequest(tools, choice, True if parallel is None else parallel)


def assistant_calls(raw: Sequence[Any], where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates take them (arguments a dict)."""
    out: list[dict[str, Any]] = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise BadRequestError(f"{at} must be an object", param=at)
        cid = call.get("id")
        if not isinstance(cid, str) or not cid:
            raise BadRequestError(f"{at}.id must be a non-empty string", param=f"{at}.id")
        if call.get("type", "function") != "function":
            raise BadRequestError(f'{at}.type must be "function"', param=f"{at}.type")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequestError(
                f"{at}.function must hold the function's name and arguments",
                param=f"{at}.function",
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise BadRequestError(
                    f"{at}.function.arguments must be a JSON object written as a string: {exc}",
                    param=f"{at}.function.arguments",
                ) from None
        if not isinstance(args, dict):
            raise BadRequestError(
                f"{at}.function.arguments must be a JSON object",
                param=f"{at}.function.arguments",
            )
        out.append(
            {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


# -- rendering ----------------------------------------------------------------------------


def template_knows_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and bool(_TEMPLATE_TOOLS.search(template))


def hermes_system_prompt(req: ToolRequest) -> str:
    """The system prompt text that offers ``req``'s tools the Hermes way."""
    specs = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in req.tools)
    lines = [
        "You can call functions to help with the user's request. "
        "The functions are described, one JSON object per line, inside <tools></tools>:",
        f"<tools>\n{specs}\n</tools>",
        "To call a function, answer with its name and a JSON object of arguments inside "
        "<tool_call></tool_call> tags, exactly like this:",
        f'{TOOL_CALL_OPEN}\n{{"name": "function_name", "arguments": {{"arg": "value"}}}}\n'
        f"{TOOL_CALL_CLOSE}",
        "Function results come back inside <tool_response></tool_response> tags.",
    ]
    if req.choice.mode == "required":
        lines.append("You must call at least one function.")
    elif req.choice.mode == "function":
        lines.append(f"You must call the function {req.choice.name}.")
    if not req.parallel:
        lines.append("Call at most one function per answer.")
    return "\n".join(lines)


def hermes_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """One call as a Hermes ``<tool_call>`` block."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def hermes_messages(
    messages: Sequence[Mapping[str, Any]], req: ToolRequest | None
) -> list[dict[str, Any]]:
    """``messages`` rewritten so that a template that knows no tools renders them Hermes-style."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [
                hermes_call_text(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join([content, *blocks]).lstrip("\n")})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            prev = out[-1] if out else None
            if prev is not None and prev.get("_tool_results"):
                prev["content"] += "\n" + block  # results of parallel calls share one turn
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if req is not None and req.parses:
        offer = hermes_system_prompt(req)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{offer}" if out[0]["content"] else offer
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out


def render_tool_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    req: ToolRequest | None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of a chat with tools (or with earlier tool calls), ready for the reply.

    The flags are the chat template's (``/tokenize`` passes a client's own); chat
    completions always render with the defaults.
    """
    flags: dict[str, bool] = {"add_generation_prompt": add_generation_prompt}
    if continue_final_message:  # only when set: the default call stays the chat endpoint's
        flags["continue_final_message"] = True
    if getattr(tokenizer, "chat_template", None) is None:
        raise BadRequestError(
            "this model has no chat template, so it cannot be offered tools: "
            "use /v1/completions without tools",
            param="tools",
        )
    try:
        if template_knows_tools(tokenizer):
            tools = [t.as_openai() for t in req.tools] if req is not None and req.parses else None
            text = tokenizer.apply_chat_template(
                [dict(m) for m in messages], tools=tools, tokenize=False, **flags
            )
        else:
            text = tokenizer.apply_chat_template(
                hermes_messages(messages, req), tokenize=False, **flags
            )
    except Exception as exc:  # a template raising on odd input is the caller's input
        raise BadRequestError(
            f"messages do not fit the chat template: {exc}", param="messages"
        ) from exc
    return str(text)


def encode_tool_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], req: ToolRequest | None
) -> list[int]:
    """Token ids of :func:`render_tool_chat`'s prompt."""
    text = render_tool_chat(tokenizer, messages, req)
    return list(tokenizer.encode(text, add_special_tokens=False))


# -- parsing ------------------------------------------------------------------------------

_WS = " \t\r\n"
#: How a call opens when its arguments can be streamed: ``{"name": <string>, "arguments": {``
#: (``None`` stands for the name's JSON string; whitespace may come between the parts).
_HEAD: tuple[str | None, ...] = ("{", '"name"', ":", None, ",", '"arguments"', ":", "{")


def parse_call(body: str) -> ToolCall | None:
    """The call in a ``<tool_call>`` block's body, or ``None`` if it holds none."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(data["name"], json.dumps(args, ensure_ascii=False))


def _block(text: str, start: int) -> tuple[ToolCall | None, int | None]:
    """The call in the block whose body starts at ``start``, and where the block ends.

    A closing tag inside an argument's string does not end the block: each
    closing tag in turn is tried until the body parses. ``(None, None)``: no
    closing tag yet; ``(None, end)``: not a call, the block ends at the first one.
    """
    first: int | None = None
    at = text.find(TOOL_CALL_CLOSE, start)
    while at >= 0:
        end = at + len(TOOL_CALL_CLOSE)
        first = end if first is None else first
        call = parse_call(text[start:at])
        if call is not None:
            return call, end
        at = text.find(TOOL_CALL_CLOSE, end)
    return None, first


def _string_end(text: str, pos: int) -> int | None:
    """Where the JSON string opening at ``text[pos]`` ends (past its quote); ``None``: not yet."""
    i = pos + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _call_head(body: str) -> tuple[bool | None, str, int]:
    """Whether a block's body opens with ``{"name": <string>, "arguments": {``.

    ``(True, name, at)``: it does, and the arguments object opens at ``at``;
    ``(False, "", 0)``: it does not; ``(None, "", 0)``: the body is too short to tell.
    The answer never changes as the body grows, so it may be asked of any prefix.
    """
    pos, name = 0, ""
    for part in _HEAD:
        while pos < len(body) and body[pos] in _WS:
            pos += 1
        if pos == len(body):
            return None, "", 0
        if part is None:
            if body[pos] != '"':
                return False, "", 0
            end = _string_end(body, pos)
            if end is None:
                return None, "", 0
            try:
                name = json.loads(body[pos:end])
            except json.JSONDecodeError:
                return False, "", 0
            if not name:
                return False, "", 0
            pos = end
            continue
        seen = body[pos : pos + len(part)]
        if not part.startswith(seen):
            return False, "", 0
        if len(seen) < len(part):
            return None, "", 0
        pos += len(part)
    return True, name, pos - 1


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could begin ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class StreamEvent:
    """What a chunk of streamed text yields: content, or a piece of a call.

    A call's first event carries its ``id`` and ``name`` (and the start of its
    arguments, maybe empty); later events of the same ``index`` carry the next
    pieces of its ``arguments``. Joined, the pieces are the call's arguments.
    """

    content: str | None = None
    #: The call's position among the answer's calls (0, 1, ...).
    index: int = 0
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


_Mode = Literal["text", "head", "whole", "args", "tail"]


class ToolCallStream:
    """Splits generated text into content and calls, streaming call arguments as they come.

    Text that might begin ``<tool_call>`` is held back until it is known.
    Inside a block, a body that opens the usual way,
    ``{"name": "<name>", "arguments": {``, is a call from then on: its id and
    name are sent at once and its arguments piece by piece, as written, up
    to the brace that closes them (a brace or a closing tag inside a string
    does not count; a ``<`` outside one, which JSON never has there, ends
    them too), and the rest of the block, up to ``</tool_call>``, is
    dropped. An answer that ends first ends the call with the arguments
    written so far, as OpenAI's API does. Any other body is read whole: the
    block is a call if its JSON is one at some closing tag (sent then, in
    one piece, with its arguments re-serialized), and text otherwise (held
    to the end of the answer, since a later closing tag could still complete
    it; then the block ends at its first closing tag).

    Whitespace is held until text follows it, so an answer with calls ends
    without the whitespace :func:`parse_tool_calls` strips. The result is
    the same however the text is cut into pieces; :func:`parse_tool_calls`
    is this parser fed the whole text at once.
    """

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        #: Calls started (sent) so far.
        self.calls = 0
        #: The complete calls, in order (past ``max_calls`` none are kept).
        self.tool_calls: list[ToolCall] = []
        self._buf = ""
        self._mode: _Mode = "text"
        self._pending_ws = ""
        # The call whose arguments are streaming.
        self._id = ""
        self._name = ""
        self._args: list[str] = []
        self._muted = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def _content(self, text: str) -> list[StreamEvent]:
        if not text:
            return []
        if not text.strip():
            self._pending_ws += text
            return []
        out = self._pending_ws + text
        self._pending_ws = ""
        # Trailing whitespace waits: it is dropped if a call follows.
        body = out.rstrip()
        self._pending_ws = out[len(body) :]
        return [StreamEvent(content=body)]

    def _full(self) -> bool:
        return self.max_calls is not None and self.calls >= self.max_calls

    def _whole_call(self, call: ToolCall) -> list[StreamEvent]:
        if self._full():
            return []
        self.calls += 1
        self.tool_calls.append(call)
        return [
            StreamEvent(index=self.calls - 1, id=call.id, name=call.name, arguments=call.arguments)
        ]

    def _start_call(self, name: str) -> list[StreamEvent]:
        self._id, self._name, self._args = new_call_id(), name, []
        self._depth, self._in_string, self._escaped = 0, False, False
        self._muted = self._full()
        if self._muted:
            return []
        self.calls += 1
        return [StreamEvent(index=self.calls - 1, id=self._id, name=name, arguments="")]

    def _end_call(self) -> None:
        if not self._muted:
            self.tool_calls.append(ToolCall(self._name, "".join(self._args), self._id))

    def _arguments_end(self, text: str) -> int | None:
        """Where the streaming arguments end in ``text`` (their scan state carries over)."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            elif ch == "<":  # no JSON has it outside a string: a tag, the arguments broke off
                return i
        return None

    def _step(self) -> tuple[list[StreamEvent], bool]:
        """Events from the buffer in the current mode; ``False`` when more text is needed."""
        buf = self._buf
        if self._mode == "text":
            start = buf.find(TOOL_CALL_OPEN)
            if start >= 0:
                self._buf, self._mode = buf[start + len(TOOL_CALL_OPEN) :], "head"
                return self._content(buf[:start]), True
            cut = len(buf) - _held_prefix(buf, TOOL_CALL_OPEN)
            self._buf = buf[cut:]
            return self._content(buf[:cut]), False
        if self._mode == "head":
            known, name, at = _call_head(buf)
            if known is None:
                return [], False
            if not known:
                self._mode = "whole"
                return [], True
            self._buf, self._mode = buf[at:], "args"
            return self._start_call(name), True
        if self._mode == "whole":
            call, end = _block(buf, 0)
            if call is None:
                return [], False  # not a call (yet): a later closing tag may still complete it
            assert end is not None
            self._buf, self._mode = buf[end:], "text"
            return self._whole_call(call), True
        if self._mode == "args":
            end = self._arguments_end(buf)
            piece = buf if end is None else buf[:end]
            self._args.append(piece)
            events = (
                []
                if self._muted or not piece
                else [StreamEvent(index=self.calls - 1, arguments=piece)]
            )
            if end is None:
                self._buf = ""
                return events, False
            self._end_call()
            self._buf, self._mode = buf[end:], "tail"
            return events, True
        # tail: what follows the arguments in the block is dropped
        close, opens = buf.find(TOOL_CALL_CLOSE), buf.find(TOOL_CALL_OPEN)
        if close >= 0 and (opens < 0 or close < opens):
            self._buf, self._mode = buf[close + len(TOOL_CALL_CLOSE) :], "text"
            return [], True
        if opens >= 0:  # a new block before this one closed
            self._buf, self._mode = buf[opens + len(TOOL_CALL_OPEN) :], "head"
            return [], True
        held = max(_held_prefix(buf, TOOL_CALL_CLOSE), _held_prefix(buf, TOOL_CALL_OPEN))
        self._buf = buf[len(buf) - held :]
        return [], False

    def feed(self, text: str) -> list[StreamEvent]:
        """Events for the next piece of text."""
        self._buf += text
        events: list[StreamEvent] = []
        more = True
        while more:
            step, more = self._step()
            events += step
        return _merged(events)

    def finish(self) -> list[StreamEvent]:
        """Events for what is still held when the answer ends."""
        mode, rest = self._mode, self._buf
        self._mode, self._buf = "text", ""
        events: list[StreamEvent] = []
        if mode == "args":
            self._end_call()
        elif mode in ("head", "whole"):
            # Not a call: the block is text, up to its first closing tag if it has one.
            at = rest.find(TOOL_CALL_CLOSE)
            if at < 0:
                events += self._content(TOOL_CALL_OPEN + rest)
            else:
                end = at + len(TOOL_CALL_CLOSE)
                events += self._content(TOOL_CALL_OPEN + rest[:end])
                events += self.feed(rest[end:])
                return _merged(events + self.finish())
        elif mode == "text":
            events += self._content(rest)
        if self._pending_ws and not self.calls:
            events.append(StreamEvent(content=self._pending_ws))
        self._pending_ws = ""
        return _merged(events)


def _merged(events: list[StreamEvent]) -> list[StreamEvent]:
    """``events`` with a call's consecutive argument pieces joined to the event before."""
    out: list[StreamEvent] = []
    for e in events:
        prev = out[-1] if out else None
        if (
            prev is not None
            and e.content is None
            and e.id is None
            and prev.content is None
            and prev.index == e.index
        ):
            prev.arguments = (prev.arguments or "") + (e.arguments or "")
        else:
            out.append(e)
    return out


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """``text``'s content outside the calls (``None`` if empty) and its Hermes calls.

    Text without a call comes back unchanged; with calls, the content around
    them is stripped of surrounding whitespace. Calls past ``max_calls`` are
    dropped. This is :class:`ToolCallStream` fed the whole text, so a streamed
    answer's calls and content are the same.
    """
    stream = ToolCallStream(max_calls)
    events = stream.feed(text) + stream.finish()
    if not stream.tool_calls:
        return (text or None), []
    content = "".join(e.content or "" for e in events).strip()
    return (content or None), stream.tool_calls
