"""Tap networking without a VM: the host side (HostNetwork: links, filter, DNS proxy,
relays) in a "host" namespace, veth pairs standing in for TAPs with "guest"
namespaces behind them, and a stand-in internet (servers, a metadata address, a DNS
server) in another namespace. Needs root (namespaces, nftables)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from ipaddress import IPv4Address
from typing import Any

import pytest
import trio

from actors.net import dnsmsg
from actors.net.egress import EgressPolicy
from actors.net.hostnet import HostNetConfig, HostNetwork
from actors.net.ippool import IpPool, link_name
from actors.net.netns import NetError, NetNS
from actors.net.portfwd import Target, bind_listener, relay_tcp, relay_udp
from tests.support.netlab import (
    CLOUD_METADATA,
    LAN,
    METADATA,
    POOL,
    SERVERS,
    UPLINK_HOST,
    UPLINK_INET,
    Guest,
    Lab,
    add_guest,
    lab_env,
    link_internet,
    namespaces,
    probe,
    resolve,
    tcp_server,
)

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("ip"), reason="needs root, nft and ip"
    ),
]


async def test_host_reaches_guest_and_table_goes_with_the_network() -> None:
    async with lab_env() as lab:
        g = lab.guest("a")
        await lab.nursery.start(tcp_server, g.ns, "0.0.0.0", 7000, "guest-a")
        assert await probe(lab.host, g.address, 7000) == f"guest-a {lab.pool.gateway}"
        # the guest reaches the internet by default (masqueraded behind the uplink)
        assert await probe(g.ns, SERVERS[0], 80) == f"server0 {UPLINK_HOST}"
        host = lab.host
    assert host is not None  # the lab is gone: its namespaces too
    out = subprocess.run(["nft", "list", "tables"], check=False, capture_output=True, text=True).stdout
    assert "sandvisor" not in out  # the test's table lived in its namespace only


async def test_teardown_removes_table_and_bridge() -> None:
    with namespaces("svh") as (host,):
        pool = IpPool(POOL)
        net = HostNetwork(HostNetConfig(netns=host, upstreams=(("192.0.2.1", 53),)), pool)
        async with trio.open_nursery() as nursery:
            await nursery.start(net.run)
            assert host.link_exists("sandvisor0")
            nursery.cancel_scope.cancel()
        assert not host.link_exists("sandvisor0")
        argv = ["ip", "netns", "exec", str(host.name), "nft", "list", "ruleset"]
        listing = subprocess.run(argv, check=False, capture_output=True)
        assert b"sandvisor" not in listing.stdout


async def test_guests_reach_each_other_only_when_allowed() -> None:
    async with lab_env() as lab:
        a = lab.guest("a")
        b = lab.guest("b", {"default": "allow", "allow": ["0.0.0.0/0"]})
        for g, label in ((a, "A"), (b, "B")):
            await lab.nursery.start(tcp_server, g.ns, "0.0.0.0", 7000, label)
        assert await probe(a.ns, b.address, 7000) == "OSError"  # EHOSTUNREACH: admin-prohibited
        assert await probe(b.ns, a.address, 7000) == "OSError"  # 0.0.0.0/0 does not open the pool
        a.link.set_policy(EgressPolicy.parse({"allow": [b.address]}))
        assert await probe(a.ns, b.address, 7000) == f"B {a.address}"  # not masqueraded
        assert await probe(b.ns, a.address, 7000) == "OSError"  # one-way: B's policy did not change


async def test_default_deny_reaches_an_allowed_cidr_and_domain_only() -> None:
    async with lab_env() as lab:
        g = lab.guest("d", {"default": "deny", "allow": [f"{SERVERS[0]}/32", "allowed.test", "*.allowed.test"]})
        gw = str(lab.pool.gateway)
        assert await probe(g.ns, SERVERS[0], 80) == f"server0 {UPLINK_HOST}"
        assert await probe(g.ns, SERVERS[1], 80) == "OSError"  # not resolved yet: closed
        assert await resolve(g.ns, gw, "allowed.test") == (dnsmsg.NOERROR, [SERVERS[1]])
        assert await probe(g.ns, SERVERS[1], 80) == f"server1 {UPLINK_HOST}"
        assert await resolve(g.ns, gw, "other.test") == (dnsmsg.REFUSED, [])
        assert "other.test" not in lab.asked  # refused without asking upstream
        assert await probe(g.ns, SERVERS[2], 80) == "OSError"
        assert await probe(g.ns, UPLINK_INET, 80) == "OSError"
        rcode, addrs = await resolve(g.ns, gw, "www.allowed.test")  # CNAME chain
        assert (rcode, addrs) == (dnsmsg.NOERROR, [SERVERS[1]])


async def test_dns_answers_expire_from_the_filter() -> None:
    async with lab_env(dns_ttl=1, min_ttl=1, grace=0) as lab:
        g = lab.guest("t", {"default": "deny", "allow": ["allowed.test:80"]})
        assert await resolve(g.ns, str(lab.pool.gateway), "allowed.test") == (dnsmsg.NOERROR, [SERVERS[1]])
        assert await probe(g.ns, SERVERS[1], 80) == f"server1 {UPLINK_HOST}"
        with trio.fail_after(10):
            while await probe(g.ns, SERVERS[1], 80) != "OSError":  # timeout 1 s: gone soon after
                await trio.sleep(0.2)


async def test_denied_domain_is_refused_and_closed_under_default_allow() -> None:
    async with lab_env() as lab:
        g = lab.guest("x", {"default": "allow", "deny": ["other.test"]})
        assert await probe(g.ns, SERVERS[2], 80) == f"server2 {UPLINK_HOST}"  # open by default
        assert await resolve(g.ns, str(lab.pool.gateway), "other.test") == (dnsmsg.REFUSED, [])
        assert await probe(g.ns, SERVERS[2], 80) == "OSError"  # its address learnt: closed for the TTL
        assert await resolve(g.ns, str(lab.pool.gateway), "allowed.test") == (dnsmsg.NOERROR, [SERVERS[1]])


async def test_private_ranges_are_closed_unless_a_cidr_names_them() -> None:
    """Under default allow the LAN (RFC 1918) and cloud metadata (100.64/10) are closed;
    a port-qualified allow of everything opens neither them nor other sandboxes; only
    an entry that names the range opens it; a name answering a private address (DNS
    rebinding) opens nothing."""
    async with lab_env() as lab:
        gw = str(lab.pool.gateway)
        other = lab.guest("other")
        await lab.nursery.start(tcp_server, other.ns, "0.0.0.0", 8080, "other-sandbox")
        await lab.nursery.start(tcp_server, lab.inet, SERVERS[0], 8080, "public-8080")
        await lab.nursery.start(tcp_server, lab.inet, LAN, 8080, "lan-8080")
        g = lab.guest("p")  # default allow
        assert await probe(g.ns, SERVERS[0], 80) == f"server0 {UPLINK_HOST}"  # the internet: open
        assert await probe(g.ns, LAN, 80) == "OSError"
        assert await probe(g.ns, CLOUD_METADATA, 80) == "OSError"
        assert await resolve(g.ns, gw, "rebind.test") == (dnsmsg.NOERROR, [LAN])  # answered as is ...
        assert await probe(g.ns, LAN, 80) == "OSError"  # ... opened nothing
        g.link.set_policy(EgressPolicy.parse({"default": "deny", "allow": ["0.0.0.0/0:8080", "rebind.test"]}))
        assert await probe(g.ns, SERVERS[0], 8080) == f"public-8080 {UPLINK_HOST}"
        assert await probe(g.ns, SERVERS[0], 80) == "OSError"
        assert await probe(g.ns, other.address, 8080) == "OSError"  # another sandbox's 8080
        assert await probe(g.ns, LAN, 8080) == "OSError"
        assert await resolve(g.ns, gw, "rebind.test") == (dnsmsg.NOERROR, [LAN])
        assert await probe(g.ns, LAN, 80) == "OSError"  # an allowed name is no way to a private address
        g.link.set_policy(EgressPolicy.parse({"allow": ["10.77.0.0/24", f"{other.address}:8080"]}))
        assert await probe(g.ns, LAN, 80) == f"lan {UPLINK_HOST}"  # named: open
        assert await probe(g.ns, other.address, 8080) == f"other-sandbox {g.address}"
        assert await probe(g.ns, CLOUD_METADATA, 80) == "OSError"  # still closed


POLICIES = [
    None,
    {"default": "deny"},
    {"default": "allow", "allow": ["0.0.0.0/0"]},
    {"default": "deny", "allow": ["0.0.0.0/1", "128.0.0.0/1", "*.allowed.test", "other.test"]},
]


@pytest.mark.parametrize("policy", POLICIES, ids=["none", "deny", "allow-all", "deny-but-everything"])
async def test_host_and_metadata_are_never_reachable(policy: dict[str, Any] | None) -> None:
    async with lab_env() as lab:
        g = lab.guest("m", policy)
        gw = str(lab.pool.gateway)
        assert await probe(g.ns, METADATA, 80) == "OSError"
        for addr in (gw, UPLINK_HOST, "10.88.255.255"):  # the host's own addresses
            assert await probe(g.ns, addr, 8081) == "OSError", addr
        # the host's loopback: a packet to 127.0.0.1 sent out of eth0 (as a hostile guest
        # with a raw socket would) is never answered, even on a host that made 127/8
        # routable (route_localnet=1, as kube-proxy or a DNAT port forward does): the
        # filter drops it, not only the kernel's martian check
        assert await _syn_to_loopback(lab, g) == "no answer"
        lab.host.sysctl("ipv4/conf/all/route_localnet", 1)
        lab.host.sysctl(f"ipv4/conf/{g.link.name}/route_localnet", 1)
        assert await _syn_to_loopback(lab, g) == "no answer"
        assert await probe(lab.host, "127.0.0.1", 8080) == "host-loopback 127.0.0.1"  # the service is up
        # and spoofing another source address gets nothing out
        assert await _spoofed_connect(g) == "timeout"


async def _syn_to_loopback(lab: Lab, g: Guest) -> str:
    """Inject a TCP SYN for 127.0.0.1:8080 at the host through the guest's eth0."""
    with g.ns.entered():
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
        r = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
    with s, r:
        s.bind(("eth0", 0))
        r.bind(("eth0", 0))
        r.settimeout(0)
        gw_mac = bytes.fromhex("027377000001")
        src_mac = bytes.fromhex("027376000099")
        ip_src = socket.inet_aton(g.address)
        ip_dst = socket.inet_aton("127.0.0.1")
        tcp = _tcp_syn(ip_src, ip_dst, 40000, 8080)
        ip = _ipv4(ip_src, ip_dst, len(tcp))
        frame = gw_mac + src_mac + b"\x08\x00" + ip + tcp
        for _ in range(3):
            s.send(frame)
        await trio.sleep(0.5)
        while True:
            try:
                pkt = r.recv(2048)
            except BlockingIOError:
                return "no answer"
            if len(pkt) > 34 and pkt[23] == 6 and pkt[26:30] == ip_dst:  # TCP from 127.0.0.1: SYN-ACK
                return "answered"


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _ipv4(src: bytes, dst: bytes, payload: int) -> bytes:
    hdr = bytearray(b"\x45\x00" + (20 + payload).to_bytes(2, "big") + b"\x12\x34\x40\x00\x40\x06\x00\x00" + src + dst)
    hdr[10:12] = _checksum(bytes(hdr)).to_bytes(2, "big")
    return bytes(hdr)


