"""actors/machines/qmp.py without QEMU: the protocol core under Hypothesis, the Trio client
against a fake QMP server on a socketpair. (With QEMU: every VM test goes through it.)"""

from __future__ import annotations

import codecs
import contextlib
import functools
import json
import math
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import qemu.qmp
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from qemu.qmp.error import ProtocolError
from qemu.qmp.message import DeserializationError, Message, UnexpectedTypeError

from actors.machines.qmp import (
    Event,
    Greeting,
    QMPClient,
    QMPCommandFailed,
    QMPDisconnected,
    QMPError,
    QMPMessage,
    QMPProtocol,
    QMPProtocolError,
    QMPTimeout,
    Reply,
    decode_object,
    encode_command,
    parse_message,
)

GREETING = b'{"QMP": {"version": {"qemu": {"major": 7, "minor": 2, "micro": 0}}, "capabilities": ["oob"]}}\r\n'


# -- the protocol core ----------------------------------------------------------------
def feed_all(p: QMPProtocol, chunks: list[bytes]) -> list[Any]:
    """Each chunk's messages, or the typed error that ended the stream (nothing else)."""
    out: list[Any] = []
    for c in chunks:
        try:
            out.extend(p.receive_data(c))
        except QMPProtocolError as exc:
            out.append(exc)
            with pytest.raises(QMPProtocolError):  # broken stays broken
                p.receive_data(b"\n")
            break
    return out


def negotiated(max_line: int = 1 << 16) -> QMPProtocol:
    p = QMPProtocol(max_line)
    assert p.receive_data(GREETING)
    ident, _ = p.command("qmp_capabilities", {"enable": []})
    assert p.receive_data(b'{"return": {}, "id": %d}\n' % ident) == [Reply(ident, True, {})]
    assert p.state == "ready"
    return p


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=200), max_size=8), st.booleans())
def test_any_bytes_give_messages_or_a_typed_error(chunks: list[bytes], greet: bool) -> None:
    p = negotiated(max_line=256) if greet else QMPProtocol(max_line=256)
    if greet:
        for _ in range(3):
            p.command("query-status")
    for m in feed_all(p, chunks):
        assert isinstance(m, (Greeting, Reply, Event, QMPProtocolError))
    assert len(p._buf) <= 256  # bounded, whatever came


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
JSON_LINES = st.one_of(
    JSON.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"return": JSON, "id": st.integers(0, 5)}).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"event": st.text(max_size=8), "data": JSON}).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"error": JSON, "id": JSON}).map(lambda v: json.dumps(v).encode()),
    st.just(b'{"QMP": {"version": {}, "capabilities": []}}'),
)


@settings(max_examples=300, deadline=None)  # (a shared machine: time is not the property)
@given(st.lists(JSON_LINES, max_size=6), st.data())
def test_json_shaped_input_gives_messages_or_a_typed_error(lines: list[bytes], data: st.DataObject) -> None:
    """Messages that are JSON but maybe not QMP (any shape, ids we never sent, a second
    greeting), split anywhere: the same messages as in one piece, or the same typed error."""
    stream = b"".join(x + b"\r\n" for x in lines)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=5)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    whole, split = negotiated(), negotiated()
    for p in (whole, split):
        for _ in range(3):
            p.command("query-status")  # ids 2, 3, 4 outstanding
    a, b = feed_all(whole, [stream]), feed_all(split, chunks)
    failed = isinstance(a[-1], QMPProtocolError) if a else False
    assert failed == (isinstance(b[-1], QMPProtocolError) if b else False)
    if failed:  # (a chunk that ends in an error gives none of its messages: the connection is dropped)
        assert b[: len(a) - 1] == a[:-1]
    else:
        assert a == b


