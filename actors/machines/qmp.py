"""A Trio-native QMP client: QEMU's machine protocol over its Unix socket.

QMP is line-oriented JSON: QEMU greets (``{"QMP": {...}}``), the client negotiates
with ``qmp_capabilities``, then sends ``{"execute": ..., "arguments": ..., "id": N}``
and QEMU answers each with ``{"return": ..., "id": N}`` or ``{"error": {"class",
"desc"}, "id": N}``; asynchronous ``{"event": ...}`` messages come in between.
Descriptors (``getfd``, ``add-fd``) travel as SCM_RIGHTS on the command's bytes.

Two layers, as hypercorn (and h11) split them:

* :class:`QMPProtocol`, the protocol core: no I/O. ``receive_data(bytes)`` gives the
  parsed messages (:class:`Greeting`, :class:`Reply`, :class:`Event`) and keeps the
  state (greeting, then negotiated; which command ids are outstanding);
  ``command(name, args)`` gives the id and the bytes to send. Anything QEMU could send
  (partial lines, garbage, unknown ids, lines beyond ``max_line``, nesting beyond
  Python's recursion) is a :class:`QMPProtocolError` or a valid message, nothing else
  (tests/unit/test_qmp.py fuzzes it). QEMU is not trusted (docs/security.md): a hostile one
  breaks its own connection, never the supervisor.
* :class:`QMPClient`, the Trio transport: ``await nursery.start(client.run, sock)``
  negotiates and then reads in that task; :meth:`QMPClient.execute` sends one command
  and waits for its reply under a timeout. Leaving ``run`` (EOF, a protocol error, a
  cancelled nursery) closes the socket and fails every command still waiting with
  :class:`QMPDisconnected`.

Error tree (each also the ``qemu.qmp`` error of the same meaning, so code written
against qemu.qmp's exceptions catches ours)::

    QMPError                qemu.qmp.QMPError
     +-- QMPProtocolError   qemu.qmp.error.ProtocolError: QEMU sent something that is
     |                      not QMP (the connection is dropped)
     +-- QMPDisconnected    qemu.qmp.ExecInterruptedError: no connection (never made,
     |                      closed, EOF, broken)
     +-- QMPTimeout         no reply within the command's timeout (qemu.qmp has none)
     +-- QMPCommandFailed   qemu.qmp.ExecuteError: QEMU answered with an error
                            (``error_class``, ``desc``, ``sent``, ``received``)

What comes from ``qemu.qmp`` (only its parts without I/O; its client is asyncio's):
:class:`QMPMessage` is its :class:`~qemu.qmp.message.Message` with RFC 8259's JSON
both ways (the stock codec writes and accepts ``NaN``/``Infinity`` and lets
``RecursionError``, ``ValueError`` and ``UnicodeDecodeError`` through untyped); its
models check the greeting and error answers. An incoming line is decoded to a dict, not
wrapped in a Message (half the parse cost again: benchmarks/qmp.py ``--parse``); only an
error answer becomes one, for :class:`QMPCommandFailed`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import qemu.qmp
import trio
from qemu.qmp import models as qmp_models
from qemu.qmp.error import ProtocolError
from qemu.qmp.message import DeserializationError, Message, UnexpectedTypeError

log = logging.getLogger("sandvisor.qmp")

MAX_LINE = 10 << 20  # bytes, as libvirt and qemu.qmp; the biggest answer we ask for (HMP text) is far smaller
EVENT_BUFFER = 64  # events a slow listener may lag behind before the oldest are dropped


class QMPError(qemu.qmp.QMPError):
    """Base of the QMP client's errors."""


class QMPProtocolError(QMPError, ProtocolError):
    """QEMU sent something that is not QMP."""


class QMPDisconnected(QMPError, qemu.qmp.ExecInterruptedError):
    """The connection is gone (or never came up)."""


class QMPTimeout(QMPError):
    """No reply in time."""


class QMPCommandFailed(QMPError, qemu.qmp.ExecuteError):
    """QEMU refused a command: qemu.qmp's ExecuteError (``error``, ``sent``,
    ``received``, ``error_class``) with the command's name in its text."""

    def __init__(
        self, command: str, error_response: qmp_models.ErrorResponse, sent: Message, received: Message
    ) -> None:
        super().__init__(error_response, sent, received)
        self.command = command

    @property
    def desc(self) -> str:
        return self.error.error.desc

    def __str__(self) -> str:
        return f"{self.command}: {self.desc}"