def _tcp_syn(src: bytes, dst: bytes, sport: int, dport: int) -> bytes:
    seg = bytearray(
        sport.to_bytes(2, "big")
        + dport.to_bytes(2, "big")
        + b"\0\0\0\1"
        + b"\0\0\0\0"
        + b"\x50\x02\xff\xff"
        + b"\0" * 4
    )
    pseudo = src + dst + b"\x00\x06" + len(seg).to_bytes(2, "big")
    seg[16:18] = _checksum(pseudo + bytes(seg)).to_bytes(2, "big")
    return bytes(seg)


async def _spoofed_connect(g: Guest) -> str:
    """Connect to an open internet server from another pool address the guest adds."""
    subprocess.run(["ip", "-n", str(g.ns.name), "addr", "add", "10.88.7.7/32", "dev", "eth0"], check=True)
    sock = trio.socket.from_stdlib_socket(g.ns.socket())
    with sock:
        await sock.bind(("10.88.7.7", 0))
        try:
            with trio.fail_after(1.5):
                await sock.connect((SERVERS[0], 80))
                return "connected"
        except trio.TooSlowError:
            return "timeout"
        except OSError as exc:
            return type(exc).__name__


async def test_exposed_ports_relay_tcp_and_udp() -> None:
    async with lab_env() as lab:
        g = lab.guest("p", {"default": "deny"})
        await lab.nursery.start(tcp_server, g.ns, "0.0.0.0", 7000, "guest-p")
        listener = bind_listener("127.0.0.1", 0, socket.SOCK_STREAM, lab.host)
        port = await lab.nursery.start(relay_tcp, listener, Target(g.address, 7000, lab.host))
        assert await probe(lab.host, "127.0.0.1", port) == f"guest-p {lab.pool.gateway}"
        # UDP: an echo in the guest behind a relayed host port
        echo = trio.socket.from_stdlib_socket(g.ns.socket(socket.AF_INET, socket.SOCK_DGRAM))
        await echo.bind(("0.0.0.0", 7001))

        async def serve_echo() -> None:
            with echo:
                while True:
                    data, peer = await echo.recvfrom(100)
                    await echo.sendto(b"echo " + data, peer)

        lab.nursery.start_soon(serve_echo)
        ulistener = bind_listener("127.0.0.1", 0, socket.SOCK_DGRAM, lab.host)
        uport = await lab.nursery.start(relay_udp, ulistener, Target(g.address, 7001, lab.host))
        client = trio.socket.from_stdlib_socket(lab.host.socket(socket.AF_INET, socket.SOCK_DGRAM))
        with client, trio.fail_after(5):
            await client.connect(("127.0.0.1", uport))
            await client.send(b"hi")
            assert await client.recv(100) == b"echo hi"


