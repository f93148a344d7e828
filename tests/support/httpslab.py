"""A stand-in HTTPS server for the secret proxy's tests and benchmark.

One TLS listener (in a namespace the test made) with a certificate from a test CA
(``trustme``, made per run) for ``api.test``, ``other.test`` and ``plain.test``; it
answers every HTTP/1.1 request (h11) and records what it got: the TLS server name
and ALPN, the method, the target, the headers and the body. ``GET /bytes/N`` answers N
bytes (the benchmark's download); ``/echo`` and ``/echo-gz`` (gzip'd, asked or not) answer
with the Authorization they got, as a hostile allowed host would."""

from __future__ import annotations

import gzip
import socket
import ssl
from typing import Any

import attrs
import h11
import trio
import trustme

from actors.net.netns import NetNS

NAMES = ("api.test", "other.test", "plain.test")
CHUNK = 256 * 1024


@attrs.define
class Seen:
    host: str  # the Host header's name
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@attrs.define
class HttpsServer:
    ca: trustme.CA
    seen: list[Seen] = attrs.Factory(list)
    connections: int = 0
    host_side: HttpsServer | None = None  # (a test's second server)

    def ca_pem(self) -> bytes:
        return self.ca.cert_pem.bytes()

    def to(self, name: str) -> list[Seen]:
        return [s for s in self.seen if s.host == name]


def https_server_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert(*NAMES).configure_cert(ctx)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def https_server(
    ns: NetNS,
    address: str,
    port: int = 443,
    *,
    ca: trustme.CA | None = None,
    task_status: trio.TaskStatus[HttpsServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve (and record) until cancelled; ``ca``: another listener's (one test CA)."""
    server = HttpsServer(ca or trustme.CA())
    ctx = https_server_context(server.ca)
    s = ns.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port))
    s.listen(64)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(s))
    async with listener, trio.open_nursery() as nursery:
        task_status.started(server)
        while True:
            stream = await listener.accept()
            server.connections += 1
            nursery.start_soon(_serve, server, trio.SSLStream(stream, ctx, server_side=True))


async def _serve(server: HttpsServer, stream: trio.SSLStream[Any]) -> None:
    try:
        with trio.fail_after(60):
            await stream.do_handshake()
        conn = h11.Connection(h11.SERVER)
        while True:
            req: Any = None
            body = b""
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                    continue
                if isinstance(ev, h11.Request):
                    req = ev
                elif isinstance(ev, h11.Data):
                    body += ev.data
                elif isinstance(ev, h11.EndOfMessage):
                    break
                else:
                    return
            headers = {k.decode(): v.decode() for k, v in req.headers}
            name = headers.get("host", "").rsplit(":", 1)[0]  # (h11 needs a Host: every HTTP/1.1 request has one)
            server.seen.append(Seen(name, req.method.decode(), req.target.decode(), headers, body))
            target = req.target.decode()
            if target.startswith("/bytes/"):
                n = int(target.removeprefix("/bytes/"))
                await stream.send_all(
                    conn.send(h11.Response(status_code=200, headers=[(b"content-length", str(n).encode())]))
                )
                block = b"x" * CHUNK
                while n > 0:
                    await stream.send_all(conn.send(h11.Data(data=block[: min(n, CHUNK)])))
                    n -= CHUNK
            elif target == "/echo-gz":  # the same, gzip'd whatever the request's Accept-Encoding said
                packed = gzip.compress(b"you sent: " + headers.get("authorization", "").encode() + b"\n")
                zipped = [(b"content-length", str(len(packed)).encode()), (b"content-encoding", b"gzip")]
                await stream.send_all(conn.send(h11.Response(status_code=200, headers=zipped)))
                await stream.send_all(conn.send(h11.Data(data=packed)))
            elif target == "/echo":  # the request's Authorization, back in a header and the body
                auth = headers.get("authorization", "").encode()
                text = b"you sent: " + auth + b"\n"
                echo = [(b"content-length", str(len(text)).encode()), (b"x-echo", auth)]
                await stream.send_all(conn.send(h11.Response(status_code=200, headers=echo)))
                await stream.send_all(conn.send(h11.Data(data=text)))
            else:
                text = f"hello {name} {req.method.decode()} {target}\n".encode()
                await stream.send_all(
                    conn.send(h11.Response(status_code=200, headers=[(b"content-length", str(len(text)).encode())]))
                )
                await stream.send_all(conn.send(h11.Data(data=text)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, h11.ProtocolError, trio.TooSlowError):
        pass
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
