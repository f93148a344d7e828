"""Boot a guest: overlay disk, kernel command line, QEMU, guest channel, hello.

:func:`booted_guest` is the one way the project brings up a VM (the sandbox actor,
the tests and the benchmarks all use it). It owns, for the duration of its block,
the QEMU process (via :class:`~actors.machine.Machine`), the guest channel and the
qcow2 overlay in ``run_dir``; leaving the block -- normally, by error or by
cancellation -- powers the guest off through the shutdown ladder and reaps QEMU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

from actors._groups import collapse_single
from actors.guest import GuestChannel, HelloTimeout, open_channel
from actors.machine import LaunchError, Machine, MachineSpec, QemuUser, connect_guest_socket
from images.build import Image, host_tsc_khz

log = logging.getLogger("sandvisor.vm")

BASE_CMDLINE = "console=ttyS0 quiet panic=-1 pci=off i8042.noaux i8042.nomux i8042.nopnp"


class BootError(LaunchError):
    """The guest did not reach guestd's hello (QEMU died, or the boot timed out)."""

    def __init__(self, message: str, console: str = "") -> None:
        super().__init__(message)
        self.console = console


def kernel_cmdline(accel: str, *, root: bool = True, hostname: str = "sandbox", extra: str = "") -> str:
    parts = [BASE_CMDLINE]
    if accel == "tcg":
        khz = host_tsc_khz()
        if khz:
            parts.append(f"tsc_early_khz={khz}")  # TCG boots hang ~1 in 30 calibrating otherwise
    if root:
        parts.append("sandvisor.root=/dev/vda")
    parts.append(f"sandvisor.hostname={hostname}")
    if extra:
        parts.append(extra)
    return " ".join(parts)


async def create_overlay(base: Path, overlay: Path, *, size_mib: int | None = None) -> None:
    """A qcow2 overlay on a read-only base (raw or qcow2, detected by qemu-img)."""
    fmt = "qcow2" if _is_qcow2(base) else "raw"
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base.resolve()), "-F", fmt, str(overlay)]
    if size_mib:
        argv.append(f"{size_mib}M")
    p = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    if p.returncode != 0:
        raise LaunchError(f"qemu-img create failed: {p.stderr.decode(errors='replace').strip()}")


def _is_qcow2(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"QFI\xfb"


@attrs.frozen
class NetConfig:
    """User-mode networking (QEMU's slirp: no packet leaves the QEMU process by itself).
    ``restrict`` (the default) cuts the guest off from the host and the outside; only
    host forwards (exposed ports) reach it."""

    restrict: bool = True
    net: str = "10.0.2.0/24"
    address: str = "10.0.2.15"
    gateway: str = "10.0.2.2"
    dns: str = "10.0.2.3"
    prefix: int = 24


NETDEV_ID = "n0"


def netdev_args(net: NetConfig | None) -> tuple[str, ...]:
    if net is None:
        return ()
    restrict = "on" if net.restrict else "off"
    return (
        "-netdev",
        f"user,id={NETDEV_ID},net={net.net},host={net.gateway},dns={net.dns},restrict={restrict}",
        "-device",
        "{net},netdev=" + NETDEV_ID,
    )


def network_cmdline(net: NetConfig | None) -> str:
    if net is None:
        return ""
    return f"sandvisor.net={net.address}/{net.prefix},{net.gateway},{net.dns}"


@attrs.define
class Guest:
    """A booted VM: its machine, its channel, and boot timestamps (monotonic seconds)."""

    machine: Machine
    channel: GuestChannel
    t_launch: float
    t_qmp: float
    t_ready: float


@asynccontextmanager
async def booted_guest(
    image: Image,
    run_dir: Path,
    *,
    rootfs: Path | None = None,
    disk: bool = True,
    cpus: int = 1,
    memory_mib: int = 256,
    accel: str = "tcg",
    hostname: str = "sandbox",
    extra_cmdline: str = "",
    boot_timeout: float = 60.0,
    machine: str = "microvm",
    sandbox: bool = True,
    user: QemuUser | None = None,
    extra_ports: tuple[str, ...] = (),
    network: NetConfig | None = None,
    disk_path: Path | None = None,
    kernel: Path | None = None,
) -> AsyncIterator[Guest]:
    """``disk_path``: where the overlay lives (default ``run_dir/disk.qcow2``); an existing
    overlay there is booted as is (a stopped sandbox started again keeps its disk)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    overlay = None
    if disk:
        overlay = disk_path or run_dir / "disk.qcow2"
        if not overlay.exists():
            await create_overlay(rootfs or image.rootfs, overlay)
    spec = MachineSpec(
        kernel=kernel or (image.kernel if machine == "microvm" else image.kernel_bz),
        initrd=image.initrd,
        disk=overlay,
        cpus=cpus,
        memory_mib=memory_mib,
        append=kernel_cmdline(
            accel,
            root=disk,
            hostname=hostname,
            extra=" ".join(x for x in (network_cmdline(network), extra_cmdline) if x),
        ),
        accel=accel,
        machine=machine,
        sandbox=sandbox,
        user=user,
        disk_backing=(rootfs or image.rootfs) if disk else None,
        extra_ports=extra_ports,
        netdev=netdev_args(network),
    )
    vm = Machine(spec, run_dir, name=hostname)
    t0 = time.monotonic()
    with collapse_single():
        async with trio.open_nursery() as nursery:
            await nursery.start(vm.run)
            t_qmp = time.monotonic()
            try:
                stream = None
                with trio.CancelScope() as boot_scope:

                    async def watch_exit() -> None:
                        await vm.wait()
                        boot_scope.cancel()

                    nursery.start_soon(watch_exit)
                    stream = await connect_guest_socket(vm.guest_socket)
                if stream is None or vm.exited:
                    raise BootError(f"QEMU exited during boot: {vm.describe_exit()}", vm.console.text())
                async with open_channel(stream, hello_timeout=None) as chan:
                    with trio.CancelScope() as hello_scope:

                        async def watch_exit_hello() -> None:
                            await vm.wait()
                            hello_scope.cancel()

                        nursery.start_soon(watch_exit_hello)
                        try:
                            await chan.hello(boot_timeout)
                        except HelloTimeout:
                            raise BootError(
                                f"guest did not become ready within {boot_timeout:g}s", vm.console.text()
                            ) from None
                    if chan.hello_info is None:
                        raise BootError(f"QEMU exited during boot: {vm.describe_exit()}", vm.console.text())
                    guest = Guest(vm, chan, t0, t_qmp, time.monotonic())
                    try:
                        yield guest
                    finally:
                        await vm.shutdown(ask=chan.shutdown if not chan.broken else None)
            finally:
                await vm.shutdown()
                nursery.cancel_scope.cancel()