@settings(deadline=None)
@given(st.lists(st.sampled_from(["return", "error", "event"]), max_size=20), st.integers(1, 50))
def test_replies_match_their_commands_with_events_between(kinds: list[str], cut: int) -> None:
    p = negotiated()
    sent = {p.command("query-status")[0]: k for k in kinds if k != "event"}
    ids = iter(sent)
    stream = b""
    for k in kinds:
        if k == "event":
            stream += b'{"event": "STOP", "data": {}, "timestamp": {"seconds": 1, "microseconds": 5}}\n'
        elif k == "return":
            stream += b'{"return": {"status": "running"}, "id": %d}\n' % next(ids)
        else:
            stream += b'{"id": %d, "error": {"class": "GenericError", "desc": "no"}}\n' % next(ids)
    got = feed_all(p, [stream[i : i + cut] for i in range(0, len(stream), cut)])
    assert [m.ok if isinstance(m, Reply) else "event" for m in got] == [
        k == "return" if k != "event" else "event" for k in kinds
    ]
    assert all(m.timestamp == 1.000005 for m in got if isinstance(m, Event))
    assert not p.pending


def test_bounded_lines_deep_nesting_and_non_qmp_are_typed_errors() -> None:
    p = negotiated(max_line=1000)
    with pytest.raises(QMPProtocolError, match="without a newline"):
        for _ in range(20):
            p.receive_data(b"x" * 100)
    for bad in [
        b"[" * 100_000 + b"]" * 100_000,  # past Python's recursion limit
        b'{"return": 1, "id": "' + b"9" * 5000 + b'"}',
        b'{"return": ' + b"9" * 5000 + b', "id": 2}',  # past int's digit limit
        b'{"return": NaN, "id": 2}',
        b"\xff\xfe",
        b"[1, 2]",
        b'{"return": {}}',  # unparsable input's error has no id
        b'{"return": {}, "id": 77}',
        b'{"return": {}, "id": true}',
        b'{"error": "x", "id": 2}',
        b'{"event": 5}',
        b'{"event": "X", "timestamp": {"seconds": 1e999}}',
        b'{"something": "else"}',
        b'{"QMP": {"version": {}, "capabilities": []}}',  # a second greeting
    ]:
        q = negotiated(max_line=1 << 20)
        q.command("x")
        with pytest.raises(QMPProtocolError):
            q.receive_data(bad + b"\n")
    q = QMPProtocol()
    with pytest.raises(QMPProtocolError, match="before the greeting"):
        q.receive_data(b'{"event": "X"}\n')


def test_commands_encode_and_bad_arguments_are_typed() -> None:
    assert json.loads(encode_command("getfd", {"fdname": "a"}, 7)) == {
        "execute": "getfd",
        "arguments": {"fdname": "a"},
        "id": 7,
    }
    p = negotiated()
    with pytest.raises(QMPProtocolError, match="not JSON"):
        p.command("x", {"a": object()})
    with pytest.raises(QMPProtocolError, match="not JSON"):
        p.command("x", {"a": float("nan")})
    ident, _ = p.command("y")  # the connection is still good
    assert p.receive_data(b'{"return": 1, "id": %d}\n' % ident) == [Reply(ident, True, 1)]


def test_a_reply_after_its_caller_gave_up_is_dropped() -> None:
    p = negotiated()
    ident, _ = p.command("slow")
    p.abandon(ident)
    assert p.receive_data(b'{"return": 1, "id": %d}\n' % ident) == []
    with pytest.raises(QMPProtocolError):  # but only once
        p.receive_data(b'{"return": 1, "id": %d}\n' % ident)


def test_parse_message_shapes() -> None:
    assert parse_message(GREETING.strip()) == Greeting({"qemu": {"major": 7, "minor": 2, "micro": 0}}, ("oob",))
    assert parse_message(b'{"event": "SHUTDOWN", "data": {"guest": true}}') == Event("SHUTDOWN", {"guest": True}, 0.0)
    assert parse_message(b'{"error": {"class": "C", "desc": "d"}, "id": 3}') == Reply(3, False, None, "C", "d")