async def test_a_tap_is_made_in_the_namespace_and_goes_with_its_fd() -> None:
    async with lab_env() as lab:
        address = lab.pool.allocate("tap-owner")
        name = link_name("tap-owner")
        link = lab.net.open_tap(name, address, EgressPolicy.parse(None))
        assert link.tap_fd is not None and lab.host.link_exists(name)
        assert not NetNS().link_exists(name)
        with pytest.raises(Exception, match="TAP"):
            lab.host.open_tap(name)  # IFF_TUN_EXCL: never attach to a device in use
        link.close()
        assert not lab.host.link_exists(name)


async def test_unknown_senders_get_no_dns_answer() -> None:
    async with lab_env() as lab:
        assert await lab.net.dns.answer(IPv4Address("10.88.9.9"), dnsmsg.query("allowed.test")) is None
        g = lab.guest("f")
        reply = await lab.net.dns.answer(IPv4Address(g.address), b"\x00\x01garbage-but-12+")
        assert reply is not None and dnsmsg.parse(reply).rcode == dnsmsg.FORMERR


async def test_one_host_network_per_namespace() -> None:
    async with lab_env() as lab:
        second = HostNetwork(HostNetConfig(netns=lab.host, upstreams=((UPLINK_INET, 53),)), IpPool(POOL))
        with pytest.raises(NetError, match="another supervisor"):
            second.setup()
        second.nft.close()
        assert await probe(lab.host, "127.0.0.1", 8080) == "host-loopback 127.0.0.1"  # the first is untouched
        g = lab.guest("still-filtered")
        assert await probe(g.ns, SERVERS[0], 80) == f"server0 {UPLINK_HOST}"


