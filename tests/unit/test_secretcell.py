"""The secret proxy's process and its channel (actors/secrets/proxyproc.py,
actors/secrets/wire.py) without VMs: the process, started as the supervisor starts it
when there is no jailer, gets a sandbox's secrets over the control channel and a
connection's two sockets over SCM_RIGHTS, puts the value in, scrubs the echo, reports
a refusal, applies a rotation to the next connection, and ends when the channel closes.
The confined start (an unprivileged id, no capabilities, own namespaces) is tested with
a real VM in tests/vm/test_secrets.py."""

from __future__ import annotations

import array
import socket
import ssl
import sys
from typing import Any

import h11
import pytest
import trio
import trustme

from actors.secrets import wire
from actors.secrets.ca import new_ca

PH = "PH_TOKEN_0123456789abcdef"
OTHER_PH = "PH_OTHER_0123456789abcdef"
VALUE = b"sk-proc-0123456789-REAL"


def test_the_channel_believes_the_proxy_little() -> None:
    names = {"TOKEN"}
    ok = {"t": "blocked", "secret": "TOKEN", "host": "other.test", "port": 443}
    assert wire.blocked_event(ok, names) == ("TOKEN", "other.test", 443)
    for bad in (
        {**ok, "secret": "NOT_OURS"},
        {**ok, "host": "evil\nInjected: log line"},
        {**ok, "host": "x" * 300},
        {**ok, "port": 0},
        {**ok, "port": True},
        {**ok, "t": "config"},
        {**ok, "secret": b"TOKEN"},
    ):
        assert wire.blocked_event(bad, names) is None, bad
    frames = wire.Frames(wire.UP_MAX)
    data = wire.frame(ok)
    assert frames.feed(data[:3]) == [] and frames.feed(data[3:] + data) == [ok, ok]
    with pytest.raises(wire.WireError):
        wire.Frames(wire.UP_MAX).feed(wire.HEADER.pack(wire.UP_MAX + 1))
    with pytest.raises(wire.WireError):
        wire.Frames(wire.UP_MAX).feed(wire.HEADER.pack(2) + b"\xc1\xc1")  # not msgpack


async def echo_server(
    ca: trustme.CA, seen: list[bytes], task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """HTTPS on loopback for api.test: answers with the Authorization it got."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("api.test").configure_cert(ctx)

    async def one(stream: trio.SSLStream[trio.SocketStream]) -> None:
        data = b""
        with trio.fail_after(30):
            while b"\r\n\r\n" not in data:
                try:
                    data += await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return  # (a connection the proxy opened no TLS on: the 403 case)
        auth = next(
            (
                line.split(b":", 1)[1].strip()
                for line in data.split(b"\r\n")
                if line.lower().startswith(b"authorization:")
            ),
            b"",
        )
        seen.append(auth)
        body = b"you sent: " + auth
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        await stream.aclose()

    listeners = await trio.open_ssl_over_tcp_listeners(0, ctx, host="127.0.0.1")
    task_status.started(listeners[0].transport_listener.socket.getsockname()[1])
    await trio.serve_listeners(one, listeners)


def body(out: bytes) -> tuple[int, bytes]:
    """(status, body) of a raw HTTP/1.1 response (h11: the proxy re-frames scrubbed bodies)."""
    c = h11.Connection(h11.CLIENT)
    c.send(h11.Request(method="GET", target="/x", headers=[("host", "api.test")]))
    c.send(h11.EndOfMessage())
    c.receive_data(out)
    c.receive_data(b"")
    status, data = 0, b""
    while not isinstance(ev := c.next_event(), (h11.EndOfMessage, h11.ConnectionClosed)):
        if isinstance(ev, h11.Response):
            status = ev.status_code
        elif isinstance(ev, h11.Data):
            data += ev.data
    return status, data


def config(gen: int, ca: tuple[bytes, bytes], upstream_ca: bytes, value: bytes, port: int) -> dict[str, Any]:
    return {
        "t": "config",
        "gen": gen,
        "secrets": [
            ["TOKEN", [f"api.test:{port}"], PH, value, "headers"],
            ["OTHER", ["other.test"], OTHER_PH, b"other-value", "headers"],
        ],
        "ca": list(ca),
        "upstream_ca": upstream_ca,
    }


async def request(conns: socket.socket, port: int, gen: int, sandbox_ca: bytes, auth: str) -> bytes:
    """A guest's connection handed over as the supervisor hands it; the response."""
    guest, theirs = socket.socketpair()
    up = socket.create_connection(("127.0.0.1", port))
    head = wire.frame({"gen": gen, "dst": ["127.0.0.1", port], "err": ""})[wire.HEADER.size :]
    conns.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [theirs.fileno(), up.fileno()]))])
    theirs.close()
    up.close()
    ctx = ssl.create_default_context(cadata=sandbox_ca.decode())
    stream = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(guest)), ctx, server_hostname="api.test")
    await stream.send_all(f"GET /x HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer {auth}\r\n\r\n".encode())
    out = b""
    try:
        while chunk := await stream.receive_some(65536):
            out += chunk
    except trio.BrokenResourceError:
        pass
    await stream.aclose()
    return out


async def test_the_proxy_process_works_on_handed_sockets() -> None:
    ca = trustme.CA()
    sandbox_ca = new_ca("t")
    control, control_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conns, conns_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = (control_child.fileno(), conns_child.fileno())
    argv = [sys.executable, "-m", "actors.secrets.proxyproc", *map(str, fds)]
    proc = await trio.lowlevel.open_process(argv, pass_fds=fds)
    control_child.close()
    conns_child.close()
    ctl = trio.socket.from_stdlib_socket(control)
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                seen: list[bytes] = []
                port = await nursery.start(echo_server, ca, seen)
                await ctl.send(wire.frame(config(1, sandbox_ca, ca.cert_pem.bytes(), VALUE, port)))
                out = await request(conns, port, 1, sandbox_ca[0], PH)
                assert body(out) == (200, b"you sent: Bearer " + PH.encode())  # (the echo scrubbed)
                # a rotation is applied to a connection accepted under its generation
                await ctl.send(wire.frame(config(2, sandbox_ca, ca.cert_pem.bytes(), b"rotated-0123456789", port)))
                out = await request(conns, port, 2, sandbox_ca[0], PH)
                assert body(out) == (200, b"you sent: Bearer " + PH.encode())
                assert seen == [b"Bearer " + VALUE, b"Bearer rotated-0123456789"]
                # a placeholder its secret does not allow here: 403, and a report up
                out = await request(conns, port, 2, sandbox_ca[0], OTHER_PH)
                assert out.startswith(b"HTTP/1.1 403") and b"other-value" not in out, out
                frames = wire.Frames(wire.UP_MAX)
                got: list[dict[str, Any]] = []
                while not got:
                    got = frames.feed(await ctl.recv(4096))
                assert wire.blocked_event(got[0], {"TOKEN", "OTHER"}) == ("OTHER", "api.test", port)
                nursery.cancel_scope.cancel()
            ctl.close()  # the channel closes: the process ends by itself
            conns.close()
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True):
                await proc.wait()