# -- messages ---------------------------------------------------------------------------
def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # (one decoder: json.loads makes one per call)


def decode_object(line: bytes) -> dict[str, Any]:
    """One JSON object (RFC 8259: no NaN/Infinity, UTF-8); DeserializationError or
    UnexpectedTypeError (qemu.qmp's) for anything else, however deep or long."""
    try:
        obj = _DECODER.decode(line.decode())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digits, NaN
        raise DeserializationError(f"not JSON: {type(exc).__name__}", line[:200]) from None
    if not isinstance(obj, dict):
        raise UnexpectedTypeError(f"a QMP message is an object, not {type(obj).__name__}", type(obj).__name__)
    return obj


class QMPMessage(Message):
    """qemu.qmp's Message with a strict codec: only RFC 8259 JSON in and out, every
    failure one of Message's own ProtocolErrors (or TypeError/ValueError on writing)."""

    @classmethod
    def _serialize(cls, value: object) -> bytes:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def _deserialize(cls, data: bytes) -> dict[str, object]:
        return decode_object(data)


@attrs.frozen
class Greeting:
    version: dict[str, Any]
    capabilities: tuple[str, ...]


@attrs.frozen
class Reply:
    """The answer to command ``id``: ``ok`` with ``value``, or an error (class, desc).
    An error also keeps qemu.qmp's view of it (``error``, the ``sent`` command and the
    ``received`` answer), outside equality."""

    id: int
    ok: bool
    value: Any = None
    error_class: str = ""
    desc: str = ""
    error: qmp_models.ErrorResponse | None = attrs.field(default=None, eq=False, repr=False)
    received: Message | None = attrs.field(default=None, eq=False, repr=False)
    sent: Message | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Event:
    name: str
    data: dict[str, Any]
    timestamp: float  # seconds since the epoch, as QEMU stamped it (0 if it did not)


Incoming = Greeting | Reply | Event


def parse_message(line: bytes) -> Incoming:
    """One QMP message from one line (without its newline)."""
    try:
        obj = decode_object(line)
    except ProtocolError as exc:
        raise QMPProtocolError(exc.error_message) from None  # (never the raw bytes into a log)
    if "QMP" in obj:
        try:  # qemu.qmp's model: QMP an object with a version object and a capabilities array
            model = qmp_models.Greeting(obj)
        except (KeyError, TypeError):
            raise QMPProtocolError("malformed greeting") from None
        version, caps = model.QMP.version, model.QMP.capabilities
        if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):  # (its Sequence takes a str)
            raise QMPProtocolError("malformed greeting")
        return Greeting(dict(version), tuple(caps))
    if "event" in obj:
        name, data, ts = obj["event"], obj.get("data", {}), obj.get("timestamp", {})
        if not isinstance(name, str) or not isinstance(data, dict) or not isinstance(ts, dict):
            raise QMPProtocolError("malformed event")
        secs, usecs = ts.get("seconds", 0), ts.get("microseconds", 0)
        if not all(type(x) in (int, float) and math.isfinite(x) for x in (secs, usecs)):
            raise QMPProtocolError("malformed event timestamp")
        return Event(name, data, float(secs) + float(usecs) / 1e6)
    if "return" in obj or "error" in obj:
        ident = obj.get("id")
        if type(ident) is not int:  # ours are ints; QEMU answers unparsable input with no id
            err = obj.get("error")
            desc = err.get("desc") if isinstance(err, dict) else None
            raise QMPProtocolError(f"a reply without one of our ids: {desc or 'no id'}"[:200])
        if "return" in obj:
            return Reply(ident, True, obj["return"])
        received = QMPMessage(obj, eager=False)
        try:  # qemu.qmp's model: error an object with string class and desc
            error = qmp_models.ErrorResponse(received)
        except (KeyError, TypeError):
            raise QMPProtocolError("malformed error reply") from None
        return Reply(
            ident, False, error_class=error.error.class_, desc=error.error.desc, error=error, received=received
        )
    raise QMPProtocolError("neither greeting, reply nor event")


