"""Tap networking with a real VM: the default image booted on a TAP that HostNetwork
made in the lab's "host" namespace (tests/netlab.py), QEMU given the TAP's fd.

MachineSpec passes only the files it opens itself to QEMU; :class:`TapSpec` (local to
the tests until the lead wires a ``net_fds`` field into actors/machine.py) adds the
TAP's fd and puts its number into the -netdev argument."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from actors.disk import backing_chain, create_overlay
from actors.egress import EgressPolicy
from actors.hostnet import SandboxLink
from actors.ippool import link_name
from actors.machine import Machine, MachineSpec
from actors.vm import Guest, _running, kernel_cmdline
from images.build import Image
from tests.netlab import SERVERS, UPLINK_HOST, Lab, lab_env, probe

pytestmark = [pytest.mark.vm, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, TAP)")]

CONNECT = "import socket,sys; print(socket.create_connection((sys.argv[1], 80), timeout=5).recv(99).decode().strip())"
SNIPPET = Path(__file__).resolve().parent.parent / "contrib" / "guestd_netcfg.py"
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(16)
while True:
    c, peer = s.accept()
    c.sendall(("vm " + peer[0] + "\\n").encode()); c.close()
"""


@attrs.frozen
class TapSpec(MachineSpec):
    """A MachineSpec whose -netdev names a TAP fd: ``{tapfd}`` in ``netdev`` becomes the
    number QEMU inherits it under."""

    tap_fd: int = -1

    def open_files(self) -> dict[str, int]:
        fds = super().open_files()
        fds["tap"] = os.dup(self.tap_fd)  # Machine closes what it passed after the launch
        return fds

    def argv(self, run_dir: Path, qmp_fd: int, console_fd: int, fds: dict[str, int] | None = None) -> list[str]:
        a = super().argv(run_dir, qmp_fd, console_fd, fds)
        return [x.replace("{tapfd}", str((fds or {})["tap"])) for x in a]


@asynccontextmanager
async def tap_vm(image: Image, run_dir: Path, link: SandboxLink) -> AsyncIterator[Guest]:
    run_dir.mkdir(parents=True, exist_ok=True)
    overlay = run_dir / "disk.qcow2"
    await create_overlay(image.rootfs, overlay)
    assert link.tap_fd is not None
    spec = TapSpec(
        kernel=image.kernel,
        initrd=image.initrd,
        disk=overlay,
        disk_chain=backing_chain(overlay),
        memory_mib=256,
        append=kernel_cmdline("tcg", hostname="tapvm", extra=link.guest.cmdline()),
        netdev=link.netdev_args("{tapfd}"),  # type: ignore[arg-type]
        tap_fd=link.tap_fd,
    )
    vm = Machine(spec, run_dir, name="tapvm")
    async with _running(vm, time.monotonic(), 90.0, None) as guest:
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


async def test_tap_vm_reached_at_its_address_and_filtered(image: Image, tmp_path: Path, qmp: None) -> None:
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


async def test_guest_reconfigured_in_place_as_after_a_restore(image: Image, tmp_path: Path, qmp: None) -> None:
    """The guest side of a restore: contrib/guestd_netcfg.py run in the real guest moves
    eth0 to a new address and MAC; the host re-keys the link; the host reaches the new
    address and the old one is gone."""
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
                    await guest.channel.write_file("/tmp/netcfg.py", SNIPPET.read_bytes())
                    args = f"eth0 {g.address} {g.prefix} {g.gateway} {g.mac} {g.dns}"
                    await sh(guest, f"python3 /tmp/netcfg.py {args}")
                    await wait_probe(lab, str(new), 8000, f"vm {lab.pool.gateway}")
                    assert await probe(lab.host, str(old), 8000, timeout=1) != f"vm {lab.pool.gateway}"
                    assert (await sh(guest, "cat /sys/class/net/eth0/address")).strip() == g.mac
                    # and the guest reaches the outside from its new address (masqueraded)
                    assert await sh(guest, f'python3 -c "{CONNECT}" {SERVERS[0]}') == f"server0 {UPLINK_HOST}\n"
        finally:
            link.close()
