"""Networking through the whole supervisor, with real VMs: tap sandboxes with egress
policies, restores of a tap snapshot, a supervisor restart, outbound user mode in
the jail.

The supervisor under test runs in this process, in a "host" network namespace the
test makes (tests/support/netlab.py: the main thread enters it for the whole test, so the
supervisor's bridge, table, DNS proxy, TAPs and QEMUs are all there), with a stand-in
internet in another namespace: servers, a metadata server at 169.254.169.254 and a
DNS server. The host namespace has its own loopback services (127.0.0.1:8080 and
0.0.0.0:8081). No packet leaves the namespaces the test made.

Sandboxes are driven through the registry (the domain), from a task that runs the
QMP loop itself (a task started from the test's context takes the test's loop).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from ipaddress import IPv4Address, IPv4Network

import pytest
import trio

from actors.errors import AlreadyExists, NotFound
from actors.model import Egress, NetMode, Network, PortSpec, Protocol, SandboxConfig, State
from actors.net import dnsmsg
from actors.net.ippool import guest_mac
from actors.registry import Registry
from actors.sandboxes.sandbox import Sandbox
from images.build import Image
from supervisor.client import AsyncSandbox
from tests.support.netlab import (
    METADATA,
    POOL,
    SERVERS,
    UPLINK_HOST,
    probe,
)
from tests.support.taplab import GATEWAY, NetLab, fetch, net_lab, reach, ready, serving, sh, start_server, tap

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, TAP, jail)")


# the first supervisor leaves its QEMUs running (--keep-sandboxes) in this process: their
# process objects are dropped while the QEMUs run on, for the next supervisor to adopt
@pytest.mark.filterwarnings("ignore:subprocess .* is still running:ResourceWarning")
async def test_tap_sandboxes_policies_isolation_and_a_restart(image: Image) -> None:
    async with net_lab("sv-tap-") as lab:
        async with serving(lab, keep_sandboxes=True) as reg:
            ips, uids = await policies_and_isolation(lab, reg)
            c = reg.stop("c", timeout=5)
            await c.wait_stopped()
        gc.collect()  # (their process objects go now, not in some later test)
        # no supervisor: a and b run on, their filter kept
        got = await probe(lab.host, ips["a"], 8000)
        assert got == f"vm {ips['a']} {GATEWAY}", got
        async with serving(lab) as reg:  # the next one adopts a and b
            await restarted(lab, reg, ips, uids)


async def policies_and_isolation(lab: NetLab, reg: Registry) -> tuple[dict[str, str], dict[str, str]]:
    """Three tap sandboxes: a (default deny), b (its policy opens the pool), c (default allow)."""
    deny_but = Egress("deny", allow=(SERVERS[0], "allowed.test"))
    a = await reg.create("a", tap(deny_but))
    b = await reg.create("b", tap(Egress("allow", allow=(POOL,))))  # opens the other sandboxes
    c = await reg.create("c", tap())  # default allow: the internet, never other sandboxes
    for sb in (a, b, c):
        await ready(sb)
    ips = {sb.id: sb.ip_address for sb in (a, b, c)}
    assert len(set(ips.values())) == 3 and all(IPv4Address(ip) in IPv4Network(POOL) for ip in ips.values())
    for sb in (a, b, c):
        assert IPv4Address(sb.ip_address) != IPv4Address(GATEWAY) and sb.gateway == GATEWAY
        assert sb.tap_name.startswith("svn") and len(sb.tap_name) == 15
        await start_server(sb)
    # the host reaches each at its address
    for sb in (a, b, c):
        await reach(lab.host, sb.ip_address, 8000, f"vm {sb.ip_address} {GATEWAY}")
    assert (await sh(a, "cat /etc/resolv.conf")).strip() == f"nameserver {GATEWAY}"

    host_targets = [f"{GATEWAY}:8081", f"{UPLINK_HOST}:8081", "127.0.0.1:8080", f"{METADATA}:80"]
    # default deny: the allowed CIDR and name only
    got = await fetch(a, f"{SERVERS[0]}:80", "allowed.test:80", "other.test:80", f"{SERVERS[2]}:80")
    assert got[:3] == ["server0", "server1", "gaierror"] and got[3] != "server2", got
    # default deny or allow, nothing of the host, no metadata, no other sandbox unless allowed
    for sb in (a, b, c):
        others = [f"{o.ip_address}:8000" for o in (a, b, c) if o is not sb]
        got = await fetch(sb, *host_targets, *others)
        assert not {"host-any", "host-loopback", "metadata"} & set(got), (sb.id, got)
        want_vm = sb is b  # only b's policy opens the pool
        assert [g == "vm" for g in got[len(host_targets) :]] == [want_vm, want_vm], (sb.id, got)
    assert (await fetch(c, f"{SERVERS[2]}:80")) == ["server2"]  # default allow: the internet

    # another sandbox's exposed port (on the host's loopback) is out of reach too
    pm = await a.expose(8000, 0, Protocol.TCP)
    await reach(lab.host, "127.0.0.1", pm.host_port, f"vm {a.ip_address} {GATEWAY}")
    assert (await a.expose(8000, 0, Protocol.TCP)) == pm  # idempotent
    for sb in (b, c):
        got = await fetch(sb, f"{GATEWAY}:{pm.host_port}", f"{UPLINK_HOST}:{pm.host_port}")
        assert "vm" not in got, got

    await hostile_dns_queries(lab, reg, a, (b, c))  # (here, to boot no more VMs)
    return ips, {sb.id: sb.record.uid for sb in (a, b, c)}


async def restarted(lab: NetLab, reg: Registry, ips: dict[str, str], uids: dict[str, str]) -> None:
    """The pool's allocations survived: adopted sandboxes run at their addresses, filtered
    as before, their exposed port relayed again; a stopped one keeps its address and
    boots at it; a new one gets another; a removed one's goes back to the pool."""
    a, b, c = reg.get("a"), reg.get("b"), reg.get("c")
    for sb in (a, b, c):
        assert sb.ip_address == ips[sb.id]
    assert a.state == b.state == State.READY and c.state == State.STOPPED
    got = await fetch(a, f"{SERVERS[0]}:80", f"{SERVERS[2]}:80", f"{GATEWAY}:8081", f"{ips['b']}:8000")
    assert got[0] == "server0" and not {"server2", "host-any", "vm"} & set(got[1:]), got  # a's policy, kept
    assert (await fetch(b, f"{ips['a']}:8000")) == ["vm"]  # b's, kept
    (pm,) = a.ports()
    await reach(lab.host, "127.0.0.1", pm.host_port, f"vm {ips['a']} {GATEWAY}")
    d = await reg.create("d", tap())
    assert d.ip_address not in ips.values()
    await reg.remove("a", force=True)
    hn = reg.settings.hostnet
    assert hn is not None and hn.pool.address_of(uids["a"]) is None
    c = await reg.start("c")  # boots again, at its address
    await ready(c)
    await start_server(c)
    await reach(lab.host, c.ip_address, 8000, f"vm {ips['c']} {GATEWAY}")


