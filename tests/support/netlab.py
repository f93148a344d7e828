"""A network laboratory in namespaces the tests make (no traffic leaves them).

    "internet" netns (svi-*)                       "host" netns (svh-*): HostNetwork under test
      eth0 198.51.100.1/24  <---- veth ---->  up0 198.51.100.2/24 (default route)
      lo   203.0.113.10, .20, .30 (servers)        services on 127.0.0.1, the uplink and 0.0.0.0
      lo   169.254.169.254 (a metadata server)     svn... ----- veth -----> "guest" netns (svg-*): eth0 10.88.x.y
      lo   10.77.0.10 (a LAN service), 100.100.100.200 (a cloud metadata service): private,
           reachable only by a policy that names them
      DNS server 198.51.100.1:53

Every namespace (and so every link and nft table in it) is deleted on the way out,
whatever happened.

A whole supervisor can run as the "host": a test enters the host namespace with
``host.entered()`` around its whole body (the main thread, where Trio and the
supervisor run), so the supervisor's sockets, links, sysctls, nftables and every
process it starts (QEMU, ``ip``) are in that namespace, and the machine's own is
never touched. (Trio's cached worker threads stay where they were made: only
non-network work runs there.)
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from ipaddress import IPv4Address
from typing import Any

import attrs
import trio

from actors.net import dnsmsg
from actors.net.egress import EgressPolicy
from actors.net.hostnet import HostNetConfig, HostNetwork, SandboxLink
from actors.net.ippool import IpPool, MemoryLeases, link_name
from actors.net.netns import NetNS

UPLINK_HOST = "198.51.100.2"
UPLINK_INET = "198.51.100.1"
SERVERS = ("203.0.113.10", "203.0.113.20", "203.0.113.30")
METADATA = "169.254.169.254"
# private addresses (actors.net.egress.PRIVATE4) behind the uplink: closed even under default
# allow; the stand-in internet above uses documentation ranges, which stay open
LAN = "10.77.0.10"
CLOUD_METADATA = "100.100.100.200"
POOL = "10.88.0.0/16"
ZONE = {
    "allowed.test": "203.0.113.20",
    "other.test": "203.0.113.30",
    "cdn.allowed.test": "203.0.113.20",
    "rebind.test": LAN,  # a public name that answers a private address (DNS rebinding)
    # the secret proxy's tests (tests/support/httpslab.py: one HTTPS server for the three)
    "api.test": "203.0.113.10",
    "plain.test": "203.0.113.20",
}


def sh(*argv: str, check: bool = True) -> None:
    subprocess.run(argv, check=check, capture_output=True)


@contextlib.contextmanager
def namespaces(*prefixes: str) -> Iterator[list[NetNS]]:
    made: list[str] = []
    try:
        for p in prefixes:
            name = f"{p}-{secrets.token_hex(4)}"
            sh("ip", "netns", "add", name)
            made.append(name)
            sh("ip", "-n", name, "link", "set", "lo", "up")
        yield [NetNS(n) for n in made]
    finally:
        for name in made:
            sh("ip", "netns", "del", name, check=False)


def link_internet(host: NetNS, inet: NetNS) -> None:
    assert host.name and inet.name
    tmp = f"svl{secrets.token_hex(4)}"
    sh("ip", "-n", host.name, "link", "add", "up0", "type", "veth", "peer", "name", tmp, "netns", inet.name)
    sh("ip", "-n", inet.name, "link", "set", tmp, "name", "eth0")
    for cmd in (
        [host.name, "addr", "add", f"{UPLINK_HOST}/24", "dev", "up0"],
        [host.name, "link", "set", "up0", "up"],
        [host.name, "route", "add", "default", "via", UPLINK_INET],
        [inet.name, "addr", "add", f"{UPLINK_INET}/24", "dev", "eth0"],
        [inet.name, "link", "set", "eth0", "up"],
        *([inet.name, "addr", "add", f"{a}/32", "dev", "lo"] for a in (*SERVERS, METADATA, LAN, CLOUD_METADATA)),
    ):
        sh("ip", "-n", *cmd)


def add_guest(host: NetNS, guest: NetNS, link: str, address: IPv4Address, prefix: int, gateway: IPv4Address) -> None:
    """A veth standing in for a TAP: ``link`` on the host side, eth0 in the guest."""
    assert host.name and guest.name
    tmp = f"svl{secrets.token_hex(4)}"
    sh("ip", "-n", host.name, "link", "add", link, "type", "veth", "peer", "name", tmp, "netns", guest.name)
    sh("ip", "-n", guest.name, "link", "set", tmp, "name", "eth0")
    sh("ip", "-n", guest.name, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
    sh("ip", "-n", guest.name, "link", "set", "eth0", "up")
    sh("ip", "-n", guest.name, "route", "add", "default", "via", str(gateway))


async def tcp_server(
    ns: NetNS, address: str, port: int, label: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Answers every connection with ``label`` and the peer's address, then closes."""
    s = ns.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port))
    s.listen(64)
    sock = trio.socket.from_stdlib_socket(s)
    with sock:
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                conn, peer = await sock.accept()

                async def reply(c: trio.socket.SocketType = conn, p: tuple[str, int] = peer) -> None:
                    with c:
                        await c.send(f"{label} {p[0]}\n".encode())

                nursery.start_soon(reply)


