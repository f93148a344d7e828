"""Tap networking with a real VM, below the supervisor: the default image booted on a
TAP that HostNetwork made in the lab's "host" namespace (tests/support/netlab.py), QEMU given
the TAP's fd the way a sandbox life gives it (VmSpec's tap NetConfig, Attach.fds),
and guestd's net_config moving the guest to a new address as after a restore. The
whole supervisor's side is in tests/vm/test_net_supervisor.py."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.channel.guest import GuestOpError
from actors.machines.disk import create_overlay
from actors.machines.machine import Placement
from actors.machines.vm import TAP_FD, Attach, Guest, NetConfig, VmSpec, booted_guest
from actors.net.egress import EgressPolicy
from actors.net.hostnet import SandboxLink
from actors.net.ippool import link_name
from guestd import proto
from images.build import Image
from tests.support.netlab import CLOUD_METADATA, LAN, SERVERS, UPLINK_HOST, Lab, lab_env, probe, tcp_server

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, TAP)")

CONNECT = "import socket,sys; print(socket.create_connection((sys.argv[1], 80), timeout=5).recv(99).decode().strip())"
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
while True:
    c, peer = s.accept()
    c.sendall(("vm " + peer[0] + "\\n").encode()); c.close()
"""


def tap_net(link: SandboxLink) -> NetConfig:
    g = link.guest
    return NetConfig(
        restrict=False,
        address=str(g.address),
        gateway=str(g.gateway),
        dns=str(g.dns),
        prefix=g.prefix,
        tap=True,
        mac=g.mac,
        tap_name=link.name,
    )


@asynccontextmanager
async def tap_vm(image: Image, run_dir: Path, link: SandboxLink) -> AsyncIterator[Guest]:
    run_dir.mkdir(parents=True, exist_ok=True)
    overlay = run_dir / "disk.qcow2"
    await create_overlay(image.rootfs, overlay)
    assert link.tap_fd is not None
    spec = VmSpec.boot(image, disk=overlay, hostname="tapvm", network=tap_net(link), boot_timeout=90.0)
    async with booted_guest(spec, Attach(Placement.plain(run_dir), fds={TAP_FD: link.tap_fd})) as guest:
        yield guest


async def sh(guest: Guest, script: str, **kw: Any) -> str:
    res = await guest.channel.run(["sh", "-c", script], **kw)
    assert res.exit_code == 0, (res.stdout, res.stderr)
    return res.stdout.decode()


async def start_server(guest: Guest, port: int) -> None:
    await guest.channel.write_file("/tmp/srv.py", SERVER.encode())
    await sh(guest, f"python3 /tmp/srv.py {port} >/dev/null 2>&1 &")


async def wait_probe(lab: Lab, address: str, port: int, want: str) -> str:
    with trio.fail_after(60):
        while (got := await probe(lab.host, address, port)) != want:
            await trio.sleep(0.3)
    return got


async def test_tap_vm_reached_at_its_address_and_filtered(image: Image, tmp_path: Path) -> None:
    async with lab_env() as lab:
        address = lab.pool.allocate("vm-1")
        policy = EgressPolicy.parse({"default": "deny", "allow": [SERVERS[0], "allowed.test"]})
        link = lab.net.open_tap(link_name("vm-1"), address, policy)
        try:
            with trio.fail_after(240):
                async with tap_vm(image, tmp_path / "run", link) as guest:
                    await start_server(guest, 8000)
                    # the host reaches the sandbox at its pool address
                    await wait_probe(lab, str(address), 8000, f"vm {lab.pool.gateway}")
                    # the guest's resolver is the proxy (init wrote resolv.conf from sandvisor.net)
                    got = await sh(guest, "cat /etc/resolv.conf")
                    assert got.strip() == f"nameserver {lab.pool.gateway}"
                    fetch = (
                        "import socket,sys\n"
                        "def get(h):\n"
                        "  try:\n"
                        "    s=socket.create_connection((h,80),timeout=3); return s.recv(100).decode().split()[0]\n"
                        "  except OSError as e: return type(e).__name__\n"
                        "print(get(sys.argv[1]))\n"
                    )
                    await guest.channel.write_file("/tmp/fetch.py", fetch.encode())
                    run = "python3 /tmp/fetch.py"
                    assert (await sh(guest, f"{run} {SERVERS[0]}")).strip() == "server0"  # allowed CIDR
                    assert (await sh(guest, f"{run} allowed.test")).strip() == "server1"  # allowed name
                    assert (await sh(guest, f"{run} other.test")).strip() == "gaierror"  # refused name
                    assert (await sh(guest, f"{run} {SERVERS[2]}")).strip() != "server2"  # not allowed
                    assert (await sh(guest, f"{run} 169.254.169.254")).strip() != "metadata"
                    assert (await sh(guest, f"{run} {UPLINK_HOST}")).strip() != "host"
        finally:
            link.close()