async def test_restores_of_a_tap_snapshot_each_get_their_own_address_and_ports(image: Image) -> None:
    async with net_lab("sv-tapr-") as lab, serving(lab) as reg:
        origin = await ready(await reg.create("o", tap(ports=(PortSpec(8000),))))
        await start_server(origin)
        await reach(lab.host, origin.ip_address, 8000, f"vm {origin.ip_address} {GATEWAY}")
        snap, _ = await reg.checkpoint("o", name="web")

        # four at once, while the origin runs: each a fresh TAP, MAC and address, set in
        # the guest before ready (the server the snapshot holds answers at the new one)
        clones: list[Sandbox] = []

        async def restore(i: int) -> None:
            clones.append(await reg.restore(snap.id, id=f"clone{i}"))

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(restore, i)
        ips = {sb.ip_address for sb in clones}
        assert len(ips) == 4 and origin.ip_address not in ips
        for sb in clones:
            assert sb.state == State.READY
            await reach(lab.host, sb.ip_address, 8000, f"vm {sb.ip_address} {GATEWAY}")
            mac = (await sh(sb, "cat /sys/class/net/eth0/address")).strip()
            assert mac == guest_mac(IPv4Address(sb.ip_address))
        assert await fetch(clones[0], f"{SERVERS[0]}:80") == ["server0"]  # out through the filter, masqueraded

        # each clone's carried port mapping has its own host port, listed; exposing it
        # again answers with that mapping (as `port add CLONE 8000` must)
        host_ports = set()
        for sb in clones:
            (pm,) = sb.ports()
            assert pm.sandbox_port == 8000 and pm.host_port
            host_ports.add(pm.host_port)
            assert await sb.expose(8000, 0, Protocol.TCP) == pm
            assert await sb.expose(8000, pm.host_port, Protocol.TCP) == pm
            await reach(lab.host, "127.0.0.1", pm.host_port, f"vm {sb.ip_address} {GATEWAY}")
        assert len(host_ports) == 4 and origin.ports()[0].host_port not in host_ports
        one = clones[0]
        (pm,) = one.ports()
        with pytest.raises(AlreadyExists):
            await one.expose(8000, pm.host_port + 1 if pm.host_port < 65535 else 1024, Protocol.TCP)
        await one.unexpose(8000, Protocol.TCP)
        assert one.ports() == [] and await probe(lab.host, "127.0.0.1", pm.host_port, timeout=1) != "vm"
        with pytest.raises(NotFound):
            await one.unexpose(8000, Protocol.TCP)
        udp = await one.expose(9999, 0, Protocol.UDP)  # listed, in order
        assert one.ports() == [udp]
        # Stop closes the relays (the mappings stay, for the next Start)
        two = clones[1]
        (pm2,) = two.ports()
        reg.stop(two.id, timeout=5)
        await two.wait_stopped()
        assert await probe(lab.host, "127.0.0.1", pm2.host_port, timeout=1) != "vm"
        assert [p.sandbox_port for p in two.ports()] == [8000]

        # the origin gone, its address is free: a restore keeps the snapshot's address...
        origin_ip = origin.ip_address
        await reg.remove("o", force=True)
        assert origin.ip_address == ""  # (back in the pool)
        kept = await reg.restore(snap.id, id="kept")
        assert kept.ip_address == origin_ip
        await reach(lab.host, kept.ip_address, 8000, f"vm {kept.ip_address} {GATEWAY}")
        # ... unless network_override asks for a fresh one (and then it always gets one)
        fresh = await reg.restore(snap.id, id="fresh", network_override=True)
        assert fresh.ip_address not in {*ips, kept.ip_address}
        await reach(lab.host, fresh.ip_address, 8000, f"vm {fresh.ip_address} {GATEWAY}")

        # a port exposed after create is carried too: a clone of a clone lists
        # both mappings, each on a new host port, and serves them
        await start_server(fresh, 8001)
        later = await fresh.expose(8001, 0, Protocol.TCP)
        snap2, _ = await reg.checkpoint("fresh", name="web2")
        again = await reg.restore(snap2.id, id="again")
        carried = {p.sandbox_port: p.host_port for p in again.ports()}
        assert set(carried) == {8000, 8001} and later.host_port != carried[8001]
        assert carried[8000] != fresh.ports()[0].host_port
        for port in (8000, 8001):
            await reach(lab.host, "127.0.0.1", carried[port], f"vm {again.ip_address} {GATEWAY}")


