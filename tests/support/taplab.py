"""A whole supervisor with tap networking in a "host" network namespace the test makes
(tests/support/netlab.py: the main thread enters it), linked to a stand-in internet with
its servers; and the calls the tap tests make on its sandboxes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from actors.model import Egress, NetMode, Network, SandboxConfig, State
from actors.net.netns import NetNS
from actors.registry import Registry
from actors.sandboxes.sandbox import Sandbox
from supervisor.main.throwaway import Workdir, supervisor, workdir
from tests.support.netlab import (
    METADATA,
    POOL,
    SERVERS,
    UPLINK_INET,
    dns_server,
    link_internet,
    namespaces,
    probe,
    tcp_server,
)

GATEWAY = "10.88.0.1"
# answers every connection with "vm <its own address> <the peer's>" (a clone's own
# address shows that it was reconfigured; the server survives the restore)
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
while True:
    c, peer = s.accept()
    c.sendall(("vm " + c.getsockname()[0] + " " + peer[0] + "\\n").encode()); c.close()
"""
# one exec, many TCP probes: "host:port ..." -> the first word each answered, or the error's name
FETCH = """
import socket, sys
def get(h, p):
    try:
        s = socket.create_connection((h, int(p)), timeout=3)
        return (s.recv(100).decode().split() or ["closed"])[0]
    except OSError as e:
        return type(e).__name__
print(" ".join(get(*a.rsplit(":", 1)) for a in sys.argv[1:]))
"""


@attrs.define
class NetLab:
    host: NetNS
    inet: NetNS
    work: Workdir


@asynccontextmanager
async def net_lab(prefix: str) -> AsyncIterator[NetLab]:
    """A fresh host namespace (entered: the test and its supervisor run there), linked
    to a fresh internet namespace with its servers, and a supervisor's work dir."""
    with namespaces("svh", "svi") as (host, inet):
        link_internet(host, inet)
        with host.entered():
            async with trio.open_nursery() as nursery:
                for i, addr in enumerate(SERVERS):
                    await nursery.start(tcp_server, inet, addr, 80, f"server{i}")
                await nursery.start(tcp_server, inet, METADATA, 80, "metadata")
                await nursery.start(dns_server, inet, UPLINK_INET)
                await nursery.start(tcp_server, host, "127.0.0.1", 8080, "host-loopback")
                await nursery.start(tcp_server, host, "0.0.0.0", 8081, "host-any")
                with workdir(prefix, private_state=True) as work:
                    yield NetLab(host, inet, work)
                nursery.cancel_scope.cancel()


@asynccontextmanager
async def serving(lab: NetLab, **options: Any) -> AsyncIterator[Registry]:
    """The supervisor under test, with tap networking: pool 10.88.0.0/16, the stand-in
    internet's DNS server as upstream."""
    opts = {"ip_pool": POOL, "dns_upstreams": (UPLINK_INET,), "stop_timeout": 5, **options}
    async with supervisor(lab.work, **opts) as (_, registry):
        yield registry


def tap(egress: Egress | None = None, **kw: Any) -> SandboxConfig:
    return SandboxConfig(network=Network(mode=NetMode.TAP, egress=egress), **kw)


async def ready(sb: Sandbox) -> Sandbox:
    with trio.fail_after(180):
        await sb.ready_event.wait()
    assert sb.state == State.READY, sb.record.error
    return sb


async def sh(sb: Sandbox, script: str) -> str:
    res = await sb.guest_call(lambda g: g.channel.run(["sh", "-c", script], timeout=60))
    assert res.exit_code == 0, (res.stdout, res.stderr)
    return res.stdout.decode()


async def start_server(sb: Sandbox, port: int = 8000) -> None:
    await sb.guest_call(lambda g: g.channel.write_file("/tmp/srv.py", SERVER.encode()))
    await sh(sb, f"python3 /tmp/srv.py {port} >/dev/null 2>&1 &")


async def fetch(sb: Sandbox, *targets: str) -> list[str]:
    await sb.guest_call(lambda g: g.channel.write_file("/tmp/fetch.py", FETCH.encode()))
    return (await sh(sb, f"python3 /tmp/fetch.py {' '.join(targets)}")).split()


async def reach(ns: NetNS, address: str, port: int, want: str) -> None:
    """Until a TCP connect from ``ns`` is answered with ``want`` (a server just started)."""
    with trio.fail_after(60):
        while (got := await probe(ns, address, port)) != want:
            await trio.sleep(0.2)
    del got