# -- what is qemu.qmp's -------------------------------------------------------------------
def _finite(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    return True


ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(),  # (NaN, inf too)
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12), st.none() | st.dictionaries(st.text(max_size=5), ANY_JSON, max_size=3))
def test_commands_are_messages_qemu_qmp_reads_back(name: str, args: dict[str, Any] | None) -> None:
    """A command's bytes are one line that qemu.qmp's own Message parses back to the
    command; arguments that are not JSON (NaN, infinities) a typed error, sent never."""
    p = negotiated()
    if args is not None and not _finite(args):
        with pytest.raises(QMPProtocolError, match="not JSON"):
            p.command(name, args)
        return
    ident, data = p.command(name, args)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    want: dict[str, Any] = {"execute": name, "id": ident} | ({} if args is None else {"arguments": args})
    assert dict(Message(data[:-1])) == want
    assert dict(p.pending[ident]) == want  # (the sent command, kept for the error it may get)


@settings(max_examples=300, deadline=None)
@given(st.one_of(JSON_LINES, ANY_JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=40)))
@example(codecs.BOM_UTF8 + b"{}")
@example("{}".encode("utf-16-le"))
@example(b'{"a": NaN}')
def test_the_codec_is_messages_with_refusals(line: bytes) -> None:
    """decode_object (QMPMessage's codec) reads what the stock Message reads, except what
    is not RFC 8259 JSON in UTF-8 (QMP's encoding; the stock codec guesses UTF-16, -32 and
    skips a BOM), which it refuses with Message's own error types, never another."""
    try:
        line.decode()
    except UnicodeDecodeError:
        utf8 = False
    else:
        utf8 = json.detect_encoding(line) == "utf-8"  # (the stock's guess: a BOM, UTF-16, -32)
    try:
        stock: Any = dict(Message(line))
    except ProtocolError:
        stock = None
    except (ValueError, RecursionError):  # (the stock codec's untyped leaks: invalid UTF-8, digits)
        stock = None
    try:
        ours: Any = decode_object(line)
    except (DeserializationError, UnexpectedTypeError):
        ours = None
    if stock is not None and _finite(stock) and utf8:
        assert ours == stock
    else:
        assert ours is None


@pytest.mark.parametrize(
    ("line", "stock_raises"),
    [
        (b"[" * 100_000 + b"]" * 100_000, RecursionError),
        (b'{"return": ' + b"9" * 5000 + b', "id": 2}', ValueError),
        (b'{"a": "\xff"}', UnicodeDecodeError),
        (b'{"return": NaN, "id": 2}', None),  # (accepted)
        (b'{"return": -Infinity, "id": 2}', None),
    ],
)
def test_what_the_stock_message_lets_through_is_refused_typed(
    line: bytes, stock_raises: type[Exception] | None
) -> None:
    """The bounds Message does not keep: its codec leaks these untyped or takes them."""
    if stock_raises is None:
        Message(line)
    else:
        with pytest.raises(stock_raises):
            Message(line)
    with pytest.raises(DeserializationError):
        QMPMessage(line)  # (the hook is still called: a qemu.qmp that renamed it fails here)
    with pytest.raises(QMPProtocolError) as exc:
        parse_message(line)
    assert isinstance(exc.value, ProtocolError) and exc.value.__cause__ is None
    assert len(str(exc.value)) < 200  # (never the hostile bytes into a log)
    with pytest.raises(ValueError, match="Out of range float"):
        bytes(QMPMessage({"a": math.inf}))


@pytest.mark.parametrize(
    "greeting",
    [
        b'{"QMP": {"version": {}, "capabilities": "oob"}}',  # (qemu.qmp's model takes a str)
        b'{"QMP": {"version": {}, "capabilities": [1]}}',
        b'{"QMP": {"capabilities": []}}',  # (the spec's members, as qemu.qmp's model wants them)
        b'{"QMP": {"version": [], "capabilities": []}}',
        b'{"QMP": []}',
    ],
)
def test_a_malformed_greeting_is_a_typed_error(greeting: bytes) -> None:
    with pytest.raises(QMPProtocolError, match="malformed greeting"):
        QMPProtocol().receive_data(greeting + b"\n")


