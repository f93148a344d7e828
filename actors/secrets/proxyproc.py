"""The secret proxy's process: ``python -m actors.secrets.proxyproc CONTROL_FD CONNS_FD``,
one per sandbox, started by actors/net/secretcell.py in a cell of its own (an
unprivileged id, no capabilities, no_new_privs, its own mount, pid, network (empty)
namespaces, rlimits, a cgroup). All the parsing of guest-chosen bytes (the ClientHello,
TLS, HTTP) happens here. It holds one sandbox's secrets (sent over the control channel,
actors/secrets/wire.py), reaches the network only through the upstream sockets the
supervisor hands it with each connection, and ends when the control channel closes
(the supervisor stopped it, or died)."""

from __future__ import annotations

import array
import logging
import socket
import ssl
import sys
from typing import Any

import trio

from actors.secrets import model as secrets_model
from actors.secrets import wire
from actors.secrets.ca import Minter
from actors.secrets.secretproxy import Blocked, ProxyView, SecretProxy

log = logging.getLogger("sandvisor.secrets.proxy")

MAX_FDS = 2
GEN_WAIT = 30.0  # a connection waits at most this for the config it was accepted under
MAX_CONNECTIONS = 256  # live at once (more are closed as they come)
EVENTS_BUFFERED = 64  # reports waiting to go up (more are dropped)


class State:
    """What the supervisor sent last."""

    def __init__(self) -> None:
        self.gen = -1
        self.refs: list[secrets_model.SecretRef] = []
        self.values: dict[str, bytes] = {}
        self.minter: Minter | None = None
        self.upstream: ssl.SSLContext | None = None
        self.ca: tuple[bytes, bytes] = (b"", b"")
        self.upstream_ca = b""
        self.changed = trio.Event()

    def apply(self, msg: dict[str, Any]) -> None:
        refs, values = [], {}
        for name, hosts, placeholder, value, substitute in msg["secrets"]:
            where = secrets_model.ALL if substitute == secrets_model.ALL else secrets_model.HEADERS
            refs.append(
                secrets_model.SecretRef(
                    str(name), tuple(str(h) for h in hosts), placeholder=str(placeholder), substitute=where
                )
            )
            if value is not None:
                values[str(name)] = bytes(value)
        ca = (bytes(msg["ca"][0]), bytes(msg["ca"][1]))
        if ca != self.ca:
            self.minter, self.ca = Minter(*ca), ca
        upstream_ca = bytes(msg.get("upstream_ca", b""))
        if self.upstream is None or upstream_ca != self.upstream_ca:
            ctx = ssl.create_default_context()
            if upstream_ca:
                ctx.load_verify_locations(cadata=upstream_ca.decode())
            ctx.set_alpn_protocols(["http/1.1"])
            self.upstream, self.upstream_ca = ctx, upstream_ca
        self.refs, self.values = refs, values
        self.gen = int(msg["gen"])
        self.changed.set()
        self.changed = trio.Event()

    async def reached(self, gen: int) -> None:
        while self.gen < gen:
            await self.changed.wait()


async def serve(control: trio.socket.SocketType, conns: trio.socket.SocketType) -> None:
    state = State()
    send_events, receive_events = trio.open_memory_channel[dict[str, Any]](EVENTS_BUFFERED)

    def blocked(b: Blocked) -> None:
        try:
            send_events.send_nowait({"t": "blocked", "secret": b.secret, "host": b.host[:253], "port": b.port})
        except trio.WouldBlock:
            pass

    def minter() -> Minter:
        assert state.minter is not None
        return state.minter

    view = ProxyView(refs=lambda: state.refs, value=lambda r: state.values.get(r.name), minter=minter, blocked=blocked)
    proxy = SecretProxy(view, upstream=ssl.create_default_context())

    async def read_control() -> None:
        frames = wire.Frames(wire.DOWN_MAX)
        while data := await control.recv(1 << 20):
            for msg in frames.feed(data):
                if msg.get("t") == "config":
                    state.apply(msg)
                    assert state.upstream is not None
                    proxy.upstream = state.upstream

    async def write_events() -> None:
        async for msg in receive_events:
            data = wire.frame(msg)
            while data:
                n = await control.send(data)
                data = data[n:]

    live = 0

    async def one(guest: socket.socket, up: socket.socket | None, head: dict[str, Any]) -> None:
        nonlocal live
        g = trio.socket.from_stdlib_socket(guest)
        u = trio.socket.from_stdlib_socket(up) if up is not None else None
        live += 1
        try:
            with trio.fail_after(GEN_WAIT):
                await state.reached(int(head["gen"]))
            if live > MAX_CONNECTIONS:
                raise trio.TooSlowError
        except trio.TooSlowError:
            g.close()
            if u is not None:
                u.close()
            live -= 1
            return
        try:
            dst = (str(head["dst"][0]), int(head["dst"][1]))
            await proxy.handle(g, dst, u, str(head.get("err", "")))
        except Exception:  # (nothing one connection does ends the process)
            log.exception("a connection failed")
        finally:
            live -= 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_events)

        async def conns_loop() -> None:
            fds_size = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
            while True:
                data, ancdata, _flags, _addr = await conns.recvmsg(wire.CONN_MAX, fds_size)
                fds: list[int] = []
                for level, kind, payload in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        a = array.array("i")
                        a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
                        fds.extend(a)
                if not data and not fds:
                    return  # the supervisor closed it
                socks = [socket.socket(fileno=fd) for fd in fds]
                for extra in socks[MAX_FDS:]:
                    extra.close()
                if not socks:
                    continue
                head = wire.unpack(data)
                nursery.start_soon(one, socks[0], socks[1] if len(socks) > 1 else None, head)

        nursery.start_soon(conns_loop)
        await read_control()  # EOF: the supervisor is done with us
        nursery.cancel_scope.cancel()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="secret proxy: %(levelname)s %(message)s")
    control = socket.socket(fileno=int(argv[0]))
    conns = socket.socket(fileno=int(argv[1]))

    async def run() -> None:
        await serve(trio.socket.from_stdlib_socket(control), trio.socket.from_stdlib_socket(conns))

    trio.run(run)


if __name__ == "__main__":
    main(sys.argv[1:])