async def test_outbound_user_mode_reaches_out_through_the_filter_only(image: Image) -> None:
    """User mode with outbound access, jailed: slirp's sockets are in the jail's own
    namespace, whose one way out is a filtered veth. It reaches the stand-in internet
    (names through slirp's resolver, which is the DNS proxy) as its policy says, and
    neither the host's loopback nor another sandbox's exposed port; UDP exposure works."""
    async with net_lab("sv-out-") as lab, serving(lab, templates=False) as reg:
        # made through the CLI, as a user would (`create --network outbound --deny ...`)
        env = {**os.environ, "SANDVISOR_SOCKET": str(lab.work.socket)}
        argv = [sys.executable, "-m", "supervisor.main.cli", "create", "u", "--network", "outbound", "--json"]
        argv += ["--deny", SERVERS[2], "--deny", "other.test"]
        done = await trio.run_process(argv, env=env, capture_stdout=True, capture_stderr=True, check=False)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"id": "u", "state": "ready", "ip_address": "10.0.2.15"}
        u = reg.get("u")
        assert u.config.network == Network(NetMode.USER, True, Egress("allow", deny=(SERVERS[2], "other.test")))
        w = await reg.create("w", SandboxConfig(network=Network(mode=NetMode.USER), ports=(PortSpec(8000),)))
        for sb in (u, w):
            await ready(sb)
        assert u.ip_address == "10.0.2.15" and u.tap_name == ""  # the guest's view; its uplink is the host's
        await start_server(w)
        (exposed,) = w.ports()
        await reach(lab.host, "127.0.0.1", exposed.host_port, "vm 10.0.2.15 10.0.2.2")

        got = await fetch(u, f"{SERVERS[0]}:80", "allowed.test:80", f"{SERVERS[2]}:80", "other.test:80")
        assert got[:2] == ["server0", "server1"] and got[2] != "server2" and got[3] == "gaierror", got
        p = exposed.host_port
        forbidden = [
            "10.0.2.2:8080",  # slirp's "host" is the jail's loopback, not the host's
            f"10.0.2.2:{p}",
            f"{GATEWAY}:{p}",
            f"{GATEWAY}:8081",
            f"{UPLINK_HOST}:{p}",
            f"{UPLINK_HOST}:8081",
            f"{METADATA}:80",
        ]
        got = await fetch(u, *forbidden)
        assert not {"vm", "host-any", "host-loopback", "metadata"} & set(got), got

        # UDP exposure (restricted slirp drops UDP replies; outbound does not)
        echo = (
            "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('0.0.0.0', 9999))\n"
            "while True:\n d, a = s.recvfrom(2048); s.sendto(b'echo:' + d, a)"
        )
        await sh(u, f'(python3 -c "{echo}" >/dev/null 2>&1 &)')
        sdk = AsyncSandbox("u", socket=lab.work.socket)
        host_port = await sdk.expose(9999, udp=True)
        assert await sdk.expose(9999, udp=True) == host_port  # idempotent
        (pm,) = u.ports()
        assert pm == PortSpec(9999, host_port, Protocol.UDP)
        argv = [sys.executable, "-m", "supervisor.main.cli", "port", "ls", "u", "--json"]
        done = await trio.run_process(argv, env=env, capture_stdout=True, check=True)
        assert json.loads(done.stdout) == [
            {"sandbox_port": 9999, "host_port": host_port, "protocol": "udp", "host_address": "127.0.0.1"}
        ]
        client = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
        with client, trio.fail_after(60):
            await client.connect(("127.0.0.1", pm.host_port))
            while True:
                await client.send(b"ping")
                with trio.move_on_after(1):
                    assert await client.recv(100) == b"echo:ping"
                    break


