"""The sandboxes' resolver: a DNS proxy on the gateway address (UDP and TCP, port 53).

Every sandbox's resolv.conf names the gateway (or the nameservers its Create gave);
the filter redirects whatever a sandbox sends to port 53 of any address here (a
nameserver the guest names is a name for this proxy, never a way around it), and lets
a sandbox reach the host on that port and nothing else. A query is judged by the sandbox's egress
policy (the sender is known by its source address: the prerouting filter drops
anything a sandbox sends from another) and by the queried name::

    guest            proxy (supervisor, Trio)                 upstream     nftables
      | A? x.com       |                                         |            |
      |--------------->| policy(x.com): allow                    |            |
      |                |---------------- query (new id) -------->|            |
      |                |<--------------- answer -----------------|            |
      |                | A records of x.com (and its CNAME chain)|            |
      |                |------ add element <link>_dns {ip timeout ttl} ------>|
      |<---------------| answer (the guest's id)                 |            |
      | connect ip:443 |                                         |      @<link>_dns: accept

- a denied name: REFUSED (and its addresses, resolved upstream, go to the
  sandbox's deny set for their TTL: a guest that learnt them elsewhere is still
  stopped when its default is allow);
- a name no entry matches: forwarded as is when the default is allow, REFUSED
  when it is deny;
- an unknown sender: no answer; a malformed query: FORMERR; a name whose labels
  hold a dot, a backslash or an octet outside printable ASCII (the policy matches
  names as text, which such labels would make ambiguous): REFUSED, never forwarded.

Every query is handled in its own error boundary (a UDP datagram, a TCP
connection): whatever the guest sends, the worst it gets is SERVFAIL or silence,
an unexpected error is logged and counted (``stats["errors"]``), and the proxy
serves on. Error answers echo the question's own octets (dnsmsg.error_response).

The set entries outlive the answer's TTL by a grace period and never last less
than ``min_ttl`` (clients connect right after a TTL-0 answer). The filter is updated
*before* the answer goes back, so the guest's first connection is never refused.
"""

from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network

import attrs
import trio

from actors.net import dnsmsg
from actors.net.egress import EgressPolicy, dns_deny_set, dns_set_name, dns_update, may_open
from actors.net.netns import NetNS
from actors.net.nft import Nft, NftError

log = logging.getLogger("sandvisor.dns")

MAX_INFLIGHT_PER_CLIENT = 64
MAX_TCP_PER_CLIENT = 4
TCP_IDLE = 10.0
UPSTREAM_TIMEOUT = 2.0
ACCEPT_BACKOFF = 0.1  # out of descriptors (or memory): the next accept waits this long
LOGGED_ERRORS = 20  # unexpected errors logged with their traceback; then one in 1000


@attrs.frozen
class Client:
    link: str
    policy: EgressPolicy


@attrs.define
class _State:
    client: Client
    inflight: int = 0
    tcp: int = 0