def test_our_errors_are_qemu_qmps_of_the_same_meaning() -> None:
    assert issubclass(QMPError, qemu.qmp.QMPError)
    assert issubclass(QMPProtocolError, ProtocolError)
    assert issubclass(QMPDisconnected, qemu.qmp.ExecInterruptedError)
    assert issubclass(QMPCommandFailed, qemu.qmp.ExecuteError)
    assert not issubclass(QMPTimeout, qemu.qmp.ExecInterruptedError | qemu.qmp.ExecuteError | ProtocolError)
    p = negotiated()
    ident, _ = p.command("device_del", {"id": "x"})
    (reply,) = p.receive_data(b'{"error": {"class": "DeviceNotFound", "desc": "no x"}, "id": %d}\n' % ident)
    assert reply == Reply(ident, False, None, "DeviceNotFound", "no x")
    assert reply.error is not None and (reply.error.error.class_, reply.error.id) == ("DeviceNotFound", ident)
    assert reply.sent is not None and reply.received is not None
    exc = QMPCommandFailed("device_del", reply.error, reply.sent, reply.received)
    assert (exc.error_class, exc.desc, str(exc)) == ("DeviceNotFound", "no x", "device_del: no x")
    assert dict(exc.sent) == {"execute": "device_del", "arguments": {"id": "x"}, "id": ident}
    assert exc.received["error"] == {"class": "DeviceNotFound", "desc": "no x"}


# -- the Trio client against a fake server ------------------------------------------------
Handler = Callable[["FakeQEMU", dict[str, Any], list[int]], Awaitable[None]]


