"""Exposed ports: a host port forwarded to a sandbox port (tap: the sandbox's address).

sandbox.v1's design: "the daemon binds a host listener forwarding into the guest". A
userspace relay, one Trio task per mapping::

    client --> 127.0.0.1:host_port (the supervisor's listener) ==> sandbox_ip:sandbox_port
               (supervisor's netns)           one task per connection, both directions

Chosen over an nftables DNAT from the host's loopback (measured side by side in
benchmarks/network_tap.py, see :func:`dnat_rules` for the variant): the listener
*holds* the port (a DNAT rule reserves nothing: another process may bind the same
port and the two silently shadow each other), the relay needs no
``route_localnet=1`` on the sandbox links (which makes 127/8 routable there: the
CVE-2020-8558 class of hole) and no source NAT of 127.0.0.1, it works unchanged
for every network mode (the target socket is created in whichever namespace holds
the sandbox's address: the jail's QEMU namespace for user mode), and when the
sandbox stops nothing stays behind in the kernel. The price is a copy through the
supervisor; under TCG the guest is far slower than the relay (measured).

UDP: one connected socket towards the sandbox per client address, dropped after
``UDP_IDLE`` seconds without traffic, at most ``UDP_FLOWS`` at once.

Whoever can reach the host port (any local user, for a loopback listener) and the
guest behind it are both untrusted: each connection (each UDP flow) is its own error
boundary, and nothing either side does (resets, descriptor exhaustion, a target
namespace gone) ends the relay, let alone the sandbox it runs under: an accept that
fails waits ``ACCEPT_BACKOFF`` and goes on.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable
from ipaddress import IPv4Address

import attrs
import trio

from actors.net.egress import TABLE
from actors.net.netns import NetError, NetNS

log = logging.getLogger("sandvisor.ports")

UDP_IDLE = 60.0
UDP_FLOWS = 256
CONNECT_TIMEOUT = 10.0
ACCEPT_BACKOFF = 0.1  # out of descriptors (or memory): the next accept waits this long


class PortInUse(OSError):
    """The host port is taken (ALREADY_EXISTS)."""


@attrs.frozen
class Target:
    """Where a mapping's traffic goes: an address and port in a namespace."""

    address: str
    port: int
    netns: NetNS = attrs.field(factory=NetNS)


def bind_listener(address: str, port: int, kind: int, netns: NetNS | None = None) -> socket.socket:
    """A socket bound to ``address:port`` (0: the kernel picks), or :class:`PortInUse`."""
    s = (netns or NetNS()).socket(socket.AF_INET, kind)
    try:
        if kind == socket.SOCK_STREAM:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
        if kind == socket.SOCK_STREAM:
            s.listen(128)
    except OSError as exc:
        s.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(exc.errno, f"host port {port} is in use on {address}") from None
        raise
    return s


