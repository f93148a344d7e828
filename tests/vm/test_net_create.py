"""Networking given at Create, on real VMs through the whole supervisor: a UDP port
answered from the host, a port on a non-loopback bind address the operator opened
(reached from another network), named network profiles expanded to egress rules
(the built-in "private" and one of the operator's file), and a guest's own
nameservers and search domains whose lookups still go through the DNS proxy.

The supervisor runs in a "host" network namespace the test makes, next to a stand-in
internet (tests/support/taplab.py); no packet leaves the namespaces the test made.
"""

from __future__ import annotations

import os

import pytest
import trio

from actors.model import Egress, NetMode, PortSpec, Protocol
from actors.sandboxes.sandbox import Sandbox
from images.build import Image
from supervisor.client import AsyncSandbox, Dns, PermissionDenied
from tests.support.netlab import LAN, SERVERS, UPLINK_HOST, probe, tcp_server
from tests.support.taplab import GATEWAY, NetLab, fetch, net_lab, reach, serving, sh, start_server

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, TAP, jail)")

PROFILES = f"""
[profile.corp]
default = "deny"
allow = ["allowed.test", "{SERVERS[0]}"]
"""
UDP_ECHO = (
    "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('0.0.0.0', 5300))\n"
    "while True:\n d, a = s.recvfrom(2048); s.sendto(b'echo:' + d, a)"
)
# the guest's own resolver (glibc: resolv.conf's nameservers and search list) -> address or error
LOOKUP = """
import socket, sys
for name in sys.argv[1:]:
    try:
        print(socket.gethostbyname(name))
    except OSError as e:
        print(type(e).__name__)
"""
NOBODY = "192.0.2.53"  # a nameserver nobody serves: only the DNS proxy answers for it


async def udp_echo(port: int) -> bytes:
    """The reply to a datagram sent to the host's loopback ``port`` (resent each second
    until the guest's server, started in the background, answers)."""
    client = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    with client, trio.fail_after(60):
        await client.connect(("127.0.0.1", port))
        while True:
            await client.send(b"ping")
            with trio.move_on_after(1):
                return await client.recv(100)


async def test_ports_profiles_and_dns_given_at_create(image: Image) -> None:
    async with net_lab("sv-ncr-") as lab:
        profiles_file = lab.work.root / "profiles.toml"
        profiles_file.write_text(PROFILES)
        opts = {"port_addresses": (UPLINK_HOST,), "network_profiles": profiles_file}
        async with serving(lab, **opts) as reg, trio.open_nursery() as servers:
            await servers.start(tcp_server, lab.inet, LAN, 80, "lan")
            sock = lab.work.socket

            # a bind address the operator did not open: refused before anything is made
            with pytest.raises(PermissionDenied, match="serve --port-address"):
                await AsyncSandbox.create("x", socket=sock, network="tap", port_address="0.0.0.0", detached=True)
            assert "x" not in reg.sandboxes

            q_sdk = await AsyncSandbox.create(
                "q",
                socket=sock,
                network_profile="corp",  # no mode: a profile that reaches out gives tap
                ports={"5300/udp": 0},
                port_bindings=[f"{UPLINK_HOST}:0:8000"],
                dns=Dns(nameservers=[NOBODY], search=["test"]),
                detached=True,
            )
            p_sdk = await AsyncSandbox.create("p", socket=sock, network_profile="private", detached=True)
            q, p = reg.get("q"), reg.get("p")

            # the profiles were expanded at Create, and the rules are what the sandbox keeps
            assert q.config.network.mode == NetMode.TAP and q.config.network.profile == "corp"
            assert q.config.network.egress == Egress("deny", ("allowed.test", SERVERS[0]))
            assert p.config.network.egress == Egress("deny", ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))
            await private_profile(p)
            await dns_through_the_proxy(q)
            await udp_port(q, q_sdk)
            await bind_address(lab, q, q_sdk)
            # a restored clone: the guest's resolv.conf written again after net_config's,
            # the origin's expanded rules, each port on its own address again
            snap, _ = await reg.checkpoint("q", name="q-snap")
            clone = await reg.restore(snap.id, id="qc")
            assert await sh(clone, "cat /etc/resolv.conf") == f"nameserver {NOBODY}\nsearch test\n"
            assert clone.config.network == q.config.network and clone.ip_address != q.ip_address
            carried = {(pm.sandbox_port, pm.host_address) for pm in clone.ports()}
            assert carried == {(5300, ""), (8000, UPLINK_HOST), (8001, "127.0.0.5")}
            await p_sdk.remove()
            servers.cancel_scope.cancel()
        # the operator changes the file: the next supervisor has the new rules, and the
        # sandbox made from the old ones keeps them (they were expanded at its Create)
        profiles_file.write_text('[profile.corp]\ndefault = "allow"\n')
        async with serving(lab, **opts) as reg:
            assert reg.settings.network_profiles == {"corp": Egress("allow")}
            q = reg.get("q")
            assert q.config.network.egress == Egress("deny", ("allowed.test", SERVERS[0]))
            assert q.config.network.profile == "corp"


