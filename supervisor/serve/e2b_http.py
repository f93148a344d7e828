"""The HTTP plumbing of the E2B endpoint (:mod:`supervisor.serve.e2b_server`): one request
as an ASGI exchange (read the body, answer JSON, stream), E2B's REST error shape, and
Connect RPC's JSON codec as envd's clients speak it.

Connect (connectrpc.com/docs/protocol), the part the ``e2b`` SDK uses: a unary call is
``POST /pkg.Service/Method`` with an ``application/json`` body, answered 200 with the
JSON response, or an error status with ``{"code": "not_found", "message": ...}``; a
server stream is ``POST`` with ``application/connect+json``, the request and each
response in an envelope (1 flag byte, 4 bytes big-endian length, the JSON), ended by an
envelope with flag 0x02 holding ``{}`` or ``{"error": {...}}``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from supervisor.wire import errors

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MAX_JSON = 4 << 20  # a request body read whole (REST, unary and the stream's opening)
END_STREAM = 0x02
CONNECT_JSON = "application/json"
CONNECT_STREAM_JSON = "application/connect+json"

# sandbox.v1's codes as Connect's, and Connect's HTTP statuses (unary errors)
CONNECT_CODE = {
    errors.INVALID_ARGUMENT: "invalid_argument",
    errors.NOT_FOUND: "not_found",
    errors.ALREADY_EXISTS: "already_exists",
    errors.FAILED_PRECONDITION: "failed_precondition",
    errors.RESOURCE_EXHAUSTED: "resource_exhausted",
    errors.DEADLINE_EXCEEDED: "deadline_exceeded",
    errors.INTERNAL: "internal",
    errors.UNAVAILABLE: "unavailable",
    errors.UNIMPLEMENTED: "unimplemented",
    errors.CANCELLED: "canceled",
    errors.PERMISSION_DENIED: "permission_denied",
}
CONNECT_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "unauthenticated": 401,
}
# sandbox.v1's codes as the REST API's HTTP statuses
HTTP_STATUS = {
    errors.INVALID_ARGUMENT: 400,
    errors.NOT_FOUND: 404,
    errors.ALREADY_EXISTS: 409,
    errors.FAILED_PRECONDITION: 409,
    errors.RESOURCE_EXHAUSTED: 429,
    errors.DEADLINE_EXCEEDED: 504,
    errors.UNAVAILABLE: 503,
    errors.UNIMPLEMENTED: 501,
    errors.PERMISSION_DENIED: 403,
}


class HttpError(Exception):
    """An answer other than success: ``status`` and a message (E2B's ``{"code", "message"}``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def http_error(exc: errors.ApiError) -> HttpError:
    return HttpError(HTTP_STATUS.get(exc.code, 500), f"{exc.code}: {exc.message}")


class Exchange:
    """One HTTP request and its answer."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope, self._receive, self._send = scope, receive, send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers: dict[str, str] = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        self.started = False
        self._ended = False

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The request body as it arrives."""
        while not self._ended:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                raise HttpError(499, "client went away")
            self._ended = not msg.get("more_body", False)
            if msg.get("body"):
                yield msg["body"]

    async def disconnected(self) -> None:
        """Returns once the client has gone (after the request body was read)."""
        while True:
            if (await self._receive())["type"] == "http.disconnect":
                return

    async def body(self, limit: int = MAX_JSON) -> bytes:
        out = bytearray()
        async for piece in self.chunks():
            out += piece
            if len(out) > limit:
                raise HttpError(413, f"request body over {limit} bytes")
        return bytes(out)

    async def json(self) -> dict[str, Any]:
        raw = await self.body()
        try:
            value = json.loads(raw) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError):
            raise HttpError(400, "the body is not JSON") from None
        if not isinstance(value, dict):
            raise HttpError(400, "the body is not a JSON object")
        return value

    async def start(self, status: int, content_type: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        hdrs = [(b"content-type", content_type.encode())] + [(k.encode(), v.encode()) for k, v in headers]
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": hdrs})

    async def write(self, data: bytes, *, more: bool = True) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def respond(
        self,
        status: int,
        body: bytes = b"",
        content_type: str = "application/json",
        headers: Iterable[tuple[str, str]] = (),
    ) -> None:
        await self.start(status, content_type, headers)
        await self.write(body, more=False)

    async def send_json(self, value: Any, status: int = 200, headers: Iterable[tuple[str, str]] = ()) -> None:
        await self.respond(status, json.dumps(value).encode(), headers=headers)

    async def fail(self, status: int, message: str) -> None:
        """E2B's error body: ``{"code": <status>, "message": ...}``."""
        await self.send_json({"code": status, "message": message}, status)


# --- Connect ----------------------------------------------------------------------------------
class RpcError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def rpc_error(exc: errors.ApiError) -> RpcError:
    return RpcError(CONNECT_CODE.get(exc.code, "unknown"), exc.message)


def envelope(value: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(value).encode()
    return struct.pack(">BI", flags, len(data)) + data


async def stream_request(ex: Exchange) -> dict[str, Any]:
    """The one enveloped message opening a server stream."""
    raw = await ex.body()
    if len(raw) < 5:
        raise RpcError("invalid_argument", "no request message")
    flags, size = struct.unpack(">BI", raw[:5])
    if flags & 0x01:
        raise RpcError("unimplemented", "compressed messages are not supported")
    return _object(raw[5 : 5 + size])


async def unary_request(ex: Exchange) -> dict[str, Any]:
    if ex.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise RpcError("unimplemented", "compressed messages are not supported")
    return _object(await ex.body())


def _object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError):
        raise RpcError("invalid_argument", "the message is not JSON") from None
    if not isinstance(value, dict):
        raise RpcError("invalid_argument", "the message is not a JSON object")
    return value


async def unary_error(ex: Exchange, err: RpcError) -> None:
    body = json.dumps({"code": err.code, "message": err.message}).encode()
    await ex.respond(CONNECT_STATUS.get(err.code, 500), body)


async def stream_end(ex: Exchange, err: RpcError | None = None) -> None:
    """The end-of-stream envelope (opening the response first if nothing was sent)."""
    if not ex.started:
        await ex.start(200, CONNECT_STREAM_JSON)
    end = {} if err is None else {"error": {"code": err.code, "message": err.message}}
    await ex.write(envelope(end, END_STREAM), more=False)