async def relay_tcp(
    listener: socket.socket, target: Target, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve a bound TCP listener until cancelled; ``started`` with the host port."""
    lsock = trio.socket.from_stdlib_socket(listener)
    with lsock:
        port = lsock.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(port)
            while True:
                try:
                    conn, _ = await lsock.accept()
                except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED...
                    log.warning("port %d: accepting: %s", port, exc)
                    await trio.sleep(ACCEPT_BACKOFF)
                    continue
                nursery.start_soon(_tcp_pair, trio.SocketStream(conn), target)


async def _tcp_pair(client: trio.SocketStream, target: Target) -> None:
    """One connection, its own error boundary: whatever happens, it closes and the
    relay serves on."""
    try:
        async with client:
            await _tcp_relay(client, target)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    except Exception:  # a bug or an error nobody foresaw: logged, never the relay's end
        log.exception("port relay to %s:%d: a connection failed", target.address, target.port)


async def _tcp_relay(client: trio.SocketStream, target: Target) -> None:
    try:
        raw = target.netns.socket(socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, NetError) as exc:  # out of descriptors, the target's namespace gone
        log.warning("port relay to %s:%d: %s", target.address, target.port, exc)
        return
    sock = trio.socket.from_stdlib_socket(raw)
    with sock:
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                await sock.connect((target.address, target.port))
        except (OSError, trio.TooSlowError):
            return  # the client sees the connection close: nothing listens in the sandbox
        upstream = trio.SocketStream(sock)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        async with upstream, trio.open_nursery() as nursery:
            nursery.start_soon(_pump, client, upstream, nursery.cancel_scope)
            nursery.start_soon(_pump, upstream, client, nursery.cancel_scope)


async def _pump(src: trio.SocketStream, dst: trio.SocketStream, scope: trio.CancelScope) -> None:
    try:
        while data := await src.receive_some(65536):
            await dst.send_all(data)
        await dst.send_eof()  # half-close: an HTTP/1.0 client that shuts down its side still gets the answer
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        scope.cancel()


async def relay_udp(
    listener: socket.socket, target: Target, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve a bound UDP socket until cancelled; ``started`` with the host port."""
    lsock = trio.socket.from_stdlib_socket(listener)
    flows: dict[tuple[str, int], tuple[trio.socket.SocketType, trio.CancelScope]] = {}
    with lsock:
        port = lsock.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(port)
            while True:
                try:
                    data, peer = await lsock.recvfrom(65535)
                except OSError as exc:  # (ENOMEM, ENOBUFS...)
                    log.warning("port %d: receiving: %s", port, exc)
                    await trio.sleep(ACCEPT_BACKOFF)
                    continue
                flow = flows.get(peer)
                if flow is None:
                    if len(flows) >= UDP_FLOWS:
                        continue
                    try:
                        up = trio.socket.from_stdlib_socket(target.netns.socket(socket.AF_INET, socket.SOCK_DGRAM))
                    except (OSError, NetError) as exc:  # out of descriptors, the target's namespace gone
                        log.warning("port relay to %s:%d: %s", target.address, target.port, exc)
                        continue
                    try:
                        await up.connect((target.address, target.port))
                    except OSError:
                        up.close()
                        continue
                    scope = trio.CancelScope()
                    flow = flows[peer] = (up, scope)
                    nursery.start_soon(_udp_back, lsock, up, peer, scope, lambda p=peer: flows.pop(p, None))
                try:
                    await flow[0].send(data)
                except OSError:
                    pass
                flow[1].deadline = trio.current_time() + UDP_IDLE


async def _udp_back(
    lsock: trio.socket.SocketType,
    up: trio.socket.SocketType,
    peer: tuple[str, int],
    scope: trio.CancelScope,
    forget: Callable[[], object],
) -> None:
    with up, scope:
        scope.deadline = trio.current_time() + UDP_IDLE
        while True:
            try:
                data = await up.recv(65535)
                await lsock.sendto(data, peer)
            except OSError:
                pass  # ICMP port unreachable from the sandbox: keep the flow until idle
            scope.deadline = trio.current_time() + UDP_IDLE
    forget()


# -- the nftables DNAT variant (measured against the relay; not the default) ------------
def dnat_base() -> list[str]:
    """Chains for :func:`dnat_rules` (added to the supervisor's table). Needs
    ``route_localnet=1`` on each sandbox link: locally generated packets from 127.0.0.1
    may not leave through another interface otherwise."""
    t = f"inet {TABLE}"
    return [
        f"add map {t} ports4 {{ type inet_proto . inet_service : ipv4_addr . inet_service; }}",
        f"add chain {t} hook_nat_output {{ type nat hook output priority -100; policy accept; }}",
        f"add rule {t} hook_nat_output ip daddr 127.0.0.1 dnat ip to meta l4proto . th dport map @ports4",
        f"add chain {t} hook_nat_post_local {{ type nat hook postrouting priority 100; policy accept; }}",
        f'add rule {t} hook_nat_post_local ip saddr 127.0.0.0/8 oifname "svn*" masquerade',
    ]


def dnat_rules(protocol: str, host_port: int, address: IPv4Address, port: int) -> list[str]:
    return [f"add element inet {TABLE} ports4 {{ {protocol} . {host_port} : {address} . {port} }}"]