async def test_an_uplink_is_a_filtered_namespace_and_goes_with_its_link() -> None:
    """A jailed user-mode QEMU's namespace (outbound access): a veth to the filter, the
    sandbox's policy and DNS proxy, nothing of the host."""
    async with lab_env() as lab:
        address = lab.pool.allocate("uplink-owner")
        name = link_name("uplink-owner")
        policy = EgressPolicy.parse({"default": "deny", "allow": [SERVERS[0], "allowed.test"]})
        link = lab.net.open_uplink(name, address, policy)
        jail = NetNS(link.jail_netns)
        try:
            assert link.jail_netns_path == f"/run/netns/{link.jail_netns}" and os.path.exists(link.jail_netns_path)
            assert link.jail_netns.startswith(lab.net.config.jail_prefix)
            assert jail.read_sysctl("ipv6/conf/all/disable_ipv6") == "1"
            assert await probe(jail, SERVERS[0], 80) == f"server0 {UPLINK_HOST}"
            assert await probe(jail, SERVERS[2], 80) != "server2"
            assert (await resolve(jail, str(lab.pool.gateway), "allowed.test"))[1] == ["203.0.113.20"]
            assert await probe(jail, "203.0.113.20", 80) == f"server1 {UPLINK_HOST}"
            for target, port in ((str(lab.pool.gateway), 8081), (UPLINK_HOST, 8081), (METADATA, 80)):
                assert await probe(jail, target, port, timeout=1) not in ("host-any", "metadata")
            # its loopback is up (slirp's port forwards listen there) and its own
            await lab.nursery.start(tcp_server, jail, "127.0.0.1", 8080, "jail-loopback")
            assert await probe(jail, "127.0.0.1", 8080) == "jail-loopback 127.0.0.1"
        finally:
            link.close()
        assert not os.path.exists(link.jail_netns_path) and not lab.host.link_exists(name)