async def private_profile(p: Sandbox) -> None:
    """ "private": a private address (the LAN service) is open, a public one is not."""
    got = await fetch(p, f"{LAN}:80", f"{SERVERS[0]}:80", f"{SERVERS[2]}:80")
    assert got[0] == "lan" and not {"server0", "server2"} & set(got[1:]), got


async def dns_through_the_proxy(q: Sandbox) -> None:
    """The guest's resolv.conf names its own nameserver and search domain; a lookup by a
    short name finds the allowed name through the proxy (nobody serves NOBODY), a name
    the policy does not allow is refused there, and the allowed one is then reachable."""
    assert await sh(q, "cat /etc/resolv.conf") == f"nameserver {NOBODY}\nsearch test\n"
    await q.guest_call(lambda g: g.channel.write_file("/tmp/lookup.py", LOOKUP.encode()))
    got = (await sh(q, "python3 /tmp/lookup.py allowed other allowed.test")).split()
    assert got == ["203.0.113.20", "gaierror", "203.0.113.20"], got
    assert (await fetch(q, "allowed.test:80", f"{SERVERS[0]}:80", f"{SERVERS[2]}:80"))[:2] == ["server1", "server0"]


async def udp_port(q: Sandbox, sdk: AsyncSandbox) -> None:
    """The UDP port given at create is answered from the host's loopback."""
    (udp,) = [pm for pm in q.ports() if pm.protocol == Protocol.UDP]
    assert udp.sandbox_port == 5300 and udp.host_port and udp.host_address == ""
    await sh(q, f'(python3 -c "{UDP_ECHO}" >/dev/null 2>&1 &)')
    assert await udp_echo(udp.host_port) == b"echo:ping"
    listed = {(m.sandbox_port, m.protocol): m.host_address for m in await sdk.ports()}
    assert listed == {(5300, "udp"): "127.0.0.1", (8000, "tcp"): UPLINK_HOST}


async def bind_address(lab: NetLab, q: Sandbox, sdk: AsyncSandbox) -> None:
    """The TCP port bound on the uplink address (opened by serve --port-address) is
    reached from the other network, and is not on the host's loopback."""
    (tcp,) = [pm for pm in q.ports() if pm.protocol == Protocol.TCP]
    assert tcp == PortSpec(8000, tcp.host_port, Protocol.TCP, UPLINK_HOST)
    await start_server(q)
    await reach(lab.inet, UPLINK_HOST, tcp.host_port, f"vm {q.ip_address} {GATEWAY}")
    assert await probe(lab.host, "127.0.0.1", tcp.host_port) == "ConnectionRefusedError"
    # a later expose of that sandbox: the caller's loopback address, or the operator's
    assert await sdk.expose(8001, address="127.0.0.5") > 0
    with pytest.raises(PermissionDenied):
        await sdk.expose(8002, address="198.51.100.99")
