"""ASGI middleware that runs before any body is parsed: the request size limit, the read deadline and the tenant
(API key).

All answer in the OpenAI error shape. The size limit rejects on ``Content-Length`` at once and also counts
the bytes of bodies sent without one (chunked), so no request can make the server buffer more than the limit.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import CodedHTTPException, error_body
from .tenants import TenantTable

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("edgespec_request_id", default="-")
# A client's x-request-id is echoed and logged only when it is a short token of printable ASCII (no log forging).
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")


async def _send_error(send: Send, status: int, message: str, code: str,
                      headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class BodyLimitMiddleware:
    """413 for bodies above ``max_bytes`` (declared or actually sent)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _send_error(send, 400, "invalid Content-Length header", "invalid_header")
                return
            if size > self.max_bytes:
                await _send_error(send, 413, f"request body of {size} bytes exceeds the limit of "
                                  f"{self.max_bytes} bytes", "body_too_large")
                return
        limit = self.max_bytes
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise CodedHTTPException(413, f"request body exceeds the limit of {limit} bytes",
                                             "body_too_large", headers={"Connection": "close"})
            return message

        await self.app(scope, limited, send)


class ReadTimeoutMiddleware:
    """Bounds the time a client may take to send its body: ``read_timeout_s`` from the end of the headers to the
    last body byte, else ``408`` (code ``request_timeout``). A body still arriving when the server starts draining
    is answered ``503`` (code ``draining``) at once, so a slow sender never holds a shutdown. Once the body is in,
    ``receive`` is passed through untouched (the app waits on it for a client's disconnect)."""

    def __init__(self, app: ASGIApp, read_timeout_s: float, draining: asyncio.Event | None = None) -> None:
        self.app = app
        self.read_timeout_s = read_timeout_s
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        body_done = False

        async def timed() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            waiters: set[asyncio.Future] = {asyncio.ensure_future(receive())}
            drain = None
            if self.draining is not None:
                drain = asyncio.ensure_future(self.draining.wait())
                waiters.add(drain)
            done, _ = await asyncio.wait(waiters, timeout=max(0.0, deadline - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            first = next(iter(waiters - {drain}))
            if drain is not None:
                drain.cancel()
            if first not in done:
                first.cancel()
                if drain is not None and drain in done:
                    raise CodedHTTPException(503, "the server is shutting down", "draining",
                                             headers={"Retry-After": "5", "Connection": "close"})
                raise CodedHTTPException(408, f"request body not received within {self.read_timeout_s:g}s",
                                         "request_timeout", headers={"Connection": "close"})
            message = first.result()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed, send)


def bearer_token(scope: Scope) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, None without one."""
    scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def scope_tenant(scope: Scope) -> str:
    """The tenant :class:`TenantMiddleware` found for this request ("" outside ``/v1``)."""
    return str(scope.get("state", {}).get(TENANT_STATE, ""))


TENANT_STATE = "edgespec_tenant"


class TenantMiddleware:
    """Under ``/v1`` finds the request's tenant (:class:`serving.tenants.TenantTable`) from its bearer token and puts
    it in the request state; with keys configured an unknown or missing key is 401. Others (health, metrics) stay
    open."""

    def __init__(self, app: ASGIApp, tenants: TenantTable, prefix: str = "/v1") -> None:
        self.app = app
        self.tenants = tenants
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] == "http" and (path == self.prefix or path.startswith(self.prefix + "/")):
            tenant = self.tenants.tenant_of(bearer_token(scope))
            if tenant is None:
                await _send_error(send, 401, "missing or invalid API key (Authorization: Bearer <key>)",
                                  "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return
            scope.setdefault("state", {})[TENANT_STATE] = tenant
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Gives every HTTP request an id (the client's ``x-request-id`` when it is a sane token, else a new one): set
    in :data:`request_id` for log lines and echoed in the ``x-request-id`` response header.

    Also counts every answer with a status >= 400 through ``on_failure(reason)``, whatever layer produced it (body
    limit, API key, validation, queue full, engine failure): the reason is the error body's ``code`` or
    ``http_<status>``. Outermost, so nothing escapes it."""

    def __init__(self, app: ASGIApp, on_failure: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.on_failure = on_failure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        rid = given if given is not None and _CLIENT_ID.match(given) else uuid.uuid4().hex
        token = request_id.set(rid)
        status = 0
        body = b""

        async def wrapped(message: Message) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < 4096:
                body += message.get("body", b"")
            await send(message)

        try:
            await self.app(scope, receive, wrapped)
        except BaseException:
            if status == 0 and self.on_failure is not None:   # Starlette's outer handler answers 500
                self.on_failure("internal_error")
            raise
        finally:
            request_id.reset(token)
        if status >= 400 and self.on_failure is not None:
            self.on_failure(_error_code(body) or f"http_{status}")


def _error_code(body: bytes) -> str | None:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) and len(code) <= 64 else None
