"""envd's PTY and input streams on a sandvisor sandbox (:mod:`supervisor.serve.e2b_envd`
holds the processes): ``Start`` with ``pty`` opens the supervisor's Exec with a TTY of
that size (its output is the ``pty`` data of envd's events), ``SendInput`` with ``pty``
writes to the terminal, ``Update`` resizes it, and ``StreamInput`` (a Connect client
stream: a ``start`` naming the process, then ``data`` messages, in order) feeds a
process's stdin or terminal as the messages arrive.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import trio

from supervisor.serve.e2b_http import (
    CONNECT_STREAM_JSON,
    END_STREAM,
    Exchange,
    RpcError,
    envelope,
    rpc_error,
    stream_end,
    unary_error,
    unary_request,
)
from supervisor.wire import errors

MAX_MESSAGE = 4 << 20
MAX_COLS_ROWS = 4096


def pty_size(req: dict[str, Any]) -> tuple[int, int] | None:
    """A Start or Update request's terminal size as (cols, rows); None: no PTY."""
    pty = req.get("pty")
    if not isinstance(pty, dict):
        return None
    size = pty.get("size") or {}
    try:
        cols, rows = int(size.get("cols") or 80), int(size.get("rows") or 24)
    except (TypeError, ValueError):
        raise RpcError("invalid_argument", "pty.size: cols and rows are numbers") from None
    if not (0 < cols <= MAX_COLS_ROWS and 0 < rows <= MAX_COLS_ROWS):
        raise RpcError("invalid_argument", f"pty.size: cols and rows between 1 and {MAX_COLS_ROWS}")
    return cols, rows


def input_bytes(value: Any) -> tuple[str, bytes]:
    """A ProcessInput (``{"stdin": b64}`` or ``{"pty": b64}``) as (kind, bytes)."""
    if not isinstance(value, dict):
        raise RpcError("invalid_argument", "input: stdin or pty")
    for kind in ("stdin", "pty"):
        if kind in value:
            try:
                return kind, base64.b64decode(str(value[kind]), validate=True)
            except binascii.Error:
                raise RpcError("invalid_argument", "bytes: base64") from None
    raise RpcError("invalid_argument", "input: stdin or pty")


async def update(ex: Exchange, procs: Any, target: Any) -> None:
    """``Update``: resize a process's terminal."""
    try:
        req = await unary_request(ex)
        proc = procs.get(target.uid, req.get("process"))
        size = pty_size(req)
        if size is not None:
            if not proc.tty:
                raise RpcError("failed_precondition", "the process has no PTY")
            if proc.execd is not None:
                await proc.execd.resize(*size)
    except RpcError as err:
        await unary_error(ex, err)
        return
    except errors.SandboxError as exc:
        await unary_error(ex, rpc_error(exc))
        return
    await ex.send_json({})


async def _messages(ex: Exchange) -> AsyncGenerator[dict[str, Any], None]:
    """The enveloped messages of a client stream, as they arrive."""
    buf = bytearray()
    async with aclosing(ex.chunks()) as chunks:
        async for piece in chunks:
            buf += piece
            while len(buf) >= 5:
                flags, size = struct.unpack(">BI", buf[:5])
                if size > MAX_MESSAGE:
                    raise RpcError("resource_exhausted", f"a message over {MAX_MESSAGE} bytes")
                if len(buf) < 5 + size:
                    break
                raw, buf = bytes(buf[5 : 5 + size]), buf[5 + size :]
                if flags & 0x01:
                    raise RpcError("unimplemented", "compressed messages are not supported")
                if flags & END_STREAM:
                    return
                try:
                    value = json.loads(raw) if raw.strip() else {}
                except (ValueError, UnicodeDecodeError):
                    raise RpcError("invalid_argument", "the message is not JSON") from None
                if not isinstance(value, dict):
                    raise RpcError("invalid_argument", "the message is not a JSON object")
                yield value
    if buf:
        raise RpcError("invalid_argument", "a truncated message")


async def stream_input(ex: Exchange, procs: Any, target: Any) -> None:
    """``StreamInput``: answered once the client ends its stream (``{}``), or with
    the first error."""
    try:
        proc = None
        async with aclosing(_messages(ex)) as messages:
            async for msg in messages:
                if "start" in msg:
                    proc = procs.get(target.uid, (msg.get("start") or {}).get("process"))
                elif "data" in msg:
                    if proc is None:
                        raise RpcError("invalid_argument", "the stream must start with a start message")
                    kind, data = input_bytes((msg.get("data") or {}).get("input"))
                    if kind == "pty" and not proc.tty:
                        raise RpcError("failed_precondition", "the process has no PTY")
                    if proc.execd is not None and data:
                        await proc.execd.send(data)
                # (keepalive messages need no answer)
        if proc is None:
            raise RpcError("invalid_argument", "no start message")
    except RpcError as err:
        await stream_end(ex, err)
        return
    except errors.SandboxError as exc:
        await stream_end(ex, rpc_error(exc))
        return
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        await stream_end(ex, RpcError("not_found", "the process has ended"))
        return
    await ex.start(200, CONNECT_STREAM_JSON)
    await ex.write(envelope({}))
    await stream_end(ex)