def command_message(name: str, args: dict[str, Any] | None, ident: int) -> QMPMessage:
    """A command as qemu.qmp's Message, serialised now (TypeError, ValueError: not JSON)."""
    msg: dict[str, Any] = {"execute": name, "id": ident}
    if args is not None:
        msg["arguments"] = args
    return QMPMessage(msg)


def encode_command(name: str, args: dict[str, Any] | None, ident: int) -> bytes:
    return bytes(command_message(name, args, ident)) + b"\n"


class QMPProtocol:
    """QMP's client side without I/O: bytes in, messages out; commands in, bytes out.

    States: ``greeting`` (nothing may be sent but is buffered) -> ``negotiating``
    (after the greeting; :meth:`command` sends ``qmp_capabilities``) -> ``ready``
    (its reply arrived). After a :class:`QMPProtocolError` the protocol is ``broken``
    and every further call raises one."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self.state = "greeting"
        self.greeting: Greeting | None = None
        self._buf = bytearray()
        self._next_id = 1
        self.pending: dict[int, QMPMessage] = {}  # id -> the command sent
        self._abandoned: set[int] = set()  # ids whose waiter gave up; their late replies are dropped
        self._negotiation: int | None = None

    def command(self, name: str, args: dict[str, Any] | None = None) -> tuple[int, bytes]:
        """A new command: its id and its bytes. Raises QMPProtocolError on arguments
        that are not JSON (a caller's bug, reported without breaking the connection)."""
        if self.state == "broken":
            raise QMPProtocolError("the connection is broken")
        ident = self._next_id
        try:
            msg = command_message(name, args, ident)
        except (TypeError, ValueError) as exc:
            raise QMPProtocolError(f"{name}: arguments are not JSON: {exc}") from None
        self._next_id += 1
        self.pending[ident] = msg
        if name == "qmp_capabilities" and self.state in ("greeting", "negotiating") and self._negotiation is None:
            self._negotiation = ident
        return ident, bytes(msg) + b"\n"

    def abandon(self, ident: int) -> None:
        """The caller no longer waits for ``ident`` (timeout, cancel): drop its reply."""
        if self.pending.pop(ident, None) is not None:
            self._abandoned.add(ident)

    def receive_data(self, data: bytes) -> list[Incoming]:
        """Feed bytes from QEMU; the complete messages they finish, in order. Replies
        are to outstanding commands (abandoned ones are dropped silently)."""
        if self.state == "broken":
            raise QMPProtocolError("the connection is broken")
        try:
            return self._receive(data)
        except QMPProtocolError:
            self.state = "broken"
            self._buf.clear()
            raise

    def _receive(self, data: bytes) -> list[Incoming]:
        out: list[Incoming] = []
        scan = len(self._buf)  # (no newline before: a long line is searched once, not per chunk)
        self._buf += data
        start = 0
        while True:
            nl = self._buf.find(b"\n", max(start, scan))
            if nl < 0:
                break
            line = bytes(self._buf[start:nl]).strip()
            start = nl + 1
            if len(line) > self.max_line:
                raise QMPProtocolError(f"a line of {len(line)} bytes (at most {self.max_line})")
            if line:
                msg = self._accept(parse_message(line))
                if msg is not None:
                    out.append(msg)
        del self._buf[:start]
        if len(self._buf) > self.max_line:
            raise QMPProtocolError(f"more than {self.max_line} bytes without a newline")
        return out

    def _accept(self, msg: Incoming) -> Incoming | None:
        if isinstance(msg, Greeting):
            if self.state != "greeting":
                raise QMPProtocolError("a second greeting")
            self.state = "negotiating"
            self.greeting = msg
            return msg
        if self.state == "greeting":
            raise QMPProtocolError("a message before the greeting")
        if isinstance(msg, Event):
            return msg
        if msg.id in self._abandoned:
            self._abandoned.discard(msg.id)
            return None
        sent = self.pending.pop(msg.id, None)
        if sent is None:
            raise QMPProtocolError(f"a reply to id {msg.id}, which is not outstanding")
        if msg.id == self._negotiation:
            if not msg.ok:
                raise QMPProtocolError(f"qmp_capabilities refused: {msg.desc}"[:200])
            self.state = "ready"
        return msg if msg.ok else attrs.evolve(msg, sent=sent)


# -- the Trio transport -----------------------------------------------------------------
class _Waiter:
    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: Reply | None = None


class QMPClient:
    """One QMP connection, read by :meth:`run` (in the owner's nursery)."""

    def __init__(self, name: str = "qmp", *, max_line: int = MAX_LINE) -> None:
        self.name = name
        self._proto = QMPProtocol(max_line)
        self._sock: trio.socket.SocketType | None = None
        self._send_lock = trio.Lock()
        self._waiters: dict[int, _Waiter] = {}
        self._greeted = trio.Event()
        self._closed: str | None = None  # why, once the connection is gone
        self._listeners: list[trio.MemorySendChannel[Event]] = []
        self.events_dropped = 0

    @property
    def greeting(self) -> Greeting | None:
        return self._proto.greeting

    @property
    def connected(self) -> bool:
        return self._closed is None and self._proto.state == "ready"

    async def run(
        self,
        sock: socket.socket,
        *,
        eager: bool = False,
        then: Sequence[tuple[str, dict[str, Any] | None]] = (),
        task_status: trio.TaskStatus[QMPClient] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Own ``sock`` (a connected stream socket to QEMU's QMP): wait for the greeting,
        negotiate, report started, then read until EOF, a protocol error or cancel. The
        socket is closed when this returns, however it does; a failed handshake raises
        QMPDisconnected (or QMPProtocolError, QMPCommandFailed). ``eager``: negotiate
        without waiting for the greeting (a connection made before QEMU started: QEMU
        reads the command after it greeted), one round trip less. ``then``: commands
        sent right behind the negotiation, without waiting for its answer (QEMU runs
        them in order after it); started once all are answered, the first refusal
        raised."""
        if self._sock is not None or self._closed is not None:
            sock.close()
            raise QMPError("a QMPClient runs once")
        self._sock = trio.socket.from_stdlib_socket(sock)
        failure: QMPError | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read)
                try:
                    if not eager:
                        await self._greeted.wait()
                    waiters = [await self._post("qmp_capabilities", {"enable": []})]
                    for command, args in then:
                        waiters.append(await self._post(command, args))
                    for (command, _), w in zip([("qmp_capabilities", None), *then], waiters, strict=True):
                        await self._answer(command, w)
                except QMPError as exc:
                    failure = exc
                    nursery.cancel_scope.cancel()
                else:
                    task_status.started(self)
        finally:
            self._close("closed")
        if failure is not None:
            raise failure

    async def _read(self) -> None:
        assert self._sock is not None
        reason = "closed"
        try:
            while True:
                try:
                    data = await self._sock.recv(65536)
                except OSError as exc:
                    reason = f"read failed: {exc}"
                    return
                except trio.ClosedResourceError:
                    return
                if not data:
                    reason = "EOF" if self._greeted.is_set() else "EOF before QEMU's greeting"
                    return
                try:
                    messages = self._proto.receive_data(data)
                except QMPProtocolError as exc:
                    log.warning("%s: QEMU broke the QMP protocol: %s", self.name, exc)
                    reason = f"protocol error: {exc}"
                    return
                for msg in messages:
                    if isinstance(msg, Reply):
                        w = self._waiters.pop(msg.id, None)
                        if w is not None:
                            w.reply = msg
                            w.done.set()
                    elif isinstance(msg, Event):
                        self._dispatch(msg)
                    else:  # the greeting: only now may qmp_capabilities go
                        self._greeted.set()
        finally:
            self._close(reason)

    def _dispatch(self, ev: Event) -> None:
        for ch in list(self._listeners):
            try:
                ch.send_nowait(ev)
            except trio.WouldBlock:
                self.events_dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._listeners.remove(ch)

    @contextlib.contextmanager
    def listen(self, buffer: int = EVENT_BUFFER) -> Iterator[trio.MemoryReceiveChannel[Event]]:
        """QEMU's events from now on, for the block (the channel ends when the connection
        does). A listener ``buffer`` events behind misses newer ones (counted in
        ``events_dropped``): the reader never waits for a listener."""
        send, recv = trio.open_memory_channel[Event](buffer)
        if self._closed is None:
            self._listeners.append(send)
        else:
            send.close()
        try:
            with recv:
                yield recv
        finally:
            if send in self._listeners:
                self._listeners.remove(send)
            send.close()

    def _close(self, reason: str) -> None:
        """The one place the connection ends: the socket closed, waiting commands and
        listeners told."""
        if self._closed is None:
            self._closed = reason
        if self._sock is not None:
            self._sock.close()
        self._greeted.set()  # (a handshake waiting for it finds the connection closed)
        for w in self._waiters.values():
            w.done.set()  # (no reply: the caller raises QMPDisconnected)
        self._waiters.clear()
        for ch in self._listeners:
            ch.close()
        self._listeners.clear()

    async def execute(
        self, command: str, args: dict[str, Any] | None = None, *, timeout: float = 30.0, fd: int | None = None
    ) -> Any:
        """Run ``command``; its return value. ``fd`` goes to QEMU with the command's bytes
        (SCM_RIGHTS), for ``getfd``/``add-fd``. QMPCommandFailed when QEMU refuses it,
        QMPTimeout after ``timeout`` seconds, QMPDisconnected without a connection,
        QMPProtocolError for arguments that are not JSON."""
        if self._closed is not None or self._proto.state != "ready":
            raise QMPDisconnected(f"QMP {command}: {self._closed or 'not connected'}")
        return await self._call(command, args, timeout, fd)

    async def _call(self, command: str, args: dict[str, Any] | None, timeout: float, fd: int | None) -> Any:
        w = _Waiter()
        try:
            with trio.fail_after(timeout):
                async with self._send_lock:  # (one command's bytes at a time, each with its fd)
                    if self._closed is not None:
                        raise QMPDisconnected(f"QMP {command}: {self._closed}")
                    ident, data = self._proto.command(command, args)
                    self._waiters[ident] = w
                    try:
                        await self._send(data, fd)
                    except BaseException:
                        self._forget(ident, w)
                        raise
                try:
                    await w.done.wait()
                finally:
                    self._forget(ident, w)
        except trio.TooSlowError:
            raise QMPTimeout(f"QMP {command}: no answer within {timeout:g}s") from None
        return self._result(command, w)

    async def _post(self, command: str, args: dict[str, Any] | None) -> _Waiter:
        """Send ``command`` now; its waiter (the handshake's pipelined commands)."""
        w = _Waiter()
        async with self._send_lock:
            if self._closed is not None:
                raise QMPDisconnected(f"QMP {command}: {self._closed}")
            ident, data = self._proto.command(command, args)
            self._waiters[ident] = w
            await self._send(data, None)
        return w

    async def _answer(self, command: str, w: _Waiter) -> Any:
        await w.done.wait()
        return self._result(command, w)

    def _result(self, command: str, w: _Waiter) -> Any:
        """An answered waiter's value, or the error it stands for."""
        reply = w.reply
        if reply is None:
            raise QMPDisconnected(f"QMP {command}: {self._closed or 'closed'}")
        if not reply.ok:
            assert reply.error is not None and reply.sent is not None and reply.received is not None
            raise QMPCommandFailed(command, reply.error, reply.sent, reply.received)
        return reply.value

    def _forget(self, ident: int, w: _Waiter) -> None:
        if w.reply is None:
            self._waiters.pop(ident, None)
            self._proto.abandon(ident)

    async def _send(self, data: bytes, fd: int | None) -> None:
        assert self._sock is not None
        view = memoryview(data)
        try:
            if fd is not None:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("@i", fd))]
                view = view[await self._sock.sendmsg([view], anc) :]
            while view:
                view = view[await self._sock.send(view) :]
        except (OSError, trio.ClosedResourceError) as exc:
            self._close(f"write failed: {exc}")
            raise QMPDisconnected(f"QMP: write failed: {exc}") from None
        except trio.Cancelled:
            if len(view) not in (0, len(data)):  # half a command on the wire: the stream is lost
                self._close("a command was cut off mid-write")
            raise

    async def aclose(self) -> None:
        """Close the connection (``run`` then returns; waiting commands fail)."""
        self._close("closed")
        await trio.lowlevel.checkpoint()
