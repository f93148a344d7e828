"""One sandbox's secret substitution proxy (docs/secrets.md): what runs in
the proxy's cell (actors/secrets/proxyproc.py, an unprivileged process of its own),
never in the supervisor. The supervisor accepts the guest's redirected connection,
reads its original destination from conntrack, opens the upstream TCP connection with
the sandbox's mark (actors/net/secretcell.py) and hands both sockets over. Here::

    guest --TLS--> [peek the ClientHello: its server name (SNI)]
       SNI named by no secret (or none, or not TLS): spliced to the upstream socket,
          bytes untouched (no TLS termination)
       SNI named by a secret: TLS terminated with a leaf of the sandbox's CA (HTTP/1.1
          only in ALPN), each request read with h11 (bounded head and body) and held
          to the SNI (:func:`check_request`: an origin-form target, one Host that is
          the SNI name, one body framing; else 400), every placeholder replaced by
          its value in the headers (and in the target and body for a secret with
          substitute "all") -- only if the secret allows this host and port, else 403
          from here, and a report to the supervisor naming the secret -- and sent
          upstream with ``Accept-Encoding: identity`` over TLS verified against the
          system store plus ``serve --upstream-ca``, SNI and certificate name being
          the guest's SNI. The response comes back scrubbed (every value replaced by
          its placeholder: headers, body -- a gzip or deflate body inflated first,
          any other encoding refused with 502 -- and the reason phrase, replaced by
          the standard one)

Hostile guest: the ClientHello peek is bounded (16 KiB, 30 s), a request head by h11
(64 KiB), a substituted body by MAX_BODY (larger bodies stream through unchanged),
every read by an idle timeout. Each connection is its own error boundary: nothing it
does ends the proxy.
"""

from __future__ import annotations

import http
import logging
import ssl
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import h11
import trio

from actors.secrets import model as secrets_model
from actors.secrets.ca import Minter

log = logging.getLogger("sandvisor.secrets")

MAX_HELLO = 16 * 1024
HELLO_TIMEOUT = 30.0  # the ClientHello, then the guest's handshake (a TCG guest under load is slow)
IDLE_TIMEOUT = 120.0
CONNECT_TIMEOUT = 20.0
MAX_HEAD = 64 * 1024
MAX_BODY = 1 << 20
CHUNK = 64 * 1024


@attrs.frozen
class Blocked:
    secret: str
    host: str
    port: int


@attrs.define
class ProxyView:
    """What the proxy asks of its sandbox, live (a rotation or a removal applies to the
    next connection): the secrets in force, a secret's value, the minter of its CA."""

    refs: Callable[[], Sequence[secrets_model.SecretRef]]
    value: Callable[[secrets_model.SecretRef], bytes | None]
    minter: Callable[[], Minter]
    blocked: Callable[[Blocked], None]


def client_hello_name(data: bytes) -> tuple[bool, str | None]:
    """(whether ``data`` holds a complete ClientHello (or is not TLS at all), its server
    name). OpenSSL parses it (a throwaway server object whose SNI callback records the
    name and ends the handshake): no hand-written TLS parser."""
    seen: list[str | None] = []

    def record(_obj: Any, name: str | None, _ctx: ssl.SSLContext) -> int:
        seen.append(name)
        return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.sni_callback = record
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_side=True)
    incoming.write(data)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        return (bool(seen), seen[0] if seen else None)
    except ssl.SSLError:
        pass
    return True, seen[0] if seen else None