# -- hostile DNS from a guest (one query used to stop every sandbox) ----------------
# run in the guest: crafted queries to the gateway over UDP, then over one TCP connection,
# then a normal one; prints {case: [reply hex or null, ...]} (null: no answer in 2 s)
CRAFTED_DNS = r"""
import json, random, socket, struct, sys
gw, name = sys.argv[1], sys.argv[2].encode()
H = struct.Struct("!HHHHHH")
Q = struct.pack("!HH", 1, 1)
W = b"".join(bytes([len(x)]) + x for x in name.split(b".")) + b"\0"  # the name on the wire
rnd = random.Random(21)
cases = {
    "nonascii": H.pack(1, 0x100, 1, 0, 0, 0) + b"\x01\xff" + W + Q,
    "dotted": H.pack(2, 0x100, 1, 0, 0, 0) + b"\x03a.b" + W + Q,
    "loop": H.pack(3, 0x100, 1, 0, 0, 0) + b"\xc0\x0c" + Q,
    "past-end": H.pack(4, 0x100, 1, 0, 0, 0) + b"\x01x\xff\xff" + Q,
    "truncated": H.pack(5, 0x100, 1, 0, 0, 0) + b"\x07exam",
    "counts": H.pack(6, 0x100, 0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF),
    "short": b"\x00\x07\x01",
    "random": bytes(rnd.getrandbits(8) for _ in range(300)),
}
out = {}
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.settimeout(2)
u.connect((gw, 53))
for case, data in cases.items():
    u.send(data)
    try:
        out[case] = [u.recv(4096).hex()]
    except socket.timeout:
        out[case] = [None]
t = socket.create_connection((gw, 53), timeout=5)
for case, data in cases.items():
    if len(data) < 12:
        continue  # (silence over TCP is a closed connection: the last case)
    t.sendall(len(data).to_bytes(2, "big") + data)
    buf = b""
    while len(buf) < 2 or len(buf) < 2 + int.from_bytes(buf[:2], "big"):
        chunk = t.recv(65536)
        if not chunk:
            break
        buf += chunk
    out[case].append(buf[2:].hex() if len(buf) >= 2 else None)
t.close()
u.send(H.pack(99, 0x100, 1, 0, 0, 0) + W + Q)
out["normal"] = [u.recv(4096).hex()]
print(json.dumps(out))
"""


