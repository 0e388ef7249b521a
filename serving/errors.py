"""OpenAI-shaped errors: every failure leaves the server as ``{"error": {message, type, param, code}}``.

Handlers registered by :func:`install_error_handlers` cover errors raised on purpose (:class:`APIError`),
Starlette's own HTTP errors (404 unknown route, 405 wrong method, 413 from the body limit), request validation
(422, or 400 when the body is not JSON at all) and anything unexpected (500, logged with its traceback).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("edgespec.serving")

# OpenAI's error "type" per status class.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII text as is, falling back to ``\\uXXXX`` escapes when the content holds text that is not
    valid Unicode (a lone surrogate echoed from a request): the plain JSONResponse raises while encoding, after the
    status line is decided, and the client sees a reset connection instead of an answer."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


_SURROGATE = re.compile("[\ud800-\udfff]")


def find_invalid_text(value: Any, path: str = "") -> str | None:
    """Where in a decoded JSON value a string holds a lone surrogate (``"\\ud800"`` is valid JSON but no text: it
    cannot be encoded to UTF-8 for the tokenizer), as ``messages[0].content``; None when all text is valid."""
    if isinstance(value, str):
        return path or "body" if _SURROGATE.search(value) else None
    if isinstance(value, Mapping):
        for k, v in value.items():
            key = str(k)
            if _SURROGATE.search(key):
                return path or "body"
            found = find_invalid_text(v, f"{path}.{key}" if path else key)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = find_invalid_text(v, f"{path}[{i}]")
            if found:
                return found
    return None


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str = Field(examples=["invalid_request_error"])
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer: ``{"error": {message, type, param, code}}``."""

    error: ErrorDetail


_DESCRIPTIONS = {
    400: "invalid request (bad values, invalid JSON or Unicode, prompt too long, unsupported field)",
    401: "missing or wrong API key (Authorization: Bearer)",
    404: "unknown model",
    408: "request headers or body not received within read_timeout_s (the connection is closed)",
    413: "request body too large",
    422: "request body does not match the schema",
    429: "the engine queue is full (Retry-After)",
    500: "internal error",
    503: "model loading, failed or server draining (Retry-After)",
    504: "timed out waiting for the engine",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the given error statuses, all with :class:`ErrorResponse` bodies."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS.get(s, HTTPStatus(s).phrase)} for s in statuses}


def error_type(status: int) -> str:
    """The OpenAI error ``type`` for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response (also sent as an SSE event when a stream fails midway)."""
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": code}}


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI error body (raise it from any handler)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return SafeJSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> SafeJSONResponse:
    return APIError(status, message, param=param, code=code, headers=headers).response()


# Loc entries pydantic adds for the branches of a union ("str", "list[str]", "TextFormat", "function-after[..]").
_UNION_TAG = re.compile(r"^(str|int|float|bool|bytes|none|list\[.*\]|dict\[.*\]|function-.*|[A-Z]\w*)$")
# Plain "wrong type" errors: when a union has other complaints, those say more.
_TYPE_ERRORS = frozenset({"string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type",
                          "model_type", "model_attributes_type", "int_parsing", "float_parsing", "bool_parsing",
                          "none_required"})


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"`` (union branch tags dropped)."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")
             and not (isinstance(p, str) and _UNION_TAG.match(p))]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or None


def _validation_message(errors: list[Mapping[str, Any]]) -> tuple[str, str | None]:
    first = next((e for e in errors if e.get("type") not in _TYPE_ERRORS), errors[0])
    param = _loc_to_param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text, param


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


class CodedHTTPException(HTTPException):
    """An HTTP error raised where only an HTTPException passes through (a middleware's ``receive``), with the
    OpenAI error ``code`` its answer carries."""

    def __init__(self, status: int, message: str, code: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(status, message, headers=dict(headers) if headers else None)
        self.code = code


# Codes for HTTP errors raised by Starlette/FastAPI themselves (every 4xx carries a code, never null).
_HTTP_CODES = {400: "invalid_request", 408: "request_timeout", 413: "body_too_large",
               415: "unsupported_media_type", 503: "unavailable"}
# FastAPI's answer when reading or decoding the body fails for a reason other than a JSON syntax error
# (invalid UTF-8, JSON nested deeper than the parser's recursion limit).
_BODY_PARSE = "There was an error parsing the body"


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    detail = exc.detail if isinstance(exc.detail, str) else None
    if status == 404:
        message, code = f"no route {request.method} {request.url.path}", "unknown_route"
    elif status == 405:
        message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    elif status == 400 and detail == _BODY_PARSE:
        message = "request body is not valid JSON (invalid UTF-8, or nested too deep)"
        code = "invalid_json"
    else:
        message = detail or HTTPStatus(status).phrase
        code = getattr(exc, "code", None) or _HTTP_CODES.get(status, f"http_{status}")
    return error_response(status, message, code=code, headers=getattr(exc, "headers", None))


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next((e.get("ctx", {}).get("error") for e in errors if e.get("type") == "json_invalid"),
                      None)
        return error_response(400, f"request body is not valid JSON ({detail})" if detail
                              else "request body is not valid JSON", code="invalid_json")
    if not errors:
        return error_response(422, "invalid request", code="validation_error")
    message, param = _validation_message(errors)
    return error_response(422, message, param=param, code="validation_error")


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path of ``app`` through the OpenAI error shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