class FakeQEMU:
    """QEMU's side of a QMP socket: greets, accepts qmp_capabilities, hands every other
    command (and the descriptors that came with it) to ``handler``."""

    def __init__(self, sock: socket.socket, handler: Handler, greeting: bytes = GREETING) -> None:
        self.sock = trio.socket.from_stdlib_socket(sock)
        self.handler = handler
        self.greeting = greeting
        self.fds: list[int] = []

    async def send(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # (the client hung up: some tests make it)
            view = memoryview(data)
            while view:
                view = view[await self.sock.send(view) :]

    async def reply(self, cmd: dict[str, Any], value: Any) -> None:
        await self.send(json.dumps({"return": value, "id": cmd["id"]}).encode() + b"\r\n")

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        buf = b""
        with self.sock:
            await self.send(self.greeting)
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        data, anc, _, _ = await self.sock.recvmsg(4096, socket.CMSG_SPACE(16))
                    except OSError:  # reset: the client hung up with our bytes unread
                        return
                    fds = [
                        fd
                        for level, kind, raw in anc
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
                        for (fd,) in struct.iter_unpack("@i", raw)
                    ]
                    self.fds += fds
                    if not data:
                        return
                    buf += data
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        cmd = json.loads(line)
                        if cmd["execute"] == "qmp_capabilities":
                            await self.reply(cmd, {})
                        else:
                            nursery.start_soon(self.handler, self, cmd, fds)
                            fds = []


@asynccontextmanager
async def connected(
    handler: Handler, greeting: bytes = GREETING
) -> AsyncIterator[tuple[QMPClient, FakeQEMU, trio.Nursery]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fake = FakeQEMU(b, handler, greeting)
    client = QMPClient("test")
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(fake.run)
                await nursery.start(client.run, a)
                yield client, fake, nursery
                nursery.cancel_scope.cancel()
    finally:
        for fd in fake.fds:
            os.close(fd)


async def echo_later(fake: FakeQEMU, cmd: dict[str, Any], fds: list[int]) -> None:
    """Answers ``{"n": N}`` after N ms (so replies come out of order), with events before."""
    n = cmd.get("arguments", {}).get("n", 0)
    await fake.send(b'{"event": "TICK", "data": {"n": %d}, "timestamp": {"seconds": 1, "microseconds": 0}}\n' % n)
    await trio.sleep(n / 1000)
    if cmd["execute"] == "fail":
        await fake.send(json.dumps({"id": cmd["id"], "error": {"class": "GenericError", "desc": "refused"}}).encode())
        await fake.send(b"\n")
    elif cmd["execute"] == "never":
        return
    elif cmd["execute"] == "hangup":
        await fake.send(b'{"return": {}, "i')  # half a reply, then EOF
        fake.sock.shutdown(socket.SHUT_WR)
    elif cmd["execute"] == "fdinfo":
        await fake.reply(cmd, [os.fstat(fd).st_ino for fd in fds])
    else:
        await fake.reply(cmd, {"n": n})


async def test_concurrent_commands_get_their_own_replies_with_events_between() -> None:
    async with connected(echo_later) as (client, _, _n):
        assert client.connected and client.greeting is not None
        got: dict[int, Any] = {}
        with client.listen() as events:

            async def one(n: int) -> None:
                got[n] = await client.execute("echo", {"n": n})

            async with trio.open_nursery() as nursery:
                for n in (30, 1, 20, 5, 0):
                    nursery.start_soon(one, n)
            assert got == {n: {"n": n} for n in (30, 1, 20, 5, 0)}
            seen = sorted([(await events.receive()).data["n"] for _ in range(5)])
            assert seen == [0, 1, 5, 20, 30]


async def test_errors_timeouts_and_late_replies() -> None:
    async with connected(echo_later) as (client, _, _n):
        with pytest.raises(QMPCommandFailed) as exc:
            await client.execute("fail")
        assert (exc.value.error_class, exc.value.desc) == ("GenericError", "refused")
        with pytest.raises(QMPTimeout):
            await client.execute("never", timeout=0.05)
        with pytest.raises(QMPTimeout):  # its reply comes after the caller gave up: dropped
            await client.execute("echo", {"n": 200}, timeout=0.01)
        with pytest.raises(QMPProtocolError):
            await client.execute("echo", {"n": object()})
        assert await client.execute("echo", {"n": 300}) == {"n": 300}  # (after the late one came)
        assert client.connected


async def test_descriptors_ride_with_their_command(tmp_path: Path) -> None:
    files = [tmp_path / f"f{i}" for i in range(3)]
    async with connected(echo_later) as (client, _, _n):
        for f in files:
            f.write_bytes(b"x")
            fd = os.open(f, os.O_RDONLY)
            try:
                assert await client.execute("fdinfo", fd=fd) == [f.stat().st_ino]
            finally:
                os.close(fd)
        assert await client.execute("fdinfo") == []


async def test_eof_mid_command_fails_waiters_and_ends_run() -> None:
    async with connected(echo_later) as (client, _, _n):
        with client.listen() as events:
            results: list[BaseException] = []

            async def waiting() -> None:
                try:
                    await client.execute("never")
                except QMPDisconnected as exc:
                    results.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiting)
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(QMPDisconnected, match="EOF"):
                    await client.execute("hangup")
            assert len(results) == 1
            assert not client.connected
            with pytest.raises(QMPDisconnected):
                await client.execute("echo")
            async for _ in events:  # the listener's channel ends with the connection
                pass


async def test_garbage_from_qemu_drops_the_connection() -> None:
    async def garbage(fake: FakeQEMU, cmd: dict[str, Any], fds: list[int]) -> None:
        await fake.send(b"x" * 100_000)  # no newline, ever

    a, b = socket.socketpair()
    fake = FakeQEMU(b, garbage)
    client = QMPClient("test", max_line=10_000)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fake.run)
            await nursery.start(client.run, a)
            with pytest.raises(QMPDisconnected, match="protocol error"):
                await client.execute("x")
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("greeting", "error"),
    [(b"", "EOF before"), (b"garbage\n", "protocol error"), (b'{"event": "X"}\n', "before the greeting")],
)
async def test_a_failed_handshake_is_a_typed_error(greeting: bytes, error: str) -> None:
    async def nothing(fake: FakeQEMU, cmd: dict[str, Any], fds: list[int]) -> None:
        pass

    a, b = socket.socketpair()
    client = QMPClient("test")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            if greeting:
                nursery.start_soon(FakeQEMU(b, nothing, greeting).run)
            else:
                b.close()
            with pytest.raises(QMPDisconnected, match=error):
                await nursery.start(client.run, a)
            nursery.cancel_scope.cancel()
    assert a.fileno() == -1  # the client closed the socket it was given