async def hostile_dns_queries(lab: NetLab, reg: Registry, sb: Sandbox, others: tuple[Sandbox, ...]) -> None:
    """A tap guest (default deny, "allowed.test" allowed) sends its gateway crafted DNS
    queries (a 0xff label, a dotted label, a compression loop, a pointer past the end,
    a truncated question, huge counts, too short, random octets) over UDP and TCP: each
    gets a well-formed answer or none, a normal query is answered after them, and the
    supervisor, its proxy and the other sandboxes serve on."""
    hn = reg.settings.hostnet
    assert hn is not None
    await sb.guest_call(lambda g: g.channel.write_file("/tmp/dns.py", CRAFTED_DNS.encode()))
    replies = json.loads(await sh(sb, f"python3 /tmp/dns.py {GATEWAY} allowed.test"))
    sent = {"nonascii": 1, "dotted": 2, "loop": 3, "past-end": 4, "truncated": 5, "counts": 6, "random": None}
    for case, mid in sent.items():
        for raw in replies[case]:  # (UDP, TCP)
            assert raw is not None, (case, replies)
            msg = dnsmsg.parse(bytes.fromhex(raw))  # well-formed
            assert msg.is_response and (mid is None or msg.id == mid), (case, msg)
            want = dnsmsg.REFUSED if case in ("nonascii", "dotted") else dnsmsg.FORMERR
            assert msg.rcode == want, (case, msg)
    for raw in replies["nonascii"]:  # the question echoed octet for octet
        assert bytes.fromhex(raw)[12:] == b"\x01\xff\x07allowed\x04test\x00\x00\x01\x00\x01"
    assert replies["short"] == [None]  # nothing to answer with: silence
    (normal,) = replies["normal"]
    msg = dnsmsg.parse(bytes.fromhex(normal))
    assert msg.id == 99 and msg.rcode == dnsmsg.NOERROR
    assert [str(a) for a, _ in dnsmsg.answered_addresses(msg, "allowed.test")] == [SERVERS[1]]
    # the proxy and the supervisor serve on: nothing failed unforeseen, every sandbox runs
    assert not hn.dns_down and hn.dns.stats["errors"] == 0, hn.dns.stats
    assert all(reg.get(x.id).state == State.READY for x in (sb, *others))
    for other in others:
        await reach(lab.host, other.ip_address, 8000, f"vm {other.ip_address} {GATEWAY}")
    assert (await fetch(sb, "allowed.test:80")) == ["server1"]