class DnsProxy:
    """``address``: the gateway (the proxy's sockets are bound there, in ``netns``).
    ``upstreams``: (address, port) of the resolvers queries are forwarded to.
    ``closed``: ranges never opened whatever an answer says (the invariants and the
    sandbox pool: a name that resolves to a sandbox or to the metadata service opens
    nothing)."""

    def __init__(
        self,
        address: IPv4Address,
        upstreams: Sequence[tuple[str, int]],
        nft: Nft,
        *,
        netns: NetNS | None = None,
        port: int = 53,
        closed: Sequence[IPv4Network] = (),
        min_ttl: int = 30,
        max_ttl: int = 86400,
        grace: int = 10,
    ) -> None:
        self.address = address
        self.upstreams = list(upstreams)
        self.nft = nft
        self.netns = netns or NetNS()
        self.port = port
        self.closed = list(closed)
        self.min_ttl, self.max_ttl, self.grace = min_ttl, max_ttl, grace
        self._clients: dict[IPv4Address, _State] = {}
        self.stats = {"queries": 0, "refused": 0, "forwarded": 0, "opened": 0, "failed": 0, "formerr": 0, "errors": 0}

    # -- registry (the sandbox's network handle calls these) ---------------------
    def register(self, address: IPv4Address, link: str, policy: EgressPolicy) -> None:
        self._clients[address] = _State(Client(link, policy))

    def unregister(self, address: IPv4Address) -> None:
        self._clients.pop(address, None)

    # -- serving -----------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[DnsProxy] = trio.TASK_STATUS_IGNORED) -> None:
        udp = trio.socket.from_stdlib_socket(self._bound(socket.SOCK_DGRAM))
        tcp = trio.socket.from_stdlib_socket(self._bound(socket.SOCK_STREAM))
        tcp.listen(64)
        with udp, tcp:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._serve_udp, udp, nursery)
                nursery.start_soon(self._serve_tcp, tcp, nursery)
                task_status.started(self)

    def _bound(self, kind: int) -> socket.socket:
        s = self.netns.socket(socket.AF_INET, kind)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((str(self.address), self.port))
        except OSError as exc:
            s.close()
            raise OSError(exc.errno, f"DNS proxy cannot bind {self.address}:{self.port}: {exc.strerror}") from None
        return s

    def _failed(self, what: str, host: IPv4Address) -> None:
        """An unexpected error handling one query (a bug, or an input nobody foresaw):
        counted and logged (the first ones with their traceback), and the proxy goes on."""
        self.stats["errors"] += 1
        n = self.stats["errors"]
        if n <= LOGGED_ERRORS or n % 1000 == 0:
            log.exception("DNS proxy: %s from %s failed (error %d; the proxy serves on)", what, host, n)

    async def _serve_udp(self, sock: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        while True:
            try:
                data, (host, port) = await sock.recvfrom(4096)
            except OSError as exc:  # (ENOMEM, ENOBUFS...): not the guest's to end the proxy
                log.warning("DNS proxy: receiving (udp): %s", exc)
                await trio.sleep(ACCEPT_BACKOFF)
                continue
            state = self._clients.get(IPv4Address(host))
            if state is None or state.inflight >= MAX_INFLIGHT_PER_CLIENT:
                continue
            state.inflight += 1
            nursery.start_soon(self._udp_one, sock, state, IPv4Address(host), port, data)

    async def _udp_one(
        self, sock: trio.socket.SocketType, state: _State, host: IPv4Address, port: int, data: bytes
    ) -> None:
        try:
            reply = await self.answer(host, data)
            if reply is not None:
                if len(reply) > 512 and not _has_edns(data):
                    reply = _truncated(data)
                try:
                    await sock.sendto(reply, (str(host), port))
                except OSError:
                    pass
        except Exception:  # this datagram's boundary: never the proxy's end
            self._failed("a UDP query", host)
        finally:
            state.inflight -= 1

    async def _serve_tcp(self, sock: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        while True:
            try:
                conn, (host, _port) = await sock.accept()
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED...
                log.warning("DNS proxy: accepting (tcp): %s", exc)
                await trio.sleep(ACCEPT_BACKOFF)
                continue
            state = self._clients.get(IPv4Address(host))
            if state is None or state.tcp >= MAX_TCP_PER_CLIENT:
                conn.close()
                continue
            state.tcp += 1
            nursery.start_soon(self._tcp_conn, trio.SocketStream(conn), state, IPv4Address(host))

    async def _tcp_conn(self, stream: trio.SocketStream, state: _State, host: IPv4Address) -> None:
        try:
            async with stream:
                buf = b""
                while True:
                    with trio.move_on_after(TCP_IDLE) as idle:
                        while True:
                            if len(buf) >= 2 and len(buf) >= 2 + int.from_bytes(buf[:2], "big"):
                                break
                            chunk = await stream.receive_some(65536)
                            if not chunk:
                                return
                            buf += chunk
                    if idle.cancelled_caught:
                        return
                    n = int.from_bytes(buf[:2], "big")
                    msg, buf = buf[2 : 2 + n], buf[2 + n :]
                    reply = await self.answer(host, msg)
                    if reply is None:
                        return
                    await stream.send_all(len(reply).to_bytes(2, "big") + reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
        except Exception:  # this connection's boundary: it closes, the proxy serves on
            self._failed("a TCP connection", host)
        finally:
            state.tcp -= 1

    # -- the decision (no sockets of the guest's here: testable directly) --------------
    async def answer(self, src: IPv4Address, data: bytes) -> bytes | None:
        """The bytes to send back to sandbox ``src`` for query ``data`` (None: silence).
        Never raises (but trio.Cancelled): a query it cannot or will not serve gets a
        well-formed FORMERR, REFUSED or SERVFAIL echoing its question, and one shorter
        than a DNS header (nothing to answer with) or from an unknown sender silence."""
        state = self._clients.get(src)
        if state is None:
            return None
        self.stats["queries"] += 1
        try:
            return await self._decide(state.client, data)
        except Exception:  # a bug, never the proxy's end: the guest gets SERVFAIL
            self._failed("a query", src)
            return _error(data, dnsmsg.SERVFAIL)

    async def _decide(self, client: Client, data: bytes) -> bytes | None:
        try:
            mid, _flags, q = dnsmsg.parse_query(data)
        except dnsmsg.DnsError:
            self.stats["formerr"] += 1
            return _error(data, dnsmsg.FORMERR)
        if not dnsmsg.is_plain(q.name):  # a dot or a raw octet inside a label: no policy can judge it
            self.stats["refused"] += 1
            return _error(data, dnsmsg.REFUSED)
        verdict, ports = client.policy.match_name(q.name)
        if verdict == "deny":
            self.stats["refused"] += 1
            if q.qtype in (dnsmsg.A, dnsmsg.ANY) and client.policy.default == "allow":
                reply = await self._forward(dnsmsg.query(q.name, dnsmsg.A))
                if reply is not None:
                    self._open(client.link, [dns_deny_set(client.link)], reply, q.name)
            return _error(data, dnsmsg.REFUSED)
        if verdict == "default" and client.policy.default == "deny":
            self.stats["refused"] += 1
            return _error(data, dnsmsg.REFUSED)
        reply = await self._forward(data)
        if reply is None:
            self.stats["failed"] += 1
            return _error(data, dnsmsg.SERVFAIL)
        self.stats["forwarded"] += 1
        if verdict == "allow" and not self._open(
            client.link, [dns_set_name(client.link, p) for p in ports], reply, q.name
        ):
            return _error(data, dnsmsg.SERVFAIL)
        return dnsmsg.with_id(reply, mid)

    def _open(self, link: str, sets: list[str], reply: bytes, qname: str) -> bool:
        """Put the answer's IPv4 addresses in ``sets``; False when the filter refused."""
        try:
            msg = dnsmsg.parse(reply)
        except dnsmsg.DnsError:
            return True  # nothing to open; the guest gets what upstream said
        by_ttl: dict[int, list[IPv4Address]] = {}
        for addr, ttl in dnsmsg.answered_addresses(msg, qname):
            if not isinstance(addr, IPv4Address) or not may_open(addr, self.closed):
                continue
            timeout = min(max(ttl, self.min_ttl), self.max_ttl) + self.grace
            by_ttl.setdefault(timeout, []).append(addr)
        cmds = [c for timeout, addrs in by_ttl.items() for c in dns_update(link, sets, addrs, timeout)]
        if not cmds:
            return True
        try:
            self.nft.run(cmds)
        except NftError as exc:  # the sandbox went away meanwhile (its sets with it)
            log.info("DNS answer for %s not opened for %s: %s", qname, link, exc)
            return False
        self.stats["opened"] += sum(len(a) for a in by_ttl.values())
        return True

    async def _forward(self, data: bytes) -> bytes | None:
        """Ask the upstreams in turn (UDP; TCP when the answer is truncated)."""
        try:
            _, _, q = dnsmsg.parse_query(data)
        except dnsmsg.DnsError:
            return None
        for host, port in self.upstreams:
            mid = secrets.randbits(16)
            out = dnsmsg.with_id(data, mid)
            try:
                reply = await self._udp_upstream(out, host, port)
                if reply is not None and _matches(reply, mid, q):
                    if dnsmsg.parse(reply).flags & dnsmsg.TC:
                        reply = await self._tcp_upstream(out, host, port)
                        if reply is None or not _matches(reply, mid, q):
                            continue
                    return reply
            except (OSError, dnsmsg.DnsError):
                continue
        return None

    async def _udp_upstream(self, data: bytes, host: str, port: int) -> bytes | None:
        sock = trio.socket.from_stdlib_socket(self.netns.socket(socket.AF_INET, socket.SOCK_DGRAM))
        with sock:
            await sock.connect((host, port))
            await sock.send(data)
            with trio.move_on_after(UPSTREAM_TIMEOUT):
                return bytes(await sock.recv(65535))
        return None

    async def _tcp_upstream(self, data: bytes, host: str, port: int) -> bytes | None:
        sock = trio.socket.from_stdlib_socket(self.netns.socket(socket.AF_INET, socket.SOCK_STREAM))
        with sock, trio.move_on_after(UPSTREAM_TIMEOUT):  # (closed whatever happens)
            await sock.connect((host, port))
            s = trio.SocketStream(sock)
            await s.send_all(len(data).to_bytes(2, "big") + data)
            buf = b""
            while len(buf) < 2 or len(buf) < 2 + int.from_bytes(buf[:2], "big"):
                chunk = await s.receive_some(65536)
                if not chunk:
                    return None
                buf += chunk
            return buf[2 : 2 + int.from_bytes(buf[:2], "big")]
        return None


def _matches(reply: bytes, mid: int, q: dnsmsg.Question) -> bool:
    try:
        msg = dnsmsg.parse(reply)
    except dnsmsg.DnsError:
        return False
    return msg.id == mid and msg.is_response and msg.questions[:1] == (q,)


def _error(query: bytes, rcode: int) -> bytes | None:
    """An error answer to ``query`` (None: shorter than a header, nothing to answer with)."""
    try:
        return dnsmsg.error_response(query, rcode)
    except dnsmsg.DnsError:
        return None


def _has_edns(query: bytes) -> bool:
    try:
        return any(r.rtype == dnsmsg.OPT for r in dnsmsg.parse(query).additional)
    except dnsmsg.DnsError:
        return False


def _truncated(query: bytes) -> bytes:
    """An empty answer with TC set: the client retries over TCP."""
    out = bytearray(dnsmsg.error_response(query, dnsmsg.NOERROR))
    out[2] |= dnsmsg.TC >> 8
    return bytes(out)


def resolv_conf_upstreams(path: str = "/etc/resolv.conf") -> list[tuple[str, int]]:
    """The host's resolvers (IPv4), for ``serve`` without --dns-upstream."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    try:
                        out.append((str(IPv4Address(parts[1])), 53))
                    except ValueError:
                        continue
    except OSError:
        pass
    return out
