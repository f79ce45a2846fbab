"""Errors as the OpenAI API answers them: the body, the status, and the handlers that make them.

:class:`APIError` is what a route raises; the handlers installed by
:func:`install_error_handlers` turn it, a request body pydantic refused, a
:class:`~kvtier.errors.BadRequestError`, an unknown route and any unexpected
exception into OpenAI's error body (``{"error": {"message", "type",
"param", "code"}}``), never a bare traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.errors import BadRequestError
from kvtier.server.protocol import error_body
from kvtier.server.streaming import json_bytes

log = logging.getLogger("kvtier.server")


class APIError(Exception):
    """An error answered with OpenAI's error body and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def check_model(name: str | None, served: str) -> None:
    """Refuse a request naming a model other than the one served (``None``: not named)."""
    if name is not None and name != served:
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise APIError(
            400,
            f"The model '{shown}' does not exist: this server serves '{served}'",
            param="model",
            code="model_not_found",
        )


def check_chars(count: int, max_chars: int, max_model_len: int, param: str) -> None:
    """Refuse a prompt of more characters than any prompt fitting the context can have."""
    if count > max_chars:
        raise APIError(
            400,
            f"the prompt has {count:,} characters; this server accepts at most "
            f"{max_chars:,} (no prompt that long fits the model's context of "
            f"{max_model_len} tokens): shorten it",
            param=param,
            code="context_length_exceeded",
        )


class SafeJSONResponse(JSONResponse):
    """A JSON response that never fails to render (lone surrogates are escaped)."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def error_response(exc: APIError) -> JSONResponse:
    return SafeJSONResponse(
        error_body(exc.message, type=exc.type, param=exc.param, code=exc.code),
        status_code=exc.status,
        headers=exc.headers,
    )


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _is_union_tag(part: str) -> bool:
    """Pydantic names the union member in an error's location: ``str``, ``list[int]``, ..."""
    return part in _TYPE_TAGS or "[" in part or part.startswith(("function-", "constrained-"))


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p != "body" and not (isinstance(p, str) and _is_union_tag(p))]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += f".{p}" if out else str(p)
    return out or None


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """A one-line message and the offending parameter for a list of pydantic errors."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        pos = loc[1] if len(loc) > 1 else "?"
        return f"the request body is not valid JSON ({detail} at position {pos})", None
    param = _loc_to_param(loc)
    msg = str(first.get("msg", "invalid value"))
    if param is None:
        if first.get("type") == "missing":
            return "the request body is missing: send a JSON object", None
        return f"invalid request body: {msg}", None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"invalid value for '{param}': {msg}{more}", param


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error ``app`` meets with OpenAI's error body (see the module docstring)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(BadRequestError)
    async def _bad_request(request: Request, exc: BadRequestError) -> JSONResponse:
        return error_response(APIError(400, str(exc), param=exc.param))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error(
            "%s %s failed: %s", request.method, request.url.path, type(exc).__name__, exc_info=exc
        )
        return SafeJSONResponse(
            error_body(f"internal server error: {type(exc).__name__}: {exc}", type="server_error"),
            status_code=500,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = f"{exc.detail} ({request.method} {request.url.path})"
        return SafeJSONResponse(
            error_body(message),
            status_code=exc.status_code,
            headers=exc.headers,
        )