class _Replay(trio.abc.Stream):
    """A stream that first gives back what was peeked."""

    def __init__(self, inner: trio.SocketStream, prefix: bytes) -> None:
        self.inner = inner
        self.prefix = prefix

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self.prefix:
            data, self.prefix = self.prefix, b""
            return data
        return await self.inner.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Refused(Exception):
    """Answer the guest with this status and end the connection."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def check_request(req: h11.Request, name: str, port: int) -> None:
    """A request on an intercepted connection is for the TLS server name ``name`` on
    ``port`` and nothing else: its target origin-form (``/path?query``: no absolute
    form, whose authority a front end would route by, no CONNECT, no ``*``), exactly
    one Host that is ``name`` (optionally ``:port``), at most one way of framing its
    body (Content-Length and Transfer-Encoding together smuggle). _Refused (400)."""
    if req.method == b"CONNECT":
        raise _Refused(400, "sandvisor secret proxy: CONNECT is not served here\n")
    if not req.target.startswith(b"/"):
        raise _Refused(400, "sandvisor secret proxy: only origin-form request targets (/path?query)\n")
    hosts = [v for k, v in req.headers if k == b"host"]
    if len(hosts) != 1:
        raise _Refused(400, "sandvisor secret proxy: a request needs exactly one Host\n")
    host, colon, port_text = hosts[0].partition(b":")
    if host.lower() != name.lower().encode("ascii", "replace") or (
        colon and (not port_text.isdigit() or len(port_text) > 5 or int(port_text) != port)
    ):
        raise _Refused(400, f"sandvisor secret proxy: Host must be {name} (the TLS server name)\n")
    names = {k for k, _ in req.headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        raise _Refused(400, "sandvisor secret proxy: both Content-Length and Transfer-Encoding\n")


def _reason(status: int) -> bytes:
    """The standard reason phrase (the server's own may carry anything back)."""
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


class SecretProxy:
    """The connections the supervisor hands over (:meth:`handle`), each with the
    upstream socket it opened for it. Runs in the proxy's cell
    (actors/secrets/proxyproc.py), never in the supervisor."""

    def __init__(self, view: ProxyView, *, upstream: ssl.SSLContext, name: str = "") -> None:
        self.view = view
        self.upstream = upstream
        self.name = name
        self.stats = {"intercepted": 0, "passed": 0, "blocked": 0, "errors": 0}

    async def handle(
        self, guest: trio.socket.SocketType, dst: tuple[str, int], up: trio.socket.SocketType | None, err: str
    ) -> None:
        """One guest connection to ``dst`` (conntrack's), ``up`` connected there (None:
        ``err`` says why not). Its own error boundary; both sockets are closed at the end."""
        stream = trio.SocketStream(guest)
        upstream = trio.SocketStream(up) if up is not None else None
        try:
            await self._serve(stream, dst, upstream, err)
        except Exception as exc:
            if not _expected(exc):  # (else a guest or a server that went away, or lied: it ends)
                self.stats["errors"] += 1
                log.exception("%s: secret proxy connection failed", self.name)
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
                if upstream is not None:
                    await upstream.aclose()

    async def _serve(
        self, stream: trio.SocketStream, dst: tuple[str, int], upstream: trio.SocketStream | None, err: str
    ) -> None:
        data = b""
        name: str | None = None
        with trio.fail_after(HELLO_TIMEOUT):
            while len(data) < MAX_HELLO:
                chunk = await stream.receive_some(MAX_HELLO - len(data))
                if not chunk:
                    return
                data += chunk
                done, name = client_hello_name(data)
                if done:
                    break
        refs = self.view.refs()
        if name is not None and secrets_model.named_by_any(refs, name, dst[1]):
            self.stats["intercepted"] += 1
            await self._intercept(_Replay(stream, data), name, dst, upstream, err)
        elif upstream is not None:
            self.stats["passed"] += 1
            await self._splice(stream, data, upstream)

    # -- pass-through ------------------------------------------------------------------
    async def _splice(self, guest: trio.SocketStream, first: bytes, upstream: trio.SocketStream) -> None:
        await upstream.send_all(first)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, guest, upstream)
            nursery.start_soon(_pump, upstream, guest)

    # -- interception --------------------------------------------------------------------
    async def _intercept(
        self, raw: _Replay, name: str, dst: tuple[str, int], tcp: trio.SocketStream | None, err: str
    ) -> None:
        guest = trio.SSLStream(raw, self.view.minter().context(name), server_side=True)
        with trio.fail_after(HELLO_TIMEOUT):
            await guest.do_handshake()
        g = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        upstream: trio.SSLStream[trio.SocketStream] | None = None
        u = h11.Connection(h11.CLIENT)
        try:
            while True:
                try:
                    req = await _next(g, guest)
                    if not isinstance(req, h11.Request):
                        return
                    check_request(req, name, dst[1])
                    body, whole = await self._read_request(g, guest)
                    out, body = self._substitute(req, body, whole, name, dst[1])
                except h11.RemoteProtocolError as exc:
                    await _answer(g, guest, exc.error_status_hint, "sandvisor secret proxy: a broken request\n")
                    return
                except _Refused as r:
                    await _answer(g, guest, r.status, r.text)
                    return
                if upstream is None:
                    if tcp is None:
                        await _answer(g, guest, 502, f"sandvisor secret proxy: {name}: upstream: {err[:200]}")
                        return
                    try:
                        upstream = await self._open_upstream(tcp, name)
                    except (OSError, ssl.SSLError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                        await _answer(g, guest, 502, f"sandvisor secret proxy: {name}: upstream: {_why(exc)}")
                        return
                try:
                    await self._forward(g, guest, u, upstream, out, body, whole)
                except _Refused as r:
                    await _answer(g, guest, r.status, r.text)
                    return
                if g.our_state is h11.DONE and g.their_state is h11.DONE and u.our_state is h11.DONE:
                    if u.their_state is not h11.DONE:
                        return
                    g.start_next_cycle()
                    u.start_next_cycle()
                else:
                    return
        finally:
            if upstream is not None:
                with trio.CancelScope(shield=True):
                    await upstream.aclose()

    async def _open_upstream(self, tcp: trio.SocketStream, name: str) -> trio.SSLStream[trio.SocketStream]:
        up = trio.SSLStream(tcp, self.upstream, server_hostname=name, https_compatible=True)
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                await up.do_handshake()
        except BaseException:
            with trio.CancelScope(shield=True):
                await tcp.aclose()
            raise
        return up

    async def _read_request(self, g: h11.Connection, guest: trio.abc.Stream) -> tuple[bytes, bool]:
        """A request's body up to MAX_BODY: (body, whether it is the whole body); none
        read (it streams through) when no secret in force is replaced in bodies."""
        if g.they_are_waiting_for_100_continue:
            await _send(g, guest, h11.InformationalResponse(status_code=100, headers=[]))
        if not any(r.substitute == secrets_model.ALL for r in self.view.refs()):
            return b"", False
        body = bytearray()
        while True:
            ev = await _next(g, guest)
            if isinstance(ev, h11.Data):
                body += ev.data
                if len(body) > MAX_BODY:
                    return bytes(body), False
            elif isinstance(ev, h11.EndOfMessage):
                return bytes(body), True
            else:
                raise _Refused(400, "sandvisor secret proxy: a broken request")

    def _substitute(
        self, req: h11.Request, body: bytes, whole: bool, name: str, port: int
    ) -> tuple[h11.Request, bytes]:
        """The request to send upstream and its (start of) body: placeholders replaced
        in the headers, and for a secret with substitute "all" in the target and a whole
        body (its Content-Length set again); ``Accept-Encoding: identity`` (a compressed
        echo would carry a value past the scrubber). _Refused (403) when a placeholder
        may not go to this host (``check_request`` has held the Host to ``name``)."""
        heads: list[tuple[bytes, bytes]] = []  # (placeholder, value) for the headers
        rest: list[tuple[bytes, bytes]] = []  # ... for the target and the body
        for ref in self.view.refs():
            ph = ref.placeholder.encode()
            everywhere = ref.substitute == secrets_model.ALL
            if not (
                any(ph in v for _, v in req.headers) or (everywhere and (ph in req.target or (whole and ph in body)))
            ):
                continue  # (a headers-only secret's placeholder elsewhere goes as it is)
            value = self.view.value(ref)
            if value is None:
                continue  # removed, or its store entry is gone: the placeholder goes as it is
            if not secrets_model.allowed(ref, name, port):
                self.stats["blocked"] += 1
                self.view.blocked(Blocked(ref.name, name, port))
                raise _Refused(403, f"sandvisor: secret {ref.name} may not be sent to {name}:{port}\n")
            heads.append((ph, value))
            if everywhere:
                rest.append((ph, value))
        drop = {b"accept-encoding", *((b"expect", b"content-length", b"transfer-encoding") if whole else ())}
        headers = [(k, secrets_model.substitute(v, heads)) for k, v in req.headers if k not in drop]
        headers.append((b"accept-encoding", b"identity"))
        if whole:
            body = secrets_model.substitute(body, rest)
            if body or req.method not in (b"GET", b"HEAD", b"DELETE", b"OPTIONS"):
                headers.append((b"content-length", str(len(body)).encode()))
        return h11.Request(method=req.method, target=secrets_model.substitute(req.target, rest), headers=headers), body

    async def _forward(
        self,
        g: h11.Connection,
        guest: trio.abc.Stream,
        u: h11.Connection,
        upstream: trio.abc.Stream,
        req: h11.Request,
        body: bytes,
        whole: bool,
    ) -> None:
        """Send the request (a body beyond MAX_BODY streams on unchanged), then the
        response back to the guest as it comes."""
        await _send(u, upstream, req)
        if body:
            await _send(u, upstream, h11.Data(data=body))
        while not whole:
            ev = await _next(g, guest)
            if isinstance(ev, h11.Data):
                await _send(u, upstream, h11.Data(data=ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                return
        await _send(u, upstream, h11.EndOfMessage())
        scrub = Scrubber(self._reverse_pairs())
        inflate: Inflater | None = None
        while True:
            ev = await _next(u, upstream)
            if isinstance(ev, h11.InformationalResponse):
                if ev.status_code != 100:
                    headers = [(k, scrub.line(v)) for k, v in ev.headers]
                    info = h11.InformationalResponse(
                        status_code=ev.status_code, headers=headers, reason=_reason(ev.status_code)
                    )
                    await _send(g, guest, info)
                continue
            if isinstance(ev, h11.Response):
                headers = [(k, scrub.line(v)) for k, v in ev.headers]
                if scrub.pairs and req.method != b"HEAD" and ev.status_code not in (204, 304):
                    # the body may change length: h11 frames it again (chunked, to an HTTP/1.1 guest)
                    headers = [(k, v) for k, v in headers if k not in (b"content-length", b"transfer-encoding")]
                    coding = b",".join(v for k, v in headers if k == b"content-encoding").strip().lower()
                    if coding not in (b"", b"identity"):
                        # sent compressed though identity was asked for: inflated and scrubbed,
                        # or refused (an encoding whose bytes the scrubber cannot read)
                        if coding not in Inflater.CODINGS:
                            raise _Refused(502, "sandvisor secret proxy: a response in an encoding it cannot scrub\n")
                        inflate = Inflater()
                        headers = [(k, v) for k, v in headers if k != b"content-encoding"]
                response = h11.Response(status_code=ev.status_code, headers=headers, reason=_reason(ev.status_code))
                await _send(g, guest, response)
                continue
            if isinstance(ev, h11.Data):
                for piece in inflate.feed(ev.data) if inflate is not None else (ev.data,):
                    data = scrub.feed(piece)
                    if data:
                        await _send(g, guest, h11.Data(data=data))
                continue
            if isinstance(ev, h11.EndOfMessage):
                rest = scrub.feed(inflate.flush()) if inflate is not None else b""
                rest += scrub.flush()
                if rest:
                    await _send(g, guest, h11.Data(data=rest))
                await _send(g, guest, h11.EndOfMessage())
                return
            return  # closed

    def _reverse_pairs(self) -> list[tuple[bytes, bytes]]:
        """(value, placeholder) of every secret in force: what a response must not carry back."""
        out = []
        for ref in self.view.refs():
            value = self.view.value(ref)
            if value:
                out.append((value, ref.placeholder.encode()))
        return out


class Inflater:
    """A gzip or deflate (zlib) body, inflated as it comes, in pieces of at most CHUNK
    bytes (a small body that inflates to gigabytes is never held whole)."""

    CODINGS = (b"gzip", b"x-gzip", b"deflate")

    def __init__(self) -> None:
        self.z = zlib.decompressobj(wbits=32 + zlib.MAX_WBITS)  # (a gzip or a zlib header, either)

    def feed(self, data: bytes) -> list[bytes]:
        out = []
        while data:
            piece = self.z.decompress(data, CHUNK)
            if piece:
                out.append(piece)
            if self.z.eof:  # what follows is another gzip member (or garbage: zlib.error)
                data = self.z.unused_data
                self.z = zlib.decompressobj(wbits=32 + zlib.MAX_WBITS)
            else:
                data = self.z.unconsumed_tail
        return out

    def flush(self) -> bytes:
        return self.z.flush()


class Scrubber:
    """A response's way back: every secret value in it replaced by its placeholder, so an
    allowed host that echoes the request (or hands a token out) gives the guest the
    placeholder, never the value. Streaming: the last len(longest value) - 1 bytes wait
    for the next chunk (a value split across two chunks is still found)."""

    def __init__(self, pairs: list[tuple[bytes, bytes]]) -> None:
        self.pairs = pairs
        self.keep = max((len(v) for v, _ in pairs), default=1) - 1
        self.tail = b""

    def line(self, data: bytes) -> bytes:
        return secrets_model.substitute(data, self.pairs)

    def feed(self, data: bytes) -> bytes:
        if not self.pairs:
            return data
        buf = secrets_model.substitute(self.tail + data, self.pairs)
        if self.keep <= 0:
            self.tail = b""
            return buf
        self.tail = buf[-self.keep :]
        return buf[: -self.keep]

    def flush(self) -> bytes:
        rest, self.tail = self.tail, b""
        return rest


_EXPECTED = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.TooSlowError,
    ssl.SSLError,
    OSError,
    zlib.error,
)


def _expected(exc: BaseException) -> bool:
    """What ends a connection in the ordinary course (a group of such too: the splice's)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_expected(e) for e in exc.exceptions)
    return isinstance(exc, (*_EXPECTED, h11.ProtocolError))


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verification failed ({exc.verify_message})"
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    return type(exc).__name__ if not str(exc) else str(exc)[:200]


async def _next(conn: h11.Connection, stream: trio.abc.Stream) -> Any:
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            with trio.fail_after(IDLE_TIMEOUT):
                data = await stream.receive_some(CHUNK)
            conn.receive_data(bytes(data))
            continue
        if ev is h11.PAUSED:
            return h11.ConnectionClosed()
        return ev


async def _send(conn: h11.Connection, stream: trio.abc.Stream, event: Any) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


async def _answer(g: h11.Connection, guest: trio.abc.Stream, status: int, text: str) -> None:
    """The proxy's own answer, then the connection ends (nothing when a response has
    begun already)."""
    body = text.encode()
    headers = [
        (b"content-type", b"text/plain"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    response = h11.Response(status_code=status, headers=headers, reason=_reason(status))
    if g.our_state is h11.SEND_RESPONSE:
        await _send(g, guest, response)
        await _send(g, guest, h11.Data(data=body))
        await _send(g, guest, h11.EndOfMessage())
    elif g.our_state is h11.IDLE and g.their_state is h11.ERROR:  # (a request head h11 refused)
        head = b"HTTP/1.1 %d %s\r\n" % (status, response.reason)
        await guest.send_all(head + b"".join(b"%s: %s\r\n" % kv for kv in headers) + b"\r\n" + body)


async def _pump(src: trio.abc.Stream, dst: trio.abc.Stream) -> None:
    try:
        while True:
            with trio.fail_after(IDLE_TIMEOUT * 5):
                data = await src.receive_some(CHUNK)
            if not data:
                break
            await dst.send_all(data)
        if isinstance(dst, trio.SocketStream):
            await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError):
        pass
