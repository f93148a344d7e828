"""Client side of the ``sandbox.v1`` Unix-socket protocol.

:func:`connect` gives an :class:`AsyncConnection`: unary calls, server streams and
bidirectional streams multiplexed on one socket, failures raised as
:class:`~supervisor.protocol.ApiError` with the seed's codes. (The user-facing SDK,
``Sandbox``/``AsyncSandbox``, is built on this.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from actors._groups import collapse_single
from supervisor import protocol as W
from supervisor.config import default_socket
from supervisor.protocol import ApiError


class CallStream:
    """One call's incoming items; ``send``/``half_close`` for client-streaming calls."""

    def __init__(self, conn: AsyncConnection, id: int) -> None:
        self.conn = conn
        self.id = id
        self.send_ch, self.recv_ch = trio.open_memory_channel[W.Envelope](256)
        self.reply: dict[str, Any] | None = None
        self.done = False

    async def send(self, body: dict[str, Any]) -> None:
        await self.conn._send(W.Send(self.id, body))

    async def half_close(self) -> None:
        await self.conn._send(W.HalfClose(self.id))

    async def cancel(self) -> None:
        if not self.done:
            await self.conn._send(W.Cancel(self.id))

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.done:
            raise StopAsyncIteration
        try:
            msg = await self.recv_ch.receive()
        except trio.EndOfChannel:
            self.done = True
            raise ApiError(W.UNAVAILABLE, "connection to the supervisor lost") from None
        if isinstance(msg, W.Item):
            return msg.body
        self.done = True
        if isinstance(msg, W.Fail):
            raise ApiError(msg.code, msg.message)
        if isinstance(msg, W.Reply):
            self.reply = msg.body
        raise StopAsyncIteration

    async def result(self) -> dict[str, Any]:
        """For calls answered by one Reply (unary, client-streaming)."""
        async for _ in self:
            pass
        return self.reply or {}


class AsyncConnection:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.lock = trio.Lock()
        self.calls: dict[int, CallStream] = {}
        self.next_id = 1
        self.reader = W.FrameReader()
        self.closed = False

    async def _send(self, msg: W.Envelope) -> None:
        async with self.lock:
            await self.stream.send_all(W.encode(msg))

    async def _read_one(self) -> W.Envelope | None:
        while True:
            body = self.reader.next()
            if body is not None:
                return W.decode(body)
            data = await self.stream.receive_some(1 << 16)
            if not data:
                return None
            self.reader.feed(data)

    async def _hello(self) -> None:
        await self._send(W.ClientHello(W.PROTOCOL_VERSION, "sandvisor-client"))
        msg = await self._read_one()
        if isinstance(msg, W.Fail):
            raise ApiError(msg.code, msg.message)
        if not isinstance(msg, W.ServerHello):
            raise ApiError(W.UNAVAILABLE, "the supervisor did not answer the hello")

    async def _reader(self) -> None:
        try:
            while True:
                msg = await self._read_one()
                if msg is None:
                    break
                if isinstance(msg, W.Fail) and msg.id == 0:
                    break
                call = self.calls.get(getattr(msg, "id", -1))
                if call is None:
                    continue
                await call.send_ch.send(msg)  # a slow consumer holds back this connection
                if not isinstance(msg, W.Item):
                    self.calls.pop(call.id, None)
                    call.send_ch.close()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.closed = True
            for call in list(self.calls.values()):
                call.send_ch.close()
            self.calls.clear()

    @asynccontextmanager
    async def open_call(self, method: str, body: dict[str, Any] | None = None) -> AsyncIterator[CallStream]:
        if self.closed:
            raise ApiError(W.UNAVAILABLE, "connection to the supervisor lost")
        call = CallStream(self, self.next_id)
        self.next_id += 1
        self.calls[call.id] = call
        await self._send(W.Call(call.id, method, body or {}))
        try:
            yield call
        finally:
            if not call.done and not self.closed:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await call.cancel()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            self.calls.pop(call.id, None)

    async def call(self, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        async with self.open_call(method, body) as c:
            return await c.result()

    async def collect(self, method: str, body: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """A server stream collected to the end (for short streams)."""
        async with self.open_call(method, body) as c:
            return [item async for item in c]


@asynccontextmanager
async def connect(path: Path | str | None = None) -> AsyncIterator[AsyncConnection]:
    sock_path = str(path or default_socket())
    try:
        stream = await trio.open_unix_socket(sock_path)
    except OSError as exc:
        raise ApiError(W.UNAVAILABLE, f"cannot reach the supervisor at {sock_path}: {exc.strerror}") from None
    conn = AsyncConnection(stream)
    with collapse_single():
        async with stream, trio.open_nursery() as nursery:
            await conn._hello()
            nursery.start_soon(conn._reader)
            try:
                yield conn
            finally:
                nursery.cancel_scope.cancel()