FETCH = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
    print(s.recv(100).decode().split()[0])
except OSError as e:
    print(type(e).__name__)
"""


async def test_vm_port_allow_and_default_allow_stay_off_sandboxes_and_private_ranges(
    image: Image, tmp_path: Path
) -> None:
    """A VM allowed 0.0.0.0/0:8080 reaches the internet's 8080 but not another sandbox's
    8080 nor a LAN's; under default allow it reaches the internet, not a private
    address (RFC 1918, cloud metadata at 100.100.100.200), not even through a name
    that answers one (rebinding)."""
    async with lab_env() as lab:
        other = lab.guest("other")  # another sandbox (a veth guest), serving 8080
        await lab.nursery.start(tcp_server, other.ns, "0.0.0.0", 8080, "other-sandbox")
        await lab.nursery.start(tcp_server, lab.inet, SERVERS[0], 8080, "public-8080")
        await lab.nursery.start(tcp_server, lab.inet, LAN, 8080, "lan-8080")
        address = lab.pool.allocate("vm-p")
        policy = EgressPolicy.parse({"default": "deny", "allow": ["0.0.0.0/0:8080"]})
        link = lab.net.open_tap(link_name("vm-p"), address, policy)
        try:
            with trio.fail_after(240):
                async with tap_vm(image, tmp_path / "run", link) as guest:
                    await guest.channel.write_file("/tmp/fetch.py", FETCH.encode())

                    async def get(target: str, port: int) -> str:
                        return (await sh(guest, f"python3 /tmp/fetch.py {target} {port}")).strip()

                    assert await get(SERVERS[0], 8080) == "public-8080"
                    assert await get(other.address, 8080) != "other-sandbox"
                    assert await get(LAN, 8080) != "lan-8080"
                    assert await get(SERVERS[0], 80) != "server0"  # the port is all it allows
                    link.set_policy(EgressPolicy.parse({"default": "allow", "allow": ["rebind.test"]}))
                    assert await get(SERVERS[1], 80) == "server1"  # default allow: the internet
                    assert await get(LAN, 80) != "lan"
                    assert await get(CLOUD_METADATA, 80) != "cloud-metadata"
                    assert await get(other.address, 8080) != "other-sandbox"
                    assert await get("rebind.test", 80) != "lan"  # resolved, and still closed
        finally:
            link.close()


async def test_guest_reconfigured_in_place_as_after_a_restore(image: Image, tmp_path: Path) -> None:
    """The guest side of a restore: guestd's net_config moves eth0 to a new address and
    MAC; the host re-keys the link; the host reaches the new address and the old one is
    gone; a bad request is INVALID_ARGUMENT and changes nothing."""
    async with lab_env() as lab:
        old = lab.pool.allocate("vm-2")
        link = lab.net.open_tap(link_name("vm-2"), old, EgressPolicy.parse(None))
        try:
            with trio.fail_after(240):
                async with tap_vm(image, tmp_path / "run", link) as guest:
                    await start_server(guest, 8000)
                    await wait_probe(lab, str(old), 8000, f"vm {lab.pool.gateway}")
                    # the host side: the same TAP under a new address (a restore makes a new TAP)
                    new = lab.pool.allocate("vm-2-clone")
                    fd, link.tap_fd = link.tap_fd, None
                    link.close()
                    lab.host.ip(f"addr flush dev {link.name}")
                    link = lab.net._configure(link.name, new, EgressPolicy.parse(None), fd)
                    g = link.guest
                    await guest.channel.net_config(str(g.address), g.prefix, str(g.gateway), [str(g.dns)], g.mac)
                    await wait_probe(lab, str(new), 8000, f"vm {lab.pool.gateway}")
                    assert await probe(lab.host, str(old), 8000, timeout=1) != f"vm {lab.pool.gateway}"
                    assert (await sh(guest, "cat /sys/class/net/eth0/address")).strip() == g.mac
                    assert (await sh(guest, "cat /etc/resolv.conf")) == f"nameserver {g.dns}\n"
                    with pytest.raises(GuestOpError) as bad:
                        await guest.channel.net_config("10.88.0.300", 16, str(g.gateway), [])
                    assert bad.value.code == proto.E_INVALID
                    await wait_probe(lab, str(new), 8000, f"vm {lab.pool.gateway}")
                    # and the guest reaches the outside from its new address (masqueraded)
                    assert await sh(guest, f'python3 -c "{CONNECT}" {SERVERS[0]}') == f"server0 {UPLINK_HOST}\n"
        finally:
            link.close()