async def dns_server(
    ns: NetNS, address: str, *, ttl: int = 300, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> None:
    """The stand-in internet's resolver for ZONE (NXDOMAIN otherwise); logs the names asked."""
    s = ns.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((address, 53))
    sock = trio.socket.from_stdlib_socket(s)
    asked: list[str] = []
    with sock:
        task_status.started(asked)
        while True:
            data, peer = await sock.recvfrom(4096)
            try:
                mid, flags, q = dnsmsg.parse_query(data)
            except dnsmsg.DnsError:
                continue
            asked.append(q.name)
            answers: tuple[dnsmsg.Record, ...] = ()
            rcode = dnsmsg.NXDOMAIN
            if q.name == "www.allowed.test":  # a CNAME chain
                answers = (
                    dnsmsg.Record(q.name, dnsmsg.CNAME, dnsmsg.IN, ttl, b"", target="cdn.allowed.test"),
                    dnsmsg.address_record("cdn.allowed.test", IPv4Address(ZONE["cdn.allowed.test"]), ttl),
                )
                rcode = dnsmsg.NOERROR
            elif q.name in ZONE:
                rcode = dnsmsg.NOERROR
                if q.qtype == dnsmsg.A:
                    answers = (dnsmsg.address_record(q.name, IPv4Address(ZONE[q.name]), ttl),)
            msg = dnsmsg.Message(mid, dnsmsg.QR | dnsmsg.RA | (flags & dnsmsg.RD) | rcode, (q,), answers)
            await sock.sendto(dnsmsg.build(msg), peer)


async def probe(ns: NetNS, address: str, port: int, timeout: float = 3.0) -> str:
    """What a TCP connect from ``ns`` gets: the server's line, or the error's name."""
    sock = trio.socket.from_stdlib_socket(ns.socket(socket.AF_INET, socket.SOCK_STREAM))
    with sock:
        try:
            with trio.fail_after(timeout):
                await sock.connect((address, port))
                return (await sock.recv(200)).decode().strip() or "closed"
        except trio.TooSlowError:
            return "timeout"
        except OSError as exc:
            return type(exc).__name__


async def resolve(ns: NetNS, server: str, name: str, timeout: float = 3.0) -> tuple[int, list[str]]:
    """(rcode, IPv4 addresses) of an A query from ``ns``; rcode -1: no answer."""
    sock = trio.socket.from_stdlib_socket(ns.socket(socket.AF_INET, socket.SOCK_DGRAM))
    with sock:
        await sock.connect((server, 53))
        await sock.send(dnsmsg.query(name, dnsmsg.A, mid=4242))
        with trio.move_on_after(timeout):
            msg = dnsmsg.parse(await sock.recv(4096))
            return msg.rcode, [str(a) for a, _ in dnsmsg.answered_addresses(msg, name)]
    return -1, []


# -- the whole lab: HostNetwork under test in the host namespace -------------------------
@attrs.define
class Guest:
    ns: NetNS
    link: SandboxLink
    address: str


@attrs.define
class Lab:
    host: NetNS
    inet: NetNS
    net: HostNetwork
    pool: IpPool
    asked: list[str]
    stack: contextlib.ExitStack
    nursery: trio.Nursery

    def guest(self, owner: str, policy: dict[str, Any] | None = None) -> Guest:
        (ns,) = self.stack.enter_context(namespaces("svg"))
        address = self.pool.allocate(owner)
        name = link_name(owner)
        add_guest(self.host, ns, name, address, self.pool.prefix, self.pool.gateway)
        link = self.net.attach(name, address, EgressPolicy.parse(policy))
        self.stack.callback(link.close)
        return Guest(ns, link, str(address))


@contextlib.asynccontextmanager
async def lab_env(*, dns_ttl: int = 300, min_ttl: int = 30, grace: int = 10, timeout: float = 60) -> AsyncIterator[Lab]:
    with contextlib.ExitStack() as stack:
        host, inet = stack.enter_context(namespaces("svh", "svi"))
        link_internet(host, inet)
        async with trio.open_nursery() as nursery:
            for i, addr in enumerate(SERVERS):
                await nursery.start(tcp_server, inet, addr, 80, f"server{i}")
            await nursery.start(tcp_server, inet, METADATA, 80, "metadata")
            await nursery.start(tcp_server, inet, LAN, 80, "lan")
            await nursery.start(tcp_server, inet, CLOUD_METADATA, 80, "cloud-metadata")
            await nursery.start(tcp_server, inet, UPLINK_INET, 80, "uplink-peer")
            asked = await nursery.start(functools.partial(dns_server, ttl=dns_ttl), inet, UPLINK_INET)
            await nursery.start(tcp_server, host, "127.0.0.1", 8080, "host-loopback")
            await nursery.start(tcp_server, host, "0.0.0.0", 8081, "host-any")
            pool = IpPool(POOL, MemoryLeases())
            net = HostNetwork(HostNetConfig(netns=host, upstreams=((UPLINK_INET, 53),)), pool)
            net.dns.min_ttl, net.dns.grace = min_ttl, grace
            await nursery.start(net.run)
            try:
                with trio.fail_after(timeout):
                    yield Lab(host, inet, net, pool, asked, stack, nursery)
            finally:
                nursery.cancel_scope.cancel()


@contextlib.contextmanager
def forwarded(ns: NetNS, port: int) -> Iterator[int]:
    """A loopback port of the caller's namespace relayed to 127.0.0.1:``port`` inside
    ``ns``. A client whose threads are not the caller's (an HTTP library's own runtime,
    made by an earlier test in the root namespace) reaches a server listening in ``ns``;
    entering ``ns`` on the test's thread would not move them."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    opened: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed: the block ended
                return
            opened.append(client)
            try:
                with ns.entered():
                    inner = socket.create_connection(("127.0.0.1", port), timeout=10)
            except OSError:
                client.close()
                continue
            inner.settimeout(None)
            opened.append(inner)
            for a, b in ((client, inner), (inner, client)):
                t = threading.Thread(target=pipe, args=(a, b), name="forwarded-pipe")
                threads.append(t)
                t.start()

    acceptor = threading.Thread(target=accept, name="forwarded-accept")
    acceptor.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        acceptor.join(10)
        for sock in opened:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for t in threads:
            t.join(10)
