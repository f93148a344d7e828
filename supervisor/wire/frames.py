"""The framed stream of the client protocol: ``u32be length || msgpack map``, both ends.

One module for the byte layer, in three parts; none imports an event loop or a
converter at import time, so a one-shot CLI command pays only for what it uses
(measured: ``import supervisor.wire.frames`` ~6 ms, mostly socket and msgpack; trio
~100 ms, :mod:`supervisor.wire.protocol` and its cattrs converter ~60 ms, and even
``typing`` ~2 ms, which is why it is imported for the type checker only)::

    FrameReader        I/O-free splitter: feed bytes, take whole frame bodies; a
                       header over the cap is RESOURCE_EXHAUSTED before its body
    FramedStream       the protocol's envelopes over a Trio stream (the server's
                       connections and the async SDK): receive() one envelope or
                       None at EOF, send() from any task under a lock
    BlockingConnection a plain blocking socket speaking the protocol with envelopes
                       as plain maps (pack/unpack): hello, calls multiplexed by id
                       (unary, streaming both ways), a deadline on a read (the CLI's
                       one-shot commands and the blocking SDK, supervisor.client.sdk.sync)

An envelope on the wire is a map tagged by ``"t"`` (see :mod:`supervisor.wire.protocol`,
whose cattrs converter makes the same maps from its attrs classes)::

    client                                   server
      | {"t":"hello","version":1,"client":..} |
      | <------- {"t":"hello_ok","version":1,"server":..}
      | {"t":"call","id":1,"method":"Run","body":{..}}
      | <------- {"t":"item","id":1,"body":{..}}   (server streams)
      | <------- {"t":"end","id":1} | {"t":"reply","id":1,"body":{..}} | {"t":"fail","id":1,"code":..,"message":..}
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections import deque
from collections.abc import Iterator, Mapping

import msgpack

from supervisor.wire.errors import (
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    ApiError,
    error_for,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy reads the name)
if TYPE_CHECKING:
    from typing import Any

    import trio

    from supervisor.wire.protocol import Envelope

PROTOCOL_VERSION = 1
MAX_FRAME = 4 << 20
RECEIVE_SIZE = 1 << 16
HDR = struct.Struct(">I")

# envelope tags (protocol.py maps its classes to these)
HELLO, HELLO_OK, CALL, SEND, HALF_CLOSE, CANCEL = "hello", "hello_ok", "call", "send", "half_close", "cancel"
REPLY, ITEM, END, FAIL = "reply", "item", "end", "fail"


class FrameReader:
    """I/O-free frame splitter for the client protocol (the same format as the guest's)."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._max = max_frame

    def feed(self, data: bytes | bytearray) -> None:
        self._buf += data

    def next(self) -> bytes | None:
        """One complete frame body, or None until more bytes arrive."""
        if len(self._buf) < 4:
            return None
        (n,) = HDR.unpack_from(self._buf)
        if n > self._max:
            raise ApiError(RESOURCE_EXHAUSTED, f"frame of {n} bytes exceeds {self._max}")
        if len(self._buf) < 4 + n:
            return None
        body = bytes(self._buf[4 : 4 + n])
        del self._buf[: 4 + n]
        return body

    @property
    def buffered(self) -> int:
        return len(self._buf)


def frame(body: bytes, max_frame: int = MAX_FRAME) -> bytes:
    """A frame of ``body``; a body over the cap is RESOURCE_EXHAUSTED (nothing is sent)."""
    if len(body) > max_frame:
        raise ApiError(RESOURCE_EXHAUSTED, f"message of {len(body)} bytes exceeds {max_frame}")
    return HDR.pack(len(body)) + body


# --- the plain-map codec (no converter) ------------------------------------------------------
def pack(envelope: Mapping[str, Any]) -> bytes:
    """An envelope map as a frame (msgpack with bin type: what the converter writes)."""
    return frame(msgpack.packb(envelope))


def unpack(body: bytes) -> dict[str, Any]:
    """A frame body as an envelope map: a map with a string tag ``t``, or INVALID_ARGUMENT."""
    try:
        obj = msgpack.unpackb(body)
    except Exception as exc:  # msgpack's own zoo
        raise ApiError(INVALID_ARGUMENT, f"malformed message: {type(exc).__name__}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise ApiError(INVALID_ARGUMENT, "malformed message: not a tagged map")
    return obj


# --- Trio ------------------------------------------------------------------------------------
class FramedStream:
    """The client protocol's envelopes over a Trio stream, one frame each, both ends.

    Envelopes are the typed classes of :mod:`supervisor.wire.protocol`, written and read by
    its converter (:func:`~supervisor.wire.protocol.encode`, :func:`~supervisor.wire.protocol.decode`).
    One task receives (the connection's reader); any task may send: a frame is
    written whole under a lock, so concurrent senders never interleave.
    """

    def __init__(self, stream: trio.abc.Stream, *, max_frame: int = MAX_FRAME) -> None:
        # here, not at the top: the one-shot CLI imports this module without either
        import trio

        from supervisor.wire import protocol

        self.stream = stream
        self._encode = protocol.encode
        self._decode = protocol.decode
        self._reader = FrameReader(max_frame)
        self._lock = trio.Lock()
        self.closed = False

    async def receive(self) -> Envelope | None:
        """The next message, or None at the end of the stream (a frame cut short by
        EOF counts as the end). ApiError: RESOURCE_EXHAUSTED for a frame over the cap
        (from its header, before its body is awaited), INVALID_ARGUMENT for a body
        that does not decode. The stream's own errors (BrokenResourceError, ...) pass."""
        while True:
            body = self._reader.next()
            if body is not None:
                return self._decode(body)
            data = await self.stream.receive_some(RECEIVE_SIZE)
            if not data:
                return None
            self._reader.feed(data)

    async def send(self, msg: Envelope) -> None:
        """Encode (before taking the lock: a message over the cap raises ApiError and
        sends nothing), then write the frame whole. ClosedResourceError once closed."""
        import trio

        data = self._encode(msg)
        async with self._lock:
            if self.closed:
                raise trio.ClosedResourceError
            await self.stream.send_all(data)

    async def aclose(self) -> None:
        """Close the stream (shielded: this runs in cleanup, often under cancellation);
        later sends raise ClosedResourceError. Idempotent."""
        import trio

        self.closed = True
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


# --- blocking --------------------------------------------------------------------------------
class BlockingConnection:
    """The client protocol over a plain blocking Unix socket, envelopes as maps.

    For one-shot commands and the blocking SDK: no event loop, no thread, no converter
    (bodies are the wire's maps, as ``AsyncConnection.call`` gives them). Calls are
    multiplexed by id: :meth:`start` one, read its envelopes with :meth:`next` (those
    of the other open calls wait in their queues), :meth:`send_body`,
    :meth:`half_close`, :meth:`cancel`. Leaving a :meth:`stream` early cancels its
    call. Errors are the SDK's (:func:`supervisor.wire.errors.error_for`).
    The hello is pipelined: ``open`` sends it, the first call goes right behind it,
    and the server's answer to the hello is read before the call's (a refused hello
    raises from that call); a one-shot command waits one round trip, not two.

        with BlockingConnection.open(path) as c:
            info = c.call("Inspect", {"id": "web"})
            for item in c.stream("Run", {"id": "web", "cmd": ["true"]}):
                ...
    """

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME) -> None:
        self.sock = sock
        self._reader = FrameReader(max_frame)
        self._next_id = 1
        self._greeted = False
        self._queues: dict[int, deque[dict[str, Any]]] = {}  # the open calls' unread envelopes

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str] | None = None,
        client: str = "sandvisor-cli",
        *,
        act_as: str = "",
        act_as_admin: bool = False,
    ) -> BlockingConnection:
        if path is None:
            from supervisor.wire.config import UnsafeRuntimeDir, check_runtime_dir, default_socket

            path = default_socket()
            try:
                check_runtime_dir(path)
            except UnsafeRuntimeDir as exc:
                raise error_for(FAILED_PRECONDITION, str(exc)) from None
        sock_path = str(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(sock_path)
        except OSError as exc:
            sock.close()
            raise error_for(UNAVAILABLE, f"cannot reach the supervisor at {sock_path}: {exc.strerror}") from None
        conn = cls(sock)
        try:
            hello: dict[str, Any] = {"t": HELLO, "version": PROTOCOL_VERSION, "client": client}
            if act_as or act_as_admin:
                hello.update(act_as=act_as, act_as_admin=act_as_admin)
            conn.send(hello)
        except OSError:
            conn.close()
            raise error_for(UNAVAILABLE, "connection to the supervisor lost") from None
        return conn

    def __enter__(self) -> BlockingConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, envelope: Mapping[str, Any]) -> None:
        self.sock.sendall(pack(envelope))

    def receive(self, deadline: float | None = None) -> dict[str, Any] | None:
        """The next envelope, or None when the supervisor hung up; TimeoutError when
        ``deadline`` (time.monotonic) passes first (a frame cut short stays buffered)."""
        while True:
            body = self._reader.next()
            if body is not None:
                return unpack(body)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
            try:
                data = self.sock.recv(RECEIVE_SIZE)
            except ConnectionError:
                return None
            finally:
                if deadline is not None:
                    self.sock.settimeout(None)
            if not data:
                return None
            self._reader.feed(data)

    def _greeting(self) -> None:
        """The server's answer to the hello (the first envelope it sends)."""
        if self._greeted:
            return
        msg = self.receive()
        if msg is not None and msg["t"] == FAIL:
            raise error_for(str(msg.get("code")), str(msg.get("message")))
        if msg is None or msg["t"] != HELLO_OK:
            raise ApiError(UNAVAILABLE, "the supervisor did not answer the hello")
        self._greeted = True

    def _send_or_lost(self, envelope: Mapping[str, Any]) -> None:
        try:
            self.send(envelope)
        except OSError:
            self._greeting()  # a refused hello says why the server hung up
            raise error_for(UNAVAILABLE, "connection to the supervisor lost") from None

    def start(self, method: str, body: Mapping[str, Any] | None = None) -> int:
        """Open a call; its id."""
        id = self._next_id
        self._next_id += 1
        self._queues[id] = deque()
        self._send_or_lost({"t": CALL, "id": id, "method": method, "body": dict(body or {})})
        return id

    def send_body(self, id: int, body: Mapping[str, Any]) -> None:
        """A message of a client-streaming call."""
        self._send_or_lost({"t": SEND, "id": id, "body": dict(body)})

    def half_close(self, id: int) -> None:
        self._send_or_lost({"t": HALF_CLOSE, "id": id})

    def cancel(self, id: int) -> None:
        """Give up call ``id`` (its envelopes still on the way are dropped)."""
        if self._queues.pop(id, None) is not None:
            try:
                self.send({"t": CANCEL, "id": id})
            except OSError:
                pass

    def next(self, id: int, deadline: float | None = None) -> dict[str, Any]:
        """Call ``id``'s next envelope (item, or its last: end, reply or fail; after the
        last the call is forgotten). The other open calls' envelopes read meanwhile are
        queued for them. TimeoutError when ``deadline`` (time.monotonic) passes first."""
        self._greeting()
        queue = self._queues[id]
        while not queue:
            msg = self.receive(deadline)
            if msg is None:
                raise error_for(UNAVAILABLE, "connection to the supervisor lost")
            mine = self._queues.get(int(msg.get("id") or 0))
            if mine is not None:
                mine.append(msg)
            elif msg["t"] == FAIL and msg.get("id") == 0:  # the server gives up on this connection
                raise error_for(str(msg.get("code")), str(msg.get("message")))
        msg = queue.popleft()
        if msg["t"] != ITEM:
            del self._queues[id]
        return msg

    def _answers(self, id: int) -> Iterator[dict[str, Any]]:
        """Call ``id``'s envelopes up to and including its last (end, reply or fail)."""
        while True:
            msg = self.next(id)
            yield msg
            if msg["t"] != ITEM:
                return

    def call(self, method: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A unary call: its reply's body ({} for a call that ends without one)."""
        for msg in self._answers(self.start(method, body)):
            if msg["t"] == REPLY:
                return dict(msg.get("body") or {})
            if msg["t"] == FAIL:
                raise error_for(str(msg.get("code")), str(msg.get("message")))
        return {}

    def stream(self, method: str, body: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """A server stream: its items' bodies. Closing the iterator early cancels the call."""
        id = self.start(method, body)
        done = False
        try:
            for msg in self._answers(id):
                if msg["t"] == ITEM:
                    yield dict(msg.get("body") or {})
                    continue
                done = True
                if msg["t"] == FAIL:
                    raise error_for(str(msg.get("code")), str(msg.get("message")))
                return
        finally:
            if not done:
                self.cancel(id)