async def test_close_ends_run_and_fails_waiters() -> None:
    async with connected(echo_later) as (client, _, nursery):
        nursery.start_soon(client.aclose)
        with pytest.raises(QMPDisconnected):
            await client.execute("never")
        with pytest.raises(QMPDisconnected, match="closed"):
            await client.execute("echo")


async def _greet_after(sock: socket.socket, lines: int, refuse: str = "", cmds: list[Any] | None = None) -> None:
    """A QEMU that greets only once it has read ``lines`` commands (into ``cmds``), then
    answers each in order (``refuse``: that command's answer is an error)."""
    s = trio.socket.from_stdlib_socket(sock)
    buf = b""
    cmds = [] if cmds is None else cmds
    with s:
        while buf.count(b"\n") < lines:
            data = await s.recv(4096)
            assert data, "the client hung up"
            buf += data
        await s.send(GREETING)
        for line in buf.splitlines():
            cmd = json.loads(line)
            cmds.append(cmd)
            if cmd["execute"] == refuse:
                err = {"id": cmd["id"], "error": {"class": "GenericError", "desc": "refused"}}
                await s.send(json.dumps(err).encode() + b"\n")
            else:
                await s.send(json.dumps({"return": {}, "id": cmd["id"]}).encode() + b"\n")
        await trio.sleep_forever()


async def test_eager_handshake_pipelines_the_commands_behind_it() -> None:
    """A connection made before QEMU started (Machine._pre_connect) negotiates without
    waiting for the greeting, and the restore's commands go right behind it: QEMU reads
    all of them before it greets, and answers them in order."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = QMPClient("eager")
    then = (("migrate-set-capabilities", {"capabilities": []}), ("migrate-incoming", {"uri": "fd:7"}))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            got: list[dict[str, Any]] = []
            nursery.start_soon(_greet_after, b, 3, "", got)
            await nursery.start(functools.partial(client.run, a, eager=True, then=then))
            assert client.connected
            nursery.cancel_scope.cancel()
    assert [c["execute"] for c in got] == ["qmp_capabilities", "migrate-set-capabilities", "migrate-incoming"]


async def test_a_refused_pipelined_command_fails_the_handshake() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = QMPClient("eager")
    then = (("migrate-incoming", {"uri": "fd:7"}),)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_greet_after, b, 2, "migrate-incoming")
            with pytest.raises(QMPCommandFailed, match="refused"):
                await nursery.start(functools.partial(client.run, a, eager=True, then=then))
            nursery.cancel_scope.cancel()


async def test_a_refusal_and_a_hang_up_are_qemu_qmps_errors() -> None:
    """Code written against qemu.qmp's client catches ours: ExecuteError (with the sent
    command and QEMU's answer), ExecInterruptedError."""
    async with connected(echo_later) as (client, _, _n):
        with pytest.raises(qemu.qmp.ExecuteError) as exc:
            await client.execute("fail", {"n": 1})
        assert exc.value.error_class == "GenericError" and str(exc.value) == "fail: refused"
        assert exc.value.sent["arguments"] == {"n": 1} and exc.value.received["id"] == exc.value.sent["id"]
        with pytest.raises(qemu.qmp.ExecInterruptedError, match="EOF"):
            await client.execute("hangup")