async def test_kept_table_filters_until_the_next_supervisor_readopts_and_sweeps() -> None:
    """serve --keep-sandboxes: the table stays while no supervisor runs (a sandbox still
    cannot reach the host); the next one replaces it (the sandbox's traffic is dropped,
    never let through) and readopts the links of the sandboxes it adopts; jail
    namespaces it does not adopt are swept."""
    with namespaces("svh", "svi") as (host, inet), namespaces("svg") as (guest_ns,):
        link_internet(host, inet)
        cfg = HostNetConfig(netns=host, upstreams=((UPLINK_INET, 53),))
        pool = IpPool(POOL)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(tcp_server, inet, SERVERS[0], 80, "server0")
                await nursery.start(tcp_server, host, "0.0.0.0", 8081, "host-any")
                address = pool.allocate("kept")
                name = link_name("kept")
                add_guest(host, guest_ns, name, address, pool.prefix, pool.gateway)
                first = HostNetwork(cfg, pool)
                async with trio.open_nursery() as running:
                    await running.start(first.run)
                    first.attach(name, address, EgressPolicy.parse(None))
                    upl_addr = pool.allocate("kept-uplink")
                    uplink = first.open_uplink(link_name("kept-uplink"), upl_addr, EgressPolicy.parse(None))
                    stale_addr = pool.allocate("stale-uplink")
                    stale = first.open_uplink(link_name("stale-uplink"), stale_addr, EgressPolicy.parse(None))
                    assert await probe(guest_ns, SERVERS[0], 80) == f"server0 {UPLINK_HOST}"
                    first.keep_table = True
                    running.cancel_scope.cancel()
                # no supervisor: the table is still there, the host still out of reach
                assert await probe(guest_ns, str(pool.gateway), 8081, timeout=1) != "host-any"
                assert os.path.exists(uplink.jail_netns_path) and os.path.exists(stale.jail_netns_path)
                second = HostNetwork(cfg, pool)
                async with trio.open_nursery() as running:
                    await running.start(second.run)
                    assert await probe(guest_ns, SERVERS[0], 80, timeout=1) == "timeout"  # in no set: dropped
                    second.readopt(name, address, EgressPolicy.parse(None), uplink=False)
                    second.readopt(link_name("kept-uplink"), upl_addr, EgressPolicy.parse(None), uplink=True)
                    second.sweep(keep=[name, link_name("kept-uplink")])
                    assert not os.path.exists(stale.jail_netns_path) and os.path.exists(uplink.jail_netns_path)
                    assert await probe(guest_ns, SERVERS[0], 80) == f"server0 {UPLINK_HOST}"
                    assert await probe(NetNS(uplink.jail_netns), SERVERS[0], 80) == f"server0 {UPLINK_HOST}"
                    assert await probe(guest_ns, str(pool.gateway), 8081, timeout=1) != "host-any"
                    running.cancel_scope.cancel()
                assert not os.path.exists(uplink.jail_netns_path)  # closed with the second (not kept)
                nursery.cancel_scope.cancel()
        finally:
            for leftover in os.listdir("/run/netns"):
                if leftover.startswith(cfg.jail_prefix):
                    subprocess.run(["ip", "netns", "del", leftover], check=False)
